"""The tuned model through Keras 3 on JAX and TensorFlow against PyTorch (issue 16's acceptance), on a merged folder.

    python bench/keras_parity.py --model runs/x/merged [--backends jax,tensorflow] [--prompts 3] [--max-tokens 32]
                                 [--data shakespeare] [--seq-len 128] [--blocks 4] [--export-dir DIR]
                                 [--torch-variants]

Per backend, in a child process each (keras_worker.py):
  fp32: greedy generations (KerasHub's cached generate) equal PyTorch's for --max-tokens on --prompts prompts;
        held-out perplexity over --blocks blocks of --seq-len tokens, against PyTorch's;
  bf16: top-1 agreement with PyTorch over the held-out positions (PyTorch in bf16 and in fp32 both shown), and the
        criterion: Keras bf16's agreement with PyTorch fp32 is at least PyTorch bf16's own, minus 0.5 points
        (bf16 flips near-tied tokens in any framework; PyTorch's own flips are the yardstick). Exit 1 if it fails;
  the export: `tunesmith export --format keras` (its own check, then a fresh-process reload of the preset with
        plain keras_hub, whose largest logit difference from the conversion is shown).
Prints a table; the figures go to docs/EXPORT.md with the hardware and date.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tunesmith.data import IGNORE, load_data
from tunesmith.export import keras as K
from tunesmith.models import load_tokenizer
from tunesmith.parity import DEFAULT_PROMPTS, compare_logits

MARGIN = 0.005  # the criterion's slack: 0.5 points of top-1 agreement below PyTorch bf16's own


def perplexity(logits: list, examples) -> float:
    total, count = 0.0, 0
    for x, (_, labels) in zip(logits, examples, strict=True):
        target = torch.tensor(labels[1:])
        total += float(F.cross_entropy(torch.as_tensor(x)[:-1].float(), target, ignore_index=IGNORE, reduction="sum"))
        count += int((target != IGNORE).sum())
    return math.exp(total / count)


def torch_block_logits(model_dir: Path, precision: str, examples) -> list:
    from tunesmith.device import DTYPES
    from tunesmith.models import load_model
    from tunesmith.parity import _logits

    model, _ = load_model(str(model_dir), "cpu", DTYPES[precision])
    return [_logits(model, list(ids)) for ids, _ in examples]


def torch_variants(model_dir: Path, examples, ref_fp32: torch.Tensor, ref_bf16: torch.Tensor) -> None:
    """For scale: how often PyTorch itself keeps fp32's top-1 token in bf16, under bf16 autocast (bf16 products;
    norms, softmax and the residual stream in fp32), and with bf16 weights but fp32 compute."""
    from tunesmith.models import load_model
    from tunesmith.parity import _logits

    model, _ = load_model(str(model_dir), "cpu", torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = torch.cat([_logits(model, list(ids)).float() for ids, _ in examples])
    for p in model.parameters():
        p.data = p.data.bfloat16().float()
    weights_only = torch.cat([_logits(model, list(ids)) for ids, _ in examples])
    top1 = lambda ref, out: compare_logits(ref, out)["top1_agreement"]  # noqa: E731
    print(f"PyTorch top-1 against its own fp32: bf16 {top1(ref_fp32, ref_bf16):.2%}, bf16 autocast "
          f"{top1(ref_fp32, autocast):.2%}, bf16 weights with fp32 compute {top1(ref_fp32, weights_only):.2%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a merged HF folder (tunesmith merge)")
    ap.add_argument("--backends", default="jax,tensorflow")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--data", default="shakespeare")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--export-dir", default="")
    ap.add_argument("--torch-variants", action="store_true",
                    help="also: PyTorch's own bf16 variants (autocast, bf16 weights) against its fp32")
    args = ap.parse_args()
    model_dir = Path(args.model)
    tokenizer = load_tokenizer(str(model_dir))
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in DEFAULT_PROMPTS[: args.prompts]]
    examples = load_data(args.data, tokenizer, args.seq_len).valid[: args.blocks]
    blocks = [list(ids) for ids, _ in examples]
    positions = sum(map(len, blocks))

    t = time.perf_counter()
    ref = K.torch_reference(model_dir, prompts, "fp32", args.max_tokens)
    ref_blocks = torch_block_logits(model_dir, "fp32", examples)
    ref_bf16 = torch_block_logits(model_dir, "bf16", examples)
    ppl_torch = perplexity(ref_blocks, examples)
    torch_top1 = compare_logits(torch.cat(ref_blocks), torch.cat(ref_bf16))["top1_agreement"]
    print(f"PyTorch: {time.perf_counter() - t:.0f}s; perplexity {ppl_torch:.4f} on {len(blocks)} blocks ({positions} "
          f"positions); bf16 top-1 against its own fp32 {torch_top1:.2%}")
    if args.torch_variants:
        torch_variants(model_dir, examples, torch.cat(ref_blocks), torch.cat(ref_bf16))
    rows = []
    for backend in filter(None, args.backends.split(",")):
        t = time.perf_counter()
        fp32 = K.run_worker(backend, K.hf_request(model_dir, "fp32", tokenizer, sequences=ref.sequences + blocks,
                                                  prompts=prompts, max_tokens=args.max_tokens))
        n = len(prompts)
        gen = compare_logits(torch.cat(ref.logits), torch.cat([torch.from_numpy(x) for x in fp32.logits[:n]]))
        greedy = sum(a == b for a, b in zip(ref.greedy, fp32.greedy, strict=True))
        ppl = perplexity(fp32.logits[n:], examples)
        bf16 = K.run_worker(backend, K.hf_request(model_dir, "bf16", tokenizer, sequences=blocks))
        out = torch.cat([torch.from_numpy(x) for x in bf16.logits])
        top1_bf16 = compare_logits(torch.cat(ref_bf16), out)["top1_agreement"]
        top1_fp32 = compare_logits(torch.cat(ref_blocks), out)["top1_agreement"]
        reload = None
        if args.export_dir:
            folder = K.export(model_dir, Path(args.export_dir) / f"keras-{backend}", "fp32", None, 256, backend=backend)
        else:
            folder = K.export(model_dir, Path(tempfile.mkdtemp()) / "preset", "fp32", None, 256, backend=backend)
        reload = json.loads((folder / K.MARKER).read_text())["check"]["reload_max_abs"]
        rows.append((backend, greedy, n, gen["max_abs"], gen["mean_abs"], ppl, ppl / ppl_torch - 1, top1_bf16,
                     top1_fp32, reload, time.perf_counter() - t))
    print(f"\n{'backend':<11} {'greedy fp32':>11} {'max|dlogit|':>11} {'mean|dlogit|':>12} {'perplexity':>10} "
          f"{'vs torch':>9} {'bf16 top1 (vs torch bf16 / fp32)':>33} {'criterion':>9} {'reload max|d|':>13} "
          f"{'seconds':>7}")
    verdicts = []
    for b, g, n, mx, mn, p, rel, t1b, t1f, rl, s in rows:
        verdicts.append("PASS" if t1f >= torch_top1 - MARGIN else "FAIL")
        print(f"{b:<11} {f'{g}/{n}':>11} {mx:>11.3g} {mn:>12.3g} {p:>10.4f} {rel:>+9.5%} "
              f"{f'{t1b:.2%} / {t1f:.2%}':>33} {verdicts[-1]:>9} {rl:>13.3g} {s:>7.0f}")
    print(f"PyTorch    perplexity {ppl_torch:.4f}; {positions} held-out positions, {len(prompts)} prompts x "
          f"{args.max_tokens} greedy tokens")
    print(f"criterion: Keras bf16 top-1 vs PyTorch fp32 >= PyTorch bf16's {torch_top1:.2%} - {MARGIN:.1%} = "
          f"{torch_top1 - MARGIN:.2%}")
    if "FAIL" in verdicts:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
