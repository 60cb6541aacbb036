"""The fit planner: exact parameter counts, activations equal to what autograd keeps, and the plan's decisions."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.conftest import make_model, tiny_train_config
from tunesmith import memory as M
from tunesmith.config import FitConfig
from tunesmith.errors import TunesmithError
from tunesmith.lora import attach_lora, trainable_parameters

GIB = 2**30


@pytest.fixture
def shape(tiny_model):
    return M.ModelShape.from_config(tiny_model.config)


def test_shape_counts_every_parameter_once(tiny_model, shape):
    assert shape.params == sum(p.numel() for p in tiny_model.parameters())
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (64, 2, 4, 2, 16)
    assert len(shape.linears) == 2 * 7 + 1  # q k v o gate up down per layer, and the head


def test_known_8b_shape_reads_offline():
    shape = M.ModelShape.from_config(M.read_model_config("meta-llama/Llama-3.1-8B"))
    assert shape.params == 8_030_261_248
    assert M.lora_parameters(shape, ["q_proj", "v_proj"], 8) == 32 * 8 * ((4096 + 4096) + (4096 + 1024))


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["all-linear"], ["down_proj"]])
def test_lora_parameter_count_equals_peft(tiny_model, shape, targets):
    peft_model = attach_lora(tiny_model, 4, 8.0, 0.0, targets)
    assert M.lora_parameters(shape, targets, 4) == trainable_parameters(peft_model)


def test_unknown_target_lists_the_linears(shape):
    with pytest.raises(TunesmithError, match="q_proj"):
        shape.targeted(["qkv"])


def _saved_bytes(model, batch, precision: str, loss_sum=None) -> int:
    """Bytes autograd keeps for backward after one forward (unique storages, parameters excluded)."""
    if loss_sum is None:
        from tunesmith.evaluate import loss_sum

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            kept[st.data_ptr()] = st.nbytes()
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        loss_sum(model, batch)
    return sum(kept.values())


@pytest.mark.parametrize(("precision", "dropout", "targets", "ckpt"), [
    ("fp32", 0.0, ["q_proj", "v_proj"], False),
    ("fp32", 0.1, ["all-linear"], False),
    ("fp32", 0.0, ["all-linear"], False),
    ("bf16", 0.1, ["q_proj", "v_proj"], False),
    ("bf16", 0.0, ["all-linear"], False),
    ("fp32", 0.1, ["q_proj", "v_proj"], True),
])
def test_activations_equal_what_autograd_keeps(tokenizer, precision, dropout, targets, ckpt):
    """The activation model, term by term, against the tensors saved for backward on a 3-layer model."""
    model = make_model(tokenizer, layers=3, hidden=128).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    shape = M.ModelShape.from_config(model.config)
    model = attach_lora(model, 8, 16.0, dropout, targets)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    b, s = 2, 64
    ids = torch.randint(0, shape.vocab, (b, s), generator=torch.Generator().manual_seed(0))
    kept = _saved_bytes(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, precision)
    setup = M.TrainSetup(seq_len=s, batch_size=b, lora_targets=tuple(targets), lora_dropout=dropout,
                         precision=precision, gradient_checkpointing=ckpt, device_type="cpu")
    parts = M.train_parts(shape, setup)
    if ckpt:  # after the forward: each layer's input and the final norm's (the recomputed layer comes later)
        parts["activations"] = (shape.layers + 1) * shape.hidden * 4 * b * s
    predicted = parts["activations"] + 4 * shape.vocab * b * (s - 1)  # autograd keeps the fp32 log-softmax output
    adapter_copies = 0 if precision == "fp32" else parts["adapter"] // 3  # autocast's bf16 copies of LoRA weights
    assert kept == pytest.approx(predicted + adapter_copies, rel=0.02)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fused_loss_keeps_one_hidden_sized_gradient_instead_of_the_logits(tokenizer, precision):
    """With tunesmith.fused's loss autograd keeps the activations and d loss / d hidden of the supervised rows; the
    plan adds what lives only while the loss runs (one chunk of logits, the gathered hidden states)."""
    from tunesmith.fused import chunk_rows, chunked_loss_sum

    model = make_model(tokenizer, layers=3, hidden=128).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    shape = M.ModelShape.from_config(model.config)
    model = attach_lora(model, 8, 16.0, 0.0, ["q_proj", "v_proj"]).train()
    b, s = 2, 64
    ids = torch.randint(0, shape.vocab, (b, s), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    kept = _saved_bytes(model, batch, precision, chunked_loss_sum)
    setup = M.TrainSetup(seq_len=s, batch_size=b, lora_dropout=0.0, precision=precision, device_type="cpu",
                         fused_loss=True)
    parts = M.train_parts(shape, setup)
    a = 4 if precision == "fp32" else 2
    adapter_copies = 0 if precision == "fp32" else parts["adapter"] // 3
    assert kept == pytest.approx(parts["activations"] + b * (s - 1) * shape.hidden * a + adapter_copies, rel=0.02)
    rows = min(b * (s - 1), chunk_rows("cpu", shape.vocab))
    assert parts["logits"] == rows * shape.vocab * (4 if precision == "fp32" else 6) + 2 * b * s * shape.hidden * a
    plain = M.train_parts(shape, replace(setup, fused_loss=False))
    assert parts["logits"] < plain["logits"] and parts["activations"] == plain["activations"]


def test_grouped_query_fp32_on_cuda_keeps_attention_scores(shape):
    """fp32 + grouped-query attention runs SDPA's math kernel on CUDA: S x S probabilities per layer, plus one."""
    s = M.TrainSetup(seq_len=128, batch_size=2, precision="fp32")
    fused, math = M.train_parts(shape, s), M.train_parts(shape, replace(s, fused_sdpa=False))
    assert math["activations"] - fused["activations"] == (shape.layers + 1) * 2 * shape.heads * 128**2 * 4


