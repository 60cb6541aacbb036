"""What the benchmarks share: the model shapes they train, random-weight model folders, the offline environment.

Each script in bench/ runs as `python bench/<script>.py`, and Python puts the script's own folder first on
sys.path, so `from common import ...` finds this module with no path set by hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from importlib import metadata
from pathlib import Path

GIB = 2**30
L1B, L8B, SMOL = "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B", "HuggingFaceTB/SmolLM2-135M-Instruct"
ROPE_THETA = {L1B: 500_000.0, L8B: 500_000.0, SMOL: 100_000.0}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
# Every process runs offline and silent; UNSLOTH_DISABLE_STATISTICS stops Unsloth's environment ping at load.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "UNSLOTH_DISABLE_STATISTICS": "1",
               "TOKENIZERS_PARALLELISM": "false"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One training setting a benchmark runs: a model shape, the sequence and micro-batch, the LoRA."""

    name: str
    shape: str  # a tunesmith.memory.KNOWN_CONFIGS id (random weights), "tiny", or "real:<built-in alias>"
    seq: int
    batch: int
    rank: int
    alpha: float
    targets: tuple[str, ...]  # ("all-linear",) or module names
    base: str = "bf16"  # the frozen base: bf16, or nf4 (tunesmith's --quantize-base nf4, Unsloth's load_in_4bit)
    checkpointing: bool | str = False  # every tool checkpoints: tunesmith's gradient_checkpointing (True, "offload"),
    # Unsloth's "unsloth" (offloaded), the Trainer's own


def model_folder(row: Row, device: str, workdir: Path) -> Path:
    """The model folder a row trains: the built-in's (converted once), or random weights of a real shape."""
    if row.shape.startswith("real:"):
        from tunesmith.models import resolve_model

        return Path(resolve_model(row.shape[5:], progress=False))
    return random_model(row.shape, device, workdir)


def random_model(shape: str, device: str, workdir: Path) -> Path:
    """Random bf16 weights (torch.manual_seed(0)) of a KNOWN_CONFIGS shape or "tiny", saved once under `workdir`
    with toy_tokenizer's tokenizer: nothing is downloaded."""
    folder = workdir / "models" / shape.split("/")[-1]
    if (folder / "config.json").is_file():
        return folder
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunesmith.memory import KNOWN_CONFIGS

    config = TINY if shape == "tiny" else {**KNOWN_CONFIGS[shape], "rope_theta": ROPE_THETA[shape]}
    config = LlamaConfig(**config, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda" if device == "cuda" else "cpu"):  # an 8B initialises in seconds on the GPU
        model = LlamaForCausalLM(config)
    partial = folder.with_name(folder.name + ".partial")  # renamed once complete: a killed run leaves none
    shutil.rmtree(partial, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(partial)
    toy_tokenizer().save_pretrained(partial)
    partial.rename(folder)
    return folder


def toy_tokenizer():
    """A word-level tokenizer made in code (one token per printable ASCII character), so that loaders that insist
    on one (Unsloth) find it offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [chr(c) for c in range(33, 127)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def versions(*packages: str) -> dict:
    """Python's version and each installed package's."""
    out = {"python": sys.version.split()[0]}
    for pkg in packages:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out
