"""Gemma 3 in every export format, each checked against the PyTorch model it came from. Figures go to docs/EXPORT.md.

    python bench/gemma_exports.py --model gemma3-270m --out /tmp/gemma-bench
    python bench/gemma_exports.py --model gemma3-270m --adapter runs/gemma/adapter --out /tmp/gemma-bench

GGUF (f16, q8_0, q4_k_m rounded to nearest; with --calibration-blocks N also q8_0, q4_0, q4_k_m by GPTQ on N
training blocks): read back by the gguf package (every tensor dequantizes; q4_k_m's per-tensor types are
llama-quantize's, its size against llama.cpp's expected size) and by transformers' GGUF loader
(logits on the first held-out Shakespeare block against PyTorch, perplexity on --blocks blocks). MLX (fp32): greedy
32 tokens from three prompts under mlx-lm against PyTorch greedy. .pte (fp32, XNNPACK): logits over a 24-token
prefill then 16 single-token steps against the eager model (max |Δ|). Core ML (fp16): conversion and the saved
spec validated (prediction needs macOS), and the converted decode step stepped through 32 tokens against PyTorch.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunesmith.data import load_data
from tunesmith.evaluate import evaluate
from tunesmith.export import kquant
from tunesmith.models import resolve_model
from tunesmith.quantize import calibration_blocks

PROMPTS = ("ROMEO:\n", "JULIET:\nO Romeo", "First Citizen:\nBefore we proceed")


def size_mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def torch_greedy(model, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def bench_gguf(folder, out, blocks, ref, ref_ppl, pad_id, calibration):
    from tunesmith.export import gguf as G

    runs = [(quant, None) for quant in ("f16", "q8_0", "q4_k_m")]
    runs += [(quant, calibration) for quant in ("q8_0", "q4_0", "q4_k_m") if calibration]
    for quant, blocks_in in runs:
        start = time.perf_counter()
        path = G.export(folder, out / f"model-{quant}.gguf", quant, 32, 256, calibration=blocks_in, progress=False)
        seconds = time.perf_counter() - start
        reader = gguf.GGUFReader(path)
        for t in reader.tensors:
            assert np.isfinite(gguf.quants.dequantize(t.data, t.tensor_type)).all(), t.name
        note = ""
        if quant == "q4_k_m":
            shapes = [(t.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors]
            types = {t.name: t.tensor_type.name for t in reader.tensors}
            assert types == kquant.tensor_types(shapes, quant)
            expected = int(reader.tensors[0].data_offset) + kquant.expected_size(shapes, types)
            note = f"; size vs llama.cpp-expected {path.stat().st_size / expected - 1:+.3%}"
        model = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([blocks[0][0]])).logits[0]
        ppl = evaluate(model, blocks, 4, 0, pad_id).perplexity
        rel = float((logits - ref).norm() / ref.norm())
        top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        how = f"GPTQ on {len(blocks_in)} blocks" if blocks_in else "round to nearest" if quant != "f16" else ""
        print(f"| gguf {quant}{f' ({how})' if how else ''} | {size_mib(path):.0f} MiB | {seconds:.0f} s | logits rel {rel:.2e}, top-1 {top1:.1%}, "
              f"perplexity {ppl:.2f} ({ppl / ref_ppl - 1:+.1%}){note} |", flush=True)
        del model
        path.unlink()


def bench_mlx(folder, out, tokenizer, ref_model):
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    from tunesmith.export import mlx as M

    start = time.perf_counter()
    path = M.export(folder, out / "mlx", "fp32", None, 256)
    seconds = time.perf_counter() - start
    model, _ = mlx_lm.load(str(path))
    same = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        got = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=32)]
        same += got == torch_greedy(ref_model, ids, 32)
    print(f"| mlx fp32 | {size_mib(path):.0f} MiB | {seconds:.0f} s | greedy 32 tokens identical to PyTorch: "
          f"{same}/{len(PROMPTS)} prompts |", flush=True)


def bench_pte(folder, out, tokenizer, ref_model, text_ids, max_seq_len):
    from tunesmith.export.executorch import export
    from tunesmith.pte_runtime import PteModel

    start = time.perf_counter()
    path = export(folder, out / "model.pte", "fp32", 32, max_seq_len)
    seconds = time.perf_counter() - start
    pte = PteModel(path)
    ids = text_ids[:40]
    got = torch.cat([pte.logits(ids[:24], 0)] + [pte.logits([t], 24 + i) for i, t in enumerate(ids[24:])])
    with torch.no_grad():
        want = ref_model(torch.tensor([ids])).logits[0]
    print(f"| pte fp32 | {size_mib(path):.0f} MiB | {seconds:.0f} s | logits over 24-token prefill + 16 steps: max "
          f"abs diff {float((got - want).abs().max()):.1e} (max |logit| {float(want.abs().max()):.1f}) |", flush=True)


def bench_coreml(folder, out, text_ids):
    from tunesmith.export import coreml as C

    start = time.perf_counter()
    package = C.export(folder, out / "coreml", "fp16", 32, 64)
    seconds = time.perf_counter() - start
    step, _ = C.load_step(folder, 64)
    info = C.validate(package, step, "fp16")
    k, v = torch.zeros(step.cache_shape()), torch.zeros(step.cache_shape())
    got = []
    with torch.no_grad():
        for pos, token in enumerate(text_ids[:32]):
            logits, k_new, v_new = step(torch.tensor([[token]], dtype=torch.int32), torch.tensor([pos], dtype=torch.int32),
                                        k, v)
            k[:, :, pos], v[:, :, pos] = k_new[:, :, 0], v_new[:, :, 0]
            got.append(logits[0, 0])
        want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(
            torch.tensor([text_ids[:32]])).logits[0]
    print(f"| coreml fp16 | {size_mib(package):.0f} MiB | {seconds:.0f} s | spec v{info['spec_version']} validates, "
          f"{sum(info['ops'].values())} ops; the converted decode step vs HF over 32 tokens: max abs diff "
          f"{float((torch.stack(got) - want).abs().max()):.1e} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--adapter", default=None, help="a PEFT adapter to merge first (the tuned model)")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--formats", default="gguf,mlx,pte,coreml")
    ap.add_argument("--max-seq-len", type=int, default=64, help="the .pte's static cache")
    ap.add_argument("--out", default=None)
    ap.add_argument("--calibration-blocks", type=int, default=0,
                    help="also q8_0, q4_0 and q4_k_m with GPTQ on this many training blocks (export's default: 64)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="gemma-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(resolve_model(args.model))
    if args.adapter:
        from tunesmith.merge import merge

        folder = Path(merge(args.model, args.adapter, str(out / "merged")))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = load_data("shakespeare", tokenizer, 256)
    blocks = data.valid[: args.blocks]
    calibration = calibration_blocks(data.train, args.calibration_blocks) if args.calibration_blocks else None
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([blocks[0][0]])).logits[0]
    ref_ppl = evaluate(ref_model, blocks, 4, 0, tokenizer.pad_token_id).perplexity
    print(f"model {folder}: PyTorch fp32 perplexity {ref_ppl:.2f} on {len(blocks)} held-out blocks of 256")
    print("| artifact | size | export | check |\n| --- | ---: | ---: | --- |")
    formats = args.formats.split(",")
    if "gguf" in formats:
        bench_gguf(folder, out, blocks, ref, ref_ppl, tokenizer.pad_token_id, calibration)
    if "mlx" in formats:
        bench_mlx(folder, out, tokenizer, ref_model)
    if "pte" in formats:
        bench_pte(folder, out, tokenizer, ref_model, blocks[0][0], args.max_seq_len)
    if "coreml" in formats:
        bench_coreml(folder, out, blocks[0][0])


if __name__ == "__main__":
    main()
