"""The frozen nf4 base's products with the weight dequantized inside a Triton kernel, forward and backward.

`qlora.QuantLinear` (nf4) holds each decoder linear as torchao's NF4 tensor: 4-bit codes two to a byte (the first
of each pair in the high nibble), one int8 scale per block of 64 weights, double-quantized (scale = code / factor of
its block of `scaler_block` scales + their mean, in the weight's dtype), and a 16-entry table of levels. The plain
path (torchao's `linear_nf4`) dequantizes the whole weight with a dozen PyTorch ops for every product and multiplies.
Here one custom op, `tunesmith::nf4_mm`, computes x W^T (forward) or g W (the input's gradient; the frozen weight
has none) with the codes decoded in the kernel, tile by tile, as Unsloth does for its 4-bit base. The decoding
rounds as torchao's does (scale, then level x scale, each in the weight's dtype), so the weight the products see is
the one `get_original_weight` returns, bit for bit.

Two strategies compute the op on CUDA, and the first call of each product shape times both and keeps the faster
(like cudnn.benchmark; the choice is per GPU and shape, fixed for the run):
- fused: one GEMM kernel that decodes each tile of W in registers before its tl.dot; no weight in memory;
- dequantize: one kernel writes the dequantized weight, then cuBLAS multiplies; one weight-sized temporary.
Elsewhere (the CPU, MPS) the same op decodes in PyTorch: the tests check the Triton kernels against it on the CPU
under Triton's interpreter. The path applies on CUDA where Triton is installed (`--fast-paths auto`).
"""

from __future__ import annotations

import warnings

import torch

from tunesmith.kernels.base import Setting, nf4_base, replace_forward, restore_all, triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of torch come without Triton; the PyTorch reference serves there
    triton = None

