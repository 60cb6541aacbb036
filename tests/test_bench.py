"""bench/train_throughput.py: its plain path, and its reading of the GPU's state (clock, power, temperature) over
the timed steps."""

from __future__ import annotations

import dataclasses
import importlib
import os
import stat
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def tt():
    # As `python bench/train_throughput.py` runs it: with its own folder first on the path, where `common` is.
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        yield importlib.import_module("train_throughput")


def test_the_plain_path_names_only_train_config_fields(tt):
    # run_tunesmith drops --ts-flags that TrainConfig lacks (so one command line runs on older commits too); a
    # renamed field in PLAIN_FLAGS would be dropped the same way and leave tunesmith-plain on the fast paths.
    from tunesmith.config import TrainConfig

    assert tt.PLAIN_FLAGS == {"fast_paths": "off"}
    assert set(tt.PLAIN_FLAGS) <= {f.name for f in dataclasses.fields(TrainConfig)}


def test_checkpointed_rows_take_the_most_memory_saving_setting(tt):
    # the -ckpt rows: the 1B and 8B rows' shapes, with tunesmith's offloaded checkpointing, a value TrainConfig reads;
    # the QLoRA row checkpoints the same way over an nf4 base
    from tunesmith.config import checkpointing_value

    checkpointed = {name: row for name, row in tt.ROWS.items() if row.checkpointing}
    assert {"llama-1b-ckpt", "llama-8b-ckpt", "llama-8b-qlora"} <= set(checkpointed)
    for name in ("llama-1b-ckpt", "llama-8b-ckpt"):
        row, plain = tt.ROWS[name], tt.ROWS[name.removesuffix("-ckpt")]
        assert dataclasses.replace(row, name=plain.name, checkpointing=False) == plain
    qlora = tt.ROWS["llama-8b-qlora"]
    assert dataclasses.replace(qlora, name="llama-8b", base="bf16", checkpointing=False) == tt.ROWS["llama-8b"]
    for name in ("llama-1b-ckpt", "llama-8b-ckpt", "llama-8b-qlora"):
        assert checkpointing_value(checkpointed[name].checkpointing) == "offload"


def test_gpu_lines_parse_to_numbers_and_anything_else_to_none(tt):
    assert tt.parse_gpu_line("1980, 689.52, 61\n") == (1980.0, 689.52, 61.0)
    for bad in ("[N/A], 600.0, 50", "clocks.sm [MHz], power.draw [W], temperature.gpu", "", "1980, 600"):
        assert tt.parse_gpu_line(bad) is None


def test_gpu_state_takes_only_the_timed_steps(tt):
    # steps end at t = 1..6; warm-up 2: the timed steps are 3, 4, 5 (the last, 6, left out), so the window is
    # from step 2's end (t=2) to step 5's end (t=5)
    ends = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    samples = [(0.5, 345, 80, 30), (1.5, 1980, 700, 50), (2.5, 1900, 690, 60), (3.5, 1800, 680, 70),
               (4.5, 1700, 670, 65), (5.5, 1000, 300, 90)]
    got = tt.gpu_state(samples, ends, warmup=2)
    assert got == {"sm_mhz": 1800, "power_w": 680, "temp_c_max": 70, "samples": 3}
    assert tt.gpu_state(samples, ends, warmup=0)["samples"] == 5  # from the start: all up to step 5's end
    assert tt.gpu_state([(9.0, 1, 1, 1)], ends, warmup=2) is None  # no sample inside
    assert tt.gpu_state(samples, [1.0], warmup=0) is None


def test_sampler_reads_nvidia_smi_until_the_block_ends(tt, tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    args = tmp_path / "args"
    fake.write_text(f'#!/bin/sh\necho "$@" > {args}\necho "1980, 689.5, 61"\necho "[N/A], 1, 1"\n'
                    'echo "1755, 700.0, 66"\nexec sleep 60\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    t0 = time.time()
    with tt.GpuSampler() as sampler:
        deadline = time.monotonic() + 60
        while len(sampler.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [s[1:] for s in sampler.samples] == [(1980.0, 689.5, 61.0), (1755.0, 700.0, 66.0)]
    assert all(t0 <= s[0] <= time.time() for s in sampler.samples)
    assert sampler.proc.poll() is not None  # stopped with the block
    assert args.read_text().split()[:2] == ["-i", "3"]
    with tt.GpuSampler(on=False) as off:
        pass
    assert off.samples == [] and off.proc is None


def test_rounds_summary_gives_the_ratio_of_medians_and_each_round_s_own(tt):
    def r(tool, rnd, tps, error=None, row="llama-8b"):
        return {"tool": tool, "row": row, "dropout": 0.0, "round": rnd, "tokens_per_s": tps, "error": error}

    results = [r("tunesmith", 0, 17_700), r("unsloth", 0, 16_200),
               r("tunesmith", 1, 17_300), r("unsloth", 1, 16_100),   # a slow tunesmith round
               r("tunesmith", 2, 17_800), r("unsloth", 2, 16_150),
               r("hf", 0, 10_000), r("hf", 1, None, error="OOM"),     # one good round: no summary for hf
               r("tunesmith", 0, 1.0, row="llama-1b"), r("unsloth", 0, 1.0, row="llama-1b")]  # one round only
    lines = tt.rounds_summary(results)
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("llama-8b dropout 0, tunesmith ÷ unsloth over 3 and 3 rounds: ")
    assert f"{17_700 / 16_150:.4f} (medians 17,700 and 16,150 tokens/s)" in line
    assert line.endswith(f"each round: {17_700 / 16_200:.4f}, {17_300 / 16_100:.4f}, {17_800 / 16_150:.4f}")
    assert tt.rounds_summary(results[:2]) == []


def test_the_qlora_row_trains_a_4_bit_base_with_checkpointing_in_tunesmith_and_unsloth_only(tt, tmp_path):
    """llama-8b-qlora: the 8B shape at seq 2048, batch 4, LoRA r16 on all linears, an nf4 base and each tool's
    checkpointing; tunesmith (and its plain path) against Unsloth, the tools without a 4-bit base left out; the
    smoke twin trains through tunesmith's nf4 path on the CPU."""
    row = tt.ROWS["llama-8b-qlora"]
    assert (row.shape, row.seq, row.batch, row.rank, row.targets) == (tt.L8B, 2048, 4, 16, ("all-linear",))
    assert row.base == "nf4" and row.checkpointing
    assert "llama-8b-qlora" in tt.DEFAULTS["cuda"][0]
    assert set(tt.NF4_TOOLS) == {"tunesmith", "tunesmith-plain", "unsloth"}
    a = dataclasses.make_dataclass("A", ["worker", "ts_flags", "device", "workdir", "steps", "dropout"])(
        "tunesmith", "", "cpu", str(tmp_path), 2, 0.0)
    smoke = tt.ROWS["smoke-qlora"]
    folder = tt.model_folder(smoke, "cpu", tmp_path)
    times, losses, trainable, notes = tt.run_tunesmith(a, smoke, folder, tt.examples(smoke, 2, folder))
    assert len(times) == len(losses) == 2 and trainable > 0 and notes["nf4_strategies"] == {}  # (no CUDA: none)
    with pytest.raises(RuntimeError, match="not run on a nf4 base"):
        tt.run_trainer(dataclasses.replace(a, worker="hf"), smoke, folder, [])
