"""A Llama MLP with LoRA on gate, up and down projections as one autograd function whose SwiGLU knows about LoRA.

PEFT's path (compiled or not) writes each rank-r term s (x A^T) B^T of gate and up as a full [tokens, intermediate]
tensor and reads it back to add it to the base product; the down projection's LoRA reads the SwiGLU output once
more for h A_d^T; backward, its rank-r term (g B_d) A_d is one more full-size tensor added into the SwiGLU's input
gradient, and dg B_g, du B_u read the gate and up gradients again. Here one kernel computes
h = SiLU(g0 + s_g xa_g B_g^T) * (u0 + s_u xa_u B_u^T) with the rank-r terms made in registers from the [tokens, r]
down-projections xa (never written), and h A_d^T from the same registers. Backward, one kernel rebuilds g and u the
same way from the saved base products, adds the down projection's rank-r term into the incoming gradient in
registers, writes the gate and up gradients, and sums dg B_g and du B_u as it goes. Each program owns a block of
rows and walks their whole width, so those sums stay in its registers: no partial sums shared between programs, no
atomics, the same bits from the same inputs.

The kernels are Triton, on CUDA. The same two operations in plain PyTorch (fp32 inside, as the kernels compute)
serve every other device, so the function's algebra is tested on the CPU; the Triton kernels themselves are
checked against them by the tests under Triton's interpreter where Triton is installed.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from tunesmith.kernels.base import (
    Setting,
    nf4_base,
    plain_lora,
    replace_forward,
    restore_forward,
    triton_available,
)
from tunesmith.kernels.nf4 import base_mm, frozen_base
from tunesmith.kernels.products import products_sum

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of torch come without Triton; the PyTorch reference serves there
    triton = None


# ------------------------------------------------------------------------------------------------ the reference


def _swiglu_reference(g0: torch.Tensor, u0: torch.Tensor, xa: torch.Tensor, bg: torch.Tensor, bu: torch.Tensor,
                      sg: float, su: float) -> tuple[torch.Tensor, torch.Tensor]:
    """g and u in fp32: the base products plus their rank-r terms."""
    r = bg.shape[1]
    f = torch.float32
    g = torch.addmm(g0.to(f), xa[:, :r].to(f), bg.to(f).t(), alpha=sg)  # never in place: g0 and u0 are kept
    u = torch.addmm(u0.to(f), xa[:, r:].to(f), bu.to(f).t(), alpha=su)
    return g, u


def _forward_reference(g0, u0, xa, bg, bu, ad, sg, su):
    g, u = _swiglu_reference(g0, u0, xa, bg, bu, sg, su)
    h = (torch.nn.functional.silu(g) * u).to(g0.dtype)
    return h, (h.to(torch.float32) @ ad.to(torch.float32).t()).to(g0.dtype)


def _backward_reference(dh0, dyb, ad, g0, u0, xa, bg, bu, sg, su, sd):
    g, u = _swiglu_reference(g0, u0, xa, bg, bu, sg, su)
    dh = torch.addmm(dh0.to(torch.float32), dyb.to(torch.float32), ad.to(torch.float32), alpha=sd)
    sig = torch.sigmoid(g)
    silu = g * sig
    dt, f = g0.dtype, torch.float32
    dg = (dh * u * sig * (1 + g * (1 - sig))).to(dt)
    du = (dh * silu).to(dt)
    dxa = torch.cat([dg.to(f) @ bg.to(f) * sg, du.to(f) @ bu.to(f) * su], dim=1)
    h = (silu * u).to(dt)
    dad = (dyb.to(f).t() @ h.to(f) * sd).to(dt)  # A_d's gradient, sd dyb^T h
    return dg, du, dad, dxa.to(dt)


# ------------------------------------------------------------------------------------------------ Triton kernels
# Each program owns BLOCK_M rows and walks a segment of W columns of them (the whole width, or a fixed share of it
# where there are too few row blocks to fill the GPU) in BLOCK_N columns, so the sums over the width (h A_d^T
# forward, dg B_g and du B_u backward) stay in its registers; a segment's sums go to their own slot of an fp32
# buffer, added up afterwards in a fixed order.

if triton is not None:

    @triton.jit
    def _load(ptr, mask, EVEN: tl.constexpr):
        """A full-size tile; EVEN: the tiles cover the tensor exactly, so no mask (loads a mask would split)."""
        if EVEN:
            x = tl.load(ptr)
        else:
            x = tl.load(ptr, mask=mask, other=0.0)
        return x

    @triton.jit
    def _store(ptr, x, mask, EVEN: tl.constexpr):
        if EVEN:
            tl.store(ptr, x)
        else:
            tl.store(ptr, x, mask=mask)

    @triton.jit
    def _swiglu_fwd_kernel(G, U, XA, BG, BU, AD, H, HA, M, N, W, stride_g, stride_u, stride_xa, stride_h, sg, su,
                           R: tl.constexpr, RP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           PRECISION: tl.constexpr, EVEN: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        seg = tl.program_id(1)
        rk = tl.arange(0, RP)
        in_m, in_k = rm < M, rk < R
        rows = rm[:, None].to(tl.int64)
        a_mask = in_m[:, None] & in_k[None, :]
        xa_g = tl.load(XA + rows * stride_xa + rk[None, :], mask=a_mask, other=0.0)
        xa_u = tl.load(XA + rows * stride_xa + R + rk[None, :], mask=a_mask, other=0.0)
        ha = tl.zeros((BLOCK_M, RP), dtype=tl.float32)
        for n0 in range(seg * W, tl.minimum(seg * W + W, N), BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            in_n = rn < N
            tile = in_m[:, None] & in_n[None, :]
            b_mask = in_k[:, None] & in_n[None, :]
            bg = tl.load(BG + rn[None, :] * R + rk[:, None], mask=b_mask, other=0.0)  # B_g^T: [RP, BLOCK_N]
            bu = tl.load(BU + rn[None, :] * R + rk[:, None], mask=b_mask, other=0.0)
            adt = tl.load(AD + rk[None, :] * N + rn[:, None], mask=in_n[:, None] & in_k[None, :], other=0.0)
            g = _load(G + rows * stride_g + rn[None, :], tile, EVEN).to(tl.float32)
            u = _load(U + rows * stride_u + rn[None, :], tile, EVEN).to(tl.float32)
            g += sg * tl.dot(xa_g, bg, input_precision=PRECISION)
            u += su * tl.dot(xa_u, bu, input_precision=PRECISION)
            h = (g * tl.sigmoid(g) * u).to(H.dtype.element_ty)
            _store(H + rows * stride_h + rn[None, :], h, tile, EVEN)
            ha += tl.dot(h, adt, input_precision=PRECISION)  # h A_d^T, from h as stored
        tl.store(HA + seg.to(tl.int64) * M * R + rows * R + rk[None, :], ha, mask=a_mask)

    @triton.jit
    def _swiglu_bwd_kernel(DH, DYB, AD, G, U, XA, BG, BU, DG, DU, H, DXA, M, N, W, stride_dh, stride_dyb, stride_g,
                           stride_u, stride_xa, stride_dg, stride_du, sg, su, sd,
                           R: tl.constexpr, RP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           PRECISION: tl.constexpr, EVEN: tl.constexpr):
        # Not h ([M, N]) but each row block's share of A_d's gradient, sd dyb^T h ([R, N] in fp32, at
        # H + row block * R * N), summed over the row blocks afterwards: h is never written
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        seg = tl.program_id(1)
        rk = tl.arange(0, RP)
        in_m, in_k = rm < M, rk < R
        rows = rm[:, None].to(tl.int64)
        a_mask = in_m[:, None] & in_k[None, :]
        xa_g = tl.load(XA + rows * stride_xa + rk[None, :], mask=a_mask, other=0.0)
        xa_u = tl.load(XA + rows * stride_xa + R + rk[None, :], mask=a_mask, other=0.0)
        dyb = tl.load(DYB + rows * stride_dyb + rk[None, :], mask=a_mask, other=0.0)
        dxa_g = tl.zeros((BLOCK_M, RP), dtype=tl.float32)
        dxa_u = tl.zeros((BLOCK_M, RP), dtype=tl.float32)
        for n0 in range(seg * W, tl.minimum(seg * W + W, N), BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            in_n = rn < N
            tile = in_m[:, None] & in_n[None, :]
            b_mask = in_k[:, None] & in_n[None, :]
            bg = tl.load(BG + rn[None, :] * R + rk[:, None], mask=b_mask, other=0.0)
            bu = tl.load(BU + rn[None, :] * R + rk[:, None], mask=b_mask, other=0.0)
            ad = tl.load(AD + rk[:, None] * N + rn[None, :], mask=b_mask, other=0.0)  # A_d: [RP, BLOCK_N]
            g = _load(G + rows * stride_g + rn[None, :], tile, EVEN).to(tl.float32)
            u = _load(U + rows * stride_u + rn[None, :], tile, EVEN).to(tl.float32)
            dh = _load(DH + rows * stride_dh + rn[None, :], tile, EVEN).to(tl.float32)
            g += sg * tl.dot(xa_g, bg, input_precision=PRECISION)
            u += su * tl.dot(xa_u, bu, input_precision=PRECISION)
            dh += sd * tl.dot(dyb, ad, input_precision=PRECISION)
            sig = tl.sigmoid(g)
            silu = g * sig
            dg = (dh * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty)
            du = (dh * silu).to(DU.dtype.element_ty)
            _store(DG + rows * stride_dg + rn[None, :], dg, tile, EVEN)
            _store(DU + rows * stride_du + rn[None, :], du, tile, EVEN)
            h = (silu * u).to(DG.dtype.element_ty)  # as the product from a stored h would read it
            part = H + tl.program_id(0).to(tl.int64) * R * N + rk[:, None] * N + rn[None, :]
            tl.store(part, sd * tl.dot(tl.trans(dyb), h, input_precision=PRECISION), mask=b_mask)
            dxa_g += tl.dot(dg, tl.trans(bg), input_precision=PRECISION)  # dg B_g, from dg as stored
            dxa_u += tl.dot(du, tl.trans(bu), input_precision=PRECISION)
        out = DXA + seg.to(tl.int64) * M * (2 * R) + rows * (2 * R) + rk[None, :]
        tl.store(out, sg * dxa_g, mask=a_mask)
        tl.store(out + R, su * dxa_u, mask=a_mask)


# BLOCK_M, BLOCK_N, warps, width segments[, pipeline stages]. Segments 0: as many as it takes for PROGRAMS_PER_SM
# programs on each multiprocessor (a power of two, at most MAX_SEGMENTS): a single wave of too few programs leaves
# multiprocessors idle. Four pipeline stages of the small B and A tiles' loads; the full-size tiles are loaded into
# registers, so shared memory stays at 16-22 KB a program on sm_80-sm_90 at any depth.
TILES = {"forward": (64, 64, 4, 0, 4), "backward": (64, 64, 4, 0, 4)}
PROGRAMS_PER_SM = 4
MAX_SEGMENTS = 8

# Pipeline stages in fp32, whatever TILES says (see _options).
FP32_STAGES = 1


def _precision(t: torch.Tensor) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"), as torch's own fp32 products do by default, not in TF32."""
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _rank_pad(r: int) -> int:
    return max(16, 1 << (r - 1).bit_length())  # tl.dot wants an inner dimension of at least 16


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_segments(row_blocks: int, multiprocessors: int) -> int:
    """Width segments for TILES' 0: the fewest (a power of two, at most MAX_SEGMENTS) that give every multiprocessor
    PROGRAMS_PER_SM programs. Fixed for a GPU model and shape, so the fp32 partial sums add up in the same order
    every step."""
    segments = 1
    while segments < MAX_SEGMENTS and row_blocks * segments < PROGRAMS_PER_SM * multiprocessors:
        segments *= 2
    return segments


