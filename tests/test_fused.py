"""The trainer's fast paths against the plain ones they replace."""

import contextlib
import json
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from tunesmith import fused
from tunesmith.data import IGNORE
from tunesmith.evaluate import loss_sum
from tunesmith.lora import attach_lora
from tunesmith.train import train

from .conftest import make_model, tiny_train_config


@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("chunk_rows", [1, 4, 100])
def test_linear_cross_entropy_equals_the_full_logits_path_value_and_gradients(softcap, chunk_rows):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=g, requires_grad=True)
    weight = torch.randn(37, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 37, (11,), generator=g)
    logits = hidden @ weight.T
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    ref = F.cross_entropy(logits, targets, reduction="sum")
    (ref * 0.7).backward()  # a scaled loss: backward must carry the incoming gradient
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    got = fused.linear_cross_entropy_sum(hidden, weight, targets, softcap, chunk_rows)
    (got * 0.7).backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_w, rtol=1e-5, atol=1e-6)


def test_a_frozen_weight_gets_no_gradient_and_no_rows_give_zero():
    hidden = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(9, 8)
    fused.linear_cross_entropy_sum(hidden, weight, torch.arange(5), rows=2).backward()
    assert weight.grad is None and hidden.grad.shape == hidden.shape
    empty = torch.zeros(0, 8, requires_grad=True)
    assert fused.linear_cross_entropy_sum(empty, weight, torch.zeros(0, dtype=torch.long)).item() == 0.0


def _batch(tokenizer):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, len(tokenizer), (3, 12), generator=g)
    labels = ids.clone()
    labels[0, :5] = IGNORE  # a prompt that is not trained on
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0  # right padding
    labels[2, 9:] = IGNORE
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _with_host_rows(model, batch):
    """chunked_loss_sum given the supervised rows found on the host, as train hands them on CUDA."""
    return fused.chunked_loss_sum(model, {**batch, "rows": fused.supervised_rows(batch["labels"])})


@pytest.mark.parametrize("rows", ["mask", "host"])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_sum_equals_loss_sum_on_a_lora_model(tokenizer, monkeypatch, tied, rows):
    monkeypatch.setattr(fused, "DEFAULT_CHUNK_BYTES", 5 * len(tokenizer) * 4)  # 16 rows a chunk: several chunks
    model = attach_lora(make_model(tokenizer, tie_word_embeddings=tied), 4, 8, 0.0, ["q_proj", "v_proj"])
    assert fused.supports_chunked_loss(model)
    batch = _batch(tokenizer)
    grads = []
    for fn in (loss_sum, fused.chunked_loss_sum if rows == "mask" else _with_host_rows):
        model.zero_grad(set_to_none=True)
        total, n = fn(model, batch)
        (total / n).backward()
        grads.append((total.item(), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}))
    (ref, ref_n, ref_g), (got, got_n, got_g) = grads
    assert got_n == ref_n == 3 * 11 - 4 - 3  # 11 targets a row, less the prompt's 4 and the padding's 3
    assert got == pytest.approx(ref, rel=1e-6)
    assert ref_g.keys() == got_g.keys() and len(ref_g) == 8
    for k in ref_g:
        torch.testing.assert_close(got_g[k], ref_g[k], rtol=1e-4, atol=1e-7)


def test_host_rows_of_a_batch_without_padding_select_nothing_and_give_the_same_loss(tokenizer):
    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, ["q_proj", "v_proj"])
    batch = _batch(tokenizer)
    batch["labels"] = batch["input_ids"].clone()  # every next token supervised
    rows = fused.supervised_rows(batch["labels"])
    assert rows.tolist() == list(range(3 * 11))
    ref, ref_n = loss_sum(model, batch)
    got, got_n = _with_host_rows(model, batch)
    assert got_n == ref_n == 33 and got.item() == pytest.approx(ref.item(), rel=1e-6)


def test_lora_on_the_output_layer_keeps_the_plain_loss(tokenizer):
    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, ["q_proj", "lm_head"])
    assert not fused.supports_chunked_loss(model)


def test_under_bf16_autocast_the_chunked_loss_stays_close(tokenizer):
    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, ["q_proj", "v_proj"])
    batch = _batch(tokenizer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = loss_sum(model, batch)
        got, _ = fused.chunked_loss_sum(model, batch)
    assert got.item() == pytest.approx(ref.item(), rel=2e-3)


def test_fifty_steps_with_the_fused_loss_follow_the_plain_losses(tmp_path, tiny_dir, text_file):
    """Acceptance: the optimized path's 50 losses within 1% of the plain path's (same seed, same data)."""
    runs = {}
    for name, on in (("plain", False), ("fused", True)):  # the fused loss, fused LoRA, recomputation, or none
        cfg = tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / name), max_steps=50,
                                fused_loss=on, fused_lora="on" if on else "off", recompute=on, lora_dropout=0.05,
                                lr=5e-3)
        runs[name] = train(cfg, progress=False).losses
    assert len(runs["fused"]) == 50
    assert runs["fused"] == pytest.approx(runs["plain"], rel=1e-2)
    assert runs["fused"][0] == pytest.approx(runs["plain"][0], rel=1e-5)


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


def test_the_start_line_names_the_fast_paths(tmp_path, tiny_dir, text_file, capsys):
    train(tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=1), progress=True)
    assert "; fused loss" in capsys.readouterr().err
    train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "b"), max_steps=1,
                            fused_loss=False), progress=True)
    assert "fused loss" not in capsys.readouterr().err


@pytest.fixture
def fake_liger(monkeypatch):
    """liger_kernel's functional API with eager stand-ins, counting calls (Liger's kernels need CUDA)."""
    calls = {"rms_norm": 0, "swiglu": 0, "rope": 0}

    def liger_rms_norm(x, w, eps):
        calls["rms_norm"] += 1
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def liger_swiglu(a, b):
        calls["swiglu"] += 1
        return F.silu(a) * b

    def liger_rope(q, k, cos, sin, unsqueeze_dim=1):
        calls["rope"] += 1
        raise AssertionError("RoPE must not reach Liger for CPU tensors")

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_rms_norm, functional.liger_swiglu, functional.liger_rope = liger_rms_norm, liger_swiglu, liger_rope
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    import transformers.models.llama.modeling_llama as modeling

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)  # restored after
    return calls


def test_liger_replaces_this_model_s_norms_and_mlps_only(tokenizer, fake_liger):
    assert fused.liger_available()
    model, other = make_model(tokenizer), make_model(tokenizer)
    ids = torch.randint(3, len(tokenizer), (2, 10))
    with torch.no_grad():
        ref = model(ids).logits
    assert fused.apply_liger(model) == ["rms_norm", "rope", "swiglu"]
    model = attach_lora(model, 4, 8, 0.0, "all-linear")  # LoRA-wrapped projections inside the new MLP forward
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref)
        other(ids)
    layers = len(model.get_base_model().model.layers)
    assert fake_liger["swiglu"] == layers and fake_liger["rms_norm"] == 2 * layers + 1
    assert fake_liger["rope"] == 0  # CPU tensors keep transformers' RoPE


