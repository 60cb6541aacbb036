"""The ExecuTorch programs against eager PyTorch on this machine: decode tokens/s, bytes, logit fidelity, perplexity.

    tunesmith quantize --model runs/demo/merged --scheme int4 --output runs/demo/quantized-int4-g32
    python bench/bench_pte.py --model runs/demo/merged --int4 runs/demo/quantized-int4-g32 --out bench-pte \
        [--adapter runs/demo/adapter] [--threads 2] [--json out.json]

Writes (once; later runs reuse them) <out>/fp32/model.pte from the merged model and <out>/8da4w/model.pte from the
int4 folder (its GPTQ weights), both with --max-seq-len 256, then measures, all in this process:

- decode tokens/s: a 64-token prompt, then N greedy steps one token per call (eager: the HF model with its KV cache,
  as `tunesmith generate` runs it; .pte: `tunesmith run`'s loop). Repeats interleave the three so a busy machine
  slows them alike; the median is reported.
- bytes: the merged model's safetensors against each .pte.
- fidelity: relative logit error max|pte - eager| / max|eager| over a 64-token prefill plus 32 decode steps; with
  --adapter, max|merged - adapter| logits on the same tokens.
- perplexity on --blocks held-out Shakespeare blocks of 256 tokens: eager fp32, eager int8 (torchao, made here),
  eager int4 (the --int4 folder), each .pte.

Lowering the 135M model takes minutes on 2 cores; measure on a quiet machine. The figures go to docs/SHIP.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from tunesmith.compare import pte_perplexity
from tunesmith.config import ExportConfig
from tunesmith.data import load_data
from tunesmith.evaluate import evaluate
from tunesmith.export import export
from tunesmith.models import load_model
from tunesmith.pte_runtime import PteModel
from tunesmith.quantize import quantize_model, weights_bytes

PTES = ("fp32", "8da4w")
MAX_SEQ = 256


@torch.no_grad()
def eager_decode_tps(model, prompt: list[int], steps: int) -> float:
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    t = time.perf_counter()
    for _ in range(steps):
        token = int(out.logits[0, -1].argmax())
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
    return steps / (time.perf_counter() - t)


def pte_decode_tps(pte: PteModel, prompt: list[int], steps: int) -> float:
    logits = pte.logits(prompt, 0)[-1]
    t = time.perf_counter()
    for i in range(steps):
        logits = pte.logits([int(logits.argmax())], len(prompt) + i)[-1]
    return steps / (time.perf_counter() - t)


@torch.no_grad()
def rel_err_prefill_decode(model, pte: PteModel, ids: list[int], prefill: int) -> float:
    ref = model(torch.tensor([ids])).logits[0]
    got = torch.cat([pte.logits(ids[:prefill], 0)] + [pte.logits([t], prefill + i) for i, t in enumerate(ids[prefill:])])
    return float((got - ref).abs().max() / ref.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="merged HF folder (fp32)")
    ap.add_argument("--int4", required=True, help="its `tunesmith quantize --scheme int4` folder (the 8da4w weights)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for eager and ExecuTorch (0: as they default)")
    ap.add_argument("--adapter", help="the adapter it was merged from: also report merged-vs-adapter logits")
    ap.add_argument("--out", default="bench-pte", help="folder for the .pte files (reused when present)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=16, help="held-out blocks of 256 tokens for perplexity")
    ap.add_argument("--export-only", action="store_true", help="write the .pte files and stop")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()

    out, started = Path(args.out), time.perf_counter()
    paths, lower_s = {}, {}
    for quant in PTES:
        paths[quant] = out / quant / "model.pte"
        if not paths[quant].is_file():
            t = time.perf_counter()
            source = args.model if quant == "fp32" else args.int4
            export(ExportConfig(model=source, format="pte", quant=quant, output=str(paths[quant]), max_seq_len=MAX_SEQ))
            lower_s[quant] = time.perf_counter() - t
            print(f"lowered {quant} in {lower_s[quant]:.0f}s", flush=True)
    if args.export_only:
        return

    if args.threads:
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

        torch.set_num_threads(args.threads)
        _unsafe_reset_threadpool(args.threads)
    model, tok = load_model(args.model)
    ptes = {q: PteModel(p) for q, p in paths.items()}
    blocks = load_data("shakespeare", tok, MAX_SEQ).valid[: args.blocks]
    ids = blocks[0][0][:96]
    prompt = ids[:64]

    tps: dict[str, list[float]] = {"eager fp32": [], **{f"pte {q}": [] for q in PTES}}
    eager_decode_tps(model, prompt, 4)  # warm-up
    for _ in range(args.repeats):
        tps["eager fp32"].append(eager_decode_tps(model, prompt, args.steps))
        for q, pte in ptes.items():
            tps[f"pte {q}"].append(pte_decode_tps(pte, prompt, args.steps))
    median = {k: statistics.median(v) for k, v in tps.items()}

    fp32_bytes = weights_bytes(args.model)
    figures = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": torch.get_num_threads(),
        "model": args.model, "decode_steps": args.steps, "repeats": args.repeats,
        "decode_tokens_per_s": median, "decode_tokens_per_s_all": tps,
        "speedup_4bit_vs_eager_fp32": median["pte 8da4w"] / median["eager fp32"],
        "bytes": {"eager fp32 (safetensors)": fp32_bytes, **{f"pte {q}": p.stat().st_size for q, p in paths.items()}},
        "bytes_ratio_4bit_vs_fp32": paths["8da4w"].stat().st_size / fp32_bytes,
        "rel_logit_err_64_prefill_32_decode": {f"pte {q}": rel_err_prefill_decode(model, pte, ids, 64)
                                               for q, pte in ptes.items()},
        "lowering_seconds": lower_s,
    }
    if args.adapter:
        from tunesmith.lora import load_adapter

        base = json.loads((Path(args.model) / "tunesmith-merge.json").read_text()).get("base_model")
        peft = load_adapter(load_model(base)[0], args.adapter).eval()
        with torch.no_grad():
            x = torch.tensor([ids])
            figures["merged_vs_adapter_max_abs_logit"] = float((model(x).logits - peft(x).logits).abs().max())
        del peft

    ppl = {"eager fp32": evaluate(model, blocks, 4, 0, tok.pad_token_id).perplexity}
    q = copy.deepcopy(model)
    quantize_model(q, "int8")
    ppl["eager int8"] = evaluate(q, blocks, 4, 0, tok.pad_token_id).perplexity
    q = load_model(args.int4)[0]
    ppl["eager int4 g32"] = evaluate(q, blocks, 4, 0, tok.pad_token_id).perplexity
    del q
    for q, pte in ptes.items():
        ppl[f"pte {q}"] = pte_perplexity(pte, blocks)
    figures["perplexity"] = ppl
    figures["perplexity_vs_eager_fp32"] = {k: v / ppl["eager fp32"] - 1 for k, v in ppl.items()}
    figures["wall_seconds"] = time.perf_counter() - started

    print(f"\n{'':18}{'decode tok/s':>14}{'MiB':>9}{'perplexity':>12}{'vs fp32':>9}")
    for name in ("eager fp32", "eager int8", "eager int4 g32", *[f"pte {q}" for q in PTES]):
        size = figures["bytes"].get(name, figures["bytes"].get(f"{name} (safetensors)"))
        speed = median.get(name)
        print(f"{name:18}{speed if speed else float('nan'):14.1f}{(size or float('nan')) / 2**20:9.1f}"
              f"{ppl[name]:12.3f}{figures['perplexity_vs_eager_fp32'][name]:+9.2%}")
    print(f"\n4-bit .pte decode: {figures['speedup_4bit_vs_eager_fp32']:.2f}x eager fp32, at "
          f"{figures['bytes_ratio_4bit_vs_fp32']:.3f}x the bytes")
    print("relative logit error (64 prefill + 32 decode):",
          {k: f"{v:.2e}" for k, v in figures["rel_logit_err_64_prefill_32_decode"].items()})
    if "merged_vs_adapter_max_abs_logit" in figures:
        print(f"merged vs adapter max |d logit|: {figures['merged_vs_adapter_max_abs_logit']:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
