"""One dataclass per stage. Every default is defined here, once; the CLI and YAML files are built from these.

Precedence: dataclass default < YAML file (``--config run.yaml``) < command-line flag.

Every value is checked where it enters, in one place (`parse_value`): a flag when argparse reads it, a YAML value when
the file is read, and a config built in Python when it is constructed (`Config.__post_init__`). A bad value is one
`TunesmithError` that names the flag: "--lr must be > 0, got -1".
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tunesmith.errors import TunesmithError

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DATA = "shakespeare"
DEMO_PROMPTS = ("ROMEO:\n", "First Citizen:\n", "KING HENRY:\nNow, lords,")  # the demo's samples and ladder


# Flags that train had and has no longer, and what a user writes instead: given as a flag or a YAML key, each is one
# error that says so (not an "unknown flag" with a guess).
REMOVED = {
    **dict.fromkeys(("fused_loss", "liger", "cuda_graphs", "fused_lora", "fused_qkv", "fused_mlp", "pack_records",
                     "fused_adamw"), "the fast paths are chosen for the model and device; --fast-paths off turns "
                    "them all off (--compile and --recompute turn off one each)"),
    "overlap_steps": "steps no longer overlap (it measured level with the default): drop the flag",
    "log_every": "metrics.jsonl records every step: drop the flag",
    "max_bad_steps": "training stops after 5 non-finite steps in a row: drop the flag",
    "on_config_mismatch": "--resume warns about settings that differ from the checkpoint's: drop the flag",
    "dist_timeout": "set TUNESMITH_DIST_TIMEOUT (seconds, default 300) in the environment instead",
    "min_steps": "--time-budget alone decides (the demo keeps --min-steps): drop the flag",
    "keep": "the two newest checkpoints are kept: drop the flag",
}


# Other tools' names for what tunesmith does another way or not at all: given as a flag or a YAML key, each is one
# error that says what to do here, instead of a look-alike flag that means something else (--save-steps is not
# --max-steps). Names that mean what a tunesmith option means are that option's aliases instead.
ELSEWHERE = {
    "steps_per_report": "mlx-lm's; tunesmith reports every step (metrics.jsonl and the progress line): drop it",
    "logging_steps": "Hugging Face's; tunesmith reports every step (metrics.jsonl and the progress line): drop it",
    **dict.fromkeys(("test", "test_batches"), "mlx-lm's; to score test data after training, run tunesmith eval "
                    "--adapter <run folder> --data <test data> (--max-batches bounds it)"),
    "save_steps": "Hugging Face's; here it is --checkpoint-every (mlx-lm's --save-every)",
    "eval_steps": "Hugging Face's; here it is --eval-every (mlx-lm's --steps-per-eval)",
    "warmup_ratio": "Hugging Face's; give --warmup-steps, a number of optimizer steps",
}
# mlx-lm's settings that name what `tunesmith train` always does: accepted, as a flag or as a YAML key set to true,
# so that an mlx-lm command or config runs unchanged; set to false, each is refused with what to do instead.
ALWAYS = {
    "train": "tunesmith train always trains; to score a model without training it, run tunesmith eval",
    "mask_prompt": "the loss is always on the completion (Alpaca: the output) or the assistant's turns only; to "
                   "learn a whole record, prompt included, give it as {\"text\": ...}",
}


def removed(name: str) -> str | None:
    """The error for a flag or YAML key that was removed (--no-fused-loss too) or is another tool's name for what
    tunesmith does another way (ELSEWHERE), or None."""
    key = name.lstrip("-").replace("-", "_")
    if key not in REMOVED and key not in ELSEWHERE and key.startswith("no_"):
        key = key[3:]
    if key in ELSEWHERE:
        return f"{flag(key)} is {ELSEWHERE[key]}"
    if key not in REMOVED:
        return None
    return f"{flag(key)} was removed: {REMOVED[key]}"


@dataclass(frozen=True)
class Bounds:
    """The values a numeric field allows; str() reads as the error says it: '> 0', '>= 1', 'in [0, 1)'."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is excluded
    hi_open: bool = False

    def __contains__(self, x: float) -> bool:
        above = self.lo is None or (x > self.lo if self.lo_open else x >= self.lo)
        below = self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)
        return above and below

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {_show(self.lo)}"
        return f"in {'(' if self.lo_open else '['}{_show(self.lo)}, {_show(self.hi)}{')' if self.hi_open else ']'}"


POSITIVE = Bounds(0, lo_open=True)  # > 0: rates, scales, epochs
COUNT = Bounds(0)  # >= 0, where 0 means off / all / no limit (the help says which)
AT_LEAST_1 = Bounds(1)  # sizes and step counts that must do something
FRACTION = Bounds(0, 1, hi_open=True)  # [0, 1): dropout, a held-out share
SEED = Bounds(0, 2**32 - 1)  # numpy's seed range, which accelerate's set_seed passes it to


