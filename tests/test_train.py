import json

import pytest
import torch

from tunesmith.cli import main
from tunesmith.data import load_data
from tunesmith.errors import TunesmithError
from tunesmith.train import RunLog, Schedule, StepRecord, budget_horizon, train

from .conftest import make_model, tiny_train_config


def _run(tmp_path, tiny_dir, text_file, tokenizer, name="run", **kw):
    cfg = tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / name), **kw)
    return train(cfg, progress=False)


def test_same_seed_same_losses_and_adapter(tmp_path, tiny_dir, text_file, tokenizer):
    a = _run(tmp_path, tiny_dir, text_file, tokenizer, "a")
    b = _run(tmp_path, tiny_dir, text_file, tokenizer, "b")
    c = _run(tmp_path, tiny_dir, text_file, tokenizer, "c", seed=1)
    assert len(a.losses) == 5 and a.losses == b.losses
    assert a.losses != c.losses
    from safetensors.torch import load_file

    wa, wb = load_file(a.adapter_dir / "adapter_model.safetensors"), load_file(b.adapter_dir / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_training_lowers_the_loss_and_writes_the_run_folder(tmp_path, tiny_dir, text_file, tokenizer):
    r = _run(tmp_path, tiny_dir, text_file, tokenizer, max_steps=30, eval_every=10, lora_targets=["all-linear"])
    assert sum(r.losses[-5:]) / 5 < sum(r.losses[:5]) / 5 - 0.3  # nats
    rows = [json.loads(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in rows if row["kind"] == "train"]
    evals = [row for row in rows if row["kind"] == "eval"]
    assert [row["step"] for row in train_rows] == list(range(1, 31))
    assert [row["loss"] for row in train_rows] == r.losses
    assert [row["step"] for row in evals] == [10, 20, 30]
    assert evals[-1]["val_ppl"] == pytest.approx(r.evals[-1][1].perplexity)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert (r.run_dir / "config.yaml").is_file() and (r.adapter_dir / "adapter_model.safetensors").is_file()


def test_gradient_accumulation_matches_the_larger_batch(tmp_path, tiny_dir, text_file, tokenizer):
    big = _run(tmp_path, tiny_dir, text_file, tokenizer, "big", batch_size=4, grad_accum=1, lora_dropout=0.0)
    acc = _run(tmp_path, tiny_dir, text_file, tokenizer, "acc", batch_size=2, grad_accum=2, lora_dropout=0.0)
    assert acc.losses == pytest.approx(big.losses, abs=1e-6)


def test_injected_model_and_data_are_used(tmp_path, tokenizer, text_file):
    data = load_data(str(text_file), tokenizer, seq_len=16)
    cfg = tiny_train_config(tmp_path, "unused-model-name", "unused-data", max_steps=2)
    r = train(cfg, model=make_model(tokenizer), tokenizer=tokenizer, data=data, progress=False)
    assert r.steps == 2 and r.tokens == 2 * 2 * 15  # 2 steps x 2 blocks x 15 predicted tokens


def test_epochs_set_the_step_count(tmp_path, tiny_dir, text_file, tokenizer):
    data = load_data(str(text_file), tokenizer, seq_len=32, val_fraction=0.05)
    r = _run(tmp_path, tiny_dir, text_file, tokenizer, max_steps=None, epochs=0.5, batch_size=4)
    assert r.steps == max(1, round(0.5 * (len(data.train) // 4)))


def test_schedule_warms_up_then_decays_to_a_tenth():
    s = Schedule(total=100, warmup=10)
    assert s(0) == pytest.approx(1 / 11) and s(10) == pytest.approx(1.0)
    assert s(55) < s(20) and s(100) == pytest.approx(0.1)


@pytest.mark.parametrize("kw,msg", [({"grad_accum": 0}, "--grad-accum"), ({"max_steps": 0}, "--max-steps"),
                                    ({"lora_targets": ["nope_proj"]}, "its linear layers are")])
def test_bad_settings_are_clear_errors(tmp_path, tiny_dir, text_file, tokenizer, kw, msg):
    with pytest.raises(TunesmithError, match=msg):
        _run(tmp_path, tiny_dir, text_file, tokenizer, **kw)


# ---- what can be passed in: the loss and a per-step callback ---------------------------------------------------


def test_an_injected_loss_is_what_trains_and_the_callback_sees_every_step(tmp_path, tiny_dir, text_file, tokenizer):
    from tunesmith.evaluate import loss_sum

    calls = []

    def counted(model, batch):  # loss_sum, counted: the plain path's loss, so the run must be its bit for bit
        calls.append(batch["input_ids"].shape[0])
        return loss_sum(model, batch)

    seen: list[StepRecord] = []
    default = _run(tmp_path, tiny_dir, text_file, tokenizer, "default", fast_paths="off")
    r = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "injected"), fast_paths="off"),
              loss=counted, callback=seen.append, progress=False)
    assert calls == [2] * 5 and r.losses == default.losses  # one micro-batch of 2 per step, the same losses
    rows = [json.loads(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if row["kind"] == "train"]
    assert [s.step for s in seen] == [1, 2, 3, 4, 5] and not any(s.skipped for s in seen)
    assert [(s.loss, s.lr, s.grad_norm, s.tokens, s.elapsed) for s in seen] == [
        (row["loss"], row["lr"], row["grad_norm"], row["tokens"], row["elapsed_s"]) for row in rows
    ]

    doubled = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "doubled")),
                    loss=lambda model, batch: (2 * loss_sum(model, batch)[0], 0), progress=False)
    assert doubled.losses[0] == pytest.approx(2 * default.losses[0], rel=1e-6)  # the loss passed in is the one used


