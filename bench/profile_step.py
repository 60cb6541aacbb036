"""Where a training step's GPU time goes: tunesmith's trainer on one row of bench/train_throughput.py, profiled.

The row's model, data and settings are train_throughput's own (random weights of the real shape, bf16, dropout 0
unless --dropout says otherwise, --ts-flags as there). torch.profiler records --profile steps after --skip
steps (compilation, CUDA graph capture and allocator growth left out); the CUDA kernels' time is then summed by
kind (matrix products, attention, Triton kernels: Inductor's and Liger's, copies, the rest) and the --top kernels
are listed, then where the GPU idles between kernels. `--shapes` adds the products by operand shapes (only
those that run outside compiled layers: inside them the compiled graph launches its products itself), `--who TEXT`
the host operators that launched the kernels whose names contain TEXT. Needs a CUDA device and what
train_throughput's tunesmith worker needs.

    python bench/profile_step.py --row llama-1b
    python bench/profile_step.py --row llama-8b --ts-flags recompute=false --top 20
    python bench/profile_step.py --row llama-8b --who memcpy
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_throughput as tt  # noqa: E402

KINDS = (  # the first that matches a lower-cased kernel name
    ("matrix products", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce")),
    ("attention", ("flash", "cudnn", "fmha", "attn", "sdpa")),
    ("triton (Inductor, Liger)", ("triton", "liger")),
    ("copies, fills", ("memcpy", "memset", "copy_kernel", "fill")),
)


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", required=True, choices=sorted(tt.ROWS))
    ap.add_argument("--ts-flags", default="", help="TrainConfig fields, as train_throughput's --ts-flags")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--skip", type=int, default=9, help="steps before the profile starts")
    ap.add_argument("--profile", type=int, default=3, help="steps profiled")
    ap.add_argument("--top", type=int, default=25, help="kernels listed")
    ap.add_argument("--shapes", action="store_true",
                    help="also list the matrix products by operator and operand shapes, with their TFLOP/s")
    ap.add_argument("--who", default="",
                    help="also list the host operators (with operand shapes) that launched kernels whose name "
                         "contains this text")
    ap.add_argument("--workdir", default="/tmp/tt-bench")
    a = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "profile_step: needs a CUDA device (the CPU's step is profiled in docs/PERFORMANCE.md "
            "with torch.profiler directly)"
        )
    import tunesmith.train as train_module

    row = tt.ROWS[a.row]
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    folder = tt.prepare(row, "cuda", Path(a.workdir))
    steps = a.skip + a.profile + 1
    data = tt.examples(row, steps, folder)
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        record_shapes=a.shapes or bool(a.who),
    )
    train = train_module.train

    def profiled_train(cfg, data=None, progress=False, callback=None):
        done = [0]

        def step_ended(record):  # called after each step's synchronize
            done[0] += 1
            if done[0] == a.skip:
                prof.start()
            elif done[0] == a.skip + a.profile:
                torch.cuda.synchronize()
                prof.stop()
            callback(record)

        return train(cfg, data=data, progress=progress, callback=step_ended)

    train_module.train = profiled_train  # run_tunesmith imports it from the module when called
    args = argparse.Namespace(
        ts_flags=a.ts_flags,
        worker="tunesmith",
        workdir=a.workdir,
        device="cuda",
        steps=steps,
        dropout=a.dropout,
    )
    times, _, _, _ = tt.run_tunesmith(args, row, folder, data)
    profiled = times[a.skip : a.skip + a.profile]

    by_kind: collections.Counter = collections.Counter()
    by_name: collections.Counter = collections.Counter()
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
            by_kind[kind(event.key)] += event.self_device_time_total / 1e3 / a.profile  # ms a step
            by_name[event.key] += event.self_device_time_total / 1e3 / a.profile
    total = sum(by_kind.values())
    print(
        f"{a.row} ({a.ts_flags or 'defaults'}): step {1e3 * sum(profiled) / len(profiled):.1f} ms on the "
        f"clock, GPU busy {total:.1f} ms a step (mean of {a.profile} steps)"
    )
    for name, ms in by_kind.most_common():
        print(f"  {name:26s} {ms:8.2f} ms  {100 * ms / total:5.1f}%")
    print(f"the {a.top} longest kernels, ms a step:")
    for name, ms in by_name.most_common(a.top):
        print(f"  {ms:8.2f}  {kind(name)[:10]:10s}  {name[:120]}")
    gaps(prof, a.profile, a.top)
    if a.shapes:
        products(prof, a.profile, a.top)
    if a.who:
        launchers(prof, a.who, a.profile, a.top)
    return 0


def launchers(prof, text: str, steps: int, top: int) -> None:
    """The host operators whose kernels' names contain `text`, with their operand shapes and device time."""
    found: collections.Counter = collections.Counter()
    for event in prof.events():
        for k in getattr(event, "kernels", []):
            if text in k.name:
                found[(event.name, str(event.input_shapes)[:140])] += k.duration / 1e3 / steps
    print(f"host operators launching kernels named *{text}*, ms a step:")
    for (name, shapes), ms in found.most_common(top):
        print(f"  {ms:8.2f}  {name}  {shapes}")


def product_flops(shapes: list) -> float:
    """2 m k n for the first two chained 2-D operands of a product ([m, k] then [k, n]), else 0."""
    mats = [s for s in shapes if isinstance(s, list | tuple) and len(s) == 2]
    for x, y in zip(mats, mats[1:], strict=False):
        if x[1] == y[0]:
            return 2.0 * x[0] * x[1] * y[1]
    return 0.0


def products(prof, steps: int, top: int) -> None:
    """The matrix products' device time by operator and operand shapes (the kernels each launched, summed), with
    the rate each shape ran at: which products fall short of the rest."""
    import torch  # noqa: F401  (the profiler's events)

    rows = []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear",
                             "aten::matmul"):
            continue
        ms = event.device_time_total / 1e3 / steps
        if ms <= 0 or event.key in ("aten::linear", "aten::matmul"):  # counted under the mm/addmm they call
            continue
        flops = product_flops(event.input_shapes) * event.count / steps
        rows.append((ms, event.key, event.count // steps, event.input_shapes, flops / (ms / 1e3) / 1e12))
    total = sum(r[0] for r in rows)
    print(f"matrix products by shape: {total:.1f} ms a step; the {top} longest (ms a step, calls a step, TFLOP/s):")
    for ms, key, count, shapes, rate in sorted(rows, key=lambda r: r[0], reverse=True)[:top]:
        print(f"  {ms:8.2f}  {count:4d}  {rate:6.0f}  {key[6:]:7s} {shapes}")


def gaps(prof, steps: int, top: int) -> None:
    """Where the GPU idles: the gaps between one kernel's end and the next kernel's start (over the union of the
    kernels' intervals, so overlapping streams count once), summed a step, and the longest with their neighbours."""
    import torch

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not kernels:
        return
    found, end, last = [], kernels[0][1], kernels[0][2]
    for start, stop, name in kernels[1:]:
        if start > end:
            found.append(((start - end) / 1e3, last, name))
        if stop > end:
            end, last = stop, name
    idle = sum(g for g, _, _ in found) / steps
    print(f"GPU idle between kernels: {idle:.2f} ms a step over {len(found) / steps:.0f} gaps a step "
          f"({sum(g for g, _, _ in found if g >= 0.05) / steps:.2f} ms in gaps of 50 us or more); the longest:")
    for gap, before, after in sorted(found, reverse=True)[:top]:
        print(f"  {gap:8.3f} ms  after {before[:60]}  before {after[:60]}")


if __name__ == "__main__":
    raise SystemExit(main())
