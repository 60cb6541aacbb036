"""Greedy and sampled generation with a KV cache, streamed token by token."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tunesmith.device import peak_memory_bytes
from tunesmith.errors import TunesmithError


@dataclass
class GenerationResponse:
    """One streamed step: the new text, the token, and running figures."""

    text: str  # text added by this token (may be empty while a multi-byte character is incomplete)
    token: int
    generated_tokens: int
    prompt_tokens: int
    prompt_tps: float  # prompt tokens per second (prefill)
    generation_tps: float  # generated tokens per second (decode)
    peak_memory_bytes: int
    finish_reason: str | None = None  # "stop" (end-of-sequence) or "length" on the last response


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise TunesmithError("--chat needs a tokenizer with a chat template; this model has none")
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True, return_dict=False
        )
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Greedy when temperature is 0, else temperature + nucleus sampling (drawn on the CPU for repeatability)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def stream_generate(
    model: torch.nn.Module,
    tokenizer,
    prompt: str,
    max_tokens: int = 100,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    chat: bool = False,
) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per generated token."""
    if max_tokens < 1:
        raise TunesmithError(f"--max-tokens must be >= 1, got {max_tokens}")
    if not 0.0 < top_p <= 1.0:
        raise TunesmithError(f"--top-p must be in (0, 1], got {top_p}")
    model.eval()
    device = next(model.parameters()).device
    ids = encode_prompt(tokenizer, prompt, chat)
    if not ids:
        raise TunesmithError("the prompt is empty")
    stop = _stop_ids(tokenizer, model)
    generator = torch.Generator().manual_seed(seed)
    from transformers import DynamicCache

    cache = DynamicCache()
    start = time.perf_counter()
    out = model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True)
    prefill_s = time.perf_counter() - start
    generated: list[int] = []
    text_so_far = ""
    decode_start = time.perf_counter()
    for n in range(1, max_tokens + 1):
        token = sample_next(out.logits[0, -1], temperature, top_p, generator)
        generated.append(token)
        finished = token in stop
        reason = "stop" if finished else ("length" if n == max_tokens else None)
        text = tokenizer.decode(generated[:-1] if finished else generated, skip_special_tokens=True)
        # Hold back a trailing partial character (U+FFFD) until its next bytes arrive, except at the end.
        if reason or not text.endswith("\ufffd"):
            delta, text_so_far = text[len(text_so_far) :], text
        else:
            delta = ""
        yield GenerationResponse(
            text=delta,
            token=token,
            generated_tokens=n,
            prompt_tokens=len(ids),
            prompt_tps=len(ids) / max(prefill_s, 1e-9),
            generation_tps=n / max(time.perf_counter() - decode_start, 1e-9),
            peak_memory_bytes=peak_memory_bytes(device),
            finish_reason=reason,
        )
        if reason:
            return
        out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)


def generate(model, tokenizer, prompt: str, **kwargs) -> str:
    """The whole generated text (no streaming)."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))


def _stop_ids(tokenizer, model) -> set[int]:
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(source)
    return ids


def generate_from_config(cfg, write=None) -> list[GenerationResponse]:
    """The `generate` verb: load the model (+ adapter), stream the text to `write`, return the responses."""
    import sys

    from tunesmith.device import resolve_device, resolve_precision, weight_dtype
    from tunesmith.lora import base_model_for, load_adapter
    from tunesmith.models import load_model

    write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    device = resolve_device(cfg.device)
    spec = base_model_for(cfg.model, cfg.adapter)  # no --model: the one the adapter was trained on
    model, tokenizer = load_model(spec, device, weight_dtype(device, resolve_precision(device, cfg.precision)),
                                  cfg.trust_remote_code)
    if cfg.adapter:
        model = load_adapter(model, cfg.adapter, base=spec)
    if not cfg.chat:
        write(cfg.prompt)
    responses = []
    for r in stream_generate(model, tokenizer, cfg.prompt, cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed, cfg.chat):
        write(r.text)
        responses.append(r)
    write("\n")
    return responses
