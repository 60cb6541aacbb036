"""Device choice and capabilities. Every MPS branch runs here with MPS mocked (no Apple hardware in CI)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tunesmith import device as D
from tunesmith.errors import TunesmithError

GIB = 2**30
MPS = torch.device("mps")
CPU = torch.device("cpu")


@pytest.fixture
def mac(monkeypatch):
    """An Apple-Silicon Mac as tunesmith sees it: MPS available, no CUDA, macOS 14.5, a bf16-capable torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(D, "mps_available", lambda: True)
    monkeypatch.setattr(D.platform, "mac_ver", lambda: ("14.5", ("", "", ""), "arm64"))
    monkeypatch.setattr(D, "_torch_mps_bf16", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 24 * GIB)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 2 * GIB)
    monkeypatch.setattr(D, "_system_ram", lambda: (32 * GIB, 30 * GIB))
    return monkeypatch


# ------------------------------------------------------------------------------------------- choosing a device


def test_auto_is_cpu_without_accelerators(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(D, "mps_available", lambda: False)
    assert D.resolve_device("auto") == CPU


def test_auto_prefers_cuda_then_mps(mac, monkeypatch):
    assert D.resolve_device("auto") == MPS
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert D.resolve_device("auto").type == "cuda"


def test_explicit_mps_without_mps_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(D, "mps_available", lambda: False)
    with pytest.raises(TunesmithError, match="MPS is not available"):
        D.resolve_device("mps")
    with pytest.raises(TunesmithError, match="unknown device"):
        D.resolve_device("tpu:x")


def test_mps_available_reads_the_backend(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert D.mps_available() is True
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert D.mps_available() is False


# ------------------------------------------------------------------------------------------------- precision


@pytest.mark.parametrize(("macos", "torch_ok", "bf16"), [("14.5", True, True), ("14.0", False, False),
                                                         ("13.6.1", True, False), ("", True, False)])
def test_bf16_on_mps_needs_macos_14_and_a_capable_torch(monkeypatch, macos, torch_ok, bf16):
    monkeypatch.setattr(D.platform, "mac_ver", lambda: (macos, ("", "", ""), "arm64"))
    monkeypatch.setattr(D, "_torch_mps_bf16", lambda: torch_ok)
    assert D.supports_bf16(MPS) is bf16
    assert D.resolve_precision(MPS, "auto") == ("bf16" if bf16 else "fp16")


def test_bf16_refused_on_old_macos_names_the_gate(mac):
    mac.setattr(D.platform, "mac_ver", lambda: ("13.6", ("", "", ""), "arm64"))
    with pytest.raises(TunesmithError, match="macOS 14"):
        D.resolve_precision(MPS, "bf16")
    assert D.resolve_precision(MPS, "fp16") == "fp16"


def test_cpu_precisions():
    assert D.resolve_precision(CPU, "auto") == "fp32"
    assert D.resolve_precision(CPU, "auto", training=True) == "fp32"  # the tests pin it (conftest)
    assert D.resolve_precision(CPU, "bf16") == "bf16"
    with pytest.raises(TunesmithError, match="fp16 training is not supported on the CPU"):
        D.resolve_precision(CPU, "fp16")
    with pytest.raises(TunesmithError, match="unknown precision"):
        D.resolve_precision(CPU, "int3")
    assert (D.supports_fp16(CPU), D.supports_fp16(MPS), D.supports_fp16(torch.device("cuda"))) == (False, True, True)


# ---------------------------------------------------------------------------------------------------- memory


def test_mps_memory_is_the_metal_limit_capped_by_free_ram(mac):
    assert D.memory_bytes(MPS) == (24 * GIB, 22 * GIB)  # recommended 24 minus 2 allocated; RAM has 30 free
    mac.setattr(D, "_system_ram", lambda: (32 * GIB, 9 * GIB))  # unified memory: other apps hold the rest
    assert D.memory_bytes(MPS) == (24 * GIB, 9 * GIB)


def test_cuda_memory_is_mem_get_info(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GIB, 141 * GIB))
    assert D.memory_bytes(torch.device("cuda")) == (141 * GIB, 100 * GIB)


def test_cpu_memory_is_system_ram():
    import psutil

    total, available = D.memory_bytes(CPU)
    assert total == psutil.virtual_memory().total
    assert 0 < available <= total


def test_capabilities_on_a_mocked_mac(mac):
    mac.setenv(D.MPS_FALLBACK, "1")
    mac.setattr(D, "_torch_at_least", lambda major, minor: True)
    caps = D.capabilities(MPS)
    assert (caps.bf16, caps.fp16, caps.fused_sdpa, caps.mps_fallback) == (True, True, True, True)
    assert (caps.total_bytes, caps.available_bytes) == (24 * GIB, 22 * GIB)
    assert "macOS 14.5" in caps.name
    assert caps.summary().endswith("PYTORCH_ENABLE_MPS_FALLBACK on")
    mac.setattr(D, "_torch_at_least", lambda major, minor: False)  # torch < 2.5: no Metal SDPA kernel
    assert D.capabilities(MPS).fused_sdpa is False


def test_fused_attention_on_cuda_depends_on_dtype_and_grouped_query():
    cuda = torch.device("cuda")
    assert D.fused_sdpa(cuda, "bf16", gqa=True)  # flash
    assert D.fused_sdpa(cuda, "fp32", gqa=False)  # memory-efficient
    assert not D.fused_sdpa(cuda, "fp32", gqa=True)  # math: seen on the H200 as S x S memory per layer


def test_capabilities_on_this_cpu():
    caps = D.capabilities(CPU)
    assert (caps.device, caps.bf16, caps.fp16, caps.fused_sdpa) == ("cpu", True, False, True)
    assert "bf16, fp32" in caps.summary() and "FALLBACK" not in caps.summary()


# ------------------------------------------------------------------------------------------ MPS CPU fallback


def _unset(monkeypatch, name: str) -> None:
    monkeypatch.setenv(name, "")  # registers the undo, so whatever the test sets is removed afterwards
    monkeypatch.delenv(name)


def test_fallback_is_set_when_unset(monkeypatch):
    _unset(monkeypatch, D.MPS_FALLBACK)
    message = D.enable_mps_fallback()
    assert os.environ[D.MPS_FALLBACK] == "1" and D.mps_fallback_enabled()
    assert message.startswith("set PYTORCH_ENABLE_MPS_FALLBACK=1")


def test_fallback_respects_the_users_choice(monkeypatch):
    monkeypatch.setenv(D.MPS_FALLBACK, "0")
    message = D.enable_mps_fallback()
    assert os.environ[D.MPS_FALLBACK] == "0" and not D.mps_fallback_enabled()
    assert "off (set by you)" in message


def test_trainer_sets_the_fallback_before_its_first_mps_op_and_says_so(monkeypatch, tmp_path, capsys):
    import tunesmith.train as T
    from tunesmith.config import TrainConfig

    class Stop(Exception):
        pass

    seen = []

    def first_mps_op(device, requested, training=False):  # resolve_precision probes bf16 with an MPS tensor
        seen.append(os.environ.get(D.MPS_FALLBACK))
        raise Stop

    _unset(monkeypatch, D.MPS_FALLBACK)
    monkeypatch.setattr(T, "resolve_device", lambda name: MPS)
    monkeypatch.setattr(T, "resolve_precision", first_mps_op)
    with pytest.raises(Stop):
        T.train(TrainConfig(output=str(tmp_path)), progress=True)
    assert seen == ["1"]
    assert "PYTORCH_ENABLE_MPS_FALLBACK=1" in capsys.readouterr().err


def test_cli_sets_the_fallback_before_the_stage_runs_on_macos(monkeypatch):
    from tunesmith import cli

    seen = []
    monkeypatch.setitem(cli.VERBS, "fit", (cli.C.FitConfig, lambda cfg: seen.append(os.environ.get(D.MPS_FALLBACK)), ""))
    _unset(monkeypatch, D.MPS_FALLBACK)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert cli.main(["fit"]) == 0
    assert seen == ["1"]


# ------------------------------------------------------------------------------------------- out of memory


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("MPS backend out of memory (MPS allocated: 17.2 GB, other allocations: 1.1 GB, max allowed: "
                 "18.1 GB). Tried to allocate 256 MB on private pool."),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError(),
])
def test_out_of_memory_is_recognised_on_every_backend(exc):
    assert D.is_oom(exc)


