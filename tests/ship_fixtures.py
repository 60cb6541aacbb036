"""Shared by the ship tests (quantize, export, compare): a tiny Llama trained for a moment on the test corpus.

A random model's perplexity sits near the vocabulary size whatever its weights do, so "quantized is close to float"
would prove little; a few hundred full-weight steps give the weights structure and the held-out text a low
perplexity that quantization error visibly moves.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import CORPUS, make_model


def corpus_blocks(tokenizer, seq_len: int = 32) -> list[list[int]]:
    ids = tokenizer(CORPUS, add_special_tokens=False)["input_ids"]
    return [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def train_tiny(tokenizer, steps: int = 150, seed: int = 0, tie: bool = False):
    """The conftest tiny Llama (optionally with tied embeddings), fitted to CORPUS with AdamW."""
    model = make_model(tokenizer, seed=seed)
    if tie:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    blocks = torch.tensor(corpus_blocks(tokenizer))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        batch = blocks[torch.randint(len(blocks), (8,), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval().requires_grad_(False)


def save(model, tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_adapter(model, path: Path, seed: int = 1) -> Path:
    """A PEFT adapter on q_proj / v_proj with non-zero B (fresh LoRA is a no-op), saved as safetensors."""
    import copy

    from tunesmith.lora import attach_lora

    peft = attach_lora(copy.deepcopy(model), rank=4, alpha=8.0, dropout=0.0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft.save_pretrained(path)
    return path
