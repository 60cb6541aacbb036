"""Group-wise integer weights chosen well: GPTQ (Frantar et al., 2022) over a model's decoder layers, or round-to-nearest.

A `Grid` says what the weights may be: integer codes in [qmin, qmax] times one scale per group of input weights
(rounded to the precision the consumer keeps scales in), plus, for an affine grid, one float offset per group
(w ~= scale * code + offset, MLX's and llama.cpp Q4_1's form). The grids:

- INT4: XNNPACK's 8da4w (symmetric codes in [-8, 7], bfloat16 scales): the eager int4 model and the .pte hold the
  very same weights.
- INT4_AFFINE: the same codes and scales plus a float offset per group. XNNPACK has no zero points, so the .pte
  runs the offsets as a small separate product (export/executorch.py); eager adds it after torchao's linear.
- INT8: per output channel (one group per row), float scales.
- Q4_0 / Q5_0 / Q8_0: llama.cpp's blocks of 32 with float16 scales, for GGUF files (Q5_0: the type llama.cpp's
  k-quant files fall back to for rows that are not a multiple of 256).

Each group's scale (and offset) is the candidate from `clips` with the least squared error; clip 1.0 is always
tried, so weights already on a grid (as in a model dequantized from a GGUF) are found exactly.

GPTQ quantizes one column at a time and spreads each column's rounding error over the columns not yet quantized,
weighted by the inverse Hessian of the layer's inputs (H = 2 X^T X over calibration tokens). Columns go in order
of decreasing H diagonal (act-order) with each group's scale fixed beforehand (static groups). Decoder layers go in
order, each calibrated on the outputs of the layers already quantized.

Pure torch: the functions return dequantized weights (exactly on the grid), scales and offsets; quantize.py and the
exporters turn them into their own tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

CLIPS = tuple(1.1 - 0.025 * i for i in range(15))  # 1.1 ... 0.75 of the range


@dataclass(frozen=True)
class Grid:
    name: str
    qmin: int
    qmax: int
    scale_dtype: torch.dtype
    divisor: float  # symmetric: scale = max|w| * clip / divisor
    affine: bool = False
    offset_dtype: torch.dtype = torch.float16  # affine: offsets are stored in float16 (as Q4_1 and MLX do)
    clips: tuple[float, ...] = CLIPS


INT4 = Grid("int4", -8, 7, torch.bfloat16, 7.5)
INT4_AFFINE = Grid("int4-affine", -8, 7, torch.bfloat16, 7.5, affine=True)
INT8 = Grid("int8", -127, 127, torch.float32, 127.0, clips=(1.0,))
Q4_0 = Grid("q4_0", -8, 7, torch.float16, 7.5)
Q8_0 = Grid("q8_0", -128, 127, torch.float16, 127.0, clips=(1.0,))
Q5_0 = Grid("q5_0", -16, 15, torch.float16, 15.5)

# QMIN / QMAX of the default grid, for callers that only need XNNPACK's int4 range.
QMIN, QMAX = INT4.qmin, INT4.qmax

Plan = Callable[[str, torch.nn.Linear], "tuple[Grid, int] | None"]


def _candidates(w: torch.Tensor, grid: Grid):
    """(scale [out], offset [out]) candidates for one group of columns w [out, g]."""
    if not grid.affine:
        amax = w.abs().amax(dim=1).clamp(min=1e-8)
        zero = torch.zeros_like(amax)
        for c in grid.clips:
            yield (amax * (c / grid.divisor)).to(grid.scale_dtype).float().clamp(min=1e-8), zero
        return
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    center, span = (hi + lo) / 2, (hi - lo).clamp(min=1e-8)
    mid = (grid.qmin + grid.qmax) / 2
    for c in grid.clips:
        scale = (span * (c / (grid.qmax - grid.qmin))).to(grid.scale_dtype).float().clamp(min=1e-8)
        offset = center - mid * scale
        for _ in range(2):  # the least-squares offset for these codes, then the codes for that offset
            codes = torch.clamp(torch.round((w - offset[:, None]) / scale[:, None]), grid.qmin, grid.qmax)
            offset = (w - codes * scale[:, None]).mean(dim=1).to(grid.offset_dtype).float()
        yield scale, offset


def group_params(w: torch.Tensor, grid: Grid = INT4) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [out], offset [out]) for one group of columns w [out, g]: the candidate with the least squared error."""
    best_err, best = None, None
    for scale, offset in _candidates(w, grid):
        err = (fake_quant(w, scale[:, None], offset[:, None], grid) - w).pow(2).sum(dim=1)
        if best is None:
            best_err, best = err, (scale, offset)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = (torch.where(better, scale, best[0]), torch.where(better, offset, best[1]))
    return best


