"""The trainer's fast paths, one module each, behind one protocol (`base`): does it apply, apply, undo.

The trainer asks the registry once, after the trainable parameters are attached (`apply_paths`), and undoes what
was applied in reverse order when training ends (`Applied.undo`). `--fast-paths off` takes none of them: the plain
path (transformers' layers, PEFT's LoRA, evaluate.loss_sum) that every path is tested against.

The order matters where two paths touch one module: Liger's SwiGLU gives way to the LoRA-aware MLP, and the eager
recompute functions pass over modules another path already replaced; the checkpointed layers come after the compiled
ones, whose module calls they take over. A run takes one loss: the first loss path
that applies (Liger's kernel where it can run, else the plain chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tunesmith.kernels import compiled, liger, liger_loss, lora, lora_mlp, loss, nf4, offload, qkv, recompute
from tunesmith.kernels.base import LossFn, Setting

PATHS = (
    liger_loss.PATH,  # the fused loss through Liger's kernel (CUDA)
    loss.PATH,  # the fused loss in plain PyTorch (elsewhere)
    liger.PATH,  # Liger's RMSNorm, SwiGLU, RoPE (CUDA)
    qkv.PATH,  # q, k, v as one product (+ the RoPE kernel on CUDA)
    lora_mlp.PATH,  # the LoRA-aware MLP (CUDA)
    lora.PATH,  # fused LoRA (eager layers)
    nf4.PATH,  # the nf4 base's products through Triton (CUDA), before the layers compile around them
    compiled.PATH,  # regional compile, CUDA graphs
    recompute.PATH,  # cheap activations recomputed
    offload.PATH,  # checkpointed layers, inputs offloaded (after compile: it compiles their forwards instead)
)


@dataclass
class Applied:
    """The paths a run took, in the order they were applied, and what the start line says of them."""

    paths: list = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    loss: LossFn | None = None  # a loss path's loss function (None: the plain one)

    def took(self, path) -> bool:
        return path in self.paths

    def undo(self, model: torch.nn.Module) -> torch.nn.Module:
        """Undo every path, last applied first: the model's forwards are again those it had before."""
        while self.paths:
            self.paths.pop().undo(model)
        self.labels.clear()
        return model


def apply_paths(model: torch.nn.Module, setting: Setting, paths=PATHS) -> Applied:
    """Apply each path of `paths` that applies to this run and model; what was applied, to undo later."""
    applied = Applied()
    for path in paths:
        is_loss = hasattr(path, "loss")
        if (is_loss and applied.loss is not None) or not path.applies(setting, model):
            continue
        label = path.apply(model, setting)
        if label is None:  # nothing in this model it could change
            continue
        applied.paths.append(path)
        applied.labels.append(label)
        if is_loss:
            applied.loss = path.loss(setting)
    return applied


__all__ = ["PATHS", "Applied", "Setting", "apply_paths"]
