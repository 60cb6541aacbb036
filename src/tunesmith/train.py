"""Fine-tuning on accelerate (one device, or several processes: DDP or FSDP2, under --gpus N, torchrun or
`accelerate launch`): LoRA, DoRA, LoRA on a quantized base (QLoRA), or full fine-tuning.

Shaped as litgpt shapes it: `train()` sets up in four named steps (`_place`: device, precision, processes;
`_load`: data and model; `_attach`: the trainable parameters, then the fast paths of `tunesmith.kernels`; `_start`:
optimizer, schedule, a fresh start or the checkpoint's state), runs `train_loop()` -- the loop, readable top to
bottom, each step's parts a function of their own -- and finishes (saves the adapter, undoes the fast paths,
returns the result). Writing the report is the caller's job (the CLI, the demo). The loss and a per-step callback
can be passed in, as in mlx-lm's `train(..., loss=..., training_callback=...)`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tunesmith import kernels
from tunesmith.checkpoint import (
    Checkpoint,
    Checkpointer,
    StopSignals,
    TrainState,
    capture_rng,
    carry_metrics,
    complete_checkpoints,
    data_fingerprint,
    restore,
    restore_rng,
    restore_weights,
    rng_of,
    verify,
)
from tunesmith.config import TrainConfig, save_config, to_dict
from tunesmith.data import (
    IGNORE,
    TokenData,
    check_data_spec,
    collate,
    collate_packed,
    describe_data,
    load_data,
)
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
from tunesmith.distributed import (
    all_sum,
    check_agreement,
    fingerprint,
    from_main,
    fsdp_plugin,
    full_model_state,
    full_optimizer_state,
    full_trainable_state,
    gather,
    is_dist_failure,
    is_sharded,
    launched,
    load_full_optimizer_state,
)
from tunesmith.errors import Interrupted, PeerLost, TunesmithError
from tunesmith.evaluate import EvalResult, eval_rounds, evaluate, loss_sum
from tunesmith.kernels import compiled, liger, offload, recompute
from tunesmith.kernels.base import LossFn, model_type
from tunesmith.kernels.compiled import eager_layers, own_gradients, recomputing
from tunesmith.kernels.liger_loss import liger_available
from tunesmith.kernels.loss import supervised_rows
from tunesmith.lora import attach_lora, save_adapter, trainable_parameters, unfreeze
from tunesmith.models import load_model, load_tokenizer, without_hub_kernels
from tunesmith.progress import Progress, Task
from tunesmith.qlora import BASE_CODES, base_codes, quantized_scheme

CALIBRATION_STEPS = 3  # steps timed before a time budget resizes the run
MAX_BAD_STEPS = 5  # non-finite steps in a row (each skipped) that stop the run
DIST_TIMEOUT = 300.0  # seconds a process waits for the others (TUNESMITH_DIST_TIMEOUT overrides)


@dataclass(frozen=True)
class StepRecord:
    """What the per-step callback is given after every optimizer step."""

    step: int  # optimizer steps done
    loss: float  # this step's training loss
    lr: float  # the learning rate this step used
    grad_norm: float  # before clipping
    tokens: int  # supervised tokens trained on so far (all processes)
    tokens_per_s: float  # this step's
    elapsed: float  # seconds of training so far, earlier processes of a resumed run included
    skipped: bool = False  # the non-finite guard skipped it: weights, optimizer and schedule untouched


Callback = Callable[[StepRecord], Any]


@dataclass
class TrainResult:
    run_dir: Path
    adapter_dir: Path  # the adapter folder; with --fine-tune-type full, the whole model's folder (<run>/model)
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
    main: bool = True  # this is the main process (of one, or of several): the one that writes
    finished: bool = False  # --resume found the run finished already: nothing trained, nothing written
    device: str = ""  # where it trained, and in what precision (resolved: never "auto")
    precision: str = ""
    tokenizer: Any = None  # the run's tokenizer and data, for callers that sample or score the trained model
    data: TokenData | None = None


class Schedule:
    """Linear warm-up, then cosine decay to 10% of the peak; the horizon can shrink once (time budget)."""

    def __init__(self, total: int, warmup: int):
        self.total, self.warmup = total, min(warmup, max(total - 1, 0))

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


class RunLog:
    """metrics.jsonl, the run's one log: train, eval, skip and oom rows, a JSON object per line, each flushed as it
    is written (a kill loses at most the row in progress). A fresh run starts it empty; a resumed run first cuts it
    back to what the checkpoint's run had logged up to the checkpoint's step (`rows`), then appends. Only the main
    process of a DDP run writes; on the others every call is a no-op."""

    def __init__(self, path: Path, resume_from: Checkpoint | None = None, enabled: bool = True):
        self.path, self.rows, self._file = path, [], None
        if enabled:
            if resume_from:
                self.rows = carry_metrics(resume_from, path)
            self._file = path.open("a" if resume_from else "w", encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> None:
        if self._file:
            self._file.write(json.dumps({"kind": kind, **fields}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plan_steps(cfg: TrainConfig, n_examples: int, per_step: int) -> tuple[int, int]:
    """(steps per epoch, total optimizer steps) for `per_step` examples per optimizer step (all processes)."""
    per_epoch = max(1, n_examples // per_step)
    if cfg.max_steps is not None:
        if cfg.max_steps < 1:
            raise TunesmithError(f"--max-steps must be >= 1, got {cfg.max_steps}")
        return per_epoch, cfg.max_steps
    if cfg.epochs <= 0:
        raise TunesmithError(f"--epochs must be > 0, got {cfg.epochs}")
    return per_epoch, max(1, math.ceil(cfg.epochs * per_epoch))


def budget_horizon(budget: float, elapsed: float, step: int, total: int, min_steps: int = 0) -> int:
    """The run's length once `step` steps took `elapsed` seconds: the steps that fit into `budget` seconds at that
    pace, but never fewer than `min_steps` (a slow or busy machine still trains what quality needs) or than the
    next step, and never more than `total` (the flags' horizon)."""
    fits = int(budget / (elapsed / step)) if elapsed > 0 else total
    return min(total, max(step + 1, min_steps, fits))


def step_examples(order: list[int], step: int, per_step: int) -> list[int]:
    """Indices of an optimizer step's examples, all processes together (process r takes every world-th from r);
    the order wraps around for later epochs."""
    start = step * per_step
    return [order[(start + i) % len(order)] for i in range(per_step)]


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def finished_run(cfg: TrainConfig) -> str | None:
    """With --resume (of this run folder) on a run that is finished, with the same length asked for: the line that
    says so (nothing is left to train, and nothing is rewritten); else None."""
    run_dir = Path(cfg.output)
    what = run_dir / ("model" if cfg.fine_tune_type == "full" else "adapter")
    done = complete_checkpoints(run_dir / "checkpoints")
    if cfg.resume is not True or not what.is_dir() or not done:
        return None
    try:
        state = verify(done[0][1]).state  # a damaged newest checkpoint is the resume's to report and fall back from
        saved = state.get("config", {})
        finished = state["step"] >= state["schedule_total"] and all(
            saved.get(k) == getattr(cfg, k) for k in ("max_steps", "epochs", "time_budget"))
    except (OSError, ValueError, KeyError, TypeError, TunesmithError):
        return None
    if not finished:
        return None
    return (f"{run_dir} is finished ({state['step']} of {state['schedule_total']} steps; {what.name} in {what}); "
            "nothing to resume. To train longer, resume with a larger --max-steps; to start over, --overwrite")


def check_run_folder(cfg: TrainConfig) -> list[str]:
    """A fresh run must not silently replace a finished one. Returns what the folder holds of an earlier run (empty:
    nothing); without --resume or --overwrite, a folder that holds one is an error naming both."""
    run_dir = Path(cfg.output)
    if cfg.resume or not run_dir.is_dir():
        return []
    found = ["an adapter"] if (run_dir / "adapter").exists() else []
    done = complete_checkpoints(run_dir / "checkpoints")
    if done:
        found.append(f"checkpoints up to {done[0][1].name}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append("metrics.jsonl")
    if found and not cfg.overwrite:
        raise TunesmithError(
            f"{run_dir} already holds a run ({', '.join(found)}); add --resume to continue it, --overwrite to "
            "replace it, or choose another --output"
        )
    return found


# ------------------------------------------------------------------------------------------------ the run


def train(
    cfg: TrainConfig,
    *,
    model: torch.nn.Module | None = None,
    tokenizer=None,
    data: TokenData | None = None,
    loss: LossFn | None = None,
    callback: Callback | None = None,
    progress: bool = True,
    min_steps: int = 0,
) -> TrainResult:
    """Train as `cfg` says; the adapter lands in <cfg.output>/adapter (full fine-tuning: the model in
    <cfg.output>/model).

    `model`, `tokenizer` and `data` replace loading them (tests pass small ones). `loss(model, batch)` returns the
    summed loss over the batch's supervised tokens and their count (default: the fused loss where a fast path
    provides one, else evaluate.loss_sum). `callback` gets a StepRecord after every optimizer step (its checkpoint,
    if one was due, already saved); an exception it raises ends the run there. `min_steps`: --time-budget never
    cuts the run below this many steps (the demo's floor)."""
    if model is None and (done := finished_run(cfg)):  # (a caller that hands in a model wants it back trained)
        _note(progress, done)
        return TrainResult(Path(cfg.output), Path(cfg.output) / ("model" if cfg.fine_tune_type == "full" else "adapter"),
                           finished=True, main=not launched() or os.environ.get("RANK", "0") == "0")
    fresh = not Path(cfg.output).exists()
    try:
        run = _setup(cfg, model, tokenizer, data, progress)
    except BaseException:
        if fresh and not launched():  # a run that failed before its first step leaves no folder behind
            shutil.rmtree(cfg.output, ignore_errors=True)
        raise
    run.min_steps = min_steps
    with run.log:
        result = TrainResult(run.run_dir, run.run_dir / ("model" if cfg.fine_tune_type == "full" else "adapter"),
                             trainable_params=trainable_parameters(run.model),
                             losses=[r["loss"] for r in run.log.rows if r.get("kind") == "train"])
        try:
            with recomputing(run.applied.took(recompute.PATH) and run.applied.took(compiled.PATH)):
                # (layers compile at their first call, inside the loop)
                train_loop(cfg, run, result, loss or run.applied.loss or loss_sum, callback,
                           progress and run.accelerator.is_main_process)
        except Exception as e:
            if run.accelerator.num_processes == 1 or not is_dist_failure(e):
                raise
            raise PeerLost(_peer_lost(e, run)) from None
    result.main = run.accelerator.is_main_process
    result.device, result.precision = str(run.accelerator.device), _precision(run.accelerator)
    result.tokenizer, result.data = run.tokenizer, run.data
    return _finish(cfg, run, result)


@dataclass
class Place:
    """Where a run trains: the device, precision and processes, decided before anything loads."""

    run_dir: Path
    accelerator: Any
    device: torch.device
    precision: str
    fsdp: bool  # several processes under FSDP2
    batch_size: int  # the micro-batch (the fit planner's, with --batch-size auto)
    earlier: list[str]  # what the folder holds of an earlier run that --overwrite replaces
    say: Callable[[str], None]  # a note on stderr, from the main process only
    progress: bool  # progress output on this process

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def world(self) -> int:
        return self.accelerator.num_processes


@dataclass
class Run:
    """What set-up hands the loop: the prepared objects and where the run stands (fresh, or resumed)."""

    run_dir: Path
    accelerator: Any
    device: torch.device
    model: torch.nn.Module  # prepared by accelerate (DDP-wrapped under `accelerate launch`)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    schedule: Schedule  # the LR multiplier; its horizon is what a time budget cuts
    params: list[torch.nn.Parameter]  # the trainable parameters (LoRA's, or the model's own with full)
    data: TokenData
    tokenizer: Any  # saved beside a fully fine-tuned model
    pad_id: int
    planned_total: int  # the horizon the flags asked for
    per_epoch: int  # optimizer steps per pass over the data
    per_step: int  # examples per optimizer step, all processes together
    batch_size: int  # the micro-batch (out-of-memory recovery halves it)
    saver: Checkpointer
    state: TrainState  # step, tokens, elapsed... as the checkpoint left them, or zero
    ckpt: Checkpoint | None  # the checkpoint resumed from
    log: RunLog  # metrics.jsonl, open (and on resume already cut back to the checkpoint's step)
    say: Callable[[str], None]  # a note on stderr, from the main process only
    applied: kernels.Applied = field(default_factory=kernels.Applied)  # the fast paths taken, undone at the end
    packed: bool = False  # micro-batches of records of different lengths packed into fewer rows
    graphed: bool = False  # the decoder layers replay as CUDA graphs
    skip_on_device: bool = False  # the non-finite guard's skip taken by the fused AdamW kernel (no sync before it)
    min_steps: int = 0  # the time budget's floor


def _setup(cfg: TrainConfig, model, tokenizer, data: TokenData | None, progress: bool) -> Run:
    """Set-up in four steps: where the run trains; the model and data; the trainable parameters and the fast
    paths; then a fresh start or the checkpoint's state."""
    place = _place(cfg, model, data, progress)
    model, tokenizer, data, fingerprint = _load(cfg, place, model, tokenizer, data)
    model, labels = _attach(cfg, model)
    varied = len({len(ids) for ids, _ in data.train}) > 1
    setting = kernels.Setting(cfg, place.device.type, place.world, place.fsdp, varied)
    if cfg.gradient_checkpointing:  # transformers' checkpointing, unless tunesmith's checkpointed layers take over
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if liger.PATH.wanted(setting, model) and not liger_available():
        place.say("liger-kernel is not installed: pip install 'tunesmith[cuda]' for its Triton kernels")
    applied = kernels.apply_paths(model, setting)
    if cfg.gradient_checkpointing and not applied.took(offload.PATH):
        model.enable_input_require_grads()  # transformers' checkpoint needs each layer's input to require grad
    if cfg.gradient_checkpointing == "offload" and not (applied.took(offload.PATH) and place.device.type == "cuda"):
        place.say("--gradient-checkpointing offload: layer inputs go to pinned host memory in a one-process run on a "
                  "CUDA GPU; here they stay on the device, as with --gradient-checkpointing on")
    graphed = applied.took(compiled.PATH) and setting.graphs
    packed = packs_records(setting, model, data)
    labels += applied.labels + (["packed records"] if packed else [])
    labels += ["FSDP2"] if place.fsdp else ["DDP"] if place.world > 1 else []
    return _start(cfg, place, model, tokenizer, data, fingerprint, applied, (packed, graphed), labels)


def _place(cfg: TrainConfig, model, data: TokenData | None, progress: bool) -> Place:
    """The device, precision, processes and micro-batch; refusals come here, before anything is written."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    several = launched()
    earlier = check_run_folder(cfg)  # before anything is written: a refusal leaves the folder as it was
    if data is None:
        check_data_spec(cfg.data)  # a mistyped --data fails now, not after the model's conversion or load
    device = resolve_device(cfg.device)
    if device.type == "mps":  # before the first MPS op (the bf16 probe in resolve_precision is one)
        _note(progress, enable_mps_fallback())
    fsdp = several and cfg.strategy == "fsdp"
    if fsdp and device.type != "cuda":
        raise TunesmithError(f"--strategy fsdp shards over CUDA GPUs; on {device.type} use --strategy ddp")
    if fsdp and cfg.quantize_base != "none":
        raise TunesmithError("--quantize-base with --strategy fsdp: a quantized base is not sharded; use "
                             "--strategy ddp (each GPU holds the small quantized base), or drop --quantize-base")
    precision = resolve_precision(device, cfg.precision, training=True)
    run_dir = Path(cfg.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    # A process that dies leaves the others waiting at the next collective: the timeout turns that wait into an
    # error (and under --gpus the launcher stops them at once).
    accelerator = Accelerator(
        cpu=device.type == "cpu", mixed_precision="no" if precision == "fp32" else precision,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=dist_timeout()))],
        **({"fsdp_plugin": fsdp_plugin()} if fsdp else {}),
    )
    main, world = accelerator.is_main_process, accelerator.num_processes
    batch_size = _plan_memory(cfg, device, precision, model, run_dir, progress and main, main, world)
    say = (lambda text: _note(progress, text)) if main else (lambda text: None)
    if os.environ.get("ACCELERATE_USE_CPU") and not several:  # a user who asked accelerate for several got one
        say("accelerate launch --cpu started one process (its multi-CPU mode needs MPI); for N processes on this "
            "CPU run tunesmith train --gpus N --device cpu")
    set_seed(cfg.seed)
    return Place(run_dir, accelerator, device, precision, fsdp, batch_size, earlier, say, progress and main)


def _load(cfg: TrainConfig, place: Place, model, tokenizer, data: TokenData | None) -> tuple:
    """The tokenizer and data (first: bad data fails in seconds, not after a long load), then the model: loaded,
    or the one handed in; with --quantize-base its base quantized, with --base-calibration calibrated."""
    if model is None and tokenizer is None:
        tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    if data is None:
        data = load_data(cfg.data, tokenizer, cfg.seq_len, cfg.val_fraction)
        if place.progress:
            print(describe_data(data))  # records truncated or dropped, and why
    _small_data_hint(cfg, data, place.say)
    fingerprint = data_fingerprint(data.train)
    # Every process must train the same thing: one error now, not gradients of different runs averaged.
    check_agreement(place.accelerator, config=config_fingerprint(cfg), data=fingerprint)
    # Full fine-tuning keeps fp32 master weights (bf16/fp16 run under autocast): updates smaller than a bf16
    # weight's rounding step would otherwise be lost. A frozen base may sit in the compute dtype, or quantized.
    dtype = torch.float32 if cfg.fine_tune_type == "full" else weight_dtype(place.device, place.precision)
    # --base-calibration: the base loads at full precision once, and GPTQ chooses its codes on the training data;
    # a resumed run loads it rounded to nearest and takes the codes its checkpoint saved (_start); an injected
    # model that is already quantized is taken as it is
    calibrate = cfg.base_calibration > 0 and not cfg.resume and not (model is not None and quantized_scheme(model))
    if calibrate and place.world > 1:
        raise TunesmithError("--base-calibration runs in a one-process run (each process would calibrate on its "
                             "own): calibrate with one process and --max-steps 1, then --resume it with --gpus")
    if model is None:  # under FSDP2 into CPU memory: sharding moves each process's part onto its GPU
        model, tokenizer = load_model(cfg.model, torch.device("cpu") if place.fsdp else place.accelerator.device,
                                      dtype, cfg.trust_remote_code, allow_pickle=cfg.allow_pickle,
                                      quantize_base="none" if calibrate else cfg.quantize_base)
    else:
        _prepare_given(cfg, model, dtype, calibrate)
    if calibrate:
        from tunesmith.qlora import calibrate_base

        blocks = [list(ids) for ids, _ in data.train[: cfg.base_calibration]]
        calibrate_base(model, cfg.quantize_base, blocks, place.progress)
    return model, tokenizer, data, fingerprint


SMALL_DATA = 200  # training examples below which the defaults learn a style slowly (README: small data)


def _small_data_hint(cfg: TrainConfig, data: TokenData, say) -> None:
    """On a small training set at the default rate and targets, say what learned one: a hint, not a changed default
    (on more data the defaults are the safer choice)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in ("lr", "lora_targets")}
    if len(data.train) >= SMALL_DATA or cfg.fine_tune_type == "full" or cfg.lr != defaults["lr"]:
        return
    targets = "" if cfg.lora_targets == ["all-linear"] else " --lora-targets all-linear"
    say(f"{len(data.train)} training examples: with so few, the default --lr {cfg.lr:g} learns slowly; "
        f"--lr 1e-3{targets} and a few epochs learned a 40-example style in 40 steps (README: small data)")


def _prepare_given(cfg: TrainConfig, model, dtype: torch.dtype, calibrate: bool) -> None:
    """A model handed in: its own forwards back (it may be kernelized: models.NO_HUB_KERNELS), its base quantized
    as --quantize-base says, or, for full fine-tuning, fp32 master weights."""
    without_hub_kernels(model)
    if cfg.quantize_base != "none" and not calibrate:
        from tunesmith.qlora import quantize_base

        quantize_base(model, cfg.quantize_base)
    elif cfg.fine_tune_type == "full" and any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        model.to(dtype)


def _attach(cfg: TrainConfig, model) -> tuple[torch.nn.Module, list[str]]:
    """The trainable parameters: LoRA's or DoRA's (PEFT), or the model's own (full fine-tuning); and what the start
    line says of them."""
    from accelerate.utils import set_seed

    labels = [f"{cfg.quantize_base} base"] if cfg.quantize_base != "none" else []
    set_seed(cfg.seed)  # LoRA init draws from the RNG: same seed, same adapter
    if cfg.fine_tune_type == "full":
        unfreeze(model, cfg.num_layers)
        labels.append("full fine-tuning" + (f" of the last {cfg.num_layers} layers" if cfg.num_layers > 0 else ""))
        return model, labels
    model = attach_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets,
                        dora=cfg.fine_tune_type == "dora", num_layers=cfg.num_layers)
    return model, labels + (["DoRA"] if cfg.fine_tune_type == "dora" else [])


