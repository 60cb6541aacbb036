"""One decoder layer's frozen products in bf16 against fp8 (`--quantize-base fp8`'s path), at the 1B and 8B shapes.

For each of a Llama layer's products (q/k/v joined, o, gate/up joined, down) over a micro-batch's tokens: the
forward product and the input's gradient, as plain bf16 matmuls and as tunesmith.qlora does them in fp8 (the input's
and the gradient's rows quantized by their absmax, compiled, then `torch._scaled_mm` against the weight's fp8 rows
and its transposed copy). Prints milliseconds for both (CUDA events, mean of --iters after a warm-up), the speed-up,
and the forward product's relative error. Needs a CUDA GPU with fp8 tensor cores (compute capability 8.9+).

    python bench/fp8_products.py
"""

from __future__ import annotations

import argparse

SHAPES = {  # name: tokens (micro-batch x seq of the throughput rows), hidden, q, kv, intermediate
    "llama-1b": (16384, 2048, 2048, 512, 8192),
    "llama-8b": (8192, 4096, 4096, 1024, 14336),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()

    import torch

    from tunesmith.qlora import fp8_products, fp8_rows

    if not torch.cuda.is_available() or not fp8_products(torch.device("cuda")):
        raise SystemExit("fp8_products: needs a CUDA GPU with fp8 tensor cores (compute capability 8.9+)")
    torch.manual_seed(0)
    rows = torch.compile(fp8_rows)

    def ms(fn) -> float:
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / a.iters

    for name, (tokens, h, q, kv, inter) in SHAPES.items():
        total_bf16 = total_fp8 = 0.0
        for product, (k, n) in {"qkv": (h, q + 2 * kv), "o": (q, h), "gate/up": (h, 2 * inter),
                                "down": (inter, h)}.items():
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            g = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
            wq, ws = fp8_rows(w)
            wtq, wts = fp8_rows(w.t())

            def bf16(x=x, w=w, g=g):
                return x @ w.t(), g @ w

            def fp8(x=x, g=g, wq=wq, ws=ws, wtq=wtq, wts=wts):
                xq, xs = rows(x)
                y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)
                gq, gs = rows(g)
                return y, torch._scaled_mm(gq, wtq.t(), scale_a=gs, scale_b=wts.t(), out_dtype=torch.bfloat16)

            t_bf16, t_fp8 = ms(bf16), ms(fp8)
            exact, approx = bf16()[0].float(), fp8()[0].float()
            err = ((approx - exact).norm() / exact.norm()).item()
            flops = 4 * tokens * k * n
            print(f"{name} {product:8s} {tokens} x {k} x {n}: bf16 {t_bf16:.3f} ms ({flops / t_bf16 / 1e9:.0f} "
                  f"TFLOP/s), fp8 {t_fp8:.3f} ms, {t_bf16 / t_fp8:.2f}x, forward error {err:.4f}")
            total_bf16 += t_bf16
            total_fp8 += t_fp8
        print(f"{name}: a layer's products {total_bf16:.2f} ms in bf16, {total_fp8:.2f} in fp8: "
              f"{total_bf16 / total_fp8:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
