"""k-quant GGUF against the model it came from, and against the size llama.cpp's own quantizer would give.

    python bench/kquant_accuracy.py --model /tmp/kq/merged --blocks 16 --quants q4_k_m,q4_k_s,q5_k_m,q6_k
    python bench/kquant_accuracy.py --model /tmp/kq/merged --blocks 16 --quants q4_k_m --calibration-blocks 64

For each file type: the file's size against llama.cpp's expected size (llama-quantize's per-tensor types for this
model's tensor shapes, kquant.tensor_types, times ggml's block sizes, plus this file's own header), the per-tensor
type counts, read back by the gguf package (every tensor dequantizes, types as planned) and by transformers' GGUF
loader: logits on the first held-out block against the PyTorch model (relative L2, KL, top-1) and perplexity on
--blocks held-out Shakespeare blocks of 256 tokens. --calibration-blocks N > 0: the Q8_0 / Q5_0 matrices of the
decoder layers by GPTQ on N training blocks (what `tunesmith export` does by default), the k-quant ones rounded.
Figures go to docs/EXPORT.md.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunesmith.data import load_data
from tunesmith.evaluate import evaluate
from tunesmith.export import gguf as G
from tunesmith.export import kquant
from tunesmith.models import resolve_model
from tunesmith.quantize import calibration_blocks


def logits_of(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def compare(got: torch.Tensor, ref: torch.Tensor) -> str:
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    top1 = float((lp.argmax(-1) == lq.argmax(-1)).float().mean())
    return f"rel {float((got - ref).norm() / ref.norm()):.2e}, KL {kl:.1e}, top-1 {top1:.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="merged HF folder (or any --model spec)")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--quants", default="q4_k_m")
    ap.add_argument("--out", default="/tmp/kquant-bench")
    ap.add_argument("--calibration-blocks", type=int, default=0, help="0: round to nearest, as llama-quantize")
    args = ap.parse_args()
    folder = Path(resolve_model(args.model))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = load_data("shakespeare", tokenizer, 256)
    blocks = data.valid[: args.blocks]
    calibration = calibration_blocks(data.train, args.calibration_blocks) if args.calibration_blocks else None
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref_ppl = evaluate(ref_model, blocks, 4, 0, tokenizer.pad_token_id).perplexity
    ref = logits_of(ref_model, blocks[0][0])
    del ref_model
    print(f"model {folder}: PyTorch fp32 perplexity {ref_ppl:.2f} on {len(blocks)} held-out blocks of 256")
    print("| quant | size MiB | llama.cpp-expected MiB | size vs expected | export s | types | logits (transformers) "
          "| perplexity |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    for quant in args.quants.split(","):
        start = time.perf_counter()
        path = G.export(folder, out / f"model-{quant}.gguf", quant, 32, 256, calibration, progress=False)
        seconds = time.perf_counter() - start
        reader = gguf.GGUFReader(path)
        shapes = [(t.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors]
        planned = kquant.tensor_types(shapes, quant)
        got = {t.name: t.tensor_type.name for t in reader.tensors}
        assert got == planned, "the file's types are not llama-quantize's"
        for t in reader.tensors:
            assert np.isfinite(gguf.quants.dequantize(t.data, t.tensor_type)).all(), t.name
        header = int(reader.tensors[0].data_offset)  # KV metadata + tensor infos + alignment, ours and theirs alike
        expected = header + kquant.expected_size(shapes, planned)
        size = path.stat().st_size
        counts = ", ".join(f"{k} {v}" for k, v in sorted(collections.Counter(got.values()).items()))
        model = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32).eval()
        ppl = evaluate(model, blocks, 4, 0, tokenizer.pad_token_id).perplexity
        label = f"{quant}, GPTQ {args.calibration_blocks}" if calibration else f"{quant}, round to nearest"
        print(f"| {label} | {size / 2**20:.1f} | {expected / 2**20:.1f} | {size / expected - 1:+.2%} | "
              f"{seconds:.0f} | {counts} | {compare(logits_of(model, blocks[0][0]), ref)} | "
              f"{ppl:.2f} ({ppl / ref_ppl - 1:+.1%}) |", flush=True)
        del model


if __name__ == "__main__":
    main()