def test_parts_scale_as_the_formulas_say(shape):
    s = M.TrainSetup(seq_len=32, batch_size=2, device_type="cpu")
    one, two = M.train_parts(shape, s), M.train_parts(shape, replace(s, batch_size=4))
    for fixed in ("weights", "adapter", "gradients", "optimizer", "runtime"):
        assert one[fixed] == two[fixed]
    assert two["logits"] == 2 * one["logits"] == 2 * 12 * shape.vocab * 2 * 31
    n = M.lora_parameters(shape, ["q_proj", "v_proj"], 8)
    assert (one["weights"], one["gradients"], one["optimizer"]) == (4 * shape.params + shape.buffer_bytes, 4 * n, 8 * n)
    bf16 = M.train_parts(shape, replace(s, precision="bf16"))
    assert bf16["weights"] == 2 * shape.params + shape.buffer_bytes and bf16["adapter"] == 6 * n
    ckpt = M.train_parts(shape, replace(s, gradient_checkpointing=True, seq_len=512))
    assert ckpt["activations"] < M.train_parts(shape, replace(s, seq_len=512))["activations"]


def test_8b_at_2048_on_an_h200_picks_micro_batch_8():
    """The acceptance case: on the H200 (139.3 GiB free) auto picked 8 and it ran, 118.5 GiB measured."""
    shape = M.ModelShape.from_config(M.read_model_config("meta-llama/Llama-3.1-8B"))
    s = M.TrainSetup(seq_len=2048, batch_size=1, precision="bf16")
    p = M.plan(shape, s, int(139.8 * GIB), int(139.3 * GIB))
    assert p.best_batch == 8
    assert sum(M.train_parts(shape, replace(s, batch_size=8)).values()) / GIB == pytest.approx(118.445, abs=0.001)
    assert sum(M.train_parts(shape, replace(s, batch_size=16)).values()) > p.budget_bytes
    assert p.checkpointing_helps  # with checkpointing a larger batch fits


def test_verdicts_say_what_to_change(shape):
    s = M.TrainSetup(seq_len=256, batch_size=8, device_type="cuda")  # on the CPU the runtime part would dominate
    need = sum(M.train_parts(shape, s).values())
    roomy = M.plan(shape, s, 64 * GIB, 64 * GIB)
    assert roomy.fits and "fits" in M.verdict(roomy) and "--batch-size auto" in M.verdict(roomy)
    tight = M.plan(shape, s, need, int(need * 0.7))
    assert not tight.fits and 0 < tight.best_batch < 8
    assert f"--batch-size {tight.best_batch}" in M.verdict(tight)
    hopeless = M.plan(shape, s, GIB, 1024)
    assert hopeless.best_batch == 0 and "Not even micro-batch 1" in M.verdict(hopeless)


