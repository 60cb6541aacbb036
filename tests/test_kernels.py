"""The fast paths behind one protocol (tunesmith.kernels): each one applied then undone leaves the model's forward
the untouched model's bit for bit, and applied it gives the plain path's loss and LoRA gradients within its stated
tolerance; the registry; which paths a run takes; and what training with them says and does. Each path's own
invariants are in tests/test_kernels_<path>.py."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tunesmith import kernels
from tunesmith.config import TrainConfig
from tunesmith.evaluate import loss_sum
from tunesmith.kernels import compiled, liger, liger_loss, lora, lora_mlp, loss, nf4, offload, qkv, recompute
from tunesmith.kernels.base import Setting, replaced_by
from tunesmith.train import train

from .conftest import make_model, tiny_train_config
from .kernel_fixtures import (
    eager_aot_compile,
    install_fake_liger,
    lora_model,
    make_batch,
    protocol_check,
    qlora_model,
    relative_error,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_liger(monkeypatch):
    return install_fake_liger(monkeypatch)


# ------------------------------------------------------------------------------------------------ the protocol

# Where each path is taken (device, config). The CUDA paths run on the CPU model as they would on CUDA, through
# their references: Liger's stand-ins (fake_liger), the LoRA-aware MLP's PyTorch reference, the RoPE kernel's.
SETTINGS = {
    liger_loss.PATH.name: ("cuda", {"compile": "off"}),  # Liger's kernel under Triton's interpreter (LIGER_ON_CPU)
    loss.PATH.name: ("cpu", {}),
    liger.PATH.name: ("cuda", {"compile": "off"}),  # (CUDA graphs would keep Liger out)
    qkv.PATH.name: ("cpu", {}),
    lora_mlp.PATH.name: ("cuda", {"compile": "off"}),
    lora.PATH.name: ("cpu", {}),
    nf4.PATH.name: ("cuda", {"compile": "off", "quantize_base": "nf4"}),  # on a QLoRA model, the op's reference
    compiled.PATH.name: ("cpu", {"compile": "on"}),
    recompute.PATH.name: ("cpu", {}),
    offload.PATH.name: ("cpu", {"gradient_checkpointing": "offload"}),  # kept on the device there
}

LIGER_LOSS_PROTOCOL = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.conftest import make_tokenizer
from tests.kernel_fixtures import protocol_check
from tunesmith.config import TrainConfig
from tunesmith.kernels import liger_loss
from tunesmith.kernels.base import Setting
liger_loss.LIGER_ON_CPU = True  # Liger's kernels on CPU tensors, run by Triton's interpreter
print(json.dumps(protocol_check(liger_loss.PATH, Setting(TrainConfig(compile="off"), "cuda"), make_tokenizer())))
"""


def _setting(path) -> Setting:
    device, cfg = SETTINGS[path.name]
    return Setting(TrainConfig(lora_dropout=0.0, **cfg), device)


def test_every_path_has_a_protocol_case():
    assert sorted(SETTINGS) == sorted(p.name for p in kernels.PATHS)
    assert all(0 <= p.tolerance < 0.1 for p in kernels.PATHS)


