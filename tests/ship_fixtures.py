"""Shared by the ship tests (quantize, export, compare): a tiny Llama trained for a moment on the test corpus.

A random model's perplexity sits near the vocabulary size whatever its weights do, so "quantized is close to float"
would prove little; a few hundred full-weight steps give the weights structure and the held-out text a low
perplexity that quantization error visibly moves.
"""

from __future__ import annotations

import json
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


def make_spm_tokenizer():
    """A tiny tokenizer shaped like Gemma's: SentencePiece BPE (spaces as ▁, byte fallback, <0x00>..<0xFF> pieces),
    <pad> <eos> <bos> <unk> at ids 0-3, a BOS added in front, trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import CORPUS

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials, show_progress=False)
    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.normalizer = normalizers.Replace(" ", "\u2581")
    draft.train_from_iterator([CORPUS], trainer)
    learned = sorted(draft.get_vocab().items(), key=lambda kv: kv[1])
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in learned if p not in specials]
    merges = json.loads(draft.to_str())["model"]["merges"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [tuple(m) if isinstance(m, list) else
                                                                      tuple(m.split(" ")) for m in merges],
                               unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(specials)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>")


def make_gemma3(tokenizer, layers: int = 6, hidden: int = 64, seed: int = 0):
    """A tiny random Gemma 3 text model: five sliding-window layers then a global one (rope bases 10000 and 1e6),
    one KV head of 256 (transformers' GGUF reader assumes query_pre_attn_scalar 256), q/k norms, tied embeddings, as
    Gemma 3 270M is shaped."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=64,
        max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # Gemma's norms scale by 1 + w and start at w = 0: give them something to carry over
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    return model


SYSTEM = "You are Captain Ahab. Answer in one line."


def chat_run(folder: Path, tiny_dir: Path, systems: list[str | None]) -> Path:
    """A run folder as `tunesmith train` leaves it (config.yaml, adapter/), trained two steps on chat records, one
    per entry of `systems`: the record's system prompt (None: a record without one)."""
    from tests.conftest import tiny_train_config
    from tunesmith.train import train

    data = folder.parent / f"{folder.name}-chats.jsonl"
    lines = []
    for i, system in enumerate(systems):
        turns = [{"role": "user", "content": f"ROMEO: wherefore {i}?"},
                 {"role": "assistant", "content": "But soft, what light through yonder window breaks."}]
        lines.append(json.dumps({"messages": ([{"role": "system", "content": system}] if system else []) + turns}))
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    train(tiny_train_config(folder.parent, tiny_dir, data, output=str(folder), max_steps=2, val_fraction=0.0,
                            seq_len=128))
    return folder
