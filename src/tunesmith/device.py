"""Which backend runs the work (cuda / mps / cpu) and which precision it can do."""

from __future__ import annotations

import torch

from tunesmith.errors import TunesmithError

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend and backend.is_available())


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' picks cuda, else mps, else cpu; an explicit device that is not there is an error."""
    name = (name or "auto").lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TunesmithError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TunesmithError("--device cuda asked for, but this torch sees no CUDA GPU; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise TunesmithError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type == "mps" and not mps_available():
        raise TunesmithError("--device mps asked for, but MPS is not available (Apple Silicon + macOS 12.3+ needed)")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise TunesmithError(f"unsupported device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    return device


def supports_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "mps":
        return _mps_bf16_supported()
    return True  # CPU computes bf16, though usually no faster than fp32


def _mps_bf16_supported() -> bool:
    # bf16 on MPS needs macOS 14 (Sonoma) and a torch that implements it.
    import platform

    release = platform.mac_ver()[0]
    try:
        major = int(release.split(".")[0]) if release else 0
    except ValueError:
        major = 0
    return major >= 14


def resolve_precision(device: torch.device, requested: str = "auto") -> str:
    """auto: bf16 where supported, else fp16 (with loss scaling), else fp32. CPU stays fp32 (faster there)."""
    requested = (requested or "auto").lower()
    if requested == "auto":
        if device.type == "cpu":
            return "fp32"
        return "bf16" if supports_bf16(device) else "fp16"
    if requested not in PRECISIONS:
        raise TunesmithError(f"unknown precision {requested!r}; use auto, fp32, bf16 or fp16")
    if requested == "bf16" and not supports_bf16(device):
        raise TunesmithError(f"bf16 is not supported on {device} here; use --precision fp16 or fp32")
    if requested == "fp16" and device.type == "cpu":
        raise TunesmithError("fp16 training is not supported on the CPU; use --precision fp32 or bf16")
    return requested


def weight_dtype(device: torch.device, precision: str) -> torch.dtype:
    """Dtype the frozen base weights are loaded in. LoRA weights stay fp32 (PEFT upcasts them)."""
    return DTYPES[precision]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory the process has used on this device (CPU: max resident set size)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
