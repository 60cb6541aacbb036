"""SIGINT / SIGTERM: finish the current step, save a checkpoint, exit 130 / 143; a second Ctrl-C cannot corrupt it."""

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tunesmith import checkpoint as ck
from tunesmith import storage
from tunesmith.cli import main
from tunesmith.errors import Interrupted

from .conftest import tiny_train_config

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _argv(tiny_dir, text_file, run: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(tiny_dir), "--data", str(text_file), "--output", str(run), "--device", "cpu",
            "--seq-len", "32", "--batch-size", "2", "--lr", "1e-2", "--warmup-steps", "1", "--eval-every", "0",
            "--max-steps", "100000", "--checkpoint-every", "0", *extra]


def _train_steps(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
    return [json.loads(x)["step"] for x in lines if x.endswith("}") and '"kind": "train"' in x]


class _SignalAtForward:
    """Send `signum` to this process before the n-th training forward of any model (a real signal, a real
    handler: the one train() installed)."""

    def __init__(self, n: int, signum: int = signal.SIGINT):
        self.n, self.signum, self.calls = n, signum, 0

    def __call__(self, module, args):
        from transformers import LlamaForCausalLM

        if isinstance(module, LlamaForCausalLM) and module.training:
            self.calls += 1
            if self.calls == self.n:
                os.kill(os.getpid(), self.signum)

    def __enter__(self):
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


# `python -c PAUSED N READY GO <tunesmith argv>`: the real CLI, paused before its N-th training forward. It says so
# on fd READY and waits for a byte on fd GO, so the parent's signal lands inside step N, whatever the machine's speed.
PAUSED = """
import os, runpy, sys, torch
from transformers import LlamaForCausalLM
n, ready, go = (int(a) for a in sys.argv[1:4])
del sys.argv[1:4]
calls = [0]
def hook(module, args):
    if isinstance(module, LlamaForCausalLM) and module.training:
        calls[0] += 1
        if calls[0] == n:
            os.write(ready, b"x")
            os.read(go, 1)
torch.nn.modules.module.register_module_forward_pre_hook(hook)
runpy.run_module("tunesmith.cli", run_name="__main__", alter_sys=True)
"""


def test_sigterm_then_sigint_each_leave_a_resumable_checkpoint_and_the_documented_code(tmp_path, tiny_dir, text_file,
                                                                                         capsys):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    with (tmp_path / "out.txt").open("w") as out, (tmp_path / "err.txt").open("w") as err_file:
        proc = subprocess.Popen([sys.executable, "-c", PAUSED, "4", str(ready_w), str(go_r),
                                 *_argv(tiny_dir, text_file, run)], cwd=REPO, env=env, stdout=out, stderr=err_file,
                                pass_fds=(ready_w, go_r))
    os.close(ready_w)
    os.close(go_r)
    try:  # the timeout only catches a hung child; one that exits early closes the pipe and fails here at once
        paused = select.select([ready_r], [], [], 600)[0] and os.read(ready_r, 1) == b"x"
        assert paused, f"the run never reached step 4:\n{(tmp_path / 'err.txt').read_text()[-3000:]}"
        proc.send_signal(signal.SIGTERM)  # what `kill`, systemd or a batch scheduler sends; it lands inside step 4
        os.write(go_w, b"x")
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(ready_r)
        os.close(go_w)
    err = (tmp_path / "err.txt").read_text()
    assert proc.returncode == 143, err
    saved = ck.newest_checkpoint(run / "checkpoints")  # it verifies: resumable
    assert saved.step == 4  # the step under way when the signal came, and no further
    assert _train_steps(run) == [1, 2, 3, 4]
    assert "stopped: SIGTERM after step 4: checkpoint" in err and "--resume" in err
    assert "Traceback" not in err

    # Resume it (another process: this one), and stop it with Ctrl-C two steps later.
    with _SignalAtForward(2):
        code = main(_argv(tiny_dir, text_file, run, "--resume"))
    err = capsys.readouterr().err
    assert code == 130 and f"resuming from {saved.path}" in err
    assert "stopped: SIGINT after step 6" in err
    again = ck.newest_checkpoint(run / "checkpoints")
    assert again.step == 6 and _train_steps(run) == list(range(1, 7))


def test_a_second_ctrl_c_during_the_save_does_not_corrupt_it(tmp_path, tiny_dir, text_file, monkeypatch, capfd):
    from tunesmith.train import train

    real, again = storage.fsync_file, []

    def second_ctrl_c(f):  # the user presses Ctrl-C again while the checkpoint is being written
        if not again and "checkpoints" in f.name:
            again.append(f.name)
            os.kill(os.getpid(), signal.SIGINT)
        return real(f)

    monkeypatch.setattr(storage, "fsync_file", second_ctrl_c)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    cfg = tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=50, checkpoint_every=0)
    with _SignalAtForward(3), pytest.raises(Interrupted) as e:
        train(cfg, progress=False)
    assert e.value.exit_code == 130 and again
    saved = ck.verify(tmp_path / "run" / "checkpoints" / "step-000003")  # complete, every sha256 right
    assert saved.step == 3
    assert "still saving the checkpoint" in capfd.readouterr().err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # handlers given back


def test_train_help_documents_the_exit_codes(capsys):
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "130 stopped by Ctrl-C (SIGINT) or 143 by SIGTERM" in text and "--resume [PATH]" in text
