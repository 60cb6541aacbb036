"""`tunesmith run model.pte`: generate with the ExecuTorch runtime and the tokenizer saved beside the program.

Prefill is one call with the whole prompt; decode is one call per token at its position (the KV cache lives in the
program). Text streams as tokens arrive, and the figures match `generate`'s: prompt and decode tokens/s.
"""

from __future__ import annotations

import ctypes
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from tunesmith.errors import TunesmithError, missing_extra
from tunesmith.export.executorch import META_FORMAT, pte_paths
from tunesmith.generate import GenerationResponse, encode_prompt, sample_next
from tunesmith.models import pad_with_eos


def _runtime():
    """The ExecuTorch runtime with the quantized kernels registered (int8 embedding gather, dequantize)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        import executorch
        from executorch.runtime import Runtime
    except ImportError:
        raise missing_extra("executorch", "ship", "running a .pte") from None
    # The Python runtime links the portable + optimized kernels; the quantized ones ship as a separate library
    # that registers itself when loaded (on a device they are linked into the runner).
    for root in executorch.__path__:
        lib = Path(root) / "lib" / "libexecutorch_kernels_quantized.so"
        if lib.is_file():
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            break
    return Runtime.get()


class PteModel:
    """A .pte written by `tunesmith export --format pte`, with its JSON and tokenizer: logits for a token span."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.path = Path(path)
        if self.path.suffix != ".pte" or not self.path.is_file():
            raise TunesmithError(f"{self.path}: no such .pte file; write one with `tunesmith export --format pte`")
        meta_path = pte_paths(self.path)[1]
        try:
            self.meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError):
            raise TunesmithError(
                f"{meta_path} is missing or unreadable; it is written beside the .pte by `tunesmith export --format pte`"
            ) from None
        if self.meta.get("format") != META_FORMAT:
            raise TunesmithError(f"{meta_path}: format {self.meta.get('format')!r} is not {META_FORMAT!r}; export again")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path.parent)
        except (OSError, ValueError) as e:
            raise TunesmithError(f"no tokenizer beside {self.path} ({str(e).splitlines()[0]}); export again") from None
        pad_with_eos(self.tokenizer)
        self.max_seq_len = int(self.meta["max_seq_len"])
        self.eos = set(self.meta.get("eos_token_ids", []))
        runtime = _runtime()
        try:
            self.method = runtime.load_program(self.path).load_method(self.meta.get("method", "forward"))
        except RuntimeError as e:
            raise TunesmithError(
                f"the ExecuTorch runtime could not load {self.path} ({e}); the file may be truncated or come from "
                "another executorch version: export it again"
            ) from None

    def logits(self, tokens: list[int], start: int = 0) -> torch.Tensor:
        """Logits [len(tokens), vocab] for `tokens` placed at positions start.. (the cache keeps what came before)."""
        end = start + len(tokens)
        if not tokens or end > self.max_seq_len:
            raise TunesmithError(
                f"{len(tokens)} tokens at position {start} do not fit this program's max_seq_len {self.max_seq_len}; "
                "shorten the prompt / --max-tokens, or export with a larger --max-seq-len"
            )
        out = self.method.execute([torch.tensor([tokens], dtype=torch.long), torch.arange(start, end)])
        return out[0][0]


def stream_generate_pte(
    model: PteModel,
    prompt: str,
    max_tokens: int = 100,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    chat: bool = False,
) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per generated token, as `generate.stream_generate` does for eager models."""
    if max_tokens < 1:
        raise TunesmithError(f"--max-tokens must be >= 1, got {max_tokens}")
    if not 0.0 < top_p <= 1.0:
        raise TunesmithError(f"--top-p must be in (0, 1], got {top_p}")
    tok = model.tokenizer
    ids = encode_prompt(tok, prompt, chat)
    if not ids:
        raise TunesmithError("the prompt is empty")
    max_tokens = min(max_tokens, model.max_seq_len - len(ids))
    if max_tokens < 1:
        raise TunesmithError(
            f"the prompt is {len(ids)} tokens and this program holds max_seq_len {model.max_seq_len} in all; "
            "shorten the prompt or export with a larger --max-seq-len"
        )
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    logits = model.logits(ids, 0)[-1]
    prefill_s = time.perf_counter() - start
    generated: list[int] = []
    text_so_far = ""
    decode_start = time.perf_counter()
    for n in range(1, max_tokens + 1):
        token = sample_next(logits, temperature, top_p, generator)
        generated.append(token)
        finished = token in model.eos
        reason = "stop" if finished else ("length" if n == max_tokens else None)
        text = tok.decode(generated[:-1] if finished else generated, skip_special_tokens=True)
        if reason or not text.endswith("\ufffd"):  # hold back a partial character until its bytes arrive
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
            peak_memory_bytes=_peak_rss(),
            finish_reason=reason,
        )
        if reason:
            return
        logits = model.logits([token], len(ids) + n - 1)[-1]


def _peak_rss() -> int:
    from tunesmith.device import peak_memory_bytes

    return peak_memory_bytes(torch.device("cpu"))


def run(cfg, write=None) -> list[GenerationResponse]:
    """The `run` verb: stream a generation from the .pte to `write` (stdout), return the responses."""
    if not cfg.pte:
        raise TunesmithError("run needs the .pte file: tunesmith run model.pte --prompt '...'")
    write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    model = PteModel(cfg.pte)
    if not cfg.chat:
        write(cfg.prompt)
    responses = []
    for r in stream_generate_pte(model, cfg.prompt, cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed, cfg.chat):
        write(r.text)
        responses.append(r)
    write("\n")
    return responses
