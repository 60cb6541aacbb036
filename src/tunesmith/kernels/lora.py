"""Fused LoRA: each PEFT LoRA linear computes base + scaling x B(A(x)) with the low-rank product accumulated into the
base product's output (and, backward, into the input's gradient) by BLAS addmm, instead of materialising the LoRA
output, scaling it and adding it: fewer full-size tensors written and read per layer. Plain PyTorch, so every
device; where the layers are compiled the compiler fuses PEFT's own path faster, so it stays off there. Saving,
merging and loading stay PEFT's.
"""

from __future__ import annotations

import torch

from tunesmith.kernels.base import Setting, lora_name, replace_forward, replaced_by, restore_all


class _LoraLinear(torch.autograd.Function):
    """y = x W^T + b + s (x_d A^T) B^T, with x_d = x (no dropout) or dropout(x) given separately.

    Forward: the base product, then the rank-r product added into it in place (addmm with beta 1). Backward: the
    input's gradient g W, with s (g B) A added into it in place when x_d is x; A's and B's gradients from the rank-r
    intermediates. Saves what PEFT's path saves (the input and the rank-r activation); the frozen weight is the
    parameter itself whenever it is already in the compute dtype."""

    @staticmethod
    def forward(ctx, x, x_drop, weight, bias, lora_a, lora_b, scaling, dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dtype)
        xd = x2 if x_drop is None else x_drop.reshape(-1, shape[-1]).to(dtype)
        w, a, b = weight.to(dtype), lora_a.to(dtype), lora_b.to(dtype)
        y = torch.nn.functional.linear(x2, w, None if bias is None else bias.to(dtype))
        xa = xd @ a.t()
        y.addmm_(xa, b.t(), alpha=scaling)
        ctx.save_for_backward(xd, xa, w, a, b)
        ctx.scaling, ctx.shape, ctx.separate = scaling, shape, x_drop is not None
        ctx.dtypes = (x.dtype, lora_a.dtype, lora_b.dtype)
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        xd, xa, w, a, b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)
        gb = (g @ b).mul_(ctx.scaling)  # d loss / d (x_d A^T), [tokens, r]
        grad_x = grad_drop = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ w
            if not ctx.separate:
                grad_x.addmm_(gb, a)
            grad_x = grad_x.view(ctx.shape).to(ctx.dtypes[0])
        if ctx.separate and ctx.needs_input_grad[1]:
            grad_drop = (gb @ a).view(ctx.shape).to(ctx.dtypes[0])
        grad_a = (gb.t() @ xd).to(ctx.dtypes[1]) if ctx.needs_input_grad[4] else None
        grad_b = (g.t() @ xa).mul_(ctx.scaling).to(ctx.dtypes[2]) if ctx.needs_input_grad[5] else None
        return grad_x, grad_drop, None, None, grad_a, grad_b, None, None


def _forward(self, x, *args, **kwargs):
    """A PEFT lora.Linear's forward through `_LoraLinear` where it is plain LoRA (`lora_name`); anything else
    (adapters disabled or merged, DoRA, a LoRA bias, a quantized or trainable base, mixed dtypes outside autocast,
    extra arguments, a dropout module PEFT did not make) takes PEFT's own forward."""
    plain = type(self).forward
    name = None if args or kwargs else lora_name(self)
    if name is None:
        return plain(self, x, *args, **kwargs)
    base, lora_a, lora_b = self.base_layer, self.lora_A[name], self.lora_B[name]
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    elif x.dtype == base.weight.dtype == lora_a.weight.dtype == lora_b.weight.dtype:
        dtype = x.dtype
    else:
        return plain(self, x, *args, **kwargs)
    dropout = self.lora_dropout[name]
    if isinstance(dropout, torch.nn.Dropout):
        x_drop = dropout(x) if dropout.training and dropout.p > 0 else None
    elif isinstance(dropout, torch.nn.Identity):
        x_drop = None
    else:  # a dropout PEFT did not make: its own forward applies it
        return plain(self, x, *args, **kwargs)
    return _LoraLinear.apply(x, x_drop, base.weight, base.bias, lora_a.weight, lora_b.weight,
                             float(self.scaling[name]), dtype)


def fuse_lora(model: torch.nn.Module) -> int:
    """Route every PEFT LoRA linear of `model` over a torch Linear through the fused forward. Returns how many."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if type(module) is LoraLinear and type(module.base_layer) is torch.nn.Linear and not replaced_by(module):
            replace_forward(module, _forward, FusedLora.name)
            count += 1
    return count


class FusedLora:
    """Fused LoRA: LoRA (not DoRA), eager layers (CPU, MPS, --compile off), not under FSDP2."""

    name = "fused LoRA"
    tolerance = 1e-5  # the same products, the sum made in place

    def applies(self, setting: Setting, model) -> bool:
        return setting.lora and not setting.compiled

    def apply(self, model, setting: Setting | None = None) -> str | None:
        return self.name if fuse_lora(model) else None

    def undo(self, model) -> None:
        restore_all(model, self.name)


PATH = FusedLora()
