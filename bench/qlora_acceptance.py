"""QLoRA's two acceptance checks: the model fits, and the 4-bit loss curve follows bf16 LoRA's.

    python bench/qlora_acceptance.py --device cuda --out qlora-cuda.json            # the Llama-3.1-8B shape
    python bench/qlora_acceptance.py --device cpu --model real:smollm2-135m-instruct --data shakespeare --seq 256

Two runs of the CLI as a user types it, the same data and seed, nothing else changed from the defaults (LoRA r8 on
q_proj,v_proj, dropout 0.05, --fast-paths auto, no gradient checkpointing):

    tunesmith train --model M --data D --seq-len S --batch-size 1 --max-steps N [--quantize-base nf4]

each in its own process (`--parallel`: both at once; each process's peak is its own). Reported for each: the peak
memory over the whole run (metrics.jsonl's peak_mem_bytes: torch.cuda.max_memory_allocated on CUDA, loading
included; the process's peak RSS on the CPU), the fit planner's prediction (fit.json) and the loss per step; then
the largest gap between the two loss curves, |qlora - lora| / lora over the steps. The bars: the QLoRA run's
peak at most --budget-gib, the gap at most 1%.

The CUDA default is random weights of the Llama-3.1-8B shape (bench/common.py's folder, shared with
train_throughput.py) on seeded random text over its toy tokenizer's 94 characters, skewed so that there is
something to learn: with random weights both curves start at about ln(vocab), so agreement there says little;
the CPU run with a real model and real text is the stricter check of the curve.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from common import GIB, L8B, OFFLINE_ENV, Row, model_folder

ROOT = Path(__file__).resolve().parents[1]


def random_text(path: Path, tokens: int, seed: int = 0) -> Path:
    """`tokens` printable characters, space-separated (the toy tokenizer's words), drawn with Zipf-like weights."""
    chars = [chr(c) for c in range(33, 127)]
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(chars))]
    path.write_text(" ".join(rng.choices(chars, weights, k=tokens)))
    return path


def run(a, folder: Path, data: str, quantize: bool, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tunesmith.cli", "train", "--model", str(folder), "--data", data,
           "--seq-len", str(a.seq), "--batch-size", "1", "--max-steps", str(a.steps), "--device", a.device,
           "--output", str(out), "--overwrite", *(["--quantize-base", "nf4"] if quantize else [])]
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (closed with the process, below)
    env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                                   os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log, proc.cmd = log, " ".join(["tunesmith", *cmd[3:]])
    return proc


def result(proc: subprocess.Popen, out: Path) -> dict:
    proc.wait()
    proc.log.close()
    if proc.returncode:
        tail = out.with_suffix(".log").read_text(errors="replace").strip().splitlines()[-5:]
        return {"command": proc.cmd, "error": " | ".join(tail)}
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("loss") is not None and "peak_mem_bytes" in s]
    fit = json.loads((out / "fit.json").read_text())
    peak = max(s["peak_mem_bytes"] for s in steps)
    return {"command": proc.cmd, "error": None, "losses": [s["loss"] for s in steps], "peak_gib": peak / GIB,
            "predicted_gib": fit["predicted_peak_bytes"] / GIB, "predicted_over_measured":
            fit["predicted_peak_bytes"] / peak, "tokens_per_s": steps[-1].get("tokens_per_s")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--model", default=L8B, help="a KNOWN_CONFIGS shape (random weights) or real:<built-in alias>")
    ap.add_argument("--data", default="", help="a data spec (default: seeded random text over the toy tokenizer)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--budget-gib", type=float, default=16.0)
    ap.add_argument("--parallel", action="store_true", help="both runs at once (peaks are per process)")
    ap.add_argument("--workdir", default="/tmp/tt-bench")
    ap.add_argument("--out", default="", help="the JSON report (default: <workdir>/qlora-acceptance.json)")
    a = ap.parse_args()
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    folder = model_folder(Row("acceptance", a.model, a.seq, 1, 8, 16, ("q_proj", "v_proj")), a.device, workdir)
    data = a.data or str(random_text(workdir / "qlora-acceptance.txt", (a.steps + 4) * a.seq * 2))
    outs = {name: workdir / f"qlora-acceptance-{name}" for name in ("lora", "qlora")}
    if a.parallel:
        procs = {name: run(a, folder, data, name == "qlora", out) for name, out in outs.items()}
        runs = {name: result(procs[name], out) for name, out in outs.items()}
    else:
        runs = {name: result(run(a, folder, data, name == "qlora", out), out) for name, out in outs.items()}
    report = {"device": a.device, "model": a.model, "seq": a.seq, "steps": a.steps, "runs": runs,
              "seconds": time.perf_counter() - t0}
    if a.device == "cuda":
        import torch

        report["gpu"] = torch.cuda.get_device_name(0)
    ok = not any(r["error"] for r in runs.values())
    if ok:
        b, q = runs["lora"]["losses"], runs["qlora"]["losses"]
        gaps = [abs(y - x) / x for x, y in zip(b, q, strict=False)]
        report["loss_gap_max"], report["loss_gap_step"] = max(gaps), gaps.index(max(gaps)) + 1
        report["fits"] = runs["qlora"]["peak_gib"] <= a.budget_gib
        report["follows"] = report["loss_gap_max"] <= 0.01
    for name, r in runs.items():
        print(f"{name}: {r['command']}")
        print(f"  FAILED {r['error']}" if r["error"] else
              f"  peak {r['peak_gib']:.2f} GiB (planned {r['predicted_gib']:.2f}, x{r['predicted_over_measured']:.3f}),"
              f" loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} over {len(r['losses'])} steps,"
              f" {r['tokens_per_s'] or 0:,.0f} tok/s")
    if ok:
        print(f"QLoRA peak {runs['qlora']['peak_gib']:.2f} GiB <= {a.budget_gib:g}: {'PASS' if report['fits'] else 'FAIL'}")
        print(f"loss curves: largest gap {report['loss_gap_max']:.4%} (step {report['loss_gap_step']}) <= 1%: "
              f"{'PASS' if report['follows'] else 'FAIL'}")
    Path(a.out or workdir / "qlora-acceptance.json").write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