def test_inference_shrinks_with_bits(shape):
    sizes = [sum(M.infer_parts(shape, bits, 256).values()) for bits in ("bf16", "int8", "int4")]
    assert sizes[0] > sizes[1] > sizes[2]
    assert M.infer_parts(shape, "bf16", 256)["weights"] == 2 * shape.params
    assert M.infer_parts(shape, "bf16", 256)["kv_cache"] == 2 * 2 * 2 * 16 * 256 * 2


def test_cpu_adds_the_process_runtime_and_glibc_slack_and_nothing_else(shape):
    """On the CPU train measures the whole process's peak RSS; the tensor terms are the accelerators' own."""
    s = M.TrainSetup(seq_len=64, batch_size=2, lora_dropout=0.0, device_type="cpu")  # no dropout: same mask bytes
    cpu, cuda = M.train_parts(shape, s), M.train_parts(shape, replace(s, device_type="cuda"))
    assert cpu.pop("runtime") == M.CPU_RUNTIME_BYTES
    assert cpu.pop("allocator") == M.CPU_HEAP_SLACK_BYTES[False] == 256 * 2**20
    assert cpu == cuda
    ckpt = M.train_parts(shape, replace(s, gradient_checkpointing=True))
    assert ckpt["allocator"] == 540 * 2**20 and ckpt["runtime"] == 752 * 2**20


# The whole-process peaks measured on the CPU (docs/MEMORY.md, "CPU"): bench/bench_memory.py's rows and the demo.
SMOL, L1B = "HuggingFaceTB/SmolLM2-135M-Instruct", "meta-llama/Llama-3.2-1B"
QV, ALL = ("q_proj", "v_proj"), ("all-linear",)
CPU_MEASURED = [  # (model, seq, batch, rank, targets, dropout, precision, checkpointing, (run 1, run 2) GiB)
    (SMOL, 256, 4, 8, QV, 0.05, "fp32", False, (3.329, 3.288)),
    (SMOL, 512, 2, 16, ALL, 0.05, "fp32", False, (3.890, 4.770)),
    (SMOL, 256, 8, 8, QV, 0.05, "fp32", True, (3.115, 3.096)),
    (SMOL, 1024, 1, 64, QV, 0.0, "fp32", True, (2.217, 2.184)),
    (SMOL, 256, 4, 8, ALL, 0.0, "bf16", False, (2.357, 2.748)),
    (L1B, 128, 2, 8, QV, 0.05, "fp32", False, (6.583, 6.579)),
    (L1B, 256, 1, 16, ALL, 0.05, "fp32", True, (6.571, 6.506)),
    (SMOL, 256, 4, 8, QV, 0.05, "fp32", False, (3.462, 3.352)),  # the demo's run: `tunesmith demo --max-steps 3`
]  # run 2: the same day, in new processes


# The same rows with the fused loss, train's default since (docs/MEMORY.md, third run; one run so far)
CPU_MEASURED_FUSED = [
    (SMOL, 256, 4, 8, QV, 0.05, "fp32", False, (2.809,)),
    (SMOL, 512, 2, 16, ALL, 0.05, "fp32", False, (3.396,)),
    (SMOL, 256, 8, 8, QV, 0.05, "fp32", True, (2.104,)),
    (SMOL, 1024, 1, 64, QV, 0.0, "fp32", True, (1.961,)),
    (SMOL, 256, 4, 8, ALL, 0.0, "bf16", False, (2.340,)),
    (L1B, 128, 2, 8, QV, 0.05, "fp32", False, (6.309,)),
    (L1B, 256, 1, 16, ALL, 0.05, "fp32", True, (6.387,)),
    (SMOL, 256, 4, 8, QV, 0.05, "fp32", False, (2.960,)),  # the demo's run
]


@pytest.mark.parametrize(("model", "seq", "batch", "rank", "targets", "dropout", "precision", "ckpt", "runs", "fused"),
                         [(*row, False) for row in CPU_MEASURED] + [(*row, True) for row in CPU_MEASURED_FUSED])
