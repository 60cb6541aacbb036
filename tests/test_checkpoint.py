"""Checkpoints: what is in one, atomic saves that fail cleanly, retention, verification, the non-finite guard."""

import contextlib
import errno
import hashlib
import importlib
import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tunesmith import checkpoint as ck
from tunesmith import storage
from tunesmith.data import load_data
from tunesmith.errors import TunesmithError
from tunesmith.lora import check_adapter_folder
from tunesmith.train import Schedule, train

from .conftest import make_model, tiny_train_config


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: several times faster for the tiny model on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@contextlib.contextmanager
def _keeping(n: int | None):
    """Runs keep `n` checkpoints (0: all; None: the trainer's own number) inside the block."""
    kept = ck.KEEP
    ck.KEEP = kept if n is None else n
    try:
        yield
    finally:
        ck.KEEP = kept


def _train(tmp_path, tiny_dir, text_file, name="run", progress=False, keep=0, **kw):
    base = dict(max_steps=4, checkpoint_every=2, lora_dropout=0.1)
    cfg = tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / name), **{**base, **kw})
    with _keeping(keep):
        return train(cfg, progress=progress)


def _injected(tmp_path, text_file, tokenizer, name="run", model=None, keep=0, **kw):
    """A run on a model the test holds (to hook it), with the tiny data."""
    base = dict(max_steps=5, checkpoint_every=1, lora_dropout=0.0)
    cfg = tiny_train_config(tmp_path, "injected", text_file, output=str(tmp_path / name), **{**base, **kw})
    data = load_data(str(text_file), tokenizer, cfg.seq_len, cfg.val_fraction)
    with _keeping(keep):
        return train(cfg, model=model or make_model(tokenizer), tokenizer=tokenizer, data=data, progress=False)


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _weights(folder: Path, name: str = ck.ADAPTER) -> dict[str, torch.Tensor]:
    return load_file(folder / name)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rows(run: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


# ---- what a checkpoint holds --------------------------------------------------------------------------------


def test_a_checkpoint_is_plain_files_a_marker_and_sha256s(tmp_path, tiny_dir, text_file):
    r = _train(tmp_path, tiny_dir, text_file)
    root = r.run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000004"]
    last = root / "step-000004"
    assert sorted(p.name for p in last.iterdir()) == sorted([ck.ADAPTER, ck.ADAPTER_CONFIG, ck.BASE_FILE, ck.OPTIMIZER,
                                                             ck.STATE, ck.MARKER])
    state = json.loads((last / ck.STATE).read_text())
    marker = json.loads((last / ck.MARKER).read_text())
    assert marker == {ck.STATE: hashlib.sha256((last / ck.STATE).read_bytes()).hexdigest()}
    for name, digest in state["files"].items():
        assert hashlib.sha256((last / name).read_bytes()).hexdigest() == digest
    assert state["step"] == 4 and state["schedule_total"] == 4 and state["tokens"] == r.tokens
    assert set(state["rng"]) == {"python", "numpy", "torch"} and state["device"] == "cpu"
    assert state["config"]["lr"] == 1e-2 and state["scheduler"]["last_epoch"] == 4
    # Nothing needs pickle: the tensors are safetensors (pickle streams start with 0x80), the rest is JSON.
    assert not any(p.read_bytes()[:1] == b"\x80" for p in last.iterdir())
    opt = _weights(last, ck.OPTIMIZER)
    assert {k.rsplit(".", 1)[1] for k in opt} == {"step", "exp_avg", "exp_avg_sq"}
    assert torch.equal(opt["state.0.step"], torch.tensor(4.0))
    # The final checkpoint's weights are the adapter's, and the folder is itself a loadable PEFT adapter.
    assert _equal(_weights(last), _weights(r.adapter_dir))
    assert check_adapter_folder(last) == last


def test_a_run_keeps_the_two_newest_checkpoints(tmp_path, tiny_dir, text_file):
    r = _train(tmp_path, tiny_dir, text_file, max_steps=5, checkpoint_every=1, keep=None)
    assert sorted(p.name for p in (r.run_dir / "checkpoints").iterdir()) == ["step-000004", "step-000005"]


def test_a_time_budget_cut_is_restored_on_resume(tmp_path, tiny_dir, text_file):
    full = _train(tmp_path, tiny_dir, text_file, "full", max_steps=50, time_budget=1e-3, checkpoint_every=1)
    assert full.steps == 4  # cut after the 3 calibration steps
    resumed = _train(tmp_path, tiny_dir, text_file, "full", max_steps=50, time_budget=1e-3, checkpoint_every=1,
                     resume=str(full.run_dir / "checkpoints" / "step-000003"))
    assert resumed.steps == 4 and [r["step"] for r in _rows(resumed.run_dir, "train")] == [1, 2, 3, 4]
    assert resumed.losses == full.losses


def test_resume_is_a_flag_with_an_optional_path(tmp_path):
    from tunesmith.cli import build_parser
    from tunesmith.config import TrainConfig, build_config

    def parsed(*argv):
        return vars(build_parser().parse_args(["train", *argv])).get("resume")

    assert parsed() is None and parsed("--resume") is True and parsed("--resume", "runs/x/checkpoints/step-000010") \
        == "runs/x/checkpoints/step-000010"
    assert parsed("--resume", "--lr", "1e-3") is True
    (tmp_path / "run.yaml").write_text("resume: true\n")
    cfg = build_config(TrainConfig, tmp_path / "run.yaml")
    assert (cfg.resume, TrainConfig().resume) == (True, False)


def test_a_tampered_state_json_is_a_named_error_not_a_crash(tmp_path, tiny_dir, text_file):
    r = _train(tmp_path, tiny_dir, text_file, max_steps=2, checkpoint_every=2)
    ckpt = r.run_dir / "checkpoints" / "step-000002"
    state = json.loads((ckpt / ck.STATE).read_text())
    state["rng"]["python"] = "not a state"
    (ckpt / ck.STATE).write_text(json.dumps(state))
    (ckpt / ck.MARKER).write_text(json.dumps({ck.STATE: hashlib.sha256((ckpt / ck.STATE).read_bytes()).hexdigest()}))
    with pytest.raises(TunesmithError, match="RNG state is malformed"):
        _train(tmp_path, tiny_dir, text_file, max_steps=4, checkpoint_every=2, resume=True)


# ---- saves that fail -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fail_on", [ck.OPTIMIZER, ck.MARKER])
def test_a_failed_save_leaves_the_previous_checkpoint_byte_identical(tmp_path, tiny_dir, text_file, monkeypatch, fail_on):
    root = tmp_path / "run" / "checkpoints"
    before: dict[str, bytes] = {}
    def full_disk(real):  # the disk fills while step 4 is being saved
        def write(path: Path, data) -> str:
            if "step-000004" in str(path) and path.name == fail_on:
                before.update(_bytes(root / "step-000002"))
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(path, data)
        return write

    monkeypatch.setattr(ck, "write_file", full_disk(ck.write_file))  # the marker and the JSON parts
    monkeypatch.setattr(ck, "_write_part", full_disk(ck._write_part))  # the tensors
    with pytest.raises(TunesmithError) as e:
        _train(tmp_path, tiny_dir, text_file, max_steps=6, keep=1)
    assert "could not save checkpoint" in str(e.value) and "step-000004: No space left on device" in str(e.value)
    assert "The previous checkpoint step-000002 is intact" in str(e.value) and "--resume" in str(e.value)
    assert before and _bytes(root / "step-000002") == before
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]  # no half-written folder left behind
    assert ck.newest_checkpoint(root).step == 2


