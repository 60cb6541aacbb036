"""`tunesmith compare RUN_DIR`: the quality ladder. Every rung on the same held-out blocks and the same prompts.

Rungs: the base model; base + LoRA adapter; the merged model (fp32); int8 and int4 weight-only (made from the merged
model into <run>/quantized-int8 and <run>/quantized-int4-g<N> when missing); every .pte under <run>/exports (and
any given with --pte); every Keras preset folder under <run>/exports (`export --format keras`), on the backend
it was exported with, when that backend is installed. Each gets perplexity, bytes on disk (weight files only:
safetensors / .pte / model.weights.h5; the LoRA rung counts base + adapter, which is what it ships), greedy decode
tokens/s on this machine, and the greedy continuation of each prompt. The table is printed and written to <run>/ladder.json, which the run report draws.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from tunesmith.config import DEMO_PROMPTS
from tunesmith.data import IGNORE, Example, read_prompts
from tunesmith.errors import TunesmithError

LADDER_FILE = "ladder.json"


@dataclass
class Rung:
    name: str
    perplexity: float | None
    bytes: int | None
    tokens_per_s: float | None
    samples: list[str] = field(default_factory=list)  # greedy continuation of each prompt
    path: str = ""
    note: str = ""


# ------------------------------------------------------------------------------------------------ scoring


def _decode_tps(runs: Sequence[tuple[int, float]]) -> float | None:
    """Generated tokens / decode seconds over all prompts, from (tokens, tokens/s) per prompt."""
    tokens = sum(n for n, _ in runs)
    seconds = sum(n / tps for n, tps in runs if tps > 0)
    return tokens / seconds if seconds > 0 else None


def _greedy(stream: Callable, prompts: Sequence[str], max_tokens: int) -> tuple[list[str], float | None]:
    """(continuation per prompt, decode tokens/s) from a stream_generate-shaped callable."""
    samples, runs = [], []
    for p in prompts:
        responses = list(stream(p, max_tokens))
        samples.append("".join(r.text for r in responses))
        runs.append((responses[-1].generated_tokens, responses[-1].generation_tps))
    return samples, _decode_tps(runs)


def score_eager(name: str, model, tokenizer, examples: Sequence[Example], prompts: Sequence[str], max_tokens: int,
                nbytes: int | None, path: str = "") -> Rung:
    from tunesmith.evaluate import evaluate
    from tunesmith.generate import stream_generate

    ppl = evaluate(model, examples, 4, 0, tokenizer.pad_token_id).perplexity
    samples, tps = _greedy(lambda p, n: stream_generate(model, tokenizer, p, max_tokens=n), prompts, max_tokens)
    return Rung(name, ppl, nbytes, tps, samples, path)


@torch.no_grad()
def pte_perplexity(pte, examples: Sequence[Example]) -> float | None:
    """Token-weighted perplexity from one prefill call per block (None when a block is longer than the program)."""
    total, count = 0.0, 0
    for ids, labels in examples:
        if len(ids) > pte.max_seq_len:
            return None
        logits = pte.logits(list(ids), 0)[:-1].float()
        target = torch.tensor(labels[1:])
        total += float(F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum"))
        count += int((target != IGNORE).sum())
    return math.exp(min(total / count, 80.0)) if count else None


def score_pte(path: Path, examples: Sequence[Example], prompts: Sequence[str], max_tokens: int) -> Rung:
    from tunesmith.pte_runtime import PteModel, stream_generate_pte

    pte = PteModel(path)
    quant, group = pte.meta.get("quant", "?"), pte.meta.get("group_size")
    name = f"pte {quant}" + (f" g{group}" if group else "")
    ppl = pte_perplexity(pte, examples)
    samples, tps = _greedy(lambda p, n: stream_generate_pte(pte, p, max_tokens=n), prompts, max_tokens)
    note = "" if ppl is not None else f"blocks longer than its max_seq_len {pte.max_seq_len}: no perplexity"
    return Rung(name, ppl, path.stat().st_size, tps, samples, str(path), note)


def score_gguf(path: Path, examples: Sequence[Example], prompts: Sequence[str], max_tokens: int) -> Rung:
    """A GGUF export, its weights dequantized exactly into PyTorch (fp32, CPU) with its own tokenizer: what its
    quantization costs, not llama.cpp's speed."""
    from tunesmith.models import read_gguf

    model, tokenizer = read_gguf(path)
    quant = path.stem.removeprefix("model-") if path.stem.startswith("model-") else path.name
    return score_eager(f"gguf {quant}", model, tokenizer, examples, prompts, max_tokens, path.stat().st_size,
                       str(path))


