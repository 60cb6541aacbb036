"""Planner accuracy: predicted vs measured peak memory of real tunesmith training runs.

    python bench/bench_memory.py --suite cpu  [--json out.json] [--markdown out.md] [--demo]
    python bench/bench_memory.py --suite cuda [--json out.json] [--markdown out.md]
    python bench/bench_memory.py --suite cuda-compiled    # the CUDA defaults (compiled layers), two micro-batches a row

Each configuration runs in its own process: build the model (the real SmolLM2-135M, or random weights with the
exact config of a known model), run `tunesmith.train.train` for a few steps (it writes the planner's prediction
to fit.json), and measure:

- cuda: torch.cuda.max_memory_allocated over the run, against the whole prediction (weights included);
- cpu:  the whole process's peak RSS (VmHWM, the figure `train` reports), against the whole prediction
        (runtime, weights and glibc's slack included). The run is a user's: the built-in tokenizer, the built-in
        Shakespeare data, then the model, with glibc's default allocator (MALLOC_* variables are removed).
- --demo (cpu): `tunesmith demo --max-steps 3` in its own process; its report's predicted and measured peak.
- --oom-demo GIB (cuda): a real out-of-memory run under a memory cap, recovered by halving the micro-batch.

The table goes to docs/MEMORY.md with the hardware and the date.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30
SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOL_ALIAS = "smollm2-135m-instruct"
L1B = "meta-llama/Llama-3.2-1B"
L8B = "meta-llama/Llama-3.1-8B"


@dataclasses.dataclass
class Case:
    name: str
    model: str  # "real:<alias>" loads the weights; otherwise a KNOWN_CONFIGS id built with random weights
    seq_len: int
    batch_size: int | str
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    lora_dropout: float = 0.05
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    steps: int = 2  # the optimizer's state exists from step 2 on
    fine_tune_type: str = "lora"
    quantize_base: str = "none"
    optimizer: str = "adamw"
    recompute: bool = True  # train's --recompute (its default)


SUITES = {
    "cpu": [
        Case("smol-s256-b4", "real:smollm2-135m-instruct", 256, 4),
        Case("smol-s512-b2-r16-all", "real:smollm2-135m-instruct", 512, 2, 16, ("all-linear",)),
        Case("smol-s256-b8-ckpt", "real:smollm2-135m-instruct", 256, 8, gradient_checkpointing=True),
        Case("smol-s1024-b1-r64-nodrop-ckpt", "real:smollm2-135m-instruct", 1024, 1, 64, lora_dropout=0.0,
             gradient_checkpointing=True),
        Case("smol-s256-b4-all-bf16", "real:smollm2-135m-instruct", 256, 4, lora_targets=("all-linear",),
             lora_dropout=0.0, precision="bf16"),
        Case("1b-s128-b2", L1B, 128, 2),
        Case("smol-s512-b2-r16-all-norecompute", "real:smollm2-135m-instruct", 512, 2, 16, ("all-linear",),
             recompute=False),
        Case("smol-s256-b4-all-bf16-norecompute", "real:smollm2-135m-instruct", 256, 4, lora_targets=("all-linear",),
             lora_dropout=0.0, precision="bf16", recompute=False),
        Case("1b-s256-b1-r16-all-ckpt", L1B, 256, 1, 16, ("all-linear",), gradient_checkpointing=True),
    ],
    # The training modes on the CPU: the real SmolLM2-135M at the demo's shape (and all-linear for DoRA / QLoRA).
    "modes": [
        Case("smol-s256-b4-dora", "real:smollm2-135m-instruct", 256, 4, fine_tune_type="dora"),
        Case("smol-s256-b4-r16-all-dora", "real:smollm2-135m-instruct", 256, 4, 16, ("all-linear",),
             fine_tune_type="dora"),
        Case("smol-s256-b4-qlora-nf4", "real:smollm2-135m-instruct", 256, 4, quantize_base="nf4"),
        Case("smol-s256-b4-r16-all-qlora-nf4", "real:smollm2-135m-instruct", 256, 4, 16, ("all-linear",),
             quantize_base="nf4"),
        Case("smol-s256-b4-qlora-int4-ckpt", "real:smollm2-135m-instruct", 256, 4, quantize_base="int4",
             gradient_checkpointing=True),
        Case("smol-s256-b4-qlora-int8", "real:smollm2-135m-instruct", 256, 4, quantize_base="int8"),
        Case("smol-s256-b4-full", "real:smollm2-135m-instruct", 256, 4, fine_tune_type="full"),
        Case("smol-s256-b4-full-adamw8bit", "real:smollm2-135m-instruct", 256, 4, fine_tune_type="full",
             optimizer="adamw8bit"),
    ],
    "cuda": [
        Case("smol-s2048-b16-bf16", SMOL, 2048, 16, precision="bf16"),
        Case("smol-s1024-b8-r16-all-fp32", SMOL, 1024, 8, 16, ("all-linear",)),
        Case("1b-s2048-b4-r16-all-bf16", L1B, 2048, 4, 16, ("all-linear",), precision="bf16"),
        Case("1b-s4096-b2-ckpt-bf16", L1B, 4096, 2, precision="bf16", gradient_checkpointing=True),
        Case("1b-s1024-b4-nodrop-fp32", L1B, 1024, 4, lora_dropout=0.0),
        Case("8b-s512-b1-bf16", L8B, 512, 1, precision="bf16"),
        Case("8b-s2048-b8-r64-all-ckpt-bf16", L8B, 2048, 8, 64, ("all-linear",), precision="bf16",
             gradient_checkpointing=True),
        Case("8b-s2048-auto-bf16", L8B, 2048, "auto", precision="bf16"),
    ],
    # Compiled layers (--compile auto: on CUDA) at the throughput bench's rows, each at two micro-batches: the
    # difference is what a micro-batch's activations take, layer by layer, as the compiler keeps them.
    "cuda-compiled": [
        Case("smol-s1024-b8-p0-bf16", SMOL, 1024, 8, lora_dropout=0.0, precision="bf16"),
        Case("smol-s1024-b16-p0-bf16", SMOL, 1024, 16, lora_dropout=0.0, precision="bf16"),
        Case("1b-s2048-b4-r16-all-p0-bf16", L1B, 2048, 4, 16, ("all-linear",), 0.0, "bf16"),
        Case("1b-s2048-b8-r16-all-p0-bf16", L1B, 2048, 8, 16, ("all-linear",), 0.0, "bf16"),
        Case("1b-s2048-b8-r16-all-p0-bf16-norecompute", L1B, 2048, 8, 16, ("all-linear",), 0.0, "bf16",
             recompute=False),
        Case("1b-s2048-b8-r16-all-bf16", L1B, 2048, 8, 16, ("all-linear",), precision="bf16"),
        Case("8b-s2048-b2-r16-all-p0-bf16", L8B, 2048, 2, 16, ("all-linear",), 0.0, "bf16"),
        Case("8b-s2048-b4-r16-all-p0-bf16", L8B, 2048, 4, 16, ("all-linear",), 0.0, "bf16"),
    ],
}


# ------------------------------------------------------------------------------------------------- one case


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_case(case: Case, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tunesmith.config import TrainConfig
    from tunesmith.data import TokenData, load_data
    from tunesmith.device import DTYPES
    from tunesmith.memory import KNOWN_CONFIGS
    from tunesmith.models import load_model, load_tokenizer
    from tunesmith.train import train

    dtype = DTYPES[case.precision]
    torch.manual_seed(0)
    if device == "cpu":
        # As `tunesmith train` runs: tokenizer, data, then the weights. SmolLM2's tokenizer ids fit every vocabulary
        # here, so the random-weight shapes train on the same Shakespeare blocks.
        data = load_data("shakespeare", load_tokenizer(SMOL_ALIAS), case.seq_len)
        runtime = _rss("VmRSS")  # imports, tokenizer and data: what the planner's "runtime" part stands for
    if case.model.startswith("real:"):  # as train loads it: fp32 master weights for full, a base quantized as read
        model, _ = load_model(case.model[5:], device, torch.float32 if case.fine_tune_type == "full" else dtype,
                              quantize_base=case.quantize_base)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**KNOWN_CONFIGS[case.model]), dtype=dtype,
                                                     attn_implementation="sdpa")
    if device == "cpu":
        data = TokenData(train=data.train, valid=data.valid[:1], source=data.source)  # one block for the final eval
        base = _rss("VmRSS")
    else:
        vocab = model.config.vocab_size
        batch = 64 if case.batch_size == "auto" else case.batch_size
        g = torch.Generator().manual_seed(0)
        rows = [torch.randint(0, vocab, (case.seq_len,), generator=g).tolist() for _ in range(batch * case.steps)]
        data = TokenData(train=[(r, r) for r in rows], valid=[], source="random")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out = tempfile.mkdtemp(prefix="bench-memory-")
    cfg = TrainConfig(
        model="(in-process)", device=device, precision=case.precision, seq_len=case.seq_len,
        batch_size=case.batch_size, grad_accum=1, max_steps=case.steps, warmup_steps=1, eval_every=0,
        lora_rank=case.lora_rank, lora_targets=list(case.lora_targets), lora_dropout=case.lora_dropout,
        gradient_checkpointing=case.gradient_checkpointing, output=out, seed=0, fine_tune_type=case.fine_tune_type,
        quantize_base=case.quantize_base, optimizer=case.optimizer, recompute=case.recompute,
    )
    t0 = time.perf_counter()
    result = train(cfg, model=model, data=data, progress=False)
    seconds = time.perf_counter() - t0
    fit = json.loads((Path(out) / "fit.json").read_text())
    # cpu: the whole process's peak RSS, as train measures it; cuda: the caching allocator's peak
    measured = result.peak_memory_bytes if device == "cpu" else torch.cuda.max_memory_allocated()
    predicted = fit["predicted_peak_bytes"]
    return {
        **dataclasses.asdict(case), "device": device, "predicted": predicted, "measured": measured,
        "baseline": base, "runtime": runtime if device == "cpu" else 0, "parts": fit["parts"],
        "micro_batch": result.batch_size, "planned_batch": fit["micro_batch"],
        "device_available": fit["device_available_bytes"], "losses": result.losses, "seconds": seconds,
        "ratio": predicted / measured,
    }


def demo_case() -> dict:
    """The demo's own run (SmolLM2-135M, fp32, seq 256, micro-batch 4, LoRA q,v r8), 3 steps, in its own process;
    the figures its report shows: fit.json's prediction and the largest peak in metrics.jsonl."""
    out = Path(tempfile.mkdtemp(prefix="bench-memory-demo-"))
    cmd = [sys.executable, "-m", "tunesmith.cli", "demo", "--device", "cpu", "--precision", "fp32", "--max-steps", "3",
           "--eval-batches", "2", "--sample-tokens", "8", "--output", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
    if proc.returncode:
        raise RuntimeError((proc.stderr or proc.stdout).strip().splitlines()[-1])
    fit = json.loads((out / "fit.json").read_text())
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    measured = max(r.get("peak_mem_bytes", 0) for r in rows if r.get("kind") == "train")
    case = Case("demo (tunesmith demo --max-steps 3)", "real:smollm2-135m-instruct", 256, 4)
    return {**dataclasses.asdict(case), "device": "cpu", "predicted": fit["predicted_peak_bytes"], "measured": measured,
            "parts": fit["parts"], "micro_batch": fit["micro_batch"], "seconds": time.perf_counter() - t0,
            "ratio": fit["predicted_peak_bytes"] / measured}


def oom_demo(limit_gib: float) -> dict:
    """A real CUDA out-of-memory run: cap the process at `limit_gib`, start at a micro-batch that cannot fit,
    and let the trainer halve its way down; compare with what the planner would have picked for that cap."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tunesmith.config import TrainConfig
    from tunesmith.data import TokenData
    from tunesmith.memory import KNOWN_CONFIGS, plan_run
    from tunesmith.train import train

    torch.cuda.set_per_process_memory_fraction(limit_gib * GIB / torch.cuda.get_device_properties(0).total_memory)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**KNOWN_CONFIGS[L1B]), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 128256, (2048,), generator=g).tolist() for _ in range(16 * 3)]
    out = tempfile.mkdtemp(prefix="bench-oom-")
    cfg = TrainConfig(model="(in-process)", device="cuda", precision="bf16", seq_len=2048, batch_size=16, max_steps=3,
                      warmup_steps=1, eval_every=0, lora_dropout=0.0, output=out)
    planned = plan_run(dataclasses.replace(cfg, batch_size="auto"), torch.device("cuda"), "bf16", model.config,
                       memory_gib=limit_gib).setup.batch_size
    r = train(cfg, model=model, data=TokenData(train=[(x, x) for x in rows], valid=[], source="random"),
              progress=False)
    events = [json.loads(ln) for ln in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"limit_gib": limit_gib, "start_batch": 16, "oom_events": [e for e in events if e["kind"] == "oom"],
            "final_batch": r.batch_size, "final_grad_accum": r.grad_accum, "steps": r.steps, "losses": r.losses,
            "planner_batch_for_limit": planned, "peak_gib": torch.cuda.max_memory_allocated() / GIB}


# --------------------------------------------------------------------------------------------------- driver


def hardware(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return f"{cpu} ({os.cpu_count()} cores), torch {torch.__version__}"


def markdown(rows: list[dict], device: str) -> str:
    what = ("torch.cuda.max_memory_allocated (weights included)" if device == "cuda" else
            "the whole process's peak RSS (VmHWM), glibc's default allocator")
    lines = [f"Hardware: {hardware(device)}; date {time.strftime('%Y-%m-%d')}; measured: {what}.", "",
             "| case | model | seq | batch | LoRA | precision | ckpt | predicted GiB | measured GiB | error |",
             "| --- | --- | ---: | ---: | --- | --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} |")
            continue
        batch = f"auto -> {r['micro_batch']}" if r["batch_size"] == "auto" else r["batch_size"]
        lora = f"r{r['lora_rank']} {','.join(r['lora_targets'])}{' p0' if not r['lora_dropout'] else ''}"
        lines.append(
            f"| {r['name']} | {r['model'].replace('real:', '')}{'' if r['model'].startswith('real:') else ' (random)'} "
            f"| {r['seq_len']} | {batch} | {lora} | {r['precision']} | {'yes' if r['gradient_checkpointing'] else 'no'} "
            f"| {r['predicted'] / GIB:.3f} | {r['measured'] / GIB:.3f} | {100 * (r['ratio'] - 1):+.1f}% |")
    return "\n".join(lines)


def _clean_env() -> dict:
    """The environment for a measured process: glibc's allocator as a user has it (no MALLOC_* tuning)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}


def _run_one(suite: str, case: Case) -> dict:
    spec = json.dumps(dataclasses.asdict(case))
    proc = subprocess.run([sys.executable, __file__, "--suite", suite, "--one", spec], capture_output=True, text=True,
                          env=_clean_env())
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {**dataclasses.asdict(case), "error": tail[0][:200]}
    return json.loads(line[7:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--json", default="")
    ap.add_argument("--markdown", default="")
    ap.add_argument("--demo", action="store_true", help="cpu: also run `tunesmith demo --max-steps 3` (its report)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: run one case, print its JSON
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)  # internal: convert the GGUF once
    ap.add_argument("--oom-demo", type=float, default=0.0, metavar="GIB",
                    help="cuda: cap memory at GIB and show out-of-memory recovery from micro-batch 16")
    args = ap.parse_args()
    if args.oom_demo:
        print(json.dumps(oom_demo(args.oom_demo), indent=1))
        return 0
    device = "cuda" if args.suite.startswith("cuda") else "cpu"  # the cpu and modes suites run on the CPU
    if args.prepare:
        from tunesmith.models import resolve_model

        resolve_model(SMOL_ALIAS)
        return 0
    if args.one:
        print("RESULT " + json.dumps(run_case(Case(**json.loads(args.one)), device)), flush=True)
        return 0
    cases = [c for c in SUITES[args.suite] if not args.only or c.name in args.only.split(",")]
    if device == "cpu":  # the one-time GGUF conversion (its own peak) happens here, not inside a measured run
        subprocess.run([sys.executable, __file__, "--prepare"], check=True, capture_output=True)
    rows = []
    for case in cases:
        r = _run_one(args.suite, case)
        rows.append(r)
        if "error" in r:
            print(f"{case.name}: FAILED {r['error']}", flush=True)
            continue
        print(f"{case.name}: predicted {r['predicted'] / GIB:.3f} GiB, measured {r['measured'] / GIB:.3f} GiB "
              f"({100 * (r['ratio'] - 1):+.1f}%), batch {r['micro_batch']}, {r['seconds']:.0f}s", flush=True)
    if args.demo and device == "cpu":
        try:
            rows.append(demo_case())
        except (RuntimeError, OSError, ValueError) as e:
            rows.append({**dataclasses.asdict(Case("demo", "real:" + SMOL_ALIAS, 256, 4)), "error": str(e)[:200]})
    table = markdown(rows, device)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    ok = [r for r in rows if "error" not in r and abs(r["ratio"] - 1) <= 0.15]
    print(f"{len(ok)}/{len(rows)} within 15%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