def _segments(n: int, bn: int, segments: int, row_blocks: int = 1, device: torch.device | None = None
              ) -> tuple[int, int]:
    """The width of a segment (a multiple of the tile width) and how many segments that makes (0: auto_segments)."""
    if segments == 0:
        segments = auto_segments(row_blocks, _multiprocessors(device))
    width = triton.cdiv(triton.cdiv(n, segments), bn) * bn
    return width, triton.cdiv(n, width)


def _options(tiles: tuple, dtype: torch.dtype) -> dict:
    """Launch options for a tile layout: its warps and pipeline stages (none given: Triton's default), but in fp32
    FP32_STAGES, since there the full-size tiles go through shared memory too (with 64 x 64 tiles the backward
    needs 148 KB at three stages, more than the 99 KB a program may have on sm_86/sm_89, 40 KB at one)."""
    _, _, warps, _, *stages = tiles
    stages = [FP32_STAGES] if dtype == torch.float32 else stages
    # multiply-adds fused into FMAs, as Triton did by default before 3.10
    return {"num_warps": warps, "enable_fp_fusion": True, **({"num_stages": stages[0]} if stages else {})}


def _layout(tiles: tuple, m: int, n: int, device: torch.device, dtype: torch.dtype
            ) -> tuple[int, int, int, tuple[int, int], dict]:
    """A tile layout (BLOCK_M, BLOCK_N, warps, segments[, pipeline stages]) for an m x n problem: BLOCK_M, BLOCK_N,
    the segment width, the grid, and the launch options."""
    bm, bn, _, segments, *_ = tiles
    width, segments = _segments(n, bn, segments, triton.cdiv(m, bm), device)
    return bm, bn, width, (triton.cdiv(m, bm), segments), _options(tiles, dtype)