def test_liger_leaves_other_architectures_alone(tokenizer, fake_liger):
    model = make_model(tokenizer)
    model.config.model_type = "gemma3_text"
    assert fused.apply_liger(model) == []


def test_liger_is_not_applied_off_cuda_and_its_absence_is_quiet_there(tmp_path, tiny_dir, text_file, capsys):
    train(tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=1, liger=True), progress=True)
    assert "liger" not in capsys.readouterr().err.lower()


@pytest.mark.parametrize("fused_loss", [True, False])
def test_training_builds_no_kv_cache(tmp_path, tiny_dir, text_file, monkeypatch, fused_loss):
    """A cache is useless in training, and with --compile each layer's own cache object made the compiled layer
    recompile per layer until torch gave up (8 recompiles) and ran the rest eagerly."""
    from transformers import cache_utils

    made = []
    original = cache_utils.DynamicCache.__init__

    def counting(self, *args, **kwargs):
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicCache, "__init__", counting)
    r = train(tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=2, eval_every=1, fused_loss=fused_loss),
              progress=False)
    assert r.steps == 2 and len(r.evals) == 2 and made == []


# ------------------------------------------------------------------------------------------------ CUDA graphs


@pytest.mark.parametrize(("changes", "device", "world", "fsdp", "expected"), [
    ({}, "cuda", 1, False, (True, True, False)),  # one GPU: compiled layers replayed as graphs, no Liger
    ({}, "cpu", 1, False, (False, False, False)),
    ({}, "mps", 1, False, (False, False, False)),
    ({}, "cuda", 2, False, (True, False, True)),  # several processes: graphs only when asked for
    ({}, "cuda", 2, True, (False, False, True)),  # FSDP2 stays eager
    ({"gradient_checkpointing": True}, "cuda", 1, False, (True, False, True)),
    ({"quantize_base": "nf4"}, "cuda", 1, False, (True, False, True)),
    ({"fine_tune_type": "dora"}, "cuda", 1, False, (True, False, True)),
    ({"fine_tune_type": "full", "cuda_graphs": "on"}, "cuda", 1, False, (True, True, False)),
    ({"cuda_graphs": "off"}, "cuda", 1, False, (True, False, True)),
    ({"cuda_graphs": "off", "liger": False}, "cuda", 1, False, (True, False, False)),
    ({"cuda_graphs": "on"}, "cuda", 2, False, (True, True, False)),
    ({"compile": "off"}, "cuda", 1, False, (False, False, True)),
    ({"compile": "on"}, "cpu", 1, False, (True, False, False)),
])
def test_cuda_graphs_go_where_layers_are_compiled_on_one_gpu_and_liger_gives_way(changes, device, world, fsdp,
                                                                                  expected):
    from tunesmith.config import TrainConfig
    from tunesmith.train import fast_paths

    assert fast_paths(TrainConfig(**changes), device, world, fsdp) == expected


def test_cuda_graphs_on_where_they_cannot_run_is_one_error_before_anything_is_written(tmp_path, tiny_dir, text_file):
    from tunesmith.errors import TunesmithError

    out = tmp_path / "run"
    with pytest.raises(TunesmithError, match=r"this run is on cpu; use --cuda-graphs off"):
        train(tiny_train_config(tmp_path, tiny_dir, text_file, cuda_graphs="on"), progress=False)
    assert not out.exists()
    from tunesmith.config import TrainConfig
    from tunesmith.train import fast_paths

    with pytest.raises(TunesmithError, match=r"not compiled; .* or --compile on"):
        fast_paths(TrainConfig(cuda_graphs="on", compile="off"), "cuda", 1, False)


def test_compiled_layers_run_eagerly_for_evaluation_and_after_training(tokenizer):
    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, "all-linear")
    assert fused.compile_layers(model, cuda_graphs=True) == 2  # torch.compile is lazy: nothing compiles until a call
    layers = model.get_base_model().model.layers
    compiled = [layer._compiled_call_impl for layer in layers]
    assert all(c is not None for c in compiled)
    with fused.eager_layers(model):
        assert all(layer._compiled_call_impl is None for layer in layers)
    assert [layer._compiled_call_impl for layer in layers] == compiled
    assert fused.uncompile_layers(model) is model
    assert all(layer._compiled_call_impl is None for layer in layers)


def test_gradients_leave_the_graph_pool_between_micro_batches_only(tokenizer, monkeypatch):
    """A graphed backward writes its gradients where its next replay writes again: between micro-batches of one
    step they are copied out (values unchanged); after the step's last one the optimizer reads them in place."""
    from accelerate import Accelerator

    import tunesmith.train as T

    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, ["q_proj", "v_proj"])
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.grad for p in params]
    fused.own_gradients(model)
    assert all(p.grad is not b and p.grad.data_ptr() != b.data_ptr() and torch.equal(p.grad, b)
               for p, b in zip(params, before, strict=True))
    model.zero_grad(set_to_none=True)

    calls = []
    monkeypatch.setattr(T, "own_gradients", lambda m: calls.append(m))
    g = torch.Generator().manual_seed(0)
    examples = [(ids, ids) for ids in (torch.randint(3, len(tokenizer), (16,), generator=g).tolist()
                                       for _ in range(4))]
    acc = Accelerator(cpu=True)
    graphed = T._accumulate(model, acc, examples, 1, 60, 0, loss_sum, graphed=True)
    grads = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    assert len(calls) == 3  # 4 micro-batches: after the first three
    plain = T._accumulate(model, acc, examples, 1, 60, 0, loss_sum, graphed=False)
    assert len(calls) == 3 and float(graphed) == float(plain)
    assert all(torch.equal(p.grad, q) for p, q in zip(params, grads, strict=True))


# ------------------------------------------------------------------------------------------------ fused LoRA


def _lora_pair(tokenizer, dropout=0.0, targets=("all-linear",), dtype=torch.float32):
    """Two copies of one tiny Llama with the same LoRA adapters (B not zero, so the low-rank path counts): the
    second with the fused forward."""
    models = []
    for _ in range(2):
        model = attach_lora(make_model(tokenizer).to(dtype), rank=4, alpha=8, dropout=dropout, targets=list(targets))
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        models.append(model)
    assert fused.fuse_lora(models[1]) == (14 if targets == ("all-linear",) else 4)
    return models


def _grads(model, batch, seed=0, autocast=None):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both
    with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
        loss, _ = loss_sum(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_lora_gives_peft_s_loss_and_gradients(tokenizer, dropout):
    plain, fast = _lora_pair(tokenizer, dropout=dropout)
    batch = _batch(tokenizer)
    ref_loss, ref = _grads(plain, batch)
    got_loss, got = _grads(fast, batch)
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert set(got) == set(ref) and len(ref) == 28  # A and B of 7 linears x 2 layers
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # the fused path is what ran: its backward node, not PEFT's add
    x = torch.randn(2, 3, 64, requires_grad=True)
    q = fast.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q(x).grad_fn).__name__ == "_LoraLinearBackward"


