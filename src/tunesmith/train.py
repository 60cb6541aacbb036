"""LoRA fine-tuning: one readable loop on accelerate (single device, or DDP under `accelerate launch`)."""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tunesmith.checkpoint import (
    Checkpointer,
    StopSignals,
    TrainState,
    carry_metrics,
    data_fingerprint,
    restore,
    restore_rng,
)
from tunesmith.config import TrainConfig, save_config
from tunesmith.data import IGNORE, TokenData, collate, describe_data, load_data
from tunesmith.device import (
    enable_mps_fallback,
    free_memory,
    is_oom,
    peak_memory_bytes,
    resolve_device,
    resolve_precision,
    synchronize,
    weight_dtype,
)
from tunesmith.errors import Interrupted, TunesmithError
from tunesmith.evaluate import EvalResult, evaluate, loss_sum
from tunesmith.lora import attach_lora, save_adapter, trainable_parameters
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
    batch_size: int = 0  # micro-batch at the end (out-of-memory recovery may have halved it)
    grad_accum: int = 0  # micro-batches per optimizer step at the end
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
    if device.type == "mps":  # before the first MPS op (the bf16 probe in resolve_precision is one)
        _note(progress, enable_mps_fallback())
    precision = resolve_precision(device, cfg.precision)
    if cfg.grad_accum < 1:
        raise TunesmithError(f"--grad-accum must be >= 1, got {cfg.grad_accum}")
    if cfg.max_bad_steps < 1:
        raise TunesmithError(f"--max-bad-steps must be >= 1, got {cfg.max_bad_steps}")
    run_dir = Path(cfg.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    batch_size = _plan_memory(cfg, device, precision, model, run_dir, progress)  # settles --batch-size auto
    accelerator = Accelerator(
        cpu=device.type == "cpu", mixed_precision="no" if precision == "fp32" else precision
    )
    set_seed(cfg.seed)

    if model is None and tokenizer is None:
        tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    if data is None:  # before the weights: bad data fails in seconds, not after a long load
        data = load_data(cfg.data, tokenizer, cfg.seq_len, cfg.val_fraction)
        if progress and accelerator.is_main_process:
            print(describe_data(data))  # records truncated or dropped, and why
    if model is None:
        model, tokenizer = load_model(cfg.model, accelerator.device, weight_dtype(device, precision), cfg.trust_remote_code,
                                      allow_pickle=cfg.allow_pickle)
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
    main = accelerator.is_main_process
    say = (lambda text: _note(progress, text)) if main else (lambda text: None)
    saver = Checkpointer(run_dir, cfg, device.type, precision, data_fingerprint(data.train), say)
    # Resume restores what the next step depends on: the LoRA weights, AdamW's moments, the schedule (whose horizon
    # a time budget may have cut), the grad scaler, and the step -- which is also the data position, since a step's
    # examples are a pure function of (seed, step). The RNGs are restored last, right before the loop, so dropout
    # draws continue as if the run had never stopped. metrics.jsonl is cut back to the checkpoint's step.
    ckpt = saver.find(cfg.resume) if cfg.resume else None
    if ckpt:
        saver.check_config(ckpt, cfg.on_config_mismatch)
        state = restore(ckpt, accelerator.unwrap_model(model), optimizer, scheduler, accelerator.scaler, schedule,
                        total, cfg.lr, cfg.weight_decay)
        rows = carry_metrics(ckpt, run_dir / "metrics.jsonl") if main else []
        result.losses = [r["loss"] for r in rows if r.get("kind") == "train"]
        say(f"resuming from {ckpt.path} (step {state.step} of {schedule.total})")
    else:
        state = TrainState(schedule_total=total, planned_total=total)
        if main:
            saver.warn_if_replacing()
    metrics = (run_dir / "metrics.jsonl").open("a" if ckpt else "w", encoding="utf-8") if main else None
    per_step = batch_size * cfg.grad_accum * world
    if state.batch_size:  # out-of-memory recovery had halved the micro-batch (the examples per step stay the same)
        batch_size = min(batch_size, state.batch_size)
    bar = _progress(progress and main)
    task = bar.add_task("train", total=schedule.total, completed=state.step, loss=float("nan"), tps=0.0)
    model.train()
    started = time.perf_counter() - state.elapsed
    step, result.tokens, bad_streak = state.step, state.tokens, state.bad_streak
    if ckpt:
        restore_rng(ckpt.state["rng"], device.type)
    with bar, StopSignals() as stop, (metrics or nullcontext()):
        while step < schedule.total:
            t0 = time.perf_counter()
            epoch = step // per_epoch
            order = epoch_order(len(data.train), cfg.seed, epoch)
            mine = [data.train[i] for i in step_examples(order, step % per_epoch, per_step, rank, world)]
            # Normalise by the supervised tokens of the whole step, so that splitting it into more or fewer
            # micro-batches gives the same gradient.
            n_tokens = max(1, sum(sum(1 for t in lab[1:] if t != IGNORE) for _, lab in mine))
            while True:  # out of memory: halve the micro-batch, double the accumulation, redo this step afresh
                try:
                    step_loss = _accumulate(model, accelerator, mine, batch_size, n_tokens, pad_id)
                    break
                except Exception as e:
                    if not is_oom(e):
                        raise
                    if batch_size == 1 or world > 1:
                        raise TunesmithError(_oom_advice(e, step, batch_size, world, cfg.seq_len)) from None
                optimizer.zero_grad(set_to_none=True)  # outside the handler: the traceback's activations are gone
                batch_size = _halve_batch(accelerator.device, step, batch_size, len(mine), bar, progress, metrics)
            # The norm is measured even without clipping (max_norm inf scales by exactly 1): the guard needs it.
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
            grad_norm = float(accelerator.clip_grad_norm_(params, max_norm))
            lr = scheduler.get_last_lr()[0]
            # Non-finite guard: one NaN/inf update would poison the weights and AdamW's moments for good, so the
            # step is skipped (weights, optimizer and schedule untouched) and the data moves on. Under fp16 an inf
            # gradient with a finite loss is the grad scaler's to handle: it skips the update and lowers the scale.
            bad = not math.isfinite(step_loss) or (not math.isfinite(grad_norm) and accelerator.scaler is None)
            if _any_process(accelerator, bad):
                bad_streak += 1
            else:
                optimizer.step()
                scheduler.step()
                bad_streak = 0
            optimizer.zero_grad(set_to_none=True)
            synchronize(accelerator.device)
            step += 1
            elapsed = time.perf_counter() - started
            dt = time.perf_counter() - t0
            if bad_streak:  # logged as a skip, not as a training step; max_bad_steps in a row end the run
                _skipped(step, step_loss, grad_norm, bad_streak, cfg, metrics, say, saver)
            else:
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
            if metrics and not bad_streak and (step % cfg.log_every == 0 or step == schedule.total):
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
            # A checkpoint every N steps, at the end, and when a stop signal came in during this step: the step is
            # complete (all its micro-batches), so weights, optimizer state and data position agree.
            stopping = _any_process(accelerator, stop.signum is not None)
            if last or stopping or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                state = TrainState(step=step, schedule_total=schedule.total, planned_total=total, tokens=result.tokens,
                                   elapsed=time.perf_counter() - started, bad_streak=bad_streak, run_id=state.run_id,
                                   batch_size=batch_size)
                if main:
                    saved = saver.save(state, accelerator.unwrap_model(model), optimizer, scheduler, accelerator.scaler)
                accelerator.wait_for_everyone()
            if stopping and not last:
                raise Interrupted(f"{stop.name or 'signal'} after step {step}: checkpoint {saved if main else saver.root} "
                                  "saved; run the same command with --resume to continue", stop.signum or signal.SIGTERM)

    result.steps = step
    result.batch_size, result.grad_accum = batch_size, -(-per_step // world // batch_size)
    result.seconds = time.perf_counter() - started
    result.peak_memory_bytes = peak_memory_bytes(accelerator.device)
    if metrics:
        metrics.close()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_adapter(accelerator.unwrap_model(model), result.adapter_dir, cfg.model)
        if report:  # report.html and a plain-text summary (the demo writes its own, with samples, at the end)
            write_report(run_dir, echo=print if progress else None)
    result.model = accelerator.unwrap_model(model)
    return result


def _skipped(step: int, loss: float, grad_norm: float, streak: int, cfg: TrainConfig, metrics, say, saver) -> None:
    """Log a step the non-finite guard skipped; after cfg.max_bad_steps in a row, stop with a diagnosis."""
    if metrics:
        row = {"kind": "skip", "step": step, "loss": str(loss), "grad_norm": str(grad_norm), "in_a_row": streak}
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()
    say(f"step {step}: loss {loss:.4g}, gradient norm {grad_norm:.4g}: not finite; step skipped, weights unchanged "
        f"({streak} in a row; the run stops at {cfg.max_bad_steps})")
    if streak >= cfg.max_bad_steps:
        done = saver.complete()
        kept = f"the last checkpoint, {done[0][1]}, is intact" if done else "no checkpoint was saved yet"
        raise TunesmithError(
            f"steps {step - streak + 1}..{step}: the loss or gradient norm was NaN/inf {streak} times in a row "
            f"(last: loss {loss:.4g}, gradient norm {grad_norm:.4g}); stopped, {kept}. Lower --lr (now {cfg.lr:g}), "
            "check the data of those steps, or try --precision fp32; then continue with --resume"
        )


def _any_process(accelerator, flag: bool) -> bool:
    """Whether `flag` holds on any process: every DDP process must take the same branch, or they deadlock."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), reduction="sum").item() > 0)


def _accumulate(model, accelerator, examples: list, batch_size: int, n_tokens: int, pad_id: int) -> float:
    """Forward and backward one optimizer step's examples in micro-batches; returns the step's loss."""
    micro = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
    step_loss = 0.0
    for i, chunk in enumerate(micro):
        batch = {k: v.to(accelerator.device) for k, v in collate(chunk, pad_id).items()}
        sync = accelerator.no_sync(model) if i < len(micro) - 1 else nullcontext()
        with sync, accelerator.autocast():
            s, _ = loss_sum(model, batch)
            loss = s / n_tokens
            accelerator.backward(loss)
        step_loss += float(loss.detach())
    return step_loss


def _halve_batch(device: torch.device, step: int, batch_size: int, examples: int, bar, progress: bool, metrics) -> int:
    """After an out-of-memory error: free the cache, halve the micro-batch, say so; the step is redone."""
    free_memory(device)
    new = batch_size // 2
    accum = -(-examples // new)
    if progress:
        bar.console.print(f"tunesmith: out of memory at step {step + 1}: micro-batch {batch_size} -> {new}, "
                          f"grad-accum -> {accum} (effective batch {examples} unchanged); redoing the step")
    if metrics:
        metrics.write(json.dumps({"kind": "oom", "step": step + 1, "batch_size": new, "grad_accum": accum}) + "\n")
    return new


def _oom_advice(e: BaseException, step: int, batch_size: int, world: int, seq_len: int) -> str:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if world > 1:
        return (f"out of memory at step {step + 1} on one of {world} processes ({first}); recovery needs a single "
                "process: lower --batch-size (see tunesmith fit)")
    return (f"out of memory at step {step + 1} even at micro-batch {batch_size} with --seq-len {seq_len} ({first}). "
            "Try --gradient-checkpointing, a shorter --seq-len, or a smaller model; `tunesmith fit` shows what fits")


def _plan_memory(cfg: TrainConfig, device: torch.device, precision: str, model, run_dir: Path, progress: bool) -> int:
    """Write the planner's prediction to fit.json (the report reads it); 'auto' takes the largest batch that fits."""
    from tunesmith.memory import plan_run, verdict

    auto = cfg.batch_size == "auto"
    config = getattr(model, "config", None)
    if model is not None and config is None:
        if auto:
            raise TunesmithError("--batch-size auto needs a transformers model (the planner reads its config)")
        return cfg.batch_size
    on_device = [] if model is None else [p for p in model.parameters() if p.device.type == device.type]
    resident = sum(p.numel() * p.element_size() for p in on_device)  # weights already loaded: not extra
    try:
        fit = plan_run(cfg, device, precision, config, resident_bytes=resident)
    except TunesmithError as e:
        if auto:
            raise
        _note(progress, f"no memory plan ({e}); training with micro-batch {cfg.batch_size}")
        return cfg.batch_size
    fit.write(run_dir / "fit.json")
    if auto or not fit.fits:
        _note(progress, f"micro-batch {fit.setup.batch_size}: {verdict(fit)}")
    return fit.setup.batch_size


def _note(enabled: bool, text: str) -> None:
    if enabled:
        print(f"tunesmith: {text}", file=sys.stderr, flush=True)


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
