"""Export accuracy: GGUF / MLX / Core ML artifacts against the PyTorch model they came from. Figures go to docs/EXPORT.md.

    python bench/export_accuracy.py --model runs/demo/merged --blocks 16 --out /tmp/export-bench

GGUF: logits on one held-out block (relative L2 error) and perplexity on --blocks blocks, read back with transformers'
GGUF loader; q8_0 / q4_0 / q4_0_mixed both rounded to nearest and by GPTQ on --calibration-blocks training blocks
(export seconds then include GPTQ's). MLX: greedy tokens from mlx-lm vs PyTorch, and perplexity (under mlx for
fp32/bf16; for 8/4-bit, of the dequantized weights in PyTorch, see bench_mlx). Core ML: conversion time, size, spec check, and the converted
decode-step wrapper against the HF forward (prediction itself needs macOS).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunesmith.data import load_data
from tunesmith.evaluate import evaluate
from tunesmith.models import resolve_model
from tunesmith.quantize import calibration_blocks

PROMPTS = ("ROMEO:\n", "JULIET:\nO Romeo", "First Citizen:\nBefore we proceed")


def size_mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def agreement(logits: np.ndarray, ref: np.ndarray) -> str:
    """KL(ref || got) per token (as llama-perplexity --kl-divergence reports it) and top-1 agreement."""
    lp, lq = torch.log_softmax(torch.from_numpy(ref), -1), torch.log_softmax(torch.from_numpy(logits), -1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    top1 = float((lp.argmax(-1) == lq.argmax(-1)).float().mean())
    return f"KL {kl:.1e}, top-1 {top1:.1%}"


def torch_greedy(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def emit(rows: list, row: tuple) -> None:
    """Print a table row as soon as it is measured (a long run still leaves its figures)."""
    rows.append(row)
    fmt, quant, mib, seconds, note, ppl = row
    shown = "—" if math.isnan(ppl) else f"{ppl:.2f} ({(ppl / rows[0][5] - 1) * 100:+.1f}%)"
    print(f"| {fmt} | {quant} | {mib:.0f} | {seconds:.1f} | {note} | {shown} |", flush=True)


GGUF_ROWS = "f16,q8_0,q4_1,q4_0,q4_0_mixed,q8_0+gptq,q4_0+gptq,q4_0_mixed+gptq"


def bench_gguf(folder, out, blocks, ref_logits, pad_id, rows, calibration, which: str = GGUF_ROWS):
    """One row per GGUF type in `which`; `type+gptq`: calibrated on `calibration`."""
    from tunesmith.export import gguf

    for row in which.split(","):
        quant, blocks_in = row.removesuffix("+gptq"), calibration if row.endswith("+gptq") else None
        t = time.perf_counter()
        path = gguf.export(folder, out / f"model-{quant}.gguf", quant, 32, 256, calibration=blocks_in)
        seconds = time.perf_counter() - t
        model = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([blocks[0][0]])).logits[0].numpy()
        ppl = evaluate(model, blocks, 4, 0, pad_id).perplexity
        note = f"logits rel {rel(logits, ref_logits):.2e}, {agreement(logits, ref_logits)}"
        label = f"{quant} GPTQ {len(blocks_in)}" if blocks_in else quant
        emit(rows, ("gguf", label, size_mib(path), seconds, note, ppl))
        path.unlink()


def dequantized_torch_model(folder: Path, mlx_dir: Path):
    """The HF model with the MLX export's weights, dequantized to fp32 (what 4/8-bit costs, evaluated in PyTorch)."""
    import mlx.core as mx

    weights = mx.load(str(mlx_dir / "model.safetensors"))
    q = json.loads((mlx_dir / "config.json").read_text())["quantization"]
    state = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        if w.dtype == mx.uint32:
            base = name[: -len(".weight")]
            w = mx.dequantize(
                w, weights[base + ".scales"], weights[base + ".biases"], q["group_size"], q["bits"]
            )
        state[name] = torch.from_numpy(np.array(w.astype(mx.float32)))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    model.tie_weights()
    return model.eval()


