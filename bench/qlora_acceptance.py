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

--floor: how far the nf4 base alone moves a step's loss, before any training: the first --steps blocks of --seq
tokens of the same text, each block's loss under the model in bf16 and again with its decoder linears in nf4 (as
`--quantize-base nf4` quantizes them), in one process; the relative gap per block, its mean, spread and largest.

    python bench/qlora_acceptance.py --floor --device cuda [--out nf4-floor.json]

--kernels: the nf4 base's products on one GPU, tunesmith's kernels (kernels.nf4) against torchao's linear_nf4 and bf16.

    python bench/qlora_acceptance.py --kernels [--rows 8192] [--out nf4-kernels.jsonl]

For each decoder linear of the Llama-3.1-8B shape (random weights quantized to nf4 as `--quantize-base nf4` does),
at `--rows` tokens in bf16: the forward product x W^T and the input's gradient g W, each through
- torchao: linear_nf4 (the plain path: the weight dequantized by PyTorch ops, then multiplied);
- fused: the GEMM kernel that decodes W's tiles in registers;
- dequantize: the decoding kernel into one buffer, then cuBLAS;
- bf16: cuBLAS on the dequantized weight held in bf16 (what the products cost with no decoding at all).
Each its mean time over 20 calls after a warm-up (CUDA events, as the op times its strategies), and the relative
error of both kernels against torchao's result (max |got - want| / max |want|), which must stay at bf16 rounding.
The strategy the op would pick (the faster kernel) is marked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
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
           "--output", str(out), "--overwrite", *(["--quantize-base", "nf4"] if quantize else []), *shlex.split(a.train_args)]
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


SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "o_proj": (4096, 4096), "gate_proj": (14336, 4096),
          "down_proj": (4096, 14336)}  # name -> (out, in); v_proj is k_proj's shape, up_proj gate_proj's


def products(x, q, w, parts, fwd: bool, linear_nf4):
    """The four ways to x W^T (fwd) or x W: torchao, the fused kernel, decode then cuBLAS, bf16 cuBLAS."""
    from tunesmith.kernels import nf4

    if fwd:
        ref, plain = (lambda: linear_nf4(x, q)), (lambda: x @ w.t())
    else:  # what linear_nf4's backward computes: g times the weight dequantized again
        ref, plain = (lambda: x @ q.to(x.dtype)), (lambda: x @ w)
    return (ref, lambda: nf4.mm_triton(x, *parts, fwd), lambda: nf4._dequantize_then_mm(x, *parts, transposed=fwd),
            plain)


