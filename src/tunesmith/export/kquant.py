"""llama.cpp's k-quants in numpy: the Q4_K / Q5_K / Q6_K reference quantizers and llama-quantize's per-tensor types.

The gguf package dequantizes every k-quant but quantizes none of them, so the three block quantizers here are ports
of ggml-quants.c's `quantize_row_q4_K_ref`, `quantize_row_q5_K_ref` and `quantize_row_q6_K_ref` (with their
`make_qkx2_quants` / `make_qx_quants` searches), vectorised over all sub-blocks of a tensor at once. They are what
llama-quantize runs without an importance matrix. The bytes are checked by reading them back with
`gguf.quants.dequantize` (tests/test_export_kquant.py).

`tensor_types` is llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp) for the four file types tunesmith
writes, including its fallback table for rows that are not a multiple of 256 weights (SmolLM2's 576, Gemma 3
270M's 640), and `expected_size` the tensor bytes that choice gives, to compare a file against.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

QK_K = 256  # weights per k-quant super-block
FILE_TYPES = ("q4_k_m", "q4_k_s", "q5_k_m", "q6_k")
# llama_ftype_get_default_type: the type of every matrix the rules below do not single out.
DEFAULT = {"q4_k_m": "Q4_K", "q4_k_s": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K"}
# tensor_type_fallback: a k-quant that does not fit a row's length, and what llama.cpp writes instead.
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
GROUP_MAX_EPS = 1e-15


# ------------------------------------------------------------------------------------------ per-tensor types


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _block_size(qtype: str) -> int:
    return QK_K if qtype.endswith("_K") else 32


def tensor_types(tensors: Iterable[tuple[str, tuple[int, ...]]], file_type: str) -> dict[str, str]:
    """GGML type name for every (GGUF name, numpy shape) as llama-quantize chooses it for `file_type`.

    1-D tensors (norms) stay F32. The counters llama.cpp keeps (i_attention_wv, i_ffn_down) equal the block
    index for models with one attn_v and one ffn_down per block, the only kind tunesmith writes; the 70B-only and
    mixture-of-experts rules do not apply to them.
    """
    tensors = list(tensors)
    default = DEFAULT[file_type]
    names = {name for name, _ in tensors}
    tied = "output.weight" not in names
    n_attn_v = sum(1 for n in names if n.endswith("attn_v.weight"))
    n_layers = len({m[1] for n in names if (m := re.match(r"blk\.(\d+)\.", n))})
    types = {}
    for name, shape in tensors:
        if len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name:
            types[name] = "F32"
            continue
        ncols = shape[-1]
        layer = int(m[1]) if (m := re.match(r"blk\.(\d+)\.", name)) else -1
        new = default
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            new = "Q8_0" if ncols % _block_size(default) else "Q6_K"
        elif name.endswith("attn_v.weight"):
            if file_type in ("q4_k_m", "q5_k_m") and _use_more_bits(layer, n_attn_v):
                new = "Q6_K"
            elif file_type == "q4_k_s" and layer < 4:
                new = "Q5_K"
        elif "ffn_down" in name:
            if file_type in ("q4_k_m", "q5_k_m") and _use_more_bits(layer, n_layers):
                new = "Q6_K"
            elif file_type == "q4_k_s" and layer < n_layers // 8:
                new = "Q5_K"
        if ncols % _block_size(new):
            new = FALLBACK.get(new, new)
            if ncols % _block_size(new):
                new = "F16"
        types[name] = new
    return types


def expected_size(tensors: Iterable[tuple[str, tuple[int, ...]]], types: dict[str, str], align: int = 32) -> int:
    """Bytes of tensor data a GGUF with these per-tensor types holds (each tensor padded to `align`, as ggml does)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    total = 0
    for name, shape in tensors:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[types[name]]]
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size
        total += -(-nbytes // align) * align
    return total


# ---------------------------------------------------------------------------------------------- quantizers


def quantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """ggml blocks (uint8 [..., row / 256 * block bytes]) of `data` (float, rows a multiple of 256) as `qtype`."""
    fn = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}[qtype]
    rows = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, data.shape[-1])
    if rows.shape[-1] % QK_K:
        raise ValueError(f"{qtype} needs rows of a multiple of {QK_K} weights, got {rows.shape[-1]}")
    step = max(1, (1 << 16) // (rows.shape[-1] // QK_K))  # about 64k blocks at a time bounds the temporaries
    out = [fn(rows[i : i + step].reshape(-1, QK_K)) for i in range(0, len(rows), step)]
    return np.concatenate(out).reshape(*data.shape[:-1], -1)


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants over rows of x: (scale, -min, L) with x ≈ scale * L + min, min <= 0, L in 0..nmax,
    searching nstep + 1 grid stretches for the least weighted squared error (the min follows the best fit)."""
    f32 = np.float32
    mn = np.minimum(x.min(-1), 0).astype(f32)
    mx = x.max(-1)
    sum_w, sum_x = w.sum(-1), (w * x).sum(-1)
    flat = mx == mn
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(flat, 0, nmax / (mx - mn)).astype(f32)
        scale = np.where(flat, 0, 1 / iscale).astype(f32)
        L = np.clip(np.rint(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        best = (w * (scale[:, None] * L + mn[:, None] - x) ** 2).sum(-1)
        for step in range(nstep + 1):
            iscale = ((rmin + rdelta * step + nmax) / (mx - mn)).astype(f32)
            La = np.clip(np.rint(iscale[:, None] * (x - mn[:, None])), 0, nmax)
            sum_l, sum_l2, sum_xl = (w * La).sum(-1), (w * La * La).sum(-1), (w * La * x).sum(-1)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, 0, this_min)
            err = (w * (this_scale[:, None] * La + this_min[:, None] - x) ** 2).sum(-1)
            better = (D > 0) & (err < best) & ~flat
            L = np.where(better[:, None], La, L)
            best = np.where(better, err, best)
            scale = np.where(better, this_scale, scale).astype(f32)
            mn = np.where(better, this_min, mn).astype(f32)
    L = np.where(flat[:, None], 0, L)
    return scale, -mn, L


def _pack_scale_min(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 bytes holding 8 six-bit scales and 8 six-bit mins (get_scale_min_k4 reads them back)."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.zeros((len(ls), 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return out


def _affine_k(blocks: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """The part Q4_K and Q5_K share: per 32-weight sub-block scale and min, stored as 6-bit multiples of a
    per-block fp16 d and dmin, then every weight re-rounded against the stored values. Returns (d, dmin,
    6-bit scales [nb, 8], 6-bit mins [nb, 8], L [nb, 256]): weight = d * scale * L - dmin * min."""
    nb = len(blocks)
    x = blocks.reshape(nb * 8, 32)
    av_x = np.sqrt((x * x).sum(-1) / 32)
    scales, mins, L = _make_qkx2(x, av_x[:, None] + np.abs(x), nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale = np.maximum(scales.max(-1), 0)
    max_min = np.maximum(mins.max(-1), 0)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, 63 / max_scale, 0).astype(np.float32)
        inv_min = np.where(max_min > 0, 63 / max_min, 0).astype(np.float32)
    ls = np.clip(np.rint(inv_scale[:, None] * scales), 0, 63)
    lm = np.clip(np.rint(inv_min[:, None] * mins), 0, 63)
    d, dmin = _fp16(max_scale / 63), _fp16(max_min / 63)
    sd = (d.astype(np.float32)[:, None] * ls).reshape(-1, 1)
    sm = (dmin.astype(np.float32)[:, None] * lm).reshape(-1, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(np.rint((x + sm) / sd), 0, nmax)
    L = np.where(sd == 0, L, again).reshape(nb, QK_K).astype(np.uint8)  # a zero scale keeps the search's codes
    return d, dmin, ls.astype(np.uint8), lm.astype(np.uint8), L


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref: [nb, 256] floats -> [nb, 144] bytes (d, dmin, 12 scale bytes, 128 nibble bytes)."""
    d, dmin, ls, lm, L = _affine_k(blocks, 15, -1.0, 0.1, 20)
    sc = _pack_scale_min(ls, lm)
    L = L.reshape(-1, 4, 2, 32)  # 64-weight chunks: byte l holds weights l (low nibble) and l + 32 (high)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), sc, qs], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref: [nb, 256] -> [nb, 176] bytes (d, dmin, 12 scale bytes, 32 high-bit bytes, 128 low)."""
    d, dmin, ls, lm, L = _affine_k(blocks, 31, -0.5, 0.1, 15)
    sc = _pack_scale_min(ls, lm)
    L = L.reshape(-1, 4, 2, 32)
    ql = ((L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    bits = (L >> 4).astype(np.uint8)  # chunk n's two halves set bits 2n and 2n + 1 of qh[l]
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)
    qh = np.bitwise_or.reduce((bits << shifts[None, :, :, None]).reshape(-1, 8, 32), axis=1)
    return np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), sc, qh, ql], axis=1
    )


