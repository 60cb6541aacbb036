"""The server's forward alone, in-process, no HTTP: a decode step of the batched model (serve.batch.BatchedLM) at
1 and 8 rows, eager against CUDA graphs, and its LoRA over a mixed batch, stacked against the grouped Triton
kernels (serve.grouped_lora), on random weights of a real shape.

    python bench/bench_serve_step.py [--shape meta-llama/Llama-3.2-1B] [--device cuda] [--json out.json]

Two LoRA adapters (rank 16 on all seven linears of every layer, B random). Each row sits at position 40 of its own
slot (cache window 256); a step is timed as the median of 7 runs of 30 steps after 5 warm-up steps (CUDA
synchronised around each run). "mixed": the rows' adapters one, two, base in turn. "prefill 64": one 64-token
chunk of adapter one beside 7 decoding rows (mixed), the step a prompt joins with (eager).

Batch-invariance: 8 prompts of 12 to 19 tokens (adapters one, two, base in turn) decode 32 greedy tokens each alone
(batch of 1), then all 8 together; "same" counts the answers whose tokens are identical, by default and with the
deterministic mode. "graph vs eager": the largest logit difference between the captured step and the packed eager
step on the same 8 rows, relative to the largest logit.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from common import L1B, ROPE_THETA, SMOL, TINY, versions

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_peft(shape: str, device: str):
    """Random bf16 weights of the shape (torch.manual_seed(0)) with LoRA adapters one and two."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunesmith.memory import KNOWN_CONFIGS

    shape_config = TINY if shape == "tiny" else {**KNOWN_CONFIGS[shape], "rope_theta": ROPE_THETA[shape]}
    config = LlamaConfig(**shape_config, rms_norm_eps=1e-5, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=LINEARS)
    model = get_peft_model(model, lora, adapter_name="one")
    model.add_adapter("two", lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model.to(torch.bfloat16).eval()  # the adapters too, as the server holds them


def timed(fn, device: str, runs: int = 7, calls: int = 30) -> float:
    """Median seconds per call: `runs` runs of `calls` calls after 5 warm-up calls."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(5):
        fn()
    times = []
    for _ in range(runs):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def batch_invariance(model, deterministic: bool, steps: int = 32) -> dict:
    """Greedy tokens of 8 rows decoded alone and together (see the module's docstring)."""
    from tunesmith.serve.batch import BatchedLM

    lm = BatchedLM(model, slots=8, context=4096, deterministic=deterministic)
    prompts = [([10 + 7 * i + j for j in range(12 + i)], (i + 1) % 3) for i in range(8)]
    check = {}

    def decode(rows):  # (slot, prompt, adapter) -> each row's greedy tokens
        logits = lm.forward([(s, p, 0, a) for s, p, a in rows], [True] * len(rows))
        tokens = [[] for _ in rows]
        for step in range(steps):
            for t, n in zip(tokens, logits.argmax(-1).tolist(), strict=True):
                t.append(n)
            batch = [(s, [t[-1]], len(p) + step, a) for (s, p, a), t in zip(rows, tokens, strict=True)]
            if len(rows) > 1 and step == 0 and lm.graphs is not None and not deterministic:
                graphs, lm.graphs = lm.graphs, None
                eager = lm.forward(batch, [True] * len(batch))
                lm.graphs = graphs
                logits = lm.forward(batch, [True] * len(batch))
                check["graph_vs_eager"] = float((logits - eager).abs().max() / eager.abs().max())
            else:
                logits = lm.forward(batch, [True] * len(batch))
        return tokens

    alone = [decode([(0, p, a)])[0] for p, a in prompts]
    together = decode([(s, p, a) for s, (p, a) in enumerate(prompts)])
    diffs = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
             for a, b in zip(alone, together, strict=True)]
    return {"same": sum(d is None for d in diffs), "first_diff": [d for d in diffs if d is not None],
            "graph_vs_eager": check.get("graph_vs_eager", float("nan"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=L1B, choices=[SMOL, L1B, "tiny"])
    ap.add_argument("--runs", type=int, default=7, help="timed runs of 30 steps per row (the median is shown)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from tunesmith.serve import grouped_lora
    from tunesmith.serve.batch import BatchedLM
    from tunesmith.serve.graphs import DecodeGraphs

    model = random_peft(args.shape, args.device)
    kernels = [False] + ([True] if grouped_lora.available(torch.zeros(1, device=args.device)) else [])
    lms = {k: BatchedLM(model, slots=8, context=4096, lora_kernel=k) for k in kernels}
    rows = {}
    for n in (1, 8):
        rows[f"base x{n}"] = [(s, [5 + s], 40, 0) for s in range(n)]
        rows[f"mixed x{n}"] = [(s, [5 + s], 40, (s + 1) % 3) for s in range(n)]  # one first: a lone row has an adapter
    prefill = [(0, list(range(5, 69)), 40, 1)] + [(s, [5 + s], 40, s % 3) for s in range(1, 8)]
    out = []

    def record(name, path, seconds, tokens):
        out.append({"step": name, "path": path, "ms": seconds * 1e3, "tok_s": tokens / seconds})
        print(f"| {name} | {path} | {seconds * 1e3:.3f} | {tokens / seconds:.0f} |", flush=True)

    print(f"\n{args.shape}, random bf16 weights, {args.device}"
          f" ({torch.cuda.get_device_name() if args.device == 'cuda' else platform.machine()})\n")
    print("| step | path | ms per step | rows' tokens/s |\n|---|---|---|---|")
    lm = lms[False]
    for name, batch in rows.items():
        graphs = lm.graphs
        lm.graphs = None
        record(name, "eager (packed)", timed(lambda b=batch: lm.forward(b, [True] * len(b)), args.device, args.runs), len(batch))
        lm.graphs = graphs if graphs is not None else DecodeGraphs(lm, capture=False)
        label = "CUDA graph" if lm.graphs.capture else "static step, eager"
        record(name, label if name.startswith("base") else f"{label}, stacked LoRA", timed(lambda b=batch: lm.forward(b, [True] * len(b)), args.device, args.runs),
               len(batch))
        if True in lms and not name.startswith("base"):
            record(name, f"{label}, grouped LoRA (Triton)",
                   timed(lambda b=batch, g=lms[True]: g.forward(b, [True] * len(b)), args.device, args.runs),
                   len(batch))
    for k, g in lms.items():
        graphs, g.graphs = g.graphs, None
        record("prefill 64 + 7 decoding, mixed", "eager, grouped LoRA (Triton)" if k else "eager, stacked LoRA",
               timed(lambda g=g: g.forward(prefill, [True] * 8), args.device, args.runs), 71)
        g.graphs = graphs
    invariance = {mode: batch_invariance(model, mode == "deterministic") for mode in ("default", "deterministic")}
    for mode, r in invariance.items():
        print(f"\nbatch-invariance, {mode}: {r['same']}/8 greedy answers (32 tokens) the same alone and 8 together; "
              f"first differing token at {r['first_diff']}; graph vs eager logits: {r['graph_vs_eager']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "device": args.device, "invariance": invariance,
                       "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                       "versions": versions("torch", "transformers", "peft", "triton"), "steps": out}, f, indent=2)


if __name__ == "__main__":
    main()
