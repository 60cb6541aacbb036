"""Adapter-only exports of a real PEFT adapter, each against the PEFT model in PyTorch. Figures go to docs/EXPORT.md.

    python bench/adapter_exports.py --adapter /tmp/kq/run/adapter --out /tmp/adapter-bench

MLX: the base model exported fp32 plus the adapter in mlx-lm's format, loaded with
`mlx_lm.load(base, adapter_path=...)`: greedy 32 tokens from three prompts against the PEFT model's greedy tokens.
GGUF: the llama.cpp LoRA adapter read back with the gguf package, every tensor against the PEFT tensor it came from
(attn_q / attn_k B rows in llama.cpp's rotary order), and its size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from tunesmith.lora import base_model_for, load_adapter
from tunesmith.models import load_model, resolve_model

PROMPTS = ("ROMEO:\n", "JULIET:\nO Romeo", "First Citizen:\nBefore we proceed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="adapter-bench-"))
    base = Path(resolve_model(base_model_for("", args.adapter)))

    from tunesmith.export import gguf as G

    path = G.export_adapter(Path(args.adapter), out / "gguf", base)
    reader = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in reader.fields.items()}
    config = json.loads((base / "config.json").read_text())
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    peft = load_file(Path(args.adapter) / "adapter_model.safetensors")
    equal = 0
    for key, tensor in peft.items():
        module, ab = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        name = f"{names.get_name(module + '.weight', try_suffixes=('.weight',))}.lora_{ab[0].lower()}"
        t = next(t for t in reader.tensors if t.name == name)
        got = np.array(t.data).reshape(tuple(int(n) for n in reversed(t.shape)))
        want = tensor.float().numpy()
        if ab[0] == "B" and "attn_q" in name:
            want = G._permute(want, config["num_attention_heads"])
        if ab[0] == "B" and "attn_k" in name:
            want = G._permute(want, config["num_key_value_heads"])
        equal += bool((got == want).all())
    print(f"| gguf adapter | {path.stat().st_size / 2**20:.2f} MiB | general.type {kv['general.type']}, adapter.type "
          f"{kv['adapter.type']}, alpha {kv['adapter.lora.alpha']:g} | {equal}/{len(peft)} tensors equal to PEFT's |")

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    from tunesmith.export import mlx as M

    base_mlx = M.export(base, out / "base-mlx", "fp32", None, 256)
    adapter_mlx = M.export_adapter(Path(args.adapter), out / "adapter-mlx", model_dir=base)
    model, tokenizer = mlx_lm.load(str(base_mlx), adapter_path=str(adapter_mlx))
    torch_model, tok = load_model(str(base), "cpu", torch.float32)
    torch_model = load_adapter(torch_model, args.adapter).eval()
    same = 0
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        got = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=32)]
        seq = list(ids)
        with torch.no_grad():
            for _ in range(32):
                seq.append(int(torch_model(torch.tensor([seq])).logits[0, -1].argmax()))
        same += got == seq[len(ids):]
    size = sum(f.stat().st_size for f in adapter_mlx.iterdir()) / 2**20
    print(f"| mlx adapter | {size:.2f} MiB | mlx_lm.load(base fp32, adapter_path=...) | greedy 32 tokens identical to "
          f"the PEFT model: {same}/{len(PROMPTS)} prompts |")


if __name__ == "__main__":
    main()
