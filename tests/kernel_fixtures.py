"""Helpers for the kernels tests: a batch, LoRA models with adapters that count, their loss and gradients, and
Liger's functional API with eager stand-ins."""

from __future__ import annotations

import contextlib
import copy
import sys
import types

import torch
import torch.nn.functional as F

from tunesmith.data import IGNORE
from tunesmith.evaluate import loss_sum
from tunesmith.lora import attach_lora

from .conftest import make_model


def make_batch(tokenizer) -> dict[str, torch.Tensor]:
    """Three rows of 12 tokens: a prompt not trained on in the first, right padding in the last."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, len(tokenizer), (3, 12), generator=g)
    labels = ids.clone()
    labels[0, :5] = IGNORE  # a prompt that is not trained on
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0  # right padding
    labels[2, 9:] = IGNORE
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lora_model(tokenizer, rank: int = 4, dropout: float = 0.0, targets=("all-linear",), dtype=torch.float32,
               dora: bool = False):
    """A tiny Llama (base weights in `dtype`) with LoRA adapters whose B is not zero, so the low-rank path counts;
    the same weights every call."""
    model = attach_lora(make_model(tokenizer).to(dtype), rank=rank, alpha=2 * rank, dropout=dropout,
                        targets=list(targets), dora=dora)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


def qlora_model(tokenizer, rank: int = 4, dtype=torch.bfloat16):
    """`lora_model` on an nf4 base (QLoRA) in `dtype`: the same adapters that count, on every linear."""
    from tunesmith.qlora import quantize_base

    model = attach_lora(quantize_base(make_model(tokenizer).to(dtype), "nf4"), rank=rank, alpha=2 * rank,
                        dropout=0.0, targets=["all-linear"])
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


def lora_pair(tokenizer, **kw):
    """Two identical `lora_model`s: the plain one and one for a fast path."""
    return lora_model(tokenizer, **kw), lora_model(tokenizer, **kw)


def loss_and_grads(model, batch, seed: int = 0, autocast=None, loss=loss_sum):
    """The loss (summed, over the batch's supervised tokens) and the trainable parameters' gradients, in train
    mode (seeded: the same dropout masks in two models)."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
        total, _ = loss(model, batch)
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def kept_loss_grads(model, batch, seed: int = 0, autocast=None):
    """Bytes the forward saves for backward (parameters excluded; what the backward's recomputation saves is not
    counted), then `loss_and_grads`'s loss and gradients."""
    params = {p.data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        if t.data_ptr() not in params:
            kept[(t.data_ptr(), tuple(t.shape), t.dtype)] = t.numel() * t.element_size()
        return t

    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
        total, _ = loss_sum(model, batch)
    total.backward()
    return sum(kept.values()), total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                 if p.requires_grad}


def install_fake_liger(monkeypatch) -> dict[str, int]:
    """liger_kernel's functional API with eager stand-ins, counting calls (Liger's kernels need CUDA); the model
    file's apply_rotary_pos_emb restored after the test."""
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


def eager_aot_compile(monkeypatch) -> None:
    """torch.compile through dynamo and AOT autograd, eager kernels (no Inductor code generation): the compiled
    layers' capture and their derived backward, in seconds on the CPU instead of minutes."""
    compile_ = torch.compile

    def compile_eager(model=None, *args, mode=None, **kwargs):
        return compile_(model, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", compile_eager)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: how the kernels' `tolerance` is stated."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def _marks(model) -> dict[str, list[str]]:
    """What a path may leave on module instances: a forward, tunesmith's attributes and buffers."""
    return {name: sorted(k for k in [*vars(m), *m._buffers] if k == "forward" or "tunesmith" in k)
            for name, m in model.named_modules()}


def protocol_check(path, setting, tokenizer, make=None) -> dict:
    """One fast path on a tiny Llama with LoRA (rank 8, dropout 0) on every linear, against an untouched copy:
    whether it applies in `setting`, the label `apply` gave, the loss's and the LoRA gradients' relative errors
    with it applied (a loss path through its own loss), whether the logits after `undo` are the copy's bit for
    bit, and what `undo` left on any module that was not there before. `make(tokenizer, rank=)`: another model
    (qlora_model for a path of the quantized base)."""
    model = (make or lora_model)(tokenizer, rank=8)
    # a second one made alike: torchao's NF4 tensor does not deep-copy with the scaler blocks small layers take
    untouched = make(tokenizer, rank=8) if make else copy.deepcopy(model)
    batch = make_batch(tokenizer)
    marks = _marks(model)
    applies = path.applies(setting, model)
    label = path.apply(model, setting)
    plain_loss, plain = loss_and_grads(untouched, batch)
    fast_loss, fast = loss_and_grads(model, batch, loss=path.loss(setting) if hasattr(path, "loss") else loss_sum)
    path.undo(model)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        bitwise = torch.equal(model.eval()(**inputs, use_cache=False).logits,
                              untouched.eval()(**inputs, use_cache=False).logits)
    return {"applies": applies, "label": label, "loss": relative_error(fast_loss, plain_loss),
            "grads": {n: relative_error(fast[n], plain[n]) for n in plain} if fast.keys() == plain.keys() else None,
            "bitwise": bitwise, "left": {n: v for n, v in _marks(model).items() if v != marks.get(n)}}
