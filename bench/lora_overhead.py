"""What LoRA's own products cost next to the frozen base's, per decoder layer, at a row's shapes (CUDA).

    python bench/lora_overhead.py [--rows llama-1b,llama-8b] [--rank 16]

For each linear of a Llama layer (q/k/v joined as tunesmith's fused q/k/v runs them, o, gate, up, down), M tokens
of bf16: the base alone (forward x W^T, backward input gradient g W: the base is frozen) against the same with
LoRA as tunesmith's fused LoRA computes it (x A^T, then B's product accumulated into the output by addmm; backward
g B, its product with A accumulated into the input gradient, and A's and B's gradients). Timed with CUDA events,
median of --iters after --warmup; the ratio says how much of a layer's product time LoRA adds, and the bytes its
skinny products must move give the bandwidth floor for that extra time.
"""

from __future__ import annotations

import argparse
import statistics

import torch

SHAPES = {  # hidden, intermediate, q heads, kv heads, head dim, tokens a micro-batch step
    "llama-1b": (2048, 8192, 32, 8, 64, 8 * 2048),
    "llama-8b": (4096, 14336, 32, 8, 128, 4 * 2048),
}


def linears(row: str) -> list[tuple[str, int, int]]:
    h, inter, qh, kvh, d, _ = SHAPES[row]
    return [("qkv", h, (qh + 2 * kvh) * d), ("o", qh * d, h), ("gate", h, inter), ("up", h, inter),
            ("down", inter, h)]


def timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


PARTS = ("x A^T", "addmm fwd", "g B", "addmm bwd", "grad A", "grad B")


def base(x, g, w):
    x @ w.t()
    g @ w


def lora(x, g, w, la, lb, s):
    xa = x @ la.t()
    torch.addmm(x @ w.t(), xa, lb.t(), alpha=s)
    gb = g @ lb
    torch.addmm(g @ w, gb, la, alpha=s)
    gb.t() @ x  # A's gradient (times s)
    g.t() @ xa  # B's gradient (times s)


def parts(x, g, w, la, lb, s) -> dict:
    """Each of LoRA's products alone, as a callable over intermediates made once here, outside the timing."""
    y, xa, dx, gb = x @ w.t(), x @ la.t(), g @ w, g @ lb
    return {"x A^T": lambda: x @ la.t(), "addmm fwd": lambda: torch.addmm(y, xa, lb.t(), alpha=s),
            "g B": lambda: g @ lb, "addmm bwd": lambda: torch.addmm(dx, gb, la, alpha=s),
            "grad A": lambda: gb.t() @ x, "grad B": lambda: g.t() @ xa}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="llama-1b,llama-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    dev, dt, r, s = "cuda", torch.bfloat16, a.rank, 2.0
    torch.manual_seed(0)
    for row in a.rows.split(","):
        m = SHAPES[row][-1]
        print(f"{row}: {m} tokens, LoRA r{r}, bf16; ms per layer (forward + backward)")
        print(f"  {'linear':6s} {'K':>6s} {'N':>6s} {'base':>8s} {'+LoRA':>8s} {'extra':>7s} {'floor':>7s}")
        tb = tl = tf = 0.0
        detail = []
        for name, k, n in linears(row):
            x = torch.randn(m, k, device=dev, dtype=dt)
            g = torch.randn(m, n, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
            la = torch.randn(r, k, device=dev, dtype=dt) / k ** 0.5
            lb = torch.randn(n, r, device=dev, dtype=dt) / r ** 0.5

            t_base = timed(lambda: base(x, g, w), a.warmup, a.iters)  # noqa: B023 (timed here, in this iteration)
            t_lora = timed(lambda: lora(x, g, w, la, lb, s), a.warmup, a.iters)  # noqa: B023
            detail.append((name, {p: timed(f, a.warmup, a.iters) for p, f in parts(x, g, w, la, lb, s).items()}))
            # the skinny products must each read their large operand once: x twice (x A^T, A's gradient), g twice
            # (g B, B's gradient); the addmms read and write the output and the input gradient once more each
            extra_bytes = 2 * (2 * m * k + 2 * m * n + 2 * m * n + 2 * m * k)
            floor = extra_bytes / 4.0e12 * 1e3  # ms at ~4 TB/s
            tb, tl, tf = tb + t_base, tl + t_lora, tf + floor
            print(f"  {name:6s} {k:6d} {n:6d} {t_base:8.3f} {t_lora:8.3f} {t_lora / t_base - 1:6.1%} {floor:7.3f}")
        print(f"  {'layer':6s} {'':6s} {'':6s} {tb:8.3f} {tl:8.3f} {tl / tb - 1:6.1%} {tf:7.3f}")
        print("  LoRA's products one by one, ms: " + ", ".join(PARTS))
        for name, times in detail:
            print(f"  {name:6s} " + " ".join(f"{times[p]:8.3f}" for p in PARTS))


if __name__ == "__main__":
    main()