def test_fused_lora_under_bf16_autocast_follows_peft_s(tokenizer):
    plain, fast = _lora_pair(tokenizer)
    batch = _batch(tokenizer)
    ref_loss, ref = _grads(plain, batch, autocast=torch.bfloat16)
    got_loss, got = _grads(fast, batch, autocast=torch.bfloat16)
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-2)
    for name in ref:
        assert got[name].dtype == torch.float32  # fp32 LoRA weights keep fp32 gradients
        cos = F.cosine_similarity(got[name].flatten(), ref[name].flatten(), dim=0)
        assert cos > 0.99, name


def test_fused_lora_gives_way_where_it_does_not_apply(tokenizer):
    plain, fast = _lora_pair(tokenizer, targets=("q_proj", "v_proj"))
    ids = {k: v for k, v in _batch(tokenizer).items() if k in ("input_ids", "attention_mask")}
    q = fast.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        adapted = fast(**ids).logits
        torch.testing.assert_close(adapted, plain(**ids).logits, rtol=1e-5, atol=1e-5)
        with fast.disable_adapter(), plain.disable_adapter():  # adapters off: the base layers alone
            torch.testing.assert_close(q(x), q.base_layer(x))
            base = fast(**ids).logits
            torch.testing.assert_close(base, plain(**ids).logits)
        assert (adapted - base).abs().max() > 1e-3  # the adapters do count when on
    # a dropout module PEFT does not make: PEFT's own forward applies it
    q.lora_dropout["default"] = torch.nn.Sequential(torch.nn.Dropout(0.1))
    assert type(q(x.requires_grad_()).grad_fn).__name__ != "_LoraLinearBackward"
    q.lora_dropout["default"] = torch.nn.Identity()
    assert type(q(x).grad_fn).__name__ == "_LoraLinearBackward"
    # fp16 weights outside autocast with fp32 adapters: mixed dtypes, PEFT's own path (which casts)
    q.base_layer.to(torch.float16)
    y = q(x.half().requires_grad_())
    assert type(y.grad_fn).__name__ != "_LoraLinearBackward"


def test_dora_and_a_quantized_base_are_not_routed_through_the_fused_lora(tokenizer):
    pytest.importorskip("torchao")
    from tunesmith.qlora import quantize_base

    dora = attach_lora(make_model(tokenizer), rank=4, alpha=8, dropout=0.0, targets=["q_proj"], dora=True)
    qlora = attach_lora(quantize_base(make_model(tokenizer), "int8"), rank=4, alpha=8, dropout=0.0,
                        targets=["q_proj"])
    assert fused.fuse_lora(qlora) == 0  # a quantized base layer is not a torch Linear
    fused.fuse_lora(dora)
    x = torch.randn(1, 2, 64, requires_grad=True)
    for model in (dora, qlora):
        q = model.base_model.model.model.layers[0].self_attn.q_proj
        assert type(q(x).grad_fn).__name__ != "_LoraLinearBackward"


def test_train_reports_the_fused_lora_and_its_switch_turns_it_off(tmp_path, tiny_dir, text_file, capsys):
    on = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "on"), max_steps=2),
               progress=True)  # auto, on the CPU with eager layers: on
    assert "fused LoRA" in "".join(capsys.readouterr())
    off = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "off"), max_steps=2,
                                  fused_lora="off"), progress=True)
    assert "fused LoRA" not in "".join(capsys.readouterr())
    assert on.losses == pytest.approx(off.losses, rel=1e-5)


def test_the_liger_loss_is_chosen_on_cuda_with_liger_installed_and_not_under_fsdp(tokenizer, monkeypatch):
    from tunesmith import train as T
    from tunesmith.config import TrainConfig

    model = make_model(tokenizer)
    monkeypatch.setattr(T, "liger_available", lambda: True)
    cfg = TrainConfig(model="m", output="o")
    assert T.uses_liger_loss(cfg, "cuda", False, model)
    assert not T.uses_liger_loss(cfg, "cpu", False, model)
    assert not T.uses_liger_loss(cfg, "mps", False, model)
    assert not T.uses_liger_loss(cfg, "cuda", True, model)  # FSDP2
    assert not T.uses_liger_loss(TrainConfig(model="m", output="o", liger=False), "cuda", False, model)
    assert not T.uses_liger_loss(TrainConfig(model="m", output="o", fused_loss=False), "cuda", False, model)
    monkeypatch.setattr(T, "liger_available", lambda: False)
    assert not T.uses_liger_loss(cfg, "cuda", False, model)
    # the start line says which loss runs
    cpu = torch.device("cpu")
    assert T._kernels(cfg, cpu, model, print, False, liger_loss=True) == ["fused loss (Liger's kernel)"]
    assert T._kernels(cfg, cpu, model, print, False) == ["fused loss"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's Triton kernels run on CUDA")
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("train_head", [False, True])
def test_liger_s_linear_cross_entropy_equals_the_chunked_one_on_cuda(softcap, train_head):
    pytest.importorskip("liger_kernel")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(300, 64, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(5000, 64, device="cuda", generator=g, dtype=torch.bfloat16) * 0.3).requires_grad_(train_head)
    targets = torch.randint(0, 5000, (300,), device="cuda", generator=g)
    ref = fused.linear_cross_entropy_sum(hidden, weight, targets, softcap)
    (ref * 0.5).backward()
    ref_h, ref_w, hidden.grad, weight.grad = hidden.grad.clone(), weight.grad, None, None
    got = fused.linear_cross_entropy_sum(hidden, weight, targets, softcap, liger=True)
    (got * 0.5).backward()
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(ref.item(), rel=1e-3)
    pairs = [(hidden.grad, ref_h)] + ([(weight.grad, ref_w)] if train_head else [])
    for a, b in pairs:
        assert a.dtype == b.dtype
        assert F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0) > 0.999


