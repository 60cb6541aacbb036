"""Training throughput: tunesmith against the transformers Trainer + PEFT, with Liger Kernel, and Unsloth.

Every tool trains the same LoRA on the same token blocks, in the same order, for the same number of optimizer
steps, each in its own process (Liger and Unsloth patch transformers classes globally). Per tool and row:

- tokens/s: micro-batch x seq tokens per step over the mean step time after the warm-up steps, the last step
  left out (the clock reads at each step's end, after a CUDA synchronize);
- peak memory: torch.cuda.max_memory_allocated over the whole run on CUDA (loading included), the process's
  own peak RSS (VmHWM: tunesmith.device.peak_rss_bytes) on the CPU;
- MFU (CUDA): FLOPs per token x tokens/s over the bf16 matmul peak measured first (8192^3 torch.matmul).
  FLOPs per token = 6 x LoRA parameters + 4 x frozen parameters (the decoder's linears and the output head,
  counted once whether tied or not; the embedding is a lookup) + 12 x layers x seq x hidden for attention
  (PaLM's formula, which counts the full score matrix, not its causal half);
- the mean loss of the first and last 5 steps: every tool should be training the same problem.

The -ckpt and -qlora rows train with gradient checkpointing in every tool: tunesmith with its most memory-saving setting
(`gradient_checkpointing=offload`, the rows' `checkpointing`), Unsloth with its default offloaded checkpointing, the Trainer's
tools with its `gradient_checkpointing`.
- the GPU's state over the timed steps (CUDA, where nvidia-smi answers): the median SM clock and board power and
  the highest temperature, sampled every 100 ms by the parent process while the tool runs. A GPU that lowers its
  clock under a power or heat limit runs a faster tool's steps slower: same-run ratios carry that, and this says
  how much.

GPU rows use random weights (torch.manual_seed(0)) of the real shapes, saved once as bf16 safetensors with a
small tokenizer built in code (no downloads) under --workdir; their tokens are random. The CPU row trains the
real SmolLM2-135M on the built-in Shakespeare. The GPU run needs liger-kernel and unsloth (with unsloth_zoo,
bitsandbytes, trl, datasets, tyro...): `pip install liger-kernel unsloth` online; offline machines get them as
the wheels that `bench/gpu.sh wheels` downloads into .whl/ (it says how to install each set there).

    python bench/train_throughput.py --device cuda --out throughput-cuda.jsonl
    python bench/train_throughput.py --device cpu --out throughput-cpu.jsonl
    python bench/train_throughput.py --device cpu --smoke        # the plumbing, in seconds

`--repeat N` runs the tools N times in turn (tunesmith, peer, tunesmith, peer, ...) and ends with each peer's
ratio over the rounds: the ratio of the median tokens/s and each round's own ratio, so one slow run (a host
stall, a GPU that has just lowered its clock) shows as itself instead of deciding the figure.

A tool that fails (not installed, out of memory, crash, --timeout) gets its error in the table and the run
goes on; each process's stderr is kept in <workdir>/logs/. The table goes to docs/PERFORMANCE.md with the
hardware and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from common import GIB, L1B, L8B, OFFLINE_ENV, SMOL, Row, model_folder, versions

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QV = ("q_proj", "v_proj")
TOOLS = ["tunesmith", "tunesmith-plain", "hf", "liger", "unsloth"]
PLAIN_FLAGS = {"fast_paths": "off"}  # the plain PyTorch + PEFT path: none of tunesmith's fast paths
PACKAGES = ("torch", "transformers", "peft", "accelerate", "liger-kernel", "unsloth", "unsloth_zoo", "torchao",
            "bitsandbytes", "triton")
NF4_TOOLS = ("tunesmith", "tunesmith-plain", "unsloth")  # a 4-bit base: tunesmith's nf4 against Unsloth's bnb nf4

ROWS = {r.name: r for r in [
    Row("llama-1b", L1B, 2048, 8, 16, 32, ("all-linear",)),
    Row("llama-8b", L8B, 2048, 4, 16, 32, ("all-linear",)),
    Row("llama-1b-ckpt", L1B, 2048, 8, 16, 32, ("all-linear",), checkpointing="offload"),
    Row("llama-8b-ckpt", L8B, 2048, 4, 16, 32, ("all-linear",), checkpointing="offload"),
    Row("llama-8b-qlora", L8B, 2048, 4, 16, 32, ("all-linear",), base="nf4", checkpointing="offload"),
    Row("llama-1b-qlora", L1B, 2048, 8, 16, 32, ("all-linear",), base="nf4", checkpointing="offload"),  # quick check
    Row("llama-1b-qv", L1B, 1024, 8, 8, 16, QV),
    Row("smollm2", SMOL, 1024, 8, 8, 16, QV),
    Row("smollm2-cpu", "real:smollm2-135m-instruct", 256, 4, 8, 16, QV),
    Row("smoke", "tiny", 32, 2, 8, 16, ("all-linear",)),
    Row("smoke-qlora", "tiny", 32, 2, 8, 16, ("all-linear",), base="nf4", checkpointing=True),
]}
DEFAULTS = {  # device -> rows, tools, steps, warm-up steps
    "cuda": (["llama-1b", "llama-8b", "llama-8b-qlora", "llama-1b-qv", "smollm2"], TOOLS, 30, 5),
    "cpu": (["smollm2-cpu"], TOOLS[:3], 12, 3),
}


# ------------------------------------------------------------------------------------- models, data, FLOPs


def examples(row: Row, steps: int, folder: Path) -> list[tuple[list[int], list[int]]]:
    """batch x steps full-length (input_ids, labels) blocks, the same in every worker."""
    n = row.batch * steps
    if row.shape.startswith("real:"):
        from tunesmith.data import load_data
        from tunesmith.models import load_tokenizer

        data = load_data("shakespeare", load_tokenizer(str(folder)), row.seq)
        full = [ex for ex in data.train if len(ex[0]) == row.seq]
        return [full[i % len(full)] for i in range(n)]
    import torch

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (n, row.seq), generator=torch.Generator().manual_seed(0)).tolist()
    return [(r, r) for r in ids]


def flops_per_token(config: dict, row: Row) -> float:
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    linears = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
               "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    targets = ALL_LINEAR if row.targets == ("all-linear",) else row.targets
    head = h * config["vocab_size"]  # the output head's matmul, once, tied or not
    frozen = layers * sum(i * o for i, o in linears.values()) + head
    lora = layers * sum(row.rank * sum(linears[t]) for t in targets)
    # PaLM's attention term counts the full score matrix (QK^T and its product with V), not the causal half.
    return 6 * lora + 4 * frozen + 12 * layers * row.seq * h


# ----------------------------------------------------------------------------------------------- the tools


def parse_flags(text: str) -> dict:
    """'recompute=False,chunk=4,lr=1e-3,x=y' -> {'recompute': False, 'chunk': 4, 'lr': 0.001, 'x': 'y'}."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, raw = (x.strip() for x in item.partition("="))
        if not eq:
            raise SystemExit(f"--ts-flags: {item!r} is not name=value")
        out[key] = raw  # a string unless it reads as a bool or a number
        with contextlib.suppress(json.JSONDecodeError):
            out[key] = json.loads(raw.lower() if raw.lower() in ("true", "false") else raw)
    return out


