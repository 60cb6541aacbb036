"""int4 group-wise weights chosen well: GPTQ (Frantar et al., 2022) over a model's decoder layers, or round-to-nearest.

The grid is the one XNNPACK runs (ExecuTorch's 8da4w): symmetric codes in [-8, 7], one scale per group of input
weights, scales rounded to bfloat16 (the precision XNNPACK keeps them in). So the eager int4 model and the .pte
hold the very same weights. Each group's scale is the multiple of max|w| (from CLIPS) with the least squared error.

GPTQ quantizes one column at a time and spreads each column's rounding error over the columns not yet quantized,
weighted by the inverse Hessian of the layer's inputs (H = 2 X^T X over calibration tokens). Columns go in order
of decreasing H diagonal (act-order) with each group's scale fixed beforehand from the unquantized weights (static
groups). Decoder layers go in order, each calibrated on the outputs of the layers already quantized. On SmolLM2-135M
this roughly quarters the perplexity cost of int4 against round-to-nearest (docs/SHIP.md).

Pure torch: the functions return dequantized weights (exactly on the grid) and the scales; quantize.py turns them
into torchao tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

QMIN, QMAX = -8, 7
CLIPS = tuple(1.1 - 0.025 * i for i in range(15))  # 1.1 ... 0.75 of max|w| / 7.5


def group_scales(w: torch.Tensor, clips: Sequence[float] = CLIPS) -> torch.Tensor:
    """Scale per row of one group of columns w [out, g]: the clip of max|w| with the least squared error."""
    amax = w.abs().amax(dim=1).clamp(min=1e-8)
    best_err, best = None, None
    for c in clips:
        scale = (amax * (c / 7.5)).to(torch.bfloat16).float()
        err = (fake_quant(w, scale[:, None]) - w).pow(2).sum(dim=1)
        if best is None:
            best_err, best = err, scale
        else:
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, scale, best)
    return best


def fake_quant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale), QMIN, QMAX) * scale


def rtn(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest: (dequantized weights, scales [out, in / group_size])."""
    w = weight.float()
    scales = torch.stack([group_scales(w[:, g : g + group_size]) for g in range(0, w.shape[1], group_size)], dim=1)
    return fake_quant(w, scales.repeat_interleave(group_size, dim=1)), scales


def gptq(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float = 0.01, block: int = 128):
    """GPTQ with act-order and static groups: (dequantized weights, scales [out, in / group_size])."""
    w = weight.float().clone()
    n = w.shape[1]
    scales = torch.stack([group_scales(w[:, g : g + group_size]) for g in range(0, n, group_size)], dim=1)
    h = hessian.float().clone()
    dead = torch.diag(h) == 0  # inputs that never fire: any value is as good, keep the weights out of the way
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(n)
    perm = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, perm], h[perm][:, perm]
    col_scale = scales.repeat_interleave(group_size, dim=1)[:, perm]
    # Upper Cholesky factor of H^-1: row i holds how column i's error should move the columns after it.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros(w.shape[0], i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            q[:, i1 + i] = fake_quant(w1[:, i], col_scale[:, i1 + i])
            err = (w1[:, i] - q[:, i1 + i]) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]  # the whole block's error, onto the columns after it
    return q[:, torch.argsort(perm)], scales


class _Captured(Exception):
    pass


@torch.no_grad()
def gptq_decoder_layers(model, calibration: Sequence[Sequence[int]], group_size: int, damp: float = 0.01):
    """Sequential GPTQ over model.model.layers. Each linear's weight is replaced by its dequantized int4 values;
    returns {module name: scales} for quantize.py to turn into int4 tensors. lm_head is not touched."""
    layers = model.model.layers
    inputs: list[tuple[tuple, dict]] = []

    def capture(_module, args, kwargs):
        inputs.append((args, kwargs))
        raise _Captured

    hook = layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        for ids in calibration:
            try:
                model(input_ids=torch.tensor([list(ids)]), use_cache=False)
            except _Captured:
                pass
    finally:
        hook.remove()
    hidden = [args[0] if args else kwargs["hidden_states"] for args, kwargs in inputs]

    def run_all(layer, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        outs = []
        for x, (args, kwargs) in zip(xs, inputs, strict=True):
            out = layer(x, *args[1:], **{k: v for k, v in kwargs.items() if k != "hidden_states"})
            outs.append(out[0] if isinstance(out, tuple) else out)
        return outs

    scales: dict[str, torch.Tensor] = {}
    for li, layer in enumerate(layers):
        linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        hessians = _hessians(linears, run_all, layer, hidden)
        for name, m in linears.items():
            q, s = gptq(m.weight, hessians[name], group_size, damp)
            m.weight.data = q.to(m.weight.dtype)
            scales[f"model.layers.{li}.{name}"] = s
        hidden = run_all(layer, hidden)  # through the quantized layer: the next layer's inputs
    return scales


def _hessians(linears: dict[str, torch.nn.Module], forward, *args) -> dict[str, torch.Tensor]:
    """2 X^T X / tokens for the inputs X each linear sees while `forward(*args)` runs."""
    hess = {n: torch.zeros(m.in_features, m.in_features) for n, m in linears.items()}
    count = dict.fromkeys(linears, 0)

    def accumulate(name):
        def hook(_module, inp, _out):
            x = inp[0].reshape(-1, inp[0].shape[-1]).float()
            hess[name].addmm_(x.T, x, alpha=2.0)
            count[name] += x.shape[0]

        return hook

    hooks = [m.register_forward_hook(accumulate(n)) for n, m in linears.items()]
    try:
        forward(*args)
    finally:
        for h in hooks:
            h.remove()
    return {n: h / max(count[n], 1) for n, h in hess.items()}
