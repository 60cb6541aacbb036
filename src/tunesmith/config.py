"""One dataclass per stage. Every default is defined here, once; the CLI and YAML files are built from these.

Precedence: dataclass default < YAML file (``--config run.yaml``) < command-line flag.
"""

from __future__ import annotations

import dataclasses
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


def opt(default: Any, help: str, **meta: Any) -> Any:
    """A config field: its default and its --help text (and optional argparse extras: choices, metavar)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def same_as(cls: type, name: str) -> Any:
    """Another stage's field, default and help included: a planner flag means what the trainer flag means."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory, metadata=f.metadata)
    return field(default=f.default, metadata=f.metadata)


def batch_size_value(value: str | int) -> int | str:
    """A micro-batch size: a positive integer, or 'auto' (the fit planner picks the largest that fits)."""
    if value == "auto":
        return "auto"
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise TunesmithError(f"batch size must be a positive integer or 'auto', got {value!r}") from None
    if n < 1:
        raise TunesmithError(f"batch size must be >= 1, got {n}")
    return n


def resume_value(value: bool | str) -> bool | str:
    """--resume: true (the newest complete checkpoint in --output), false, or a checkpoint or run folder."""
    if isinstance(value, bool) or (isinstance(value, str) and value):
        return value
    raise TunesmithError(f"resume must be true, false or a checkpoint folder, got {value!r}")


def targets_value(value: str | list[str]) -> list[str]:
    """LoRA target modules: a comma-separated string or a list; 'all-linear' targets every linear layer."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not value or not all(isinstance(v, str) for v in value):
        raise TunesmithError("--lora-targets needs module names, e.g. q_proj,v_proj or all-linear")
    return list(value)


def list_value(value: str | list[str]) -> list[str]:
    """A comma-separated string or a list of strings."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TunesmithError(f"expected a comma-separated list, got {value!r}")
    return list(value)


@dataclass
class ModelConfig:
    """What every stage that loads a model shares."""

    model: str = opt(DEFAULT_MODEL, "model: a built-in alias, a local HF folder, a .gguf file, or a hub id")
    device: str = opt("auto", "device: auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps")
    precision: str = opt(
        "auto", "compute precision: auto (bf16 where supported, else fp16, else fp32)", choices=["auto", "fp32", "bf16", "fp16"]
    )
    seed: int = opt(0, "random seed (data order, LoRA init and dropout, sampling)")
    trust_remote_code: bool = opt(False, "allow a hub model to run its own Python code (off unless you trust it)")


@dataclass
class DataConfig:
    data: str = opt(DEFAULT_DATA, "data: .txt, .jsonl, a folder with train.jsonl/valid.jsonl, or shakespeare / tinyshakespeare")
    seq_len: int = opt(256, "tokens per training example (longer records are truncated)")
    val_fraction: float = opt(0.05, "fraction of the data held out for validation when no valid.jsonl exists")