def test_cpu_prediction_is_within_15_percent_of_the_measured_peak(model, seq, batch, rank, targets, dropout,
                                                                  precision, ckpt, runs, fused):
    shape = M.ModelShape.from_config(M.read_model_config(model))
    s = M.TrainSetup(seq_len=seq, batch_size=batch, lora_rank=rank, lora_targets=targets, lora_dropout=dropout,
                     precision=precision, gradient_checkpointing=ckpt, device_type="cpu", fused_loss=fused)
    predicted = sum(M.train_parts(shape, s).values()) / GIB
    for measured in runs:
        assert predicted == pytest.approx(measured, rel=0.15), runs


def test_plan_on_the_cpu_gives_this_process_back_to_the_available_memory(tiny_dir, monkeypatch):
    """The plan counts the process from its start (the runtime part), so what it holds already is not a burden."""
    import tunesmith.device as D

    monkeypatch.setattr(D, "memory_bytes", lambda device: (16 * GIB, 4 * GIB))
    monkeypatch.setattr(M, "_process_rss", lambda: GIB)
    cfg = FitConfig(model=str(tiny_dir), device="cpu", seq_len=64)
    assert M.plan_run(cfg, torch.device("cpu"), "fp32").available_bytes == 5 * GIB
    monkeypatch.setattr(M, "_process_rss", lambda: 20 * GIB)
    assert M.plan_run(cfg, torch.device("cpu"), "fp32").available_bytes == 16 * GIB  # never above the total


def test_read_model_config_sources(tiny_dir, tmp_path):
    assert M.read_model_config(str(tiny_dir)).hidden_size == 64
    with pytest.raises(TunesmithError, match="GGUF file not found"):
        M.read_model_config(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TunesmithError, match="no config.json"):
        M.read_model_config(str(tmp_path / "empty"))
    with pytest.raises(TunesmithError, match="not in the local hub cache"):
        M.read_model_config("nobody/no-such-model")  # HF_HUB_OFFLINE=1 in the tests


def test_plan_run_auto_and_memory_override(tiny_dir):
    cfg = FitConfig(model=str(tiny_dir), device="cpu", batch_size="auto", seq_len=64)
    p = M.plan_run(cfg, torch.device("cpu"), "fp32", memory_gib=2.0)  # the CPU's runtime part takes about 1 GiB
    assert p.setup.batch_size == M.AUTO_MAX_BATCH and p.available_bytes == 2 * GIB
    with pytest.raises(TunesmithError, match="--batch-size auto: does NOT fit"):
        M.plan_run(cfg, torch.device("cpu"), "fp32", memory_gib=0.0001)


def test_fit_verb_prints_table_and_verdict(tiny_dir, capsys):
    from tunesmith.cli import main

    assert main(["fit", "--model", str(tiny_dir), "--device", "cpu", "--seq-len", "64", "--memory-gib", "0.001"]) == 0
    out = capsys.readouterr().out
    for word in ("weights", "activations", "logits", "peak", "does NOT fit", "int4"):
        assert word in out


def test_train_writes_fit_json_and_auto_batch_runs(tmp_path, tiny_dir, text_file, tokenizer):
    from tunesmith.train import train

    cfg = tiny_train_config(tmp_path, tiny_dir, text_file, batch_size="auto", max_steps=1)
    r = train(cfg, model=make_model(tokenizer), tokenizer=tokenizer, progress=False)
    fit = json.loads((tmp_path / "run" / "fit.json").read_text())
    assert {"predicted_peak_bytes", "parts", "device_total_bytes", "device_available_bytes"} <= set(fit)
    assert fit["predicted_peak_bytes"] == sum(fit["parts"].values())
    assert set(fit["parts"]) == {"weights", "adapter", "gradients", "optimizer", "activations", "logits", "runtime",
                                 "allocator"}  # the CPU's whole-process parts
    assert r.batch_size == fit["micro_batch"] == M.AUTO_MAX_BATCH and r.steps == 1


def test_read_model_config_resolves_the_model_as_loading_does(tiny_dir, monkeypatch):
    """One resolver for every verb: a built-in alias (or .gguf) is the folder models.resolve_model converts it to."""
    import tunesmith.models as models

    asked = []
    monkeypatch.setattr(models, "resolve_model", lambda spec: asked.append(spec) or tiny_dir)
    assert M.read_model_config("smollm2-135m-instruct").hidden_size == 64
    assert asked == ["smollm2-135m-instruct"]
