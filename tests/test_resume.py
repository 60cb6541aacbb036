"""An interrupted run is indistinguishable from one that never stopped: exact resume at four cut points, and
kill -9 at 20 moments (half of them inside a checkpoint save).

Both need fresh processes. Importing torch + transformers takes ~10 s on a busy 2-core CI machine, so one process
(the "zygote": this file run as `python -m tests.test_resume`) imports everything once and forks a child per run.
Each child is a new process that has trained nothing before; the resumed ones know only what is on disk, and
kill -9 hits a real process. The zygote never runs a torch op itself (forking after OpenMP has started is unsafe),
and every child uses one intra-op thread, so all runs reduce in the same order.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the zygote forks its runs")

KILLS_STEPS = 40  # the killed run's length: 20 kills move it by about 22 steps (each child saves at most twice)
COMMON = ["--device", "cpu", "--seq-len", "32", "--batch-size", "2", "--lr", "1e-2", "--warmup-steps", "2",
          "--lora-dropout", "0.1", "--eval-every", "0", "--seed", "0"]


# ------------------------------------------------------------------------------------------- the zygote side


def _fork(argv: list[str], log: Path, *, signal_at: int = 0, pause_at: int = 0, pipe_w: int = -1,
          pause: tuple[str, int] | None = None) -> int:
    """Run `tunesmith <argv>` in a forked child; returns its pid. Optional fault injection, in the child only:
    signal_at=n sends SIGINT to itself before its n-th training forward; pause_at=n writes to pipe_w and sleeps
    before its n-th fsync of a checkpoint file or folder (the parent then kills it there); pause=(moment, n) does
    the same at the n-th of another moment (see _pause_at)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 99
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        import torch

        torch.set_num_threads(1)
        import tunesmith.report

        tunesmith.report.write_report = lambda *a, **k: None  # matplotlib plots: seconds per run, not under test
        if signal_at:
            _signal_at_forward(signal_at)
        if pause_at:
            _pause_at_fsync(pause_at, pipe_w)
        if pause:
            _pause_at(*pause, pipe_w, argv[argv.index("--output") + 1])
        from tunesmith.cli import main

        code = main(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _signal_at_forward(n: int) -> None:
    import torch
    from transformers import LlamaForCausalLM

    calls = [0]

    def hook(module, args):
        if isinstance(module, LlamaForCausalLM) and module.training:
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGINT)

    torch.nn.modules.module.register_module_forward_pre_hook(hook)


def _pause_at_fsync(n: int, pipe_w: int) -> None:
    import tunesmith.storage as st  # checkpoint.py calls its fsyncs there

    calls = [0]

    def wrap(fn):
        def inner(target):
            if "checkpoints" in str(getattr(target, "name", target)):
                calls[0] += 1
                if calls[0] == n:
                    os.write(pipe_w, b"x")
                    time.sleep(600)
            return fn(target)

        return inner

    st.fsync_file, st.fsync_dir = wrap(st.fsync_file), wrap(st.fsync_dir)


def _pause_at(moment: str, n: int, pipe_w: int, run: str) -> None:
    """Stop this child at its n-th `moment` and wait there for the parent's kill (_hold). The moments:
    'write': a change to the run folder (a file opened for writing, a rename, a mkdir, a removal): first start-up's
             (fit.json, config.yaml, the rewrite of metrics.jsonl), then the checkpoint saves' and their clean-up;
    'forward': before a training forward; 'step': right after an optimizer step (weights moved, nothing saved)."""
    calls = [0]

    def reached() -> None:
        calls[0] += 1
        if calls[0] == n:
            _hold(pipe_w)

    if moment == "write":  # Python's audit events see every file-system change, whichever module makes it
        changes = {"os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree"}
        writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT

        def audit(event: str, args: tuple) -> None:
            if event in changes or (event == "open" and isinstance(args[2], int) and args[2] & writing):
                if isinstance(args[0], (str, os.PathLike)) and (os.fspath(args[0]) + os.sep).startswith(run + os.sep):
                    reached()

        sys.addaudithook(audit)
    elif moment == "forward":
        import torch
        from transformers import LlamaForCausalLM

        def forward(module, args):
            if isinstance(module, LlamaForCausalLM) and module.training:
                reached()

        torch.nn.modules.module.register_module_forward_pre_hook(forward)
    elif moment == "step":
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(lambda optimizer, args, kwargs: reached())
    else:
        raise ValueError(f"unknown moment {moment!r}")


def _hold(pipe_w: int) -> None:
    """Tell the parent that this child has reached its moment, and wait there for its kill."""
    os.write(pipe_w, b"x")
    time.sleep(600)
    os._exit(97)  # no kill came (the parent is gone): never run on from here