def run_tunesmith(a, row: Row, folder: Path, data: list) -> tuple[list[float], list[float], int, dict]:
    from tunesmith.config import TrainConfig
    from tunesmith.data import TokenData
    from tunesmith.train import train

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    flags = parse_flags(a.ts_flags) | (PLAIN_FLAGS if a.worker == "tunesmith-plain" else {})
    for name in sorted(set(flags) - known):
        print(f"train_throughput: TrainConfig has no field {name!r}; ignored", file=sys.stderr)
    flags = {k: v for k, v in flags.items() if k in known}
    ends: list[float] = []
    walls: list[float] = []  # wall-clock step ends, to match the GPU's samples (gpu_state)
    with tempfile.TemporaryDirectory(prefix="tt-run-", dir=a.workdir) as out:
        settings = dict(
            model=str(folder), output=out, device=a.device,
            precision="bf16" if a.device == "cuda" else "fp32", seq_len=row.seq, batch_size=row.batch,
            max_steps=a.steps, lr=2e-4, warmup_steps=0, lora_rank=row.rank, lora_alpha=row.alpha,
            lora_dropout=a.dropout, lora_targets=list(row.targets), eval_every=0, checkpoint_every=0,
            seed=0, overwrite=True, quantize_base="nf4" if row.base == "nf4" else "none",
            gradient_checkpointing=row.checkpointing,
        )
        cfg = TrainConfig(**{**settings, **flags})  # --ts-flags may override any of these (precision=bf16...)
        # StepRecord.elapsed is read right after the step's synchronize, before the end-of-run checkpoint.
        result = train(cfg, data=TokenData(train=data, valid=[], source="bench"), progress=False,
                       callback=lambda r: (ends.append(r.elapsed), walls.append(time.time())))
    times = [b - e for e, b in zip([0.0, *ends], ends, strict=False)]
    notes = {"flags": flags, "step_end_unix": walls}
    if flags.get("gradient_checkpointing", row.checkpointing):
        notes["gradient_checkpointing"] = str(flags.get("gradient_checkpointing", row.checkpointing))
    if row.base == "nf4":  # the strategy the nf4 kernels timed fastest for each product shape (kernels.nf4)
        from tunesmith.kernels import nf4

        notes["nf4_strategies"] = {str(k[2:]): v for k, v in nf4.CHOICE.items()}
    return times, result.losses, result.trainable_params, notes