def fake_quant(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None, grid: Grid = INT4):
    if offset is None:
        return torch.clamp(torch.round(w / scale), grid.qmin, grid.qmax) * scale
    return torch.clamp(torch.round((w - offset) / scale), grid.qmin, grid.qmax) * scale + offset


def codes(dequantized: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int) -> torch.Tensor:
    """The integer codes (int8) of weights on a grid, from their scales and offsets [out, in / group_size]."""
    s, o = scales.repeat_interleave(group_size, dim=1), offsets.repeat_interleave(group_size, dim=1)
    return torch.round((dequantized.float() - o) / s).to(torch.int8)


def _params(w: torch.Tensor, group_size: int, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, offsets) [out, in / group_size]: every group of every row at once, as rows of [out * groups, g]."""
    out, groups = w.shape[0], w.shape[1] // group_size
    scale, offset = group_params(w.reshape(out * groups, group_size), grid)
    return scale.view(out, groups), offset.view(out, groups)


def rtn(weight: torch.Tensor, group_size: int, grid: Grid = INT4):
    """Round to nearest: (dequantized weights, scales, offsets), the last two [out, in / group_size]."""
    w = weight.float()
    scales, offsets = _params(w, group_size, grid)
    s, o = scales.repeat_interleave(group_size, dim=1), offsets.repeat_interleave(group_size, dim=1)
    return fake_quant(w, s, o, grid), scales, offsets


def gptq(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, grid: Grid = INT4, damp: float = 0.01,
         block: int = 128):
    """GPTQ with act-order and static groups: (dequantized weights, scales, offsets)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the column loop is thousands of small ops: threads only wait on each other
    try:
        return _gptq(weight, hessian, group_size, grid, damp, block)
    finally:
        torch.set_num_threads(threads)


def _gptq(weight, hessian, group_size: int, grid: Grid, damp: float, block: int):
    scales, offsets = _params(weight.float(), group_size, grid)
    # One row per input column, contiguous: the loop reads a column's scales (and offsets) at a time.
    col_scale = scales.T.repeat_interleave(group_size, dim=0).contiguous()
    col_offset = offsets.T.repeat_interleave(group_size, dim=0).contiguous()

    def rounder(w: torch.Tensor, col: int) -> torch.Tensor:  # fake_quant's arithmetic, in place on one temporary
        s = col_scale[col]
        if grid.affine:
            o = col_offset[col]
            return w.sub(o).div_(s).round_().clamp_(grid.qmin, grid.qmax).mul_(s).add_(o)
        return w.div(s).round_().clamp_(grid.qmin, grid.qmax).mul_(s)

    return _column_loop(weight, hessian, damp, block, rounder), scales, offsets


def gptq_levels(weight: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor,
                damp: float = 0.01, block: int = 128) -> torch.Tensor:
    """GPTQ onto a fixed table of levels: each weight becomes levels[code] * its group's scale, with the scales
    [out, in / group] given (a quantized format's own, as round to nearest chose them) and the codes chosen
    column by column against the Hessian. Returns the codes [out, in] (int64 indices into `levels`), for a format
    such as NF4 whose levels are not evenly spaced (the grids above are)."""
    group = weight.shape[1] // scales.shape[1]
    col_scale = scales.float().to(weight.device).T.repeat_interleave(group, dim=0).contiguous()  # [in, out]
    table = levels.float().to(weight.device)
    codes = torch.zeros(weight.shape[::-1], dtype=torch.long, device=weight.device)  # [in, out], as col_scale

    def nearest(w: torch.Tensor, col: int) -> torch.Tensor:
        s = col_scale[col]
        c = (w / s).unsqueeze(-1).sub(table).abs().argmin(dim=-1)
        codes[col] = c
        return table[c] * s

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as gptq(): the column loop is thousands of small ops
    try:
        _column_loop(weight, hessian, damp, block, nearest)
    finally:
        torch.set_num_threads(threads)
    return codes.T.contiguous()


def _column_loop(weight, hessian, damp: float, block: int, rounder) -> torch.Tensor:
    """GPTQ's loop: columns in act-order, each rounded by `rounder(values [out], column index)` and its error
    spread over the columns after it. Returns the rounded weights [out, in] in the original column order.

    The weights are held transposed ([in, out], a column per contiguous row) and each step is a few in-place ops
    on whole rows: the loop runs once per input column (thousands per layer), so its per-op overhead is its cost."""
    w = weight.float().clone()
    n = w.shape[1]
    h = hessian.float().clone()
    dead = torch.diag(h) == 0  # inputs that never fire: any value is as good, keep the weights out of the way
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(n, device=h.device)
    perm = torch.argsort(torch.diag(h), descending=True)
    wt, h = w[:, perm].T.contiguous(), h[perm][:, perm]
    # Upper Cholesky factor of H^-1: row i holds how column i's error should move the columns after it.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    inv_diag, cols = (1.0 / torch.diag(hinv)).tolist(), perm.tolist()
    q = torch.empty_like(wt)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        w1, err1, hinv1 = wt[i1:i2], wt.new_empty(i2 - i1, wt.shape[1]), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            qi = q[i1 + i]
            qi.copy_(rounder(w1[i], cols[i1 + i]))
            err = torch.sub(w1[i], qi, out=err1[i]).mul_(inv_diag[i1 + i])
            w1[i + 1:].addr_(hinv1[i, i + 1:], err, alpha=-1.0)
        wt[i2:].addmm_(hinv[i1:i2, i2:].T, err1, alpha=-1.0)  # the whole block's error, onto the columns after it
    return q.T[:, torch.argsort(perm)]


class _Captured(Exception):
    pass


def uniform(grid: Grid, group_size: int) -> Plan:
    """A plan putting every linear of the decoder layers on one grid."""
    return lambda _name, _module: (grid, group_size)


@torch.no_grad()
def gptq_decoder_layers(model, calibration: Sequence[Sequence[int]], plan: Plan, damp: float = 0.01,
                        progress: bool = True):
    """Sequential GPTQ over model.model.layers. `plan(name, linear)` gives each linear its (grid, group size), or
    None to leave it alone. Each planned linear's weight is replaced by its dequantized values; returns
    {module name (model.layers.i....): (grid, group size, scales, offsets)}. lm_head is not touched.
    Minutes on a CPU for a 135M model: a progress bar per layer on stderr unless `progress` is False."""
    from tunesmith.progress import steps

    layers = model.model.layers
    hidden, run_all = layer_inputs(model, calibration)

    done: dict[str, tuple] = {}
    with steps(f"GPTQ on {len(calibration)} blocks, layer", len(layers), progress) as advance:
        for li, layer in enumerate(layers):
            linears = {}
            for n, m in layer.named_modules():
                if isinstance(m, torch.nn.Linear) and (p := plan(f"model.layers.{li}.{n}", m)) is not None:
                    linears[n] = (m, *p)
            hessians = _hessians({n: v[0] for n, v in linears.items()}, run_all, layer, hidden)
            for name, (m, grid, group) in linears.items():
                q, s, o = gptq(m.weight, hessians[name], group, grid, damp)
                m.weight.data = q.to(m.weight.dtype)
                done[f"model.layers.{li}.{name}"] = (grid, group, s, o)
            hidden = run_all(layer, hidden)  # through the quantized layer: the next layer's inputs
            advance()
    return done


