"""LoRA fine-tuning: one readable loop on accelerate (single device, or DDP under `accelerate launch`)."""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tunesmith.config import TrainConfig, save_config
from tunesmith.data import IGNORE, TokenData, collate, load_data
from tunesmith.device import peak_memory_bytes, resolve_device, resolve_precision, synchronize, weight_dtype
from tunesmith.errors import TunesmithError
from tunesmith.evaluate import EvalResult, evaluate, loss_sum
from tunesmith.lora import attach_lora, trainable_parameters
from tunesmith.models import load_model, load_tokenizer
from tunesmith.report import write_report

CALIBRATION_STEPS = 3  # steps timed before a time budget resizes the run


@dataclass
class TrainResult:
    run_dir: Path
    adapter_dir: Path
    losses: list[float] = field(default_factory=list)  # training loss of every optimizer step
    evals: list[tuple[int, EvalResult]] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0  # supervised tokens trained on
    seconds: float = 0.0
    peak_memory_bytes: int = 0
    trainable_params: int = 0
    model: torch.nn.Module | None = None  # the trained PeftModel, for callers that go on using it


class Schedule:
    """Linear warm-up, then cosine decay to 10% of the peak; the horizon can shrink once (time budget)."""

    def __init__(self, total: int, warmup: int):
        self.total, self.warmup = total, min(warmup, max(total - 1, 0))

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def plan_steps(cfg: TrainConfig, n_examples: int, world: int, batch_size: int) -> tuple[int, int]:
    """(steps per epoch, total optimizer steps)."""
    per_step = batch_size * cfg.grad_accum * world
    per_epoch = max(1, n_examples // per_step)
    if cfg.max_steps is not None:
        if cfg.max_steps < 1:
            raise TunesmithError(f"--max-steps must be >= 1, got {cfg.max_steps}")
        return per_epoch, cfg.max_steps
    if cfg.epochs <= 0:
        raise TunesmithError(f"--epochs must be > 0, got {cfg.epochs}")
    return per_epoch, max(1, math.ceil(cfg.epochs * per_epoch))


def step_examples(order: list[int], step: int, per_step: int, rank: int, world: int) -> list[int]:
    """Indices of this process's examples for an optimizer step; the order wraps around for later epochs."""
    start = step * per_step
    idx = [order[(start + i) % len(order)] for i in range(per_step)]
    return idx[rank::world]


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def train(
    cfg: TrainConfig,
    *,
    model: torch.nn.Module | None = None,
    tokenizer=None,
    data: TokenData | None = None,
    progress: bool = True,
    report: bool = True,
) -> TrainResult:
    """Train a LoRA adapter as `cfg` says. Tests inject a small `model`, `tokenizer` and `data`."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    device = resolve_device(cfg.device)
    precision = resolve_precision(device, cfg.precision)
    if cfg.grad_accum < 1:
        raise TunesmithError(f"--grad-accum must be >= 1, got {cfg.grad_accum}")
    batch_size = cfg.batch_size
    if batch_size == "auto":
        raise TunesmithError("--batch-size auto needs the fit planner (tunesmith fit); give a number")
    run_dir = Path(cfg.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(
        cpu=device.type == "cpu", mixed_precision="no" if precision == "fp32" else precision
    )
    set_seed(cfg.seed)

    if model is None and tokenizer is None:
        tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    if data is None:  # before the weights: bad data fails in seconds, not after a long load
        data = load_data(cfg.data, tokenizer, cfg.seq_len, cfg.val_fraction)
    if model is None:
        model, tokenizer = load_model(cfg.model, accelerator.device, weight_dtype(device, precision), cfg.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0

    set_seed(cfg.seed)  # LoRA init draws from the RNG: same seed, same adapter
    model = attach_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    world, rank = accelerator.num_processes, accelerator.process_index
    per_epoch, total = plan_steps(cfg, len(data.train), world, batch_size)
    schedule = Schedule(total, cfg.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    save_config(cfg, run_dir / "config.yaml")

    result = TrainResult(run_dir, run_dir / "adapter", trainable_params=trainable_parameters(model))
    metrics = (run_dir / "metrics.jsonl").open("w", encoding="utf-8") if accelerator.is_main_process else None
    per_step = batch_size * cfg.grad_accum * world
    bar = _progress(progress and accelerator.is_main_process)
    task = bar.add_task("train", total=total, loss=float("nan"), tps=0.0)
    model.train()
    started = time.perf_counter()
    step = 0
    with bar:
        while step < schedule.total:
            t0 = time.perf_counter()
            epoch = step // per_epoch
            order = epoch_order(len(data.train), cfg.seed, epoch)
            mine = [data.train[i] for i in step_examples(order, step % per_epoch, per_step, rank, world)]
            micro = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
            # Normalise by the supervised tokens of the whole step, so that splitting it into more or fewer
            # micro-batches gives the same gradient.
            n_tokens = max(1, sum(sum(1 for t in lab[1:] if t != IGNORE) for _, lab in mine))
            step_loss = 0.0
            for i, examples in enumerate(micro):
                batch = {k: v.to(accelerator.device) for k, v in collate(examples, pad_id).items()}
                sync = accelerator.no_sync(model) if i < len(micro) - 1 else nullcontext()
                with sync, accelerator.autocast():
                    s, _ = loss_sum(model, batch)
                    loss = s / n_tokens
                    accelerator.backward(loss)
                step_loss += float(loss.detach())
            grad_norm = (
                float(accelerator.clip_grad_norm_(params, cfg.max_grad_norm)) if cfg.max_grad_norm > 0 else float("nan")
            )
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(accelerator.device)
            step += 1
            elapsed = time.perf_counter() - started
            dt = time.perf_counter() - t0
            result.losses.append(step_loss)
            result.tokens += n_tokens * world
            tps = n_tokens * world / dt
            if cfg.time_budget and step == CALIBRATION_STEPS and schedule.total > step:
                # Steps 2..3 are warm; fit the rest of the run into the budget and stretch the schedule to it.
                per = elapsed / step
                fits = max(step + 1, int(cfg.time_budget / per))
                if fits < schedule.total:
                    schedule.total = fits
                    bar.update(task, total=fits)
            if metrics and (step % cfg.log_every == 0 or step == schedule.total):
                row = {"kind": "train", "step": step, "loss": step_loss, "lr": lr, "grad_norm": grad_norm,
                       "tokens": result.tokens, "tokens_per_s": tps, "elapsed_s": elapsed,
                       "peak_mem_bytes": peak_memory_bytes(accelerator.device)}
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            bar.update(task, advance=1, loss=step_loss, tps=tps)
            last = step == schedule.total
            if data.valid and ((cfg.eval_every and step % cfg.eval_every == 0) or last):
                ev = evaluate(model, data.valid, batch_size, cfg.eval_batches, pad_id)
                result.evals.append((step, ev))
                if metrics:
                    metrics.write(json.dumps({"kind": "eval", "step": step, "val_loss": ev.loss,
                                              "val_ppl": ev.perplexity, "val_tokens": ev.tokens}) + "\n")
                    metrics.flush()
                model.train()

    result.steps = step
    result.seconds = time.perf_counter() - started
    result.peak_memory_bytes = peak_memory_bytes(accelerator.device)
    if metrics:
        metrics.close()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(result.adapter_dir, safe_serialization=True)
        if report:  # report.html and a plain-text summary (the demo writes its own, with samples, at the end)
            write_report(run_dir, echo=print if progress else None)
    result.model = accelerator.unwrap_model(model)
    return result


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:.0f} tok/s"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )
