"""Out-of-memory recovery: an OOM at step k halves the micro-batch, doubles accumulation, and the run goes on
exactly as a run started at the smaller micro-batch would have.

lora_dropout is 0 here: dropout draws one mask per micro-batch, so a split step draws different masks and the
losses could not be compared bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import make_model, tiny_train_config
from tunesmith.errors import TunesmithError
from tunesmith.evaluate import loss_sum
from tunesmith.train import train

OOM_AT_STEP = 3


def _run(tmp_path, tiny_dir, text_file, tokenizer, name, loss=None, **kw):
    cfg = tiny_train_config(tmp_path / name, tiny_dir, text_file, lora_dropout=0.0, max_steps=6, **kw)
    return train(cfg, model=make_model(tokenizer), tokenizer=tokenizer, loss=loss, progress=False)


class FailAt:
    """A training loss (evaluate.loss_sum) whose call-th call (1-based) and the next times-1 calls raise `exc`."""

    def __init__(self, call: int, exc: BaseException, times: int = 1):
        self.call, self.exc, self.times, self.n = call, exc, times, 0

    def __call__(self, model, batch):
        self.n += 1
        if self.call <= self.n < self.call + self.times:
            raise self.exc
        return loss_sum(model, batch)


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
    RuntimeError("MPS backend out of memory (MPS allocated: 9.00 GB, other allocations: 0 bytes, max allowed: "
                 "9.07 GB). Tried to allocate 80.00 MB on private pool."),
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes."),
], ids=["cuda", "mps", "cpu"])
def test_oom_at_step_k_continues_like_a_run_at_half_the_micro_batch(tmp_path, tiny_dir, text_file, tokenizer, exc):
    reference = _run(tmp_path, tiny_dir, text_file, tokenizer, "small", batch_size=2, grad_accum=2)
    # batch 4 x accum 1: call k is the first micro-batch of step k
    recovered = _run(tmp_path, tiny_dir, text_file, tokenizer, "big", FailAt(OOM_AT_STEP, exc), batch_size=4,
                     grad_accum=1)

    assert (recovered.batch_size, recovered.grad_accum) == (2, 2)
    assert recovered.steps == reference.steps == 6
    assert recovered.losses == pytest.approx(reference.losses, abs=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "big" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in rows if r["kind"] == "oom"] == [{"kind": "oom", "step": OOM_AT_STEP, "batch_size": 2,
                                                        "grad_accum": 2}]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_repeated_oom_halves_again(tmp_path, tiny_dir, text_file, tokenizer):
    reference = _run(tmp_path, tiny_dir, text_file, tokenizer, "one", batch_size=1, grad_accum=4)
    # step 3 at batch 4 is call 3; at batch 2 its first micro-batch (call 4) fails too
    fails = FailAt(OOM_AT_STEP, torch.OutOfMemoryError("CUDA out of memory"), times=2)
    recovered = _run(tmp_path, tiny_dir, text_file, tokenizer, "four", fails, batch_size=4)
    assert (recovered.batch_size, recovered.grad_accum) == (1, 4)
    # float32 rounding: the fused loss sums each micro-batch's rows in its own order (a few ulps of a loss of 6)
    assert recovered.losses == pytest.approx(reference.losses, rel=1e-6)


def test_oom_at_micro_batch_1_gives_up_clearly(tmp_path, tiny_dir, text_file, tokenizer):
    fails = FailAt(2, torch.OutOfMemoryError("CUDA out of memory"), times=100)
    with pytest.raises(TunesmithError, match=r"out of memory at step 2 even at micro-batch 1 with --seq-len 32"):
        _run(tmp_path, tiny_dir, text_file, tokenizer, "hopeless", fails, batch_size=2)


def test_other_errors_are_not_retried(tmp_path, tiny_dir, text_file, tokenizer):
    fails = FailAt(2, RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        _run(tmp_path, tiny_dir, text_file, tokenizer, "bug", fails, batch_size=2)
    assert fails.n == 2
