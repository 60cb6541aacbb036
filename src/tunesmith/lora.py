"""LoRA through PEFT: attach, count, load. The adapter folder is plain PEFT format."""

from __future__ import annotations

from pathlib import Path

import torch

from tunesmith.errors import TunesmithError
from tunesmith.storage import PICKLE_SUFFIXES, check_safetensors

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def attach_lora(
    model: torch.nn.Module,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.05,
    targets: list[str] | str = ("q_proj", "v_proj"),
):
    """Wrap `model` with fresh LoRA adapters (B is zero, so the output is unchanged until training)."""
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise TunesmithError(f"--lora-rank must be >= 1, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise TunesmithError(f"--lora-dropout must be in [0, 1), got {dropout}")
    target_modules: list[str] | str = "all-linear" if list(targets) == ["all-linear"] else list(targets)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM"
    )
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise TunesmithError(f"--lora-targets {','.join(targets)}: {e}. Linear layers here: {', '.join(names)}") from None


def trainable_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_adapter_folder(path: str | Path) -> Path:
    """The folder must hold a PEFT adapter saved as safetensors; list everything that is missing."""
    p = Path(path)
    if not p.is_dir():
        raise TunesmithError(f"adapter folder not found: {p}")
    missing = [f for f in ADAPTER_FILES if not (p / f).is_file()]
    pickled = sorted(f.name for f in p.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if ADAPTER_FILES[1] in missing and pickled:  # PEFT would fall back to torch.load; tunesmith never does
        raise TunesmithError(
            f"{p} holds its adapter as pickle ({', '.join(pickled)}), which can run code when loaded; tunesmith reads "
            f"adapters only as {ADAPTER_FILES[1]}. Convert it with a tool you trust"
        )
    if missing:
        raise TunesmithError(f"{p} is not a PEFT adapter folder: missing {', '.join(missing)}")
    check_safetensors(p / ADAPTER_FILES[1])  # truncated or damaged: a named error, not a crash inside PEFT
    return p


def load_adapter(model: torch.nn.Module, path: str | Path, trainable: bool = False):
    """Apply a saved PEFT adapter to `model` (safetensors only)."""
    from peft import PeftModel

    folder = check_adapter_folder(path)
    try:
        return PeftModel.from_pretrained(model, folder, is_trainable=trainable)
    except (ValueError, RuntimeError, KeyError) as e:
        raise TunesmithError(f"could not apply adapter {folder}: {str(e).splitlines()[0]}") from None