def _show(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else repr(x) if isinstance(x, str) else str(x)


def flag(name: str) -> str:
    """The command-line spelling of a field: max_steps -> --max-steps."""
    return "--" + name.replace("_", "-")


def opt(default: Any, help: str, **meta: Any) -> Any:
    """A config field: its default and its --help text, and optional extras: bounds (a Bounds), aliases (other
    names a flag or YAML key may use, e.g. mlx-lm's), and argparse's choices, metavar, nargs, const, type."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def same_as(cls: type, name: str, **changes: Any) -> Any:
    """Another stage's field, its default, help, bounds and aliases included (a planner flag means what the trainer
    flag means); `changes` replace some of them (default=, help=, aliases=)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta = {**f.metadata, **changes}
    default = meta.pop("default", f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
    return opt(default, meta.pop("help"), **meta)


# A field's `type` turns a flag's text or a YAML value into the field's value; it raises ValueError with the end of a
# sentence that starts with the flag's name ("--batch-size must be ..."), and parse_value adds the name.


def batch_size_value(value: str | int) -> int | str:
    """A micro-batch size: a positive integer, or 'auto' (the fit planner picks the largest that fits)."""
    if value == "auto":
        return "auto"
    try:
        return _number(int, value)
    except ValueError:
        raise ValueError(f"must be a positive integer or 'auto', got {value!r}") from None


def batches_value(value: str | int) -> int:
    """A number of batches, or 'all' (read as 0: no limit)."""
    if value == "all":
        return 0
    try:
        return _number(int, value)
    except ValueError:
        raise ValueError(f"must be a number of batches or all, got {value!r}") from None


def resume_value(value: bool | str) -> bool | str:
    """--resume: true (the newest complete checkpoint in --output), false, or a checkpoint or run folder."""
    if isinstance(value, bool) or (isinstance(value, str) and value):
        return value
    raise ValueError(f"must be true, false or a checkpoint folder, got {value!r}")


def checkpointing_value(value: bool | str) -> bool | str:
    """--gradient-checkpointing: true (on), false (off) or 'offload'."""
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if word in ("on", "true"):
        return True
    if word in ("off", "false"):
        return False
    if word == "offload":
        return "offload"
    raise ValueError(f"must be on, off or offload, got {value!r}")


def targets_value(value: str | list[str]) -> list[str]:
    """LoRA target modules: a comma-separated string or a list; 'all-linear' targets every linear layer."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not value or not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("needs module names, e.g. q_proj,v_proj or all-linear")
    return list(value)


def list_value(value: str | list[str]) -> list[str]:
    """A comma-separated string or a list of strings."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"must be a comma-separated list, got {value!r}")
    return list(value)


def adapter_base_model() -> Any:
    """--model for a verb that takes --adapter: not given means the model the adapter was trained on."""
    return opt("", "model: a built-in alias, a local HF folder, a .gguf file, or a hub id "
               f"(default: the one --adapter was trained on, else {DEFAULT_MODEL})")


def adapter_value(value: str | None) -> str | None:
    """An adapter folder, or a run folder that holds one in adapter/ (what train --output / --adapter-path wrote)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"must be a folder, got {value!r}")
    inner = Path(value) / "adapter"
    if value and not (Path(value) / "adapter_config.json").is_file() and (inner / "adapter_config.json").is_file():
        return str(inner)
    return value


def named_adapters_value(value: str | list[str] | dict[str, str]) -> list[str]:
    """Served adapters as NAME=PATH (a bare PATH is named after its folder: the run folder's name for a run folder);
    from a flag (one each time it is given), a YAML list, or a YAML mapping of name: path."""
    if isinstance(value, dict):
        value = [f"{k}={v}" for k, v in value.items()]
    elif isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"must be NAME=PATH (or a list of them), got {value!r}")
    out = []
    for spec in value:
        name, sep, path = spec.partition("=")
        if not sep or "/" in name:  # a bare path (which may itself hold '=' after a '/')
            name, path = "", spec
        path = path.strip()
        if not path:
            raise ValueError(f"must be NAME=PATH or an adapter folder, got {spec!r}")
        name = name.strip() or Path(path.rstrip("/")).name
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"needs a name without spaces, got {spec!r}; write NAME=PATH")
        out.append(f"{name}={adapter_value(path)}")
    return out


class Config:
    """What every stage config shares: its values are checked when it is built, however it is built."""

    always: typing.ClassVar[tuple[str, ...]] = ()  # ALWAYS names this stage accepts

    def __post_init__(self) -> None:
        check_values(type(self), **{f.name: getattr(self, f.name) for f in fields_of(type(self))})
        self.check()

    def check(self) -> None:
        """Rules between fields (one field's bounds are in its metadata); a stage that has some overrides this."""


def adapter_help(purpose: str) -> str:
    return f"LoRA adapter folder (PEFT format) {purpose}, or the run folder that holds it in adapter/"


@dataclass
class ModelConfig(Config):
    """What every stage that loads a model shares."""

    model: str = opt(DEFAULT_MODEL, "model: a built-in alias, a local HF folder, a .gguf file, or a hub id")
    device: str = opt("auto", "device: auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps")
    precision: str = opt(
        "auto", "compute precision: auto (bf16 where supported, else fp16, else fp32; training on the CPU: bf16 "
        "where this CPU multiplies bf16 at least 1.5x as fast as fp32, measured once, else fp32)", choices=["auto", "fp32", "bf16", "fp16"]
    )
    seed: int = opt(0, "random seed (data order, LoRA init and dropout, sampling)", bounds=SEED)
    trust_remote_code: bool = opt(False, "allow a hub model to run its own Python code (off unless you trust it)")


@dataclass
class DataConfig(Config):
    data: str = opt(DEFAULT_DATA, "data: plain text (.txt, .md or no extension), .jsonl (text, prompt/completion, "
                    "messages, Alpaca or ShareGPT records), a folder with train.jsonl/valid.jsonl, or shakespeare / "
                    "tinyshakespeare")
    seq_len: int = opt(256, "tokens per training example (longer records are truncated)", bounds=Bounds(2),
                       aliases=("max_seq_length",))
    val_fraction: float = opt(0.05, "fraction of the data held out for validation when no valid.jsonl exists",
                              bounds=FRACTION)


@dataclass
class TrainConfig(DataConfig, ModelConfig):
    always: typing.ClassVar[tuple[str, ...]] = ("train", "mask_prompt")

    output: str = opt("runs/train", "run folder: adapter, metrics.jsonl and the resolved config land here",
                      aliases=("adapter_path",))
    max_steps: int | None = opt(None, "stop after this many optimizer steps (overrides --epochs)", bounds=AT_LEAST_1,
                                aliases=("iters",))
    epochs: float = opt(1.0, "passes over the training data when --max-steps is not given", bounds=POSITIVE,
                        aliases=("num_train_epochs",))
    batch_size: int | str = opt(4, "micro-batch size, or 'auto' to take the largest that the fit planner says fits",
                                type=batch_size_value, bounds=AT_LEAST_1)
    grad_accum: int = opt(1, "micro-batches per optimizer step (effective batch = batch-size x grad-accum)", bounds=AT_LEAST_1,
                          aliases=("gradient_accumulation_steps", "grad_accumulation_steps"))
    lr: float = opt(2e-4, "peak learning rate (AdamW)", bounds=POSITIVE, aliases=("learning_rate",))
    warmup_steps: int = opt(10, "linear warm-up steps before the cosine decay", bounds=COUNT)
    weight_decay: float = opt(0.0, "AdamW weight decay", bounds=COUNT)
    max_grad_norm: float = opt(1.0, "clip the gradient norm to this (0 disables)", bounds=COUNT)
    lora_rank: int = opt(8, "LoRA rank r", bounds=AT_LEAST_1)
    lora_alpha: float = opt(16.0, "LoRA alpha (scale = alpha / r)", bounds=POSITIVE)
    lora_dropout: float = opt(0.05, "dropout on the LoRA input", bounds=FRACTION)
    lora_targets: list[str] = opt(["q_proj", "v_proj"], "modules to adapt, comma-separated, or all-linear", type=targets_value)
    fine_tune_type: str = opt(
        "lora", "lora (low-rank adapters), dora (weight-decomposed LoRA: PEFT's use_dora) or full (the weights "
        "themselves train; the result is a whole model in <output>/model)", choices=["lora", "dora", "full"])
    quantize_base: str = opt(
        "none", "QLoRA: hold the frozen base's linear layers in nf4 (torchao's NormalFloat4), int4 (group-wise) or "
        "int8, for lora and dora; needs pip install 'tunesmith[qlora]'. fp8 (float8 e4m3, per row): on a CUDA GPU "
        "with fp8 tensor cores (compute capability 8.9+) in bf16 the products run in fp8, faster, at bf16's weight "
        "memory; needs no extra", choices=["none", "nf4", "int4", "int8", "fp8"])
    base_calibration: int = opt(
        0, "with --quantize-base nf4, int4 or int8: choose the base's codes with GPTQ on this many blocks of the "
        "training data instead of rounding each weight to nearest (same format, scales and memory while training; "
        "the base moves much less from the full-precision model). Loads the model at full precision once to "
        "calibrate, and takes minutes; the codes are saved with the adapter. 0: round to nearest", bounds=COUNT)
    num_layers: int = opt(0, "adapt (with full: train) only the last N decoder layers (0 or -1: all of them)",
                          bounds=Bounds(-1))
    optimizer: str = opt("adamw", "adamw, or adamw8bit (torchao's AdamW with 8-bit moments: a quarter of its "
                         "memory; needs tunesmith[qlora])", choices=["adamw", "adamw8bit"])
    eval_every: int = opt(50, "evaluate on the validation split every N steps (0: only at the end)", bounds=COUNT,
                          aliases=("steps_per_eval",))
    eval_batches: int = opt(25, "validation batches per evaluation, the split's first (0 or all: the whole split, "
                            "which on a large split can take longer than training)", type=batches_value,
                            bounds=COUNT, aliases=("val_batches",))
    gradient_checkpointing: bool | str = opt(
        False, "keep only each decoder layer's input for the backward pass, which recomputes the layer, to save "
        "memory: on (the flag alone), off, or offload: on a CUDA GPU the inputs also wait in pinned host memory, "
        "copied while the layers compute (the least memory; one process)", type=checkpointing_value, nargs="?",
        const=True, metavar="on|off|offload", aliases=("grad_checkpoint",))
    fast_paths: str = opt("auto", "auto: the fast paths that apply to this model and device (a fused loss, fused "
                          "LoRA and q/k/v, Liger's and tunesmith's Triton kernels on CUDA, compiled layers, packed "
                          "records, cheap activations recomputed; docs/PERFORMANCE.md); off: the plain "
                          "transformers + PEFT path", choices=["auto", "off"])
    compile: str = opt("auto", "torch.compile each decoder layer (regional: the first compiles, the rest reuse it): "
                       "auto (on CUDA with --fast-paths auto), on, off", choices=["auto", "on", "off"])
    recompute: bool = opt(True, "with --fast-paths auto: keep less for the backward pass and recompute cheap "
                          "elementwise results (norms, the gated MLP's product) instead, for less memory at a "
                          "small cost in speed")
    time_budget: float = opt(
        0.0, "fit training into about this many seconds: after 3 steps the step count is cut to fit (0: no limit)",
        bounds=COUNT,
    )
    checkpoint_every: int = opt(50, "save a resumable checkpoint every N optimizer steps, and at the end (0: only at the end)",
                                bounds=COUNT, aliases=("save_every",))
    resume: bool | str = opt(
        False, "continue from the newest complete checkpoint in --output, or from the checkpoint folder PATH",
        type=resume_value, nargs="?", const=True, metavar="PATH",
    )
    overwrite: bool = opt(
        False, "replace the run already in --output (its adapter, checkpoints, metrics); without it train refuses"
    )
    gpus: int = opt(0, "launch this many processes, one per CUDA GPU, data-parallel through torch's launcher (0 or 1: "
                    "this process only); with --device cpu, that many CPU processes on gloo", bounds=COUNT)
    strategy: str = opt("ddp", "with several processes: ddp (each GPU holds the whole model) or fsdp (FSDP2 shards "
                        "the frozen base, the adapter and the optimizer over the GPUs; CUDA only)",
                        choices=["ddp", "fsdp"])
    allow_pickle: bool = opt(
        False, "let --model load pickle weights (.bin/.pt, read with weights_only=True) when it has no safetensors; "
        "pickle files can run code"
    )

    def check(self) -> None:
        if self.fine_tune_type == "full" and self.quantize_base != "none":
            raise TunesmithError("--quantize-base is for lora and dora (a frozen base under adapters); full "
                                 "fine-tuning trains the weights themselves: drop --quantize-base, or use "
                                 "--fine-tune-type lora")
        if self.base_calibration and self.quantize_base in ("none", "fp8"):
            raise TunesmithError(f"--base-calibration chooses the codes of a base held in nf4, int4 or int8, but "
                                 f"--quantize-base is {self.quantize_base}: add --quantize-base nf4 (or int4, int8), "
                                 "or drop --base-calibration")


@dataclass
class GenerateConfig(ModelConfig):
    model: str = adapter_base_model()
    adapter: str | None = opt(None, adapter_help("to apply"), type=adapter_value, aliases=("adapter_path",))
    prompt: str = opt("ROMEO:", "the prompt; - reads it from stdin")
    max_tokens: int = opt(100, "tokens to generate", bounds=AT_LEAST_1)
    temperature: float = opt(0.0, "sampling temperature; 0 is greedy", bounds=COUNT)
    top_p: float = opt(1.0, "nucleus sampling: keep the smallest set of tokens whose probability reaches this",
                       bounds=Bounds(0, 1, lo_open=True))
    chat: bool = opt(False, "wrap the prompt in the model's chat template")
    system: str | None = opt(None, "with --chat: a system message before the prompt")

    def check(self) -> None:
        if self.system is not None and not self.chat:
            raise TunesmithError("--system is a message of the chat template; add --chat")


@dataclass
class ServeConfig(Config):
    """`tunesmith serve`: an OpenAI-compatible HTTP server for a model and any number of adapters over it."""

    model: str = adapter_base_model()
    adapter: list[str] = opt(
        [], "an adapter to serve beside the base, as NAME=PATH (a bare PATH is named after its folder); give it once "
        "per adapter. A request's model field picks the base or an adapter by name", type=named_adapters_value,
        metavar="NAME=PATH", action="extend")
    served_model_name: str = opt("", "the name requests use for the base model (default: the alias, the folder's "
                                 "name or the hub id)")
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0 exposes the server to the network: add --api-key)")
    port: int = opt(8000, "port to listen on (0: any free one; the address is printed)", bounds=Bounds(0, 65535))
    api_key: str = opt("", "require this bearer token (Authorization: Bearer KEY) on every request (empty: none)")
    max_tokens: int = opt(512, "tokens an answer may have when the request gives no max_tokens (never past the "
                          "context)", bounds=AT_LEAST_1)
    parallel: int = opt(8, "requests answered at once, batched into each forward step; later ones wait in a "
                        "first-come, first-served queue of 4 per slot, and past that are refused (429, Retry-After)",
                        bounds=AT_LEAST_1)
    deterministic: bool = opt(False, "answers that do not depend on the other requests in the batch, bit for bit "
                              "(each prompt read alone; every decode step at the full --parallel batch over the "
                              "whole cache; attention on PyTorch's math kernel): slower, for reproducible bf16 "
                              "answers on a GPU")
    device: str = same_as(ModelConfig, "device")
    precision: str = same_as(ModelConfig, "precision")
    trust_remote_code: bool = same_as(ModelConfig, "trust_remote_code")

    def check(self) -> None:
        try:  # a config built in Python gets its adapters read as a flag's are (idempotent on NAME=PATH)
            self.adapter = named_adapters_value(self.adapter)
        except ValueError as e:
            raise TunesmithError(f"--adapter {e}") from None
        names = [a.partition("=")[0] for a in self.adapter]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise TunesmithError(f"--adapter: the name {', '.join(twice)} is given to more than one adapter; name "
                                 "each one: --adapter NAME=PATH")
        if self.served_model_name and self.served_model_name in names:
            raise TunesmithError(f"--served-model-name {self.served_model_name} is also an adapter's name; pick "
                                 "another")


@dataclass
class ChatConfig(ModelConfig):
    """`tunesmith chat`: talk to a model (+ adapter) in the terminal, through its chat template."""

    model: str = adapter_base_model()
    adapter: str | None = same_as(GenerateConfig, "adapter")
    system: str | None = opt(None, "a system message at the start of the conversation (and after /reset)")
    max_tokens: int = same_as(GenerateConfig, "max_tokens", default=512, help="tokens per answer at most")
    temperature: float = same_as(GenerateConfig, "temperature")
    top_p: float = same_as(GenerateConfig, "top_p")


@dataclass
class EvalConfig(DataConfig, ModelConfig):
    model: str = adapter_base_model()
    adapter: str | None = opt(None, adapter_help("to apply"), type=adapter_value, aliases=("adapter_path",))
    batch_size: int = opt(4, "examples per forward pass", bounds=AT_LEAST_1)
    max_batches: int = opt(0, "evaluate at most this many batches (0: the whole split)", bounds=COUNT)
    split: str = opt("valid", "what to score: valid (the held-out part: valid.jsonl, or the last --val-fraction of a "
                     "file), train, or all (the whole data)", choices=["valid", "train", "all"])


@dataclass
class MergeConfig(ModelConfig):
    model: str = adapter_base_model()
    adapter: str = opt("", adapter_help("to merge into the model"), type=adapter_value, aliases=("adapter_path",))
    output: str = opt("", "folder for the merged model (safetensors + config + tokenizer)")
    dtype: str = opt("float32", "dtype of the saved weights", choices=["float32", "bfloat16", "float16"])


@dataclass
class DemoConfig(TrainConfig):
    """The WWDC24 workflow on the built-in model and data; the defaults are sized for a 2-core CPU."""

    name: str = opt("demo", "run name: everything lands in <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "folder that holds the runs")
    output: str = opt("", "run folder (default: <runs-dir>/<name>)")
    lr: float = same_as(
        TrainConfig, "lr", default=3e-3,
        help="peak learning rate (AdamW); high because the demo trains for minutes (docs/PERFORMANCE.md, the demo)",
    )
    warmup_steps: int = same_as(TrainConfig, "warmup_steps", default=5)
    max_steps: int | None = same_as(TrainConfig, "max_steps", default=120,
                                    help="optimizer steps (the time budget may stop it earlier)")
    batch_size: int | str = same_as(TrainConfig, "batch_size", help="micro-batch size")
    time_budget: float = same_as(TrainConfig, "time_budget", default=300.0,
                                 help="seconds of training to aim for; the step count is cut to fit the device")
    min_steps: int = opt(40, "the time budget never cuts the run below this many steps, however slow the machine "
                         "(held-out perplexity falls by a quarter by step 20: docs/PERFORMANCE.md)", bounds=COUNT)
    overwrite: bool = opt(True, "replace the earlier demo run in <runs-dir>/<name> (--no-overwrite refuses instead)")
    eval_batches: int = same_as(TrainConfig, "eval_batches", default=8,
                                help="validation batches for the before/after perplexity")
    eval_every: int = same_as(TrainConfig, "eval_every", default=0,
                              help="evaluate every N steps during training (0: only at the end)")
    sample_tokens: int = opt(60, "tokens per before/after sample", bounds=AT_LEAST_1)
    sample_temperature: float = opt(0.7, "temperature of the before/after samples", bounds=COUNT)
    ship: bool = opt(
        False, "finish by exporting a 4-bit .pte and printing the quality ladder (needs tunesmith[ship]; minutes on a CPU)"
    )


@dataclass
class ReportConfig(Config):
    run_dir: str = opt("", "run folder written by train or demo (holds metrics.jsonl)", positional=True)
    output: str = opt("", "HTML file to write; empty means <run-dir>/report.html")


_MEMORY_UNITS = {"": 1.0, "g": 1.0, "gib": 1.0, "gb": 1e9 / 2**30, "m": 2**-10, "mib": 2**-10, "mb": 1e6 / 2**30,
                 "t": 1024.0, "tib": 1024.0, "tb": 1e12 / 2**30}


def memory_value(value: str | float) -> float:
    """A memory size in GiB: 16, 16g or 16GiB (2^30 bytes each), 16GB (10^9 bytes each); MiB/MB, TiB/TB too."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    hit = re.fullmatch(r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-z]*)\s*", value.lower()) if isinstance(value, str) else None
    if hit is None or hit.group(2) not in _MEMORY_UNITS:
        raise ValueError(f"must be a memory size such as 16GiB, 16GB (10^9 bytes) or 16 (GiB), got {value!r}")
    return float(hit.group(1)) * _MEMORY_UNITS[hit.group(2)]


@dataclass
class FitConfig(ModelConfig):
    """`tunesmith fit`: the training flags that move memory, read as `train` reads them."""

    seq_len: int = same_as(DataConfig, "seq_len")
    batch_size: int | str = same_as(TrainConfig, "batch_size")
    lora_rank: int = same_as(TrainConfig, "lora_rank")
    lora_targets: list[str] = same_as(TrainConfig, "lora_targets")
    lora_dropout: float = same_as(TrainConfig, "lora_dropout")
    gradient_checkpointing: bool | str = same_as(TrainConfig, "gradient_checkpointing")
    fine_tune_type: str = same_as(TrainConfig, "fine_tune_type")
    quantize_base: str = same_as(TrainConfig, "quantize_base")
    base_calibration: int = same_as(TrainConfig, "base_calibration")
    num_layers: int = same_as(TrainConfig, "num_layers")
    optimizer: str = same_as(TrainConfig, "optimizer")
    fast_paths: str = same_as(TrainConfig, "fast_paths", help="plan for the fast paths (auto: the fused loss, "
                              "where the model allows it) or the plain path (off)")
    gpus: int = same_as(TrainConfig, "gpus")
    strategy: str = same_as(TrainConfig, "strategy")
    memory_gib: float = opt(0.0, "plan for a machine with this much memory instead of this one: 16GiB, 16GB (10^9 "
                            "bytes) or 16 (GiB); 0: this device", type=memory_value, bounds=COUNT, aliases=("memory",))


@dataclass
class ParityConfig(ModelConfig):
    """`tunesmith parity`: the same prompts on --device and on the CPU (fp32), compared."""

    model: str = adapter_base_model()
    adapter: str | None = opt(None, adapter_help("to apply on both sides"), type=adapter_value,
                              aliases=("adapter_path",))
    prompts: str | None = opt(None, "text file with one prompt per line, \\n for a newline (default: a few built-in prompts)")
    max_tokens: int = opt(32, "greedy tokens generated per prompt on each side (0: compare the logits only)", bounds=COUNT)
    tolerance: float = opt(0.0, "largest mean relative logit difference allowed (0: the default for the precision)",
                           bounds=COUNT)
    framework: str = opt("torch", "torch: --device against the CPU; jax or tensorflow: Keras 3 on that backend "
                         "against PyTorch (CPU), in fp32 and bf16 unless --precision picks one",
                         choices=["torch", "jax", "tensorflow"])


@dataclass
class QuantizeConfig(DataConfig):
    """`tunesmith quantize`: weight-only int8 / int4 through torchao, for eager inference; a folder generate/eval load."""

    model: str = adapter_base_model()
    adapter: str | None = opt(None, adapter_help("to merge before quantizing"), type=adapter_value,
                              aliases=("adapter_path",))
    scheme: str = opt("int8", "int8 (per output channel) or int4 (group-wise) weights", choices=["int8", "int4"])
    group_size: int = opt(32, "int4: weights per quantization group", choices=[32, 64, 128])
    output: str = opt("", "folder for the quantized model (config, tokenizer, weights, tunesmith-quant.json)")
    calibration_blocks: int = opt(64, "int4: training blocks GPTQ calibrates on (0: round to nearest, no data)",
                                  bounds=COUNT)
    grid: str = opt("affine", "int4: affine (a scale and a float offset per group) or symmetric (a scale per group)",
                    choices=["affine", "symmetric"])
    keep_8bit: str = opt("v_proj", "int4: comma-separated linear names kept int8 per channel ('' for none)")
    eval_blocks: int = opt(16, "held-out blocks to compare float and quantized perplexity on (0: skip the check)",
                           bounds=COUNT)
    max_tokens: int = opt(32, "greedy tokens generated to time float vs quantized decoding (0: skip)", bounds=COUNT)


@dataclass
class ExportConfig(Config):
    """`tunesmith export`: a model (or model + adapter) -> an on-device artifact."""

    model: str = opt("", "model to export: a merged HF folder, a built-in alias, a .gguf file or a hub id "
                     f"(default: the one --adapter was trained on, else {DEFAULT_MODEL})")
    adapter: str | None = opt(None, adapter_help("to merge on the fly before exporting"), type=adapter_value,
                              aliases=("adapter_path",))
    format: str = opt("pte", "pte (ExecuTorch), gguf (llama.cpp), mlx (MLX folder), coreml (.mlpackage), ollama "
                      "(a folder: the GGUF and a Modelfile) or keras (Keras 3 preset folder)",
                      choices=["pte", "gguf", "mlx", "coreml", "ollama", "keras"])
    adapter_only: bool = opt(False, "write the --adapter alone, not merged: --format mlx gives mlx-lm's "
                             "adapters.safetensors + adapter_config.json, --format gguf a llama.cpp LoRA adapter .gguf")
    backend: str = opt("jax", "keras: the Keras backend that converts and checks the preset (jax or tensorflow)",
                       choices=["jax", "tensorflow"])
    output: str = opt("", "file or folder to write, e.g. ship/model.pte")
    quant: str = opt("fp32", "weights: pte fp32|8w|8da4w; gguf and ollama f32|f16|q8_0|q4_1|q4_0|"
                             "q4_0_mixed|q4_k_m|q4_k_s|q5_k_m|q6_k; "
                             "mlx fp32|bf16|fp16|8bit|4bit; coreml fp32|fp16|int8|int4; keras fp32|bf16")
    group_size: int = opt(32, "weights per quantization group for the 4-bit schemes", bounds=AT_LEAST_1)
    max_seq_len: int = opt(256, "longest sequence (prompt + generated tokens) the artifact can hold", bounds=Bounds(2))
    calibration_blocks: int = opt(
        64, "gguf/ollama q8_0|q4_0|q4_0_mixed and the k-quants' Q8_0/Q5_0 matrices: training blocks GPTQ "
        "calibrates the decoder weights on, from --data, else from the data the model was tuned on (its train run's "
        "config.yaml, beside the adapter or the merged folder); with neither, or 0, every block is rounded to "
        "nearest, as llama-quantize does. Other formats and quants ignore it", bounds=COUNT,
    )
    data: str = same_as(DataConfig, "data", default="", help="data GPTQ calibrates on (--calibration-blocks; "
                        "default: the data the model was tuned on, when its run folder records it)")
    system: str | None = opt(None, "ollama: the Modelfile's SYSTEM prompt ('' for none; default: the system prompt "
                             "every record of the run's chat data opens with, else the chat template's own)")
    seq_len: int = same_as(DataConfig, "seq_len", aliases=())  # beside --max-seq-len, mlx-lm's name would mislead
    val_fraction: float = same_as(DataConfig, "val_fraction")


@dataclass
class RunConfig(Config):
    """`tunesmith run model.pte` (or model.gguf): generate from an exported file, with the tokenizer it carries."""

    pte: str = opt("", "the exported file: a .pte (`export --format pte`: the ExecuTorch runtime, with the tokenizer "
                   "saved beside it) or a .gguf (`export --format gguf`: its own weights, dequantized exactly, and "
                   "tokenizer, through PyTorch on the CPU)", positional=True, metavar="FILE")
    prompt: str = same_as(GenerateConfig, "prompt")
    max_tokens: int = same_as(GenerateConfig, "max_tokens")
    temperature: float = same_as(GenerateConfig, "temperature")
    top_p: float = same_as(GenerateConfig, "top_p")
    chat: bool = same_as(GenerateConfig, "chat")
    system: str | None = same_as(GenerateConfig, "system")
    seed: int = same_as(ModelConfig, "seed")

    check = GenerateConfig.check


@dataclass
class CompareConfig(DataConfig):
    """`tunesmith compare RUN_DIR`: the quality ladder, every rung on the same held-out text and prompts."""

    run_dir: str = opt("", "run folder (the demo's): adapter/, merged/ and the exports/ (.pte, .gguf, Keras) are read; "
                       "ladder.json is written",
                       positional=True)
    model: str = opt("", "base model (default: the one the run's adapter was trained on, else the one its config names)")
    pte: list[str] = opt([], "extra .pte files, comma-separated (every .pte under <run-dir>/exports is included)",
                         type=list_value)
    group_size: int = same_as(QuantizeConfig, "group_size")
    calibration_blocks: int = same_as(QuantizeConfig, "calibration_blocks")
    eval_blocks: int = opt(16, "held-out blocks of --seq-len tokens that every rung is scored on", bounds=AT_LEAST_1)
    prompts: str | None = opt(None, "text file with one prompt per line, \\n for a newline (default: the demo's prompts)")
    max_tokens: int = opt(40, "greedy tokens generated per prompt", bounds=AT_LEAST_1)

# ---------------------------------------------------------------------------------------------------------------


def fields_of(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def check_bounds(f: dataclasses.Field, value: Any) -> None:
    """Raise ValueError('must be > 0, got -1') when a number is outside the field's bounds ('auto', None pass)."""
    bounds = f.metadata.get("bounds")
    if bounds is not None and isinstance(value, int | float) and not isinstance(value, bool) and value not in bounds:
        raise ValueError(f"must be {bounds}, got {_show(value)}")


def check_values(cls: type, **values: Any) -> None:
    """Check values of `cls`'s fields against their bounds, as a flag is checked (for code that takes them one by
    one, such as generate.decode)."""
    fields = {f.name: f for f in fields_of(cls)}
    for name, value in values.items():
        try:
            check_bounds(fields[name], value)
        except ValueError as e:
            raise TunesmithError(f"{flag(name)} {e}") from None


def _number(base: type, value: Any) -> int | float:
    """A flag's text or a YAML value as an int or a float. YAML 1.1 reads `1e-3` (no dot) as a string, and that is
    how mlx-lm's and axolotl's configs write learning rates, so numeric strings are numbers here."""
    what = "an integer" if base is int else "a number"
    x = value
    if isinstance(x, str):
        try:
            x = int(x.strip())
        except ValueError:
            try:
                x = float(x)
            except ValueError:
                raise ValueError(f"must be {what}, got {value!r}") from None
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise ValueError(f"must be {what}, got {value!r}")
    if base is int:
        if isinstance(x, float) and not x.is_integer():
            raise ValueError(f"must be {what}, got {value!r}")
        return int(x)
    return float(x)


def _convert(f: dataclasses.Field, hint: Any, value: Any) -> Any:
    if "type" in f.metadata:
        return f.metadata["type"](value)
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    if value is None and type(None) in args:
        return None
    base = next((a for a in args if a is not type(None)), hint)
    if base is bool:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        return value
    if base in (int, float):
        value = _number(base, value)
    elif base is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise ValueError(f"must be a string, got {value!r}")
        value = str(value)
    if "choices" in f.metadata and value not in f.metadata["choices"]:
        raise ValueError(f"must be one of {', '.join(map(str, f.metadata['choices']))}, got {_show(value)}")
    return value


def parse_value(f: dataclasses.Field, hint: Any, value: Any, name: str) -> Any:
    """A flag's text or a YAML value, converted to the field's type and checked against its choices and bounds.
    Anything wrong is one TunesmithError that starts with `name` (the flag, or the file and key)."""
    try:
        value = _convert(f, hint, value)
        check_bounds(f, value)
    except ValueError as e:
        raise TunesmithError(f"{name} {e}") from None
    return value


def names_of(f: dataclasses.Field) -> list[str]:
    """A field's name and its aliases, as YAML keys (underscores)."""
    return [f.name, *f.metadata.get("aliases", ())]


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise TunesmithError(f"config file not found: {p}")
    try:
        loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise TunesmithError(f"{p}: not valid YAML: {e}") from None
    except UnicodeDecodeError:
        raise TunesmithError(f"{p}: not UTF-8 text; save it as UTF-8") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise TunesmithError(f"{p}: a config file must be a mapping of option: value")
    return {str(k).replace("-", "_"): v for k, v in loaded.items()}


# mlx-lm's `lora_parameters:` block (YAML only), key by key. Its scale multiplies the adapter's product as PEFT's
# alpha / rank does, so it becomes lora_alpha = scale x the run's rank, once the rank is known.
LORA_PARAMETERS = {"rank": "lora_rank", "dropout": "lora_dropout", "keys": "lora_targets", "scale": "lora_alpha"}


def _lora_parameters(block: Any, where: str) -> list[tuple[str, Any]]:
    """mlx-lm's lora_parameters as (key, value) pairs named lora_parameters.<key>, checked for keys it lacks."""
    if not isinstance(block, dict):
        raise TunesmithError(f"{where}: 'lora_parameters' must be a mapping of rank, scale, dropout and keys")
    for key in block:
        if key == "alpha":
            raise TunesmithError(f"{where}: lora_parameters.alpha is ambiguous: mlx-lm now ignores it (scale alone "
                                 "is the multiplier, PEFT's alpha / rank) and older mlx-lm multiplied scale by alpha "
                                 "/ rank; give scale alone, or lora_alpha (PEFT's alpha) instead")
        if key not in LORA_PARAMETERS:
            raise TunesmithError(f"{where}: unknown key '{key}' in lora_parameters; it takes rank, scale, dropout "
                                 "and keys")
    return [(f"lora_parameters.{k}", v) for k, v in block.items()]


def _unknown_options(keys: list[str], names: list[str]) -> str:
    """'unknown option 'lora_rnak' (did you mean lora_rank?)': each key with its nearest known name, if any."""
    parts, lost = [], False
    for key in keys:
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        parts.append(f"'{key}'" + (f" (did you mean {close[0]}?)" if close else ""))
        lost = lost or not close
    more = "; the command's --help lists its options (a key is a flag's name: lora_rank for --lora-rank)" if lost else ""
    return f"unknown option{'s' if len(keys) > 1 else ''} {', '.join(parts)}{more}"


def _yaml_values(cls: type, known: dict[str, dataclasses.Field], yaml_path: str | Path) -> tuple[dict[str, Any], Any]:
    """The YAML file's values, by field name, checked; and mlx-lm's lora_parameters scale, if given (not yet an
    alpha: that needs the final rank)."""
    pairs = list(read_yaml(yaml_path).items())
    if "lora_rank" in known:
        pairs = [kv for key, v in pairs for kv in (_lora_parameters(v, str(yaml_path)) if key == "lora_parameters"
                                                     else [(key, v)])]
        # fit plans memory, which the scale does not move: a training config's block is read there without it
        pairs = [(key, v) for key, v in pairs if key != "lora_parameters.scale" or "lora_alpha" in known]
    canonical = {name: f.name for f in known.values() for name in names_of(f)}
    canonical.update({f"lora_parameters.{k}": n for k, n in LORA_PARAMETERS.items() if n in known})
    for key, v in pairs:
        if key in cls.always and v is not True:
            raise TunesmithError(f"{yaml_path}: '{key}' must be true (or left out): {ALWAYS[key]}")
    pairs = [(key, v) for key, v in pairs if key not in cls.always]
    unknown = [key for key, _ in pairs if key not in canonical]
    gone = [removed(k) for k in unknown if removed(k)]
    if gone:
        raise TunesmithError(f"{yaml_path}: {gone[0]}")
    if unknown:
        raise TunesmithError(f"{yaml_path}: {_unknown_options(unknown, [*canonical, *cls.always])}")
    hints, given, values, scale = typing.get_type_hints(cls), {}, {}, None
    for key, v in pairs:
        name = canonical[key]
        if name in given:  # `iters:` and `max_steps:` both
            raise TunesmithError(f"{yaml_path}: '{given[name]}' and '{key}' are the same option; keep one")
        given[name] = key
        value = parse_value(known[name], hints[name], v, f"{yaml_path}: '{key}'")
        if key == "lora_parameters.scale":
            scale = value
        else:
            values[name] = value
    return values, scale


def build_config(cls: type, yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Any:
    """Resolve a stage config: defaults, then the YAML file, then explicit overrides (already typed)."""
    known = {f.name: f for f in fields_of(cls)}
    values, scale = _yaml_values(cls, known, yaml_path) if yaml_path else ({}, None)
    for k, v in (overrides or {}).items():
        if k not in known:
            raise TypeError(f"{cls.__name__} has no option {k!r}")
        values[k] = v
    if scale is not None and "lora_alpha" not in (overrides or {}):  # --lora-alpha on the command line wins
        values["lora_alpha"] = scale * values.get("lora_rank", known["lora_rank"].default)
    return cls(**values)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
