"""Fused q/k/v: a Llama attention's q, k and v projections as one product over their joined frozen weights, their
LoRA down-projections as one more (the input read once, not once per adapter) and the up-projections added in as
one block-diagonal product (dropout 0). On CUDA, RoPE is applied straight out of the joined product by one Triton
kernel a direction (`rope.rope_qkv`), in place of the split, transformers' RoPE and the compiler's kernels for
them. Plain PyTorch otherwise, so every device; in compiled layers the compiler derives its backward.
"""

from __future__ import annotations

import sys

import torch

from tunesmith.kernels import nf4
from tunesmith.kernels.base import Setting, nf4_base, plain_lora, replace_forward, restore_forward

QKV = ("q_proj", "k_proj", "v_proj")
ROPE_ON_CPU = False  # tests: rope_qkv's PyTorch reference on the CPU


def _frozen_linear(layer) -> bool:
    """A frozen bias-free torch Linear, or nf4 base (QLoRA's, `base.nf4_base`) of a projection with no adapter."""
    return layer.bias is None and (nf4_base(layer) or (type(layer) is torch.nn.Linear
                                                       and not layer.weight.requires_grad))


def _qkv_parts(module) -> list[str | None] | None:
    """For each of q/k/v: its adapter's name (a plain LoRA layer) or None (a frozen bias-free Linear with no
    adapter); None if any projection is neither or none has an adapter."""
    if not all(hasattr(module, p) for p in QKV):
        return None
    layers = [getattr(module, p) for p in QKV]
    names = [plain_lora(layer, nf4=True) for layer in layers]
    if not any(names) or any(n is None and not _frozen_linear(layer) for n, layer in zip(names, layers, strict=True)):
        return None
    if len({nf4_base(_holder(layer)) for layer in layers}) != 1:  # all three nf4, or none
        return None
    return names


