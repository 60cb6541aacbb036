"""Never lose a run: atomic checkpoints, exact resume, stop signals (files on disk: storage.py).

A checkpoint is a folder ``<run>/checkpoints/step-000120/``:

    adapter_model.safetensors, adapter_config.json   the LoRA weights: a PEFT adapter folder `generate` can load
    optimizer.safetensors                            AdamW's per-parameter state as plain tensors
    state.json                                       step (= data position), schedule, optimizer hyper-parameters,
                                                     grad scaler, every RNG state, the config, each file's sha256
    COMMITTED                                        written last; holds state.json's sha256

Nothing in it needs pickle to read. A save writes a temporary folder, fsyncs it, renames it into place and only then
writes COMMITTED: a folder without the marker is an interrupted save, ignored on resume and deleted by the next save.
Old checkpoints are deleted (``--keep``) only after the new one is committed.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import threading
import uuid
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tunesmith import storage
from tunesmith.errors import TunesmithError
from tunesmith.lora import BASE_FILE, adapter_config, base_file
from tunesmith.storage import read_safetensors

FORMAT = 1
ADAPTER, ADAPTER_CONFIG, OPTIMIZER, STATE, MARKER = (
    "adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors", "state.json", "COMMITTED",
)
CODES, SCALES = ".codes8", ".scales8"  # an 8-bit optimizer moment, saved as its two tensors
TRAINABLE = "trainable.safetensors"  # full fine-tuning: the trained parameters by name (a checkpoint is no adapter)
PREFIX = "step-"
# Settings that change how a run is kept or logged, not what it computes: they may differ on resume without a word.
BOOKKEEPING = frozenset({"output", "resume", "checkpoint_every", "eval_every", "eval_batches", "allow_pickle", "device",
                         "precision", "gpus", "strategy"})
KEEP = 2  # checkpoints kept, newest first: the older one stands in if the newest is damaged
Echo = Callable[[str], None]


def _stderr(text: str) -> None:
    print(f"tunesmith: {text}", file=sys.stderr, flush=True)


@dataclass
class TrainState:
    """What the loop carries from one step to the next, beyond the weights and the optimizer."""

    step: int = 0  # optimizer steps done; also the data position (a step's examples depend only on seed and step)
    schedule_total: int = 0  # the schedule's horizon, which a time budget may have cut
    planned_total: int = 0  # the horizon the flags asked for, to tell a cut from a changed --max-steps
    tokens: int = 0
    elapsed: float = 0.0  # seconds of training before this process
    bad_streak: int = 0  # non-finite steps in a row
    batch_size: int = 0  # the micro-batch in use (out-of-memory recovery may have halved it); 0: the flag's
    per_step: int = 0  # examples per optimizer step, all processes together; 0: as the flags say
    world: int = 1  # processes that trained together
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])


@dataclass
class Checkpoint:
    path: Path
    state: dict[str, Any]  # the parsed state.json

    @property
    def step(self) -> int:
        return int(self.state["step"])


# ------------------------------------------------------------------------------------------------ saving


class Checkpointer:
    """Saves and finds one run's checkpoints. Only the main process of a multi-process run calls save(), with
    what the others hold passed in (their RNG states; under FSDP2 the gathered weights and optimizer state)."""

    def __init__(self, run_dir: str | Path, cfg, device: str, precision: str, data_fingerprint: str,
                 echo: Echo = _stderr, keep: int | None = None):
        self.run_dir, self.root = Path(run_dir), Path(run_dir) / "checkpoints"
        self.config = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        self.keep = KEEP if keep is None else keep  # 0: all
        if getattr(cfg, "checkpoint_every", 0) < 0:
            raise TunesmithError(f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}")
        self.identity = {"device": device, "precision": precision, "data": data_fingerprint}
        self.echo = echo

    def save(self, state: TrainState, model, optimizer, scheduler, scaler=None, *, rng_ranks: list | None = None,
             trainable: dict | None = None, optimizer_state: dict | None = None) -> Path:
        """Write a checkpoint of `state` atomically; a failure leaves earlier checkpoints untouched and says so.
        `rng_ranks`: every process's RNG state, in rank order (default: this one's); `trainable` and
        `optimizer_state`: the trainable weights by name and the optimizer's state_dict, when the live objects
        hold only a shard of them."""
        final = self.root / f"{PREFIX}{state.step:06d}"
        tmp = self.root / f"{storage.TMP_PREFIX}{final.name}-{os.getpid()}"
        tensors, meta = _optimizer_tensors(optimizer_state if optimizer_state is not None else optimizer.state_dict())
        if hasattr(model, "peft_config"):  # the checkpoint is also an adapter folder the other verbs load
            payload = {
                ADAPTER: _adapter_tensors(model, trainable),
                ADAPTER_CONFIG: json.dumps(adapter_config(model, self.config.get("model")), indent=2,
                                           sort_keys=True).encode(),
            }
            calibrated = bool(self.config.get("base_calibration")) and self.config.get("quantize_base") != "none"
            if calibrated:  # the calibrated base's codes: resume restores them, the other verbs load them
                from tunesmith.qlora import BASE_CODES, base_codes

                payload[BASE_CODES] = base_codes(model)
            if self.config.get("model"):  # the base model, as a finished adapter folder records it
                payload[BASE_FILE] = base_file(self.config["model"], self.config.get("quantize_base", "none"),
                                               calibrated)
        else:
            payload = {TRAINABLE: _trainable_tensors(model, trainable)}
        payload[OPTIMIZER] = tensors
        body = {
            "format": FORMAT, **dataclasses.asdict(state), **self.identity, "config": self.config,
            "optimizer": meta, "scheduler": _scheduler_state(scheduler),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng_ranks[0] if rng_ranks else capture_rng(self.identity["device"]),
            "rng_ranks": rng_ranks if rng_ranks and len(rng_ranks) > 1 else None,  # the others' too
        }
        aside, placed, committed = None, False, False
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            body["files"] = {name: _write_part(tmp / name, data) for name, data in payload.items()}
            state_json = json.dumps(body, indent=1).encode()
            write_file(tmp / STATE, state_json)
            storage.fsync_dir(tmp)
            # an existing folder (an interrupted save of this step, or a run resumed from an earlier checkpoint)
            # goes aside until the marker is down
            aside = storage.swap_in(tmp, final)
            placed = True
            write_file(final / MARKER, json.dumps({STATE: _sha256(state_json)}).encode())
            storage.fsync_dir(final)
            committed = True
        except OSError as e:
            raise TunesmithError(
                f"could not save checkpoint {final}: {e.strerror or e}. {self._intact(final)} "
                "Free space (or fix the folder), then run the same command with --resume"
            ) from None
        finally:
            if not committed:  # leave things as they were: no half-written folder, the replaced one back
                shutil.rmtree(tmp, ignore_errors=True)
                if placed:
                    shutil.rmtree(final, ignore_errors=True)
                    if aside is not None:
                        with contextlib.suppress(OSError):
                            os.replace(aside, final)
            elif aside is not None:
                storage.remove_folder(aside)
        self.prune(final, state.run_id)
        return final

    def _intact(self, failed: Path) -> str:
        done = [p for _, p in self.complete() if p != failed]
        return f"The previous checkpoint {done[0].name} is intact." if done else "No earlier checkpoint exists."

    def prune(self, current: Path, run_id: str) -> None:
        """After `current` is committed: drop interrupted saves, other runs' checkpoints, checkpoints past `current`
        (a future this run has replaced) and all but the newest `keep`."""
        mine = []
        for entry in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if entry == current or not entry.is_dir():
                continue
            if entry.name.startswith((storage.TMP_PREFIX, storage.TRASH_PREFIX)) or not (entry / MARKER).is_file():
                storage.remove_folder(entry)
                continue
            try:
                saved = json.loads((entry / STATE).read_text(encoding="utf-8"))
                same_run, step = saved.get("run_id") == run_id, int(saved["step"])
            except (OSError, ValueError, KeyError, TypeError):
                same_run, step = False, -1
            if not same_run or step > _step_of(current):
                storage.remove_folder(entry)
            else:
                mine.append((step, entry))
        if self.keep > 0:
            for _, entry in sorted(mine, reverse=True)[max(0, self.keep - 1):]:
                storage.remove_folder(entry)

    # ------------------------------------------------------------------------------------------- finding

    def complete(self) -> list[tuple[int, Path]]:
        return complete_checkpoints(self.root)

    def find(self, resume: bool | str) -> Checkpoint:
        """`--resume` (True): the newest checkpoint of this run that verifies. `--resume PATH`: that checkpoint
        folder (it must verify), or the newest in that run folder."""
        if not isinstance(resume, str):
            return newest_checkpoint(self.root, self.echo)
        path = Path(resume).expanduser()
        if path.name.startswith(PREFIX) or (path / MARKER).exists() or (path / STATE).exists():
            return verify(path)
        if not path.is_dir():
            raise TunesmithError(f"--resume {resume}: no such checkpoint or run folder")
        return newest_checkpoint(path / "checkpoints" if (path / "checkpoints").is_dir() else path, self.echo)

    def check_config(self, ckpt: Checkpoint) -> None:
        """Warn about settings that differ from the checkpoint's, all in one line."""
        diffs = self.differences(ckpt)
        if not diffs:
            return
        listing = "; ".join(diffs)
        self.echo(f"warning: resuming {ckpt.path} with settings that differ from the checkpoint's: {listing}")

    def differences(self, ckpt: Checkpoint) -> list[str]:
        """Every setting that differs from the checkpoint's, as 'name: saved -> now'."""
        saved, now = ckpt.state.get("config", {}), self.config
        diffs = [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in sorted(saved.keys() & now.keys())
                 if k not in BOOKKEEPING and saved[k] != now[k]]
        for k in ("device", "precision"):
            if ckpt.state.get(k) != self.identity[k]:
                diffs.append(f"{k}: {ckpt.state.get(k)} -> {self.identity[k]}")
        if ckpt.state.get("data") != self.identity["data"]:
            diffs.append("training data: the tokenized examples differ (the file changed, or --seq-len / the tokenizer)")
        return diffs


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint under `root`, newest first; not yet verified."""
    found = []
    for entry in root.iterdir() if root.is_dir() else []:
        if entry.name.startswith(PREFIX) and entry.is_dir() and (entry / MARKER).is_file():
            found.append((_step_of(entry), entry))
    return sorted(found, reverse=True)


def newest_checkpoint(root: Path, echo: Echo = _stderr) -> Checkpoint:
    """The newest checkpoint that verifies; a damaged one is skipped with a warning naming the bad file."""
    for _, path in complete_checkpoints(root):
        try:
            return verify(path)
        except TunesmithError as e:
            echo(f"warning: {e}; falling back to the previous checkpoint")
    interrupted = [e for e in root.iterdir() if e.is_dir() and not (e / MARKER).is_file()] if root.is_dir() else []
    skipped = f" ({len(interrupted)} interrupted save(s) ignored)" if interrupted else ""
    raise TunesmithError(
        f"nothing to resume: {root} holds no complete checkpoint{skipped}. Run without --resume to start over"
    )


def _step_of(path: Path) -> int:
    try:
        return int(path.name.removeprefix(PREFIX))
    except ValueError:
        return -1


def write_file(path: Path, data: bytes) -> str:
    """Write and fsync a file; returns its sha256."""
    with open(path, "wb") as f:
        f.write(data)
        storage.fsync_file(f)
    return _sha256(data)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- verifying


def verify(path: str | Path) -> Checkpoint:
    """Check a checkpoint's marker and every file's sha256; the error names the file that fails."""
    path = Path(path)
    if not path.is_dir():
        raise TunesmithError(f"checkpoint {path} not found")
    if not (path / MARKER).is_file():
        raise TunesmithError(f"checkpoint {path} is incomplete (no {MARKER} marker: its save was interrupted)")
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
        raw = (path / STATE).read_bytes()
    except (OSError, ValueError) as e:
        raise TunesmithError(f"checkpoint {path}: cannot read {MARKER} / {STATE} ({e})") from None
    if not isinstance(marker, dict) or marker.get(STATE) != _sha256(raw):
        raise TunesmithError(f"checkpoint {path}: {STATE} fails its sha256 check (the file is damaged)")
    state = json.loads(raw)
    if state.get("format") != FORMAT:
        raise TunesmithError(f"checkpoint {path}: format {state.get('format')} is not {FORMAT}; this tunesmith cannot read it")
    for name, digest in state["files"].items():
        f = path / name
        if not f.is_file():
            raise TunesmithError(f"checkpoint {path}: {name} is missing")
        if _file_sha256(f) != digest:
            raise TunesmithError(f"checkpoint {path}: {name} fails its sha256 check (the file is damaged)")
    return Checkpoint(path, state)


# ---------------------------------------------------------------------------------------------- restoring


def restore(ckpt: Checkpoint, model, optimizer, scheduler, scaler, schedule, planned_total: int, lr: float,
            weight_decay: float, load_optimizer: Callable[[dict], None] | None = None) -> TrainState:
    """Load a verified checkpoint into the live objects; returns the loop's state. The RNGs are separate
    (restore_rng), to be set right before the loop. `load_optimizer` (FSDP2): the weights were restored before
    sharding (restore_weights), and it splits the optimizer's full state over the processes."""
    try:
        return _restore(ckpt, model, optimizer, scheduler, scaler, schedule, planned_total, lr, weight_decay,
                        load_optimizer)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a state.json this tunesmith did not write
        raise TunesmithError(f"checkpoint {ckpt.path}: {STATE} is malformed ({type(e).__name__}: {e})") from None


