"""Greedy and sampled generation, streamed token by token: one decode loop for every kind of model.

`decode` runs over a "next logits" function, so an eager model with a KV cache (`stream_generate`) and an ExecuTorch
program (`pte_runtime.stream_generate_pte`) share the sampling, the stop rule, the streamed text and the figures.
"""

from __future__ import annotations

import bisect
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from tunesmith.config import GenerateConfig, check_values
from tunesmith.device import peak_memory_bytes
from tunesmith.errors import TunesmithError

DECODE_CONTEXT = 4  # tokens decoded again before the new ones (Answer._text)

NextLogits = Callable[[list[int], int], torch.Tensor]
"""(tokens, position of the first of them) -> logits [vocab] after the last one; it keeps its own cache."""


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


def resolve_prompt(prompt: str) -> str:
    """--prompt as given, or what comes on stdin for `--prompt -`."""
    if prompt != "-":
        return prompt
    text = sys.stdin.read()
    if not text:
        raise TunesmithError("--prompt -: nothing came on stdin; pipe the prompt in, e.g. echo 'ROMEO:' | tunesmith ...")
    return text


def encode_prompt(tokenizer, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
    """The prompt's token ids: as text, or with --chat through the model's chat template (after `system`)."""
    if not chat:
        if system is not None:
            raise TunesmithError("--system is a message of the chat template; add --chat")
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}
    ]
    return encode_messages(tokenizer, messages)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation's token ids through the model's own chat template, ready for the assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise TunesmithError("--chat needs a tokenizer with a chat template; this model has none")
    from jinja2 import TemplateError

    try:
        return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))
    except TemplateError as e:  # e.g. a template without a system role
        raise TunesmithError(f"this model's chat template refused the messages: {e}") from None


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