def _start(cfg: TrainConfig, place: Place, model, tokenizer, data: TokenData, fingerprint: str,
           applied: kernels.Applied, packed_graphed: tuple[bool, bool], labels: list[str]) -> Run:
    """Optimizer, schedule and accelerate's wrapping; then the checkpoint's state restored, or a fresh start; the
    run log opened and the start line said."""
    acc, world = place.accelerator, place.world
    saver = Checkpointer(place.run_dir, cfg, place.device.type, place.precision, fingerprint, place.say)
    ckpt = _checkpoint_to_resume(cfg, saver, model)
    per_step = _examples_per_step(cfg, ckpt, place.batch_size, world, place.say)
    if ckpt and place.fsdp:  # sharding then splits the restored weights; the optimizer's moments follow below
        restore_weights(ckpt, model)
    params = [p for p in model.parameters() if p.requires_grad]
    trainable, every = sum(p.numel() for p in params), sum(p.numel() for p in model.parameters())
    optimizer, what = make_optimizer(cfg, params, place.device)
    per_epoch, total = plan_steps(cfg, len(data.train), per_step)
    schedule = Schedule(total, cfg.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    # The scheduler stays outside accelerate: its wrapper would step it once per process, and the cosine decay
    # would run world times too fast.
    model, optimizer = acc.prepare(model, optimizer)
    params = [p for p in model.parameters() if p.requires_grad]  # FSDP2 replaced them with sharded ones
    if place.main:
        save_config(cfg, place.run_dir / "config.yaml")
    state = _restored_state(cfg, place, ckpt, model, optimizer, scheduler, schedule, total)
    _replace_earlier(place)
    log = RunLog(place.run_dir / "metrics.jsonl", ckpt, enabled=place.main)
    if ckpt:
        place.say(f"resuming from {ckpt.path} (step {state.step} of {schedule.total})")
    # Set-up is done: say what trains, where, at what precision (the one line a user checks first)
    on = f"{acc.device.type} x {world} processes" if world > 1 else f"{acc.device}"
    labels += [what] if what else []
    place.say(f"training on {on} in {place.precision}: {trainable:,} trainable parameters, {trainable / every:.2%} "
              f"of {every:,}" + (f"; {', '.join(labels)}" if labels else ""))
    batch_size = min(place.batch_size, state.batch_size or place.batch_size)  # out-of-memory recovery halved it
    batch_size = min(batch_size, per_step // world)
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    return Run(place.run_dir, acc, place.device, model, optimizer, scheduler, schedule, params, data, tokenizer,
               pad_id, total, per_epoch, per_step, batch_size, saver, state, ckpt, log, place.say, applied,
               *packed_graphed, skips_on_device(optimizer, acc))


def _checkpoint_to_resume(cfg: TrainConfig, saver: Checkpointer, model) -> Checkpoint | None:
    """With --resume, the checkpoint to continue (its settings compared with these), its calibrated base codes
    applied to the model; else None."""
    if not cfg.resume:
        return None
    ckpt = saver.find(cfg.resume)
    saver.check_config(ckpt)
    if cfg.base_calibration or (ckpt.path / BASE_CODES).is_file():
        from tunesmith.qlora import apply_base_codes

        if not (ckpt.path / BASE_CODES).is_file():
            raise TunesmithError(f"--resume {ckpt.path}: --base-calibration is set, but the checkpoint holds no "
                                 f"calibrated codes ({BASE_CODES}); resume with the checkpoint's settings")
        apply_base_codes(model, ckpt.path / BASE_CODES)
    return ckpt


def _restored_state(cfg: TrainConfig, place: Place, ckpt: Checkpoint | None, model, optimizer, scheduler,
                    schedule: Schedule, total: int) -> TrainState:
    """Resume restores what the next step depends on: the trainable weights, AdamW's moments, the schedule (whose
    horizon a time budget may have cut), the grad scaler, and the step -- which is also the data position, since
    a step's examples are a pure function of (seed, step). The RNGs are restored by the loop, right before its
    first step, so dropout draws continue as if the run had never stopped."""
    if not ckpt:
        return TrainState(schedule_total=total, planned_total=total)
    acc = place.accelerator
    unwrapped = acc.unwrap_model(model)
    load_moments = (lambda sd: load_full_optimizer_state(unwrapped, optimizer, sd)) if place.fsdp else None
    return restore(ckpt, unwrapped, optimizer, scheduler, acc.scaler, schedule, total, cfg.lr, cfg.weight_decay,
                   load_moments)


def _replace_earlier(place: Place) -> None:
    """--overwrite, once set-up has worked: nothing of the earlier run may pass for this one's."""
    if place.earlier and place.main:
        place.say(f"--overwrite: replacing the run in {place.run_dir} ({', '.join(place.earlier)})")
        for name in ("adapter", "checkpoints", "metrics.jsonl", "report.html"):
            _delete(place.run_dir / name)
    place.accelerator.wait_for_everyone()  # no process writes into the folder before the replaced run is gone


def _examples_per_step(cfg: TrainConfig, ckpt: Checkpoint | None, batch_size: int, world: int, say) -> int:
    """Examples per optimizer step, all processes together: micro-batch x grad-accum x processes; a resumed run
    keeps its checkpoint's, so that resuming on another number of processes trains on the same examples per step."""
    per_step = batch_size * cfg.grad_accum * world
    saved, saved_world = (ckpt.state.get("per_step"), ckpt.state.get("world")) if ckpt else (None, None)
    if not saved or saved_world in (None, world):
        return int(saved or per_step)
    if saved % world:
        raise TunesmithError(
            f"--resume: the checkpoint's {saved_world}-process run took {saved} examples per step, which {world} "
            f"processes cannot split evenly; resume on a number of processes that divides {saved}"
        )
    mine = saved // world
    micro = min(batch_size, mine)
    say(f"resuming a {saved_world}-process run on {world}: each step still trains on the same {saved} examples "
        f"({mine} per process, micro-batch {micro} x {-(-mine // micro)}), so the losses follow the uninterrupted "
        "run's up to floating-point summation order; dropout's random draws differ from it"
        + (", each process continuing process 0's random state" if world > 1 else ""))
    return saved


def train_loop(cfg: TrainConfig, run: Run, result: TrainResult, loss: LossFn = loss_sum,
               callback: Callback | None = None, progress: bool = True) -> None:
    """The loop: optimizer steps from where set-up left the run (step 0, or the checkpoint's) to the end of the
    schedule. Fills `result` and writes the run log; a stop signal ends it with a checkpoint and Interrupted."""
    acc, schedule, state = run.accelerator, run.schedule, run.state
    rank, world = acc.process_index, acc.num_processes
    bar = Progress(progress)  # a bar on a terminal; plain lines every INTERVAL seconds in a log file
    task = bar.task("train", schedule.total, state.step)
    run.model.train()
    started = time.perf_counter() - state.elapsed  # elapsed counts the earlier processes of a resumed run
    step, result.tokens, bad_streak = state.step, state.tokens, state.bad_streak
    if run.ckpt:  # last thing before the first step: nothing in set-up may draw from them after this
        restore_rng(rng_of(run.ckpt, rank, world), run.device.type)
    ahead = None  # the next step's examples, and its micro-batches already on their way to the device
    with bar, StopSignals() as stop:
        while step < schedule.total:
            t0 = time.perf_counter()
            mine, n_tokens, ready = _step_examples(run, cfg.seed, step, ahead)
            step_loss = _forward_backward(cfg, run, step, mine, n_tokens, loss, ready, bar, progress)
            lr = float(run.scheduler.get_last_lr()[0])  # the rate this step uses (a tensor under torchao's optimizers)
            following = partial(_Ahead.make, run, cfg.seed, step + 1) if step + 1 < schedule.total else None
            step_loss, grad_norm, bad, ahead = _optimizer_step(cfg, run, step_loss, following)
            bad_streak = bad_streak + 1 if bad else 0
            synchronize(acc.device)  # an accelerator runs ahead of Python: time the step, not its launch
            step += 1
            now = time.perf_counter()
            elapsed, tps = now - started, n_tokens / (now - t0)
            if bad_streak:  # logged as a skip, not as a training step; MAX_BAD_STEPS in a row end the run
                _skipped(step, step_loss, grad_norm, bad_streak, cfg, run)
            else:
                result.losses.append(step_loss)
                result.tokens += n_tokens
                run.log.write("train", step=step, loss=step_loss, lr=lr, grad_norm=grad_norm,
                              tokens=result.tokens, tokens_per_s=tps, elapsed_s=elapsed,
                              peak_mem_bytes=peak_memory_bytes(acc.device))
            _fit_budget(cfg, run, step, elapsed, task)
            task.advance(info=f"loss {step_loss:.4f}, {tps:,.0f} tok/s")
            last = step == schedule.total
            _evaluate(cfg, run, result, step, last, bar)
            # Every process must agree to stop, or the others would wait for it forever.
            stopping = _any_process(acc, stop.signum is not None)
            state = TrainState(step=step, schedule_total=schedule.total, planned_total=run.planned_total,
                               tokens=result.tokens, elapsed=time.perf_counter() - started, bad_streak=bad_streak,
                               run_id=state.run_id, batch_size=run.batch_size, per_step=run.per_step, world=world)
            saved = _checkpoint(cfg, run, state, last or stopping)
            if callback:
                callback(StepRecord(step, step_loss, lr, grad_norm, result.tokens, tps, elapsed, bool(bad_streak)))
            if stopping and not last:
                raise Interrupted(f"{stop.name or 'signal'} after step {step}: checkpoint {saved or run.saver.root} "
                                  "saved; run the same command with --resume to continue", stop.signum or signal.SIGTERM)
    result.steps = step
    result.batch_size, result.grad_accum = run.batch_size, -(-run.per_step // world // run.batch_size)
    result.seconds = time.perf_counter() - started


def _step_examples(run: Run, seed: int, step: int, ahead: _Ahead | None) -> tuple[list, int, list | None]:
    """This process's examples of `step`, the step's supervised tokens (all processes) and its micro-batches where
    they were made ahead (at the current micro-batch size)."""
    if ahead is not None and ahead.step == step:
        return ahead.examples, ahead.n_tokens, ahead.batches if ahead.batch_size == run.batch_size else None
    acc = run.accelerator
    mine, n_tokens = _examples_of(run, seed, step, acc.process_index, acc.num_processes)
    return mine, n_tokens, None


def _forward_backward(cfg: TrainConfig, run: Run, step: int, mine: list, n_tokens: int, loss: LossFn,
                      ready: list | None, bar, progress: bool) -> torch.Tensor:
    """The step's forward and backward passes; out of memory: halve the micro-batch, double the accumulation, and
    redo the step (one process only: several would have to agree on it)."""
    acc = run.accelerator
    while True:
        try:
            return _accumulate(run.model, acc, mine, run.batch_size, n_tokens, run.pad_id, loss, run.graphed, ready,
                               run.packed)
        except Exception as e:
            if not is_oom(e):
                raise
            if run.batch_size == 1 or acc.num_processes > 1:
                raise TunesmithError(_oom_advice(e, step, run.batch_size, acc.num_processes, cfg.seq_len)) from None
        ready = None
        run.optimizer.zero_grad(set_to_none=True)  # outside the handler: the traceback's activations are gone
        run.batch_size = _halve_batch(acc.device, step, run.batch_size, len(mine), bar, progress, run.log)


def _optimizer_step(cfg: TrainConfig, run: Run, step_loss: torch.Tensor, following: Callable | None
                    ) -> tuple[float, float, bool, _Ahead | None]:
    """Clip, then update unless the step is not finite; returns the step's loss, gradient norm, whether it was
    skipped, and the next step made ahead (or None).

    Non-finite guard: one NaN/inf update would poison the weights and AdamW's moments for good, so the step is
    skipped (weights, optimizer and schedule untouched) and the data moves on. Under fp16 an inf gradient with a
    finite loss is the grad scaler's to handle: it skips the update and lowers the scale. Loss and norm are the same
    on every process (summed; synchronized gradients), and so is the verdict. Where the fused AdamW kernel can take
    the verdict itself (`skips_on_device`), Python launches the update while the device is still in the backward
    pass, makes the next step's micro-batches (`following()`), and the step's one wait is for the loss and norm."""
    acc = run.accelerator
    # The norm is measured even without clipping (max_norm inf scales by exactly 1): the guard needs it.
    norm = acc.clip_grad_norm_(run.params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
    ahead = None
    if run.skip_on_device:
        stats = _step_on_device(run.optimizer, step_loss, norm)
        ahead = following() if following is not None else None
        loss, grad_norm = stats.tolist()
        bad = not (math.isfinite(loss) and math.isfinite(grad_norm))
    else:
        loss = all_sum(acc, [float(step_loss)])[0]  # the processes' shares of the step's loss
        grad_norm = _as_float(norm)
        bad = not math.isfinite(loss) or (not math.isfinite(grad_norm) and acc.scaler is None)
        if not bad:
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    if not bad:
        run.scheduler.step()
    return loss, grad_norm, bad, ahead


def _step_on_device(optimizer, step_loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """The optimizer step, skipped by the fused kernel when the loss or the gradient norm is not finite. Returns
    [loss, norm] on the device, for the caller's one host sync of the step."""
    stats = torch.stack([step_loss.double(), norm.double()])
    inner = getattr(optimizer, "optimizer", optimizer)
    inner.found_inf = (~torch.isfinite(stats)).any().float()  # what GradScaler hands the fused kernels
    try:
        optimizer.step()
    finally:
        del inner.found_inf
    optimizer.zero_grad(set_to_none=True)
    return stats


def _fit_budget(cfg: TrainConfig, run: Run, step: int, elapsed: float, task: Task) -> None:
    """After step CALIBRATION_STEPS (warm): fit the run into --time-budget (never below the demo's --min-steps) and
    let the cosine decay end at the new horizon. The main process's pace decides, or the processes would plan
    different lengths."""
    if not (cfg.time_budget and step == CALIBRATION_STEPS and run.schedule.total > step):
        return
    fits = budget_horizon(cfg.time_budget, elapsed, step, run.schedule.total, run.min_steps)
    run.schedule.total = from_main(run.accelerator, fits)
    task.resize(run.schedule.total)


def _evaluate(cfg: TrainConfig, run: Run, result: TrainResult, step: int, last: bool, bar: Progress) -> None:
    """Every --eval-every steps and at the end, where there is validation data: loss and perplexity on the first
    --eval-batches batches of the split (0: all of it), logged. A bar while it runs; in a log file, lines only when
    it runs longer than the progress interval."""
    if not run.data.valid or not (last or (cfg.eval_every and step % cfg.eval_every == 0)):
        return
    acc = run.accelerator
    unwrapped = acc.unwrap_model(run.model)
    batches = eval_rounds(len(run.data.valid), run.batch_size, cfg.eval_batches, acc.num_processes)
    task = bar.task("evaluate", batches, first=False)
    # graphed layers are recorded for training; evaluation (no gradients) runs them eagerly
    with eager_layers(unwrapped) if run.graphed else nullcontext():
        ev = evaluate(unwrapped, run.data.valid, run.batch_size, cfg.eval_batches, run.pad_id,
                      (acc.process_index, acc.num_processes), lambda v: all_sum(acc, v), task.advance,
                      run.applied.loss or loss_sum)
    task.remove()
    result.evals.append((step, ev))
    run.log.write("eval", step=step, val_loss=ev.loss, val_ppl=ev.perplexity, val_tokens=ev.tokens)
    run.model.train()


def _checkpoint(cfg: TrainConfig, run: Run, state: TrainState, due: bool) -> Path | None:
    """A checkpoint every --checkpoint-every steps, at the end, and when a stop signal came in during the step
    (`due`): the step is complete (all its micro-batches), so weights, optimizer state and data position agree.
    Every process's RNG, and under FSDP2 the whole weights and moments: collectives, then the main process
    writes. Returns the folder written (None on the other processes, or when none was due)."""
    if not (due or (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0)):
        return None
    acc = run.accelerator
    unwrapped = acc.unwrap_model(run.model)
    rngs = gather(acc, capture_rng(run.device.type))
    weights, moments = full_trainable_state(unwrapped), full_optimizer_state(unwrapped, run.optimizer)
    saved = None
    if acc.is_main_process:
        saved = run.saver.save(state, unwrapped, run.optimizer, run.scheduler, acc.scaler, rng_ranks=rngs,
                               trainable=weights, optimizer_state=moments)
    acc.wait_for_everyone()
    return saved


def _finish(cfg: TrainConfig, run: Run, result: TrainResult) -> TrainResult:
    """Save the adapter (from the main process, once every process is done), undo the fast paths and hand back
    the trained model."""
    acc = run.accelerator
    result.peak_memory_bytes = peak_memory_bytes(acc.device)
    acc.wait_for_everyone()
    model = acc.unwrap_model(run.model)
    # Under FSDP2 the weights are gathered whole onto the main process first (every process takes part): the
    # folder is the same plain one that a single device writes.
    if cfg.fine_tune_type == "full":
        weights = full_model_state(model)
        if acc.is_main_process:
            save_model(model, run.tokenizer, result.adapter_dir, cfg.model, state_dict=weights)
    else:
        weights = full_trainable_state(model) if is_sharded(model) else None
        if acc.is_main_process:  # records the model it needs, and how its base was held
            save_adapter(model, result.adapter_dir, cfg.model, cfg.quantize_base, state_dict=weights,
                         base_codes=base_codes(model) if cfg.base_calibration else None)
    acc.wait_for_everyone()
    result.model = run.applied.undo(model)
    return result


# ------------------------------------------------------------------------------------------------ helpers


def make_optimizer(cfg: TrainConfig, params: list, device: torch.device) -> tuple[torch.optim.Optimizer, str]:
    """AdamW (torch's fused kernel on CUDA with the fast paths on), or torchao's AdamW8bit; and what the start line
    says of it."""
    if cfg.optimizer == "adamw8bit":
        try:
            from torchao.optim import AdamW8bit
        except ImportError:
            from tunesmith.errors import missing_extra

            raise missing_extra("torchao", "qlora", "--optimizer adamw8bit") from None
        return AdamW8bit(params, lr=cfg.lr, weight_decay=cfg.weight_decay), "8-bit AdamW"
    fused = cfg.fast_paths == "auto" and device.type == "cuda"  # one kernel for every trainable tensor's update
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)
    return optimizer, "fused AdamW" if fused else ""


def save_model(model, tokenizer, folder: Path, base_spec: str, state_dict: dict | None = None) -> Path:
    """A fully fine-tuned model: a plain HF folder (safetensors, config, tokenizer) that every verb loads."""
    from tunesmith.storage import atomic_folder

    with atomic_folder(folder) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": state_dict} if state_dict else {}))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "tunesmith-train.json").write_text(json.dumps({"base_model": base_spec, "fine_tune_type": "full"},
                                                             indent=2) + "\n", encoding="utf-8")
    return folder


def dist_timeout() -> float:
    """Seconds a process waits for the others at a synchronisation point before it stops with an error (a process
    that died does not leave the rest hanging): $TUNESMITH_DIST_TIMEOUT, else DIST_TIMEOUT."""
    raw = os.environ.get("TUNESMITH_DIST_TIMEOUT", "")
    try:
        value = float(raw) if raw else DIST_TIMEOUT
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise TunesmithError(f"TUNESMITH_DIST_TIMEOUT must be a number of seconds > 0, got {raw!r}")
    return value


PACKED_MODEL_TYPES = ("llama",)  # packed position_ids verified to keep each example to itself (tests)


def packs_records(setting: kernels.Setting, model, data: TokenData | None) -> bool:
    """Whether micro-batches are packed (data.collate_packed): training data of different lengths (.jsonl records;
    text blocks are all --seq-len long and gain nothing), a Llama-family model, eager layers (packed rows change
    shape from batch to batch, which compiled layers and CUDA graphs would recompile for), the fast paths on."""
    if not setting.auto or setting.compiled or data is None or not setting.varied:
        return False
    return model_type(model) in PACKED_MODEL_TYPES


def skips_on_device(optimizer, accelerator) -> bool:
    """Whether the non-finite guard can run on the device: torch's fused AdamW (whose kernel skips an update it is
    told is bad), one process (several must reduce the loss first) and no fp16 grad scaler (which has its own)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return (type(inner) is torch.optim.AdamW and bool(inner.defaults.get("fused")) and accelerator.num_processes == 1
            and accelerator.scaler is None)


def _skipped(step: int, loss: float, grad_norm: float, streak: int, cfg: TrainConfig, run: Run) -> None:
    """Log a step the non-finite guard skipped; after MAX_BAD_STEPS in a row, stop with a diagnosis."""
    run.log.write("skip", step=step, loss=str(loss), grad_norm=str(grad_norm), in_a_row=streak)
    run.say(f"step {step}: loss {loss:.4g}, gradient norm {grad_norm:.4g}: not finite; step skipped, weights "
            f"unchanged ({streak} in a row; the run stops at {MAX_BAD_STEPS})")
    if streak >= MAX_BAD_STEPS:
        done = run.saver.complete()
        kept = f"the last checkpoint, {done[0][1]}, is intact" if done else "no checkpoint was saved yet"
        raise TunesmithError(
            f"steps {step - streak + 1}..{step}: the loss or gradient norm was NaN/inf {streak} times in a row "
            f"(last: loss {loss:.4g}, gradient norm {grad_norm:.4g}); stopped, {kept}. Lower --lr (now {cfg.lr:g}), "
            "check the data of those steps, or try --precision fp32; then continue with --resume"
        )


def config_fingerprint(cfg: TrainConfig) -> str:
    return fingerprint(to_dict(cfg))


def _as_float(norm) -> float:
    """A gradient norm as a float (under FSDP2 a DTensor, whole once asked for)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _any_process(accelerator, flag: bool) -> bool:
    """Whether `flag` holds on any process: every DDP process must take the same branch, or they deadlock."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), reduction="sum").item() > 0)


@dataclass
class _Ahead:
    """A step's examples (this process's share), its supervised-token count and its micro-batches, made early."""

    step: int
    examples: list
    n_tokens: int
    batch_size: int
    batches: list

    @classmethod
    def make(cls, run: Run, seed: int, step: int) -> _Ahead:
        acc = run.accelerator
        examples, count = _examples_of(run, seed, step, acc.process_index, acc.num_processes)
        return cls(step, examples, count, run.batch_size,
                   _device_batches(examples, run.batch_size, run.pad_id, acc.device, run.packed))


def _examples_of(run: Run, seed: int, step: int, rank: int, world: int) -> tuple[list, int]:
    """This process's examples of `step`, and the supervised tokens of the whole step (all processes)."""
    # A step's examples are a pure function of (seed, step): that is what makes resume exact.
    order = epoch_order(len(run.data.train), seed, step // run.per_epoch)
    every = [run.data.train[i] for i in step_examples(order, step % run.per_epoch, run.per_step)]
    mine = every[rank::world]  # this process's share: no example is seen twice in an epoch
    # Normalise by the supervised tokens of the whole step, all processes together, so that splitting it into more
    # or fewer micro-batches or processes gives the same gradient.
    return mine, max(1, sum(sum(1 for t in lab[1:] if t != IGNORE) for _, lab in every))


def _device_batch(chunk: list, pad_id: int, device: torch.device, pack: bool = False) -> dict[str, torch.Tensor]:
    batch = (collate_packed(chunk, pad_id) if pack else None) or collate(chunk, pad_id)
    if device.type == "cuda":  # pinned: the copy runs asynchronously, behind the kernels already queued
        batch["rows"] = supervised_rows(batch["labels"])
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


def _device_batches(examples: list, batch_size: int, pad_id: int, device: torch.device, pack: bool = False) -> list:
    return [_device_batch(examples[i : i + batch_size], pad_id, device, pack)
            for i in range(0, len(examples), batch_size)]


def _accumulate(model, accelerator, examples: list, batch_size: int, n_tokens: int, pad_id: int,
                loss_fn: LossFn = loss_sum, graphed: bool = False, ready: list | None = None,
                pack: bool = False) -> torch.Tensor:
    """Forward and backward one optimizer step's examples in micro-batches (`ready`: made already; `pack`: with
    less padding, data.collate_packed); returns the step's loss."""
    micro = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
    device = accelerator.device
    parts = []  # kept on the device: one host sync per step, not one per micro-batch
    for i, chunk in enumerate(micro):
        batch = ready[i] if ready is not None else _device_batch(chunk, pad_id, device, pack)
        # DDP all-reduces gradients on every backward; only the step's last micro-batch needs it.
        sync = accelerator.no_sync(model) if i < len(micro) - 1 else nullcontext()
        with sync, accelerator.autocast():
            s, _ = loss_fn(model, batch)
            loss = s / n_tokens
            accelerator.backward(loss)
        if graphed and i < len(micro) - 1:
            own_gradients(model)
        parts.append(loss.detach().double())
    return torch.stack(parts).sum()  # on the device: read when the step is done, not after each micro-batch


def _halve_batch(device: torch.device, step: int, batch_size: int, examples: int, bar, progress: bool,
                 log: RunLog) -> int:
    """After an out-of-memory error: free the cache, halve the micro-batch, say so; the step is redone."""
    free_memory(device)
    new = batch_size // 2
    accum = -(-examples // new)
    if progress:
        bar.note(f"out of memory at step {step + 1}: micro-batch {batch_size} -> {new}, grad-accum -> {accum} "
                 f"(effective batch {examples} unchanged); redoing the step")
    log.write("oom", step=step + 1, batch_size=new, grad_accum=accum)
    return new


def _delete(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _peer_lost(e: BaseException, run: Run) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    done = run.saver.complete()
    kept = f"The newest checkpoint, {done[0][1]}, is intact" if done else "No checkpoint was saved yet"
    return (f"process {run.accelerator.process_index} of {run.accelerator.num_processes}: another process stopped, "
            f"or did not answer within {dist_timeout():g}s (TUNESMITH_DIST_TIMEOUT) ({first[:200]}); stopping too. "
            f"{kept}: run the same command with --resume to continue")


def _oom_advice(e: BaseException, step: int, batch_size: int, world: int, seq_len: int) -> str:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if world > 1:
        return (f"out of memory at step {step + 1} on one of {world} processes ({first}); recovery needs a single "
                "process: lower --batch-size (see tunesmith fit)")
    return (f"out of memory at step {step + 1} even at micro-batch {batch_size} with --seq-len {seq_len} ({first}). "
            "Try --gradient-checkpointing, a shorter --seq-len, or a smaller model; `tunesmith fit` shows what fits")


def _plan_memory(cfg: TrainConfig, device: torch.device, precision: str, model, run_dir: Path, progress: bool,
                 main: bool = True, world: int = 1) -> int:
    """Write the planner's prediction (per process) to fit.json (the report reads it); 'auto' takes the largest
    batch that fits."""
    from tunesmith.memory import KNOWN_CONFIGS, plan_run, verdict
    from tunesmith.models import resolve_model

    auto = cfg.batch_size == "auto"
    config = getattr(model, "config", None)
    if model is not None and config is None:
        if auto:
            raise TunesmithError("--batch-size auto needs a transformers model (the planner reads its config)")
        return cfg.batch_size
    on_device = [] if model is None else [p for p in model.parameters() if p.device.type == device.type]
    resident = sum(p.numel() * p.element_size() for p in on_device)  # weights already loaded: not extra
    if model is None and cfg.model not in KNOWN_CONFIGS:
        resolve_model(cfg.model, progress)  # a model that cannot load stops here, with its own one-line error
    try:
        fit = plan_run(cfg, device, precision, config, resident_bytes=resident, world=world)
    except TunesmithError as e:
        if auto:
            raise
        _note(progress, f"no memory plan ({e}); training with micro-batch {cfg.batch_size}")
        return cfg.batch_size
    if main:
        fit.write(run_dir / "fit.json")
    if auto or not fit.fits:
        _note(progress, f"micro-batch {fit.setup.batch_size}: {verdict(fit)}")
    return fit.setup.batch_size


def _precision(accelerator) -> str:
    mixed = accelerator.mixed_precision
    return "fp32" if mixed in (None, "no") else str(mixed)


def _note(enabled: bool, text: str) -> None:
    if enabled:
        print(f"tunesmith: {text}", file=sys.stderr, flush=True)