def test_a_callback_that_raises_stops_the_run_after_that_step(tmp_path, tiny_dir, text_file, tokenizer):
    class Enough(Exception):
        pass

    def stop_at_3(record: StepRecord) -> None:
        if record.step == 3:
            raise Enough

    cfg = tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=8, checkpoint_every=3)
    with pytest.raises(Enough):
        train(cfg, callback=stop_at_3, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["kind"] == "train"] == [1, 2, 3]
    assert (tmp_path / "run" / "checkpoints" / "step-000003" / "COMMITTED").is_file()  # step 3's checkpoint came first


def test_run_log_flushes_each_row_and_is_quiet_off_the_main_process(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with RunLog(path) as log:
        log.write("train", step=1, loss=2.5)
        assert json.loads(path.read_text()) == {"kind": "train", "step": 1, "loss": 2.5}  # on disk before close
        log.write("oom", step=2, batch_size=1, grad_accum=4)
        assert len(path.read_text().splitlines()) == 2
    other = tmp_path / "other.jsonl"
    with RunLog(other, enabled=False) as log:
        log.write("train", step=1, loss=2.5)
    assert not other.exists()


def test_training_starts_by_naming_device_precision_and_trainable_parameters(tmp_path, tokenizer, text_file, capsys):
    model = make_model(tokenizer)
    every = sum(p.numel() for p in model.parameters())
    cfg = tiny_train_config(tmp_path, "unused", text_file, max_steps=1)
    r = train(cfg, model=model, tokenizer=tokenizer, data=load_data(str(text_file), tokenizer, seq_len=16))
    lora = 2 * (8 * (64 + 64) + 8 * (64 + 32))  # 2 layers, r 8: A (r x in) + B (out x r) on q_proj 64->64, v_proj 64->32
    assert r.trainable_params == lora
    lines = [x for x in capsys.readouterr().err.splitlines() if "trainable parameters" in x]
    assert lines == [f"tunesmith: training on cpu in fp32: {lora:,} trainable parameters, "
                     f"{lora / (every + lora):.2%} of {every + lora:,}; fused loss, fused LoRA, cheap activations recomputed"]


# ---- the time budget and its floor ---------------------------------------------------------------------------


@pytest.mark.parametrize("budget,elapsed,total,min_steps,expected", [
    (300.0, 15.0, 120, 0, 60),    # 5 s a step: 60 fit
    (300.0, 30.0, 120, 0, 30),    # a busy machine, 10 s a step: 30
    (300.0, 30.0, 120, 40, 40),   # ... but never below the floor
    (300.0, 3.0, 120, 40, 120),   # a fast machine: the flags' horizon, the budget does not stretch it
    (300.0, 30.0, 25, 40, 25),    # the floor never lifts the run past --max-steps
    (1e-3, 3.0, 50, 0, 4),        # a budget already spent: the step under way is the last
    (300.0, 0.0, 50, 0, 50),      # a clock that did not move (no division by zero)
])
def test_budget_horizon(budget, elapsed, total, min_steps, expected):
    assert budget_horizon(budget, elapsed, 3, total, min_steps) == expected


def test_the_demo_s_min_steps_trains_that_many_steps_however_little_the_budget(tmp_path, tiny_dir, text_file):
    # A 1 ms budget is spent after any real step, so without a floor the run stops at step 4 (test_checkpoint).
    def config(name, **kw):
        return tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / name), **kw)

    r = train(config("floor", max_steps=50, time_budget=1e-3), progress=False, min_steps=7)
    assert r.steps == 7 and len(r.losses) == 7
    capped = train(config("capped", max_steps=6, time_budget=1e-3), progress=False, min_steps=40)
    assert capped.steps == 6