def bench_mlx(folder, out, blocks, tokenizer, ref_model, rows):
    """Greedy tokens under mlx for every quant; perplexity under mlx for fp32/bf16. mlx's CPU build has no fast
    quantized matmul (about 1.5 s per token for 135M at 4 bits on this machine), so 8/4-bit perplexity is measured
    on the dequantized weights in PyTorch instead, and greedy decoding uses one prompt."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from tunesmith.export import mlx as M

    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    want = {"fp32": [torch_greedy(ref_model, p, 32) for p in prompts]}
    bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    want["bf16"] = [torch_greedy(bf16, p, 32) for p in prompts]
    del bf16
    for quant in ("fp32", "bf16", "8bit", "4bit"):
        t = time.perf_counter()
        path = M.export(folder, out / f"mlx-{quant}", quant, None, 256)
        seconds = time.perf_counter() - t
        model, _ = load(str(path))
        used = prompts if quant in ("fp32", "bf16") else prompts[:1]
        got = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=32)] for p in used]
        same = sum(g == w for g, w in zip(got, want["fp32"], strict=False))
        note = f"greedy 32 == torch fp32: {same}/{len(used)}"
        if quant == "bf16":
            note += (
                f", == torch bf16: {sum(g == w for g, w in zip(got, want['bf16'], strict=True))}/{len(used)}"
            )
        if quant in ("fp32", "bf16"):
            nll, count = 0.0, 0
            for ids, _ in blocks:
                logits = model(mx.array([ids])).astype(mx.float32)
                nll += float(nn.losses.cross_entropy(logits[0, :-1], mx.array(ids[1:]), reduction="sum"))
                count += len(ids) - 1
            ppl = math.exp(nll / count)
        else:
            note += "; perplexity of the dequantized weights in PyTorch"
            ppl = evaluate(
                dequantized_torch_model(folder, path), blocks, 4, 0, tokenizer.pad_token_id
            ).perplexity
        emit(rows, ("mlx", quant, size_mib(path), seconds, note, ppl))
        shutil.rmtree(path)


def bench_coreml(folder, out, blocks, ref_model, rows):
    from tunesmith.export import coreml

    step, _ = coreml.load_step(folder, 256)
    ids = blocks[0][0][:32]
    k, v = torch.zeros(step.cache_shape()), torch.zeros(step.cache_shape())
    stepped = []
    with torch.no_grad():
        for pos, token in enumerate(ids):
            logits, k_new, v_new = step(
                torch.tensor([[token]], dtype=torch.int32), torch.tensor([pos], dtype=torch.int32), k, v
            )
            k[:, :, pos], v[:, :, pos] = k_new[:, :, 0], v_new[:, :, 0]
            stepped.append(logits[0, 0].numpy())
        full = ref_model(torch.tensor([ids])).logits[0].numpy()
    parity = float(np.abs(np.stack(stepped) - full).max())
    for quant in ("fp32", "fp16", "int8", "int4"):
        t = time.perf_counter()
        package = coreml.export(folder, out / f"coreml-{quant}", quant, 32, 256)
        seconds = time.perf_counter() - t
        spec = coreml.validate(package, step, quant)
        note = f"spec v{spec['spec_version']}, {sum(spec['ops'].values())} ops; wrapper vs HF max|dlogit| {parity:.1e}"
        emit(rows, ("coreml", quant, size_mib(package), seconds, note, float("nan")))
        shutil.rmtree(package.parent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--blocks", type=int, default=16, help="held-out Shakespeare blocks of 256 tokens")
    ap.add_argument("--out", default="/tmp/export-bench")
    ap.add_argument("--formats", default="gguf,mlx,coreml")
    ap.add_argument("--gguf", default=GGUF_ROWS, help="GGUF rows: types, +gptq for calibrated ones")
    ap.add_argument("--calibration-blocks", type=int, default=64, help="GGUF +gptq rows: training blocks")
    args = ap.parse_args()
    folder = Path(resolve_model(args.model))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = load_data("shakespeare", tokenizer, 256)
    blocks = data.valid[: args.blocks]
    calibration = calibration_blocks(data.train, args.calibration_blocks)
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = ref_model(torch.tensor([blocks[0][0]])).logits[0].numpy()
    print(f"model {folder}, {len(blocks)} held-out blocks of 256 tokens\n")
    print("| format | quant | size MiB | export s | check | perplexity |")
    print("|---|---|---:|---:|---|---:|")
    rows: list = []
    ppl = evaluate(ref_model, blocks, 4, 0, tokenizer.pad_token_id).perplexity
    emit(rows, ("pytorch", "fp32", size_mib(folder / "model.safetensors"), 0.0, "reference", ppl))
    formats = args.formats.split(",")
    if "gguf" in formats:
        bench_gguf(folder, out, blocks, ref_logits, tokenizer.pad_token_id, rows, calibration, args.gguf)
    if "mlx" in formats:
        bench_mlx(folder, out, blocks, tokenizer, ref_model, rows)
    if "coreml" in formats:
        bench_coreml(folder, out, blocks, ref_model, rows)


if __name__ == "__main__":
    main()
