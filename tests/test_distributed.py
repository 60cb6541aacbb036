"""Several processes on the CPU (gloo): the same run on 2 processes as on 1, each process its own share of every
step, gradients synchronized, only the main process writing, exact resume (on 2 processes, and on 1), processes
that disagree stopped with one error, and a process killed mid-run: the launcher stops the other, says so, and
the run resumes.

Two-process runs go through torch's launcher (tests/dist_worker.py, or `tunesmith train --gpus 2`); each costs
~10-20 s on a 2-core machine, so the runs are few and each checks several things.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import CORPUS, make_model, make_tokenizer

REPO = Path(__file__).resolve().parents[1]
STEPS, PER_STEP = 4, 4  # 2 processes x micro-batch 2 == 1 process x micro-batch 4
BASE = dict(device="cpu", seq_len=32, max_steps=STEPS, lr=1e-2, warmup_steps=1, lora_dropout=0.0, eval_every=2,
            checkpoint_every=2, seed=0, fast_paths="off")


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    return env


def _two_processes(tmp_path: Path, name: str, config: dict, rank_overrides: dict | None = None,
                   force_mlp: bool = False, default_loss: bool = False) -> list[dict]:
    out = tmp_path / f"{name}-out"
    out.mkdir()
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"config": config, "out": str(out), "rank_overrides": rank_overrides or {},
                                "force_mlp": force_mlp, "default_loss": default_loss}))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "tests" / "dist_worker.py"), str(spec)],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1) if (out / f"rank{r}.json").is_file()]
    assert len(records) == 2, proc.stderr[-3000:]
    return records


def _one_process(config: dict):
    """The same run in this process, recording each step's examples as the worker does."""
    from tunesmith.config import TrainConfig
    from tunesmith.data import load_data
    from tunesmith.evaluate import loss_sum
    from tunesmith.train import train

    cfg = TrainConfig(**config)
    tok = make_tokenizer()
    steps: list[list] = [[]]

    def recording(model, batch):
        steps[-1].extend(batch["input_ids"].tolist())
        return loss_sum(model, batch)

    data = load_data(cfg.data, tok, cfg.seq_len, cfg.val_fraction)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker: the same reduction order; restored for the tests after this one
    try:
        r = train(cfg, model=make_model(tok), tokenizer=tok, data=data, loss=recording,
                  callback=lambda _: steps.append([]), progress=False)
    finally:
        torch.set_num_threads(threads)
    return r, steps[:-1]


@pytest.fixture
def corpus(tmp_path) -> Path:
    """Numbered lines: every token block differs, so a block seen twice means an example seen twice."""
    p = tmp_path / "corpus.txt"
    p.write_text("".join(f"Line {i}: but soft, what light through yonder window {i * 7} breaks?\n" for i in range(300)),
                 encoding="utf-8")
    return p


@pytest.mark.slow
def test_two_processes_train_as_one_shard_sync_write_once_and_resume_exactly(tmp_path, corpus):
    two = {**BASE, "data": str(corpus), "output": str(tmp_path / "two"), "batch_size": 2}
    r0, r1 = _two_processes(tmp_path, "two", two)
    one, one_steps = _one_process({**BASE, "data": str(corpus), "output": str(tmp_path / "one"), "batch_size": 4})

    # the same examples per step, split: no example on both processes, together the 1-process run's
    for s in range(STEPS):
        mine0, mine1 = {tuple(x) for x in r0["steps"][s]}, {tuple(x) for x in r1["steps"][s]}
        assert len(r0["steps"][s]) == len(r1["steps"][s]) == PER_STEP // 2
        assert not mine0 & mine1
        assert sorted(r0["steps"][s] + r1["steps"][s]) == sorted(one_steps[s])
    # the loss of every step is the whole step's (both processes'), and equals the 1-process run's
    assert r0["losses"] == r1["losses"]
    assert r0["losses"] == pytest.approx(one.losses, rel=1e-5)
    assert r0["losses"][-1] < r0["losses"][0]  # it trained
    assert r0["tokens"] == one.tokens
    assert [e for _, e in r0["evals"]] == pytest.approx([e.loss for _, e in one.evals], rel=1e-5)
    # gradients synchronized: both processes end with the same weights, bit for bit
    assert r0["weights"] == r1["weights"]
    # only the main process writes: config, every checkpoint, the adapter
    assert r0["calls"] == ["save_config", "checkpoint", "checkpoint", "save_adapter"]
    assert r1["calls"] == []
    saved = json.loads((tmp_path / "two" / "checkpoints" / "step-000002" / "state.json").read_text())
    assert len(saved["rng_ranks"]) == 2 and saved["world"] == 2 and saved["per_step"] == PER_STEP
    from safetensors.torch import load_file

    a2 = load_file(tmp_path / "two" / "adapter" / "adapter_model.safetensors")
    a1 = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    assert a2.keys() == a1.keys()
    for k in a2:  # Adam divides by the gradient's size: where a gradient is ~0, rounding moves a weight by a
        torch.testing.assert_close(a2[k], a1[k], rtol=0, atol=0.2 * BASE["lr"])  # fraction of a step

    # exact resume of the 2-process run from its step-2 checkpoint, on 2 processes: the same losses, bit for bit
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    ckpt = resumed / "checkpoints" / "step-000002"
    q0, q1 = _two_processes(tmp_path, "resumed", {**two, "output": str(resumed), "resume": str(ckpt)})
    assert q0["losses"] == r0["losses"], "a resumed 2-process run must continue exactly"
    assert q0["weights"] == q1["weights"] == r0["weights"]

    # and on 1 process: the checkpoint's 4 examples per step are kept (micro-batch 2 x 2), the same losses to rounding
    single = tmp_path / "single"
    shutil.copytree(tmp_path / "two", single)
    r, _ = _one_process({**two, "output": str(single), "resume": str(single / "checkpoints" / "step-000002")})
    assert r.losses[:3] == pytest.approx(r0["losses"][:3], rel=1e-5)  # (Adam amplifies rounding a little later)
    assert r.losses == pytest.approx(r0["losses"], rel=1e-3)


