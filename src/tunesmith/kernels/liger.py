"""Liger Kernel's Triton RMSNorm, SwiGLU and RoPE on a Llama-family model, on CUDA (`pip install 'tunesmith[cuda]'`).

Instance by instance: other models in the process keep their eager modules. RoPE is a module-level function in
transformers, so its swap is too, and it sends only CUDA inputs to Liger's kernel. Not where the layers replay as
CUDA graphs: Liger's RoPE writes into its inputs, and torch runs a layer whose graph mutates an input without its
graph.
"""

from __future__ import annotations

import importlib
import sys

from tunesmith.kernels.base import Setting, causal_lm, model_type, replace_forward, restore_all
from tunesmith.kernels.liger_loss import liger_available

MODEL_TYPES = ("llama",)  # RMSNorm + SwiGLU MLP + rotate-half RoPE, the shapes Liger's kernels compute


def _rms_norm(self, x):
    from liger_kernel.transformers.functional import liger_rms_norm

    return liger_rms_norm(x, self.weight, self.variance_epsilon)


def _swiglu(self, x):
    from liger_kernel.transformers.functional import liger_swiglu

    return self.down_proj(liger_swiglu(self.gate_proj(x), self.up_proj(x)))


def replace_norms_and_mlps(lm, norm_forward, mlp_forward, owner: str) -> list[str]:
    """Give each RMSNorm of a Llama-family model `norm_forward` and each SiLU-gated MLP `mlp_forward`, instance by
    instance, passing over modules another path already gave a forward; returns what was replaced. What Liger's
    kernels and `recompute` both replace."""
    if getattr(lm.config, "model_type", None) not in MODEL_TYPES:
        return []
    silu = getattr(lm.config, "hidden_act", "silu") == "silu"
    done = []
    for module in lm.modules():
        if "forward" in vars(module):
            continue
        kind = type(module).__name__
        if kind.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            replace_forward(module, norm_forward, owner)
            done.append("rms_norm")
        elif kind.endswith("MLP") and silu and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            replace_forward(module, mlp_forward, owner)
            done.append("swiglu")
    return sorted(set(done))


def _patch_rope(lm) -> bool:
    """Liger's RoPE kernel in place of transformers' apply_rotary_pos_emb for CUDA inputs."""
    from liger_kernel.transformers.functional import liger_rope

    module = importlib.import_module(type(lm).__module__)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    if getattr(original, "_tunesmith_liger", False):
        return True

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if q.is_cuda and not args and set(kwargs) <= {"unsqueeze_dim"} and cos.shape[-1] == q.shape[-1]:
            return liger_rope(q, k, cos, sin, unsqueeze_dim=kwargs.get("unsqueeze_dim", 1))
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._tunesmith_liger = True
    apply_rotary_pos_emb._tunesmith_original = original
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def _unpatch_rope(lm) -> None:
    module = sys.modules.get(type(lm).__module__)
    patched = getattr(module, "apply_rotary_pos_emb", None)
    if getattr(patched, "_tunesmith_liger", False):
        module.apply_rotary_pos_emb = patched._tunesmith_original


class Liger:
    """Liger's RMSNorm, SwiGLU and RoPE kernels: CUDA, a Llama-family model, layers not replayed as CUDA graphs."""

    name = "liger"
    tolerance = 1e-2  # Triton kernels in the compute dtype (bf16): rounding differs from transformers' eager ops

    def wanted(self, setting: Setting, model) -> bool:
        """Whether this run would take Liger's kernels if liger-kernel were installed."""
        return setting.auto and setting.device == "cuda" and not setting.graphs and model_type(model) in MODEL_TYPES

    def applies(self, setting: Setting, model) -> bool:
        return self.wanted(setting, model) and liger_available()

    def apply(self, model, setting: Setting | None = None) -> str | None:
        lm = causal_lm(model)
        if getattr(lm.config, "model_type", None) not in MODEL_TYPES:  # nor its model file's RoPE
            return None
        done = replace_norms_and_mlps(lm, _rms_norm, _swiglu, self.name)
        if _patch_rope(lm):
            done.append("rope")
        return f"Liger {', '.join(sorted(set(done)))}" if done else None

    def undo(self, model) -> None:
        lm = causal_lm(model)
        restore_all(lm, self.name)
        _unpatch_rope(lm)


PATH = Liger()
