"""RoPE out of the joined q/k/v product, forward + backward (CUDA): transformers' path compiled as the trainer's
layers are (split, v made contiguous, apply_rotary_pos_emb) against rope.rope_qkv's Triton kernels.

    python bench/rope_kernel.py [--rows llama-1b,llama-8b]

For each row: the joined product [tokens, (Hq + 2 Hk) D] in bf16 at the row's micro-batch (seq 2048), cos / sin as
LlamaRotaryEmbedding makes them, gradients for q, k and v as the attention kernel hands them back ([b, h, s, d]).
Prints the median time of each path (CUDA events), the bytes each must move at the least (the product read and
q, k, v written; the same backward), and how far the kernels' outputs are from the compiled path's.
Each path runs eagerly between the CUDA events, its launches included: at these sizes the host's launches weigh
more than the GPU's work, so the training step, whose layers replay from CUDA graphs, is the measure that counts
(bench/train_throughput.py with fused.ROPE_KERNEL flipped).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_overhead import SHAPES, timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="llama-1b,llama-8b")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def plain(qkv, cos, sin, batch, hq, hk):
        d = cos.shape[-1]
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q = q.reshape(batch, -1, hq, d).transpose(1, 2)
        k, v = (t.reshape(batch, -1, hk, d).transpose(1, 2) for t in (k, v.contiguous()))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    compiled = torch.compile(plain)
    for row in a.rows.split(","):
        bench_row(row, a, compiled)


def bench_row(row: str, a, compiled) -> None:
    from tunesmith.rope import rope_qkv

    _, _, hq, hk, d, m = SHAPES[row]
    batch, seq = m // 2048, 2048
    torch.manual_seed(0)
    qkv = torch.randn(m, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(seq, device="cuda")[None].expand(batch, seq)
    freqs = pos[..., None].float() * (1.0 / 500000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    grads = [torch.randn(batch, h, seq, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk)]

    def run(fn, transpose):
        qkv.grad = None
        out = fn(qkv, cos, sin, batch, hq, hk)
        if transpose:
            out = [t.transpose(1, 2) for t in out]
        torch.autograd.backward(out, grads)
        return out

    t_plain = timed(lambda: run(compiled, False), a.warmup, a.iters)
    t_kernel = timed(lambda: run(rope_qkv, True), a.warmup, a.iters)
    ref = [t.float() for t in run(compiled, False)]
    ref_grad = qkv.grad.float()
    got = run(rope_qkv, True)
    err = max(float((x.detach().float() - y).abs().max() / y.abs().max()) for x, y in zip(got, ref, strict=True))
    err_grad = float((qkv.grad.float() - ref_grad).abs().max() / ref_grad.abs().max())
    least = 2 * 2 * qkv.numel() * 2  # forward and backward each read and write the product's size in bf16
    print(f"{row}: {batch} x {seq} tokens, {hq} + {hk} + {hk} heads of {d}: compiled transformers' path "
          f"{t_plain:.3f} ms, rope_qkv {t_kernel:.3f} ms ({t_plain / t_kernel:.2f}x; {least / t_kernel / 1e9:.2f} "
          f"TB/s at the least bytes); largest difference q/k/v {err:.1e}, the product's gradient {err_grad:.1e}")

if __name__ == "__main__":
    main()
