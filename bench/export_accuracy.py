"""Export accuracy: every export format against the PyTorch model it came from. Figures go to docs/EXPORT.md.

    python bench/export_accuracy.py --model runs/demo/merged --blocks 16 --formats gguf
    python bench/export_accuracy.py --model runs/demo/merged --formats gguf --gguf q4_k_m,q4_k_m+gptq,q6_k
    python bench/export_accuracy.py --model gemma3-270m --adapter runs/gemma/adapter --blocks 8 \
        --formats gguf,mlx,pte,coreml --gguf f16,q8_0,q4_k_m --mlx fp32 --coreml fp16 --max-seq-len 64
    python bench/export_accuracy.py --adapter runs/demo/adapter --formats adapter

--adapter merges that PEFT adapter into --model first (the tuned model); `--formats adapter` instead exports the
adapter alone, as GGUF and MLX adapters, each checked against the PEFT model on its base.

GGUF: logits on one held-out block (relative L2 error, KL, top-1) and perplexity on --blocks blocks, read back with
transformers' GGUF loader; each --gguf row rounded to nearest, `type+gptq` by GPTQ on --calibration-blocks
training blocks (export seconds then include GPTQ's). k-quant rows (q4_k_m, q4_k_s, q5_k_m, q6_k) also check that
every tensor's type is llama-quantize's and give the size against llama.cpp's expected size. MLX: greedy tokens from
mlx-lm vs PyTorch, and perplexity (under mlx for fp32/bf16; for 8/4-bit, of the dequantized weights in PyTorch, see
bench_mlx). .pte (fp32, XNNPACK): logits over a 24-token prefill then 16 single-token steps against the eager model.
Core ML: conversion time, size, spec check, and the converted decode-step wrapper against the HF forward
(prediction itself needs macOS). Adapters: the GGUF adapter's tensors against PEFT's (names mapped, q/k B rows in
llama.cpp's rotary order); the MLX adapter on the base's fp32 export, greedy tokens against the PEFT model.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import shutil
import tempfile
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


def kquant_check(path: Path, quant: str) -> str:
    """A k-quant file as llama-quantize would write it: every tensor's type, every tensor finite when dequantized,
    and the size against llama.cpp's expected size (its per-tensor types and ggml's block sizes, plus this file's
    own header)."""
    import gguf

    from tunesmith.export import kquant

    reader = gguf.GGUFReader(path)
    shapes = [(t.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors]
    got = {t.name: t.tensor_type.name for t in reader.tensors}
    assert got == kquant.tensor_types(shapes, quant), "the file's types are not llama-quantize's"
    for t in reader.tensors:
        assert np.isfinite(gguf.quants.dequantize(t.data, t.tensor_type)).all(), t.name
    header = int(reader.tensors[0].data_offset)  # KV metadata + tensor infos + alignment, ours and theirs alike
    expected = header + kquant.expected_size(shapes, got)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(collections.Counter(got.values()).items()))
    return f"; {counts}; size vs llama.cpp-expected {path.stat().st_size / expected - 1:+.3%}"


def bench_gguf(folder, out, blocks, ref_logits, pad_id, rows, calibration, which: str = GGUF_ROWS):
    """One row per GGUF type in `which`; `type+gptq`: calibrated on `calibration`."""
    from tunesmith.export import gguf, kquant

    for row in which.split(","):
        quant, blocks_in = row.removesuffix("+gptq"), calibration if row.endswith("+gptq") else None
        t = time.perf_counter()
        path = gguf.export(folder, out / f"model-{quant}.gguf", quant, 32, 256, calibration=blocks_in,
                           progress=False)
        seconds = time.perf_counter() - t
        model = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([blocks[0][0]])).logits[0].numpy()
        ppl = evaluate(model, blocks, 4, 0, pad_id).perplexity
        note = f"logits rel {rel(logits, ref_logits):.2e}, {agreement(logits, ref_logits)}"
        if quant in kquant.FILE_TYPES:
            note += kquant_check(path, quant)
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


def bench_mlx(folder, out, blocks, tokenizer, ref_model, rows, quants=("fp32", "bf16", "8bit", "4bit")):
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
    for quant in quants:
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


def bench_pte(folder, out, blocks, ref_model, rows, max_seq_len):
    """fp32 .pte (XNNPACK): logits over a 24-token prefill, then 16 single-token steps, against the eager model."""
    from tunesmith.export.executorch import export
    from tunesmith.pte_runtime import PteModel

    t = time.perf_counter()
    path = export(folder, out / "model.pte", "fp32", 32, max_seq_len)
    seconds = time.perf_counter() - t
    pte = PteModel(path)
    ids = blocks[0][0][:40]
    got = torch.cat([pte.logits(ids[:24], 0)] + [pte.logits([t], 24 + i) for i, t in enumerate(ids[24:])])
    with torch.no_grad():
        want = ref_model(torch.tensor([ids])).logits[0]
    note = (f"24-token prefill + 16 steps vs eager: max |dlogit| {float((got - want).abs().max()):.1e} "
            f"(max |logit| {float(want.abs().max()):.1f})")
    emit(rows, ("pte", "fp32", size_mib(path), seconds, note, float("nan")))


def bench_coreml(folder, out, blocks, ref_model, rows, quants=("fp32", "fp16", "int8", "int4"), max_seq_len=256):
    from tunesmith.export import coreml

    step, _ = coreml.load_step(folder, max_seq_len)
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
    for quant in quants:
        t = time.perf_counter()
        package = coreml.export(folder, out / f"coreml-{quant}", quant, 32, max_seq_len)
        seconds = time.perf_counter() - t
        spec = coreml.validate(package, step, quant)
        note = f"spec v{spec['spec_version']}, {sum(spec['ops'].values())} ops; wrapper vs HF max|dlogit| {parity:.1e}"
        emit(rows, ("coreml", quant, size_mib(package), seconds, note, float("nan")))
        shutil.rmtree(package.parent)


def bench_adapter(adapter: Path, base: Path, out: Path, rows) -> None:
    """The adapter alone, as a llama.cpp GGUF adapter and an mlx-lm adapter, each against the PEFT adapter."""
    import gguf
    from safetensors.torch import load_file

    from tunesmith.export import gguf as G

    t = time.perf_counter()
    path = G.export_adapter(adapter, out / "gguf-adapter", base)
    seconds = time.perf_counter() - t
    reader = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in reader.fields.items()}
    config = json.loads((base / "config.json").read_text())
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    peft = load_file(adapter / "adapter_model.safetensors")
    equal = 0
    for key, tensor in peft.items():
        module, ab = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        name = f"{names.get_name(module + '.weight', try_suffixes=('.weight',))}.lora_{ab[0].lower()}"
        found = next(x for x in reader.tensors if x.name == name)
        got = np.array(found.data).reshape(tuple(int(n) for n in reversed(found.shape)))
        want = tensor.float().numpy()
        if ab[0] == "B" and "attn_q" in name:
            want = G._permute(want, config["num_attention_heads"])
        if ab[0] == "B" and "attn_k" in name:
            want = G._permute(want, config["num_key_value_heads"])
        equal += bool((got == want).all())
    note = (f"general.type {kv['general.type']}, adapter.type {kv['adapter.type']}, alpha "
            f"{kv['adapter.lora.alpha']:g}; {equal}/{len(peft)} tensors equal to PEFT's")
    emit(rows, ("gguf adapter", "lora", size_mib(path), seconds, note, float("nan")))

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    from tunesmith.export import mlx as M
    from tunesmith.lora import load_adapter
    from tunesmith.models import load_model

    t = time.perf_counter()
    base_mlx = M.export(base, out / "base-mlx", "fp32", None, 256)
    adapter_mlx = M.export_adapter(adapter, out / "adapter-mlx", model_dir=base)
    seconds = time.perf_counter() - t
    model, _ = mlx_lm.load(str(base_mlx), adapter_path=str(adapter_mlx))
    torch_model, tok = load_model(str(base), "cpu", torch.float32)
    torch_model = load_adapter(torch_model, str(adapter)).eval()
    same = 0
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        got = [int(x) for x, _ in generate_step(mx.array(ids), model, max_tokens=32)]
        same += got == torch_greedy(torch_model, ids, 32)
    note = f"mlx_lm.load(base fp32, adapter_path=...): greedy 32 == the PEFT model: {same}/{len(PROMPTS)}"
    emit(rows, ("mlx adapter", "lora", size_mib(adapter_mlx), seconds, note, float("nan")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a model spec (merged folder, built-in alias); with --adapter, its base")
    ap.add_argument("--adapter", default=None,
                    help="a PEFT adapter: merged into --model first, or with --formats adapter exported alone")
    ap.add_argument("--blocks", type=int, default=16, help="held-out Shakespeare blocks of 256 tokens")
    ap.add_argument("--out", default=None, help="where the exports go (default: a new temporary folder)")
    ap.add_argument("--formats", default="gguf,mlx,coreml", help="of: gguf, mlx, pte, coreml, adapter")
    ap.add_argument("--gguf", default=GGUF_ROWS, help="GGUF rows: types (k-quants too), +gptq for calibrated ones")
    ap.add_argument("--mlx", default="fp32,bf16,8bit,4bit", help="MLX rows")
    ap.add_argument("--coreml", default="fp32,fp16,int8,int4", help="Core ML rows")
    ap.add_argument("--max-seq-len", type=int, default=256, help="the .pte's and Core ML's static cache")
    ap.add_argument("--calibration-blocks", type=int, default=64, help="GGUF +gptq rows: training blocks")
    args = ap.parse_args()
    formats = args.formats.split(",")
    out = Path(args.out or tempfile.mkdtemp(prefix="export-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    rows: list = []
    print("| format | quant | size MiB | export s | check | perplexity |")
    print("|---|---|---:|---:|---|---:|")
    if "adapter" in formats:
        from tunesmith.lora import base_model_for

        if not args.adapter:
            raise SystemExit("--formats adapter needs --adapter")
        base = Path(resolve_model(base_model_for("", args.adapter)))
        bench_adapter(Path(args.adapter), base, out, rows)
        formats.remove("adapter")
        if not formats:
            return
        rows.clear()  # the reference row comes first: the perplexity column is against it
    folder = Path(resolve_model(args.model))
    if args.adapter:
        from tunesmith.merge import merge

        folder = Path(merge(args.model, args.adapter, str(out / "merged")))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = load_data("shakespeare", tokenizer, 256)
    blocks = data.valid[: args.blocks]
    calibration = calibration_blocks(data.train, args.calibration_blocks)
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = ref_model(torch.tensor([blocks[0][0]])).logits[0].numpy()
    print(f"model {folder}, {len(blocks)} held-out blocks of 256 tokens", flush=True)
    ppl = evaluate(ref_model, blocks, 4, 0, tokenizer.pad_token_id).perplexity
    emit(rows, ("pytorch", "fp32", size_mib(folder / "model.safetensors"), 0.0, "reference", ppl))
    if "gguf" in formats:
        bench_gguf(folder, out, blocks, ref_logits, tokenizer.pad_token_id, rows, calibration, args.gguf)
    if "mlx" in formats:
        bench_mlx(folder, out, blocks, tokenizer, ref_model, rows, args.mlx.split(","))
    if "pte" in formats:
        bench_pte(folder, out, blocks, ref_model, rows, args.max_seq_len)
    if "coreml" in formats:
        bench_coreml(folder, out, blocks, ref_model, rows, args.coreml.split(","), args.max_seq_len)

if __name__ == "__main__":
    main()