def score_keras(folder: Path, info: dict, tokenizer, examples: Sequence[Example], prompts: Sequence[str],
                max_tokens: int) -> Rung:
    """A Keras preset (export --format keras) on its backend, in a child process: perplexity from its logits on the
    held-out blocks, greedy continuations from KerasHub's cached generate (which runs the full max_tokens)."""
    from tunesmith.export.keras import run_worker

    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    out = run_worker(info["backend"], {"source": str(folder), "kind": "preset", "dtype": info["dtype"],
                                       "sequences": [list(ids) for ids, _ in examples], "prompts": encoded,
                                       "max_tokens": max_tokens})
    total, count = 0.0, 0
    for logits, (_, labels) in zip(out.logits, examples, strict=True):
        target = torch.tensor(labels[1:])
        total += float(F.cross_entropy(torch.from_numpy(logits)[:-1], target, ignore_index=IGNORE, reduction="sum"))
        count += int((target != IGNORE).sum())
    seconds = out.info.get("decode_seconds")
    tps = len(prompts) * max_tokens / seconds if seconds else None
    samples = [tokenizer.decode(g, skip_special_tokens=True) for g in out.greedy]
    weights = folder / "model.weights.h5"
    return Rung(f"keras {info['backend']} {info['quant']}", math.exp(min(total / count, 80.0)) if count else None,
                weights.stat().st_size if weights.is_file() else None, tps, samples, str(folder))


# ------------------------------------------------------------------------------------------------ the ladder


def run_model(run_dir: Path) -> str:
    """The base model a run was trained from, read from the config train / demo saved there."""
    import yaml

    for name in ("config.yaml", "demo-config.yaml"):
        p = run_dir / name
        if p.is_file():
            model = (yaml.safe_load(p.read_text(encoding="utf-8")) or {}).get("model")
            if model:
                return str(model)
    raise TunesmithError(f"{run_dir} has no config.yaml naming its model; pass --model (the base model)")


def quantized_folder(run_dir: Path, merged: Path, scheme: str, group_size: int, calibration=None) -> Path:
    """<run>/quantized-<scheme>, made from the merged model when it is not there yet (int4: GPTQ on `calibration`)."""
    from tunesmith.models import load_model
    from tunesmith.quantformat import is_quantized, save_quantized
    from tunesmith.quantize import quantize_model

    folder = run_dir / (f"quantized-{scheme}" + (f"-g{group_size}" if scheme == "int4" else ""))
    if not is_quantized(folder):
        model, tokenizer = load_model(str(merged), "cpu", torch.float32)
        info = quantize_model(model, scheme, group_size, calibration if scheme == "int4" else None)
        save_quantized(model, tokenizer, folder, {**info, "source": str(merged), "adapter": None})
    return folder


