"""Which backend runs the work (cuda / mps / cpu), what it can do (bf16, fp16, fused attention, memory), and how
to recognise and recover from its out-of-memory errors."""

from __future__ import annotations

import functools
import gc
import os
import platform
from dataclasses import dataclass

import torch

from tunesmith.errors import TunesmithError

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MPS_FALLBACK = "PYTORCH_ENABLE_MPS_FALLBACK"  # torch reads it when it loads: ops MPS lacks then run on the CPU
# How each backend words running out of memory (CUDA and recent torch also raise torch.OutOfMemoryError).
OOM_MESSAGES = (
    "CUDA out of memory",
    "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
)


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


def macos_major() -> int:
    """The macOS major version (14 for Sonoma), or 0 when not on macOS."""
    release = platform.mac_ver()[0]
    try:
        return int(release.split(".")[0]) if release else 0
    except ValueError:
        return 0


def _mps_bf16_supported() -> bool:
    # bf16 on MPS needs macOS 14 (Sonoma) and a torch that implements it.
    return macos_major() >= 14 and _torch_mps_bf16()


def _torch_mps_bf16() -> bool:
    """Whether this torch can make a bf16 tensor on MPS (older builds raise)."""
    try:
        torch.ones(1, dtype=torch.bfloat16, device="mps")
    except (RuntimeError, TypeError):
        return False
    return True


def supports_fp16(device: torch.device) -> bool:
    """fp16 training (autocast + loss scaling): CUDA and MPS yes; the CPU has no fast fp16 path."""
    return device.type in ("cuda", "mps")


def fused_sdpa(device: torch.device, precision: str = "bf16", gqa: bool = False) -> bool:
    """Whether scaled_dot_product_attention runs a fused kernel, so attention memory grows with S, not S^2.

    CUDA: flash attention takes bf16/fp16 (grouped-query too); in fp32 the memory-efficient kernel takes over, but
    not for grouped-query attention, which then falls back to the math kernel (memory growing with S^2).
    """
    if device.type == "cuda":
        if precision in ("bf16", "fp16") and torch.backends.cuda.flash_sdp_enabled():
            return True
        return torch.backends.cuda.mem_efficient_sdp_enabled() and not gqa
    if device.type == "mps":
        return _torch_at_least(2, 5)  # the Metal SDPA kernel arrived in torch 2.5
    return True  # torch's CPU flash-attention kernel (torch >= 2.2), grouped-query included


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


def mps_fallback_enabled() -> bool:
    return os.environ.get(MPS_FALLBACK, "0").strip() not in ("", "0")


def enable_mps_fallback() -> str:
    """Set PYTORCH_ENABLE_MPS_FALLBACK=1 unless the user chose a value, and say what holds.

    torch reads the variable when it loads, so the CLI sets it before importing torch; from Python, set it
    before `import torch` for it to take effect.
    """
    if MPS_FALLBACK in os.environ:
        state = "on" if mps_fallback_enabled() else "off (set by you)"
        return f"{MPS_FALLBACK}={os.environ[MPS_FALLBACK]}: CPU fallback for ops MPS lacks is {state}"
    os.environ[MPS_FALLBACK] = "1"
    return (f"set {MPS_FALLBACK}=1 for ops MPS lacks; torch had already loaded, so it applies to the next "
            "process: set it before importing torch")


def memory_bytes(device: torch.device) -> tuple[int, int]:
    """(total, available) bytes for tensors on this device.

    CUDA: cudaMemGetInfo. MPS: Metal's recommended working set, capped by free system RAM, since the GPU shares
    memory with the CPU. CPU: system RAM.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total), int(free)
    ram_total, ram_free = _system_ram()
    if device.type == "mps":
        limit = int(torch.mps.recommended_max_memory())
        used = int(torch.mps.driver_allocated_memory())
        return limit, max(0, min(limit - used, ram_free))
    return ram_total, ram_free


def _system_ram() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


@dataclass(frozen=True)
class Capabilities:
    """What a device can do, for the planner and for `tunesmith fit`'s header line."""

    device: str
    name: str
    bf16: bool
    fp16: bool
    fused_sdpa: bool  # at the device's default precision
    total_bytes: int
    available_bytes: int
    mps_fallback: bool  # PYTORCH_ENABLE_MPS_FALLBACK set (only matters on MPS)

    def summary(self) -> str:
        gib = 2**30
        kinds = [p for p, ok in (("bf16", self.bf16), ("fp16", self.fp16)) if ok] + ["fp32"]
        line = (f"{self.device} ({self.name}): {', '.join(kinds)}; fused attention {'yes' if self.fused_sdpa else 'no'}; "
                f"memory {self.available_bytes / gib:.1f} GiB available of {self.total_bytes / gib:.1f} GiB")
        if self.device.startswith("mps"):
            line += f"; {MPS_FALLBACK} {'on' if self.mps_fallback else 'off'}"
        return line