LIGER_LOSS_CHECK = """
import torch
from tunesmith import fused
fused.LIGER_ON_CPU = True  # Liger's kernels on CPU tensors, run by Triton's interpreter
def no_host_read(*a, **k):
    raise AssertionError("a read to the host inside the loss")
torch.Tensor.item, torch.equal = no_host_read, no_host_read
torch.manual_seed(0)
worst = 0.0
for rows, chunk in ((37, 8), (16, 16), (5, 64)):
    hidden = torch.randn(rows, 24, requires_grad=True)
    weight = torch.randn(301, 24) * 0.3
    targets = torch.randint(0, 301, (rows,))
    ref = fused.linear_cross_entropy_sum(hidden, weight, targets, rows=chunk)
    (ref / 7).backward()
    ref_grad, hidden.grad = hidden.grad, None
    got = fused._LigerLinearCrossEntropy.apply(hidden, weight, targets, 0.0, chunk)
    (got / torch.tensor(7.0)).backward()  # the scale comes as a tensor, as the trainer's 1 / tokens does
    assert got.dtype == torch.float32
    worst = max(worst, abs(float(got.detach()) - float(ref.detach())) / abs(float(ref.detach())),
                float((hidden.grad - ref_grad).abs().max() / ref_grad.abs().max()))
# an ignored row: no loss, no gradient
hidden = torch.randn(6, 24, requires_grad=True)
targets = torch.randint(0, 301, (6,))
targets[2] = -100
got = fused._LigerLinearCrossEntropy.apply(hidden, weight, targets, 0.0, 4)
got.backward()
assert float(hidden.grad[2].abs().max()) == 0.0 and float(hidden.grad[3].abs().max()) > 0
keep = torch.tensor([0, 1, 3, 4, 5])
ref = fused.linear_cross_entropy_sum(hidden.detach()[keep], weight, targets[keep])
worst = max(worst, abs(float(got.detach()) - float(ref)) / abs(float(ref)))
# the frozen-head path of linear_cross_entropy_sum(liger=True) is this loop
hidden.grad = None
fused.linear_cross_entropy_sum(hidden[keep], weight, targets[keep], liger=True).backward()
assert float(hidden.grad[2].abs().max()) == 0.0
print(worst)
"""


def test_liger_s_loss_kernel_without_host_reads_equals_the_chunked_loss_under_triton_s_interpreter():
    """tunesmith's loop over Liger's cross-entropy kernel (the frozen output layer's path): the chunked loss's value
    and hidden-state gradient in fp32, chunks that do not divide the rows included, ignored rows left out, and no
    `.item()` or `torch.equal` anywhere (each is a wait for the GPU on CUDA)."""
    import os
    import subprocess

    pytest.importorskip("triton")
    pytest.importorskip("liger_kernel")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", LIGER_LOSS_CHECK], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) < 1e-5


def test_liger_s_loss_kernel_of_another_signature_is_not_called(monkeypatch, request):
    pytest.importorskip("liger_kernel")
    fused._liger_kernels.cache_clear()
    request.addfinalizer(fused._liger_kernels.cache_clear)  # the lookup is cached a process
    assert fused._liger_kernels() is not None
    fused._liger_kernels.cache_clear()
    monkeypatch.setattr(fused, "LIGER_CE_ARGS", fused.LIGER_CE_ARGS[:-1])
    assert fused._liger_kernels() is None  # linear_cross_entropy_sum then takes Liger's public function


@pytest.mark.parametrize("rows, hidden, vocab, const, chunk", [
    (8192, 4096, 128256, 8, 2048),  # the Llama-3.1-8B row: Liger's default would take 256 rows at a time
    (16384, 2048, 128256, 8, 2048),  # Llama-3.2-1B, seq 2048, micro-batch 8
    (8192, 576, 49152, 64, 4096),  # SmolLM2-135M: the budget holds 5,461 rows; 64 is the largest tried
    (300, 4096, 5000, 64, 300),  # one chunk: never more rows than there are
])
def test_liger_s_chunks_take_the_cuda_chunk_budget(rows, hidden, vocab, const, chunk):
    assert fused.liger_chunk_const(rows, hidden, vocab) == const
    # Liger 0.8.5's rule (ops/fused_linear_cross_entropy.py), written out: the chunk it then takes
    parts = -(-vocab // (const * hidden))
    got = min(2 ** math.ceil(math.log2(-(-rows // parts))), rows)
    assert got == chunk == fused.liger_chunk_rows(rows, hidden, vocab)  # what tunesmith's own loop over it takes
    assert got * vocab * 2 <= fused.CHUNK_BYTES["cuda"]  # bf16 logits within the planner's chunk budget


# ------------------------------------------------------------------------------------------------ fused q/k/v


def _qkv_pair(tokenizer, dropout=0.0, targets=("all-linear",), rank=4):
    """Two copies of one tiny Llama with the same LoRA adapters (B not zero), the second to be fused."""
    models = []
    for _ in range(2):
        model = attach_lora(make_model(tokenizer), rank=rank, alpha=2 * rank, dropout=dropout, targets=list(targets))
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        models.append(model)
    return models


def _attn(model, i=0):
    return model.base_model.model.model.layers[i].self_attn


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "k_proj", "v_proj"), ("q_proj", "v_proj")])
@pytest.mark.parametrize("rope_kernel", [False, True])
def test_fused_qkv_gives_peft_s_loss_and_gradients(tokenizer, targets, rope_kernel, monkeypatch):
    # rope_kernel: RoPE straight out of the joined product (rope.rope_qkv, its PyTorch reference on the CPU)
    monkeypatch.setattr(fused, "ROPE_KERNEL", rope_kernel)
    monkeypatch.setattr(fused, "ROPE_ON_CPU", rope_kernel)
    from tunesmith import rope

    calls, original = [], rope._forward_reference
    monkeypatch.setattr(rope, "_forward_reference", lambda *a: calls.append(1) or original(*a))
    plain, fast = _qkv_pair(tokenizer, targets=targets)
    assert fused.fuse_qkv(fast) == 2
    attn = _attn(fast)
    whole = attn.tunesmith_qkv_weight
    assert whole.shape == (64 + 32 + 32, 64)  # 4 heads of 16 for q, 2 KV heads for k and v
    for p in fused.QKV:  # the frozen weights are views into the joined one: no second copy
        w = fused._holder(getattr(attn, p)).weight
        assert w.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() and not w.requires_grad
    batch = _batch(tokenizer)
    ref_loss, ref = _grads(plain, batch)
    got_loss, got = _grads(fast, batch)
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert set(got) == set(ref) and len(ref) == {1: 28, 3: 12, 2: 8}[len(targets)]
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    assert len(calls) == (2 if rope_kernel else 0)  # one call a layer
    # under bf16 autocast it follows PEFT's path as closely as two bf16 paths can
    ref_loss, ref = _grads(plain, batch, autocast=torch.bfloat16)
    got_loss, got = _grads(fast, batch, autocast=torch.bfloat16)
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-2)
    for name in ref:
        assert got[name].dtype == torch.float32
        assert F.cosine_similarity(got[name].flatten(), ref[name].flatten(), dim=0) > 0.99, name


def test_fused_qkv_is_what_runs_and_gives_way_where_it_does_not_apply(tokenizer, monkeypatch):
    plain, fast = _qkv_pair(tokenizer)
    fused.fuse_qkv(fast)
    ids = {k: v for k, v in _batch(tokenizer).items() if k in ("input_ids", "attention_mask")}
    calls = []
    q = _attn(fast).q_proj
    monkeypatch.setattr(q, "forward", lambda x, *a, **k: calls.append(1) or type(q).forward(q, x, *a, **k))
    with torch.no_grad():
        adapted = fast(**ids, use_cache=False).logits
        assert calls == []  # the joined product ran, not q_proj's own forward
        torch.testing.assert_close(adapted, plain(**ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
        with fast.disable_adapter(), plain.disable_adapter():  # adapters off: the model's own forward
            torch.testing.assert_close(fast(**ids, use_cache=False).logits, plain(**ids, use_cache=False).logits)
        assert len(calls) == 1
        # generation with a KV cache: the model's own forward, the same tokens
        prompt = ids["input_ids"][:1, :5]
        out = [m.generate(input_ids=prompt, max_new_tokens=6, do_sample=False) for m in (fast, plain)]
        assert torch.equal(out[0], out[1])


def test_fused_qkv_leaves_dropout_and_partial_targets_alone_and_undoes_itself(tokenizer):
    dropped, = _qkv_pair(tokenizer, dropout=0.1)[:1]
    assert fused.fuse_qkv(dropped) == 0  # each projection draws its own dropout mask
    o, = _qkv_pair(tokenizer, targets=("o_proj", "up_proj"))[:1]
    assert fused.fuse_qkv(o) == 0  # no adapter on q, k or v: nothing to join
    plain, fast = _qkv_pair(tokenizer)
    fused.fuse_qkv(fast)
    fused.unfuse_qkv(fast)
    attn = _attn(fast)
    assert "forward" not in attn.__dict__ and not hasattr(attn, "tunesmith_qkv_weight")
    ptrs = {fused._holder(getattr(attn, p)).weight.untyped_storage().data_ptr() for p in fused.QKV}
    assert len(ptrs) == 3  # each weight its own tensor again: merging and saving see plain layers
    merged = fast.merge_and_unload()
    ref = plain.merge_and_unload()
    for (n, a), (_, b) in zip(merged.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=n)


def test_train_reports_fused_qkv_and_its_switch_turns_it_off(tmp_path, tiny_dir, text_file, capsys):
    kw = dict(max_steps=3, lora_dropout=0.0, lora_targets=["all-linear"])
    on = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "on"), **kw), progress=True)
    assert "fused q/k/v" in "".join(capsys.readouterr())
    off = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "off"), fused_qkv=False, **kw),
                progress=True)
    assert "fused q/k/v" not in "".join(capsys.readouterr())
    assert on.losses == pytest.approx(off.losses, rel=1e-5)
    assert "forward" not in _attn(on.model).__dict__  # the returned model attends as the library does


