"""The ExecuTorch runtime from Python: a .pte program with the tokenizer saved beside it (`PteModel`), and
`tunesmith run model.pte`, which generates from it.

Prefill is one call with the whole prompt; decode is one call per token at its position (the KV cache lives in the
program). Decoding is `generate.decode`, the loop eager models use, so the text streams and the figures (prompt and
decode tokens/s) are the same as `generate`'s.
"""

from __future__ import annotations

import ctypes
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from tunesmith.device import peak_memory_bytes
from tunesmith.errors import TunesmithError, missing_extra
from tunesmith.export.executorch import META_FORMAT, pte_paths
from tunesmith.generate import GenerationResponse, decode, encode_prompt, resolve_prompt, stream_to
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
    system: str | None = None,
) -> Iterator[GenerationResponse]:
    """Yield one GenerationResponse per generated token, through the loop `generate.stream_generate` uses."""
    ids = encode_prompt(model.tokenizer, prompt, chat, system)
    if ids and max_tokens >= 1:  # the program holds max_seq_len tokens in all: the prompt's and the generated ones
        max_tokens = min(max_tokens, model.max_seq_len - len(ids))
        if max_tokens < 1:
            raise TunesmithError(
                f"the prompt is {len(ids)} tokens and this program holds max_seq_len {model.max_seq_len} in all; "
                "shorten the prompt or export with a larger --max-seq-len"
            )
    yield from decode(lambda tokens, start: model.logits(tokens, start)[-1], model.tokenizer, ids, model.eos,
                      max_tokens, temperature, top_p, seed, lambda: peak_memory_bytes(torch.device("cpu")))


def run_from_config(cfg, write=None) -> list[GenerationResponse]:
    """The `run` verb: stream a generation from the exported file to `write` (stdout), return the responses. A .pte
    runs in the ExecuTorch runtime; a .gguf through PyTorch on the CPU from the file's own weights (its quantized
    values, dequantized exactly, in fp32) and tokenizer."""
    if not cfg.pte:
        raise TunesmithError("run needs the exported file: tunesmith run model.pte (or model.gguf) --prompt '...'")
    path = Path(cfg.pte)
    check_artifact(path)
    prompt = resolve_prompt(cfg.prompt)
    if path.suffix == ".gguf":
        from tunesmith.generate import stream_generate
        from tunesmith.models import read_gguf

        model, tokenizer = read_gguf(path)
        stream = stream_generate(model, tokenizer, prompt, cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed,
                                 cfg.chat, cfg.system)
    else:
        stream = stream_generate_pte(PteModel(path), prompt, cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed,
                                     cfg.chat, cfg.system)
    return stream_to(write, "" if cfg.chat else prompt, stream)


def check_artifact(path: Path) -> None:
    """What `run` takes: a .pte or .gguf file; anything else is refused with how that kind of artifact runs."""
    if path.suffix in (".pte", ".gguf") and path.is_file():
        return
    if not path.exists():
        raise TunesmithError(f"{path}: no such file; `tunesmith export --format pte` (or gguf) writes one to run")
    inside = sorted(p for p in path.iterdir() if p.suffix in (".pte", ".gguf")) if path.is_dir() else []
    if inside:  # an export's folder (Ollama's holds its .gguf)
        how = f"a folder; run the file in it: tunesmith run {inside[0]}"
    elif path.suffix == ".mlpackage":
        how = "a Core ML package, which runs on Apple devices (Core ML in an app, or coremltools' predict on macOS)"
    elif path.is_dir() and (path / "metadata.json").is_file() and (path / "model.weights.h5").is_file():
        how = f"a Keras preset: load it with keras_hub.models.CausalLM.from_preset('{path}')"
    elif path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        how = (f"a model folder: run an MLX export with `mlx_lm.generate --model {path}` (on a Mac), a merged folder "
               f"with `tunesmith generate --model {path}`")
    else:
        how = "not an artifact tunesmith writes"
    raise TunesmithError(f"{path} is {how}; `tunesmith run` takes a .pte or .gguf file")