def layer_inputs(model, calibration: Sequence[Sequence[int]], batch_tokens: int = 2048):
    """(the first decoder layer's inputs, one per calibration block; run_all(layer, inputs) -> that layer's
    outputs): what a layer-by-layer pass over model.model.layers needs.

    Each layer's own keyword arguments are recorded (one pass through the model with every layer skipped): they
    differ between layer types, as Gemma 3's sliding-window and global layers differ in mask and rotary tables.
    run_all stacks consecutive blocks whose arguments are equal into batches of up to `batch_tokens` tokens (one
    larger product per linear instead of many small ones) and hands the outputs back one per block."""
    layers = list(model.model.layers)
    calls: dict[torch.nn.Module, list[tuple[tuple, dict]]] = {layer: [] for layer in layers}
    hidden: list[torch.Tensor] = []
    device = model.get_input_embeddings().weight.device

    def record(module, args, kwargs):
        if module is layers[0]:
            hidden.append(args[0] if args else kwargs["hidden_states"])
        calls[module].append((args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"}))

    def skip(*args, **kwargs):  # the layer's output is not needed here, only what it was called with
        return args[0] if args else kwargs["hidden_states"]

    def stop(*_):
        raise _Captured

    hooks = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    if (head := model.get_output_embeddings()) is not None:  # nothing after the layers is needed either
        hooks.append(head.register_forward_pre_hook(stop))
    own = [layer.__dict__.get("forward") for layer in layers]  # a wrapper's forward set on the instance, if any
    for layer in layers:
        layer.forward = skip
    try:
        for ids in calibration:
            try:
                model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)
            except _Captured:
                pass
    finally:
        for h in hooks:
            h.remove()
        for layer, forward in zip(layers, own, strict=True):
            del layer.forward
            if forward is not None:
                layer.forward = forward

    def run_all(layer, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        recorded, outs, i = calls[layer], [], 0
        while i < len(xs):
            j = i + 1
            while (j < len(xs) and (j - i + 1) * xs[i].shape[1] <= batch_tokens and xs[j].shape == xs[i].shape
                   and _same(recorded[j], recorded[i])):
                j += 1
            args, kwargs = _batched(recorded[i], j - i)
            out = layer(torch.cat(xs[i:j]) if j - i > 1 else xs[i], *args, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            outs.extend(out.split(1) if j - i > 1 else [out])
            i = j
        return outs

    return hidden, run_all


def _same(a, b) -> bool:
    """Whether two recorded layer arguments are equal (tensors by value)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and (a is b or torch.equal(a, b)))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except Exception:
        return False


def _batched(recorded: tuple[tuple, dict], n: int):
    """One block's recorded (args, kwargs) for a batch of n such blocks: per-block tensors (a leading dimension of
    1: rotary tables, masks, positions) expanded along it (views, no copies)."""
    def grow(v):
        if isinstance(v, torch.Tensor) and n > 1 and v.dim() >= 2 and v.shape[0] == 1:
            return v.expand(n, *v.shape[1:])
        if isinstance(v, tuple):
            return tuple(grow(x) for x in v)
        return v

    args, kwargs = recorded
    return tuple(grow(a) for a in args), {k: grow(v) for k, v in kwargs.items()}


def rtn_decoder_layers(model, plan: Plan) -> dict[str, tuple]:
    """Round to nearest over model.model.layers, with gptq_decoder_layers' plan and return value."""
    done = {}
    for name, m in model.model.layers.named_modules():
        full = f"model.layers.{name}"
        if isinstance(m, torch.nn.Linear) and (p := plan(full, m)) is not None:
            q, s, o = rtn(m.weight, p[1], p[0])
            m.weight.data = q.to(m.weight.dtype)
            done[full] = (p[0], p[1], s, o)
    return done


def _hessians(linears: dict[str, torch.nn.Module], forward, *args) -> dict[str, torch.Tensor]:
    """2 X^T X / tokens for the inputs X each linear sees while `forward(*args)` runs. Linears fed the same
    tensor (q/k/v, gate/up) share one product per call."""
    hess = {n: torch.zeros(m.in_features, m.in_features, device=m.weight.device) for n, m in linears.items()}
    count = dict.fromkeys(linears, 0)
    last: list = [None, None]  # the input seen last, and its 2 X^T X

    def accumulate(name):
        def hook(_module, inp, _out):
            if inp[0] is not last[0]:
                x = inp[0].reshape(-1, inp[0].shape[-1]).float()
                last[:] = inp[0], torch.mm(x.T, x).mul_(2.0)
            hess[name].add_(last[1])
            count[name] += inp[0].numel() // inp[0].shape[-1]

        return hook

    hooks = [m.register_forward_hook(accumulate(n)) for n, m in linears.items()]
    try:
        forward(*args)
    finally:
        for h in hooks:
            h.remove()
        last.clear()
    return {n: h / max(count[n], 1) for n, h in hess.items()}
