"""Several processes: launching them (torch's elastic launcher, the engine behind torchrun and `accelerate launch`),
and what the training loop needs of them beyond accelerate: sums and values agreed over processes, a check that
every process trains the same thing, and FSDP2's full (unsharded) state for saving.

One process is the default and costs nothing here: every function is the identity when there is one process.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from tunesmith.errors import PeerLost, TunesmithError


def launched() -> bool:
    """Whether a launcher started this process (torchrun, accelerate launch, --gpus): as one of several, or as the
    only one (then --strategy fsdp still wraps the model, unsharded)."""
    return "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_launch(n: int, device: str) -> None:
    """--gpus N on this machine: CUDA GPUs enough, or CPU processes on gloo; MPS is one device."""
    if device == "mps":
        raise TunesmithError("--gpus: MPS is one device; on a Mac train in one process (drop --gpus)")
    if device == "cpu":
        return
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        raise TunesmithError(
            f"--gpus {n}: this machine has {have} CUDA GPU{'s' if have != 1 else ''}; use --gpus {have} or fewer"
            + (", or --device cpu --gpus N for CPU processes on gloo" if have == 0 else "")
        )


def launch(cfg, write_config) -> None:
    """Run `tunesmith train` as cfg.gpus processes through torch's elastic launcher (torchrun's engine), the
    config handed over as a YAML file. If any process fails, the launcher stops the others at once; what failed,
    and how to continue, ends up in one TunesmithError."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    n = cfg.gpus
    check_launch(n, cfg.device)
    fd, path = tempfile.mkstemp(prefix="tunesmith-launch-", suffix=".yaml")
    os.close(fd)
    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS",)}
    try:
        write_config(cfg, path)
        if cfg.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # the cores shared, not oversubscribed
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex[:8],
                              rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.2)
        try:
            elastic_launch(config, entrypoint=sys.executable)("-m", "tunesmith.cli", "train", "--config", path)
        except ChildFailedError as e:
            raise TunesmithError(failure_message(e.failures, n, Path(cfg.output))) from None
    finally:
        Path(path).unlink(missing_ok=True)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def failure_message(failures: dict, n: int, run_dir: Path) -> str:
    """One line for the launcher's failures (rank -> ProcessFailure): which process ended how; those the launcher
    itself stopped (SIGTERM) named apart; where the run can continue from."""
    from tunesmith.checkpoint import complete_checkpoints

    def how(code: int) -> str:
        if code < 0 and -code in signal.valid_signals():
            return f"killed by {signal.Signals(-code).name}"
        if code == PeerLost.exit_code:
            return "stopped: another process stopped or did not answer"
        return f"exit code {code}"

    # Stopped as a consequence: by the launcher (SIGTERM), or on its own on finding a peer gone (PeerLost), whichever
    # came first; neither is the cause, unless nothing else failed (a stop from outside, a collective's timeout).
    stopped = {r for r, f in failures.items() if f.exitcode in (-signal.SIGTERM, PeerLost.exit_code)}
    first = sorted(set(failures) - stopped) or sorted(failures)
    parts = ", ".join(f"process {r} ({how(failures[r].exitcode)})" for r in first)
    others = sorted(set(range(n)) - set(first))
    done = complete_checkpoints(run_dir / "checkpoints")
    after = (f"the newest checkpoint, {done[0][1]}, is intact: run the same command with --resume to continue"
             if done else "no checkpoint was saved yet: run the same command again")
    stop = f"; the other{'s' if len(others) > 1 else ''} ({', '.join(map(str, others))}) stopped with " \
        f"{'it' if len(first) == 1 else 'them'}" \
        if others else ""
    return f"{parts} of the {n}-process run failed{stop}; {after}"


# ------------------------------------------------------------------------------------------------ in the loop


def all_sum(accelerator, values: list[float]) -> list[float]:
    """Each value summed over the processes (as they are, with one)."""
    if accelerator.num_processes == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    return accelerator.reduce(t, reduction="sum").tolist()


def from_main(accelerator, value: Any) -> Any:
    """The main process's `value` on every process (a decision taken from timing must be the same everywhere)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


def gather(accelerator, value: Any) -> list[Any]:
    """Every process's `value`, in rank order, on every process."""
    if accelerator.num_processes == 1:
        return [value]
    from accelerate.utils import gather_object

    return gather_object([value])


def fingerprint(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_agreement(accelerator, **what: str) -> None:
    """Every process must train the same run: the same settings and the same tokenized data. A difference would
    not fail loudly (the gradients of different models or data would still be averaged), so it is one error,
    on every process, naming what differs and where."""
    if accelerator.num_processes == 1:
        return
    seen = gather(accelerator, what)
    differ = [name for name in what if len({s[name] for s in seen}) > 1]
    if differ:
        detail = "; ".join(f"{name}: " + ", ".join(f"process {r} {s[name]}" for r, s in enumerate(seen))
                           for name in differ)
        raise TunesmithError(
            f"the {len(seen)} processes disagree ({detail}); every process must see the same config and the same "
            "data file: start them from one command on one copy of the files"
        )


def is_dist_failure(e: BaseException) -> bool:
    """An error that means another process stopped or a collective timed out, rather than a bug here."""
    dist = getattr(torch.distributed, "DistError", ())
    text = str(e)
    return isinstance(e, dist) or (isinstance(e, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "Timed out",
                            "timed out", "Broken pipe")))


# ------------------------------------------------------------------------------------------------ FSDP2


def fsdp_plugin() -> Any:
    """accelerate's FSDP2 plugin: each decoder layer its own shard group (the model's `_no_split_modules`; its
    weights gathered just before use and freed after), the full state dict gathered for saving."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False,
    )


def is_sharded(model) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def full_trainable_state(model) -> dict[str, torch.Tensor]:
    """The trainable parameters as whole tensors on the CPU, by their names in `model` (the unwrapped PeftModel).
    Under FSDP2 a collective (every process calls it) that leaves the tensors on the main process only."""
    if not is_sharded(model):
        return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=True))


def full_model_state(model) -> dict[str, torch.Tensor] | None:
    """Every weight, whole, on the main process (None when the model is not sharded: save it as it is)."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model, optimizer) -> dict:
    """The optimizer's state_dict as one process holds it (integer keys in parameter order). Under FSDP2 a
    collective: the sharded moments gathered whole onto the main process, renamed from names to positions."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not is_sharded(model):
        return inner.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    order = [name for group in sd.get("param_groups", []) for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    groups, start = [], 0
    for group in sd.get("param_groups", []):
        groups.append({**group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": {index[k]: v for k, v in sd.get("state", {}).items()}, "param_groups": groups}


def load_full_optimizer_state(model, optimizer, sd: dict) -> None:
    """The inverse for a sharded model: an integer-keyed full optimizer state into the FSDP2 optimizer (each process
    keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in inner.param_groups for p in group["params"]]
    groups, start = [], 0
    for saved, live in zip(sd["param_groups"], inner.param_groups, strict=True):
        groups.append({**saved, "params": order[start:start + len(live["params"])]})
        start += len(live["params"])
    by_name = {"state": {order[int(i)]: v for i, v in sd["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, inner, by_name, options=StateDictOptions(full_state_dict=True))