# ------------------------------------------------------------------------------------------------ packed records


def _records(tokenizer, lengths=(12, 5, 4, 3, 9, 2)):
    g = torch.Generator().manual_seed(3)
    out = []
    for n in lengths:
        ids = torch.randint(3, len(tokenizer), (n,), generator=g).tolist()
        out.append((ids, [IGNORE] * (n // 3) + ids[n // 3:]))  # a prompt part, not trained on
    return out


@pytest.mark.parametrize("fn", ["plain", "chunked"])
def test_packed_records_give_the_padded_loss_and_gradients(tokenizer, fn):
    from tunesmith.data import collate, collate_packed

    model = attach_lora(make_model(tokenizer), 4, 8, 0.0, ["q_proj", "v_proj"])
    loss = loss_sum if fn == "plain" else fused.chunked_loss_sum
    records = _records(tokenizer)
    packed = collate_packed(records, tokenizer.pad_token_id)
    assert packed["input_ids"].shape == (3, 12)  # 6 records in 3 rows: 12 | 9+3 | 5+4+2
    results = []
    for batch in (collate(records, tokenizer.pad_token_id), packed):
        model.zero_grad(set_to_none=True)
        total, n = loss(model, batch)
        total.backward()
        results.append((total.item(), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}))
    (ref, ref_n, ref_g), (got, got_n, got_g) = results
    assert got_n == ref_n == sum(sum(1 for t in lab[1:] if t != IGNORE) for _, lab in records)
    assert got == pytest.approx(ref, rel=1e-5)
    for k in ref_g:
        torch.testing.assert_close(got_g[k], ref_g[k], rtol=1e-4, atol=1e-6, msg=k)


def test_a_packed_record_attends_only_to_itself(tokenizer):
    from tunesmith.data import collate_packed

    model = make_model(tokenizer).eval()
    records = _records(tokenizer, (6, 3, 2))
    a = collate_packed(records, tokenizer.pad_token_id)
    changed = [records[0], ([5] * 3, records[1][1]), records[2]]  # the record before the last one in its row
    b = collate_packed(changed, tokenizer.pad_token_id)
    with torch.no_grad():
        la = model(**{k: v for k, v in a.items() if k != "labels"}, use_cache=False).logits
        lb = model(**{k: v for k, v in b.items() if k != "labels"}, use_cache=False).logits
    assert a["input_ids"][1].tolist()[3:5] == records[2][0]  # row 1: the 3-token record, then the 2-token one
    torch.testing.assert_close(la[1, 3:5], lb[1, 3:5])  # the 2-token record does not see its neighbour
    assert (la[1, :3] - lb[1, :3]).abs().max() > 1e-4


def test_train_packs_jsonl_records_and_not_text_blocks(tmp_path, tiny_dir, text_file, capsys):
    lines = text_file.read_text().split("\n")
    records = [{"prompt": lines[i], "completion": " ".join(lines[i + 1 : i + 2 + i % 4])} for i in range(0, 60, 3)]
    data = tmp_path / "records.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    kw = dict(max_steps=3, batch_size=4, precision="fp32", lora_dropout=0.0)  # dropout draws depend on shapes
    on = train(tiny_train_config(tmp_path, tiny_dir, data, output=str(tmp_path / "on"), **kw), progress=True)
    assert "packed records" in "".join(capsys.readouterr())
    off = train(tiny_train_config(tmp_path, tiny_dir, data, output=str(tmp_path / "off"), pack_records="off", **kw),
                progress=True)
    assert "packed records" not in "".join(capsys.readouterr())
    assert on.losses == pytest.approx(off.losses, rel=1e-4) and on.tokens == off.tokens
    train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "txt"), max_steps=1), progress=True)
    assert "packed records" not in "".join(capsys.readouterr())  # text blocks are all one length


# ------------------------------------------------------------------------------------------------ recomputation


