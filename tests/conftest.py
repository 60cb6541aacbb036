"""Shared fixtures: a tiny in-process Llama (2 layers, hidden 64) with a tiny byte-level BPE tokenizer."""

from __future__ import annotations

import os

# Before torch loads OpenMP (it reads this once): idle OpenMP threads sleep instead of spinning. With spinning
# threads, a busy 2-core machine runs a 135M forward 10x slower on 2 threads than on 1 (each parallel region waits
# for a thread that another process has descheduled); sleeping, 2 threads stay as fast as 1 or faster. Child
# processes (the resume zygote, the signal test's CLI) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# `--precision auto` trains in bf16 on a CPU whose bf16 products are clearly faster (measured per machine); the tests'
# tolerances are fp32's, so they train in fp32 wherever they run (test_device.py tests the choice itself).
os.environ.setdefault("TUNESMITH_CPU_TRAIN_PRECISION", "fp32")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = (
    "ROMEO:\nBut soft, what light through yonder window breaks?\n\n"
    "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?\n\n"
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
) * 20


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Each test gets its own tunesmith cache unless it asks for the real one (the slow tests)."""
    if "TUNESMITH_TEST_REAL_CACHE" not in os.environ:
        monkeypatch.setenv("TUNESMITH_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS, "Speaker: the quick brown fox jumps over the lazy dog. 0123456789"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    fast.chat_template = CHATML
    return fast


def make_model(tokenizer, seed: int = 0, layers: int = 2, hidden: int = 64, **config_overrides):
    """A tiny random Llama for `tokenizer`; `config_overrides` go to LlamaConfig (tie_word_embeddings, rope_theta...)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(LlamaConfig(**{**settings, **config_overrides})).eval()


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    return make_model(tokenizer)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny model saved as a plain HF folder (safetensors + config + tokenizer)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_model(tokenizer).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def text_file(tmp_path) -> Path:
    p = tmp_path / "corpus.txt"
    p.write_text(CORPUS, encoding="utf-8")
    return p


def tiny_train_config(tmp_path, tiny_dir, data, **kw):
    from tunesmith.config import TrainConfig

    base = dict(model=str(tiny_dir), data=str(data), output=str(tmp_path / "run"), device="cpu", seq_len=32,
                batch_size=2, max_steps=5, lr=1e-2, warmup_steps=1, eval_every=0, seed=0)
    base.update(kw)
    return TrainConfig(**base)