def test_a_save_over_a_file_size_quota_fails_cleanly(tmp_path, text_file, tokenizer):
    resource = pytest.importorskip("resource")
    model = make_model(tokenizer)
    root = tmp_path / "run" / "checkpoints"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else exceeding the quota kills the process
    before: dict[str, bytes] = {}
    calls = {"n": 0}

    def quota(module, args):  # in step 3, after step 2's checkpoint: files may no longer exceed 4 KiB
        calls["n"] += module.training
        if calls["n"] == 3 and not before:
            before.update(_bytes(root / "step-000002"))
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))

    model.register_forward_pre_hook(quota)
    try:
        with pytest.raises(TunesmithError) as e:
            _injected(tmp_path, text_file, tokenizer, model=model, max_steps=6, checkpoint_every=2, keep=1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_xfsz)
    assert "could not save checkpoint" in str(e.value) and "File too large" in str(e.value)
    assert _bytes(root / "step-000002") == before
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]


# ---- finding a checkpoint to resume --------------------------------------------------------------------------


def test_resume_without_a_complete_checkpoint_is_a_clear_error(tmp_path, tiny_dir, text_file):
    (tmp_path / "run" / "checkpoints" / ".tmp-step-000002-1").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-000004").mkdir()  # renamed into place, never marked COMMITTED
    with pytest.raises(TunesmithError, match=r"nothing to resume: .* no complete checkpoint \(2 interrupted"):
        _train(tmp_path, tiny_dir, text_file, resume=True)


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, tiny_dir, text_file, capsys):
    full = _train(tmp_path, tiny_dir, text_file, max_steps=6, checkpoint_every=2)
    final = _weights(full.adapter_dir)
    root = full.run_dir / "checkpoints"
    bad = root / "step-000006" / ck.OPTIMIZER
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0x01  # one bit in the tensor data: safetensors itself cannot notice, the sha256 does
    bad.write_bytes(bytes(data))
    with (full.run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 7, "lo')  # a kill in the middle of a line
    with pytest.raises(TunesmithError, match="step-000006: optimizer.safetensors fails its sha256 check"):
        _train(tmp_path, tiny_dir, text_file, max_steps=6, checkpoint_every=2, resume=str(bad.parent))
    capsys.readouterr()
    r = _train(tmp_path, tiny_dir, text_file, max_steps=6, checkpoint_every=2, resume=True, progress=True)
    err = capsys.readouterr().err
    assert "optimizer.safetensors fails its sha256 check (the file is damaged); falling back to the previous" in err
    assert "resuming from" in err and "step-000004" in err
    assert [row["step"] for row in _rows(r.run_dir, "train")] == [1, 2, 3, 4, 5, 6]
    assert _equal(_weights(r.adapter_dir), final)


def test_changed_settings_are_warned_about_and_then_apply(tmp_path, tiny_dir, text_file, capsys):
    first = _train(tmp_path, tiny_dir, text_file, max_steps=4, checkpoint_every=2)
    step2 = str(first.run_dir / "checkpoints" / "step-000002")
    kw = dict(max_steps=4, checkpoint_every=2, resume=step2, lr=5e-3, progress=True)
    r = _train(tmp_path, tiny_dir, text_file, **kw)
    assert "with settings that differ from the checkpoint's: lr: 0.01 -> 0.005" in capsys.readouterr().err
    lrs = [row["lr"] for row in _rows(r.run_dir, "train")]
    assert lrs[2] == 5e-3 * Schedule(4, 1)(2)  # the new --lr takes effect from the checkpoint on


def test_overwrite_replaces_an_earlier_runs_checkpoints_and_without_it_nothing_is_touched(tmp_path, tiny_dir,
                                                                                          text_file, capsys):
    first = _train(tmp_path, tiny_dir, text_file, max_steps=6, checkpoint_every=3, keep=0)
    before = {p.relative_to(first.run_dir): p.read_bytes() for p in first.run_dir.rglob("*") if p.is_file()}
    with pytest.raises(TunesmithError, match=r"already holds a run \(an adapter, checkpoints up to step-000006, "
                                             r"metrics.jsonl\); add --resume to continue it, --overwrite to replace"):
        _train(tmp_path, tiny_dir, text_file, max_steps=4, checkpoint_every=2, keep=0)
    assert {p.relative_to(first.run_dir): p.read_bytes() for p in first.run_dir.rglob("*") if p.is_file()} == before
    r = _train(tmp_path, tiny_dir, text_file, max_steps=4, checkpoint_every=2, keep=0, overwrite=True, progress=True)
    assert "--overwrite: replacing the run in" in capsys.readouterr().err
    assert sorted(p.name for p in (r.run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert [row["step"] for row in _rows(r.run_dir, "train")] == [1, 2, 3, 4]


def test_a_checkpoint_writes_its_tensors_without_a_copy_of_them_in_memory(tmp_path):
    """Full fine-tuning checkpoints every weight and two moments each: building the file in memory first held a
    second copy of all of them, the whole run's peak (docs/MEMORY.md)."""
    import tracemalloc

    import safetensors.torch  # noqa: F401  (its import's own allocations are not the copy looked for)

    tensors = {"w": torch.arange(4 * 2**20, dtype=torch.float32), "m": torch.ones(2**20)}  # 20 MiB
    tracemalloc.start()
    digest = ck._write_part(tmp_path / "t.safetensors", tensors)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * 2**20, peak  # hashing reads 1 MiB at a time; all 20 MiB as bytes before
    assert digest == ck._file_sha256(tmp_path / "t.safetensors")
    back = storage.read_safetensors(tmp_path / "t.safetensors")
    assert torch.equal(back["w"], tensors["w"]) and torch.equal(back["m"], tensors["m"])
    with pytest.raises(OSError, match="No such file or directory"):  # safetensors' own I/O error, as an OSError
        ck._write_part(tmp_path / "missing" / "t.safetensors", tensors)


def test_safetensors_that_are_truncated_or_bit_flipped_are_named_errors(tmp_path):
    good = tmp_path / "good.safetensors"
    ck._write_part(good, {"w": torch.arange(64.0)})
    raw = good.read_bytes()
    for name, data in [("truncated", raw[:-7]), ("empty", b""), ("flipped", raw[:20] + bytes([raw[20] ^ 0x40]) + raw[21:])]:
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(data)
        for reader in (storage.read_safetensors, storage.check_safetensors):
            with pytest.raises(TunesmithError, match=rf"{name}.safetensors: not a readable safetensors file"):
                reader(bad)
    assert torch.equal(storage.read_safetensors(good)["w"], torch.arange(64.0))


# ---- the non-finite guard ------------------------------------------------------------------------------------


class _NanGrad(torch.autograd.Function):
    """Identity forward (a finite loss), NaN backward (a NaN gradient norm)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _inf_loss(logits: torch.Tensor) -> torch.Tensor:
    mask = torch.full_like(logits, float("-inf"))
    mask[..., 0] = 0.0  # only token 0 stays possible: every real target gets probability 0, loss +inf
    return logits + mask


def _poison(model, steps: set[int], how) -> None:
    """With grad-accum 1, the n-th training forward belongs to step n. The hook sits on the output layer's logits,
    which only the plain loss computes: these runs take --fast-paths off (test_kernels poisons the fused loss)."""
    calls = {"n": 0}

    def hook(module, args, output):
        if module.training:
            calls["n"] += 1
            if calls["n"] in steps:
                return how(output)
        return None

    model.lm_head.register_forward_hook(hook)


def _fused_adamw_on_the_cpu(monkeypatch) -> list:
    """torch's fused AdamW (CUDA's default) on the CPU, where its kernel exists too: the run then takes the
    guard's on-device skip (train._step_on_device), whose calls are counted."""
    T = importlib.import_module("tunesmith.train")
    step, calls = T._step_on_device, []

    def fused(cfg, params, device):
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True), "fused AdamW"

    def counted(*a):
        calls.append(1)
        return step(*a)

    monkeypatch.setattr(T, "make_optimizer", fused)
    monkeypatch.setattr(T, "_step_on_device", counted)
    return calls


@pytest.mark.parametrize("on_device", [False, True], ids=["host-skip", "device-skip"])
@pytest.mark.parametrize("how,loss", [(_inf_loss, "inf"), (_NanGrad.apply, None)])
def test_a_non_finite_step_is_skipped_and_leaves_the_weights(tmp_path, text_file, tokenizer, how, loss, on_device,
                                                             monkeypatch):
    calls = _fused_adamw_on_the_cpu(monkeypatch) if on_device else None
    model = make_model(tokenizer)
    _poison(model, {3}, how)
    r = _injected(tmp_path, text_file, tokenizer, model=model, max_steps=5, fast_paths="off")
    if on_device:
        assert len(calls) == 5  # every step's verdict taken by the fused kernel
    root = r.run_dir / "checkpoints"
    after = {s: _weights(root / f"step-00000{s}") for s in (2, 3, 4)}
    assert _equal(after[3], after[2])  # weights after the bad step s equal those after s - 1
    assert _equal(_weights(root / "step-000003", ck.OPTIMIZER), _weights(root / "step-000002", ck.OPTIMIZER))
    assert not _equal(after[4], after[3])  # and training goes on
    skip = _rows(r.run_dir, "skip")
    assert [(row["step"], row["in_a_row"]) for row in skip] == [(3, 1)]
    if loss == "inf":
        assert skip[0]["loss"] == "inf"
    else:
        assert skip[0]["grad_norm"] == "nan" and skip[0]["loss"] != "nan"
    assert [row["step"] for row in _rows(r.run_dir, "train")] == [1, 2, 4, 5] and len(r.losses) == 4


def test_k_bad_steps_in_a_row_stop_the_run_with_the_last_checkpoint_intact(tmp_path, text_file, tokenizer,
                                                                          monkeypatch):
    monkeypatch.setattr(importlib.import_module("tunesmith.train"), "MAX_BAD_STEPS", 3)
    model = make_model(tokenizer)
    _poison(model, {3, 4, 5}, _inf_loss)
    with pytest.raises(TunesmithError) as e:
        _injected(tmp_path, text_file, tokenizer, model=model, max_steps=8, checkpoint_every=2, fast_paths="off")
    msg = str(e.value)
    assert msg.startswith("steps 3..5: the loss or gradient norm was NaN/inf 3 times in a row")
    assert "step-000004, is intact" in msg and "Lower --lr (now 0.01)" in msg and "--resume" in msg
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for _, p in ck.complete_checkpoints(root)] == ["step-000004", "step-000002"]
    assert ck.verify(root / "step-000004").state["bad_streak"] == 2
    assert _equal(_weights(root / "step-000004"), _weights(root / "step-000002"))  # the good weights, kept


