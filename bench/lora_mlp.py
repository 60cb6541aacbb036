"""One Llama MLP with LoRA on gate, up and down: PEFT's layers against tunesmith's LoRA-aware MLP (CUDA).

    python bench/lora_mlp.py [--rows llama-1b,llama-8b] [--rank 16] [--eager]

For each row, a transformers LlamaMLP of the row's shape in bf16 with PEFT LoRA (dropout 0, B drawn non-zero so
every rank-r term counts) on gate_proj, up_proj and down_proj, compiled as the trainer compiles its layers
(activation memory budget 0.9), forward + backward over a micro-batch of the row's tokens: PEFT's own path, and the
same module after `fused.fuse_mlp`. Prints the median time (CUDA events), the peak memory above the weights, and
how far the fused output and LoRA gradients are from PEFT's (relative to each tensor's largest value), and the
same for both against an fp32 copy, so the bf16 rounding of either path is seen next to the other's. Then the two
kernels alone against the bytes they must move.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_overhead import SHAPES, timed  # noqa: E402  (hidden, intermediate, ..., tokens a micro-batch step)


def build(hidden: int, inter: int, rank: int, dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")

    class Holder(torch.nn.Module):  # PEFT wraps a model, not a bare MLP
        def __init__(self):
            super().__init__()
            self.mlp = LlamaMLP(cfg)

        def forward(self, x):
            return self.mlp(x)

    torch.manual_seed(0)
    model = Holder()
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                             target_modules=["gate_proj", "up_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model.to("cuda", dtype)


SWEEP = [(bm, bn, w, s) for bm, bn, w in ((32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 64, 8), (64, 128, 4))
         for s in (1, 2, 4, 8)]
# --stages: the default tiles, their segments chosen per GPU (0), at each software-pipeline depth
STAGES = [(64, 64, w, 0, st) for w in (4, 8) for st in (1, 2, 3, 4, 5)]


def profile(fn, name: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print(f"  {name}: CUDA kernels over 3 forward + backward passes")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))


def lora_grads(model) -> dict:
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}


def step(model, x, gy):
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.backward(gy)
    return y


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def kernels(a, m: int, inter: int, sums: dict) -> None:
    from tunesmith import lora_mlp

    # the kernels alone: the forward reads g0 and u0 and writes h; the backward reads dh, g0 and u0 and writes
    # dg, du and h (bf16, 2 bytes each)
    r = a.rank
    g0, u0 = (torch.randn(m, inter, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    xa = torch.randn(m, 2 * r, device="cuda", dtype=torch.bfloat16)
    bg, bu = (torch.randn(inter, r, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dh = torch.randn(m, inter, device="cuda", dtype=torch.bfloat16)
    dyb = torch.randn(m, r, device="cuda", dtype=torch.bfloat16)
    ad = torch.randn(r, inter, device="cuda", dtype=torch.bfloat16)
    big = m * inter * 2
    fwd = lora_mlp.lora_swiglu
    bwd = lora_mlp.lora_swiglu_backward
    args = (g0, u0, xa, bg, bu, ad, 0.5, 2.0)
    bargs = (dh, dyb, ad, g0, u0, xa, bg, bu, 0.5, 2.0, 1.5)
    tf = timed(lambda args=args, fwd=fwd: fwd(*args), a.warmup, a.iters)
    tb = timed(lambda bargs=bargs, bwd=bwd: bwd(*bargs), a.warmup, a.iters)
    h0, h1 = lora_mlp._forward_reference(*args), fwd(*args)
    b0, b1 = lora_mlp._backward_reference(*bargs), bwd(*bargs)
    auto = {k: lora_mlp.auto_segments(-(-m // t[0]), torch.cuda.get_device_properties(0).multi_processor_count)
            for k, t in lora_mlp.TILES.items()}
    print(f"  kernels at TILES {lora_mlp.TILES} (segments 0 here: {auto}), MASKLESS {lora_mlp.MASKLESS}")
    print(f"  kernels: forward {tf:.3f} ms ({3 * big / tf / 1e9:.2f} TB/s), backward {tb:.3f} ms "
          f"({6 * big / tb / 1e9:.2f} TB/s); against the fp32 reference: h {rel(h1[0], h0[0]):.1e}, "
          f"h A_d^T {rel(h1[1], h0[1]):.1e}, dg {rel(b1[0], b0[0]):.1e}, du {rel(b1[1], b0[1]):.1e}, "
          f"h {rel(b1[2], b0[2]):.1e}, dxa {rel(b1[3], b0[3]):.1e}")
    # A_d's gradient: from h by a product after the kernel (as now), or summed by the kernel itself (DAD_IN_KERNEL)
    tp = timed(lambda: (dyb.t() @ b1[2]).mul_(1.5), a.warmup, a.iters)
    tk = timed(lambda bargs=bargs: lora_mlp._backward_triton(*bargs, shares=1), a.warmup, a.iters)
    dad0 = lora_mlp._backward_reference(*bargs, shares=1)[2]
    one = lora_mlp._backward_triton(*bargs, shares=1)
    print(f"  A_d's gradient: backward kernel + product over h {tb:.3f} + {tp:.3f} = {tb + tp:.3f} ms; summed in the "
          f"kernel (DAD_IN_KERNEL) {tk:.3f} ms ({tk / (tb + tp):.3f}x), against the fp32 reference "
          f"{rel(one[2], dad0):.1e} (the product's {rel((dyb.t() @ b1[2]).mul_(1.5), dad0):.1e})")
    # B_g's and B_u's gradients: by two products over dg and du after the kernel, or summed by it (LORA_B_IN_KERNEL)
    r2 = xa.shape[1] // 2
    tbp = timed(lambda: ((one[0].t() @ xa[:, :r2]).mul_(0.5), (one[1].t() @ xa[:, r2:]).mul_(2.0)), a.warmup,
                a.iters)
    t3 = timed(lambda bargs=bargs: lora_mlp._backward_triton(*bargs, shares=3), a.warmup, a.iters)
    ref3 = lora_mlp._backward_reference(*bargs, shares=3)[2]
    three = lora_mlp._backward_triton(*bargs, shares=3)[2]
    print(f"  B_g's and B_u's gradients: kernel (A_d's summed) + two products {tk:.3f} + {tbp:.3f} = {tk + tbp:.3f} "
          f"ms; summed in the kernel (LORA_B_IN_KERNEL) {t3:.3f} ms ({t3 / (tk + tbp):.3f}x), against the fp32 "
          f"reference {max(rel(three[i], ref3[i]) for i in range(3)):.1e} (the products' "
          f"{rel((one[0].t() @ xa[:, :r2]).mul_(0.5).t(), ref3[1]):.1e})")
    if a.sweep:
        mine = {}
        shares = lora_mlp.shares() if a.shares is None else a.shares
        b0 = lora_mlp._backward_reference(*bargs, shares=shares)
        print(f"  the backward kernel with shares={shares}")
        for tiles in a.tiles or (STAGES if a.stages else SWEEP):
            f = timed(lambda t=tiles, args=args: lora_mlp._forward_triton(*args, tiles=t), a.warmup, a.iters)
            b = timed(lambda t=tiles, bargs=bargs: lora_mlp._backward_triton(*bargs, tiles=t, shares=shares),
                      a.warmup, a.iters)
            hf = lora_mlp._forward_triton(*args, tiles=tiles)
            hb = lora_mlp._backward_triton(*bargs, tiles=tiles, shares=shares)
            err = max(rel(hf[0], h0[0]), rel(hf[1], h0[1]), *(rel(x, y) for x, y in zip(hb, b0, strict=True)))
            print(f"  tiles {tiles}: forward {f:.3f} ms ({3 * big / f / 1e9:.2f} TB/s), backward {b:.3f} ms "
                  f"({6 * big / b / 1e9:.2f} TB/s), largest error against the fp32 reference {err:.1e}")
            sums[tiles] = [x + y for x, y in zip(sums.get(tiles, (0.0, 0.0)), (f, b), strict=True)]
            mine[tiles] = (f, b)
        print(f"  fastest here: forward {min(mine, key=lambda t: mine[t][0])}, backward "
              f"{min(mine, key=lambda t: mine[t][1])}")


def registers(rank: int) -> None:
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tunesmith import lora_mlp

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    print(f"sm_90, bf16, LoRA r{rank}: registers and stack bytes per thread (Triton {triton.__version__})")
    for name, kernel in (("forward", lora_mlp._swiglu_fwd_kernel), ("backward", lora_mlp._swiglu_bwd_kernel)):
        for bm, bn, warps, _ in SWEEP[::4]:  # the segments change the grid, not the kernel
            consts = {"R": rank, "RP": lora_mlp._rank_pad(rank), "PRECISION": "tf32", "BLOCK_M": bm, "BLOCK_N": bn,
                      "EVEN": True}
            if name == "backward":
                consts["SHARES"] = lora_mlp.shares()
            names = kernel.arg_names
            sums = ("HA", "DXA", *(("H",) if consts.get("SHARES") else ()))
            signature = {n: "constexpr" if n in consts else "fp32" if n in ("sg", "su", "sd") else
                         "*fp32" if n in sums else "*bf16" if n.isupper() and n not in ("M", "N", "W")
                         else "i32" for n in names}
            src = ASTSource(kernel, signature, {(names.index(n),): v for n, v in consts.items()})
            built = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(built.asm["cubin"])
                f.flush()
                out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
            usage = next(line.split()[:2] for line in out.splitlines() if "REG:" in line)
            print(f"  {name:8s} tiles {bm:3d} x {bn:3d}, {warps} warps: {' '.join(usage)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="llama-1b,llama-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--eager", action="store_true", help="do not compile the modules")
    ap.add_argument("--sweep", action="store_true", help="time the kernels at several tile shapes")
    ap.add_argument("--stages", action="store_true", help="with --sweep: the default tiles at several pipeline "
                    "depths (num_stages) instead")
    ap.add_argument("--tiles", type=lambda v: tuple(int(x) for x in v.split(",")), nargs="+",
                    help="with --sweep: these tile layouts (BLOCK_M,BLOCK_N,warps,segments[,stages]) instead")
    ap.add_argument("--shares", type=int, choices=(0, 1, 3),
                    help="with --sweep: the backward kernel's shares (default: as the trainer runs it)")
    ap.add_argument("--masked", action="store_true", help="load and store every tile with a mask, as the kernels "
                    "do where the tiles do not cover the tensors exactly (lora_mlp.MASKLESS off)")
    ap.add_argument("--profile", action="store_true", help="CUDA kernel times of one forward + backward of each")
    ap.add_argument("--kernels-only", action="store_true", help="time the two kernels alone, not the modules")
    ap.add_argument("--registers", action="store_true",
                    help="no GPU needed: build the kernels at each tile shape of the sweep for sm_90 with Triton's "
                         "ptxas and print their registers and stack (spills) per thread")
    a = ap.parse_args()
    if a.registers:
        return registers(a.rank)
    if a.masked:
        from tunesmith import lora_mlp

        lora_mlp.MASKLESS = False
    import torch._functorch.config as functorch_config

    from tunesmith.fused import LEAN_BUDGET, fuse_mlp

    sums = {}  # tiles -> summed forward, backward times over the rows
    for row in a.rows.split(","):
        hidden, inter, *_, m = SHAPES[row]
        if a.kernels_only:
            print(f"{row}: intermediate {inter}, {m} tokens, LoRA r{a.rank}, bf16")
            kernels(a, m, inter, sums)
            continue
        peft = build(hidden, inter, a.rank, torch.bfloat16)
        ref = copy.deepcopy(peft).float()
        fused = copy.deepcopy(peft)
        assert fuse_mlp(fused) == 1
        torch.manual_seed(1)
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        y_ref = step(ref, x.float(), gy.float())
        g_ref = lora_grads(ref)
        del ref
        results = {}
        for name, model in (("PEFT", peft), ("fused", fused)):
            run = model if a.eager else torch.compile(model)
            with functorch_config.patch(activation_memory_budget=LEAN_BUDGET):
                y = step(run, x, gy)
                grads = lora_grads(model)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                ms = timed(lambda run=run, x=x, gy=gy: step(run, x, gy), a.warmup, a.iters)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                if a.profile:
                    profile(lambda run=run, x=x, gy=gy: step(run, x, gy), name)
            results[name] = (y.detach(), grads, ms, peak)
        print(f"{row}: hidden {hidden}, intermediate {inter}, {m} tokens, LoRA r{a.rank} on gate/up/down, bf16, "
              f"{'eager' if a.eager else 'compiled'}; forward + backward")
        for name, (y, grads, ms, peak) in results.items():
            worst = max(rel(grads[k], g_ref[k]) for k in g_ref)
            print(f"  {name:6s} {ms:8.3f} ms  peak above inputs {peak:6.2f} GiB  vs fp32: output {rel(y, y_ref):.2e}, "
                  f"LoRA gradients (worst) {worst:.2e}")
        (y0, g0, t0, _), (y1, g1, t1, _) = results["PEFT"], results["fused"]
        print(f"  fused / PEFT time {t1 / t0:.3f}; fused vs PEFT: output {rel(y1, y0):.2e}, LoRA gradients (worst) "
              f"{max(rel(g1[k], g0[k]) for k in g0):.2e}")

        kernels(a, m, inter, sums)
        del peft, fused, results
        torch.cuda.empty_cache()
    if sums:
        best = {k: min(sums, key=lambda t, i=i: sums[t][i]) for i, k in enumerate(("forward", "backward"))}
        print(f"fastest over the rows: TILES = {best}")


if __name__ == "__main__":
    main()
