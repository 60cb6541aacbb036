"""bf16 top-1 agreement between every pair of bf16 implementations of one merged model (issue 16's 99% figure).

    python bench/keras_bf16_pairs.py --model runs/x/merged [--backends jax,tensorflow]

PyTorch bf16 through SDPA and through eager attention (softmax in fp32, as KerasHub computes it), PyTorch fp32,
and Keras (KerasHub) in bf16 on each backend, over the same positions: the 256 that predict PyTorch SDPA's 32-token
greedy continuations of 8 prompts, and 4 held-out Shakespeare blocks of 128 tokens (512). Figures: docs/EXPORT.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tunesmith.data import load_data
from tunesmith.export import keras as K
from tunesmith.models import load_tokenizer
from tunesmith.parity import DEFAULT_PROMPTS, compare_logits

EXTRA_PROMPTS = ["KING RICHARD III:\nNow is the winter", "The quick brown fox", "To be, or not to be,",
                 "Once upon a time"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a merged HF folder (tunesmith merge)")
    ap.add_argument("--backends", default="jax,tensorflow")
    args = ap.parse_args()
    d = Path(args.model)
    tok = load_tokenizer(str(d))
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in [*DEFAULT_PROMPTS[:4], *EXTRA_PROMPTS]]
    blocks = [list(ids) for ids, _ in load_data("shakespeare", tok, 128).valid[:4]]
    models = {a: AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation=a).eval()
              for a in ("sdpa", "eager")}
    models["fp32"] = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        seqs = []
        for p in prompts:  # PyTorch bf16 (SDPA) greedy, 32 tokens
            s = list(p)
            for _ in range(32):
                s.append(int(models["sdpa"](torch.tensor([s])).logits[0, -1].argmax()))
            seqs.append(s)
        out = {a: [m(torch.tensor([x])).logits[0].float() for x in seqs + blocks] for a, m in models.items()}
    for backend in filter(None, args.backends.split(",")):
        r = K.run_worker(backend, K.hf_request(d, "bf16", tok, sequences=seqs + blocks))
        out[f"keras-{backend}"] = [torch.from_numpy(x).float() for x in r.logits]
    n = len(seqs)

    def cont(ls):
        return torch.cat([x[len(p) - 1: len(p) + 31] for x, p in zip(ls[:n], prompts, strict=True)])

    names = list(out)
    print(f"{'pair':<30} {'continuations (256)':>20} {'held-out (512)':>15}")
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            c = compare_logits(cont(out[a]), cont(out[b]))["top1_agreement"]
            h = compare_logits(torch.cat(out[a][n:]), torch.cat(out[b][n:]))["top1_agreement"]
            print(f"{a + ' vs ' + b:<30} {c:>20.2%} {h:>15.2%}")


if __name__ == "__main__":
    main()