def _forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """LlamaAttention's training forward with q, k and v from one product: x [Wq; Wk; Wv]^T for the frozen
    weights, x [A..]^T for the LoRA down-projections together (the input read once, not once per adapter), and the
    up-projections as one block-diagonal product added into the first in place (`products.products_sum`; a
    projection without an adapter gets a zero block). The same function as PEFT's layers (tests: loss and gradients); anything else -- a KV cache,
    adapters switched off or merged since -- goes through the model's own forward."""
    from tunesmith.kernels.products import products_sum

    names = _qkv_parts(self)
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    autocast = torch.is_autocast_enabled(hidden_states.device.type)
    if (cache is not None or names != self.tunesmith_qkv_names or position_embeddings is None
            or not (autocast or len({hidden_states.dtype} | {p.dtype for p in self.parameters()}) == 1)):
        return type(self).forward(self, hidden_states=hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, **kwargs)
    kwargs.pop("past_key_values", None)
    kwargs.pop("cache", None)
    layers = [getattr(self, p) for p in QKV]
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    a = torch.cat([layer.lora_A[n].weight for layer, n in zip(layers, names, strict=True) if n])
    b = torch.block_diag(*[layer.lora_B[n].weight * layer.scaling[n] if n else a.new_zeros(size, 0)
                           for layer, n, size in zip(layers, names, self.tunesmith_qkv_sizes, strict=True)])
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    xa = torch.nn.functional.linear(x, a)
    if "tunesmith_qkv_weight" in self._buffers:
        # x W^T + (x A^T) B^T, the second product added into the first in place (torch.addmm would copy the first)
        qkv = products_sum([x.to(dtype), self.tunesmith_qkv_weight.to(dtype).t(), xa.to(dtype), b.to(dtype).t()],
                           [1.0, 1.0])
    else:  # an nf4 base: the three weights decoded into one buffer for one product, forward and backward
        holders = [_holder(layer) for layer in layers]
        parts = [t for h in holders for t in nf4.nf4_parts(h.qweight)]
        sizes = [n for h in holders for n in (h.out_features, h.in_features, h.qweight.scaler_block_size)]
        qkv = nf4.nf4_joined_mm(x.to(dtype), parts, sizes, True).addmm_(xa.to(dtype), b.to(dtype).t())
    cos, sin = position_embeddings
    module = sys.modules[type(self).__module__]  # the model file's own RoPE and eager attention (Liger may patch it)
    if _rope_kernel(qkv, hidden_states, cos, module, self.tunesmith_qkv_sizes, self.head_dim):
        from tunesmith.kernels.rope import rope_qkv

        hq, hk = (n // self.head_dim for n in self.tunesmith_qkv_sizes[:2])
        q, k, v = (t.transpose(1, 2) for t in rope_qkv(qkv, cos, sin, hidden_states.shape[0], hq, hk))
    else:
        q, k, v = qkv.split(self.tunesmith_qkv_sizes, dim=-1)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        # v goes to the attention kernel as it is, which keeps it for the backward pass: a view would keep all of
        # the joined output alive with it (q and k are rotated into new tensors anyway)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v.contiguous()))
        q, k = module.apply_rotary_pos_emb(q, k, cos, sin)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = self.config._attn_implementation
    attend = module.eager_attention_forward if impl in (None, "eager") else ALL_ATTENTION_FUNCTIONS[impl]
    out, weights = attend(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                          scaling=self.scaling, **kwargs)
    out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
    return self.o_proj(out), weights


def _rope_kernel(qkv, hidden_states, cos, module, sizes, head_dim) -> bool:
    """Whether this attention's RoPE goes through rope.rope_qkv: CUDA (Triton) or ROPE_ON_CPU,
    [batch, seq, hidden] inputs, transformers' own apply_rotary_pos_emb (not Liger's) over whole heads with
    cos / sin of [batch or 1, seq, head_dim], and k and v of one size."""
    from tunesmith.kernels.rope import triton as rope_triton

    return (((qkv.is_cuda and rope_triton is not None) or ROPE_ON_CPU) and hidden_states.dim() == 3
            and not getattr(module.apply_rotary_pos_emb, "_tunesmith_liger", False) and cos.dim() == 3
            and cos.shape[-1] == head_dim and head_dim % 2 == 0 and cos.shape[1] == hidden_states.shape[1]
            and sizes[1] == sizes[2] and sizes[0] % head_dim == 0 and sizes[1] % head_dim == 0)


def _holder(layer) -> torch.nn.Linear:
    """A projection's frozen base: the layer itself, or the base under its LoRA."""
    return layer.base_layer if hasattr(layer, "base_layer") else layer


def fuse_qkv(model: torch.nn.Module) -> int:
    """Give each Llama attention whose q_proj, k_proj and v_proj are plain LoRA layers at dropout 0 (`_plain_lora`)
    or frozen bias-free Linears, at least one with an adapter, the one-product forward. The three frozen weights
    become views into one [Wq; Wk; Wv] buffer (no copy kept). Returns how many attentions; `unfuse_qkv` undoes it."""
    count = 0
    for module in model.modules():
        names = _qkv_parts(module) if type(module).__name__ == "LlamaAttention" else None
        if names is None:
            continue
        holders = [_holder(getattr(module, p)) for p in QKV]
        if nf4_base(holders[0]):  # QLoRA: the codes stay as they are; the forward joins the decoded weights
            module.tunesmith_qkv_sizes = [h.out_features for h in holders]
            module.tunesmith_qkv_names = names
            replace_forward(module, _forward, FusedQkv.name)
            count += 1
            continue
        weights = [h.weight for h in holders]
        if len({(w.dtype, w.device) for w in weights}) != 1:
            continue
        whole = torch.cat([w.detach() for w in weights])
        module.register_buffer("tunesmith_qkv_weight", whole, persistent=False)
        module.tunesmith_qkv_sizes = [w.shape[0] for w in weights]
        module.tunesmith_qkv_names = names
        for holder, part in zip(holders, whole.split(module.tunesmith_qkv_sizes), strict=True):
            holder.weight = torch.nn.Parameter(part, requires_grad=False)
        replace_forward(module, _forward, FusedQkv.name)
        count += 1
    return count


def unfuse_qkv(model: torch.nn.Module) -> torch.nn.Module:
    """What `fuse_qkv` did, undone: the model's own attention forward, each weight its own tensor again."""
    for module in model.modules():
        if "tunesmith_qkv_names" not in vars(module):
            continue
        if "tunesmith_qkv_weight" in module._buffers:
            for p in QKV:
                holder = _holder(getattr(module, p))
                holder.weight = torch.nn.Parameter(holder.weight.detach().clone(), requires_grad=False)
            del module.tunesmith_qkv_weight
        del module.tunesmith_qkv_sizes, module.tunesmith_qkv_names
        restore_forward(module, FusedQkv.name)
    return model


class FusedQkv:
    """Fused q/k/v: Llama attention with plain LoRA at dropout 0 on any of q, k, v; LoRA, not under FSDP2."""

    name = "fused q/k/v"
    tolerance = 1e-5  # the same products, joined

    def applies(self, setting: Setting, model) -> bool:
        return setting.lora

    def apply(self, model, setting: Setting | None = None) -> str | None:
        return self.name if fuse_qkv(model) else None

    def undo(self, model) -> None:
        unfuse_qkv(model)


PATH = FusedQkv()