def test_the_demo_hands_its_min_steps_to_the_trainer(tmp_path, tiny_dir, text_file):
    """`tunesmith demo` on a slow machine: a time budget spent after any step still trains --min-steps steps."""
    import io

    from rich.console import Console

    from tunesmith.config import DemoConfig
    from tunesmith.pipeline import demo

    cfg = DemoConfig(model=str(tiny_dir), data=str(text_file), runs_dir=str(tmp_path), device="cpu", seq_len=32,
                     batch_size=2, max_steps=20, time_budget=1e-3, min_steps=5, eval_batches=1, sample_tokens=2)
    assert demo(cfg, console=Console(file=io.StringIO())).train_steps == 5


def test_the_demo_trains_at_least_the_steps_the_sweep_needs():
    from tunesmith.config import DemoConfig

    demo = DemoConfig()
    # docs/PERFORMANCE.md: lr 3e-3 on q_proj,v_proj passes a 25% held-out drop at step 20; twice that as margin
    assert (demo.lr, demo.lora_targets, demo.min_steps, demo.overwrite) == (3e-3, ["q_proj", "v_proj"], 40, True)
    assert demo.min_steps <= demo.max_steps


# ---- a folder that already holds a run -------------------------------------------------------------------------


def _cli_train(tiny_dir, text_file, run, *extra):
    return main(["train", "--model", str(tiny_dir), "--data", str(text_file), "--output", str(run), "--device", "cpu",
                 "--seq-len", "32", "--batch-size", "2", "--max-steps", "2", "--lr", "1e-2", "--warmup-steps", "1",
                 "--eval-every", "0", *extra])