@pytest.mark.slow
def test_two_processes_with_the_lora_aware_mlp_train_as_one(tmp_path, corpus, monkeypatch):
    """DDP over the LoRA-aware MLP (on by default on CUDA; here its plain-PyTorch reference): the gradients of its
    adapters are synchronized like PEFT's, and the run is the 1-process run."""
    from tunesmith.kernels import lora_mlp

    kw = {**BASE, "data": str(corpus), "lora_targets": ["all-linear"], "fast_paths": "auto"}
    r0, r1 = _two_processes(tmp_path, "mlp", {**kw, "output": str(tmp_path / "two"), "batch_size": 2}, force_mlp=True)
    monkeypatch.setattr(lora_mlp.LoraMLP, "applies", lambda self, setting, model: setting.lora)
    one, _ = _one_process({**kw, "output": str(tmp_path / "one"), "batch_size": 4})
    assert r0["fused_mlps"] == r1["fused_mlps"] == [2]  # both layers' MLPs, on each process
    assert r0["weights"] == r1["weights"]
    assert r0["losses"] == pytest.approx(one.losses, rel=1e-5) and r0["losses"][-1] < r0["losses"][0]
    a2 = load_adapter(tmp_path / "two")
    assert any("mlp.down_proj.lora_B" in k for k in a2)
    for k, v in load_adapter(tmp_path / "one").items():
        torch.testing.assert_close(a2[k], v, rtol=0, atol=0.2 * BASE["lr"])


def load_adapter(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "adapter" / "adapter_model.safetensors")


@pytest.mark.slow
def test_processes_that_disagree_stop_with_one_error(tmp_path, corpus):
    config = {**BASE, "data": str(corpus), "output": str(tmp_path / "run"), "batch_size": 2}
    records = _two_processes(tmp_path, "disagree", config, rank_overrides={"1": {"lr": 5e-3}})
    for r in records:
        assert "disagree" in r["error"] and "config" in r["error"], r
    assert not (tmp_path / "run" / "adapter").exists()


@pytest.mark.slow
def _process_of_rank(pid: int, rank: str, deadline: float):
    """The launcher's child training as `rank`. Children come and go (short-lived helpers a library spawns): one
    that is gone, or not yet readable, between listing and reading is skipped, and the search repeats until found."""
    import psutil

    while True:
        for p in psutil.Process(pid).children(recursive=True):
            try:
                if p.environ().get("RANK") == rank and "tunesmith.cli" in " ".join(p.cmdline()):
                    return p
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        assert time.monotonic() < deadline, f"no process of rank {rank} found"
        time.sleep(0.05)


def _live_trainers(parent) -> list:
    import psutil

    live = []
    for p in parent.children(recursive=True):
        try:
            if "tunesmith.cli" in " ".join(p.cmdline()) and p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                live.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return live