def _restore(ckpt: Checkpoint, model, optimizer, scheduler, scaler, schedule, planned_total: int, lr: float,
             weight_decay: float, load_optimizer: Callable[[dict], None] | None = None) -> TrainState:
    s = ckpt.state
    if load_optimizer is None:
        restore_weights(ckpt, model)
    inner_opt = getattr(optimizer, "optimizer", optimizer)
    live = {"param_groups": inner_opt.param_groups}
    opt_state = _optimizer_state(read_safetensors(ckpt.path / OPTIMIZER), s["optimizer"], live)
    try:
        if load_optimizer is not None:
            load_optimizer(opt_state)
        else:
            optimizer.load_state_dict(opt_state)
    except (ValueError, KeyError) as e:
        raise TunesmithError(f"checkpoint {ckpt.path}: optimizer state does not fit this model ({e})") from None
    _requantize_8bit_state(optimizer)
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds the LambdaLR
    scheduler.load_state_dict({**s["scheduler"], "lr_lambdas": [None] * len(getattr(inner, "lr_lambdas", []))})
    if scaler is not None and s.get("scaler"):
        scaler.load_state_dict(s["scaler"])
    # A time budget's cut horizon carries over unless the flags now ask for a different length.
    schedule.total = s["schedule_total"] if s["planned_total"] == planned_total else planned_total
    # The flags given now set the learning rate and weight decay from here on (the same numbers when unchanged),
    # so `--lr` lower on resume takes effect.
    for group in optimizer.param_groups:
        # torchao's optimizers hold the rate as a float32 tensor, and the scheduler then multiplies in float32:
        # the base rate takes the same form, so a resumed run's rates round as the uninterrupted run's did
        tensor = isinstance(group["lr"], torch.Tensor)
        base = torch.tensor(lr, dtype=group["lr"].dtype) if tensor else lr
        group["initial_lr"], group["weight_decay"] = base, weight_decay
        if tensor:
            group["lr"].fill_(base * schedule(inner.last_epoch))
        else:
            group["lr"] = lr * schedule(inner.last_epoch)
    inner.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    inner._last_lr = [g["lr"] for g in optimizer.param_groups]
    names = {f.name for f in dataclasses.fields(TrainState)}
    return TrainState(**{k: v for k, v in s.items() if k in names})