def ladder(cfg, prompts: Sequence[str] | None = None, echo: Callable[[str], None] = print) -> list[Rung]:
    """Score every rung the run folder has; `prompts` overrides cfg.prompts (the demo passes its own)."""
    from tunesmith.data import load_data
    from tunesmith.lora import load_adapter, load_quantized_for, recorded_base, recorded_quantization
    from tunesmith.models import load_model, load_tokenizer, resolve_model
    from tunesmith.quantize import weights_bytes

    run_dir = Path(cfg.run_dir)
    if not run_dir.is_dir():
        raise TunesmithError(f"run folder not found: {run_dir}")
    adapter, merged = run_dir / "adapter", run_dir / "merged"
    has_adapter = (adapter / "adapter_config.json").is_file()
    base = cfg.model or (recorded_base(adapter)[0] if has_adapter else None) or run_model(run_dir)
    if not (merged / "config.json").is_file() and (run_dir / "model" / "config.json").is_file():
        merged = run_dir / "model"  # a full fine-tune: the trained model itself
    has_merged = (merged / "config.json").is_file()
    scheme = recorded_quantization(adapter) if has_adapter else "none"  # QLoRA: the base the adapter trained on
    ptes = sorted((run_dir / "exports").glob("*.pte")) + [Path(p) for p in cfg.pte]
    prompts = list(prompts) if prompts else read_prompts(cfg.prompts, DEMO_PROMPTS)
    tokenizer = load_tokenizer(str(merged) if has_merged else base)
    data = load_data(cfg.data, tokenizer, cfg.seq_len, cfg.val_fraction)
    examples = data.valid[: cfg.eval_blocks]
    if not examples:
        raise TunesmithError(f"{cfg.data} has no held-out blocks of {cfg.seq_len} tokens; lower --seq-len or add data")

    def timed(label: str, score: Callable[..., Rung], *args) -> Rung:
        t = time.perf_counter()
        rung = score(*args)
        echo(f"  {label}: perplexity {_fmt(rung.perplexity, '.2f')}, {_fmt(rung.tokens_per_s, '.1f')} tok/s "
             f"({time.perf_counter() - t:.0f}s)")
        return rung

    echo(f"quality ladder: {len(examples)} held-out blocks of {cfg.seq_len} tokens, {len(prompts)} prompts x "
         f"{cfg.max_tokens} greedy tokens")
    rungs: list[Rung] = []
    source = resolve_model(base)
    base_bytes = weights_bytes(source) if isinstance(source, Path) else None
    model, tok = load_model(base, "cpu", torch.float32)
    rungs.append(timed("base", score_eager, "base", model, tok, examples, prompts, cfg.max_tokens, base_bytes, str(source)))
    if scheme != "none":  # the quantized base's own rung, then the adapter on it
        del model
        model, tok = load_quantized_for(base, adapter, "cpu", torch.float32)
        rungs.append(timed(f"base {scheme}", score_eager, f"base ({scheme})", model, tok, examples, prompts,
                           cfg.max_tokens, None, str(source)))
    if has_adapter:
        peft = load_adapter(model, adapter, base=base)
        nbytes = base_bytes + weights_bytes(adapter) if base_bytes is not None and scheme == "none" else None
        label = f"QLoRA ({scheme} base + adapter)" if scheme != "none" else "LoRA (base + adapter)"
        rungs.append(timed("LoRA", score_eager, label, peft, tok, examples, prompts, cfg.max_tokens,
                           nbytes, str(adapter)))
        del peft
    del model
    if has_merged:
        model, tok = load_model(str(merged), "cpu", torch.float32)
        rungs.append(timed("merged", score_eager, "merged fp32", model, tok, examples, prompts, cfg.max_tokens,
                           weights_bytes(merged), str(merged)))
        del model
        rungs += _quantized_rungs(run_dir, merged, cfg, data.train, examples, prompts, timed, echo)
    if ptes and importlib.util.find_spec("executorch") is None:
        echo(f"  {len(ptes)} .pte rung(s) skipped: running a .pte needs executorch: pip install 'tunesmith[ship]'")
        ptes = []
    for path in ptes:
        rungs.append(timed(path.name, score_pte, path, examples, prompts, cfg.max_tokens))
    for path in _gguf_files(run_dir / "exports"):
        rungs.append(timed(path.name, score_gguf, path, examples, prompts, cfg.max_tokens))
    for folder, info in _keras_presets(run_dir / "exports", echo):
        rungs.append(timed(f"keras {info['backend']}", score_keras, folder, info, tokenizer, examples, prompts,
                           cfg.max_tokens))
    write_ladder(run_dir, rungs, prompts)
    return rungs


