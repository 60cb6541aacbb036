"""LoRA through PEFT: attach, count, save, load. The adapter folder is plain PEFT format.

An adapter folder also says which base model it needs: adapter_config.json's `base_model_name_or_path` holds a
portable id (a built-in alias's hub id, a hub id, or the absolute path of a local model) that plain PEFT users see,
and tunesmith-adapter.json holds the --model given at training (the alias itself for a built-in), which the verbs
that take --adapter load when --model is not given.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tunesmith.errors import TunesmithError
from tunesmith.storage import PICKLE_SUFFIXES, atomic_folder, check_safetensors

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
BASE_FILE = "tunesmith-adapter.json"  # {"model": the --model the adapter was trained on}


def attach_lora(
    model: torch.nn.Module,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.05,
    targets: list[str] | str = ("q_proj", "v_proj"),
    dora: bool = False,
    num_layers: int = 0,
):
    """Wrap `model` with fresh LoRA adapters (B is zero, so the output is unchanged until training).

    `dora`: weight-decomposed LoRA (PEFT's use_dora: a trained magnitude per output row on top of the low-rank
    direction); `num_layers` > 0 adapts only the last that many decoder layers."""
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise TunesmithError(f"--lora-rank must be >= 1, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise TunesmithError(f"--lora-dropout must be in [0, 1), got {dropout}")
    targets = [targets] if isinstance(targets, str) else list(targets)
    target_modules: list[str] | str = "all-linear" if targets == ["all-linear"] else targets
    if target_modules != "all-linear":
        check_targets(model, targets)
    elif last_layers(model, num_layers) is not None:  # PEFT takes a layer subset only with named targets
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        target_modules = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                 if isinstance(m, torch.nn.Linear) and m is not head})
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM",
        use_dora=dora, layers_to_transform=last_layers(model, num_layers),
    )
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise TunesmithError(f"--lora-targets {','.join(targets)}: {e}. Linear layers here: "
                             f"{', '.join(linear_names(model))}") from None


def decoder_layers(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    if not layers:
        raise TunesmithError("--num-layers needs a transformers model whose config gives num_hidden_layers")
    return int(layers)


def last_layers(model: torch.nn.Module, num_layers: int) -> list[int] | None:
    """The indices of the last `num_layers` decoder layers (None: all of them, for 0, -1 or more than there are)."""
    if num_layers <= 0:
        return None
    total = decoder_layers(model)
    return None if num_layers >= total else list(range(total - num_layers, total))


def unfreeze(model: torch.nn.Module, num_layers: int = 0) -> None:
    """Full fine-tuning: every parameter trains, or (num_layers > 0) those of the last num_layers decoder layers."""
    import re

    layers = last_layers(model, num_layers)
    pattern = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
    for name, p in model.named_parameters():
        hit = pattern.search(name)
        p.requires_grad_(layers is None or (hit is not None and int(hit.group(1)) in layers))


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what --lora-targets takes)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Every target must name at least one module, as PEFT matches a list entry: the whole name or its last parts.

    PEFT itself only requires that one of them matches, so a typo would train the rest and be written into
    adapter_config.json."""
    import difflib

    names = [n for n, _ in model.named_modules() if n]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not unmatched:
        return
    linear = linear_names(model)
    hints = []
    for t in unmatched:
        close = difflib.get_close_matches(t.rsplit(".", 1)[-1], linear, n=1)
        hints.append(f"{t} (did you mean {close[0]}?)" if close else t)
    raise TunesmithError(
        f"--lora-targets: {', '.join(hints)} match{'es' if len(unmatched) == 1 else ''} no module of this model; "
        f"its linear layers are {', '.join(linear)} (or pass all-linear)"
    )


def merge_adapter(peft_model, safe_merge: bool = False) -> torch.nn.Module:
    """Fold the adapter into the base weights (PEFT's merge_and_unload). A quantized base (QLoRA) is first
    dequantized: the merged weights are what the adapter was trained against plus its update."""
    from tunesmith.qlora import dequantize_base, quantized_scheme

    if quantized_scheme(peft_model) is not None:
        dequantize_base(peft_model)
    return peft_model.merge_and_unload(safe_merge=safe_merge)