def _requantize_8bit_state(optimizer) -> None:
    """torchao's 8-bit AdamW keeps its moments as 8-bit tensors, which a checkpoint holds as their codes and block
    scales (_optimizer_tensors): rebuild each moment from them, bit for bit, so the resumed run continues exactly."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds it
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for name, signed in (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)):
                if name + CODES not in state:
                    continue
                moment = optimizer._new_buffer(p, signed)
                moment.codes.copy_(state.pop(name + CODES))
                moment.scale.copy_(state.pop(name + SCALES))
                state[name] = moment


def restore_weights(ckpt: Checkpoint, model) -> None:
    """The adapter's weights (LoRA, DoRA), or the trained parameters by name (full fine-tuning)."""
    from peft import set_peft_model_state_dict

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    full = (ckpt.path / TRAINABLE).is_file()
    if full != (not hasattr(model, "peft_config")):
        saved, now = ("full", "an adapter") if full else ("an adapter", "full")
        raise TunesmithError(f"checkpoint {ckpt.path} holds {saved} fine-tuning's weights, but this run trains "
                             f"{now}; --fine-tune-type differs from the checkpoint's")
    weights = read_safetensors(ckpt.path / (TRAINABLE if full else ADAPTER))
    if full:
        fits = set(weights) == set(trainable) and all(weights[n].shape == p.shape for n, p in trainable.items())
        if fits:
            with torch.no_grad():
                for name, p in trainable.items():
                    p.copy_(weights[name])
    else:
        try:
            result = set_peft_model_state_dict(model, weights)
        except RuntimeError:  # a size mismatch
            result = None
        fits = result is not None and not getattr(result, "unexpected_keys", None) and len(weights) == len(trainable)
    if not fits:
        raise TunesmithError(
            f"checkpoint {ckpt.path}: its weights do not fit this model ({len(weights)} tensors saved, "
            f"{len(trainable)} trainable here); --lora-rank, --lora-targets, --fine-tune-type, --num-layers or "
            "--model differ from the checkpoint's"
        )