def test_a_killed_process_stops_the_run_cleanly_and_it_resumes(tmp_path, corpus, tiny_dir):
    import psutil

    argv = [sys.executable, "-m", "tunesmith.cli", "train", "--model", str(tiny_dir), "--data", str(corpus),
            "--output", str(tmp_path / "run"), "--device", "cpu", "--gpus", "2", "--seq-len", "32",
            "--batch-size", "2", "--lr", "1e-2", "--warmup-steps", "1", "--lora-dropout", "0", "--eval-every", "0",
            "--checkpoint-every", "2", "--max-steps", "100000"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            cwd=tmp_path)
    first = tmp_path / "run" / "checkpoints" / "step-000002" / "COMMITTED"
    deadline = time.monotonic() + 240
    while not first.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
        time.sleep(0.05)
    victim = _process_of_rank(proc.pid, "1", deadline)
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - killed_at < 90, "the other process was left hanging"
    assert proc.returncode != 0
    assert "process 1 (killed by SIGKILL) of the 2-process run failed; the other (0) stopped with it" in err, err[-3000:]
    assert "--resume" in err, err[-3000:]
    assert not _live_trainers(psutil.Process())

    from tunesmith.checkpoint import complete_checkpoints

    step = complete_checkpoints(tmp_path / "run" / "checkpoints")[0][0]
    resumed = subprocess.run([*argv[:-1], str(step + 2), "--resume"], capture_output=True, text=True,
                             env=_env(), cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {tmp_path / 'run' / 'checkpoints'}" in resumed.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, step + 3))
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------------------------------------ in this process


def test_the_failure_is_named_whichever_of_its_consequences_ended_first(tmp_path):
    """A killed process's peer ends either by the launcher's SIGTERM or on its own (PeerLost) on finding it gone,
    whichever comes first: a race that a busy machine decides. The line names the killed one either way."""
    from types import SimpleNamespace as F

    from tunesmith.distributed import failure_message
    from tunesmith.errors import PeerLost

    killed = "process 1 (killed by SIGKILL) of the 2-process run failed; the other (0) stopped with it; no checkpoint"
    for peer in (-signal.SIGTERM, PeerLost.exit_code):
        assert failure_message({0: F(exitcode=peer), 1: F(exitcode=-signal.SIGKILL)}, 2, tmp_path).startswith(killed)
    assert failure_message({1: F(exitcode=2), 2: F(exitcode=-signal.SIGKILL), 0: F(exitcode=PeerLost.exit_code)},
                           4, tmp_path).startswith("process 1 (exit code 2), process 2 (killed by SIGKILL) of the "
                                                   "4-process run failed; the others (0, 3) stopped with them")
    # nothing but consequences (a collective timed out everywhere): each is named as what it is
    assert failure_message({0: F(exitcode=PeerLost.exit_code), 1: F(exitcode=PeerLost.exit_code)}, 2,
                           tmp_path).startswith("process 0 (stopped: another process stopped or did not answer), "
                                                "process 1 (stopped: another process stopped or did not answer) of")


def test_gpus_without_gpus_names_the_cpu_fix():
    from tunesmith.distributed import check_launch
    from tunesmith.errors import TunesmithError

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA GPUs")
    with pytest.raises(TunesmithError, match="--device cpu --gpus N"):
        check_launch(2, "cuda")
    with pytest.raises(TunesmithError, match="MPS is one device"):
        check_launch(2, "mps")
    check_launch(2, "cpu")  # N CPU processes on gloo


def test_fsdp_is_refused_off_cuda_and_with_a_quantized_base(monkeypatch, tmp_path, tiny_dir, corpus):
    from tunesmith.config import TrainConfig
    from tunesmith.errors import TunesmithError
    from tunesmith.train import train

    monkeypatch.setenv("WORLD_SIZE", "2")  # as a launcher sets it; refused before any process group starts
    cfg = TrainConfig(**{**BASE, "model": str(tiny_dir), "data": str(corpus), "output": str(tmp_path / "r"),
                         "strategy": "fsdp"})
    with pytest.raises(TunesmithError, match="--strategy fsdp shards over CUDA GPUs; on cpu use --strategy ddp"):
        train(cfg, progress=False)


def test_sharded_evaluation_sums_to_the_single_process_result(tiny_model):
    from tunesmith.data import load_data
    from tunesmith.evaluate import evaluate

    tok = make_tokenizer()
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.txt"
        p.write_text(CORPUS, encoding="utf-8")
        examples = load_data(str(p), tok, 32, 0.0).train[:11]  # 11: the processes' shares differ in length
    whole = evaluate(tiny_model, examples, 4)
    parts = []
    for rank in (0, 1):
        def keep(v, _parts=parts):
            _parts.append(v)
            return v
        evaluate(tiny_model, examples, 4, shard=(rank, 2), all_sum=keep)
    sums = [parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]]
    assert sums[1] == whole.tokens
    assert sums[0] / sums[1] == pytest.approx(whole.loss, rel=1e-6)


