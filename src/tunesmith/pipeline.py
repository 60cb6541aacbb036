"""The demo: the WWDC24 workflow, every stage in order, on the built-in model and data.

load -> generate (before) -> perplexity (before) -> LoRA train -> generate (after) -> perplexity (after)
-> merge and save -> before/after table -> ship: 4-bit .pte + quality ladder. Everything lands in runs/<name>/.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from tunesmith.config import DEMO_PROMPTS, DemoConfig, TrainConfig, fields_of, save_config
from tunesmith.data import IGNORE, check_data_spec, load_data
from tunesmith.device import resolve_device, resolve_precision, weight_dtype
from tunesmith.evaluate import evaluate
from tunesmith.generate import generate
from tunesmith.merge import merge_model
from tunesmith.models import load_model
from tunesmith.report import write_report
from tunesmith.train import check_run_folder, train


@dataclass
class DemoResult:
    run_dir: Path
    ppl_before: float
    ppl_after: float
    samples_before: list[str]
    samples_after: list[str]
    train_steps: int
    train_seconds: float
    wall_seconds: float
    merged_dir: Path

    @property
    def ppl_drop(self) -> float:
        return 1.0 - self.ppl_after / self.ppl_before


def demo(cfg: DemoConfig, console=None) -> DemoResult:
    from rich.console import Console

    console = console or Console()
    started = time.perf_counter()
    run_dir = Path(cfg.output or Path(cfg.runs_dir) / cfg.name)
    train_cfg = TrainConfig(**{f.name: getattr(cfg, f.name) for f in fields_of(TrainConfig)})
    train_cfg = dataclasses.replace(train_cfg, output=str(run_dir))
    check_run_folder(train_cfg)  # a refusal (--no-overwrite) comes now, not after minutes of loading and sampling
    check_data_spec(cfg.data)  # and so does a mistyped --data
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "demo-config.yaml")
    device = resolve_device(cfg.device)
    precision = resolve_precision(device, cfg.precision, training=True)

    console.print(f"[bold]tunesmith demo[/] -> {run_dir}  (device {device}, {precision})")
    t = time.perf_counter()
    model, tokenizer = load_model(cfg.model, device, weight_dtype(device, precision), cfg.trust_remote_code,
                                  allow_pickle=cfg.allow_pickle)
    console.print(f"loaded {cfg.model} in {time.perf_counter() - t:.1f}s")
    data = load_data(cfg.data, tokenizer, cfg.seq_len, cfg.val_fraction)
    console.print(f"data {data.source}: {len(data.train)} training blocks, {len(data.valid)} held out")

    def measure(m) -> tuple[float, list[str]]:
        ev = evaluate(m, data.valid, cfg.batch_size if isinstance(cfg.batch_size, int) else 4, cfg.eval_batches,
                      tokenizer.pad_token_id)
        samples = [
            generate(m, tokenizer, p, max_tokens=cfg.sample_tokens, temperature=cfg.sample_temperature, seed=cfg.seed)
            for p in DEMO_PROMPTS
        ]
        return ev.perplexity, samples

    ppl_before, before = measure(model)
    console.print(f"before: held-out perplexity {ppl_before:.2f}")

    # The demo reruns into the same folder: DemoConfig.overwrite is on, so train replaces the earlier run.
    result = train(train_cfg, model=model, tokenizer=tokenizer, data=data, min_steps=cfg.min_steps)
    tuned = result.model

    ppl_after, after = measure(tuned)
    console.print(f"after:  held-out perplexity {ppl_after:.2f}")
    merged_dir = merge_model(tuned, tokenizer, run_dir / "merged", "float32", {"base_model": cfg.model, "adapter": "adapter"})

    out = DemoResult(run_dir, ppl_before, ppl_after, before, after, result.steps, result.seconds,
                     time.perf_counter() - started, merged_dir)
    _write(out)
    _print_table(console, out)
    if cfg.ship:
        ship(cfg, merged_dir, console, data.train)
    write_report(run_dir, echo=console.out)
    return out


def ship(cfg: DemoConfig, merged_dir: Path, console, train) -> None:
    """The last step: int4 (GPTQ on the training text) -> a 4-bit .pte, then the quality ladder over every artifact."""
    import importlib.util

    from tunesmith.compare import compare, quantized_folder
    from tunesmith.config import CompareConfig, ExportConfig
    from tunesmith.export import export
    from tunesmith.quantize import calibration_blocks

    run_dir = merged_dir.parent
    if any(importlib.util.find_spec(m) is None for m in ("executorch", "torchao")):
        console.print("ship step skipped: the .pte export and the int8/int4 rungs need pip install 'tunesmith[ship]'")
        return
    ladder = CompareConfig(run_dir=str(run_dir), model=cfg.model, data=cfg.data, seq_len=cfg.seq_len,
                           val_fraction=cfg.val_fraction)
    t = time.perf_counter()
    int4 = quantized_folder(run_dir, merged_dir, "int4", ladder.group_size,
                            calibration_blocks(train, ladder.calibration_blocks))
    pte = export(ExportConfig(model=str(int4), format="pte", output=str(run_dir / "exports" / "model-8da4w.pte"),
                              quant="8da4w", group_size=ladder.group_size, max_seq_len=cfg.seq_len))
    console.print(f"int4 (GPTQ) and {pte} ({pte.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f}s")
    compare(ladder, console, prompts=DEMO_PROMPTS)


def write_samples(run_dir: Path, prompts, before: list[str], after: list[str]) -> None:
    """samples.json, the report's before/after section: a {"prompt", "before", "after"} object per prompt."""
    samples = [{"prompt": p, "before": b, "after": a} for p, b, a in zip(prompts, before, after, strict=True)]
    (run_dir / "samples.json").write_text(json.dumps(samples, indent=2), encoding="utf-8")