def _make_qx(x: np.ndarray, nmax: int):
    """make_qx_quants(rmse_type 1) over rows of x: (scale, L) with x ≈ scale * (L - nmax), weighting errors by
    x², trying 19 scales around -nmax / (the weight of largest magnitude)."""
    idx = np.abs(x).argmax(-1)
    mx = np.take_along_axis(x, idx[:, None], -1)[:, 0]
    zero = np.abs(mx) < GROUP_MAX_EPS
    mx = np.where(zero, 1, mx)
    w = x * x

    def fit(iscale):
        q = np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1)
        return q, (w * x * q).sum(-1), (w * q * q).sum(-1)

    q, sumlx, suml2 = fit((-nmax / mx).astype(np.float32))
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 > 0, sumlx / suml2, 0)
        best = scale * sumlx
        L = q + nmax
        for step in [*range(-9, 0), *range(1, 10)]:
            q, sumlx, suml2 = fit((-(nmax + 0.1 * step) / mx).astype(np.float32))
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(better[:, None], q + nmax, L)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, 0, scale).astype(np.float32), np.where(zero[:, None], 0, L)


def _q6_k_codes(blocks: np.ndarray):
    """Q6_K's numbers for [nb, 256] floats: (fp16 d [nb], int8 scales [nb, 16], L [nb, 256] in 0..63); weight =
    d * scale * (L - 32). A block of zeros (or of weights below GROUP_MAX_EPS) is all zeros."""
    nb = len(blocks)
    x = blocks.reshape(nb * 16, 16)
    scales, L = _make_qx(x, 32)
    scales, L = scales.reshape(nb, 16), L.reshape(nb, QK_K)
    pick = np.abs(scales).argmax(-1)
    max_scale = np.take_along_axis(scales, pick[:, None], -1)[:, 0]
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore"):
        iscale = np.where(empty, 0, -128 / max_scale).astype(np.float32)
        d = _fp16(np.where(empty, 0, 1 / iscale))
    sc = np.minimum(127, np.rint(iscale[:, None] * scales)).astype(np.int8)
    sd = (d.astype(np.float32)[:, None] * sc).reshape(-1, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(np.rint(x / sd), -32, 31) + 32
    L = np.where(sd == 0, L.reshape(-1, 16), again).reshape(nb, QK_K)
    sc = np.where(empty[:, None], 0, sc).astype(np.int8)
    return d, sc, np.where(empty[:, None], 0, L).astype(np.uint8)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: [nb, 256] -> [nb, 210] bytes (128 low-nibble bytes, 64 high-bit bytes, 16 int8
    sub-block scales, fp16 d)."""
    nb = len(blocks)
    d, sc, L = _q6_k_codes(blocks)
    L = L.reshape(nb, 2, 4, 32)
    # 128-weight halves; in each, byte l of ql's first 32 holds weights l / l + 64, of the next 32 l + 32 / l + 96.
    ql = np.concatenate(
        [(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4), (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2
    ).reshape(nb, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6))
    qh = qh.reshape(nb, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