def _await_pause(r: int, pid: int, log: Path) -> None:
    """Block until the child on pipe `r` stands paused at its moment. A child that exits first (the pipe closes)
    fails the scenario with its log; the timeout only catches a hung child, and is far above any start-up."""
    ready = select.select([r], [], [], 900)[0]
    if ready and os.read(r, 1) == b"x":
        return
    if not ready:
        os.kill(pid, signal.SIGKILL)
    status = _wait(pid)
    text = log.read_text(errors="replace") if log.is_file() else "(no log)"
    why = f"exited with status {status}" if ready else "did not pause within 900 s"
    raise RuntimeError(f"child {pid} {why} before its moment; its log {log}:\n{text[-6000:]}")


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _newest(run: Path) -> int | None:
    from tunesmith.checkpoint import newest_checkpoint
    from tunesmith.errors import TunesmithError

    try:
        return newest_checkpoint(run / "checkpoints", echo=lambda text: None).step
    except TunesmithError:
        return None


def _resumed_from(log: Path) -> int | None:
    m = re.search(r"resuming from \S*step-(\d+)", log.read_text(errors="replace") if log.is_file() else "")
    return int(m.group(1)) if m else None


def scenario_cuts(tiny: str, data: str, root: str, per_epoch: int) -> dict:
    """A reference run; then for each cut point a run stopped by SIGINT and a new process that resumes it."""
    root_p = Path(root)
    steps = 2 * per_epoch + 2

    def argv(run: Path) -> list[str]:
        return ["train", "--model", tiny, "--data", data, "--output", str(run), *COMMON, "--grad-accum", "2",
                "--max-steps", str(steps), "--checkpoint-every", "0"]

    # grad-accum 2: training forwards 2s-1 and 2s belong to step s
    cuts = {
        "first step": 1,
        "mid-epoch": 2 * (per_epoch // 2 + 1) - 1,
        "epoch boundary": 2 * per_epoch - 1,
        "inside accumulation": 2 * (per_epoch + 2),  # after the step's first micro-batch, before its second
    }
    out = {"reference": str(root_p / "reference"), "steps": steps, "cuts": {}}
    out["reference_rc"] = _wait(_fork(argv(root_p / "reference"), root_p / "reference.log"))
    for name, forward in cuts.items():
        run = root_p / name.replace(" ", "-")
        rc_cut = _wait(_fork(argv(run), root_p / f"{run.name}-cut.log", signal_at=forward))
        saved = _newest(run)
        log = root_p / f"{run.name}-resume.log"
        rc_resume = _wait(_fork([*argv(run), "--resume"], log))
        out["cuts"][name] = {"run": str(run), "forward": forward, "rc_cut": rc_cut, "saved_step": saved,
                             "rc_resume": rc_resume, "resumed_from": _resumed_from(log)}
    return out


def scenario_kills(tiny: str, data: str, root: str, kills: int, seed: int) -> dict:
    """kill -9 a run `kills` times, every other time while it is inside a checkpoint save; each new process resumes
    it with --resume. Then a last process finishes it. Every child is killed where it stands paused at a chosen
    moment (it says so on a pipe), so which moments are hit depends on `seed` alone, never on the machine's speed."""
    rng = random.Random(seed)
    root_p = Path(root)

    def argv(run: Path, resume: bool) -> list[str]:
        return ["train", "--model", tiny, "--data", data, "--output", str(run), *COMMON, "--max-steps", str(KILLS_STEPS),
                "--checkpoint-every", "2", *(["--resume"] if resume else [])]

    ref = root_p / "reference"
    out: dict = {"reference": str(ref), "reference_rc": _wait(_fork(argv(ref, False), root_p / "reference.log"))}
    run, events = root_p / "killed", []
    elsewhere = ["write", "forward", "step"]  # taken in turn by the kills outside a save
    for i in range(kills):
        newest = _newest(run)
        log = root_p / f"child-{i:02d}.log"
        r, w = os.pipe()
        if i % 2 == 0:  # inside a save: at a random fsync of the first saves (the first run: after its first one)
            moment = ("fsync", rng.randint(9 if i == 0 else 1, 16))
            pid = _fork(argv(run, newest is not None), log, pause_at=moment[1], pipe_w=w)
        else:  # anywhere else: a write in start-up or a save, or a random point of the child's first few steps
            kind = elsewhere[(i // 2) % len(elsewhere)]
            moment = (kind, rng.randint(1, 16) if kind == "write" else rng.randint(1, 5))
            pid = _fork(argv(run, newest is not None), log, pause=moment, pipe_w=w)
        os.close(w)
        _await_pause(r, pid, log)
        os.kill(pid, signal.SIGKILL)
        status = _wait(pid)
        os.close(r)
        leftovers = [p.name for p in (run / "checkpoints").iterdir()
                     if not (p / "COMMITTED").is_file()] if (run / "checkpoints").is_dir() else []
        events.append({"mode": "save" if i % 2 == 0 else "anywhere", "moment": list(moment),
                       "newest_before": newest, "resumed_from": _resumed_from(log), "status": status,
                       "leftovers": leftovers, "newest_after": _newest(run)})
    log = root_p / "final.log"
    out.update(run=str(run), events=events, final_newest=_newest(run),
               final_rc=_wait(_fork(argv(run, True), log)), final_resumed_from=_resumed_from(log))
    return out


def _serve() -> None:
    """The zygote: import everything, then answer one JSON request per line (a scenario and its arguments)."""
    import warnings

    warnings.filterwarnings("ignore")
    # Everything a run imports lazily, so that no child pays for it (importing runs no torch op)
    import accelerate  # noqa: F401
    import peft  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import tunesmith.checkpoint  # noqa: F401
    import tunesmith.cli  # noqa: F401
    import tunesmith.memory  # noqa: F401
    import tunesmith.train  # noqa: F401

    scenarios = {"cuts": scenario_cuts, "kills": scenario_kills}
    print("@@ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"ok": scenarios[request["scenario"]](**request["args"])}
        except Exception:
            reply = {"error": traceback.format_exc()}
        print("@@" + json.dumps(reply), flush=True)


# ------------------------------------------------------------------------------------------- the pytest side


class Zygote:
    def __init__(self, workdir: Path):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
               "TUNESMITH_CACHE": str(workdir / "cache"), "OBJC_DISABLE_INITIALIZE_FORK_SAFETY": "YES"}
        self.stderr = (workdir / "zygote.err").open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.test_resume"], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)
        assert self._reply() == "ready"

    def _reply(self) -> str:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return line[2:].strip()
        raise RuntimeError(f"the zygote died; see {self.stderr.name}")

    def run(self, scenario: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"scenario": scenario, "args": args}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self._reply())
        assert "error" not in reply, reply.get("error")
        return reply["ok"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.stderr.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from .conftest import CORPUS

    p = tmp_path_factory.mktemp("data") / "corpus.txt"
    p.write_text(CORPUS, encoding="utf-8")
    return p


def _train_rows(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"], r["tokens"]) for r in rows if r["kind"] == "train"]


def _same_tensors(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a), load_file(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_in_a_new_process_is_bitwise_exact_at_every_cut_point(zygote, tiny_dir, corpus, tmp_path, tokenizer):
    from tunesmith.data import load_data

    per_epoch = len(load_data(str(corpus), tokenizer, 32, 0.05).train) // 4  # batch 2 x grad-accum 2
    assert per_epoch >= 4
    out = zygote.run("cuts", tiny=str(tiny_dir), data=str(corpus), root=str(tmp_path), per_epoch=per_epoch)
    ref = Path(out["reference"])
    assert out["reference_rc"] == 0 and len(_train_rows(ref)) == out["steps"]
    expected = {"first step": 1, "mid-epoch": per_epoch // 2 + 1, "epoch boundary": per_epoch,
                "inside accumulation": per_epoch + 2}
    for name, cut in out["cuts"].items():
        run = Path(cut["run"])
        # SIGINT finished the step it came in (all its micro-batches), saved, and exited 130
        assert cut["rc_cut"] == 130 and cut["saved_step"] == expected[name], (name, cut)
        assert cut["rc_resume"] == 0 and cut["resumed_from"] == expected[name], (name, cut)
        assert _train_rows(run) == _train_rows(ref), name  # every step's loss, lr, grad norm: bitwise
        assert _same_tensors(run / "adapter" / "adapter_model.safetensors", ref / "adapter" / "adapter_model.safetensors")
        last = f"checkpoints/step-{out['steps']:06d}/optimizer.safetensors"
        assert _same_tensors(run / last, ref / last), name  # and AdamW's moments


def test_kill_9_at_20_moments_resumes_from_the_newest_complete_checkpoint(zygote, tiny_dir, corpus, tmp_path):
    out = zygote.run("kills", tiny=str(tiny_dir), data=str(corpus), root=str(tmp_path), kills=20, seed=5)
    ref, run, events = Path(out["reference"]), Path(out["run"]), out["events"]
    assert out["reference_rc"] == 0
    assert all(e["status"] == -signal.SIGKILL for e in events), events  # every kill hit a live run
    assert {e["moment"][0] for e in events} == {"fsync", "write", "forward", "step"}, events
    assert any(e["resumed_from"] is None for e in events[1:]), events  # one kill came in start-up, before the resume
    assert sum(bool(e["leftovers"]) for e in events) >= 3, events  # some kills left a half-written save behind
    for e in events[1:]:
        assert e["newest_before"] is not None, events
        if e["resumed_from"] is not None:  # (a kill during start-up comes before the resume message)
            assert e["resumed_from"] == e["newest_before"], events
    assert sum(e["resumed_from"] is not None for e in events) >= 12, events
    steps = [e["newest_after"] for e in events]
    assert steps == sorted(steps) and steps[-1] < KILLS_STEPS, events  # progress is never lost, and the run was not over
    assert out["final_rc"] == 0 and out["final_resumed_from"] == out["final_newest"]
    assert _train_rows(run) == _train_rows(ref)
    assert _same_tensors(run / "adapter" / "adapter_model.safetensors", ref / "adapter" / "adapter_model.safetensors")


if __name__ == "__main__":
    _serve()