@pytest.mark.parametrize("exc", [RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ValueError("out of memory")])
def test_other_errors_are_not_out_of_memory(exc):
    assert not D.is_oom(exc)


def test_free_memory_empties_the_mps_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.mps, "empty_cache", lambda: calls.append("mps"))
    D.free_memory(MPS)
    assert calls == ["mps"]


@pytest.mark.parametrize(("speedup", "expected"), [(3.0, "bf16"), (1.5, "bf16"), (1.2, "fp32"), (0.55, "fp32")])
def test_training_on_the_cpu_takes_bf16_where_this_cpu_multiplies_it_clearly_faster(monkeypatch, speedup, expected):
    monkeypatch.delenv(D.CPU_PRECISION_ENV, raising=False)
    monkeypatch.setattr(D, "cpu_bf16_speedup", lambda: speedup)
    assert D.resolve_precision(CPU, "auto", training=True) == expected
    assert D.resolve_precision(CPU, "auto") == "fp32"  # generation, evaluation, serving: fp32 as before
    assert D.resolve_precision(CPU, "fp32", training=True) == "fp32"  # asked for: never overridden
    monkeypatch.setenv(D.CPU_PRECISION_ENV, "bf16")
    assert D.resolve_precision(CPU, "auto", training=True) == "bf16"
    monkeypatch.setenv(D.CPU_PRECISION_ENV, "fp16")
    with pytest.raises(TunesmithError, match="TUNESMITH_CPU_TRAIN_PRECISION='fp16': use fp32 or bf16"):
        D.resolve_precision(CPU, "auto", training=True)