def _saved_and_grads(model, batch, recompute):
    """Bytes the compiled decoder layers keep for backward (parameters aside) and the LoRA gradients."""
    torch._dynamo.reset()  # compiled code is cached per layer code and shapes: each case compiles afresh
    params = {p.data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        if t.data_ptr() not in params:
            kept[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    fused.compile_layers(model)
    try:
        with fused.recomputing(recompute), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = loss_sum(model, batch)
        loss.backward()
    finally:
        fused.uncompile_layers(model)
        torch._dynamo.reset()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return sum(kept.values()), grads


def test_recomputing_keeps_less_and_gives_the_same_gradients(tokenizer):
    model = attach_lora(make_model(tokenizer, hidden=64), rank=4, alpha=8, dropout=0.0, targets=["all-linear"])
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(3, len(tokenizer), (2, 48))
    batch = {"input_ids": ids, "labels": ids.clone()}
    plain_bytes, plain = _saved_and_grads(model, batch, False)
    lean_bytes, lean = _saved_and_grads(model, batch, True)
    # what goes, at least: each layer's SwiGLU product (the down projection's input) and a normed input (fp32,
    # hidden 64, intermediate 128, 2 x 48 tokens, 2 layers); measured: those and three of the four normed inputs
    assert plain_bytes - lean_bytes >= 2 * (128 + 64) * 2 * 48 * 4
    assert plain.keys() == lean.keys() and len(plain) == 2 * 7 * 2  # 2 layers x 7 linears x (A, B)
    for name in plain:
        torch.testing.assert_close(lean[name], plain[name], rtol=1e-4, atol=1e-6)


def _lean_pair(tokenizer, dtype=torch.float32):
    """One tiny Llama (its base weights in `dtype`, as train loads them) with LoRA on every linear (B not zero),
    and an identical copy with lean layers."""
    models = []
    for _ in range(2):
        base = make_model(tokenizer).to(dtype)
        model = attach_lora(base, rank=4, alpha=8, dropout=0.0, targets=["all-linear"])
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        models.append(model)
    assert fused.lean_layers(models[1]) == ["rms_norm", "swiglu"]
    return models


def _kept_bytes_loss_grads(model, batch, autocast=False):
    params = {p.data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        if t.data_ptr() not in params:
            kept[(t.data_ptr(), tuple(t.shape), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss, _ = loss_sum(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sum(kept.values()), loss.detach(), grads


@pytest.mark.parametrize("autocast", [False, True])
def test_lean_layers_keep_less_and_give_the_same_loss_and_gradients(tokenizer, autocast):
    # bf16 as train runs it: a bf16 base, fp32 LoRA weights, autocast
    plain, lean = _lean_pair(tokenizer, torch.bfloat16 if autocast else torch.float32)
    ids = torch.randint(3, len(tokenizer), (2, 48))
    batch = {"input_ids": ids, "labels": ids.clone()}
    plain_bytes, plain_loss, plain_grads = _kept_bytes_loss_grads(plain, batch, autocast)
    lean_bytes, lean_loss, lean_grads = _kept_bytes_loss_grads(lean, batch, autocast)
    assert torch.equal(lean_loss, plain_loss)  # the forward is the same computation
    assert plain_grads.keys() == lean_grads.keys() and len(plain_grads) == 2 * 7 * 2
    tol = dict(rtol=2e-2, atol=1e-4) if autocast else dict(rtol=1e-4, atol=1e-6)
    for name in plain_grads:
        torch.testing.assert_close(lean_grads[name], plain_grads[name], **tol)
    tokens, hidden, inter, layers = 2 * 48, 64, 128, 2
    # silu(gate) is no longer kept: one MLP-wide tensor a layer (fp32, or bf16 under autocast); under autocast each
    # norm also keeps its bf16 input instead of the fp32 upcast (half of 4 bytes x hidden, two norms a layer)
    saved = layers * tokens * inter * (2 if autocast else 4) + (layers * 2 * tokens * hidden * 2 if autocast else 0)
    assert plain_bytes - lean_bytes >= saved
    fused.unlean_layers(lean)
    assert not any("forward" in vars(m) for m in lean.modules() if type(m).__name__.endswith(("RMSNorm", "MLP")))


def test_lean_norm_gives_the_weight_gradient_of_a_training_norm(tokenizer):
    plain, lean = _lean_pair(tokenizer)
    for model in (plain, lean):
        for name, p in model.named_parameters():
            p.requires_grad_("norm" in name)
    ids = torch.randint(3, len(tokenizer), (2, 48))
    batch = {"input_ids": ids, "labels": ids.clone()}
    _, _, plain_grads = _kept_bytes_loss_grads(plain, batch)
    _, _, lean_grads = _kept_bytes_loss_grads(lean, batch)
    assert len(plain_grads) == 2 * 2 + 1  # two norms a layer and the final one
    for name in plain_grads:
        torch.testing.assert_close(lean_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6)


def test_lean_layers_leave_other_architectures_alone(tokenizer):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert fused.lean_layers(Gemma3ForCausalLM(config)) == []


def test_train_recomputes_in_eager_layers_and_its_switch_turns_it_off(tmp_path, tiny_dir, text_file, capsys):
    on = train(tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=3, output=str(tmp_path / "on")),
               progress=True)
    assert "cheap activations recomputed" in capsys.readouterr().err
    assert not any("forward" in vars(m) for m in on.model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP")))
    off = train(tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=3, output=str(tmp_path / "off"),
                                  recompute=False), progress=True)
    assert "recomputed" not in capsys.readouterr().err
    assert on.losses == pytest.approx(off.losses, rel=1e-5)


def test_lean_layers_pass_over_modules_liger_already_replaced(tokenizer, fake_liger):
    model = make_model(tokenizer)
    assert fused.apply_liger(model) == ["rms_norm", "rope", "swiglu"]
    assert fused.lean_layers(model) == []  # Liger's kernels keep no more than the lean functions would
    ids = torch.randint(3, len(tokenizer), (1, 16))
    calls = dict(fake_liger)
    model(input_ids=ids)
    assert fake_liger["swiglu"] > calls["swiglu"] and fake_liger["rms_norm"] > calls["rms_norm"]
    fused.unlean_layers(model)  # leaves Liger's forwards in place
    assert all("forward" in vars(m) for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP")))


# ------------------------------------------------------------------------------------------------ LoRA-aware MLP


def _mlp(model, i=0):
    return model.base_model.model.model.layers[i].mlp


@pytest.mark.parametrize(("dad_in_kernel", "lora_b_in_kernel"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rank", [4, 5])
def test_the_lora_aware_mlp_gives_peft_s_loss_and_gradients(tokenizer, rank, dad_in_kernel, lora_b_in_kernel,
                                                            monkeypatch):
    from tunesmith import lora_mlp

    monkeypatch.setattr(lora_mlp, "DAD_IN_KERNEL", dad_in_kernel)  # A_d's gradient from the backward kernel
    monkeypatch.setattr(lora_mlp, "LORA_B_IN_KERNEL", lora_b_in_kernel)  # and B_g's and B_u's
    plain, fast = _qkv_pair(tokenizer, rank=rank)
    assert fused.fuse_mlp(fast) == 2
    batch = _batch(tokenizer)
    ref_loss, ref = _grads(plain, batch)
    got_loss, got = _grads(fast, batch)
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert set(got) == set(ref) and len(ref) == 28
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # under bf16 autocast each path rounds its own way: the fused one no further from fp32 than PEFT's
    ref_loss16, ref16 = _grads(plain, batch, autocast=torch.bfloat16)
    got_loss16, got16 = _grads(fast, batch, autocast=torch.bfloat16)
    assert got_loss16.item() == pytest.approx(ref_loss.item(), rel=1e-2)
    for name, want in ref.items():
        assert got16[name].dtype == torch.float32
        err16, ref_err16 = ((g[name] - want).norm() / want.norm() for g in (got16, ref16))
        assert err16 < max(2 * ref_err16, 1e-2), name


def test_the_lora_aware_mlp_is_what_runs_and_gives_way_where_it_does_not_apply(tokenizer, monkeypatch):
    plain, fast = _qkv_pair(tokenizer)
    fused.fuse_mlp(fast)
    ids = {k: v for k, v in _batch(tokenizer).items() if k in ("input_ids", "attention_mask")}
    calls = []
    gate = _mlp(fast).gate_proj
    monkeypatch.setattr(gate, "forward", lambda x, *a, **k: calls.append(1) or type(gate).forward(gate, x, *a, **k))
    with torch.no_grad():
        torch.testing.assert_close(fast(**ids).logits, plain(**ids).logits, rtol=1e-5, atol=1e-5)
        assert calls == []  # the function ran, not gate_proj's own forward
        with fast.disable_adapter(), plain.disable_adapter():  # adapters off: the module's own forward
            torch.testing.assert_close(fast(**ids).logits, plain(**ids).logits)
        assert len(calls) == 1


def test_the_lora_aware_mlp_leaves_dropout_and_partial_targets_alone_and_undoes_itself(tokenizer):
    dropped, = _qkv_pair(tokenizer, dropout=0.1)[:1]
    assert fused.fuse_mlp(dropped) == 0
    for targets in (("q_proj", "v_proj"), ("gate_proj", "up_proj")):  # down_proj without an adapter: PEFT's layers
        model, = _qkv_pair(tokenizer, targets=targets)[:1]
        assert fused.fuse_mlp(model) == 0
    wide, = _qkv_pair(tokenizer, rank=fused.MLP_MAX_RANK + 1)[:1]
    assert fused.fuse_mlp(wide) == 0
    from tunesmith.qlora import quantize_base

    dora = attach_lora(make_model(tokenizer), rank=4, alpha=8, dropout=0.0, targets=["all-linear"], dora=True)
    assert fused.fuse_mlp(dora) == 0
    qlora = attach_lora(quantize_base(make_model(tokenizer), "fp8"), rank=4, alpha=8, dropout=0.0,
                        targets=["all-linear"])
    assert fused.fuse_mlp(qlora) == 0  # a quantized base (fp8 codes) is not a torch Linear to cast
    plain, fast = _qkv_pair(tokenizer)
    fused.fuse_mlp(fast)
    fused.unfuse_mlp(fast)
    assert "forward" not in _mlp(fast).__dict__ and not hasattr(_mlp(fast), "tunesmith_mlp_names")
    merged, ref = fast.merge_and_unload(), plain.merge_and_unload()
    for (n, a), (_, b) in zip(merged.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=n)


KERNEL_CHECK = """
import itertools
import torch
from tunesmith import lora_mlp as L
torch.manual_seed(0)
worst = 0.0
shapes = [(70, 200, 8, torch.float32), (33, 130, 5, torch.float32), (64, 256, 16, torch.float16)]
# a row's width in one tile; in several (the sums run across them; a pipeline depth given); in segments of several
# (summed afterwards)
tiles = [(32, 256, 4, 1), (16, 64, 4, 1, 2), (16, 32, 4, 3)]
for (m, n, r, dt), t in itertools.product(shapes, tiles):
    g0, u0, dh0 = (torch.randn(m, n, dtype=dt) for _ in range(3))
    xa, dyb = torch.randn(m, 2 * r, dtype=dt), torch.randn(m, r, dtype=dt)
    bg, bu, ad = torch.randn(n, r, dtype=dt), torch.randn(n, r, dtype=dt), torch.randn(r, n, dtype=dt)
    args = (g0, u0, xa, bg, bu, ad, 0.5, 2.0)
    pairs = list(zip(L._forward_reference(*args), L._forward_triton(*args, tiles=t), strict=True))
    args = (dh0, dyb, ad, g0, u0, xa, bg, bu, 0.5, 2.0, 1.5)
    pairs += list(zip(L._backward_reference(*args), L._backward_triton(*args, tiles=t), strict=True))
    # A_d's gradient summed in the kernel, in place of h; then B_g's and B_u's with it
    pairs += list(zip(L._backward_reference(*args, shares=1), L._backward_triton(*args, tiles=t, shares=1),
                      strict=True))
    pairs.append((pairs[-2][0], (dyb.float().t() @ pairs[-6][0].float() * 1.5).to(dt)))  # = sd dyb^T h
    dg, du, dad = pairs[2][1].float(), pairs[3][1].float(), pairs[8][1]  # the kernel's, one share and none
    three = L._backward_triton(*args, tiles=t, shares=3)
    pairs += list(zip(L._backward_reference(*args, shares=3), three, strict=True))
    pairs += [(three[2][0], dad), (three[2][1], (xa[:, :r].float().t() @ dg * 0.5).to(dt)),
              (three[2][2], (xa[:, r:].float().t() @ du * 2.0).to(dt))]  # = sg xa_g^T dg, su xa_u^T du
    for a, b in pairs:
        assert a.shape == b.shape and a.dtype == b.dtype
        worst = max(worst, ((a.float() - b.float()).abs().max() / a.float().abs().max()).item())
print(worst)
"""


def test_the_mlp_kernels_equal_their_reference_under_triton_s_interpreter(tmp_path):
    """The Triton kernels themselves, run on the CPU by Triton's interpreter (fp32 and fp16: the interpreter's
    bf16 products are not exact; bf16 is checked on the GPU by bench/lora_mlp.py)."""
    import os
    import subprocess

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) < 1e-3


@pytest.mark.parametrize(("row_blocks", "multiprocessors", "expected"), [
    (256, 132, 4), (128, 132, 8), (2048, 132, 1), (1, 132, 8), (264, 132, 2), (64, 108, 8), (512, 108, 1)])
def test_the_mlp_kernels_cut_the_width_until_every_multiprocessor_has_four_programs(row_blocks, multiprocessors,
                                                                                      expected):
    """TILES' segments 0: an H200 (132 multiprocessors) gets 4 segments for the 1B row's 256 row blocks of 64 and 8
    for the 8B row's 128, as measured fastest; enough row blocks need none; never more than MAX_SEGMENTS."""
    from tunesmith import lora_mlp

    assert lora_mlp.TILES["forward"][3] == lora_mlp.TILES["backward"][3] == 0
    assert lora_mlp.auto_segments(row_blocks, multiprocessors) == expected


def test_auto_segments_cut_the_width_into_whole_tiles(monkeypatch):
    pytest.importorskip("triton")
    from tunesmith import lora_mlp

    monkeypatch.setattr(lora_mlp, "_multiprocessors", lambda device: 132)
    assert lora_mlp._segments(14336, 64, 0, 128, None) == (1792, 8)  # the 8B's width, 8 x 28 tiles of 64
    assert lora_mlp._segments(8192, 64, 0, 256, None) == (2048, 4)
    assert lora_mlp._segments(200, 64, 0, 1, None) == (64, 4)  # no more segments than tiles
    assert lora_mlp._segments(200, 64, 3) == (128, 2)  # an explicit count, rounded to whole tiles


def test_train_with_the_lora_aware_mlp_follows_peft_s_and_resumes_exactly(tmp_path, tiny_dir, text_file, capsys):
    import shutil

    kw = dict(max_steps=6, checkpoint_every=3, lora_dropout=0.0, lora_targets=["all-linear"], fused_mlp="on",
              lr=5e-3)
    on = train(tiny_train_config(tmp_path / "on", tiny_dir, text_file, **kw), progress=True)
    assert "LoRA-aware MLP" in "".join(capsys.readouterr())
    off = train(tiny_train_config(tmp_path / "off", tiny_dir, text_file, **{**kw, "fused_mlp": "off"}),
                progress=True)
    assert "LoRA-aware MLP" not in "".join(capsys.readouterr())
    assert on.losses == pytest.approx(off.losses, rel=1e-5) and on.losses[-1] < on.losses[0]
    assert "forward" not in _mlp(on.model).__dict__  # the returned model runs PEFT's layers
    cut = tmp_path / "cut" / "run"
    shutil.copytree(on.run_dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step-000006")
    shutil.rmtree(cut / on.adapter_dir.name)
    again = train(tiny_train_config(tmp_path / "cut", tiny_dir, text_file, resume=True, **kw), progress=False)
    assert again.losses == on.losses


@pytest.mark.parametrize(("setting", "device", "triton", "expected"), [
    ("auto", "cuda", True, True), ("auto", "cuda", False, False), ("auto", "cpu", True, False),
    ("auto", "mps", True, False), ("on", "cpu", False, True), ("off", "cuda", True, False)])
def test_the_lora_aware_mlp_is_chosen_on_cuda_with_triton(setting, device, triton, expected, monkeypatch):
    from tunesmith import train as T
    from tunesmith.config import TrainConfig

    monkeypatch.setattr(T, "triton_available", lambda: triton)
    assert T.uses_fused_mlp(TrainConfig(fused_mlp=setting), device) is expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_sum_equals_the_addmm_chain_and_its_gradients(dtype):
    """x W^T + s (x A^T) B^T as products_sum (the second product added in place) gives addmm's bits and gradients,
    and skips the gradient of an operand that needs none (the frozen weight)."""
    from torch.utils.flop_counter import FlopCounterMode

    from tunesmith.products import products_sum

    g = torch.Generator().manual_seed(0)
    m, k, n, r = 10, 16, 12, 4
    x, xa, b = (torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in ((m, k), (m, r), (n, r)))
    w = torch.randn(n, k, generator=g).to(dtype)  # frozen
    dy = torch.randn(m, n, generator=g).to(dtype)
    want = torch.addmm(x @ w.t(), xa, b.t(), alpha=0.5)
    want_grads = torch.autograd.grad(want, [x, xa, b], dy)
    got = products_sum([x, w.t(), xa, b.t()], [1.0, 0.5])
    with FlopCounterMode(display=False) as count:
        got_grads = torch.autograd.grad(got, [x, xa, b], dy)
    assert torch.equal(got, want)
    for a, e in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert count.get_total_flops() == 2 * m * n * (k + 2 * r)  # dx, d xa, d b: not W's


def test_products_sum_of_three_scales_its_first_term_too():
    from tunesmith.products import products_sum

    g = torch.Generator().manual_seed(1)
    a, b, c, d, e, f = (torch.randn(*s, generator=g) for s in ((5, 3), (3, 4), (5, 2), (2, 4), (5, 6), (6, 4)))
    got = products_sum([a, b, c, d, e, f], [2.0, 1.0, -0.5])
    torch.testing.assert_close(got, 2 * a @ b + c @ d - 0.5 * e @ f)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as count:
        products_sum([a, b, c, d, e, f], [2.0, 1.0, -0.5])
    assert count.get_total_flops() == 2 * 5 * 4 * (3 + 2 + 6)


def test_the_lora_aware_mlp_skips_the_input_gradient_where_none_is_asked_for():
    """An MLP whose input needs no gradient (LoRA on MLPs only: the first one's input comes from frozen layers)
    skips the three products of the input's gradient, and its LoRA gradients stay the same."""
    from torch.utils.flop_counter import FlopCounterMode

    from tunesmith.lora_mlp import LoraMLPFunction

    m, h, n, r = 6, 8, 12, 2
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(*shape, generator=g) for shape in ((n, h), (n, h), (h, n))]
    lora = [torch.randn(*shape, generator=g, requires_grad=True) for shape in ((2 * r, h), (n, r), (n, r), (r, n),
                                                                                 (h, r))]
    x = torch.randn(m, h, generator=g)
    grads, flops = [], []
    for needs in (True, False):
        xin = x.clone().requires_grad_(needs)
        y = LoraMLPFunction.apply(xin, *weights, *lora, 0.5, 2.0, 1.5)
        with FlopCounterMode(display=False) as count:
            got = torch.autograd.grad(y.sum(), [xin, *lora] if needs else lora)
        grads.append(got[-len(lora):])
        flops.append(count.get_total_flops())
    assert flops[0] - flops[1] == 2 * m * h * (2 * n + 2 * r)  # [dg | du] [W_g; W_u] and dxa [A_g; A_u], skipped
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("even", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("arch", [80, 90])
def test_the_mlp_kernels_compile_for_ampere_and_hopper(dtype, arch, even):
    """The kernels as the GPU would build them (Triton's own ptxas, no GPU needed): what the interpreter cannot
    check, such as the products' input precision for each dtype, at the tiles the trainer uses."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from tunesmith import lora_mlp

    constexprs = {"R": 16, "RP": 16, "PRECISION": "ieee" if dtype == "fp32" else "tf32", "EVEN": even}
    for kernel, tiles, shares in ((lora_mlp._swiglu_fwd_kernel, lora_mlp.TILES["forward"], None),
                                  *((lora_mlp._swiglu_bwd_kernel, lora_mlp.TILES["backward"], s) for s in (0, 1, 3))):
        names = kernel.arg_names
        consts = {**constexprs, "BLOCK_M": tiles[0], "BLOCK_N": tiles[1],
                  **({} if shares is None else {"SHARES": shares})}
        sums = ("HA", "DXA", *(("H",) if shares else ()))  # the row sums' and shares' fp32 slots
        signature = {n: "constexpr" if n in consts else "fp32" if n in ("sg", "su", "sd") else
                     "*fp32" if n in sums else
                     f"*{dtype}" if n.isupper() and n not in ("M", "N", "W") else "i32" for n in names}
        src = ASTSource(kernel, signature, {(names.index(n),): v for n, v in consts.items()})
        built = compile(src, target=GPUTarget("cuda", arch, 32),
                        options=lora_mlp._options(tiles, {"bf16": torch.bfloat16, "fp16": torch.float16,
                                                                  "fp32": torch.float32}[dtype]))
        assert built.asm["cubin"] and ".target sm_" in built.asm["ptx"]
        # what a program may have on every GPU the kernels serve (sm_75's 64 KB the least): bf16 and fp16 pipeline
        # only the rank-r tiles, fp32 its full-size tiles at one stage
        assert built.metadata.shared <= 64 * 1024