@pytest.mark.parametrize("path", kernels.PATHS, ids=lambda p: p.name)
def test_a_path_applied_then_undone_leaves_the_forward_bitwise_and_applied_follows_the_plain_gradients(
        path, tokenizer, monkeypatch):
    if path is liger_loss.PATH:
        pytest.importorskip("triton")
        pytest.importorskip("liger_kernel")
        # Triton's interpreter is chosen when a kernel is defined: a process of its own
        out = subprocess.run([sys.executable, "-c", LIGER_LOSS_PROTOCOL, str(ROOT)], capture_output=True, text=True,
                             env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.splitlines()[-1])
    else:
        install_fake_liger(monkeypatch)
        monkeypatch.setattr(lora_mlp, "triton_available", lambda: True)  # its reference serves the CPU
        monkeypatch.setattr(nf4, "triton_available", lambda: True)
        monkeypatch.setattr(qkv, "ROPE_ON_CPU", True)  # the RoPE kernel's reference, as CUDA takes the kernel
        eager_aot_compile(monkeypatch)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        result = protocol_check(path, _setting(path), tokenizer, qlora_model if path is nf4.PATH else None)
        # the compiled layers did run compiled: dynamo captured them
        assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0) is (path is compiled.PATH)
        torch._dynamo.reset()
    assert result["applies"] and result["label"]  # the setting takes it, and it found something to change
    assert result["bitwise"], "the forward after undo is not the untouched model's"
    assert result["left"] == {}
    assert result["loss"] <= path.tolerance
    assert result["grads"] is not None and len(result["grads"]) == 2 * 7 * 2  # A and B of 7 linears x 2 layers
    worst = max(result["grads"], key=result["grads"].get)
    assert result["grads"][worst] <= path.tolerance, (worst, result["grads"][worst])


@pytest.mark.parametrize("device", ["cpu", "mps", "cuda"])
def test_fast_paths_off_takes_no_path(device, tokenizer, fake_liger, monkeypatch):
    monkeypatch.setattr(lora_mlp, "triton_available", lambda: True)
    model = lora_model(tokenizer)
    setting = Setting(TrainConfig(fast_paths="off"), device)
    assert [p.name for p in kernels.PATHS if p.applies(setting, model)] == []
    assert kernels.apply_paths(model, setting).paths == []


def _logits(model, batch):
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        return model.eval()(**inputs, use_cache=False).logits


def _forwards(model):
    return {n: sorted(k for k in vars(m) if k == "forward" or "tunesmith" in k) for n, m in model.named_modules()}


def test_the_registry_applies_what_a_cpu_run_takes_and_undoes_it_bitwise(tokenizer):
    model = lora_model(tokenizer, rank=8)
    untouched, before = copy.deepcopy(model), _forwards(model)
    batch = make_batch(tokenizer)
    applied = kernels.apply_paths(model, Setting(TrainConfig(lora_dropout=0.0), "cpu"))
    assert applied.paths == [loss.PATH, qkv.PATH, lora.PATH, recompute.PATH]
    assert applied.labels == ["fused loss", "fused q/k/v", "fused LoRA", "cheap activations recomputed"]
    assert applied.loss is loss.chunked_loss_sum and applied.took(lora.PATH) and not applied.took(compiled.PATH)
    total, n = applied.loss(model.train(), batch)
    want, want_n = loss_sum(untouched.train(), batch)
    assert n == want_n and relative_error(total.detach(), want.detach()) <= 1e-5
    assert applied.undo(model) is model and applied.paths == [] and applied.labels == []
    assert torch.equal(_logits(model, batch), _logits(untouched, batch))
    assert _forwards(model) == before


def test_paths_stacked_on_one_module_undo_in_reverse_order(tokenizer, fake_liger, monkeypatch):
    """Liger's SwiGLU, then the LoRA-aware MLP over it on the same MLP: undoing the MLP path brings Liger's forward
    back, undoing Liger the module's own; the registry does both, last first."""
    monkeypatch.setattr(lora_mlp, "triton_available", lambda: True)
    model = lora_model(tokenizer, rank=8)
    untouched, before = copy.deepcopy(model), _forwards(model)
    batch = make_batch(tokenizer)
    applied = kernels.apply_paths(model, Setting(TrainConfig(lora_dropout=0.0, compile="off"), "cuda"))
    # recompute finds nothing left to replace: Liger's norms and the MLP paths are there first
    assert applied.paths == [liger_loss.PATH, liger.PATH, qkv.PATH, lora_mlp.PATH, lora.PATH]
    mlp = model.base_model.model.model.layers[0].mlp
    assert [owner for owner, _ in vars(mlp)["_tunesmith_forwards"]] == [liger.PATH.name, lora_mlp.PATH.name]
    swiglu = fake_liger["swiglu"]
    _logits(model, batch)
    assert fake_liger["swiglu"] == swiglu  # the LoRA-aware MLP runs, not Liger's SwiGLU beneath it
    lora_mlp.PATH.undo(model)
    assert replaced_by(mlp) == liger.PATH.name
    _logits(model, batch)
    assert fake_liger["swiglu"] == swiglu + 2  # Liger's SwiGLU again, in both layers
    applied.paths.remove(lora_mlp.PATH)
    applied.undo(model)
    assert _forwards(model) == before
    assert torch.equal(_logits(model, batch), _logits(untouched, batch))
    import transformers.models.llama.modeling_llama as modeling

    assert not getattr(modeling.apply_rotary_pos_emb, "_tunesmith_liger", False)  # transformers' RoPE back