BLOCK = 64  # weights per scale (torchao's and the QLoRA paper's block)
FUSED_TILES = (128, 128, 64, 8, 8, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages
DEQUANT_TILES = (64, 4)  # blocks of 64 weights per program, warps
STRATEGIES = ("fused", "dequantize")
CHOICE: dict[tuple, str] = {}  # (shape key) -> the strategy timed fastest on this GPU
FORCE: str | None = None  # tests and benchmarks: one strategy throughout (None: timed)
INTERPRET = False  # tests: the Triton kernels on CPU tensors, under Triton's interpreter


def nf4_parts(weight) -> tuple[torch.Tensor, ...]:
    """An NF4 tensor's (codes uint8 [numel / 2], scales int8 [blocks], factors [blocks / scaler_block], mean [],
    levels [16]): what the op reads. The last three in the weight's dtype."""
    return (weight.quantized_data, weight.quantized_scalers, weight.quantization_factor,
            weight.scaler_mean.reshape(()), weight.nf4)


# ------------------------------------------------------------------------------------------------ the reference


def dequantize_reference(codes, scales, factors, mean, levels, out_features: int, in_features: int,
                         scaler_block: int) -> torch.Tensor:
    """The weight [out, in] in the levels' dtype, rounded as torchao's get_original_weight rounds it."""
    dt = levels.dtype
    s = (scales.view(-1, scaler_block).to(dt) / factors.to(dt)[:, None]).flatten() + mean.to(dt)
    s = s.repeat_interleave(BLOCK // 2)
    first, second = levels[(codes >> 4).long()] * s, levels[(codes & 15).long()] * s
    return torch.stack([first, second], dim=-1).reshape(out_features, in_features)


def _reference(x, codes, scales, factors, mean, levels, out_features, in_features, scaler_block, transposed):
    w = dequantize_reference(codes, scales, factors, mean, levels, out_features, in_features, scaler_block)
    return x @ w.to(x.dtype).t() if transposed else x @ w.to(x.dtype)


# ------------------------------------------------------------------------------------------------ Triton kernels

if triton is not None:

    @triton.jit
    def _decode(Q, QS, QF, LUT, MEAN, rows, c0, K, SB, row_mask, R: tl.constexpr, C: tl.constexpr):
        """W[rows, c0:c0 + C] ([R, C], the weight's dtype's values, held in fp32) of a [*, K] nf4 weight: each
        code's level times its block's scale, rounded as torchao rounds them. C and K even; c0 even."""
        dt = QF.dtype.element_ty
        j = c0 // 2 + tl.arange(0, C // 2)
        mask = row_mask[:, None] & (2 * j < K)[None, :]
        byte = rows[:, None].to(tl.int64) * (K // 2) + j[None, :]  # the pair's byte; its block: byte // 32
        packed = tl.load(Q + byte, mask=mask, other=0).to(tl.int32)
        block = byte // 32  # BLOCK // 2 bytes a block (a jit function reads no module globals)
        q = tl.load(QS + block, mask=mask, other=0).to(tl.float32)
        f = tl.load(QF + block // SB, mask=mask, other=1.0).to(tl.float32)
        mean = tl.load(MEAN).to(tl.float32)
        s = (tl.math.div_rn(q, f).to(dt).to(tl.float32) + mean).to(dt).to(tl.float32)
        # rounded to the weight's dtype, joined in fp32: the products' operand is then a cast of the join, which
        # Triton 3.6's dot-operand pass takes (a join fed straight into tl.dot fails to build there)
        hi = (tl.load(LUT + (packed >> 4)).to(tl.float32) * s).to(dt).to(tl.float32)
        lo = (tl.load(LUT + (packed & 15)).to(tl.float32) * s).to(dt).to(tl.float32)
        return tl.join(hi, lo).reshape(R, C)

    @triton.jit
    def _dequant_kernel(Q, QS, QF, LUT, MEAN, W, BLOCKS, SB, NB: tl.constexpr):
        """NB blocks of 64 weights of the flattened weight per program, each block's scale computed once (the
        weight's rows hold whole blocks: the flat order is the [out, in] order)."""
        dt = QF.dtype.element_ty
        b = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB)
        live = b < BLOCKS
        q = tl.load(QS + b, mask=live, other=0).to(tl.float32)
        f = tl.load(QF + b // SB, mask=live, other=1.0).to(tl.float32)
        mean = tl.load(MEAN).to(tl.float32)
        s = (tl.math.div_rn(q, f).to(dt).to(tl.float32) + mean).to(dt).to(tl.float32)[:, None]
        packed = tl.load(Q + b[:, None] * 32 + tl.arange(0, 32)[None, :], mask=live[:, None], other=0).to(tl.int32)
        hi = (tl.load(LUT + (packed >> 4)).to(tl.float32) * s).to(dt)
        lo = (tl.load(LUT + (packed & 15)).to(tl.float32) * s).to(dt)
        w = tl.join(hi, lo).reshape(NB, 64)
        tl.store(W + b[:, None] * 64 + tl.arange(0, 64)[None, :], w.to(W.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _mm_kernel(X, Q, QS, QF, LUT, MEAN, Y, M, N, K, KW, SB, stride_x, stride_y, TRANSPOSED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   PRECISION: tl.constexpr):
        """Y [M, N] = X [M, K] B with B = W^T (TRANSPOSED: W is [N, K]) or W (W is [K, N]); W's tiles decoded in
        registers. KW: W's row length (its in_features)."""
        pid = tl.program_id(0)
        grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * grid_n)  # row blocks in groups, for W's tiles to be reused from L2
        first = group * GROUP_M
        size = tl.minimum(grid_m - first, GROUP_M)
        pid_m = first + (pid % (GROUP_M * grid_n)) % size
        pid_n = (pid % (GROUP_M * grid_n)) // size
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                        mask=(rm < M)[:, None] & (rk < K)[None, :], other=0.0)
            if TRANSPOSED:  # W's rows rn, columns k0.. : [BLOCK_N, BLOCK_K], turned
                b = tl.trans(_decode(Q, QS, QF, LUT, MEAN, rn, k0, KW, SB, rn < N, BLOCK_N, BLOCK_K))
            else:  # W's rows rk, columns pid_n * BLOCK_N.. : [BLOCK_K, BLOCK_N]
                b = _decode(Q, QS, QF, LUT, MEAN, rk, pid_n * BLOCK_N, KW, SB, rk < K, BLOCK_K, BLOCK_N)
            acc += tl.dot(x, b.to(x.dtype), input_precision=PRECISION)
        tl.store(Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])


def _options(warps: int, stages: int | None = None) -> dict:
    if INTERPRET:
        return {}
    return {"num_warps": warps, **({"num_stages": stages} if stages else {})}


def dequantize_triton(codes, scales, factors, mean, levels, out_features: int, in_features: int, scaler_block: int,
                      dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight [out, in] in `dtype`, decoded by one Triton kernel (the reference's values, cast to `dtype`);
    into `out` (contiguous [out, in]) where given."""
    nb, warps = DEQUANT_TILES
    w = torch.empty(out_features, in_features, dtype=dtype, device=codes.device) if out is None else out
    blocks = out_features * in_features // BLOCK
    _dequant_kernel[(triton.cdiv(blocks, nb),)](codes, scales, factors, levels, mean, w, blocks, scaler_block,
                                                NB=nb, **_options(warps))
    return w


def mm_triton(x, codes, scales, factors, mean, levels, out_features: int, in_features: int, scaler_block: int,
              transposed: bool, tiles=FUSED_TILES) -> torch.Tensor:
    """The fused kernel: x W^T ([m, out], `transposed`) or x W ([m, in]), x [m, in] or [m, out] contiguous rows."""
    bm, bn, bk, group, warps, stages = tiles
    m, k = x.shape
    n = out_features if transposed else in_features
    y = x.new_empty(m, n)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _mm_kernel[grid](x, codes, scales, factors, levels, mean, y, m, n, k, in_features, scaler_block, x.stride(0),
                     y.stride(0), TRANSPOSED=transposed, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
                     PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **_options(warps, stages))
    return y


def _dequantize_then_mm(x, *parts, transposed: bool):
    w = dequantize_triton(*parts, x.dtype)
    return x @ w.t() if transposed else x @ w


def _timed(fn, repeat: int = 3) -> float:
    fn()  # compiles, warms up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def strategy(x: torch.Tensor, n: int, k_w: int, transposed: bool, run) -> str:
    """The strategy for this product shape: FORCE, else the one CHOICE timed fastest (timing both at first sight).
    Rows are bucketed to the next power of two: varied record lengths share a choice."""
    if FORCE:
        return FORCE
    key = (x.device.index, x.dtype, 1 << (x.shape[0] - 1).bit_length(), n, k_w, transposed)
    if key not in CHOICE:
        times = {}
        for name in STRATEGIES:
            try:
                times[name] = _timed(lambda name=name: run(name))
            except RuntimeError as e:  # Triton's compiler can refuse a kernel on some GPU / version: the other serves
                if name == STRATEGIES[-1] and not times:
                    raise
                warnings.warn(f"nf4 kernels: the {name} strategy failed for a {tuple(x.shape)} x {n} product "
                              f"({str(e).splitlines()[0][:200]}); the other is used", stacklevel=2)
        CHOICE[key] = min(times, key=times.get)
    return CHOICE[key]


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or INTERPRET)


# ------------------------------------------------------------------------------------------------ the op


@torch.library.custom_op("tunesmith::nf4_mm", mutates_args=())
def nf4_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, factors: torch.Tensor, mean: torch.Tensor,
           levels: torch.Tensor, out_features: int, in_features: int, scaler_block: int,
           transposed: bool) -> torch.Tensor:
    """x W^T (`transposed`: x is [m, in], the forward product) or x W (x is [m, out], the input's gradient), W the
    [out, in] nf4 weight in `codes` .. `levels` (nf4_parts); in x's dtype."""
    x = x.contiguous()
    parts = (codes, scales, factors, mean, levels, out_features, in_features, scaler_block)
    if not _use_triton(x):
        return _reference(x, *parts, transposed)

    def run(name: str) -> torch.Tensor:
        if name == "fused":
            return mm_triton(x, *parts, transposed)
        return _dequantize_then_mm(x, *parts, transposed=transposed)

    if INTERPRET:
        return run(FORCE or "fused")
    return run(strategy(x, out_features if transposed else in_features, in_features, transposed, run))


@nf4_mm.register_fake
def _(x, codes, scales, factors, mean, levels, out_features, in_features, scaler_block, transposed):
    return x.new_empty(x.shape[0], out_features if transposed else in_features)


def _setup(ctx, inputs, output):
    _, *parts, transposed = inputs
    ctx.save_for_backward(*parts[:5])
    ctx.sizes, ctx.transposed = tuple(parts[5:]), transposed


def _backward(ctx, grad):
    parts = ctx.saved_tensors
    grad_x = nf4_mm(grad, *parts, *ctx.sizes, not ctx.transposed) if ctx.needs_input_grad[0] else None
    return grad_x, None, None, None, None, None, None, None, None, None


nf4_mm.register_autograd(_backward, setup_context=_setup)


def joined_weight(parts: list[torch.Tensor], sizes: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The row-concatenation [sum of outs, in] in `dtype` of several nf4 weights of one in_features: each weight's
    five tensors (nf4_parts) in turn in `parts`, its (out, in, scaler_block) in `sizes`. On CUDA each is decoded
    by the Triton kernel straight into its rows of one buffer."""
    weights = [(parts[5 * i:5 * i + 5], sizes[3 * i:3 * i + 3]) for i in range(len(sizes) // 3)]
    if not _use_triton(parts[0]):
        return torch.cat([dequantize_reference(*p, *z).to(dtype) for p, z in weights])
    w = torch.empty(sum(z[0] for _, z in weights), sizes[1], dtype=dtype, device=parts[0].device)
    row = 0
    for p, z in weights:
        dequantize_triton(*p, *z, dtype, out=w[row:row + z[0]])
        row += z[0]
    return w


@torch.library.custom_op("tunesmith::nf4_joined_mm", mutates_args=())
def nf4_joined_mm(x: torch.Tensor, parts: list[torch.Tensor], sizes: list[int], transposed: bool) -> torch.Tensor:
    """x W^T (`transposed`: x [m, in]) or x W (x [m, sum of outs]) for W the row-concatenation of several nf4
    weights (`joined_weight`): decoded into one buffer, then one product (fused q/k/v over an nf4 base). The
    buffer lives only for the product: the backward pass decodes again."""
    w = joined_weight(parts, sizes, x.dtype)
    x = x.contiguous()
    return x @ w.t() if transposed else x @ w


@nf4_joined_mm.register_fake
def _(x, parts, sizes, transposed):
    return x.new_empty(x.shape[0], sum(sizes[0::3]) if transposed else sizes[1])


def _joined_setup(ctx, inputs, output):
    _, parts, sizes, transposed = inputs
    ctx.save_for_backward(*parts)
    ctx.sizes, ctx.transposed = sizes, transposed


def _joined_backward(ctx, grad):
    grad_x = (nf4_joined_mm(grad, list(ctx.saved_tensors), ctx.sizes, not ctx.transposed)
              if ctx.needs_input_grad[0] else None)
    return grad_x, [None] * len(ctx.saved_tensors), None, None


nf4_joined_mm.register_autograd(_joined_backward, setup_context=_joined_setup)


def frozen_base(base, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """A frozen bias-free base as the fused LoRA paths multiply by it (`base_mm`): ((its weight in `dtype`,), ())
    for a torch Linear; (its nf4 tensors, (out, in, scaler block)) for an nf4 base (`nf4_base`), never
    dequantized whole here."""
    if nf4_base(base):
        q = base.qweight
        return nf4_parts(q), (base.out_features, base.in_features, q.scaler_block_size)
    return (base.weight.to(dtype),), ()


def base_mm(x: torch.Tensor, parts: tuple[torch.Tensor, ...], sizes: tuple[int, ...], transposed: bool) -> torch.Tensor:
    """x W^T (`transposed`: x [m, in]) or x W (x [m, out]) for a frozen base given as `frozen_base` gives it: an
    nf4 base's through the nf4 kernels' op (`nf4_mm`), in x's dtype."""
    if sizes:
        return nf4_mm(x, *parts, *sizes, transposed)
    return x @ parts[0].t() if transposed else x @ parts[0]


# ------------------------------------------------------------------------------------------------ the path


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    """QuantLinear.forward for nf4 through `nf4_mm`, in the compute dtype (autocast's, else x's); fp32 outside
    autocast, and anything the kernels do not take, goes the plain way."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    q = self.qweight
    if dtype not in (torch.bfloat16, torch.float16) or q.device != x.device:
        return type(self).forward(self, x)
    shape = x.shape
    y = nf4_mm(x.reshape(-1, shape[-1]).to(dtype), *nf4_parts(q), self.out_features, self.in_features,
               q.scaler_block_size, True)
    y = y.view(*shape[:-1], self.out_features)
    return y if self.bias is None else y + self.bias.to(y.dtype)


def fuse_nf4(model: torch.nn.Module) -> int:
    """Route every nf4 QuantLinear of `model` through the kernels. Returns how many."""
    count = 0
    for module in model.modules():
        if nf4_base(module):  # an nf4 QuantLinear whose rows hold whole blocks
            replace_forward(module, _forward, Nf4Kernels.name)
            count += 1
    return count


class Nf4Kernels:
    """The nf4 base's products through the Triton kernels: CUDA, Triton installed, --fast-paths auto."""

    name = "nf4 kernels"
    tolerance = 1e-2  # the same weight, multiplied in another order (bf16 products)

    def applies(self, setting: Setting, model) -> bool:
        return (setting.auto and setting.device == "cuda" and triton_available()
                and getattr(setting.cfg, "quantize_base", "none") == "nf4")

    def apply(self, model, setting: Setting | None = None) -> str | None:
        return self.name if fuse_nf4(model) else None

    def undo(self, model) -> None:
        restore_all(model, self.name)


PATH = Nf4Kernels()
