"""Several GPUs: the same `tunesmith train` command on 1 GPU and on N (DDP or FSDP2), at the same global batch and
seed, compared in one run.

Each run is the CLI itself (`tunesmith train --gpus N --strategy S`), on random weights of a real shape and random
tokens (bench/common.py's model folders and toy tokenizer; nothing is downloaded). The 1-GPU run takes
N micro-batches per step (--grad-accum N) so that every run trains the same examples per step, at the same
micro-batch. From each run's metrics.jsonl and fit.json:

- tokens/s: the median over the steps after --warmup (tokens of the whole step, all GPUs, over its time);
- peak memory per GPU: the main process's allocator peak over the run (torch.cuda.max_memory_allocated, loading
  included); under FSDP2 the processes hold equal shares;
- the planner's per-GPU prediction;
- the loss of every step; per pair, the largest relative difference from the 1-GPU run's.

    python bench/bench_multigpu.py --row smollm2 --runs 1:ddp,2:ddp --steps 50 --out mg.jsonl
    python bench/bench_multigpu.py --row llama-1b --runs 1:ddp,2:ddp --steps 30 --out mg.jsonl
    python bench/bench_multigpu.py --row llama-8b-ckpt --runs 1:ddp,2:fsdp --steps 50 --out mg.jsonl
    python bench/bench_multigpu.py --row tiny --device cpu --runs 1:ddp,2:ddp --steps 6   # the plumbing, on gloo

The table and the command go to docs/PERFORMANCE.md with the hardware and the date.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import GIB, L1B, L8B, OFFLINE_ENV, SMOL, Row, model_folder

ROWS = {r.name: r for r in [
    Row("smollm2", SMOL, 256, 4, 8, 16, ("q_proj", "v_proj")),  # micro-batch per GPU
    Row("llama-1b", L1B, 2048, 8, 16, 32, ("all-linear",)),
    Row("llama-8b-ckpt", L8B, 2048, 1, 16, 32, ("all-linear",)),  # with --gradient-checkpointing
    Row("tiny", "tiny", 32, 2, 8, 16, ("all-linear",)),
]}
CHECKPOINTING = {"llama-8b-ckpt"}


def corpus(folder: Path, tokens: int, seed: int = 0) -> Path:
    """Random one-character words: the toy tokenizer makes each one token."""
    path = folder / f"random-{tokens}.txt"
    if not path.is_file():
        rng = random.Random(seed)
        words = [chr(c) for c in range(33, 127)]
        path.write_text(" ".join(rng.choice(words) for _ in range(tokens)), encoding="utf-8")
    return path


def run(a, row: Row, model: Path, data: Path, gpus: int, strategy: str, most: int) -> dict:
    out = Path(a.workdir) / "runs" / f"{row.name}-{gpus}-{strategy}"
    # (FSDP2 on one GPU needs a launched process: torchrun with one)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] \
        if gpus == 1 and strategy == "fsdp" else []
    cmd = [sys.executable, *launcher, "-m", "tunesmith.cli", "train", "--model", str(model), "--data", str(data),
           "--output", str(out), "--overwrite", "--device", a.device, "--seq-len", str(row.seq),
           "--batch-size", str(row.batch), "--grad-accum", str(most // gpus), "--max-steps", str(a.steps),
           "--lora-rank", str(row.rank), "--lora-alpha", str(row.alpha), "--lora-targets", ",".join(row.targets),
           "--lora-dropout", "0", "--lr", "1e-4", "--warmup-steps", "5", "--eval-every", "0",
           "--checkpoint-every", str(a.steps // 2 if a.resume_check else 0), "--seed", "0",
           "--gpus", str(gpus), "--strategy", strategy]
    if row.name in CHECKPOINTING:
        cmd.append("--gradient-checkpointing")
    cmd += a.flags.split()
    result = {"row": row.name, "gpus": gpus, "strategy": strategy, "command": " ".join(cmd[1:])}
    train, failed = _train(a, cmd, out, out.name, result)
    if failed:
        return result
    if a.resume_check:  # the second half again, from the mid-run checkpoint, in a copy of the run folder
        import shutil

        again = out.with_name(out.name + "-resumed")
        shutil.rmtree(again, ignore_errors=True)
        shutil.copytree(out, again)
        mid = again / "checkpoints" / f"step-{a.steps // 2:06d}"
        resumed_cmd = [x if x != str(out) else str(again) for x in cmd if x != "--overwrite"]
        resumed, failed = _train(a, [*resumed_cmd, "--resume", str(mid)], again, again.name, {})
        if not failed:
            pairs = list(zip(resumed[a.steps // 2:], train[a.steps // 2:], strict=True))
            result["resume_max_rel_loss_diff"] = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in pairs)
    result |= {
        "losses": [r["loss"] for r in train],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[a.warmup:] or train),
        "peak_gib": max(r["peak_mem_bytes"] for r in train) / GIB,
    }
    fit = out / "fit.json"
    if fit.is_file():
        result["planned_gib"] = json.loads(fit.read_text())["predicted_peak_bytes"] / GIB
    return result


def _train(a, cmd: list[str], out: Path, name: str, result: dict) -> tuple[list[dict], bool]:
    """Run one training command; its metrics' train rows, and whether it failed (the log's end in `result`)."""
    started = time.perf_counter()
    log = Path(a.workdir) / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout,
                              env={**os.environ, **OFFLINE_ENV})
    result |= {"rc": proc.returncode, "wall_s": time.perf_counter() - started}
    if proc.returncode:
        result["error"] = log.read_text(errors="replace")[-2000:]
        return [], True
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r["kind"] == "train"], False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", choices=sorted(ROWS), default="smollm2")
    ap.add_argument("--runs", default="1:ddp,2:ddp", help="GPUS:STRATEGY,... (the first is the reference)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the tokens/s median")
    ap.add_argument("--flags", default="", help="more `tunesmith train` flags for every run")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--resume-check", action="store_true",
                    help="checkpoint at half-way, then train the second half again from it and compare the losses")
    ap.add_argument("--workdir", default="/tmp/tunesmith-multigpu")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    row = ROWS[a.row]
    runs = [(int(g), s) for g, s in (x.split(":") for x in a.runs.split(","))]
    most = max(g for g, _ in runs)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = model_folder(row, a.device, work)
    data = corpus(work, int(row.seq * row.batch * most * (a.steps + 2) * 1.1) + 1000)
    results = [run(a, row, model, data, g, s, most) for g, s in runs]
    ref = results[0]
    print(f"\n{row.name}: seq {row.seq}, micro-batch {row.batch} per GPU, {most * row.batch} examples per step, "
          f"{a.steps} steps, r{row.rank} on {','.join(row.targets)}")
    print(f"{'run':<12}{'tokens/s':>12}{'speed-up':>10}{'peak GiB/GPU':>14}{'x ref':>8}{'planned':>9}"
          f"{'max rel loss diff':>19}")
    for r in results:
        if r["rc"]:
            print(f"{r['gpus']}:{r['strategy']:<10} failed (rc {r['rc']}): {r['error'][-300:]}")
            continue
        if not ref["rc"]:
            r["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"]
            r["memory_ratio"] = r["peak_gib"] / ref["peak_gib"]
            pairs = list(zip(r["losses"], ref["losses"], strict=False))
            r["max_rel_loss_diff"] = max(abs(x - y) / abs(y) for x, y in pairs) if pairs else float("nan")
        print(f"{r['gpus']}:{r['strategy']:<10}{r['tokens_per_s']:>12,.0f}{r.get('speedup', 0):>10.2f}"
              f"{r['peak_gib']:>14.2f}{r.get('memory_ratio', 0):>8.2f}{r.get('planned_gib', 0):>9.2f}"
              f"{r.get('max_rel_loss_diff', 0):>19.2e}"
              + (f"   resumed: {r['resume_max_rel_loss_diff']:.2e}" if "resume_max_rel_loss_diff" in r else ""))
    if a.out:
        with open(a.out, "a") as f:
            for r in results:
                f.write(json.dumps({**r, "date": time.strftime("%Y-%m-%d"), "steps": a.steps,
                                    **dataclasses.asdict(row)}) + "\n")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
