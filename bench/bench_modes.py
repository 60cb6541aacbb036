"""The training modes side by side: LoRA, QLoRA (nf4 / int4 / int8 base), DoRA and full fine-tuning.

    python bench/bench_modes.py quality [--device cpu] [--steps 60] [--modes lora,qlora-nf4,dora,full]
    python bench/bench_modes.py quality --modes lora,qlora-nf4 --base-calibration 64 [--targets all-linear] [--lr 2e-3]
    python bench/bench_modes.py quality --precision bf16 --modes lora,qlora-fp8 --fp8-products
    python bench/bench_modes.py memory --device cuda --shape meta-llama/Llama-3.1-8B [--modes qlora-nf4,lora]

quality: the demo's data and settings (the built-in SmolLM2-135M and Shakespeare, seq 256, micro-batch 4, LoRA r8
alpha 16 on q_proj,v_proj, dropout 0.05, warm-up 5) for the same number of steps in every mode, then the held-out
perplexity on the demo's 8 batches. Full fine-tuning takes its own learning rate (--full-lr): the whole weight
moves, not a low-rank update of it, so the LoRA rate would wreck it.

memory: random weights of a known shape written as a safetensors folder (once, tensor by tensor), then trained
as a user trains it (`train --model <folder>`: a quantized base is read and quantized tensor by tensor) at seq 2048,
micro-batch 1, LoRA r16 on all linears, gradient checkpointing, bf16; each mode in its own process. Reported:
the allocator's peak over the whole process (loading included), the peak while training, the planner's
prediction (fit.json) and tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30
MODES = {  # name -> TrainConfig changes
    "lora": {},
    "qlora-nf4": {"quantize_base": "nf4"},
    "qlora-int4": {"quantize_base": "int4"},
    "qlora-int8": {"quantize_base": "int8"},
    "qlora-fp8": {"quantize_base": "fp8"},
    "dora": {"fine_tune_type": "dora"},
    "full": {"fine_tune_type": "full"},
    "full-8bit": {"fine_tune_type": "full", "optimizer": "adamw8bit"},
}


def quality(args) -> None:
    import tunesmith.qlora
    from tunesmith.config import DemoConfig, TrainConfig, fields_of
    from tunesmith.data import load_data
    from tunesmith.device import resolve_device
    from tunesmith.evaluate import evaluate
    from tunesmith.models import load_model
    from tunesmith.train import train

    demo = DemoConfig()
    device = resolve_device(args.device)
    if args.fp8_products:  # the fp8 products a capable GPU runs, here on this device (torch._scaled_mm runs on the CPU)
        tunesmith.qlora.fp8_products = lambda _device: True
    rows = []
    for mode in args.modes.split(","):
        changes = dict(MODES[mode])
        lr = args.full_lr if changes.get("fine_tune_type") == "full" else args.lr or demo.lr
        if args.targets:
            changes["lora_targets"] = args.targets.split(",")
        scheme = changes.get("quantize_base", "none")
        if args.base_calibration and scheme != "none":  # GPTQ-chosen codes (--base-calibration), before "before"
            model, tok = load_model(demo.model, device)
            data = load_data(demo.data, tok, demo.seq_len, demo.val_fraction)
            t = time.perf_counter()
            tunesmith.qlora.calibrate_base(model, scheme, [list(ids) for ids, _ in data.train[: args.base_calibration]],
                                           progress=False)
            print(f"calibrated the {scheme} base on {args.base_calibration} blocks in {time.perf_counter() - t:.0f} s",
                  flush=True)
            changes["base_calibration"] = args.base_calibration
        else:
            model, tok = load_model(demo.model, device, quantize_base=scheme)
        data = load_data(demo.data, tok, demo.seq_len, demo.val_fraction)
        before = evaluate(model, data.valid, demo.batch_size, demo.eval_batches, tok.pad_token_id).perplexity
        cfg = TrainConfig(**{f.name: getattr(demo, f.name) for f in fields_of(TrainConfig)})
        cfg = dataclasses.replace(cfg, output=f"{args.out}/{mode}", max_steps=args.steps, time_budget=0.0,
                                  eval_every=0, device=str(device), precision=args.precision,
                                  checkpoint_every=0, lr=lr, **changes)
        t = time.perf_counter()
        # quantize_base on an injected model quantizes in place: already done by load_model here, so a no-op
        r = train(cfg, model=model, tokenizer=tok, data=data, progress=False)
        after = r.evals[-1][1].perplexity
        row = {"mode": mode, "base_calibration": changes.get("base_calibration", 0),
               "targets": cfg.lora_targets, "lr": lr, "steps": r.steps, "ppl_before": before, "ppl_after": after,
               "drop": 1 - after / before, "trainable": r.trainable_params, "seconds": time.perf_counter() - t,
               "tokens_per_s": r.tokens / r.seconds, "peak_bytes": r.peak_memory_bytes, "losses": r.losses}
        rows.append(row)
        print(f"| {mode} | {','.join(cfg.lora_targets)} | {lr:g} | {r.steps} | {before:.2f} | {after:.2f} ({row['drop']:.1%}) | "
              f"{r.trainable_params:,} | {row['tokens_per_s']:.0f} |", flush=True)
        _append(args.json, row)
        del model, r
    ref = next((r["ppl_after"] for r in rows if r["mode"] == "lora"), None)
    if ref:
        for r in rows:
            print(f"{r['mode']}: held-out perplexity {r['ppl_after']:.2f}, {r['ppl_after'] / ref - 1:+.1%} against LoRA")


# --------------------------------------------------------------------------------------------------- memory


def write_random_folder(shape: str, folder: Path, device: str) -> Path:
    """Random bf16 weights of a known shape as a safetensors folder (one shard per decoder layer), with a
    word-level tokenizer; made tensor by tensor, so writing it never holds the model."""
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    from tunesmith.memory import KNOWN_CONFIGS

    if (folder / "done").is_file():
        return _write_index(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**KNOWN_CONFIGS[shape])
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    g = torch.Generator(device=device).manual_seed(0)
    current = None
    for name, p in model.named_parameters():  # in order: a layer's tensors come together
        parts = name.split(".")
        shard = f"layer-{int(parts[2]):03d}" if parts[1:2] == ["layers"] else "rest"
        if current not in (None, shard, "rest") and current in shards:  # the previous layer is complete
            save_file(shards.pop(current), str(folder / f"{current}.safetensors"), metadata={"format": "pt"})
        current = shard
        t = (torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        shards.setdefault(shard, {})[name] = t.cpu()
    for shard, tensors in shards.items():
        save_file(tensors, str(folder / f"{shard}.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                  unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    tok.save_pretrained(folder)
    (folder / "done").write_text("")
    return _write_index(folder)


def _write_index(folder: Path) -> Path:
    """The shard index transformers reads a sharded folder by."""
    from safetensors import safe_open

    index = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            index.update({key: file.name for key in f.keys()})  # noqa: SIM118
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return folder


def memory_case(args, mode: str) -> dict:
    import torch

    from tunesmith.config import TrainConfig
    from tunesmith.data import TokenData
    from tunesmith.memory import KNOWN_CONFIGS
    from tunesmith.train import train

    folder = Path(args.workdir) / args.shape.replace("/", "--")
    vocab = KNOWN_CONFIGS[args.shape]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, vocab, (args.seq,), generator=g).tolist() for _ in range(args.batch * args.steps)]
    data = TokenData(train=[(r, r) for r in rows], valid=[], source="random")
    out = tempfile.mkdtemp(prefix=f"bench-modes-{mode}-")
    cfg = TrainConfig(model=str(folder), device=args.device, precision="bf16", seq_len=args.seq,
                      batch_size=args.batch, max_steps=args.steps, warmup_steps=1, eval_every=0, lora_rank=16,
                      lora_alpha=32, lora_targets=["all-linear"], lora_dropout=0.0, gradient_checkpointing=True,
                      output=out, checkpoint_every=0, **MODES[mode])
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    steps_at: list[float] = []
    r = train(cfg, data=data, progress=False, callback=lambda rec: steps_at.append(time.perf_counter()))
    fit = json.loads((Path(out) / "fit.json").read_text())
    timed = steps_at[-1] - steps_at[1] if len(steps_at) > 2 else float("nan")
    return {"mode": mode, "shape": args.shape, "seq": args.seq, "batch": args.batch, "steps": r.steps,
            "peak_whole_process": torch.cuda.max_memory_allocated(), "predicted": fit["predicted_peak_bytes"],
            "parts": fit["parts"], "ratio": fit["predicted_peak_bytes"] / torch.cuda.max_memory_allocated(),
            "tokens_per_s": args.seq * args.batch * (len(steps_at) - 2) / timed, "losses": r.losses,
            "seconds": time.perf_counter() - t0}


def memory(args) -> None:
    folder = write_random_folder(args.shape, Path(args.workdir) / args.shape.replace("/", "--"), args.device)
    print(f"random {args.shape} weights in {folder}", flush=True)
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "one", "--mode", mode, *sys.argv[2:]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            print(f"{mode}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        _append(args.json, row)
        print(f"| {mode} | {row['peak_whole_process'] / GIB:.2f} | {row['predicted'] / GIB:.2f} | "
              f"{row['ratio']:.3f} | {row['tokens_per_s']:.0f} |", flush=True)


def _append(path: str | None, row: dict) -> None:
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["quality", "memory", "one"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="lora,qlora-nf4,dora,full")
    ap.add_argument("--mode", default="")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--full-lr", type=float, default=1e-4)
    ap.add_argument("--lr", type=float, default=0.0, help="quality: the adapters' learning rate (default: the demo's)")
    ap.add_argument("--targets", default="", help="quality: LoRA targets (default: the demo's q_proj,v_proj)")
    ap.add_argument("--base-calibration", type=int, default=0,
                    help="quality: a quantized base's codes chosen by GPTQ on this many training blocks (train's flag)")
    ap.add_argument("--precision", default="fp32", help="quality: the training precision (the demo's: fp32)")
    ap.add_argument("--fp8-products", action="store_true",
                    help="quality: qlora-fp8 takes the fp8 products (torch._scaled_mm) on this device too (bf16)")
    ap.add_argument("--shape", default="meta-llama/Llama-3.1-8B")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--workdir", default="/tmp/bench-modes")
    ap.add_argument("--out", default="/tmp/bench-modes/runs")
    ap.add_argument("--json", default=None, help="append each row to this .jsonl file")
    args = ap.parse_args()
    if args.what == "quality":
        quality(args)
    elif args.what == "memory":
        memory(args)
    else:
        print(json.dumps(memory_case(args, args.mode)))


if __name__ == "__main__":
    main()