@dataclass
class TrainConfig(DataConfig, ModelConfig):
    output: str = opt("runs/train", "run folder: adapter, metrics.jsonl and the resolved config land here")
    max_steps: int | None = opt(None, "stop after this many optimizer steps (overrides --epochs)")
    epochs: float = opt(1.0, "passes over the training data when --max-steps is not given")
    batch_size: int | str = opt(4, "micro-batch size, or 'auto' to take the largest that the fit planner says fits", type=batch_size_value)
    grad_accum: int = opt(1, "micro-batches per optimizer step (effective batch = batch-size x grad-accum)")
    lr: float = opt(2e-4, "peak learning rate (AdamW)")
    warmup_steps: int = opt(10, "linear warm-up steps before the cosine decay")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    max_grad_norm: float = opt(1.0, "clip the gradient norm to this (0 disables)")
    lora_rank: int = opt(8, "LoRA rank r")
    lora_alpha: float = opt(16.0, "LoRA alpha (scale = alpha / r)")
    lora_dropout: float = opt(0.05, "dropout on the LoRA input")
    lora_targets: list[str] = opt(["q_proj", "v_proj"], "modules to adapt, comma-separated, or all-linear", type=targets_value)
    eval_every: int = opt(50, "evaluate on the validation split every N steps (0: only at the end)")
    eval_batches: int = opt(0, "validation batches per evaluation (0: the whole split)")
    log_every: int = opt(1, "write a metrics.jsonl line every N steps")
    gradient_checkpointing: bool = opt(False, "recompute activations in the backward pass to save memory")
    time_budget: float = opt(
        0.0, "fit training into about this many seconds: after 3 steps the step count is cut to fit (0: no limit)"
    )
    checkpoint_every: int = opt(50, "save a resumable checkpoint every N optimizer steps, and at the end (0: only at the end)")
    keep: int = opt(2, "checkpoints to keep, newest first (0: all); old ones go only after a new one is saved")
    resume: bool | str = opt(
        False, "continue from the newest complete checkpoint in --output, or from the checkpoint folder PATH",
        type=resume_value, nargs="?", const=True, metavar="PATH",
    )
    on_config_mismatch: str = opt(
        "warn", "when --resume finds settings that differ from the checkpoint's: warn and go on, or refuse",
        choices=["warn", "refuse"],
    )
    max_bad_steps: int = opt(5, "stop after this many steps in a row with a NaN/inf loss or gradient (each is skipped)")
    allow_pickle: bool = opt(
        False, "let --model load pickle weights (.bin/.pt, read with weights_only=True) when it has no safetensors; "
        "pickle files can run code"
    )


@dataclass
class GenerateConfig(ModelConfig):
    adapter: str | None = opt(None, "LoRA adapter folder (PEFT format) to apply")
    prompt: str = opt("ROMEO:", "the prompt")
    max_tokens: int = opt(100, "tokens to generate")
    temperature: float = opt(0.0, "sampling temperature; 0 is greedy")
    top_p: float = opt(1.0, "nucleus sampling: keep the smallest set of tokens whose probability reaches this")
    chat: bool = opt(False, "wrap the prompt in the model's chat template")


@dataclass
class EvalConfig(DataConfig, ModelConfig):
    adapter: str | None = opt(None, "LoRA adapter folder (PEFT format) to apply")
    batch_size: int = opt(4, "examples per forward pass")
    max_batches: int = opt(0, "evaluate at most this many batches (0: the whole validation split)")


@dataclass
class MergeConfig(ModelConfig):
    adapter: str = opt("", "LoRA adapter folder (PEFT format) to merge into the model")
    output: str = opt("", "folder for the merged model (safetensors + config + tokenizer)")
    dtype: str = opt("float32", "dtype of the saved weights", choices=["float32", "bfloat16", "float16"])


