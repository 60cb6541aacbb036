"""HF folder -> a Keras 3 preset folder on JAX or TensorFlow, checked against PyTorch before it is kept.

KerasHub converts the Hugging Face checkpoint (its `utils/transformers` converters: Llama through convert_llama3)
and saves a preset that `keras_hub.models.CausalLM.from_preset(folder)` loads with no tunesmith installed, on any
Keras backend. Keras fixes its backend at import, so the Keras work runs in a child process per backend
(keras_worker.py); this module computes the PyTorch side and compares.

Every export is checked, like WWDC24's JAX demo: the default prompts and PyTorch's greedy continuation through
both frameworks (logit differences, top-1 agreement, greedy generations through KerasHub's cached `generate`),
judged by parity.py's tolerance for the precision; the saved preset is then reloaded in a fresh process with plain
`CausalLM.from_preset` and must give the logits the conversion gave. A folder is written only when both hold.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tunesmith.errors import TunesmithError, missing_extra
from tunesmith.storage import atomic_folder

BACKENDS = ("jax", "tensorflow")  # each is also the package it needs and the tunesmith extra that installs it
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}
MARKER = "tunesmith-export.json"
CHECK_TOKENS = 16  # greedy tokens per prompt in the export's own check (parity --max-tokens goes further)
# The reloaded preset against the converted model, same backend and dtype: only the file round trip differs.
RELOAD_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}

# Hugging Face model types KerasHub 0.32 converts to a causal LM, among those tunesmith trains. Llama (SmolLM2
# included) and Gemma 3 are verified (docs/EXPORT.md); for the others the export's parity check vouches for it.
ARCHITECTURES = {
    "llama": "Llama 3", "mistral": "Mistral", "qwen2": "Qwen 2", "qwen3": "Qwen 3", "gemma": "Gemma",
    "gemma2": "Gemma 2", "gemma3": "Gemma 3", "gemma3_text": "Gemma 3", "smollm3": "SmolLM3",
}


def check_quant(quant: str) -> str:
    """The Keras dtype for a --quant value, or an error listing the valid ones."""
    if quant not in PRECISIONS:
        raise TunesmithError(f"--quant {quant!r} is not a Keras option; choose one of {', '.join(PRECISIONS)}")
    return quant


def require(backend: str) -> None:
    """An error naming the extra when keras-hub or the backend's package is missing."""
    if backend not in BACKENDS:
        raise TunesmithError(f"unknown Keras backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    for package, module in (("keras-hub", "keras_hub"), (backend, backend)):
        if importlib.util.find_spec(module) is None:
            raise missing_extra(package, backend, f"Keras on {backend}")


def keras_settings(config: dict, folder: Path) -> dict:
    """Backbone arguments KerasHub's converter leaves at its defaults, or a refusal naming what cannot convert."""
    model_type = config.get("model_type", "?")
    if model_type not in ARCHITECTURES:
        arch = ", ".join(config.get("architectures") or [model_type])
        raise TunesmithError(
            f"{folder}: KerasHub has no converter for {arch} (model_type {model_type!r}); --format keras takes "
            f"{', '.join(sorted(set(ARCHITECTURES.values())))}"
        )
    if model_type != "llama":
        return {}
    problems = []
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    if config.get("head_dim", hidden // heads) != hidden // heads:
        problems.append(f"head_dim {config['head_dim']} (KerasHub's Llama uses hidden_size / heads)")
    for option in ("attention_bias", "mlp_bias"):
        if config.get(option):
            problems.append(option)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") not in ("default", "llama3"):
        problems.append(f"rope_type {rope['rope_type']}")
    if problems:
        raise TunesmithError(f"{folder}: KerasHub's Llama cannot express {', '.join(problems)}")
    # convert_llama3 keeps Llama3Backbone's 1e-6; SmolLM2 (and Llama 2) use 1e-5, a small but real difference
    return {"layer_norm_epsilon": float(config.get("rms_norm_eps", 1e-6))}


# ------------------------------------------------------------------------------------------------ the worker


@dataclass
class KerasOutput:
    logits: list  # numpy (positions, vocab) float32 per sequence
    greedy: list[list[int]]  # per prompt
    token_ids: list[list[int]]  # per text, through the Keras tokenizer
    info: dict  # backend, versions, decode_seconds


def run_worker(backend: str, request: dict, timeout: float | None = None) -> KerasOutput:
    """Run keras_worker.py on `backend` in a child process and read back what it wrote."""
    import numpy as np

    require(backend)
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3", "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory(prefix="tunesmith-keras-") as tmp:
        path = Path(tmp) / "request.json"
        path.write_text(json.dumps(request), encoding="utf-8")
        worker = Path(__file__).with_name("keras_worker.py")
        done = subprocess.run([sys.executable, "-P", str(worker), str(path)], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise TunesmithError(f"Keras on {backend} failed on {request['source']}:\n{tail}")
        arrays = np.load(path.with_suffix(".npz"))
        info = json.loads(path.with_suffix(".out.json").read_text(encoding="utf-8"))

        def series(prefix: str, n: int) -> list:
            return [arrays[f"{prefix}_{i}"] for i in range(n)]

        return KerasOutput(
            series("logits", len(request.get("sequences", []))),
            [g.tolist() for g in series("greedy", len(request.get("prompts", [])))],
            [t.tolist() for t in series("token_ids", len(request.get("texts", [])))],
            info,
        )


def hf_request(model_dir: Path, precision: str, tokenizer, **fields) -> dict:
    """A worker request that converts the HF folder `model_dir`, with the settings KerasHub needs from us."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    probe = tokenizer("a")["input_ids"]
    adds_bos = tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id]
    settings = {"backbone": keras_settings(config, model_dir), "preprocessor": {"add_start_token": adds_bos}}
    return {"source": str(model_dir), "kind": "hf", "dtype": PRECISIONS[precision], "config": settings, **fields}


# ------------------------------------------------------------------------------------------------ the check


@dataclass
class Reference:
    """PyTorch's side: each prompt followed by its greedy continuation, and the logits over that sequence."""

    prompts: list[list[int]]
    greedy: list[list[int]]
    logits: list  # torch (positions, vocab) float32

    @property
    def sequences(self) -> list[list[int]]:
        return [p + g for p, g in zip(self.prompts, self.greedy, strict=True)]


def torch_reference(model_dir: Path, prompts: Sequence[list[int]], precision: str, max_tokens: int) -> Reference:
    import torch

    from tunesmith.device import DTYPES
    from tunesmith.models import load_model
    from tunesmith.parity import _logits, greedy_tokens

    model, _ = load_model(str(model_dir), "cpu", DTYPES[precision])
    greedy = [greedy_tokens(model, list(p), max_tokens) for p in prompts]
    with torch.no_grad():
        logits = [_logits(model, list(p) + g) for p, g in zip(prompts, greedy, strict=True)]
    return Reference([list(p) for p in prompts], greedy, logits)


def judge(ref: Reference, out: KerasOutput, backend: str, precision: str, reference: str, tolerance: float = 0.0):
    """parity.py's ParityResult for the Keras side against PyTorch's, with the precision's tolerance."""
    import torch

    from tunesmith.parity import TOLERANCES, ParityResult, Tolerance, compare_logits

    stats = compare_logits(torch.cat(ref.logits), torch.cat([torch.from_numpy(x) for x in out.logits]))
    matches = [a == b for a, b in zip(ref.greedy, out.greedy, strict=True)]
    divergences = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                   for a, b in zip(ref.greedy, out.greedy, strict=True)]
    tol = TOLERANCES[precision]
    if tolerance > 0:
        tol = Tolerance(mean_rel=tolerance, min_top1=tol.min_top1)
    return ParityResult(f"Keras on {out.info.get('backend', backend)} (cpu)", precision,
                        sum(len(x) for x in ref.logits), **stats, greedy_match=matches,
                        first_divergence=divergences, tolerance=tol, reference=reference)


def check_tokenizer(tokenizer, texts: Sequence[str], keras_ids: Sequence[list[int]]) -> None:
    """The preset's tokenizer must split text as the trained model's did, or its text interface lies."""
    for text, ids in zip(texts, keras_ids, strict=True):
        want = tokenizer(text, add_special_tokens=False)["input_ids"]
        if ids != want:
            raise TunesmithError(f"KerasHub's tokenizer splits {text!r} as {ids[:12]}..., the model's tokenizer as "
                                 f"{want[:12]}...; the preset would not read text as the model was trained on it")



def framework_parity(cfg, console=None, progress: bool = True) -> list:
    """`parity --framework jax|tensorflow`: the prompts through PyTorch (CPU) and through Keras 3 on that backend,
    both sides in the same dtype: fp32 and bf16, or the one --precision names. Logits are compared over each prompt
    and PyTorch's greedy continuation; the Keras side generates with KerasHub's own cached `generate`."""
    from rich.console import Console

    from tunesmith.data import read_prompts
    from tunesmith.export import model_folder
    from tunesmith.models import load_tokenizer
    from tunesmith.parity import DEFAULT_PROMPTS, ParityMismatch, print_result
    from tunesmith.progress import status

    console = console or Console()

    require(cfg.framework)
    precisions = list(PRECISIONS) if cfg.precision == "auto" else [cfg.precision]
    if any(p not in PRECISIONS for p in precisions):
        raise TunesmithError(f"--framework {cfg.framework} compares in {' or '.join(PRECISIONS)}, not {cfg.precision}")
    prompts = read_prompts(cfg.prompts, DEFAULT_PROMPTS)
    results = []
    with model_folder(cfg.model, cfg.adapter) as folder:
        tokenizer = load_tokenizer(str(folder))
        encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        for precision in precisions:
            status(f"parity: {len(encoded)} prompts x {cfg.max_tokens} greedy tokens, {folder} through PyTorch and "
                   f"Keras on {cfg.framework} ({precision})", progress)
            ref = torch_reference(folder, encoded, precision, cfg.max_tokens)
            out = run_worker(cfg.framework, hf_request(folder, precision, tokenizer, sequences=ref.sequences,
                                                       prompts=ref.prompts, max_tokens=cfg.max_tokens))
            r = judge(ref, out, cfg.framework, precision, f"PyTorch cpu ({precision})", cfg.tolerance)
            print_result(r, console)
            results.append(r)
    failed = [r for r in results if not r.passed]
    if failed:
        raise ParityMismatch("; ".join(
            f"Keras on {cfg.framework} ({r.precision}) differs from PyTorch beyond the tolerance: mean relative logit "
            f"difference {r.mean_rel:.3g} (allowed {r.tolerance.mean_rel:g}), top-1 agreement "
            f"{r.top1_agreement:.1%} (needed {r.tolerance.min_top1:.0%})" for r in failed))
    return results


# ------------------------------------------------------------------------------------------------ the export


def export(model_dir: Path, output: Path, quant: str, group_size: int | None, max_seq_len: int,
           backend: str = "jax") -> Path:
    """Write `model_dir` (a plain HF folder) as a Keras preset folder at `output` after checking it on `backend`.

    `quant` is the weights' dtype (fp32 or bf16); `group_size` and `max_seq_len` are not used (Keras models take
    any length; the preprocessor's sequence_length is KerasHub's default and can be set when loading)."""
    from rich.console import Console

    from tunesmith.models import load_tokenizer
    from tunesmith.parity import DEFAULT_PROMPTS, ParityMismatch, print_result
    from tunesmith.progress import status

    precision = check_quant(quant)
    require(backend)
    out = _check_output(Path(output))
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    keras_settings(config, model_dir)  # refuse before the slow part
    tokenizer = load_tokenizer(str(model_dir))
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in DEFAULT_PROMPTS]
    status(f"keras: converting {model_dir} on {backend} ({precision}), then checking {len(prompts)} prompts x "
           f"{CHECK_TOKENS} greedy tokens against PyTorch and reloading the preset")
    ref = torch_reference(model_dir, prompts, precision, CHECK_TOKENS)
    with atomic_folder(out) as tmp:
        converted = run_worker(backend, hf_request(model_dir, precision, tokenizer, sequences=ref.sequences,
                                                   prompts=ref.prompts, max_tokens=CHECK_TOKENS,
                                                   texts=list(DEFAULT_PROMPTS), save=str(tmp)))
        check_tokenizer(tokenizer, DEFAULT_PROMPTS, converted.token_ids)
        result = judge(ref, converted, backend, precision, f"PyTorch cpu ({precision})")
        print_result(result, Console(stderr=True))
        if not result.passed:
            raise ParityMismatch(f"Keras on {backend} differs from PyTorch beyond the {precision} tolerance "
                                 f"(mean relative {result.mean_rel:.3g}, top-1 {result.top1_agreement:.1%}); "
                                 "nothing written")
        reloaded = run_worker(backend, {"source": str(tmp), "kind": "preset", "dtype": PRECISIONS[precision],
                                        "sequences": ref.sequences, "texts": list(DEFAULT_PROMPTS)})
        check_tokenizer(tokenizer, DEFAULT_PROMPTS, reloaded.token_ids)
        reload_diff = max(float(abs(a - b).max()) for a, b in zip(converted.logits, reloaded.logits, strict=True))
        if reload_diff > RELOAD_TOLERANCE[precision]:
            raise TunesmithError(f"the saved preset reloads with logits {reload_diff:.3g} away from the converted "
                                 f"model's (allowed {RELOAD_TOLERANCE[precision]:g}); nothing written")
        provenance = {
            "format": "keras", "backend": backend, "quant": precision, "dtype": PRECISIONS[precision],
            "source": str(model_dir), **{k: converted.info[k] for k in ("keras", "keras_hub", "task")},
            "check": {"positions": result.positions, "max_abs": result.max_abs, "mean_rel": result.mean_rel,
                      "top1_agreement": result.top1_agreement, "greedy_match": result.greedy_match,
                      "reload_max_abs": reload_diff},
        }
        (tmp / MARKER).write_text(json.dumps(provenance, indent=2), encoding="utf-8")
    return out


def _check_output(out: Path) -> Path:
    if out.suffix in (".gguf", ".mlpackage", ".safetensors", ".pte", ".keras", ".h5"):
        raise TunesmithError(f"--format keras writes a preset folder; {out} looks like a file name")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        raise TunesmithError(f"{out} exists and is not a tunesmith export folder; choose an empty --output")
    return out


def exported_presets(folder: Path) -> list[tuple[Path, dict]]:
    """(preset folder, its tunesmith-export.json) for every Keras export directly under `folder`."""
    found = []
    for marker in sorted(Path(folder).glob(f"*/{MARKER}")):
        info = json.loads(marker.read_text(encoding="utf-8"))
        if info.get("format") == "keras":
            found.append((marker.parent, info))
    return found
