"""Causal attention forward + backward at the training rows' shapes, per SDPA backend (CUDA).

    python bench/attention.py [--rows llama-1b,llama-8b]

bf16 q [b, heads, seq, head dim] and k, v with the rows' fewer key/value heads, as HF's SDPA path passes them to
`scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)`; each backend of torch's SDPA alone
(`sdpa_kernel`), the same with k and v repeated to every head (what HF does where enable_gqa is not taken), and
FlexAttention compiled with a causal block mask. Median of CUDA-event times; TFLOP/s counts the causal half of
4 b h s^2 d forward and 2.5 times that backward. A backend that refuses the shapes says so and is skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_overhead import SHAPES, timed  # noqa: E402  (hidden, intermediate, q heads, kv heads, head dim, tokens)

SEQ = 2048


def bench_row(row: str, warmup: int, iters: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    _, _, qh, kvh, d, tokens = SHAPES[row]
    b, rep = tokens // SEQ, qh // kvh
    flops = 4 * b * qh * SEQ * SEQ * d / 2 * 3.5  # causal forward, backward 2.5x
    q = torch.randn(b, qh, SEQ, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, kvh, SEQ, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    dout = torch.randn_like(q)
    print(f"{row}: batch {b}, {qh} heads ({kvh} key/value), seq {SEQ}, head dim {d}, bf16, causal")

    def step(fn):
        q.grad = k.grad = v.grad = None
        out = fn()
        out.backward(dout)
        return out

    def sdpa_case(backend, gqa: bool):
        def run():
            with sdpa_kernel([backend]):
                if gqa:
                    return sdpa(q, k, v, is_causal=True, enable_gqa=True)
                return sdpa(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        return run

    cases = [(f"{name.lower()}{', enable_gqa' if gqa else ', k/v repeated'}",
              sdpa_case(getattr(SDPBackend, name), gqa))
             for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION") for gqa in (True, False)]
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda _b, _h, qi, ki: qi >= ki, None, None, SEQ, SEQ, device="cuda")
        flex = torch.compile(flex_attention)
        cases.append(("flex_attention (compiled), enable_gqa",
                      lambda: flex(q, k, v, block_mask=mask, enable_gqa=True)))
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"  flex_attention: not available ({type(e).__name__}: {e})")
    ref = None
    for name, fn in cases:
        try:
            out = step(fn)
        except RuntimeError as e:
            print(f"  {name}: refused ({str(e).splitlines()[0][:120]})")
            continue
        if ref is None:
            ref = out.detach().float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ms = timed(lambda fn=fn: step(fn), warmup, iters)
        print(f"  {name}: {ms:.3f} ms forward + backward ({flops / ms / 1e9:.0f} TFLOP/s), output against the "
              f"first: {err:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="llama-1b,llama-8b")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    for row in a.rows.split(","):
        bench_row(row, a.warmup, a.iters)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