def test_the_cpu_bf16_speed_is_measured_once_and_kept_in_the_cache(monkeypatch, tmp_path):
    import json

    monkeypatch.setenv("TUNESMITH_CACHE", str(tmp_path))
    first = D.cpu_bf16_speedup()
    assert first > 0
    (key, value), = json.loads((tmp_path / "cpu-bf16.json").read_text()).items()
    assert value == first and f"torch {torch.__version__}" in key
    (tmp_path / "cpu-bf16.json").write_text(json.dumps({key: 9.0}))
    assert D.cpu_bf16_speedup() == 9.0  # read back, not measured again
    (tmp_path / "cpu-bf16.json").write_text("not json")
    assert D.cpu_bf16_speedup() > 0  # a damaged cache is measured over


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and execve's kept high-water mark: Linux")
def test_the_cpu_peak_is_the_process_own_not_the_peak_of_what_launched_it():
    """getrusage's ru_maxrss starts a launched program at its launcher's peak; a 1.5 GiB parent must not make a small
    child report 1.5 GiB (a benchmark harness reported a 1.45 GiB run as 4.85 GiB that way)."""
    import subprocess

    ballast = b"x" * (3 * GIB // 2)  # this process's resident peak is now above 1.5 GiB
    code = "import torch; from tunesmith.device import peak_memory_bytes; print(peak_memory_bytes(torch.device('cpu')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    del ballast
    child = int(out.stdout.split()[-1])
    assert 50 * 2**20 < child < GIB  # the child's own peak: an interpreter with torch imported


@pytest.mark.skipif(D._malloc_trim() is None, reason="glibc's malloc_trim")
def test_release_heap_gives_freed_heap_blocks_back():
    """Blocks freed between blocks still in use stay resident until the heap is trimmed."""
    import psutil

    me = psutil.Process()
    blocks = [b"\1" * 100_000 for _ in range(6000)]  # 100 kB blocks: from the heap, one after another
    before = me.memory_info().rss
    del blocks[::2]  # every other one freed: holes between blocks in use, which the heap cannot shrink past
    freed = me.memory_info().rss
    D.release_heap()
    after = me.memory_info().rss
    del blocks
    assert before - after > 200 * 2**20 and freed - after > 200 * 2**20, (before, freed, after)