def run_trainer(a, row: Row, folder: Path, data: list) -> tuple[list[float], list[float], int, dict]:
    """The plain recipe: transformers Trainer + PEFT (hf), the same with use_liger_kernel (liger), or
    Unsloth's model and LoRA under the same Trainer (unsloth)."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from tunesmith.train import epoch_order

    cuda = a.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    all_linear = row.targets == ("all-linear",)
    notes: dict = {}
    checkpointed = bool(row.checkpointing)
    if a.worker == "unsloth":
        from unsloth import FastLanguageModel

        four = row.base == "nf4"  # bitsandbytes' nf4, double-quantized, quantized from the bf16 folder as it loads
        model, _ = FastLanguageModel.from_pretrained(
            model_name=str(folder), max_seq_length=row.seq, dtype=dtype, load_in_4bit=four,
            load_in_16bit=not four, local_files_only=True)
        unsloth_ckpt = checkpointed or a.unsloth_checkpointing == "unsloth"
        model = FastLanguageModel.get_peft_model(
            model, r=row.rank, target_modules=ALL_LINEAR if all_linear else list(row.targets),
            lora_alpha=row.alpha, lora_dropout=a.dropout, bias="none",
            use_gradient_checkpointing="unsloth" if unsloth_ckpt else False, random_state=0)
        notes["gradient_checkpointing"] = ("unsloth (its default), as every tool checkpoints in this row"
                                           if checkpointed else
                                           "unsloth (its default; the other tools run without)" if unsloth_ckpt
                                           else "off, as the other tools")
        notes["load_in_4bit"] = four
    else:
        if row.base != "bf16":
            raise RuntimeError(f"{a.worker} is not run on a {row.base} base (those rows: {', '.join(NF4_TOOLS)})")
        if a.worker == "liger":
            import liger_kernel  # noqa: F401  -- missing: a clear ImportError before the model loads
        from peft import LoraConfig, get_peft_model

        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
        model = get_peft_model(model, LoraConfig(
            r=row.rank, lora_alpha=row.alpha, lora_dropout=a.dropout, task_type="CAUSAL_LM",
            target_modules="all-linear" if all_linear else list(row.targets)))
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class Clock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.walls: list[float] = []
            self.losses: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.times.append(time.perf_counter() - self.t0)
            self.walls.append(time.time())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    # tunesmith's step order, read in sequence: every tool's step k trains on the same examples
    ds = [{"input_ids": torch.tensor(ids), "labels": torch.tensor(lab),
           "attention_mask": torch.ones(len(ids), dtype=torch.long)}
          for ids, lab in (data[i] for i in epoch_order(len(data), 0, 0))]
    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="tt-hf-", dir=a.workdir) as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=row.batch, max_steps=a.steps, learning_rate=2e-4,
            lr_scheduler_type="constant", warmup_steps=0, bf16=cuda, use_cpu=not cuda, logging_steps=1,
            save_strategy="no", report_to=[], dataloader_num_workers=0, remove_unused_columns=False, seed=0,
            gradient_checkpointing=checkpointed and a.worker != "unsloth", use_liger_kernel=a.worker == "liger",
            disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[clock])
        trainer._get_train_sampler = lambda *_, **__: torch.utils.data.SequentialSampler(ds)
        trainer.train()
    notes["optim"] = str(args.optim)
    notes["step_end_unix"] = clock.walls
    return clock.times, clock.losses, sum(p.numel() for p in model.parameters() if p.requires_grad), notes


def worker(a) -> dict:
    if a.worker == "unsloth":  # first, before transformers and peft load: Unsloth patches them as they do
        os.environ.update(OFFLINE_ENV)
        import unsloth  # noqa: F401
    import torch

    from tunesmith.device import peak_rss_bytes

    row, folder = ROWS[a.row], Path(a.model_dir)
    torch.manual_seed(0)
    data = examples(row, a.steps, folder)
    run = run_tunesmith if a.worker.startswith("tunesmith") else run_trainer
    times, losses, trainable, notes = run(a, row, folder, data)
    # The last step is left out too, as the warm-up steps are: the timed window the published figures used.
    timed = times[a.warmup:-1] or times
    tps = row.batch * row.seq / (sum(timed) / len(timed))
    peak = (torch.cuda.max_memory_allocated() if a.device == "cuda"  # the whole run's, loading included
            else peak_rss_bytes())
    fpt = flops_per_token(json.loads((folder / "config.json").read_text()), row)
    mfu = fpt * tps / a.peak_flops if a.peak_flops else None
    return {"tokens_per_s": tps, "peak_gib": peak / GIB, "mfu": mfu, "steps": len(times),
            "step_s_list": times, "losses": losses, "error": None, "flops_per_token": fpt,
            "trainable_params": trainable, **notes}


def measure_peak() -> dict:
    """The bf16 matmul peak: an 8192^3 torch.matmul, 3 warm-ups, then the mean of 10 timed by CUDA events."""
    import torch

    n = 8192
    x, y = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(3 + 10):
        if i == 3:  # the warm-ups are done
            torch.cuda.synchronize()
            start.record()
        torch.matmul(x, y)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    return {"gpu": torch.cuda.get_device_name(0), "peak_flops": 2 * n**3 / seconds}


# ----------------------------------------------------------------------------------------------- the driver


def spawn(args: list[str], timeout: float, log: Path) -> tuple[dict | None, str]:
    """Run this script with `args` in its own process group (compile workers die with it), stderr to `log`;
    its JSON line (the last stdout line that starts with '{') and, without one, why."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=err,
                                text=True, env={**os.environ, **OFFLINE_ENV}, start_new_session=True)
        why = ""
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, why = proc.communicate()[0], f"timed out after {timeout:.0f}s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
    with contextlib.suppress(json.JSONDecodeError, TypeError):
        return json.loads(line), ""
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return None, why or (tail[-1].strip()[:300] if tail else f"exit code {proc.returncode}, no output")