def test_train_refuses_to_replace_a_finished_run_unless_told(tmp_path, tiny_dir, text_file, capsys, monkeypatch):
    import tunesmith.report

    monkeypatch.setattr(tunesmith.report, "write_report", lambda *a, **k: None)  # plots: not under test here
    run = tmp_path / "run"
    run.mkdir()  # an empty folder is a new one
    assert _cli_train(tiny_dir, text_file, run) == 0
    adapter = run / "adapter" / "adapter_model.safetensors"
    old, old_metrics = adapter.read_bytes(), (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()

    assert _cli_train(tiny_dir, text_file, run, "--seed", "1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tunesmith train: error: {run} already holds a run (an adapter, ")
    assert "--resume" in err[0] and "--overwrite" in err[0]
    assert adapter.read_bytes() == old and (run / "metrics.jsonl").read_bytes() == old_metrics

    assert _cli_train(tiny_dir, text_file, run, "--resume") == 0  # continuing it is fine (nothing left to train)
    assert adapter.read_bytes() == old
    assert _cli_train(tiny_dir, text_file, run, "--seed", "1", "--overwrite") == 0
    assert adapter.read_bytes() != old  # trained afresh with the other seed
    assert "trained 2 steps" in capsys.readouterr().out


def test_the_demo_refuses_before_loading_anything_with_no_overwrite(tmp_path, capsys):
    run = tmp_path / "demo"
    (run / "adapter").mkdir(parents=True)
    assert main(["demo", "--output", str(run), "--no-overwrite", "--model", str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert "already holds a run (an adapter)" in err and "--overwrite" in err
    assert sorted(p.name for p in run.iterdir()) == ["adapter"]


def test_the_wait_for_other_processes_comes_from_the_environment(monkeypatch):
    from tunesmith.errors import TunesmithError
    from tunesmith.train import DIST_TIMEOUT, dist_timeout

    monkeypatch.delenv("TUNESMITH_DIST_TIMEOUT", raising=False)
    assert dist_timeout() == DIST_TIMEOUT == 300.0
    monkeypatch.setenv("TUNESMITH_DIST_TIMEOUT", "60")
    assert dist_timeout() == 60.0
    for bad in ("0", "-5", "soon", "inf"):
        monkeypatch.setenv("TUNESMITH_DIST_TIMEOUT", bad)
        with pytest.raises(TunesmithError, match="TUNESMITH_DIST_TIMEOUT must be a number of seconds > 0"):
            dist_timeout()


# ---- what a user meets through the CLI, in a process of its own -------------------------------------------------


def _cli_process(tmp_path, *args: str, stderr_file=None):
    """`python -m tunesmith.cli ARGS` as a user runs it; stderr to a file (not a terminal) when one is given."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "TUNESMITH_CPU_TRAIN_PRECISION": "fp32"}
    with open(stderr_file or os.devnull, "w") as err:
        done = subprocess.run([sys.executable, "-m", "tunesmith.cli", *args], env=env, cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=err if stderr_file else subprocess.PIPE, timeout=600)
    return done, Path(stderr_file).read_text() if stderr_file else done.stderr


def _train_args(tiny_dir, data, run, *extra):
    return ["train", "--model", str(tiny_dir), "--data", str(data), "--output", str(run), "--device", "cpu",
            "--seq-len", "32", "--batch-size", "2", "--max-steps", "3", "--lr", "1e-2", "--warmup-steps", "1",
            "--eval-every", "0", *extra]


def test_a_log_file_gets_plain_progress_lines_and_the_report_samples_and_device(tmp_path, tiny_dir, text_file):
    run, log = tmp_path / "run", tmp_path / "train.log"
    done, err = _cli_process(tmp_path, *_train_args(tiny_dir, text_file, run), stderr_file=log)
    assert done.returncode == 0, err
    lines = [x for x in err.splitlines() if x.startswith("tunesmith: train ")]
    # the first step and the last (a 3-step run ends well within the 30 s between lines)
    assert [x.split(":")[1].split()[1] for x in lines] == ["1/3", "3/3"], err
    assert "loss " in lines[0] and "tok/s" in lines[0] and "left" in lines[0] and "nan" not in err
    assert "with so few" not in err  # the small-data hint is for the default --lr; this run set its own
    summary = json.loads((run / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["precision"] == "fp32" and summary["valid_examples"] > 0
    samples = json.loads((run / "samples.json").read_text())
    assert len(samples) == min(2, summary["valid_examples"]) and all(s["prompt"] and s["after"] for s in samples)
    assert "trained on cpu, fp32" in done.stdout
    if summary["valid_examples"] < 4:  # the tiny corpus holds out one block
        assert "warning: the validation set holds" in done.stdout

    # --resume on the finished run: one line, exit 0, nothing rewritten
    adapter = run / "adapter" / "adapter_model.safetensors"
    old, report = adapter.stat().st_mtime_ns, (run / "report.html").stat().st_mtime_ns
    done, err = _cli_process(tmp_path, *_train_args(tiny_dir, text_file, run, "--resume"))
    assert done.returncode == 0 and done.stdout == "", (done.stdout, err)
    assert f"{run} is finished (3 of 3 steps" in err and "overwrite" not in err.split("nothing to resume")[0]
    assert adapter.stat().st_mtime_ns == old and (run / "report.html").stat().st_mtime_ns == report


def test_a_small_training_set_at_the_default_rate_gets_the_hint_on_the_start_line(tmp_path, tiny_dir, text_file):
    args = [a for a in _train_args(tiny_dir, text_file, tmp_path / "run") if a not in ("--lr", "1e-2")]
    done, err = _cli_process(tmp_path, *args, "--max-steps", "1")
    assert done.returncode == 0, err
    assert "training examples: with so few, the default --lr 0.0002" in err
    assert "--lr 1e-3 --lora-targets all-linear" in err


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(tmp_path, text_file):
    run = tmp_path / "runs" / "new"
    done, err = _cli_process(tmp_path, *_train_args(tmp_path / "no-such-model", text_file, run))
    assert done.returncode == 2 and "not found" in err, err
    assert not run.exists()


def test_plain_progress_prints_the_first_step_every_interval_and_the_last():
    import io

    from tunesmith.progress import Progress

    now = [0.0]
    out = io.StringIO()
    bar = Progress(interval=30, stream=out, terminal=False, now=lambda: now[0])
    task = bar.task("train", 10)
    for _ in range(10):
        now[0] += 7
        task.advance(info="loss 1.0000")
    shown = [line.split()[2] for line in out.getvalue().splitlines()]
    assert shown == ["1/10", "6/10", "10/10"]  # at 7 s, 42 s (35 s later), and the last
    quiet = Progress(interval=30, stream=out, terminal=False, now=lambda: now[0]).task("evaluate", 3, first=False)
    before = out.getvalue()
    for _ in range(3):
        quiet.advance()
    assert out.getvalue() == before  # a short evaluation says nothing in a log


def test_eval_batches_is_bounded_by_default_and_all_means_the_whole_split():
    from tunesmith.cli import build_parser
    from tunesmith.config import TrainConfig, build_config

    assert TrainConfig().eval_batches == 25
    for flag, value, expected in (("--eval-batches", "all", 0), ("--val-batches", "7", 7)):
        args = vars(build_parser().parse_args(["train", flag, value]))
        args.pop("verb"), args.pop("config", None)
        assert build_config(TrainConfig, None, args).eval_batches == expected


def test_a_small_training_set_at_the_default_rate_gets_the_settings_that_learned_one(tmp_path, tokenizer, text_file):
    from tunesmith.config import TrainConfig
    from tunesmith.train import _small_data_hint

    data = load_data(str(text_file), tokenizer, seq_len=32)
    said = []
    _small_data_hint(TrainConfig(), data, said.append)
    assert said and said[0].startswith(f"{len(data.train)} training examples: with so few, the default --lr 0.0002")
    assert "--lr 1e-3 --lora-targets all-linear" in said[0]
    said.clear()
    _small_data_hint(TrainConfig(lr=1e-3), data, said.append)
    assert not said
