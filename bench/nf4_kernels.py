"""The nf4 base's products on one GPU: tunesmith's kernels (kernels.nf4) against torchao's linear_nf4 and bf16.

    python bench/nf4_kernels.py [--rows 8192] [--out nf4-kernels.jsonl]

For each decoder linear of the Llama-3.1-8B shape (random weights quantized to nf4 as `--quantize-base nf4` does),
at `--rows` tokens in bf16: the forward product x W^T and the input's gradient g W, each through
- torchao: linear_nf4 (the plain path: the weight dequantized by PyTorch ops, then multiplied);
- fused: the GEMM kernel that decodes W's tiles in registers;
- dequantize: the decoding kernel into one buffer, then cuBLAS;
- bf16: cuBLAS on the dequantized weight held in bf16 (what the products cost with no decoding at all).
Each its mean time over 20 calls after 3 warm-ups (CUDA events), and the relative error of both kernels against
torchao's result (max |got - want| / max |want|), which must stay at bf16 rounding. The strategy the op would pick
(the faster kernel) is marked.
"""

from __future__ import annotations

import argparse
import json
import sys

SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "o_proj": (4096, 4096), "gate_proj": (14336, 4096),
          "down_proj": (4096, 14336)}  # name -> (out, in); v_proj is k_proj's shape, up_proj gate_proj's


def timed(fn, repeat: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeat


def products(x, q, w, parts, fwd: bool, linear_nf4):
    """The four ways to x W^T (fwd) or x W: torchao, the fused kernel, decode then cuBLAS, bf16 cuBLAS."""
    from tunesmith.kernels import nf4

    if fwd:
        ref, plain = (lambda: linear_nf4(x, q)), (lambda: x @ w.t())
    else:  # what linear_nf4's backward computes: g times the weight dequantized again
        ref, plain = (lambda: x @ q.to(x.dtype)), (lambda: x @ w)
    return (ref, lambda: nf4.mm_triton(x, *parts, fwd), lambda: nf4._dequantize_then_mm(x, *parts, transposed=fwd),
            plain)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192, help="tokens per product (batch x seq)")
    ap.add_argument("--out", default="", help="append the rows to this JSON Lines file")
    a = ap.parse_args()
    import torch

    from tunesmith.kernels import nf4
    from tunesmith.qlora import QuantLinear, _torchao_nf4

    _, linear_nf4 = _torchao_nf4()
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, rows {a.rows}, bf16; ms per product")
    print("| linear | direction | torchao | fused | dequantize | bf16 cuBLAS | picked | err fused | err dequantize |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|")
    rows = []
    for name, (out_f, in_f) in SHAPES.items():
        layer = QuantLinear.from_weight((torch.randn(out_f, in_f, device="cuda") * 0.02).to(bf16), "nf4")
        q = layer.qweight
        parts = (*nf4.nf4_parts(q), out_f, in_f, q.scaler_block_size)
        w = q.get_original_weight().to(bf16)
        for direction in ("forward", "input grad"):
            fwd = direction == "forward"
            x = torch.randn(a.rows, in_f if fwd else out_f, device="cuda", dtype=bf16)
            ref, fused, deq, plain = products(x, q, w, parts, fwd, linear_nf4)
            want = ref().float()
            errs = {k: ((f().float() - want).abs().max() / want.abs().max()).item()
                    for k, f in (("fused", fused), ("dequantize", deq))}
            ms = {k: timed(f) for k, f in (("torchao", ref), ("fused", fused), ("dequantize", deq), ("bf16", plain))}
            picked = min(("fused", "dequantize"), key=ms.get)
            row = {"linear": name, "direction": direction, "rows": a.rows, "ms": ms, "errors": errs,
                   "picked": picked, "gpu": torch.cuda.get_device_name(0)}
            rows.append(row)
            print(f"| {name} | {direction} | {ms['torchao']:.3f} | {ms['fused']:.3f} | {ms['dequantize']:.3f} | "
                  f"{ms['bf16']:.3f} | {picked} | {errs['fused']:.2e} | {errs['dequantize']:.2e} |", flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    worst = max(max(r["errors"].values()) for r in rows)
    print(f"largest relative error against torchao: {worst:.2e} ({'ok' if worst < 1e-2 else 'TOO LARGE'})")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
