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
checked against them by the tests under Triton's interpreter where Triton is installed, and on the GPU by
bench/lora_mlp.py.
"""

from __future__ import annotations

import functools

import torch

from tunesmith.products import products_sum

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


def _backward_reference(dh0, dyb, ad, g0, u0, xa, bg, bu, sg, su, sd, shares: int = 0):
    g, u = _swiglu_reference(g0, u0, xa, bg, bu, sg, su)
    dh = torch.addmm(dh0.to(torch.float32), dyb.to(torch.float32), ad.to(torch.float32), alpha=sd)
    sig = torch.sigmoid(g)
    silu = g * sig
    dt, f = g0.dtype, torch.float32
    dg = (dh * u * sig * (1 + g * (1 - sig))).to(dt)
    du = (dh * silu).to(dt)
    dxa = torch.cat([dg.to(f) @ bg.to(f) * sg, du.to(f) @ bu.to(f) * su], dim=1)
    h = (silu * u).to(dt)
    if shares:  # A_d's gradient, sd dyb^T h, in place of h; with 3, also B_g's and B_u's, transposed
        grads = [dyb.to(f).t() @ h.to(f) * sd]
        if shares == 3:
            r = bg.shape[1]
            grads += [xa[:, :r].to(f).t() @ dg.to(f) * sg, xa[:, r:].to(f).t() @ du.to(f) * su]
        h = (grads[0] if shares == 1 else torch.stack(grads)).to(dt)
    return dg, du, h, dxa.to(dt)


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
                           stride_u, stride_xa, stride_dg, stride_du, stride_h, sg, su, sd,
                           R: tl.constexpr, RP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           PRECISION: tl.constexpr, SHARES: tl.constexpr, EVEN: tl.constexpr):
        # SHARES 1: instead of h ([M, N]), each row block's share of A_d's gradient, sd dyb^T h ([R, N] in fp32, at
        # H + row block * R * N), summed over the row blocks afterwards; 3: after it in the same slot, the shares of
        # B_g's and B_u's gradients, transposed (sg xa_g^T dg and su xa_u^T du, from dg and du as stored)
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
            if SHARES > 0:
                h = (silu * u).to(DG.dtype.element_ty)  # as the product from a stored h would read it
                part = H + tl.program_id(0).to(tl.int64) * SHARES * R * N + rk[:, None] * N + rn[None, :]
                tl.store(part, sd * tl.dot(tl.trans(dyb), h, input_precision=PRECISION), mask=b_mask)
                if SHARES == 3:
                    tl.store(part + R * N, sg * tl.dot(tl.trans(xa_g), dg, input_precision=PRECISION), mask=b_mask)
                    tl.store(part + 2 * R * N, su * tl.dot(tl.trans(xa_u), du, input_precision=PRECISION),
                             mask=b_mask)
            else:
                _store(H + rows * stride_h + rn[None, :], (silu * u).to(H.dtype.element_ty), tile, EVEN)
            dxa_g += tl.dot(dg, tl.trans(bg), input_precision=PRECISION)  # dg B_g, from dg as stored
            dxa_u += tl.dot(du, tl.trans(bu), input_precision=PRECISION)
        out = DXA + seg.to(tl.int64) * M * (2 * R) + rows * (2 * R) + rk[None, :]
        tl.store(out, sg * dxa_g, mask=a_mask)
        tl.store(out + R, su * dxa_u, mask=a_mask)


# BLOCK_M, BLOCK_N, warps, width segments[, pipeline stages] (bench/lora_mlp.py --sweep)
# Segments 0: as many as it takes for PROGRAMS_PER_SM programs on each multiprocessor (a power of two, at most
# MAX_SEGMENTS). On an H200 that is 4 for the 1B row's 256 row blocks and 8 for the 8B row's 128, the fastest or
# within noise of it for both kernels (bench/results/h200-2026-12-02-lora-mlp-sweep2.txt); one segment left the 8B
# row's single wave of 128 programs a quarter slower. Four pipeline stages (of the small B and A tiles' loads; the
# full-size tiles are loaded into registers, so shared memory stays at 16-22 KB a program on sm_80-sm_90 at any
# depth): the forward 0.93x of Triton's default depth on the 8B row, the backward level
# (2026-12-03, bench/results/h200-2026-12-03-even.txt).
TILES = {"forward": (64, 64, 4, 0, 4), "backward": (64, 64, 4, 0, 4)}
PROGRAMS_PER_SM = 4
MAX_SEGMENTS = 8


# A_d's gradient summed by the backward kernel (each row block's share of dyb^T h in fp32, then summed over the row
# blocks) instead of by a product over the SwiGLU output h, which the kernel then need not write: per layer the
# [tokens, intermediate] h written and read once more against [row blocks, r, intermediate] shares in fp32, about
# half the bytes at 64-row blocks. Checked against the reference under Triton's interpreter. On an H200 (2026-12-03)
# the backward's A_d part took 0.84x (8B row) and 0.78x (1B row) of the time (bench/lora_mlp.py --kernels-only), and
# with ROPE_KERNEL the 8B training step ran 0.4-0.5% faster at 0.11 GiB less peak memory: on.
DAD_IN_KERNEL = True

# With DAD_IN_KERNEL, B_g's and B_u's gradients summed by the backward kernel too (each row block's shares of
# xa_g^T dg and xa_u^T du next to A_d's), instead of by two products that read dg and du back.
LORA_B_IN_KERNEL = False


def shares() -> int:
    """What the backward kernel writes in place of h: 0 (h itself), 1 (A_d's gradient's shares) or 3 (and B_g's
    and B_u's), as DAD_IN_KERNEL and LORA_B_IN_KERNEL say."""
    return (3 if LORA_B_IN_KERNEL else 1) if DAD_IN_KERNEL else 0

# Pipeline stages in fp32, whatever TILES says (see _options).
FP32_STAGES = 1

# Tiles that cover the tensors exactly are loaded and stored without masks: on an H200 (2026-12-03) the kernels took
# 0.73-0.99x the time of the masked ones at the 1B and 8B rows' shapes in three calls (bench/lora_mlp.py --masked).
MASKLESS = True

# Multiply-adds fused into FMAs, as the kernels were measured (Triton's default until 3.9; 3.10 turns it off unless
# asked for).
FMA = True


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
    return {"num_warps": warps, "enable_fp_fusion": FMA, **({"num_stages": stages[0]} if stages else {})}


def _layout(tiles: tuple, m: int, n: int, device: torch.device, dtype: torch.dtype
            ) -> tuple[int, int, int, tuple[int, int], dict]:
    """A tile layout (BLOCK_M, BLOCK_N, warps, segments[, pipeline stages]) for an m x n problem: BLOCK_M, BLOCK_N,
    the segment width, the grid, and the launch options."""
    bm, bn, _, segments, *_ = tiles
    width, segments = _segments(n, bn, segments, triton.cdiv(m, bm), device)
    return bm, bn, width, (triton.cdiv(m, bm), segments), _options(tiles, dtype)


def _even(m: int, n: int, bm: int, bn: int) -> bool:
    """Whether the tiles cover an m x n tensor exactly (segments are whole tiles), so that with MASKLESS the
    kernels load and store its tiles without masks."""
    return MASKLESS and m % bm == 0 and n % bn == 0


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


def _backward_triton(dh0, dyb, ad, g0, u0, xa, bg, bu, sg, su, sd, tiles=None, shares: int = 0):
    (m, n), r = g0.shape, bg.shape[1]
    bm, bn, width, grid, options = _layout(tiles or TILES["backward"], m, n, g0.device, g0.dtype)
    dg, du = g0.new_empty(m, n), g0.new_empty(m, n)
    # shares: a slot of A_d's gradient (and B_g's and B_u's) for each row block, in place of h
    h = g0.new_empty(grid[0], shares, r, n, dtype=torch.float32) if shares else g0.new_empty(m, n)
    dxa = g0.new_empty(grid[1], m, 2 * r, dtype=torch.float32)
    _swiglu_bwd_kernel[grid](
        dh0, dyb, ad, g0, u0, xa, bg, bu, dg, du, h, dxa, m, n, width, dh0.stride(0), dyb.stride(0), g0.stride(0),
        u0.stride(0), xa.stride(0), dg.stride(0), du.stride(0), h.stride(-2), sg, su, sd, R=r, RP=_rank_pad(r),
        BLOCK_M=bm, BLOCK_N=bn, PRECISION=_precision(g0), SHARES=shares, EVEN=_even(m, n, bm, bn), **options)
    if shares:
        h = _summed(h, g0.dtype)  # the row blocks' shares, in a fixed order
        h = h[0] if shares == 1 else h
    return dg, du, h, _summed(dxa, g0.dtype)


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
                         sd: float, shares: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """With dh = dh0 + sd dyb ad (the SwiGLU output's gradient, the down projection's rank-r term included): the
    gradients of g and u ([m, n] each); the SwiGLU output h itself, which A_d's gradient needs ([m, n]), or with
    `shares` 1 that gradient, sd dyb^T h ([r, n]), summed in the same pass, or with 3 that and B_g's and B_u's
    gradients transposed, sg xa_g^T dg and su xa_u^T du ([3, r, n]); and the gradient of xa,
    [sg dg bg | su du bu] ([m, 2r])."""
    if shares not in (0, 1, 3):
        raise ValueError(f"shares is 0, 1 or 3, not {shares}")
    if _use_triton(g0):
        return _backward_triton(dh0.contiguous(), dyb.contiguous(), ad.contiguous(), g0.contiguous(),
                                u0.contiguous(), xa.contiguous(), bg.contiguous(), bu.contiguous(), sg, su, sd,
                                shares=shares)
    return _backward_reference(dh0, dyb, ad, g0, u0, xa, bg, bu, sg, su, sd, shares=shares)


@lora_swiglu_backward.register_fake
def _(dh0, dyb, ad, g0, u0, xa, bg, bu, sg, su, sd, shares=0):
    (m, n), r = g0.shape, bg.shape[1]
    h = g0.new_empty(m, n) if not shares else g0.new_empty(r, n) if shares == 1 else g0.new_empty(3, r, n)
    return g0.new_empty(g0.shape), g0.new_empty(g0.shape), h, g0.new_empty(m, 2 * r)


# ------------------------------------------------------------------------------------------------ the MLP


class LoraMLPFunction(torch.autograd.Function):
    """y = down(SiLU(gate(x)) * up(x)) for frozen bias-free gate/up/down weights, each with a LoRA adapter at
    dropout 0: gate(x) = x W_g^T + s_g (x A_g^T) B_g^T, and so on. Inputs in the compute dtype; `agu` is
    [A_g; A_u], so x is read once for both down-projections. Keeps x, the base products of gate and up, the
    [tokens, r] down-projections and the weights: not the SwiGLU output (the backward kernel rebuilds it) nor any
    sum with a rank-r term."""

    @staticmethod
    def forward(ctx, x, wg, wu, wd, agu, bg, bu, ad, bd, sg: float, su: float, sd: float):
        g0, u0 = x @ wg.t(), x @ wu.t()
        xa = x @ agu.t()
        h, ha = lora_swiglu(g0, u0, xa, bg, bu, ad, sg, su)
        y = products_sum([h, wd.t(), ha, bd.t()], [1.0, sd])
        ctx.save_for_backward(x, g0, u0, xa, ha, wg, wu, wd, agu, bg, bu, ad, bd)
        ctx.scales = (sg, su, sd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g0, u0, xa, ha, wg, wu, wd, agu, bg, bu, ad, bd = ctx.saved_tensors
        sg, su, sd = ctx.scales
        r = bg.shape[1]
        dy = dy.contiguous()
        dyb = dy @ bd
        dbd = (dy.t() @ ha).mul_(sd)
        n_shares = shares()
        dg, du, h, dxa = lora_swiglu_backward(dy @ wd, dyb, ad, g0, u0, xa, bg, bu, sg, su, sd, n_shares)
        if n_shares == 3:
            dad, dbg, dbu = h[0], h[1].t(), h[2].t()
        else:
            dad = h if n_shares else (dyb.t() @ h).mul_(sd)
            dbg = (dg.t() @ xa[:, :r]).mul_(sg)
            dbu = (du.t() @ xa[:, r:]).mul_(su)
        dx = products_sum([dg, wg, du, wu, dxa, agu], [1.0, 1.0, 1.0]) if ctx.needs_input_grad[0] else None
        dagu = dxa.t() @ x
        return dx, None, None, None, dagu, dbg, dbu, dad, dbd, None, None, None