def trainable_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_adapter_folder(path: str | Path) -> Path:
    """The folder must hold a PEFT adapter saved as safetensors; list everything that is missing."""
    p = Path(path)
    if not p.is_dir():
        raise TunesmithError(f"adapter folder not found: {p}")
    missing = [f for f in ADAPTER_FILES if not (p / f).is_file()]
    pickled = sorted(f.name for f in p.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if ADAPTER_FILES[1] in missing and pickled:  # PEFT would fall back to torch.load; tunesmith never does
        raise TunesmithError(
            f"{p} holds its adapter as pickle ({', '.join(pickled)}), which can run code when loaded; tunesmith reads "
            f"adapters only as {ADAPTER_FILES[1]}. Convert it with a tool you trust"
        )
    if missing and (p / "model" / "config.json").is_file():  # a run of --fine-tune-type full
        raise TunesmithError(f"{p} holds a fully fine-tuned model, not an adapter: pass --model {p / 'model'} "
                             "instead of --adapter")
    if missing:
        raise TunesmithError(f"{p} is not a PEFT adapter folder: missing {', '.join(missing)}")
    check_safetensors(p / ADAPTER_FILES[1])  # truncated or damaged: a named error, not a crash inside PEFT
    return p


def load_adapter(model: torch.nn.Module, path: str | Path, trainable: bool = False, base: str | None = None,
                 name: str = "default"):
    """Apply a saved PEFT adapter to `model` (safetensors only); `base` names the model for the error message.

    On a model that already holds adapters (a PeftModel), the adapter is added beside them as `name`, sharing the
    one copy of the base weights; `model.set_adapter(name)` makes it the active one."""
    from peft import PeftModel

    folder = check_adapter_folder(path)
    try:
        if isinstance(model, PeftModel):
            model.load_adapter(folder, adapter_name=name, is_trainable=trainable)
            return model
        return PeftModel.from_pretrained(model, folder, adapter_name=name, is_trainable=trainable)
    except (ValueError, RuntimeError, KeyError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        detail = next((line for line in lines if line.startswith("size mismatch")), lines[0])
        recorded, _ = recorded_base(folder)
        if recorded and not (base and same_model(base, recorded)):
            fix = f"it was trained on {recorded}: pass --model {recorded}, or leave --model out"
        else:
            fix = "pass --model with the model it was trained on"
        raise TunesmithError(f"adapter {folder} does not fit the model {base or '(given)'} ({detail}); {fix}") from None


# ------------------------------------------------------------------------------------------ the base model


def base_record(spec: str) -> tuple[str, str]:
    """(what tunesmith-adapter.json records, the portable id for adapter_config.json) for a --model spec.

    A built-in alias is kept as itself and shown to PEFT as its hub id; a local folder or .gguf file as its absolute
    path (the same model from any working directory); a hub id as it is."""
    from tunesmith.models import BUILTIN_MODELS

    if spec in BUILTIN_MODELS:
        return spec, BUILTIN_MODELS[spec].hub_id
    path = Path(spec).expanduser()
    if path.exists():
        return str(path.resolve()), str(path.resolve())
    return spec, spec


def adapter_config(model, base_spec: str | None) -> dict:
    """The live model's adapter_config.json as a dict, its base model recorded portably (checkpoints write it)."""
    config = model.peft_config["default"].to_dict()
    config = json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    if base_spec:
        config["base_model_name_or_path"] = base_record(base_spec)[1]
    return config


def base_file(base_spec: str, quantize_base: str = "none", calibrated: bool = False) -> bytes:
    """The bytes of tunesmith-adapter.json for an adapter trained on `base_spec` (held quantized: QLoRA; with
    calibrated codes, which the adapter folder holds in base-codes.safetensors)."""
    record = {"model": base_record(base_spec)[0]}
    if quantize_base != "none":
        record["quantize_base"] = quantize_base
    if calibrated:
        record["base_calibrated"] = True
    return (json.dumps(record, indent=2) + "\n").encode()


def save_adapter(model, folder: str | Path, base_spec: str | None, quantize_base: str = "none",
                 state_dict: dict | None = None, base_codes: dict | None = None) -> Path:
    """Save the adapter as PEFT does (safetensors), recording the base model it was trained on. `state_dict`: the
    model's trainable weights by name, whole, where the live model holds only a shard of them (FSDP2).
    `base_codes`: a calibrated quantized base's codes (qlora.base_codes), saved beside the adapter."""
    from safetensors.torch import save_file

    from tunesmith.qlora import BASE_CODES

    folder = Path(folder)
    with atomic_folder(folder) as tmp:  # all or nothing, with the modes the user's umask gives
        model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": state_dict} if state_dict else {}))
        if base_codes:
            save_file(base_codes, str(tmp / BASE_CODES))
        if base_spec:
            config_path = tmp / ADAPTER_FILES[0]
            config = json.loads(config_path.read_text(encoding="utf-8"))
            config["base_model_name_or_path"] = base_record(base_spec)[1]  # PEFT wrote the loaded (cache) path
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            (tmp / BASE_FILE).write_bytes(base_file(base_spec, quantize_base, bool(base_codes)))
    return folder


def recorded_base(adapter: str | Path) -> tuple[str | None, bool]:
    """(the base model an adapter folder names, whether tunesmith recorded it) or (None, False)."""
    folder = Path(adapter)
    record = folder / BASE_FILE
    if record.is_file():
        try:
            model = json.loads(record.read_text(encoding="utf-8")).get("model")
        except (OSError, ValueError, AttributeError):
            raise TunesmithError(f"{record} is unreadable; delete it and pass --model") from None
        if isinstance(model, str) and model:
            return model, True
    try:
        model = json.loads((folder / ADAPTER_FILES[0]).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None, False  # check_adapter_folder says what is wrong when the adapter is loaded
    return (model, False) if isinstance(model, str) and model else (None, False)


def recorded_quantization(adapter: str | Path | None) -> str:
    """The scheme the base was held in when the adapter trained (QLoRA), or 'none'."""
    record = Path(adapter) / BASE_FILE if adapter else None
    if record is None or not record.is_file():
        return "none"
    try:
        scheme = json.loads(record.read_text(encoding="utf-8")).get("quantize_base", "none")
    except (OSError, ValueError, AttributeError):
        raise TunesmithError(f"{record} is unreadable; delete it and pass --model") from None
    return scheme if isinstance(scheme, str) else "none"


def load_quantized_for(spec: str, adapter: str | Path | None, device="cpu", dtype: torch.dtype = torch.float32,
                       trust_remote_code: bool = False):
    """(model, tokenizer): the base an adapter trained on, held as it was: quantized the same way (QLoRA), with
    the calibrated codes the adapter folder saved (--base-calibration)."""
    from tunesmith.models import load_model
    from tunesmith.qlora import BASE_CODES, apply_base_codes

    scheme = recorded_quantization(adapter)
    model, tokenizer = load_model(spec, device, dtype, trust_remote_code, quantize_base=scheme)
    codes = Path(adapter) / BASE_CODES if adapter else None
    if codes is not None and scheme != "none":
        calibrated = json.loads((Path(adapter) / BASE_FILE).read_text(encoding="utf-8")).get("base_calibrated")
        if codes.is_file():
            apply_base_codes(model, codes)
        elif calibrated:
            raise TunesmithError(f"adapter {adapter} was trained on a calibrated {scheme} base, whose codes "
                                 f"({BASE_CODES}) are missing from the folder; copy them from the run's adapter")
    return model, tokenizer


def base_model_for(model: str | None, adapter: str | Path | None) -> str:
    """The model a verb loads: --model when given, else the one `adapter` was trained on, else the default.

    A --model that is not the model tunesmith recorded for the adapter is refused, naming both."""
    from tunesmith.config import DEFAULT_MODEL

    recorded, ours = recorded_base(adapter) if adapter else (None, False)
    if not model:
        if recorded is None:
            return DEFAULT_MODEL
        if not ours and recorded.startswith(("/", ".", "~")) and not Path(recorded).expanduser().exists():
            raise TunesmithError(
                f"adapter {adapter} names its base model {recorded} (adapter_config.json), which is not on this "
                "machine; pass --model with the model it was trained on"
            )
        return recorded
    if recorded and ours and not same_model(model, recorded):
        raise TunesmithError(
            f"adapter {adapter} was trained on {recorded}, but --model is {model}; leave --model out to use "
            f"{recorded}, or pass --model {recorded}"
        )
    return model


def load_with_adapter(model: str | None, adapter: str | Path | None, device="cpu", dtype: torch.dtype = torch.float32,
                      trust_remote_code: bool = False):
    """(model, tokenizer, spec): the model a verb names (base_model_for: --model, else the adapter's recorded one,
    else the default) loaded on `device` in `dtype`, with `adapter` applied when one is given. An adapter trained
    on a quantized base (QLoRA) gets the base quantized the same way: that is the model it was trained with."""
    spec = base_model_for(model, adapter)
    loaded, tokenizer = load_quantized_for(spec, adapter, device, dtype, trust_remote_code)
    if adapter:
        loaded = load_adapter(loaded, adapter, base=spec)
    return loaded, tokenizer, spec


def same_model(a: str, b: str) -> bool:
    """Whether two model specs name the same model: equal after resolving aliases and paths, or two local folders
    with the same config.json (a copy of the model)."""
    if _model_key(a) == _model_key(b):
        return True
    configs = [Path(s).expanduser() / "config.json" for s in (a, b)]
    if not all(c.is_file() for c in configs):
        return False
    return _architecture(configs[0]) == _architecture(configs[1])


def _model_key(spec: str) -> str:
    from tunesmith.models import BUILTIN_MODELS

    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec].hub_id.lower()
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec.lower()  # hub ids are case-insensitive


def _architecture(config_json: Path) -> dict:
    try:
        config = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"unreadable": str(config_json)}
    ignored = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache")
    return {k: v for k, v in config.items() if k not in ignored} if isinstance(config, dict) else {}