# ------------------------------------------------------------------------------------------------ which paths


@pytest.mark.parametrize(("changes", "device", "world", "fsdp", "expected"), [
    ({}, "cuda", 1, False, (True, True, False)),  # one GPU: compiled layers replayed as graphs, no Liger
    ({}, "cpu", 1, False, (False, False, False)),
    ({}, "mps", 1, False, (False, False, False)),
    ({}, "cuda", 2, False, (True, False, True)),  # several processes: no graphs
    ({}, "cuda", 2, True, (False, False, True)),  # FSDP2 stays eager
    ({"gradient_checkpointing": True}, "cuda", 1, False, (True, False, True)),
    ({"quantize_base": "nf4"}, "cuda", 1, False, (True, False, True)),
    ({"fine_tune_type": "dora"}, "cuda", 1, False, (True, False, True)),
    ({"fine_tune_type": "full"}, "cuda", 1, False, (True, False, True)),
    ({"fast_paths": "off"}, "cuda", 1, False, (False, False, False)),
    ({"compile": "off"}, "cuda", 1, False, (False, False, True)),
    ({"compile": "on"}, "cpu", 1, False, (True, False, False)),
    ({"varied": True}, "cuda", 1, False, (True, False, True)),  # records of many lengths: no graph per shape
])
def test_cuda_graphs_go_where_layers_are_compiled_on_one_gpu_and_liger_gives_way(changes, device, world, fsdp,
                                                                                  expected, tokenizer, monkeypatch):
    varied = changes.pop("varied", False)
    setting = Setting(TrainConfig(**changes), device, world, fsdp, varied)
    model = make_model(tokenizer)
    assert (setting.compiled, setting.graphs, liger.PATH.wanted(setting, model)) == expected
    assert compiled.PATH.applies(setting, model) is expected[0]
    for available in (True, False):
        monkeypatch.setattr(liger, "liger_available", lambda a=available: a)
        assert liger.PATH.applies(setting, model) is (expected[2] and available)


def test_liger_is_wanted_for_llama_family_models_only(tokenizer):
    model = make_model(tokenizer)
    setting = Setting(TrainConfig(compile="off"), "cuda")
    assert liger.PATH.wanted(setting, model)
    model.config.model_type = "gemma3_text"
    assert not liger.PATH.wanted(setting, model)


def test_the_liger_loss_is_chosen_on_cuda_with_liger_installed_and_not_under_fsdp(tokenizer, monkeypatch):
    model = make_model(tokenizer)
    monkeypatch.setattr(liger_loss, "liger_available", lambda: True)
    both = (liger_loss.PATH, loss.PATH)

    def chosen(device="cuda", fsdp=False, **cfg):
        setting = Setting(TrainConfig(**cfg), device, fsdp=fsdp)
        taken = kernels.apply_paths(model, setting, paths=both).paths
        assert len(taken) <= 1  # one loss or the other, never both
        return taken[0] if taken else None

    assert chosen() is liger_loss.PATH
    assert chosen("cpu") is chosen("mps") is loss.PATH
    assert chosen(fsdp=True) is loss.PATH  # FSDP2: the plain chunks
    assert chosen(fast_paths="off") is None
    monkeypatch.setattr(liger_loss, "liger_available", lambda: False)
    assert chosen() is loss.PATH
    # the start line says which loss runs
    monkeypatch.setattr(liger_loss, "liger_available", lambda: True)
    cuda = kernels.apply_paths(model, Setting(TrainConfig(), "cuda"), paths=both)
    assert cuda.labels == ["fused loss (Liger's kernel)"]
    assert cuda.loss.keywords == {"cross_entropy": liger_loss.linear_cross_entropy_sum}
    assert kernels.apply_paths(model, Setting(TrainConfig(), "cpu"), paths=both).labels == ["fused loss"]