def carry_metrics(ckpt: Checkpoint, metrics: Path) -> list[dict]:
    """Rewrite `metrics` as the checkpoint's run logged it up to the checkpoint's step (a kill may have left rows
    past it, or half a line); returns the rows kept."""
    source = ckpt.path.parent.parent / "metrics.jsonl"
    rows = []
    if source.is_file():
        for line in source.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= ckpt.step:
                rows.append(row)
    tmp = metrics.with_name(metrics.name + ".tmp")
    write_file(tmp, "".join(json.dumps(r) + "\n" for r in rows).encode())
    os.replace(tmp, metrics)
    return rows


# --------------------------------------------------------------------------------- state as plain values


def _adapter_tensors(model, trainable: dict | None = None) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    sd = get_peft_model_state_dict(model, state_dict=trainable)
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}


def _trainable_tensors(model, trainable: dict | None = None) -> dict[str, torch.Tensor]:
    named = trainable if trainable is not None else {n: p for n, p in model.named_parameters() if p.requires_grad}
    return {n: p.detach().contiguous().cpu() for n, p in named.items()}


def _write_part(path: Path, data: bytes | dict[str, torch.Tensor]) -> str:
    """Write and fsync one file of a checkpoint (bytes, or tensors as safetensors); returns its sha256. Tensors go
    to the file from their own memory: building the file in memory first (safetensors' `save`) held a second copy
    of every weight and moment, which for full fine-tuning was the run's peak."""
    if isinstance(data, bytes):
        return write_file(path, data)
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(data, str(path), metadata={"format": "pt"})
    except SafetensorError as e:  # its I/O errors (a full disk) are the caller's OSError
        raise OSError(str(e)) from None
    with open(path, "rb+") as f:
        storage.fsync_file(f)
    return _file_sha256(path)