def kernels(a) -> int:
    """--kernels: the nf4 base's products, each kernel against torchao and bf16 (see the module's docstring)."""
    import torch

    from tunesmith.kernels import nf4
    from tunesmith.qlora import QuantLinear, _torchao_nf4

    _, linear_nf4 = _torchao_nf4()
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, rows {a.rows}, bf16; ms per product")
    print("| linear | direction | torchao | fused | dequantize | bf16 cuBLAS | picked | err fused | err dequantize |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|")
    rows = []
    for name, (out_f, in_f) in SHAPES.items():
        layer = QuantLinear.from_weight((torch.randn(out_f, in_f, device="cuda") * 0.02).to(bf16), "nf4")
        q = layer.qweight
        parts = (*nf4.nf4_parts(q), out_f, in_f, q.scaler_block_size)
        w = q.get_original_weight().to(bf16)
        for direction in ("forward", "input grad"):
            fwd = direction == "forward"
            x = torch.randn(a.rows, in_f if fwd else out_f, device="cuda", dtype=bf16)
            ref, fused, deq, plain = products(x, q, w, parts, fwd, linear_nf4)
            want = ref().float()
            errs = {k: ((f().float() - want).abs().max() / want.abs().max()).item()
                    for k, f in (("fused", fused), ("dequantize", deq))}
            ways = (("torchao", ref), ("fused", fused), ("dequantize", deq), ("bf16", plain))
            ms = {k: nf4._timed(f, 20) / 20 for k, f in ways}
            picked = min(("fused", "dequantize"), key=ms.get)
            row = {"linear": name, "direction": direction, "rows": a.rows, "ms": ms, "errors": errs,
                   "picked": picked, "gpu": torch.cuda.get_device_name(0)}
            rows.append(row)
            print(f"| {name} | {direction} | {ms['torchao']:.3f} | {ms['fused']:.3f} | {ms['dequantize']:.3f} | "
                  f"{ms['bf16']:.3f} | {picked} | {errs['fused']:.2e} | {errs['dequantize']:.2e} |", flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    worst = max(max(r["errors"].values()) for r in rows)
    print(f"largest relative error against torchao: {worst:.2e} ({'ok' if worst < 1e-2 else 'TOO LARGE'})")
    return 0 if worst < 1e-2 else 1


def floor(a, folder: Path, text_path: Path) -> int:
    """--floor: each block's loss in bf16 and with an nf4 base, no training (see the module's docstring)."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunesmith.qlora import quantize_base

    ids = AutoTokenizer.from_pretrained(folder)(text_path.read_text(), return_tensors="pt").input_ids[0]
    blocks = [ids[i * a.seq:(i + 1) * a.seq] for i in range(min(a.steps, len(ids) // a.seq))]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(a.device).eval()

    def losses() -> list[float]:
        with torch.no_grad():
            return [model(input_ids=b[None].to(a.device), labels=b[None].to(a.device)).loss.item() for b in blocks]

    bf16 = losses()
    quantize_base(model, "nf4")
    nf4 = losses()
    gaps = [(q - b) / b for b, q in zip(bf16, nf4, strict=True)]
    report = {"device": a.device, "model": a.model, "seq": a.seq, "bf16": bf16, "nf4": nf4, "gaps": gaps,
              "gap_mean": statistics.mean(gaps), "gap_sd": statistics.pstdev(gaps), "gap_max": max(map(abs, gaps))}
    if a.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    print(f"{len(blocks)} blocks of {a.seq} tokens, the nf4 base against bf16, no training: gap mean "
          f"{report['gap_mean']:+.3%}, sd {report['gap_sd']:.3%}, largest |gap| {report['gap_max']:.3%}")
    Path(a.out or Path(a.workdir) / "nf4-floor.json").write_text(json.dumps(report, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", action="store_true", help="time the nf4 kernels instead (CUDA; see the docstring)")
    ap.add_argument("--floor", action="store_true", help="the nf4 base alone, no training (see the docstring)")
    ap.add_argument("--rows", type=int, default=8192, help="--kernels: tokens per product (batch x seq)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--model", default=L8B, help="a KNOWN_CONFIGS shape (random weights) or real:<built-in alias>")
    ap.add_argument("--data", default="", help="a data spec (default: seeded random text over the toy tokenizer)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--budget-gib", type=float, default=16.0)
    ap.add_argument("--train-args", default="", help="more `tunesmith train` flags for both runs (a probe: the "
                    "acceptance check itself is the defaults), e.g. '--lora-dropout 0'")
    ap.add_argument("--parallel", action="store_true", help="both runs at once (peaks are per process)")
    ap.add_argument("--workdir", default="/tmp/tt-bench")
    ap.add_argument("--out", default="", help="the JSON report (default: <workdir>/qlora-acceptance.json); with "
                    "--kernels, a JSON Lines file the rows are appended to")
    a = ap.parse_args()
    if a.kernels:
        return kernels(a)
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    folder = model_folder(Row("acceptance", a.model, a.seq, 1, 8, 16, ("q_proj", "v_proj")), a.device, workdir)
    data = a.data or str(random_text(workdir / "qlora-acceptance.txt", (a.steps + 4) * a.seq * 2))
    if a.floor:
        if not Path(data).is_file():
            ap.error("--floor reads a text file: leave --data out (the seeded random text) or give a .txt path")
        return floor(a, folder, Path(data))
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