def test_a_model_whose_output_layer_has_lora_takes_no_fused_loss(tokenizer, monkeypatch):
    monkeypatch.setattr(liger_loss, "liger_available", lambda: True)
    model = lora_model(tokenizer, targets=("q_proj", "lm_head"))
    for device in ("cpu", "cuda"):
        setting = Setting(TrainConfig(), device)
        assert not loss.PATH.applies(setting, model) and not liger_loss.PATH.applies(setting, model)


@pytest.mark.parametrize(("changes", "device", "triton", "fsdp", "expected"), [
    ({}, "cuda", True, False, True), ({}, "cuda", False, False, False), ({}, "cpu", True, False, False),
    ({}, "mps", True, False, False), ({"fast_paths": "off"}, "cuda", True, False, False),
    ({}, "cuda", True, True, False), ({"fine_tune_type": "dora"}, "cuda", True, False, False)])
def test_the_lora_aware_mlp_is_chosen_on_cuda_with_triton(changes, device, triton, fsdp, expected, tokenizer,
                                                          monkeypatch):
    monkeypatch.setattr(lora_mlp, "triton_available", lambda: triton)
    setting = Setting(TrainConfig(**changes), device, fsdp=fsdp)
    assert lora_mlp.PATH.applies(setting, make_model(tokenizer)) is expected


@pytest.mark.parametrize(("changes", "device", "fsdp", "expected"), [
    ({}, "cpu", False, (True, True, True)),  # eager layers: fused LoRA and lean layers
    ({}, "cuda", False, (True, False, True)),  # compiled: the compiler fuses PEFT's path, and recomputes
    ({"compile": "off"}, "cuda", False, (True, True, True)),
    ({}, "cuda", True, (False, False, False)),  # FSDP2
    ({"recompute": False}, "cpu", False, (True, True, False)),
    ({"fine_tune_type": "full"}, "cpu", False, (False, False, True)),
])
def test_the_lora_paths_go_where_plain_lora_runs_and_recompute_where_layers_are_reached(changes, device, fsdp,
                                                                                       expected, tokenizer):
    setting = Setting(TrainConfig(**changes), device, fsdp=fsdp)
    model = make_model(tokenizer)
    assert (qkv.PATH.applies(setting, model), lora.PATH.applies(setting, model),
            recompute.PATH.applies(setting, model)) == expected


# ------------------------------------------------------------------------------------------------ training


def test_fifty_steps_with_the_fast_paths_follow_the_plain_losses(tmp_path, tiny_dir, text_file):
    """Acceptance: the fast paths' 50 losses within 1% of the plain path's (same seed, same data)."""
    runs = {}
    for fast_paths in ("off", "auto"):  # auto on the CPU: the fused loss, fused LoRA, recomputation
        cfg = tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / fast_paths), max_steps=50,
                                fast_paths=fast_paths, lora_dropout=0.05, lr=5e-3)
        runs[fast_paths] = train(cfg, progress=False).losses
    assert len(runs["auto"]) == 50
    assert runs["auto"] == pytest.approx(runs["off"], rel=1e-2)
    assert runs["auto"][0] == pytest.approx(runs["off"][0], rel=1e-5)