def _even(m: int, n: int, bm: int, bn: int) -> bool:
    """Whether the tiles cover an m x n tensor exactly (segments are whole tiles), so that the kernels load and
    store its tiles without masks (which split the loads)."""
    return m % bm == 0 and n % bn == 0


def _summed(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (parts[0] if parts.shape[0] == 1 else parts.sum(0)).to(dtype)


def _forward_triton(g0, u0, xa, bg, bu, ad, sg, su, tiles=None):
    (m, n), r = g0.shape, bg.shape[1]
    bm, bn, width, grid, options = _layout(tiles or TILES["forward"], m, n, g0.device, g0.dtype)
    h, ha = g0.new_empty(m, n), g0.new_empty(grid[1], m, r, dtype=torch.float32)  # a slot for each segment
    _swiglu_fwd_kernel[grid](
        g0, u0, xa, bg, bu, ad, h, ha, m, n, width, g0.stride(0), u0.stride(0), xa.stride(0), h.stride(0), sg, su,
        R=r, RP=_rank_pad(r), BLOCK_M=bm, BLOCK_N=bn, PRECISION=_precision(g0), EVEN=_even(m, n, bm, bn), **options)
    return h, _summed(ha, g0.dtype)


def _backward_triton(dh0, dyb, ad, g0, u0, xa, bg, bu, sg, su, sd, tiles=None):
    (m, n), r = g0.shape, bg.shape[1]
    bm, bn, width, grid, options = _layout(tiles or TILES["backward"], m, n, g0.device, g0.dtype)
    dg, du = g0.new_empty(m, n), g0.new_empty(m, n)
    shares = g0.new_empty(grid[0], r, n, dtype=torch.float32)  # each row block's share of A_d's gradient
    dxa = g0.new_empty(grid[1], m, 2 * r, dtype=torch.float32)
    _swiglu_bwd_kernel[grid](
        dh0, dyb, ad, g0, u0, xa, bg, bu, dg, du, shares, dxa, m, n, width, dh0.stride(0), dyb.stride(0),
        g0.stride(0), u0.stride(0), xa.stride(0), dg.stride(0), du.stride(0), sg, su, sd, R=r, RP=_rank_pad(r),
        BLOCK_M=bm, BLOCK_N=bn, PRECISION=_precision(g0), EVEN=_even(m, n, bm, bn), **options)
    # the row blocks' shares summed in a fixed order
    return dg, du, _summed(shares, g0.dtype), _summed(dxa, g0.dtype)


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


# ------------------------------------------------------------------------------------------------ the ops
# Custom ops, so torch.compile treats each kernel as one opaque call (with the shapes below) inside the compiled
# layer and CUDA graphs capture it like any other kernel.


@torch.library.custom_op("tunesmith::lora_swiglu", mutates_args=())
def lora_swiglu(g0: torch.Tensor, u0: torch.Tensor, xa: torch.Tensor, bg: torch.Tensor, bu: torch.Tensor,
                ad: torch.Tensor, sg: float, su: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = SiLU(g) * u with g = g0 + sg xa[:, :r] bg^T and u = u0 + su xa[:, r:] bu^T ([m, n]), and h ad^T ([m, r]):
    the down projection's LoRA down-projection, from the same pass."""
    if _use_triton(g0):
        return _forward_triton(g0.contiguous(), u0.contiguous(), xa.contiguous(), bg.contiguous(), bu.contiguous(),
                               ad.contiguous(), sg, su)
    return _forward_reference(g0, u0, xa, bg, bu, ad, sg, su)


@lora_swiglu.register_fake
def _(g0, u0, xa, bg, bu, ad, sg, su):
    return g0.new_empty(g0.shape), g0.new_empty(g0.shape[0], bg.shape[1])


@torch.library.custom_op("tunesmith::lora_swiglu_backward", mutates_args=())
def lora_swiglu_backward(dh0: torch.Tensor, dyb: torch.Tensor, ad: torch.Tensor, g0: torch.Tensor, u0: torch.Tensor,
                         xa: torch.Tensor, bg: torch.Tensor, bu: torch.Tensor, sg: float, su: float,
                         sd: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """With dh = dh0 + sd dyb ad (the SwiGLU output's gradient, the down projection's rank-r term included): the
    gradients of g and u ([m, n] each); A_d's gradient, sd dyb^T h ([r, n]), summed in the same pass from the
    SwiGLU output h, which is never written; and the gradient of xa, [sg dg bg | su du bu] ([m, 2r])."""
    if _use_triton(g0):
        return _backward_triton(dh0.contiguous(), dyb.contiguous(), ad.contiguous(), g0.contiguous(),
                                u0.contiguous(), xa.contiguous(), bg.contiguous(), bu.contiguous(), sg, su, sd)
    return _backward_reference(dh0, dyb, ad, g0, u0, xa, bg, bu, sg, su, sd)


@lora_swiglu_backward.register_fake
def _(dh0, dyb, ad, g0, u0, xa, bg, bu, sg, su, sd):
    (m, n), r = g0.shape, bg.shape[1]
    return g0.new_empty(g0.shape), g0.new_empty(g0.shape), g0.new_empty(r, n), g0.new_empty(m, 2 * r)


# ------------------------------------------------------------------------------------------------ the MLP


class LoraMLPFunction(torch.autograd.Function):
    """y = down(SiLU(gate(x)) * up(x)) for frozen bias-free gate/up/down bases, each with a LoRA adapter at
    dropout 0: gate(x) = x W_g^T + s_g (x A_g^T) B_g^T, and so on. Inputs in the compute dtype; `agu` is
    [A_g; A_u], so x is read once for both down-projections. Each base comes as `nf4.frozen_base` gives it
    (`sizes`: one entry per base, () for a weight, its sizes for an nf4 base; `weights`: their tensors in turn), so
    a QLoRA MLP's products run through the nf4 kernels and no dequantized weight is kept. Keeps x, the base
    products of gate and up, the [tokens, r] down-projections and the bases: not the SwiGLU output (the backward
    kernel rebuilds it) nor any sum with a rank-r term."""

    @staticmethod
    def forward(ctx, x, agu, bg, bu, ad, bd, sg: float, su: float, sd: float, unused: bool, sizes: tuple,
                *weights):
        (pg, pu, pd), (zg, zu, zd) = _bases(weights, sizes), sizes
        g0, u0 = base_mm(x, pg, zg, True), base_mm(x, pu, zu, True)
        xa = x @ agu.t()
        h, ha = lora_swiglu(g0, u0, xa, bg, bu, ad, sg, su)
        # unused: a checkpointed layer's recomputation, which needs only what backward keeps, not the output (its
        # backward reads none of it): the down projection's product, a third of the MLP's, is skipped
        if unused:
            y = x.new_zeros(x.shape[0], zd[0] if zd else pd[0].shape[0])
        elif zd:
            y = base_mm(h, pd, zd, True).addmm_(ha, bd.t(), alpha=sd)
        else:
            y = products_sum([h, pd[0].t(), ha, bd.t()], [1.0, sd])
        ctx.save_for_backward(x, g0, u0, xa, ha, agu, bg, bu, ad, bd, *weights)
        ctx.scales, ctx.sizes = (sg, su, sd), sizes
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g0, u0, xa, ha, agu, bg, bu, ad, bd, *weights = ctx.saved_tensors
        sg, su, sd = ctx.scales
        (pg, pu, pd), (zg, zu, zd) = _bases(weights, ctx.sizes), ctx.sizes
        r = bg.shape[1]
        dy = dy.contiguous()
        dyb = dy @ bd
        dbd = (dy.t() @ ha).mul_(sd)
        dg, du, dad, dxa = lora_swiglu_backward(base_mm(dy, pd, zd, False), dyb, ad, g0, u0, xa, bg, bu, sg, su, sd)
        dbg = (dg.t() @ xa[:, :r]).mul_(sg)
        dbu = (du.t() @ xa[:, r:]).mul_(su)
        dx = None
        if ctx.needs_input_grad[0] and (zg or zu):
            dx = base_mm(dg, pg, zg, False).add_(base_mm(du, pu, zu, False)).addmm_(dxa, agu)
        elif ctx.needs_input_grad[0]:
            dx = products_sum([dg, pg[0], du, pu[0], dxa, agu], [1.0, 1.0, 1.0])
        dagu = dxa.t() @ x
        return dx, dagu, dbg, dbu, dad, dbd, None, None, None, None, None, *(None for _ in weights)


def _bases(weights: tuple, sizes: tuple) -> list[tuple]:
    """`weights` cut into each base's tensors: one for a weight, nf4_parts' five for an nf4 base."""
    out, i = [], 0
    for size in sizes:
        n = 5 if size else 1
        out.append(tuple(weights[i:i + n]))
        i += n
    return out


# ------------------------------------------------------------------------------------------------ the path

MLP = ("gate_proj", "up_proj", "down_proj")
# The kernels hold [rows, rank] blocks in registers beside each tile (measured at rank 16); larger ranks keep PEFT's
# layers rather than spill.
MLP_MAX_RANK = 32


def _mlp_parts(module) -> list[str] | None:
    """The adapters' names if `module` is a Llama-family SiLU-gated MLP whose gate, up and down projections are all
    plain LoRA layers at dropout 0 (`_plain_lora`) of one rank (at most MLP_MAX_RANK) over bias-free bases of one
    dtype; else None."""
    if not all(hasattr(module, p) for p in MLP) or getattr(getattr(module, "config", None), "hidden_act", None) != "silu":
        return None
    layers = [getattr(module, p) for p in MLP]
    names = [plain_lora(layer, nf4=True) for layer in layers]
    if any(n is None for n in names):
        return None
    ranks = {layer.lora_A[n].weight.shape[0] for layer, n in zip(layers, names, strict=True)}
    if len(ranks) != 1 or ranks.pop() > MLP_MAX_RANK:
        return None
    if len({_base_kind(layer.base_layer) for layer in layers}) != 1:
        return None
    return names


def _base_kind(base) -> tuple:
    """(dtype or "nf4", device): what the three bases must share (an nf4 base is never dequantized to ask)."""
    if nf4_base(base):
        return "nf4", base.qweight.device
    return base.weight.dtype, base.weight.device


def _forward(self, x):
    """The MLP through `lora_mlp.LoraMLPFunction` (a SwiGLU kernel that makes the gate and up LoRA terms itself);
    anything else -- adapters switched off or merged since, mixed dtypes outside autocast -- goes through the
    module's own forward."""
    names = _mlp_parts(self)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    elif len({x.dtype} | {p.dtype for p in self.parameters()}) == 1:
        dtype = x.dtype
    else:
        names = None
    if names != self.tunesmith_mlp_names:
        return type(self).forward(self, x)
    gate, up, down = (getattr(self, p) for p in MLP)
    ng, nu, nd = names
    agu = torch.cat([gate.lora_A[ng].weight, up.lora_A[nu].weight]).to(dtype)
    bases = [frozen_base(layer.base_layer, dtype) for layer in (gate, up, down)]
    y = LoraMLPFunction.apply(x.reshape(-1, x.shape[-1]).to(dtype), agu, gate.lora_B[ng].weight.to(dtype),
                              up.lora_B[nu].weight.to(dtype), down.lora_A[nd].weight.to(dtype),
                              down.lora_B[nd].weight.to(dtype), float(gate.scaling[ng]), float(up.scaling[nu]),
                              float(down.scaling[nd]), _output_unused, tuple(size for _, size in bases),
                              *(t for parts, _ in bases for t in parts))
    return y.view(*x.shape[:-1], y.shape[-1])


_output_unused = False  # read by _forward (the compiler guards on it: a recomputation compiles its own graph)


@contextlib.contextmanager
def output_unused():
    """Inside the block, the LoRA-aware MLP skips its down projection and returns zeros: for a checkpointed layer's
    recomputation in the backward pass, which needs what the MLP keeps for its backward (x, the gate and up
    products, the rank-r down-projections, all computed) and the gradient of its output, never the output itself.
    The gradients are those of the full forward, bit for bit."""
    global _output_unused
    before, _output_unused = _output_unused, True
    try:
        yield
    finally:
        _output_unused = before


def fuse_mlp(model: torch.nn.Module) -> int:
    """Give each Llama-family MLP with plain LoRA on gate, up and down (`_mlp_parts`) the LoRA-aware forward.
    Returns how many MLPs; `unfuse_mlp` undoes it."""
    count = 0
    for module in model.modules():
        names = _mlp_parts(module) if type(module).__name__.endswith("MLP") else None
        if names is None:
            continue
        module.tunesmith_mlp_names = names
        replace_forward(module, _forward, LoraMLP.name)
        count += 1
    return count


def unfuse_mlp(model: torch.nn.Module) -> torch.nn.Module:
    """What `fuse_mlp` did, undone: the module's own forward."""
    for module in model.modules():
        if "tunesmith_mlp_names" in vars(module):
            del module.tunesmith_mlp_names
            restore_forward(module, LoraMLP.name)
    return model


class LoraMLP:
    """The LoRA-aware MLP: Llama-family MLP with plain LoRA at dropout 0 on gate, up and down; its Triton kernels on
    CUDA (elsewhere the plain-PyTorch reference, fp32 inside: for checking, slower than PEFT's layers, so not
    taken there); LoRA, not under FSDP2."""

    name = "LoRA-aware MLP"
    tolerance = 1e-2  # the SwiGLU and its gradient in fp32 inside, rounded once to the compute dtype (bf16)

    def applies(self, setting: Setting, model) -> bool:
        return setting.lora and setting.device == "cuda" and triton_available()

    def apply(self, model, setting: Setting | None = None) -> str | None:
        return self.name if fuse_mlp(model) else None

    def undo(self, model) -> None:
        unfuse_mlp(model)


PATH = LoraMLP()
