"""Rotary position embedding straight out of the joined q/k/v product, and its gradient straight back into it.

The fused q/k/v attention (`qkv.fuse_qkv`) computes one [tokens, (Hq + 2 Hk) D] product. transformers then splits
it, rotates q and k (q cos + rotate_half(q) sin, each product and the sum rounded to the compute dtype), and the
backward pass undoes the rotation and joins dq, dk and dv into the product's gradient; torch.compile fuses each of
these into one elementwise kernel whose every element works out which part, head, position and half it belongs to.
Here one Triton kernel per direction does it in tiles of tokens by one head: the forward reads the joined product
once and writes q, k (rotated) and v as [batch, seq, heads, D]; the backward reads dq, dk and dv (any strides) and
writes the joined gradient, [tokens, (Hq + 2 Hk) D], rotating back with

    dx1 = dy1 cos1 + dy2 sin2,  dx2 = dy2 cos2 - dy1 sin1    (x1, x2: the two halves of a head)

the adjoint of y1 = x1 cos1 - x2 sin1, y2 = x2 cos2 + x1 sin2, computed in fp32 and rounded once.

Triton on CUDA; the same operations in PyTorch (fp32 inside, as the kernels compute) serve other devices and the
tests, which also run the kernels under Triton's interpreter.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of torch come without Triton; the PyTorch reference serves there
    triton = None

BLOCK_T = 32  # tokens a program


# ------------------------------------------------------------------------------------------------ the reference


def _halves(cos: torch.Tensor, sin: torch.Tensor, batch: int, seq: int):
    """cos and sin as [batch, seq, 1, D] in fp32, split into their halves."""
    d = cos.shape[-1]
    c = cos.float().expand(batch, seq, d)[:, :, None]
    s = sin.float().expand(batch, seq, d)[:, :, None]
    return c[..., : d // 2], c[..., d // 2 :], s[..., : d // 2], s[..., d // 2 :]


def _forward_reference(qkv, cos, sin, batch: int, hq: int, hk: int):
    d = cos.shape[-1]
    x = qkv.view(batch, -1, hq + 2 * hk, d)
    seq = x.shape[1]
    c1, c2, s1, s2 = _halves(cos, sin, batch, seq)
    xr = x[:, :, : hq + hk].float()
    x1, x2 = xr[..., : d // 2], xr[..., d // 2 :]
    rot = torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], dim=-1).to(qkv.dtype)
    return rot[:, :, :hq].contiguous(), rot[:, :, hq:].contiguous(), x[:, :, hq + hk :].contiguous()


def _backward_reference(dq, dk, dv, cos, sin):
    batch, seq, _, d = dq.shape
    c1, c2, s1, s2 = _halves(cos, sin, batch, seq)
    dy = torch.cat([dq, dk], dim=2).float()
    y1, y2 = dy[..., : d // 2], dy[..., d // 2 :]
    dx = torch.cat([y1 * c1 + y2 * s2, y2 * c2 - y1 * s1], dim=-1).to(dq.dtype)
    return torch.cat([dx, dv.to(dq.dtype)], dim=2).reshape(batch * seq, -1)


# ------------------------------------------------------------------------------------------------ Triton kernels
# Program (token block, head): BLOCK_T tokens of one head, both halves. Heads below ROT (q and k) are rotated, the
# rest (v) copied. Sources and destinations are addressed as [batch, seq, head, D] by their strides, so the forward
# reads the joined product in place and the backward reads the attention kernel's gradients in whatever layout it
# made them.

if triton is not None:

    @triton.jit
    def _rope_kernel(SRC, DST, COS, SIN, T, SEQ, ROT,
                     ssb, sss, ssh, dsb, dss, dsh, csb, css, BACKWARD: tl.constexpr, HALF: tl.constexpr,
                     BLOCK: tl.constexpr):
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        head = tl.program_id(1)
        live = t < T
        b = (t // SEQ).to(tl.int64)
        s = (t % SEQ).to(tl.int64)
        col = tl.arange(0, HALF)
        mask = live[:, None]
        src = SRC + (b * ssb + s * sss + head * ssh)[:, None] + col[None, :]
        dst = DST + (b * dsb + s * dss + head * dsh)[:, None] + col[None, :]
        x1 = tl.load(src, mask=mask, other=0.0)
        x2 = tl.load(src + HALF, mask=mask, other=0.0)
        if head < ROT:
            trig = (b * csb + s * css)[:, None] + col[None, :]
            c1 = tl.load(COS + trig, mask=mask, other=0.0).to(tl.float32)
            c2 = tl.load(COS + trig + HALF, mask=mask, other=0.0).to(tl.float32)
            s1 = tl.load(SIN + trig, mask=mask, other=0.0).to(tl.float32)
            s2 = tl.load(SIN + trig + HALF, mask=mask, other=0.0).to(tl.float32)
            a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
            if BACKWARD:
                y1 = a1 * c1 + a2 * s2
                y2 = a2 * c2 - a1 * s1
            else:
                y1 = a1 * c1 - a2 * s1
                y2 = a2 * c2 + a1 * s2
            tl.store(dst, y1.to(DST.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, y2.to(DST.dtype.element_ty), mask=mask)
        else:
            tl.store(dst, x1.to(DST.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, x2.to(DST.dtype.element_ty), mask=mask)


def _trig_strides(cos: torch.Tensor, batch: int, seq: int) -> tuple[int, int]:
    c = cos.expand(batch, seq, cos.shape[-1])
    return c.stride(0), c.stride(1)


def _launch(src, dst, cos, sin, batch: int, seq: int, heads: int, rot: int, backward: bool) -> None:
    """src, dst: [batch, seq, heads, D] views (last dimension contiguous)."""
    d = cos.shape[-1]
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    csb, css = _trig_strides(cos, batch, seq)
    grid = (triton.cdiv(batch * seq, BLOCK_T), heads)
    _rope_kernel[grid](src, dst, cos, sin, batch * seq, seq, rot, *src.stride()[:3], *dst.stride()[:3], csb, css,
                       BACKWARD=backward, HALF=d // 2, BLOCK=BLOCK_T, num_warps=4)


def _forward_triton(qkv, cos, sin, batch: int, hq: int, hk: int):
    d = cos.shape[-1]
    x = qkv.view(batch, -1, hq + 2 * hk, d)
    seq = x.shape[1]
    parts = [qkv.new_empty(batch, seq, n, d) for n in (hq, hk, hk)]
    for dst, first, rot in zip(parts, (0, hq, hq + hk), (hq, hk, 0), strict=True):
        _launch(x[:, :, first : first + dst.shape[2]], dst, cos, sin, batch, seq, dst.shape[2], rot, backward=False)
    return tuple(parts)


def _backward_triton(dq, dk, dv, cos, sin):
    batch, seq, hq, d = dq.shape
    hk = dk.shape[2]
    out = dq.new_empty(batch, seq, hq + 2 * hk, d)
    for src, first, rot in ((dq, 0, hq), (dk, hq, hk), (dv, hq + hk, 0)):
        if src.stride(-1) != 1:
            src = src.contiguous()
        _launch(src, out[:, :, first : first + src.shape[2]], cos, sin, batch, seq, src.shape[2], rot,
                backward=True)
    return out.view(batch * seq, -1)


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


# ------------------------------------------------------------------------------------------------ the ops


@torch.library.custom_op("tunesmith::rope_qkv", mutates_args=())
def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: int, hq: int,
             hk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the joined product [batch * seq, (hq + 2 hk) D]: q and k rotated by cos / sin ([batch or 1, seq, D]),
    and v, each [batch, seq, heads, D], contiguous."""
    if _use_triton(qkv):
        return _forward_triton(qkv.contiguous(), cos, sin, batch, hq, hk)
    return _forward_reference(qkv.contiguous(), cos, sin, batch, hq, hk)


@rope_qkv.register_fake
def _(qkv, cos, sin, batch, hq, hk):
    d = cos.shape[-1]
    seq = qkv.shape[0] // batch
    return (qkv.new_empty(batch, seq, hq, d), qkv.new_empty(batch, seq, hk, d), qkv.new_empty(batch, seq, hk, d))


@torch.library.custom_op("tunesmith::rope_qkv_backward", mutates_args=())
def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """The joined product's gradient, [batch * seq, (hq + 2 hk) D], from those of q, k and v (any strides)."""
    if _use_triton(dq):
        return _backward_triton(dq, dk, dv, cos, sin)
    return _backward_reference(dq, dk, dv, cos, sin)


@rope_qkv_backward.register_fake
def _(dq, dk, dv, cos, sin):
    batch, seq, hq, d = dq.shape
    return dq.new_empty(batch * seq, (hq + 2 * dk.shape[2]) * d)


def _setup(ctx, inputs, output):
    _, cos, sin, *_ = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    return rope_qkv_backward(dq, dk, dv, cos, sin), None, None, None, None, None


rope_qkv.register_autograd(_backward, setup_context=_setup)