def test_a_nan_through_the_fused_loss_is_skipped_like_any_other(tmp_path, text_file, tokenizer):
    from tunesmith.data import load_data

    model, calls = make_model(tokenizer), {"n": 0}

    def poison(module, args, output):  # the final norm's output at step 3's forward: a NaN loss
        calls["n"] += module.training
        return output * float("nan") if module.training and calls["n"] == 3 else None

    model.model.norm.register_forward_hook(poison)
    cfg = tiny_train_config(tmp_path, "injected", text_file, max_steps=5, lora_dropout=0.0)
    r = train(cfg, model=model, tokenizer=tokenizer, data=load_data(str(text_file), tokenizer, cfg.seq_len),
              progress=False)
    rows = [json.loads(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["loss"]) for row in rows if row["kind"] == "skip"] == [(3, "nan")]
    assert len(r.losses) == 4 and all(math.isfinite(x) for x in r.losses)


def test_the_start_line_names_the_fast_paths_and_off_takes_none(tmp_path, tiny_dir, text_file, capsys):
    on = train(tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=1, lora_dropout=0.0,
                                 lora_targets=["all-linear"]), progress=True)
    err = capsys.readouterr().err
    assert "; fused loss, fused q/k/v, fused LoRA, cheap activations recomputed" in err
    off = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "b"), max_steps=1,
                                  lora_dropout=0.0, lora_targets=["all-linear"], fast_paths="off"), progress=True)
    err = capsys.readouterr().err
    assert not any(label in err for label in ("fused", "Liger", "compiled", "recomputed", "packed")), err
    assert on.losses == pytest.approx(off.losses, rel=1e-5)
    for r in (on, off):  # the returned model runs the library's own forwards
        assert not any("forward" in vars(m) or "_tunesmith_forwards" in vars(m) for m in r.model.modules())


def test_liger_is_not_applied_off_cuda_and_its_absence_is_quiet_there(tmp_path, tiny_dir, text_file, capsys):
    train(tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=1), progress=True)
    assert "liger" not in capsys.readouterr().err.lower()


@pytest.mark.parametrize("fast_paths", ["auto", "off"])
def test_training_builds_no_kv_cache(tmp_path, tiny_dir, text_file, monkeypatch, fast_paths):
    """A cache is useless in training, and with --compile each layer's own cache object made the compiled layer
    recompile per layer until torch gave up (8 recompiles) and ran the rest eagerly."""
    from transformers import cache_utils

    made = []
    original = cache_utils.DynamicCache.__init__

    def counting(self, *args, **kwargs):
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicCache, "__init__", counting)
    r = train(tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=2, eval_every=1, fast_paths=fast_paths),
              progress=False)
    assert r.steps == 2 and len(r.evals) == 2 and made == []


def test_train_reports_the_fused_lora_and_without_it_trains_the_same(tmp_path, tiny_dir, text_file, capsys,
                                                                    monkeypatch):
    on = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "on"), max_steps=2),
               progress=True)  # auto, on the CPU with eager layers: on
    assert "fused LoRA" in "".join(capsys.readouterr())
    monkeypatch.setattr(lora.FusedLora, "applies", lambda self, s, m: False)
    off = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "off"), max_steps=2),
                progress=True)
    assert "fused LoRA" not in "".join(capsys.readouterr())
    assert on.losses == pytest.approx(off.losses, rel=1e-5)


def test_train_reports_fused_qkv_and_without_it_trains_the_same(tmp_path, tiny_dir, text_file, capsys, monkeypatch):
    kw = dict(max_steps=3, lora_dropout=0.0, lora_targets=["all-linear"])
    on = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "on"), **kw), progress=True)
    assert "fused q/k/v" in "".join(capsys.readouterr())
    monkeypatch.setattr(qkv.FusedQkv, "applies", lambda self, s, m: False)
    off = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "off"), **kw), progress=True)
    assert "fused q/k/v" not in "".join(capsys.readouterr())
    assert on.losses == pytest.approx(off.losses, rel=1e-5)
    attn = on.model.base_model.model.model.layers[0].self_attn
    assert "forward" not in vars(attn)  # the returned model attends as the library does