@dataclass
class DemoConfig(TrainConfig):
    """The WWDC24 workflow on the built-in model and data; the defaults are sized for a 2-core CPU."""

    name: str = opt("demo", "run name: everything lands in <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "folder that holds the runs")
    output: str = opt("", "run folder (default: <runs-dir>/<name>)")
    lr: float = opt(3e-3, "peak learning rate (AdamW); high because the demo trains for minutes (bench/demo_sweep.py)")
    warmup_steps: int = opt(5, "linear warm-up steps before the cosine decay")
    max_steps: int | None = opt(120, "optimizer steps (the time budget may stop it earlier)")
    batch_size: int | str = opt(4, "micro-batch size", type=batch_size_value)
    time_budget: float = opt(300.0, "seconds of training to aim for; the step count is cut to fit the device")
    eval_batches: int = opt(8, "validation batches for the before/after perplexity")
    eval_every: int = opt(0, "evaluate every N steps during training (0: only at the end)")
    sample_tokens: int = opt(60, "tokens per before/after sample")
    sample_temperature: float = opt(0.7, "temperature of the before/after samples")
    ship: bool = opt(
        False, "finish by exporting a 4-bit .pte and printing the quality ladder (needs tunesmith[ship]; minutes on a CPU)"
    )


@dataclass
class ReportConfig:
    run_dir: str = opt("", "run folder written by train or demo (holds metrics.jsonl)", positional=True)
    output: str = opt("", "HTML file to write; empty means <run-dir>/report.html")


@dataclass
class FitConfig(ModelConfig):
    """`tunesmith fit`: the training flags that move memory, read as `train` reads them."""

    seq_len: int = same_as(DataConfig, "seq_len")
    batch_size: int | str = same_as(TrainConfig, "batch_size")
    lora_rank: int = same_as(TrainConfig, "lora_rank")
    lora_targets: list[str] = same_as(TrainConfig, "lora_targets")
    lora_dropout: float = same_as(TrainConfig, "lora_dropout")
    gradient_checkpointing: bool = same_as(TrainConfig, "gradient_checkpointing")
    optimizer: str = opt("adamw", "optimizer whose state to count (train uses AdamW)", choices=["adamw", "sgd"])
    memory_gib: float = opt(0.0, "plan for a machine with this much memory instead of this one (0: this device)")


@dataclass
class ParityConfig(ModelConfig):
    """`tunesmith parity`: the same prompts on --device and on the CPU (fp32), compared."""

    adapter: str | None = opt(None, "LoRA adapter folder (PEFT format) to apply on both sides")
    prompts: str | None = opt(None, "text file with one prompt per line, \\n for a newline (default: a few built-in prompts)")
    max_tokens: int = opt(32, "greedy tokens generated per prompt on each side")
    tolerance: float = opt(0.0, "largest mean relative logit difference allowed (0: the default for the precision)")



@dataclass
class QuantizeConfig(DataConfig):
    """`tunesmith quantize`: weight-only int8 / int4 through torchao, for eager inference; a folder generate/eval load."""

    model: str = same_as(ModelConfig, "model")
    adapter: str | None = opt(None, "LoRA adapter folder (PEFT format) to merge before quantizing")
    scheme: str = opt("int8", "int8 (per output channel) or int4 (group-wise) weights", choices=["int8", "int4"])
    group_size: int = opt(32, "int4: weights per quantization group", choices=[32, 64, 128])
    output: str = opt("", "folder for the quantized model (config, tokenizer, weights, tunesmith-quant.json)")
    calibration_blocks: int = opt(64, "int4: training blocks GPTQ calibrates on (0: round to nearest, no data)")
    grid: str = opt("affine", "int4: affine (a scale and a float offset per group) or symmetric (a scale per group)",
                    choices=["affine", "symmetric"])
    keep_8bit: str = opt("v_proj", "int4: comma-separated linear names kept int8 per channel ('' for none)")
    eval_blocks: int = opt(16, "held-out blocks to compare float and quantized perplexity on (0: skip the check)")
    max_tokens: int = opt(32, "greedy tokens generated to time float vs quantized decoding")


@dataclass
class ExportConfig:
    """`tunesmith export`: a model (or model + adapter) -> an on-device artifact."""

    model: str = opt(DEFAULT_MODEL, "model to export: a merged HF folder, a built-in alias, a .gguf file or a hub id")
    adapter: str | None = opt(None, "LoRA adapter folder to merge on the fly before exporting")
    format: str = opt("pte", "pte (ExecuTorch), gguf (llama.cpp), mlx (MLX folder) or coreml (.mlpackage)",
                      choices=["pte", "gguf", "mlx", "coreml"])
    output: str = opt("", "file or folder to write, e.g. ship/model.pte")
    quant: str = opt("fp32", "weights: pte fp32|8w|8da4w; gguf f32|f16|q8_0|q4_1|q4_0|q4_0_mixed; "
                             "mlx fp32|bf16|fp16|8bit|4bit; coreml fp32|fp16|int8|int4")
    group_size: int = opt(32, "weights per quantization group for the 4-bit schemes")
    max_seq_len: int = opt(256, "longest sequence (prompt + generated tokens) the artifact can hold")
    calibration_blocks: int = opt(
        64, "gguf q8_0|q4_0|q4_0_mixed: training blocks of --data that GPTQ calibrates the decoder weights on "
        "(0: round to nearest, no data); other formats and quants ignore it"
    )
    data: str = same_as(DataConfig, "data")
    seq_len: int = same_as(DataConfig, "seq_len")
    val_fraction: float = same_as(DataConfig, "val_fraction")


@dataclass
class RunConfig:
    """`tunesmith run model.pte`: generate with the ExecuTorch runtime and the tokenizer saved beside the .pte."""

    pte: str = opt("", "the .pte file written by `tunesmith export --format pte`", positional=True)
    prompt: str = same_as(GenerateConfig, "prompt")
    max_tokens: int = same_as(GenerateConfig, "max_tokens")
    temperature: float = same_as(GenerateConfig, "temperature")
    top_p: float = same_as(GenerateConfig, "top_p")
    chat: bool = same_as(GenerateConfig, "chat")
    seed: int = same_as(ModelConfig, "seed")


@dataclass
class CompareConfig(DataConfig):
    """`tunesmith compare RUN_DIR`: the quality ladder, every rung on the same held-out text and prompts."""

    run_dir: str = opt("", "run folder (the demo's): adapter/, merged/ and exports/*.pte are read; ladder.json is written",
                       positional=True)
    model: str = opt("", "base model (default: the one the run was trained from, read from its config)")
    pte: list[str] = opt([], "extra .pte files, comma-separated (every .pte under <run-dir>/exports is included)",
                         type=list_value)
    group_size: int = same_as(QuantizeConfig, "group_size")
    calibration_blocks: int = same_as(QuantizeConfig, "calibration_blocks")
    eval_blocks: int = opt(16, "held-out blocks of --seq-len tokens that every rung is scored on")
    prompts: str | None = opt(None, "text file with one prompt per line, \\n for a newline (default: the demo's prompts)")
    max_tokens: int = opt(40, "greedy tokens generated per prompt")

# ---------------------------------------------------------------------------------------------------------------


def fields_of(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _coerce(f: dataclasses.Field, hint: Any, value: Any, where: str) -> Any:
    """Check a YAML value against the field's annotation and convert what YAML cannot express."""
    if "type" in f.metadata:
        return f.metadata["type"](value)
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    if value is None and type(None) in args:
        return None
    base = next((a for a in args if a is not type(None)), hint)
    if base is bool:
        if not isinstance(value, bool):
            raise TunesmithError(f"{where}: '{f.name}' must be true or false, got {value!r}")
        return value
    if base in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float) or (base is int and isinstance(value, float)):
            raise TunesmithError(f"{where}: '{f.name}' must be a {base.__name__}, got {value!r}")
        return base(value)
    if base is str:
        if not isinstance(value, str | int | float):
            raise TunesmithError(f"{where}: '{f.name}' must be a string, got {value!r}")
        value = str(value)
    if "choices" in f.metadata and value not in f.metadata["choices"]:
        raise TunesmithError(f"{where}: '{f.name}' must be one of {', '.join(f.metadata['choices'])}, got {value!r}")
    return value


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


def build_config(cls: type, yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Any:
    """Resolve a stage config: defaults, then the YAML file, then explicit overrides (already typed)."""
    known = {f.name: f for f in fields_of(cls)}
    values: dict[str, Any] = {}
    if yaml_path:
        loaded = read_yaml(yaml_path)
        unknown = sorted(set(loaded) - set(known))
        if unknown:
            raise TunesmithError(
                f"{yaml_path}: unknown option(s) {', '.join(unknown)} for this command; known: {', '.join(sorted(known))}"
            )
        hints = typing.get_type_hints(cls)
        values.update({k: _coerce(known[k], hints[k], v, str(yaml_path)) for k, v in loaded.items()})
    for k, v in (overrides or {}).items():
        if k not in known:
            raise TypeError(f"{cls.__name__} has no option {k!r}")
        values[k] = v
    return cls(**values)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