TRAIN_SAMPLES, TRAIN_SAMPLE_TOKENS = 2, 32  # a train run's report: greedy, short, so they cost seconds


def sample_prompts(data, n: int = TRAIN_SAMPLES, head: int = 16) -> list[list[int]]:
    """Prompts from the held-out examples (else the training ones): a record's prompt (its tokens before the first
    supervised one), or a text block's first `head` tokens."""
    prompts = []
    for ids, labels in (data.valid or data.train)[:n]:
        first = next((i for i, t in enumerate(labels) if t != IGNORE), len(ids))
        prompts.append(list(ids[:first] if first > 0 else ids[:head]))
    return prompts


def sample_train_run(result, max_tokens: int = TRAIN_SAMPLE_TOKENS) -> None:
    """A train run's samples.json and summary.json, for its report. The samples are greedy: the same prompts from
    the trained model with the adapter switched off (PEFT's disable_adapter: the base, as it was before training;
    no second model loaded) and on. Full fine-tuning keeps no base: no samples."""
    from tunesmith.generate import stream_tokens

    model, tokenizer, data = result.model, result.tokenizer, result.data
    summary = {"device": result.device, "precision": result.precision,
               "valid_examples": len(data.valid) if data is not None else None}
    (result.run_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    if model is None or tokenizer is None or data is None or not hasattr(model, "disable_adapter"):
        return
    prompts = sample_prompts(data)

    def run() -> list[str]:
        return ["".join(r.text for r in stream_tokens(model, tokenizer, ids, max_tokens)) for ids in prompts]

    with model.disable_adapter():
        before = run()
    after = run()
    write_samples(result.run_dir, [tokenizer.decode(ids) for ids in prompts], before, after)


def _write(r: DemoResult) -> None:
    write_samples(r.run_dir, DEMO_PROMPTS, r.samples_before, r.samples_after)
    summary = {
        "ppl_before": r.ppl_before, "ppl_after": r.ppl_after, "ppl_drop": r.ppl_drop,
        "train_steps": r.train_steps, "train_seconds": r.train_seconds, "wall_seconds": r.wall_seconds,
        "merged_dir": str(r.merged_dir),
    }
    (r.run_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")


def _print_table(console, r: DemoResult) -> None:
    from rich.table import Table

    table = Table(title="before / after LoRA", show_lines=True)
    table.add_column("prompt", style="bold")
    table.add_column("before")
    table.add_column("after")
    for p, b, a in zip(DEMO_PROMPTS, r.samples_before, r.samples_after, strict=True):
        table.add_row(p.strip(), p + b, p + a)
    table.add_row("held-out perplexity", f"{r.ppl_before:.2f}", f"{r.ppl_after:.2f}  ({r.ppl_drop:.0%} lower)")
    console.print(table)
    console.print(
        f"trained {r.train_steps} steps in {r.train_seconds:.0f}s; whole demo {r.wall_seconds:.0f}s. "
        f"Merged model: {r.merged_dir}"
    )
