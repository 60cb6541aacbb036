"""Cheap activations recomputed: decoder layers that keep less for the backward pass.

Compiled layers get it from the compiler (`compile.recomputing`, for the span of the training loop). Eager
Llama-family layers (CPU, MPS, --compile off) get plain-PyTorch functions: each RMSNorm keeps its input as it came
and 1/rms instead of its fp32 upcast, each gated MLP its gate and up projections without silu(gate), recomputing
the rest in backward. Same outputs; gradients to float rounding.
"""

from __future__ import annotations

import torch

from tunesmith.kernels.base import Setting, causal_lm, restore_all
from tunesmith.kernels.liger import replace_norms_and_mlps


class _RMSNorm(torch.autograd.Function):
    """transformers' Llama RMSNorm, w * (x / rms(x)) with the normalisation in fp32 and the product in x's dtype,
    keeping for backward only x as it came (bf16 under autocast, where eager autograd keeps its fp32 upcast) and
    1/rms per token; the normalised x is recomputed from them."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).float()
            grad_x = (rstd * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, None


class _SiLUMul(torch.autograd.Function):
    """silu(a) * b, the gated MLP's product, keeping a and b (what its backward needs anyway) and recomputing
    silu(a), which eager autograd keeps as a third tensor of the MLP's width."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.nn.functional.silu(a) * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = torch.ops.aten.silu_backward(grad * b, a) if ctx.needs_input_grad[0] else None
        grad_b = grad * torch.nn.functional.silu(a) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def _lean_norm(self, x):
    return _RMSNorm.apply(x, self.weight, self.variance_epsilon)


def _lean_mlp(self, x):
    return self.down_proj(_SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))


def lean_layers(model: torch.nn.Module) -> list[str]:
    """Eager decoder layers that keep less for the backward pass (what `recomputing` has the compiler do): each
    RMSNorm keeps its input as it came and 1/rms instead of its fp32 upcast, each gated MLP its gate and up
    projections without silu(gate), recomputing the rest in backward. Plain PyTorch, so the CPU and MPS get it;
    same outputs, gradients to float rounding. Llama-family models only (Liger's kernels, where applied, already
    keep no more); instance by instance, undone by `unlean_layers`. Returns what was replaced."""
    return replace_norms_and_mlps(causal_lm(model), _lean_norm, _lean_mlp, Recompute.name)


def unlean_layers(model: torch.nn.Module) -> torch.nn.Module:
    """What `lean_layers` did, undone: the modules' own forwards again."""
    try:
        lm = causal_lm(model)
    except (AttributeError, TypeError):
        return model
    restore_all(lm, Recompute.name)
    return model


class Recompute:
    """--recompute (on by default): in compiled layers through the compiler's activation memory budget, in eager
    Llama-family layers through `lean_layers` (not under FSDP2, whose layers it does not reach)."""

    name = "cheap activations recomputed"
    tolerance = 1e-5  # the same functions, recomputed

    def applies(self, setting: Setting, model) -> bool:
        return setting.auto and bool(getattr(setting.cfg, "recompute", True)) and (
            setting.compiled or not setting.fsdp)

    def apply(self, model, setting: Setting) -> str | None:
        if setting.compiled:  # the compiler does it, inside compile.recomputing (the trainer's loop)
            return self.name
        return self.name if lean_layers(model) else None

    def undo(self, model) -> None:
        unlean_layers(model)


PATH = Recompute()
