"""The frozen products of a Llama MLP's gate and up projections, as two products or as one over joined weights.

Forward, g0 = x W_g^T and u0 = x W_u^T are two products of N = intermediate each, or one of N = 2 x intermediate
over [W_g; W_u] (its two halves then strided views). Backward, the input gradient dg W_g + du W_u is a product and
an addmm (which reads and writes the [tokens, hidden] result once more), or one product of K = 2 x intermediate
over [dg | du]. Timed with CUDA events at the benchmark rows' shapes (bf16, tokens = micro-batch x seq), each
variant's result checked against the other's.

    python bench/mlp_products.py            # the Llama-3.2-1B and Llama-3.1-8B rows
"""

from __future__ import annotations

import argparse

SHAPES = {"llama-1b": (16384, 2048, 8192), "llama-8b": (8192, 4096, 14336)}  # tokens, hidden, intermediate


def timed(fn, reps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def compare(m: int, k: int, n: int, reps: int) -> list[tuple]:
    """(what, ms as two products, ms as one, flop, largest relative difference) forward and backward."""
    import torch

    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, **bf)
    wgu = torch.randn(2 * n, k, **bf) / k**0.5
    wg, wu = wgu[:n], wgu[n:]
    dgu = torch.randn(m, 2 * n, **bf)
    dg, du = dgu[:, :n].contiguous(), dgu[:, n:].contiguous()
    flop = 2 * m * k * 2 * n

    def diff(one, two):
        return ((one.float() - two.float()).abs().max() / two.float().abs().max()).item()

    return [
        ("forward g0, u0", timed(lambda: (x @ wg.t(), x @ wu.t()), reps), timed(lambda: x @ wgu.t(), reps), flop,
         diff(x @ wgu.t(), torch.cat([x @ wg.t(), x @ wu.t()], 1))),
        ("backward dx", timed(lambda: torch.addmm(dg @ wg, du, wu), reps), timed(lambda: dgu @ wgu, reps), flop,
         diff(dgu @ wgu, torch.addmm(dg @ wg, du, wu))),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("mlp_products: needs a CUDA device")
    torch.manual_seed(0)
    for row in a.rows.split(","):
        for what, t2, t1, flop, err in compare(*SHAPES[row], a.reps):
            print(f"{row} {what}: two {t2:.3f} ms ({flop / t2 / 1e9:.0f} TFLOP/s), joined {t1:.3f} ms "
                  f"({flop / t1 / 1e9:.0f} TFLOP/s), {t2 / t1:.3f}x; largest difference {err:.1e} of the largest value")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
