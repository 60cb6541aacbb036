"""What every fast path is, and the few things several of them share.

A fast path computes what the plain path computes (transformers' layers, PEFT's LoRA, evaluate.loss_sum), faster or
in less memory. Each one is an object with
- `name`: how tests and notes call it;
- `tolerance`: how far its gradients may be from the plain path's, relative to their size (0: the same bits);
- `applies(setting, model)`: whether this run takes it (the config, the device, the model's shape);
- `apply(model, setting)`: change the model (or nothing, for a loss), returning what the start line says of it,
  or None when it found nothing to change;
- `undo(model)`: what `apply` did, undone: the model's forward is again the one it had, bit for bit.
A loss path also has `loss(setting)`: the training loss function it stands for.

A path replaces a module's `forward` on the instance (other models in the process keep their own) through
`replace_forward`, which remembers what it replaced, so that undoing the paths in reverse order restores every
module exactly, whichever paths replaced the same module in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch

# (model, batch) -> (loss summed over the batch's supervised tokens, their count); evaluate.loss_sum is the plain one
LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, int]]


@dataclass(frozen=True)
class Setting:
    """What decides which fast paths a run takes: its config (a TrainConfig, or anything with the same fields) and
    where it runs."""

    cfg: Any
    device: str  # cuda, mps or cpu
    world: int = 1  # processes training together
    fsdp: bool = False  # the model is sharded by FSDP2
    varied: bool = False  # the training examples differ in length (.jsonl records, not --seq-len text blocks)

    @property
    def auto(self) -> bool:
        """--fast-paths auto: take the paths that apply (off: the plain path throughout)."""
        return getattr(self.cfg, "fast_paths", "auto") == "auto"

    @property
    def lora(self) -> bool:
        """Plain LoRA on a model of one process's own (the paths that compute PEFT's LoRA in their own way)."""
        return self.auto and self.cfg.fine_tune_type == "lora" and not self.fsdp

    @property
    def compiled(self) -> bool:
        """--compile auto compiles on CUDA with the fast paths on, except under FSDP2 (its hooks around each layer
        would go inside the compiled region); on compiles anywhere."""
        compile_ = getattr(self.cfg, "compile", "auto")
        return compile_ == "on" or (compile_ == "auto" and self.auto and self.device == "cuda" and not self.fsdp)

    @property
    def graphs(self) -> bool:
        """The compiled layers replay as CUDA graphs: one CUDA GPU, LoRA on a plain base, no gradient checkpointing
        (whose recomputation would run a graphed layer inside the backward pass), examples of one length (a graph
        is recorded, and its memory kept, for every shape a batch comes in)."""
        cfg = self.cfg
        return (self.compiled and self.device == "cuda" and self.world == 1 and not cfg.gradient_checkpointing
                and cfg.quantize_base == "none" and cfg.fine_tune_type == "lora" and not self.varied)


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside accelerate's / DDP's wrapper and PEFT's."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) or type(model).__name__ == "OptimizedModule":
            model = model.module if hasattr(model, "module") else model._orig_mod
        elif hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            return model


def model_type(model: torch.nn.Module) -> str | None:
    return getattr(getattr(causal_lm(model), "config", None), "model_type", None)


def replace_forward(module: torch.nn.Module, forward: Callable, owner: str) -> None:
    """Give `module` (this instance only) `forward`, remembering the forward it replaced and which path did it."""
    state = vars(module)
    state.setdefault("_tunesmith_forwards", []).append((owner, state.get("forward")))
    module.forward = MethodType(forward, module)


def restore_forward(module: torch.nn.Module, owner: str) -> bool:
    """Undo `owner`'s replace_forward on `module` (the last one made there); False if it made none."""
    state = vars(module)
    stack = state.get("_tunesmith_forwards")
    if not stack or stack[-1][0] != owner:
        return False
    _, before = stack.pop()
    if before is None:
        del module.forward
    else:
        module.forward = before
    if not stack:
        del state["_tunesmith_forwards"]
    return True


def replaced_by(module: torch.nn.Module) -> str | None:
    """The path whose forward `module` now runs (None: its own, or one set outside tunesmith)."""
    stack = vars(module).get("_tunesmith_forwards")
    return stack[-1][0] if stack else None


def restore_all(model: torch.nn.Module, owner: str) -> int:
    """Undo `owner`'s forwards on every module of `model`; how many."""
    return sum(restore_forward(m, owner) for m in model.modules())


def nf4_base(base) -> bool:
    """Whether `base` is a frozen nf4 QuantLinear (QLoRA's) whose products the nf4 kernels take: blocks of 64
    within its rows (kernels.nf4)."""
    return (type(base).__name__ == "QuantLinear" and getattr(base, "scheme", None) == "nf4"
            and base.in_features % 64 == 0)  # kernels.nf4.BLOCK (not imported: nf4 imports this module)


def lora_name(layer, nf4: bool = False) -> str | None:
    """The adapter's name if `layer` is a PEFT LoRA linear computing base(x) + s B A dropout(x) plainly: one active
    adapter (not disabled or merged), no DoRA or other variant, no LoRA bias, a frozen torch Linear under it (or,
    with `nf4`, a frozen nf4 base: `nf4_base`); else None. What the LoRA paths may compute in their own way."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if type(layer) is not LoraLinear or layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name, base = layer.active_adapters[0], layer.base_layer
    frozen = (nf4 and nf4_base(base)) or (type(base) is torch.nn.Linear and not base.weight.requires_grad)
    if (name not in layer.lora_A or name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name)
            or type(layer.lora_A[name]) is not torch.nn.Linear or layer.lora_B[name].bias is not None
            or not frozen or (base.bias is not None and base.bias.requires_grad)):
        return None
    return name


def plain_lora(layer, nf4: bool = False) -> str | None:
    """The adapter name if `layer` is plain LoRA (`lora_name`, over an nf4 base too with `nf4`) with no dropout over
    a bias-free base, whose output is base(x) + s B A x exactly; else None."""
    name = lora_name(layer, nf4)
    if name is None or layer.base_layer.bias is not None:
        return None
    dropout = layer.lora_dropout[name]
    if not (isinstance(dropout, torch.nn.Identity) or (type(dropout) is torch.nn.Dropout and dropout.p == 0)):
        return None
    return name


def compute_dtype(x: torch.Tensor, module: torch.nn.Module) -> torch.dtype | None:
    """The dtype a replaced forward computes in: autocast's, else the one dtype of the input and the module's
    parameters; None where they are mixed outside autocast (the module's own forward handles that)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    dtypes = {x.dtype} | {p.dtype for p in module.parameters()}
    return x.dtype if len(dtypes) == 1 else None


def triton_available() -> bool:
    """Whether Triton is importable (the CUDA kernels), without importing it."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None