def test_planner_per_gpu_shards_fsdp_and_adds_buckets_for_ddp():
    from dataclasses import replace

    from transformers import LlamaConfig

    from tunesmith.memory import KNOWN_CONFIGS, ModelShape, TrainSetup, train_parts

    shape = ModelShape.from_config(LlamaConfig(**KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"]))
    s = TrainSetup(seq_len=2048, batch_size=1, lora_rank=16, lora_targets=("all-linear",), precision="bf16",
                   gradient_checkpointing=True, fused_loss=True)
    one = train_parts(shape, s)
    ddp = train_parts(shape, replace(s, world=2))
    fsdp = train_parts(shape, replace(s, world=2, strategy="fsdp"))
    assert ddp["weights"] == one["weights"] and ddp["ddp_buckets"] == one["gradients"]
    assert fsdp["weights"] == -(-one["weights"] // 2) and fsdp["optimizer"] == -(-one["optimizer"] // 2)
    assert fsdp["activations"] == one["activations"]
    # an 8B's bf16 weights dominate: two GPUs under FSDP2 need well under the one GPU's peak each
    assert sum(fsdp.values()) < 0.6 * sum(one.values())


def test_the_fsdp2_plugin_wraps_each_decoder_layer(tiny_model):
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from tunesmith.distributed import fsdp_plugin

    plugin = fsdp_plugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    plugin.set_auto_wrap_policy(tiny_model)
    wrap = fsdp2_prepare_auto_wrap_policy(plugin, tiny_model)
    wrapped = [type(m).__name__ for m in tiny_model.modules() if wrap(m)]
    assert wrapped == ["LlamaDecoderLayer"] * tiny_model.config.num_hidden_layers


def _records(tmp_path: Path) -> Path:
    """prompt/completion records of different lengths: padded, or packed where the fast paths pack them."""
    data = tmp_path / "records.jsonl"
    words = "speak hear me now what light through yonder window breaks soft".split()
    data.write_text("".join(json.dumps({"prompt": " ".join(words[: 1 + i % 5]) + ":",
                                        "completion": " " + " ".join(words[i % 7:][: 2 + i % 9])}) + "\n"
                            for i in range(40)), encoding="utf-8")
    return data


def _cli_losses(tmp_path: Path, name: str, *argv: str) -> tuple[list[float], str]:
    out = subprocess.run([sys.executable, "-m", "tunesmith.cli", "train", "--output", str(tmp_path / name), *argv],
                         capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"], out.stderr


@pytest.mark.slow
def test_two_cpu_processes_train_as_one_on_jsonl_records(tmp_path, tiny_dir):
    """`tunesmith train --gpus 2 --device cpu` on prompt/completion records, with the default fast paths (the
    fused loss, packed records): the losses of one process at twice the micro-batch, and the start line says so."""
    argv = ["--model", str(tiny_dir), "--data", str(_records(tmp_path)), "--device", "cpu", "--seq-len", "32",
            "--max-steps", "4", "--lr", "1e-2", "--warmup-steps", "1", "--lora-dropout", "0", "--eval-every", "0",
            "--precision", "fp32"]
    two, err = _cli_losses(tmp_path, "two", *argv, "--gpus", "2", "--batch-size", "2")
    one, _ = _cli_losses(tmp_path, "one", *argv, "--batch-size", "4")
    assert "training on cpu x 2 processes" in err and "packed records" in err
    assert two == pytest.approx(one, rel=1e-5) and len(two) == 4


def test_accelerate_s_one_process_cpu_launch_is_named_with_the_way_to_run_several(tmp_path, tiny_dir):
    """`accelerate launch --cpu --num_processes 2` starts one process (its multi-CPU mode needs MPI): the run says
    so, and how to start several, instead of training as one process without a word."""
    env = {**_env(), "ACCELERATE_USE_CPU": "True"}
    out = subprocess.run([sys.executable, "-m", "tunesmith.cli", "train", "--model", str(tiny_dir), "--data",
                          str(_records(tmp_path)), "--output", str(tmp_path / "run"), "--device", "cpu",
                          "--seq-len", "32", "--max-steps", "1", "--eval-every", "0"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "accelerate launch --cpu started one process" in out.stderr
    assert "tunesmith train --gpus N --device cpu" in out.stderr
