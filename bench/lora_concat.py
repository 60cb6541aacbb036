"""LoRA's up-projection folded into the frozen product's inner dimension, against PEFT's and tunesmith's current
LoRA linear, forward + backward at a row's shapes (CUDA, bf16).

    python bench/lora_concat.py [--rows llama-1b,llama-8b] [--rank 16]

y = x W^T + s (x A^T) B^T is one product [x | s x A^T] [W | B]^T over K + r, and the input's gradient
g W + s (g B) A is one product [g | s g B] [W ; A] over N + r: no pass over the M x N output (or the M x K input
gradient) to add LoRA's part in. Both read one buffer Z = [[W, B], [A, 0]] ((N + r) x (K + r)): the first N rows
for the forward product, the first K columns (a strided view) for the backward one. Each direction concatenates
whichever of its two operands is narrower and adds the rank-r term with addmm otherwise.

--products: why it does not pay. The product alone at the model's K, at K + 16 ... K + 128, through a strided
view of a wider buffer (what sharing Z means for the base product), the in-place addmm it would replace and the
concatenation it adds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_overhead import SHAPES, linears, timed  # noqa: E402


class ConcatLoRA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, a, b, s, n, k):
        z[:n, k:].copy_(b)
        z[n:, :k].copy_(a)
        xa = x @ a.t()
        if k <= n:
            y = torch.cat([x, xa * s], 1) @ z[:n].t()
        else:
            y = x @ z[:n, :k].t()
            y.addmm_(xa, b.t(), alpha=s)
        ctx.save_for_backward(x, xa, z, a, b)
        ctx.s, ctx.n, ctx.k = s, n, k
        return y

    @staticmethod
    def backward(ctx, g):
        x, xa, z, a, b = ctx.saved_tensors
        s, n, k = ctx.s, ctx.n, ctx.k
        gb = (g @ b).mul_(s)
        if n <= k:
            dx = torch.cat([g, gb], 1) @ z[:, :k]
        else:
            dx = g @ z[:n, :k]
            dx.addmm_(gb, a)
        return dx, None, gb.t() @ x, (g.t() @ xa).mul_(s), None, None, None


def peft(x, w, a, b, s):
    return torch.nn.functional.linear(x, w) + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="llama-1b,llama-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--compile", action="store_true", help="also PEFT's path compiled (Inductor)")
    ap.add_argument("--products", action="store_true", help="then the products alone (see above)")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from tunesmith.fused import _LoraLinear

    dev, dt, r, s = "cuda", torch.bfloat16, a.rank, 2.0
    torch.manual_seed(0)
    peft_c = torch.compile(peft, dynamic=False) if a.compile else None
    for row in a.rows.split(","):
        m = SHAPES[row][-1]
        names = ["base only", "PEFT eager"] + (["PEFT compiled"] if a.compile else []) + ["addmm (now)", "concat"]
        print(f"{row}: {m} tokens, LoRA r{r}, bf16; forward + backward, ms")
        print(f"  {'linear':6s} " + " ".join(f"{n:>13s}" for n in names) + "   max |concat - addmm| / max |y|")
        tot = dict.fromkeys(names, 0.0)
        for name, k, n in linears(row):
            x = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
            g = torch.randn(m, n, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
            la = (torch.randn(r, k, device=dev, dtype=dt) / k ** 0.5).requires_grad_()
            lb = (torch.randn(n, r, device=dev, dtype=dt) / r ** 0.5).requires_grad_()
            z = torch.zeros(n + r, k + r, device=dev, dtype=dt)
            z[:n, :k].copy_(w)
            wv = z[:n, :k]

            def step(f, x=x, la=la, lb=lb, g=g):
                def run():
                    x.grad = la.grad = lb.grad = None
                    f().backward(g)
                return run

            fns = {"base only": step(lambda: torch.nn.functional.linear(x, w)),  # noqa: B023
                   "PEFT eager": step(lambda: peft(x, w, la, lb, s)),  # noqa: B023
                   "addmm (now)": step(lambda: _LoraLinear.apply(x, None, w, None, la, lb, s, dt)),  # noqa: B023
                   "concat": step(lambda: ConcatLoRA.apply(x, z, la, lb, s, n, k))}  # noqa: B023
            if peft_c is not None:
                fns["PEFT compiled"] = step(lambda: peft_c(x, w, la, lb, s))  # noqa: B023
            t = {nm: timed(fns[nm], a.warmup, a.iters) for nm in names}
            with torch.no_grad():
                y1 = _LoraLinear.apply(x, None, w, None, la, lb, s, dt)
                y2 = ConcatLoRA.apply(x, z, la, lb, s, n, k)
                err = float((y1 - y2).abs().max() / y1.abs().max())
            assert torch.equal(wv, w)
            for nm in names:
                tot[nm] += t[nm]
            print(f"  {name:6s} " + " ".join(f"{t[nm]:13.3f}" for nm in names) + f"   {err:.1e}")
        print(f"  {'layer':6s} " + " ".join(f"{tot[nm]:13.3f}" for nm in names))
    if a.products:
        products(a.rows.split(","), r, a.warmup, a.iters)


def products(rows: list[str], r: int, warmup: int, iters: int) -> None:
    dt = torch.bfloat16
    print(f"products alone, ms (M x K x N; K + p: the input and weight p columns wider; view: the weight a strided "
          f"view of an N + {r} x K + {r} buffer)")
    for row in rows:
        m = SHAPES[row][-1]
        for name, k, n in linears(row):
            if name in ("up", "o"):
                continue  # the same shapes as gate, and near q/k/v's
            x = torch.randn(m, k, device="cuda", dtype=dt)
            xa, b = torch.randn(m, r, device="cuda", dtype=dt), torch.randn(n, r, device="cuda", dtype=dt)
            cells = []
            for pad in (0, 16, 32, 64, 128):
                z = torch.randn(n + r, k + pad, device="cuda", dtype=dt)
                xe = torch.randn(m, k + pad, device="cuda", dtype=dt)
                cells.append(f"K+{pad} {timed(lambda z=z, xe=xe: xe @ z[:n].t(), warmup, iters):.3f}")  # noqa: B023
                if pad == r:
                    cells.append(f"view {timed(lambda z=z: x @ z[:n, :k].t(), warmup, iters):.3f}")  # noqa: B023
            y = x @ torch.randn(n, k, device="cuda", dtype=dt).t()
            cells.append(f"addmm_ {timed(lambda y=y: y.addmm_(xa, b.t()), warmup, iters):.3f}")  # noqa: B023
            cells.append(f"cat {timed(lambda: torch.cat([x, xa], 1), warmup, iters):.3f}")  # noqa: B023
            print(f"  {row} {name:5s} {m}x{k}x{n}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