GPU_QUERY = "clocks.sm,power.draw,temperature.gpu"


class GpuSampler:
    """While the `with` block runs (and `on`): nvidia-smi's SM clock (MHz), board power (W) and temperature (C)
    every 100 ms, each stamped with this process's wall clock. No samples where nvidia-smi is missing or fails."""

    def __init__(self, on: bool = True):
        self.on = on
        self.samples: list[tuple[float, float, float, float]] = []
        self.proc = self.thread = None

    def __enter__(self):
        import shutil
        import threading

        if self.on and shutil.which("nvidia-smi"):
            gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
            with contextlib.suppress(OSError):
                self.proc = subprocess.Popen(
                    ["nvidia-smi", "-i", gpu, f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits",
                     "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                self.thread = threading.Thread(target=self._read, daemon=True)
                self.thread.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            values = parse_gpu_line(line)
            if values:
                self.samples.append((time.time(), *values))

    def __exit__(self, *exc) -> bool:
        if self.proc is not None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            self.thread.join(timeout=5)
        return False


def parse_gpu_line(line: str) -> tuple[float, float, float] | None:
    """'1980, 689.52, 61' -> (1980.0, 689.52, 61.0); None for anything else ('[N/A]', a header, a blank)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        return tuple(float(p) for p in parts)  # type: ignore[return-value]
    except ValueError:
        return None


def gpu_state(samples: list[tuple[float, ...]], step_ends: list[float], warmup: int) -> dict | None:
    """The GPU over the timed steps, those tokens/s counts (after the warm-up, the last left out): from the end
    of step `warmup` - 1 (the first step's start at warm-up 0) to the end of the next-to-last step. The median SM
    clock and power, the highest temperature and the samples' count; None without a sample in that window."""
    import statistics

    if len(step_ends) < 2:
        return None
    start = step_ends[warmup - 1] if 0 < warmup <= len(step_ends) - 2 else float("-inf")
    inside = [s for s in samples if start <= s[0] <= step_ends[-2]]
    if not inside:
        return None
    return {"sm_mhz": statistics.median(s[1] for s in inside), "power_w": statistics.median(s[2] for s in inside),
            "temp_c_max": max(s[3] for s in inside), "samples": len(inside)}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def rounds_summary(results: list[dict]) -> list[str]:
    """For each row, dropout and peer run in more than one round: tunesmith's median tokens/s over the peer's
    (over the rounds where each ran without error), and each round's own ratio, to 4 decimals (a ratio of 1.0998
    is not 1.100). Nothing where there is one round."""
    import statistics

    lines = []
    speeds: dict[tuple, dict[int, float]] = {}  # (row, dropout, tool) -> round -> tokens/s
    for r in results:
        if not r["error"]:
            speeds.setdefault((r["row"], r["dropout"], r["tool"]), {})[r.get("round", 0)] = r["tokens_per_s"]
    for row, dropout, tool in speeds:
        if tool == "tunesmith":
            continue
        ours, theirs = speeds.get((row, dropout, "tunesmith"), {}), speeds[(row, dropout, tool)]
        if len(ours) < 2 or len(theirs) < 2:
            continue
        each = ", ".join(f"{ours[k] / theirs[k]:.4f}" for k in sorted(ours.keys() & theirs.keys()))
        mine, peer = statistics.median(ours.values()), statistics.median(theirs.values())
        lines.append(f"{row} dropout {dropout:g}, tunesmith ÷ {tool} over {len(ours)} and {len(theirs)} rounds: "
                     f"{mine / peer:.4f} (medians {mine:,.0f} and {peer:,.0f} tokens/s); each round: {each or '-'}")
    return lines


def print_table(results: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption="tunesmith ÷ tool: tunesmith's tokens/s and peak memory over the "
                  "tool's (speed > 1: tunesmith is faster; peak < 1: it needs less memory)")
    for col in ("row", "dropout", "tool", "round", "tokens/s", "peak GiB", "MFU %", "tunesmith ÷ tool: speed", "peak",
                "loss: first 5 → last 5 steps"):
        table.add_column(col, justify="left" if col in ("row", "tool") or col.startswith("loss") else "right")
    # each peer against tunesmith's run of the same round (the last one where a round has several)
    ours = {(r["row"], r["dropout"], r.get("round", 0)): r for r in results
            if r["tool"] == "tunesmith" and not r["error"]}
    for r in results:
        key = [r["row"], f"{r['dropout']:g}", r["tool"], str(r.get("round", 0) + 1)]
        if r["error"]:
            table.add_row(*key, "-", "-", "-", "-", "-", f"[red]failed: {r['error']}")
            continue
        ts = ours.get((r["row"], r["dropout"], r.get("round", 0)))
        speed = f"{ts['tokens_per_s'] / r['tokens_per_s']:.2f}" if ts else "-"
        memory = f"{ts['peak_gib'] / r['peak_gib']:.2f}" if ts else "-"
        mfu = f"{100 * r['mfu']:.1f}" if r["mfu"] is not None else "-"
        loss = f"{mean(r['losses'][:5]):.4f} → {mean(r['losses'][-5:]):.4f}"
        table.add_row(*key, f"{r['tokens_per_s']:,.0f}", f"{r['peak_gib']:.2f}", mfu, speed, memory, loss)
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # a log file gets the whole table
    for r in results:
        if r.get("gradient_checkpointing"):
            print(f"{r['tool']} ({r['row']}, dropout {r['dropout']:g}) trained with gradient checkpointing "
                  f"{r['gradient_checkpointing']}")


def drive(a) -> int:
    rows_default, tools_default, steps, warmup = DEFAULTS[a.device]
    rows = ["smoke"] if a.smoke else (a.rows.split(",") if a.rows else rows_default)
    tools = a.tools.split(",") if a.tools else tools_default
    steps, warmup = (3, 1) if a.smoke else (steps, warmup)
    steps, warmup = a.steps or steps, a.warmup if a.warmup is not None else warmup
    bad = [x for x in rows if x not in ROWS] + [x for x in tools if x not in TOOLS]
    if a.repeat < 1:
        sys.exit(f"--repeat must be at least 1 (got {a.repeat})")
    if bad or warmup >= steps:
        sys.exit(f"unknown rows/tools {bad} (rows: {', '.join(ROWS)}; tools: {', '.join(TOOLS)})" if bad
                 else f"--warmup ({warmup}) must be below --steps ({steps})")
    parse_flags(a.ts_flags)  # a malformed --ts-flags stops here, not in every worker
    workdir = Path(a.workdir)
    out = Path(a.out) if a.out else workdir / "results.jsonl"
    env = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": a.device, **versions(*PACKAGES), "steps": steps,
           "warmup": warmup}
    peak_flops = 0.0
    if a.device == "cuda":
        peak, why = spawn(["--peak", "--device", "cuda"], 300, workdir / "logs" / "peak.log")
        if peak is None or peak.get("error"):
            sys.exit(f"measuring the bf16 matmul peak failed: {why or peak['error']}")
        peak_flops, env["gpu"] = peak["peak_flops"], peak["gpu"]
        env["bf16_peak_tflops"] = round(peak_flops / 1e12, 1)
    print("  ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    results = []
    for name in rows:
        prep, why = spawn(["--prepare", name, "--device", a.device, "--workdir", str(workdir)], a.timeout,
                          workdir / "logs" / f"prepare-{name}.log")
        if prep is not None and prep.get("error"):
            prep, why = None, prep["error"]
        row_tools = [t for t in tools if ROWS[name].base == "bf16" or t in NF4_TOOLS]
        if row_tools != tools:
            print(f"{name}: {', '.join(t for t in tools if t not in row_tools)} not run on its "
                  f"{ROWS[name].base} base", flush=True)
        for dropout, rnd, tool in itertools.product(map(float, a.dropout.split(",")), range(a.repeat), row_tools):
            t0 = time.perf_counter()
            with GpuSampler(a.device == "cuda") as sampler:
                r, err = (None, f"preparing the model failed: {why}") if prep is None else spawn([
                    "--worker", tool, "--row", name, "--dropout", str(dropout), "--device", a.device,
                    "--steps", str(steps), "--warmup", str(warmup), "--workdir", str(workdir),
                    "--model-dir", prep["folder"], "--peak-flops", str(peak_flops), "--ts-flags", a.ts_flags,
                    "--unsloth-checkpointing", a.unsloth_checkpointing,
                ], a.timeout, workdir / "logs" / f"{name}-p{dropout:g}-{tool}{f'-{rnd}' if a.repeat > 1 else ''}.log")
            if r is not None and r.get("step_end_unix"):
                r["gpu_state"] = gpu_state(sampler.samples, r["step_end_unix"], warmup)
            r = {"tool": tool, "row": name, "dropout": dropout, "tokens_per_s": None, "peak_gib": None,
                 "mfu": None, "losses": [], **(r or {}), "round": rnd}
            r["error"] = r.get("error") or err or None
            results.append(r)
            with out.open("a") as f:
                f.write(json.dumps({**r, "env": env}) + "\n")
            took = f"({time.perf_counter() - t0:.0f}s)"
            said = (f"FAILED {r['error']}" if r["error"] else
                    f"{r['tokens_per_s']:,.0f} tok/s, {r['peak_gib']:.2f} GiB")
            if not r["error"] and r.get("gpu_state"):
                g = r["gpu_state"]
                said += f", SM {g['sm_mhz']:.0f} MHz, {g['power_w']:.0f} W, up to {g['temp_c_max']:.0f} C"
            turn = f" (round {rnd + 1} of {a.repeat})" if a.repeat > 1 else ""
            print(f"{name} dropout {dropout:g} {tool}{turn}: {said} {took}", flush=True)
    print_table(results, f"Training throughput, {env.get('gpu', 'CPU')}, {env['date']}")
    for line in rounds_summary(results):
        print(line)
    print(f"results appended to {out}; logs in {workdir / 'logs'}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--rows", default="",
                    help=f"comma-separated, of: {', '.join(ROWS)} (default: the device's)")
    ap.add_argument("--tools", default="",
                    help=f"comma-separated, of: {', '.join(TOOLS)} (default: all; cpu: the first 3)")
    ap.add_argument("--dropout", default="0,0.05", help="LoRA dropouts, comma-separated (a run for each)")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps per run (default: cuda 30, cpu 12)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="first steps left out of the timing, as is the last (default: cuda 5, cpu 3)")
    ap.add_argument("--ts-flags", default="",
                    help="TrainConfig fields for tunesmith and tunesmith-plain, e.g. 'compile=on,seed=1' "
                    "(tunesmith-plain then sets PLAIN_FLAGS over them)")
    ap.add_argument("--unsloth-checkpointing", choices=["unsloth", "off"], default="unsloth",
                    help="Unsloth's use_gradient_checkpointing: its default ('unsloth': offloaded checkpoints), or off "
                         "as the other tools run (the configuration of the figures first quoted for it); the -ckpt "
                         "rows checkpoint in every tool whatever this says")
    ap.add_argument("--out", default="", help="JSON Lines file the results are appended to "
                    "(default: <workdir>/results.jsonl)")
    ap.add_argument("--workdir", default="/tmp/tt-bench", help="model folders, logs, temporary run folders")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per process before it is killed")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds: the tools run in turn this many times, and the ratios over the rounds are printed")
    ap.add_argument("--smoke", action="store_true",
                    help="check the plumbing: a 2-layer hidden-64 model, seq 32, batch 2, 3 steps")
    # internal: one process's part
    ap.add_argument("--worker", choices=TOOLS, help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--peak-flops", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--prepare", help=argparse.SUPPRESS)
    ap.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not (a.worker or a.prepare or a.peak):
        return drive(a)
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    if a.worker:
        a.dropout = float(a.dropout)
    stdout = sys.stdout
    try:  # stdout carries only the result line; whatever the libraries print goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            if a.peak:
                result = measure_peak()
            elif a.prepare:
                result = {"folder": str(model_folder(ROWS[a.prepare], a.device, Path(a.workdir)))}
            else:
                result = worker(a)
    except Exception as e:  # the table shows the error; the log keeps the traceback
        traceback.print_exc()
        message = (str(e).strip().splitlines() or [""])[0]
        result = {"error": f"{type(e).__name__}: {message}"[:300]}
    if a.worker:
        result = {"tool": a.worker, "row": a.row, "dropout": a.dropout, **result}
    print(json.dumps(result), file=stdout, flush=True)
    return 1 if result.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