def capabilities(device: torch.device) -> Capabilities:
    total, available = memory_bytes(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = f"Apple GPU, macOS {platform.mac_ver()[0] or '?'}"
    else:
        name = platform.processor() or platform.machine() or "cpu"
    fused = fused_sdpa(device, resolve_precision(device, "auto"))
    return Capabilities(str(device), name, supports_bf16(device), supports_fp16(device), fused, total, available,
                        mps_fallback_enabled())


CPU_BF16_MIN_SPEEDUP = 1.5  # bf16 products at least this many times as fast as fp32: training on the CPU takes bf16
CPU_PRECISION_ENV = "TUNESMITH_CPU_TRAIN_PRECISION"  # fp32 or bf16: what `auto` trains in on the CPU, unmeasured


def cpu_bf16_speedup() -> float:
    """How many times as fast this CPU multiplies bf16 matrices as fp32 ones, measured once per CPU model, torch
    version and thread count (well under a second) and kept in the cache folder.

    CPUs differ both ways: with the same AVX512-BF16 flag, one runs bf16 products several times as fast as fp32 and
    another (without AMX) at half the speed, so the answer is measured here, not read from the CPU's flags."""
    import json
    import time

    from tunesmith.storage import cache_dir

    key = f"{_cpu_model()}|torch {torch.__version__}|{torch.get_num_threads()} threads"
    path = cache_dir() / "cpu-bf16.json"
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), (int, float)):
        return float(known[key])
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(1024, 1024, generator=g).to(dtype) for _ in range(2))
        a @ b  # the first call sets up the kernel
        best = float("inf")
        for _ in range(5):  # the best of 5: a busy machine slows some repeats, not the kernel
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        seconds[dtype] = best
    speedup = seconds[torch.float32] / seconds[torch.bfloat16]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**(known if isinstance(known, dict) else {}), key: speedup}), encoding="utf-8")
    except OSError:
        pass  # an unwritable cache only means measuring again next time
    return speedup


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_training_precision() -> str:
    """What `--precision auto` trains in on the CPU: bf16 where this CPU multiplies bf16 at least
    CPU_BF16_MIN_SPEEDUP times as fast as fp32, else fp32 (TUNESMITH_CPU_TRAIN_PRECISION=fp32|bf16 decides instead)."""
    forced = os.environ.get(CPU_PRECISION_ENV, "").strip().lower()
    if forced:
        if forced not in ("fp32", "bf16"):
            raise TunesmithError(f"{CPU_PRECISION_ENV}={forced!r}: use fp32 or bf16 (or unset it to measure)")
        return forced
    return "bf16" if cpu_bf16_speedup() >= CPU_BF16_MIN_SPEEDUP else "fp32"


def resolve_precision(device: torch.device, requested: str = "auto", training: bool = False) -> str:
    """auto: bf16 where supported, else fp16 (with loss scaling), else fp32. On the CPU: fp32, except training
    (`training`) on a CPU whose bf16 products are clearly faster (cpu_training_precision)."""
    requested = (requested or "auto").lower()
    if requested == "auto":
        if device.type == "cpu":
            return cpu_training_precision() if training else "fp32"
        return "bf16" if supports_bf16(device) else "fp16"
    if requested not in PRECISIONS:
        raise TunesmithError(f"unknown precision {requested!r}; use auto, fp32, bf16 or fp16")
    if requested == "bf16" and not supports_bf16(device):
        why = " (bf16 on MPS needs macOS 14+ and a torch that supports it)" if device.type == "mps" else ""
        raise TunesmithError(f"bf16 is not supported on {device} here{why}; use --precision fp16 or fp32")
    if requested == "fp16" and not supports_fp16(device):
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
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's own peak resident set. On Linux that is /proc's VmHWM: getrusage's ru_maxrss starts a
    program at the peak of the process that launched it (execve keeps the forked parent's high-water mark), so a
    run started by a larger parent (a notebook, a benchmark harness) would report the parent's peak as its own."""
    import resource
    import sys

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def release_heap() -> None:
    """Hand the C heap's free memory back to the OS (glibc's malloc_trim; elsewhere nothing).

    Loading a quantized base frees a full-precision copy of every weight as it goes. glibc adjusts its mmap threshold
    as blocks are freed, and from then on serves the next copies from the heap, where the small quantized tensors
    kept between them pin the freed blocks: some loads of the 135M model held 1.7 GiB more than others (peak 1.13 to
    3.2 GiB over identical runs). Trimming once per decoder layer keeps every load at the low figure."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` is an out-of-memory error from any backend (CUDA, MPS, a CPU allocation)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MESSAGES)


def free_memory(device: torch.device) -> None:
    """Give cached blocks back after an out-of-memory error (call it once the exception is dropped)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()