def test_the_on_device_step_with_early_batches_resumes_exactly(tmp_path, tiny_dir, text_file, monkeypatch):
    """The CUDA path (the fused kernel's skip, the next step's micro-batches made before the step's one sync),
    taken on the CPU: a run cut at step 3 and resumed gives the uninterrupted run's losses and adapter, bit for
    bit, with gradient accumulation and dropout."""
    import shutil

    T = importlib.import_module("tunesmith.train")
    calls = _fused_adamw_on_the_cpu(monkeypatch)
    early, made, used, accumulate = [], T._device_batches, [], T._accumulate
    monkeypatch.setattr(T, "_device_batches", lambda *a: early.append(1) or made(*a))
    monkeypatch.setattr(T, "_accumulate", lambda *a: used.append(a[8] is not None) or accumulate(*a))  # a[8]: ready
    kw = dict(max_steps=6, checkpoint_every=3, grad_accum=2, batch_size=1, lora_dropout=0.05)
    ref = train(tiny_train_config(tmp_path / "ref", tiny_dir, text_file, **kw), progress=False)
    assert len(calls) == 6 and len(early) == 5  # every step after the first had its batches made early
    assert used == [False] + [True] * 5  # and trained on them (the resumed run's step 4 makes its own: the same)
    cut = tmp_path / "cut" / "run"
    shutil.copytree(ref.run_dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step-000006")
    shutil.rmtree(cut / ref.adapter_dir.name)
    again = train(tiny_train_config(tmp_path / "cut", tiny_dir, text_file, resume=True, **kw), progress=False)
    assert again.losses == ref.losses and len(ref.losses) == 6 and ref.losses[-1] < ref.losses[0]
    a, b = _weights(ref.adapter_dir, "adapter_model.safetensors"), _weights(again.adapter_dir, "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