class Answer:
    """One answer's sampling, stop rule and streamed text, fed the logits after each token it adds: the part of
    the decode loop that does not run the model, so a loop over one sequence (`decode`) and the server's batched
    steps (serve.engine) answer alike.

    A `stop` string ends the text before it (it is not part of the text); text that may be the start of one is held
    back until the next tokens say whether it is."""

    def __init__(self, tokenizer, prompt_tokens: int, stop_ids: Iterable[int], max_tokens: int = 100,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 peak_memory: Callable[[], int] = lambda: 0, stop: Iterable[str] = ()):
        check_values(GenerateConfig, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        self.tokenizer, self.prompt_tokens, self.max_tokens = tokenizer, prompt_tokens, max_tokens
        self.temperature, self.top_p, self.peak_memory = temperature, top_p, peak_memory
        self.stop_tokens, self.stop_strings = set(stop_ids), [s for s in stop if s]
        self.generator = torch.Generator().manual_seed(seed)
        self.generated: list[int] = []
        self.text_so_far = ""
        # the text decoded so far, of the tokens before `_read`, and where the text so far ended in a whole
        # character (see _text)
        self._kept, self._read, self._whole = "", 0, [0]
        self.start = time.perf_counter()  # the prefill begins now
        self.prefill_s = self.decode_start = 0.0

    def add(self, logits: torch.Tensor, token: int | None = None) -> GenerationResponse:
        """The next token drawn from `logits` (those after the last token so far) and what it adds to the text.
        `token`: the greedy token, drawn already (the server draws a step's greedy rows at once)."""
        if not self.generated:
            self.decode_start = time.perf_counter()
            self.prefill_s = self.decode_start - self.start
        if token is None or self.temperature > 0:
            token = sample_next(logits, self.temperature, self.top_p, self.generator)
        self.generated.append(token)
        n = len(self.generated)
        finished = token in self.stop_tokens
        reason = "stop" if finished else ("length" if n == self.max_tokens else None)
        text = self._text(self.generated[:-1] if finished else self.generated, last=reason is not None)
        cut = _stop_at(text, self.stop_strings, len(self.text_so_far))
        if cut is not None:
            text, reason = text[:cut], "stop"
        # Hold back a trailing partial character (U+FFFD) until its next bytes arrive, and the start of a stop
        # string until it is whole or broken, except at the end.
        if not reason:
            text = text[: len(text) - _held_back(text, self.stop_strings)]
        if reason or not text.endswith("\ufffd"):
            delta, self.text_so_far = text[len(self.text_so_far) :], text
        else:
            delta = ""
        return GenerationResponse(
            text=delta,
            token=token,
            generated_tokens=n,
            prompt_tokens=self.prompt_tokens,
            prompt_tps=self.prompt_tokens / max(self.prefill_s, 1e-9),
            generation_tps=n / max(time.perf_counter() - self.decode_start, 1e-9),
            peak_memory_bytes=self.peak_memory(),
            finish_reason=reason,
        )

    def _text(self, ids: list[int], last: bool) -> str:
        """The text of `ids` (the tokens so far) as one decode of them all reads it, decoding only the last few:
        the text of the tokens before `_read` is kept from the calls before, and a window of the tokens from at
        least `DECODE_CONTEXT` before `_read` is decoded, the text of its tokens before `_read` cut off. So a token
        costs the same however long the answer (a decode of them all grows with it: 0.2 ms a token at 1,000 on a
        2-core CPU). The window starts where the text so far once ended in a whole character, and its first
        tokens read the boundary as the whole does (the space a SentencePiece word starts with). Where the window
        reads otherwise: while a character's bytes have not all come (a byte-fallback decoder makes the whole run
        of byte tokens U+FFFD then), the kept text and U+FFFD, which `add` holds back; else, or for the `last`
        token, a decode of them all. The kept text moves on once it ends in a whole character."""
        start = self._whole[max(0, bisect.bisect_right(self._whole, self._read - DECODE_CONTEXT) - 1)]
        head = self.tokenizer.decode(ids[start : self._read], skip_special_tokens=True)
        window = self.tokenizer.decode(ids[start:], skip_special_tokens=True)
        if window.startswith(head):
            text = self._kept + window[len(head) :]
        elif window.endswith("\ufffd") and not last:
            return self._kept + "\ufffd"
        else:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not text.endswith("\ufffd") and len(ids) > self._read:
            self._kept, self._read = text, len(ids)
            self._whole.append(self._read)
        return text


@torch.no_grad()
def decode(
    next_logits: NextLogits,
    tokenizer,
    prompt_ids: list[int],
    stop_ids: Iterable[int],
    max_tokens: int = 100,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    peak_memory: Callable[[], int] = lambda: 0,
    stop: Iterable[str] = (),
) -> Iterator[GenerationResponse]:
    """The decode loop: prefill the prompt, then sample one token at a time until a stop token, a `stop` string or
    max_tokens, yielding one GenerationResponse per token (the sampling and the text: `Answer`)."""
    answer = Answer(tokenizer, len(prompt_ids), stop_ids, max_tokens, temperature, top_p, seed, peak_memory, stop)
    if not prompt_ids:
        raise TunesmithError("the prompt is empty")
    logits = next_logits(prompt_ids, 0)
    while True:
        r = answer.add(logits)
        yield r
        if r.finish_reason:
            return
        logits = next_logits([r.token], len(prompt_ids) + r.generated_tokens - 1)



def _stop_at(text: str, stop: list[str], emitted: int) -> int | None:
    """Where the first stop string in `text` begins (looking only where it could not have been streamed yet)."""
    longest = max((len(s) for s in stop), default=0)
    hits = [i for s in stop if (i := text.find(s, max(0, emitted - longest + 1))) >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stop: list[str]) -> int:
    """The length of the longest end of `text` that begins a stop string."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def eager_next_logits(model: torch.nn.Module) -> NextLogits:
    """A NextLogits for a transformers model: a fresh KV cache, filled as the tokens come."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache()

    def next_logits(tokens: list[int], start: int) -> torch.Tensor:
        out = model(input_ids=torch.tensor([tokens], device=device), past_key_values=cache, use_cache=True)
        return out.logits[0, -1]

    return next_logits


def stream_generate(
    model: torch.nn.Module,
    tokenizer,
    prompt: str,
    max_tokens: int = 100,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    chat: bool = False,
    system: str | None = None,
    stop: Iterable[str] = (),
) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per generated token of an eager model."""
    ids = encode_prompt(tokenizer, prompt, chat, system)
    yield from stream_tokens(model, tokenizer, ids, max_tokens, temperature, top_p, seed, stop)


def stream_tokens(
    model: torch.nn.Module,
    tokenizer,
    prompt_ids: list[int],
    max_tokens: int = 100,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: Iterable[str] = (),
) -> Iterator[GenerationResponse]:
    """stream_generate from prompt token ids (a whole conversation through encode_messages, say)."""
    model.eval()
    device = next(model.parameters()).device
    yield from decode(eager_next_logits(model), tokenizer, prompt_ids, stop_token_ids(tokenizer, model), max_tokens,
                      temperature, top_p, seed, lambda: peak_memory_bytes(device), stop)


def generate(model, tokenizer, prompt: str, **kwargs) -> str:
    """The whole generated text (no streaming)."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))


def stop_token_ids(tokenizer, model) -> set[int]:
    """The end-of-sequence ids of the tokenizer and of the model's generation config."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(source)
    return ids


def stream_to(write: Callable[[str], object] | None, echo: str,
              responses: Iterable[GenerationResponse]) -> list[GenerationResponse]:
    """Write `echo` (the prompt, when it is plain text), each response's text as it comes, then a newline (to stdout
    when `write` is None); return the responses."""
    write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    write(echo)
    done = []
    for r in responses:
        write(r.text)
        done.append(r)
    write("\n")
    return done


def generate_from_config(cfg, write=None) -> list[GenerationResponse]:
    """The `generate` verb: load the model (+ adapter), stream the text to `write`, return the responses."""
    from tunesmith.device import resolve_device, resolve_precision, weight_dtype
    from tunesmith.lora import load_with_adapter

    prompt = resolve_prompt(cfg.prompt)
    device = resolve_device(cfg.device)
    model, tokenizer, _ = load_with_adapter(cfg.model, cfg.adapter, device,
                                            weight_dtype(device, resolve_precision(device, cfg.precision)),
                                            cfg.trust_remote_code)
    stream = stream_generate(model, tokenizer, prompt, cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed, cfg.chat,
                             cfg.system)
    return stream_to(write, "" if cfg.chat else prompt, stream)