def _optimizer_tensors(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state_dict -> tensors 'state.<param>.<name>' and a JSON part (param groups, non-tensor state)."""
    tensors, scalars = {}, {}
    for idx, per_param in sd["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                if type(value) is not torch.Tensor and hasattr(value, "codes") and hasattr(value, "scale"):
                    # torchao's 8-bit AdamW moment: its codes and block scales, exactly (restore rebuilds it)
                    tensors[f"state.{idx}.{name}{CODES}"] = value.codes.detach().contiguous().cpu()
                    tensors[f"state.{idx}.{name}{SCALES}"] = value.scale.detach().contiguous().cpu()
                    continue
                tensors[f"state.{idx}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{idx}.{name}"] = value
    groups = [{k: v.item() if isinstance(v, torch.Tensor) else v for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _optimizer_state(tensors: dict[str, torch.Tensor], meta: dict, live: dict) -> dict:
    """The inverse of _optimizer_tensors; JSON lists become tuples where the live optimizer holds tuples (betas)."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for key, value in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    groups = []
    for saved, now in zip(meta["param_groups"], live["param_groups"], strict=False):
        groups.append({k: tuple(v) if isinstance(now.get(k), tuple) else
                       torch.tensor(v, dtype=now[k].dtype) if isinstance(now.get(k), torch.Tensor) else v
                       for k, v in saved.items()})
    return {"state": state, "param_groups": groups}


def _scheduler_state(scheduler) -> dict:
    # lr_lambdas holds the Schedule's fields; the horizon is saved on its own and the rest comes from the flags.
    sd = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    return json.loads(json.dumps(sd, default=_tensor_item))  # torchao's optimizers give tensor learning rates


def _tensor_item(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"{type(value).__name__} in a scheduler's state")


def capture_rng(device: str) -> dict[str, Any]:
    """Every RNG a step can draw from, as JSON: python, numpy, torch CPU, and CUDA or MPS when training there."""
    import numpy as np

    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    rng: dict[str, Any] = {"python": [version, list(mt), gauss],
                           "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
                           "torch": _b64(torch.get_rng_state())}
    if device == "cuda" and torch.cuda.is_available():
        rng["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    if device == "mps" and torch.backends.mps.is_available():
        rng["mps"] = _b64(torch.mps.get_rng_state())
    return rng


def rng_of(ckpt: Checkpoint, rank: int, world: int) -> dict[str, Any]:
    """The RNG state process `rank` continues from: its own when the run had as many processes, else process 0's."""
    ranks = ckpt.state.get("rng_ranks") or []
    return ranks[rank] if len(ranks) == world else ckpt.state["rng"]


def restore_rng(rng: dict[str, Any], device: str) -> None:
    try:
        _restore_rng(rng, device)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise TunesmithError(f"checkpoint RNG state is malformed ({type(e).__name__}: {e})") from None


def _restore_rng(rng: dict[str, Any], device: str) -> None:
    import numpy as np

    version, mt, gauss = rng["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(rng["torch"]))
    if device == "cuda" and "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in rng["cuda"]])
    if device == "mps" and "mps" in rng and torch.backends.mps.is_available():
        torch.mps.set_rng_state(_unb64(rng["mps"]))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def data_fingerprint(examples: Sequence[tuple[list[int], list[int]]]) -> str:
    """sha256 of the tokenized training examples: a resume notices when the data under a run has changed."""
    h = hashlib.sha256()
    for ids, labels in examples:
        h.update(array("q", [len(ids)]).tobytes())
        h.update(array("q", ids).tobytes())
        h.update(array("q", labels).tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- signals


class StopSignals:
    """SIGINT / SIGTERM ask the loop to stop after the current step and save. The handler only records the signal
    (the loop acts on it between steps), so a second Ctrl-C during the save cannot interrupt the write.

    Installed only from the main thread (Python's rule); the previous handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum: int, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        text = (f"\ntunesmith: {signal.Signals(signum).name}: finishing this step, then saving a checkpoint\n" if first
                else "\ntunesmith: still saving the checkpoint; it is written atomically, so the run stays resumable\n")
        try:  # a raw write: print() from a signal handler can collide with a print in progress
            os.write(2, text.encode())
        except OSError:
            pass
