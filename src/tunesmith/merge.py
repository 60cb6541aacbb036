"""Base model + LoRA adapter -> one standard HF folder that loads with plain transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tunesmith.errors import TunesmithError
from tunesmith.lora import load_with_adapter, merge_adapter
from tunesmith.storage import atomic_folder

SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def merge_model(peft_model, tokenizer, output: str | Path, dtype: str = "float32", provenance: dict | None = None) -> Path:
    """Fold the adapter into the base weights and save the result atomically, with the modes the umask gives.

    safe_merge checks every merged weight for NaN / inf (a diverged adapter) before it replaces the base's. An
    adapter trained on a quantized base (QLoRA) merges onto that base dequantized: the weights it trained against."""
    if dtype not in SAVE_DTYPES:
        raise TunesmithError(f"--dtype must be one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
    out = Path(output)
    if out.exists() and any(out.iterdir()) and not (out / "tunesmith-merge.json").is_file():
        raise TunesmithError(f"{out} exists and is not a tunesmith merge folder; choose an empty --output")
    try:  # a fully fine-tuned model (no adapter) has nothing to merge: it is saved as it is
        merged = peft_model if not hasattr(peft_model, "peft_config") else merge_adapter(peft_model, safe_merge=True)
        merged = merged.to(SAVE_DTYPES[dtype])
    except ValueError as e:
        if "NaN" not in str(e):
            raise
        raise TunesmithError("cannot merge: the adapter makes the merged weights non-finite (NaN or inf), so it is "
                             "broken; merge the adapter of an earlier checkpoint instead") from None
    with atomic_folder(out) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "tunesmith-merge.json").write_text(json.dumps(provenance or {}, indent=2))
    return out


def merge(model: str, adapter: str, output: str, dtype: str = "float32", trust_remote_code: bool = False) -> Path:
    """Load `model` on the CPU in fp32, apply `adapter`, merge, and save to `output`.

    An empty `model` is the one the adapter was trained on."""
    if not output:
        raise TunesmithError("merge needs --output, the folder for the merged model")
    if not adapter:
        raise TunesmithError("merge needs --adapter, the adapter folder to merge")
    peft_model, tokenizer, spec = load_with_adapter(model, adapter, "cpu", torch.float32, trust_remote_code)
    return merge_model(peft_model, tokenizer, output, dtype, {"base_model": spec, "adapter": str(adapter)})
