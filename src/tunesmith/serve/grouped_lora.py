"""Each token's own LoRA adapter in one pass over a batch, as two Triton kernels (Punica's shrink and expand).

For one linear served with adapters 1..n: A of every adapter stacked [n, in, R] and B [n, R, out] (ranks padded with
zeros to one R, a power of two), each adapter's scale beside them. Per token t of adapter a (-1: the base):

- shrink: v[t] = scale[a] * (x[t] @ A[a]), in float32, [tokens, R];
- expand: y[t] += v[t] @ B[a], in place over the base's output, rounded once to y's dtype.

A row of the base reads and writes nothing. Against serve.batch's stacked path (x @ A_all, times a per-token mask,
then addmm with B_all: three kernels, every adapter's columns for every token) it is two kernels that read only
the token's own adapter.

`masked_add` is the stacked path's second half as one kernel: y += (h * mask) @ B_all, the mask's product and the
addition in place that PyTorch runs as two (mul_, then addmm_). Each program reads one block of B_all's columns
once, for every token of the step, and each token's sum runs over the ranks in the same order whatever else the
step holds. `available` says whether these can run for a tensor; tests run them on the CPU under Triton's
interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU, or a GPU build without Triton: serve.batch's stacked path
    triton = None

BLOCK_K, BLOCK_N = 128, 128


def available(x: torch.Tensor) -> bool:
    import os

    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _shrink(x_ptr, a_ptr, scale_ptr, index_ptr, v_ptr, K, stride_x, R: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        n = tl.load(index_ptr + t)
        k_end = tl.where(n >= 0, K, 0)  # a row of the base loads nothing
        n = tl.maximum(n, 0)
        r = tl.arange(0, R)
        acc = tl.zeros([R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t * stride_x + k, mask=k < k_end, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + n * K * R + k[:, None] * R + r[None, :], mask=k[:, None] < k_end, other=0.0)
            acc += tl.sum(xk[:, None] * a.to(tl.float32), axis=0)
        scale = tl.load(scale_ptr + n)
        tl.store(v_ptr + t * R + r, acc * scale)

    @triton.jit
    def _expand(v_ptr, b_ptr, index_ptr, y_ptr, N, stride_y, R: tl.constexpr, BLOCK_N: tl.constexpr):
        t = tl.program_id(0)
        n = tl.load(index_ptr + t)
        n_end = tl.where(n >= 0, N, 0)  # a row of the base loads and stores nothing
        n = tl.maximum(n, 0)
        o = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, R)
        keep = o < n_end
        v = tl.load(v_ptr + t * R + r)
        b = tl.load(b_ptr + n * R * N + r[:, None] * N + o[None, :], mask=keep[None, :], other=0.0)
        delta = tl.sum(v[:, None] * b.to(tl.float32), axis=0)
        y = tl.load(y_ptr + t * stride_y + o, mask=keep, other=0.0)
        tl.store(y_ptr + t * stride_y + o, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=keep)


    @triton.jit
    def _masked_add(h_ptr, m_ptr, b_ptr, y_ptr, T, J, N, stride_h, stride_m, stride_y, IEEE: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr):
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        o = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for j0 in range(0, J, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            keep = (t[:, None] < T) & (j[None, :] < J)
            h = tl.load(h_ptr + t[:, None] * stride_h + j[None, :], mask=keep, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + t[:, None] * stride_m + j[None, :], mask=keep, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + j[:, None] * N + o[None, :], mask=(j[:, None] < J) & (o[None, :] < N), other=0.0)
            hm = (h * m).to(b_ptr.dtype.element_ty)  # rounded to the weights' dtype, as the stacked path's mul_
            acc += tl.dot(hm, b, input_precision="ieee" if IEEE else "tf32")
        keep = (t[:, None] < T) & (o[None, :] < N)
        y = tl.load(y_ptr + t[:, None] * stride_y + o[None, :], mask=keep, other=0.0)
        tl.store(y_ptr + t[:, None] * stride_y + o[None, :], (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty),
                 mask=keep)


def masked_add(y: torch.Tensor, h: torch.Tensor, mask: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """y += (h * mask) @ b in place, one kernel. y [tokens, out] and h [tokens, ranks] may be views with a row
    stride (the joined product's columns); mask [tokens, ranks] and b [ranks, out] contiguous; one dtype."""
    tokens, ranks = h.shape
    mask, b = mask.contiguous(), b.contiguous()
    block_t = 16 if tokens <= 16 else 32
    block_j = min(64, max(16, 1 << (ranks - 1).bit_length()))
    grid = (triton.cdiv(y.shape[1], 64), triton.cdiv(tokens, block_t))
    _masked_add[grid](h, mask, b, y, tokens, ranks, y.shape[1], h.stride(0), mask.stride(0), y.stride(0),
                      IEEE=b.dtype == torch.float32, BLOCK_T=block_t, BLOCK_J=block_j, BLOCK_N=64)
    return y


def grouped(a: list[torch.Tensor], b: list[torch.Tensor], scales: list[float]):
    """The stacked weights the kernels read: A [n, in, R] and B [n, R, out] from each adapter's PEFT weights
    (lora_A [rank, in], lora_B [out, rank]), ranks padded with zeros to R; the scales as float32 [n]."""
    rank = max(16, 1 << (max(w.shape[0] for w in a) - 1).bit_length())
    a_all = a[0].new_zeros(len(a), a[0].shape[1], rank)
    b_all = b[0].new_zeros(len(b), rank, b[0].shape[0])
    for i, (wa, wb) in enumerate(zip(a, b, strict=True)):
        a_all[i, :, : wa.shape[0]] = wa.t()
        b_all[i, : wb.shape[1]] = wb.t()
    return a_all.contiguous(), b_all.contiguous(), torch.tensor(scales, dtype=torch.float32, device=a[0].device)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
             index: torch.Tensor) -> torch.Tensor:
    """y[t] += scales[i] * x[t] @ a[i] @ b[i] for each token t whose index i = index[t] is not -1; y in place.
    x [tokens, in], y [tokens, out] (rows may be strided), index int [tokens]."""
    tokens, rank = x.shape[0], a.shape[2]
    v = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    _shrink[(tokens,)](x, a, scales, index, v, x.shape[1], x.stride(0), R=rank, BLOCK_K=BLOCK_K)
    _expand[(tokens, triton.cdiv(y.shape[1], BLOCK_N))](v, b, index, y, y.shape[1], y.stride(0), R=rank,
                                                        BLOCK_N=BLOCK_N)
    return y


def reference(y, x, a, b, scales, index):
    """What add_lora computes, in PyTorch (float32 products, y rounded once)."""
    out = y.float()
    for t, i in enumerate(index.tolist()):
        if i >= 0:
            out[t] += scales[i] * (x[t].float() @ a[i].float()) @ b[i].float()
    return out.to(y.dtype)