def test_train_packs_jsonl_records_and_not_text_blocks(tmp_path, tiny_dir, text_file, capsys, monkeypatch):
    import tunesmith.train as T

    lines = text_file.read_text().split("\n")
    records = [{"prompt": lines[i], "completion": " ".join(lines[i + 1 : i + 2 + i % 4])} for i in range(0, 60, 3)]
    data = tmp_path / "records.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    kw = dict(max_steps=3, batch_size=4, precision="fp32", lora_dropout=0.0)  # dropout draws depend on shapes
    on = train(tiny_train_config(tmp_path, tiny_dir, data, output=str(tmp_path / "on"), **kw), progress=True)
    assert "packed records" in "".join(capsys.readouterr())
    with monkeypatch.context() as patch:
        patch.setattr(T, "packs_records", lambda setting, model, data: False)
        off = train(tiny_train_config(tmp_path, tiny_dir, data, output=str(tmp_path / "off"), **kw), progress=True)
    assert "packed records" not in "".join(capsys.readouterr())
    assert on.losses == pytest.approx(off.losses, rel=1e-4) and on.tokens == off.tokens
    plain = train(tiny_train_config(tmp_path, tiny_dir, data, output=str(tmp_path / "plain"), fast_paths="off", **kw),
                  progress=True)
    assert "packed records" not in "".join(capsys.readouterr())  # --fast-paths off: padded micro-batches
    assert plain.tokens == on.tokens
    train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "txt"), max_steps=1), progress=True)
    assert "packed records" not in "".join(capsys.readouterr())  # text blocks are all one length


def test_train_recomputes_in_eager_layers_and_its_switch_turns_it_off(tmp_path, tiny_dir, text_file, capsys):
    on = train(tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=3, output=str(tmp_path / "on")),
               progress=True)
    assert "cheap activations recomputed" in capsys.readouterr().err
    assert not any("forward" in vars(m) for m in on.model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP")))
    off = train(tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=3, output=str(tmp_path / "off"),
                                  recompute=False), progress=True)
    assert "recomputed" not in capsys.readouterr().err
    assert on.losses == pytest.approx(off.losses, rel=1e-5)


def test_train_with_the_lora_aware_mlp_follows_peft_s_and_resumes_exactly(tmp_path, tiny_dir, text_file, capsys,
                                                                         monkeypatch):
    import shutil

    # forced on the CPU (its PyTorch reference), as on CUDA it is taken
    monkeypatch.setattr(lora_mlp.LoraMLP, "applies", lambda self, s, m: s.lora)
    kw = dict(max_steps=6, checkpoint_every=3, lora_dropout=0.0, lora_targets=["all-linear"], lr=5e-3)
    on = train(tiny_train_config(tmp_path / "on", tiny_dir, text_file, **kw), progress=True)
    assert "LoRA-aware MLP" in "".join(capsys.readouterr())
    with monkeypatch.context() as patch:
        patch.setattr(lora_mlp.LoraMLP, "applies", lambda self, s, m: False)
        off = train(tiny_train_config(tmp_path / "off", tiny_dir, text_file, **kw), progress=True)
    assert "LoRA-aware MLP" not in "".join(capsys.readouterr())
    assert on.losses == pytest.approx(off.losses, rel=1e-5) and on.losses[-1] < on.losses[0]
    assert "forward" not in vars(on.model.base_model.model.model.layers[0].mlp)  # the returned model runs PEFT's
    cut = tmp_path / "cut" / "run"
    shutil.copytree(on.run_dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step-000006")
    shutil.rmtree(cut / on.adapter_dir.name)
    again = train(tiny_train_config(tmp_path / "cut", tiny_dir, text_file, resume=True, **kw), progress=False)
    assert again.losses == on.losses