def _gguf_files(exports: Path) -> list[Path]:
    """Every .gguf under <run>/exports and one folder down (an Ollama export's). gguf, which reads them, is one of
    tunesmith's own dependencies: no rung is skipped for want of it."""
    return sorted(exports.glob("*.gguf")) + sorted(exports.glob("*/*.gguf")) if exports.is_dir() else []


def _keras_presets(exports: Path, echo) -> list[tuple[Path, dict]]:
    """Every Keras preset under <run>/exports whose backend is installed; a line for those skipped."""
    from tunesmith.export.keras import exported_presets, require

    found = []
    for folder, info in exported_presets(exports) if exports.is_dir() else []:
        try:
            require(info["backend"])
        except TunesmithError as e:
            echo(f"  {folder.name} skipped: {e}")
            continue
        found.append((folder, info))
    return found


def _quantized_rungs(run_dir, merged, cfg, train, examples, prompts, timed, echo) -> list[Rung]:
    from tunesmith.models import load_model
    from tunesmith.quantformat import import_torchao
    from tunesmith.quantize import calibration_blocks, weights_bytes

    try:
        import_torchao()
    except TunesmithError as e:
        echo(f"  int8 / int4 skipped: {e}")
        return []
    out = []
    for scheme, name in (("int8", "int8"), ("int4", f"int4 g{cfg.group_size}")):
        folder = quantized_folder(run_dir, merged, scheme, cfg.group_size,
                                  calibration_blocks(train, cfg.calibration_blocks))
        model, tok = load_model(str(folder), "cpu")
        out.append(timed(name, score_eager, name, model, tok, examples, prompts, cfg.max_tokens, weights_bytes(folder),
                         str(folder)))
        del model
    return out


def write_ladder(run_dir: Path, rungs: Sequence[Rung], prompts: Sequence[str]) -> Path:
    """ladder.json: one object per rung (name, perplexity, bytes, tokens_per_s, sample, samples, path, note)."""
    rows = []
    for r in rungs:
        row = asdict(r)
        row["samples"] = [{"prompt": p, "text": s} for p, s in zip(prompts, r.samples, strict=True)]
        row["sample"] = prompts[0] + r.samples[0] if r.samples else ""
        rows.append(row)
    path = run_dir / LADDER_FILE
    path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return path


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_ladder(console, rungs: Sequence[Rung], prompts: Sequence[str]) -> None:
    from rich.table import Table

    ref = next((r for r in rungs if r.name == "merged fp32"), None)
    table = Table(title="quality ladder (same held-out text, same prompts, greedy)", show_lines=True)
    for col, kw in (("artifact", {"style": "bold"}), ("perplexity", {"justify": "right"}), ("size", {"justify": "right"}),
                    ("tok/s", {"justify": "right"})):
        table.add_column(col, **kw)
    for p in prompts:
        table.add_column(p.strip().splitlines()[0][:24])
    for r in rungs:
        ppl = _fmt(r.perplexity, ".2f")
        if ref and ref.perplexity and r.perplexity and r is not ref:
            ppl += f" ({r.perplexity / ref.perplexity - 1:+.1%})"
        size = "—" if r.bytes is None else f"{r.bytes / 2**20:.0f} MiB"
        table.add_row(r.name, ppl, size, _fmt(r.tokens_per_s, ".1f"), *[s.strip() for s in r.samples])
    console.print(table)


def compare(cfg, console=None, prompts: Sequence[str] | None = None) -> list[Rung]:
    """The `compare` verb: score the ladder, print the table, write <run>/ladder.json."""
    from rich.console import Console

    console = console or Console()
    prompts = list(prompts) if prompts else read_prompts(cfg.prompts, DEMO_PROMPTS)
    rungs = ladder(cfg, prompts, echo=console.print)
    print_ladder(console, rungs, prompts)
    console.print(f"ladder written to {Path(cfg.run_dir) / LADDER_FILE}")
    return rungs
