"""HF folder -> an mlx-lm model folder (optionally MLX-quantized); PEFT adapter -> mlx-lm's adapter folder.

The model folder is written by mlx-lm itself (its loader renames and drops tensors per architecture, its quantizer
packs the weights), so it loads with `mlx_lm.load(folder)` for every architecture mlx-lm knows. The adapter is
converted here without mlx: adapters.safetensors + adapter_config.json, loadable with
`mlx_lm.load(base_mlx_folder, adapter_path=...)` or `mlx_lm.generate --adapter-path`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tunesmith.errors import TunesmithError, missing_extra
from tunesmith.storage import atomic_folder

PRECISIONS = {"fp32": "float32", "none": "float32", "bf16": "bfloat16", "fp16": "float16"}
BITS = {"8bit": 8, "4bit": 4}
GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts
DEFAULT_GROUP_SIZE = 64  # mlx-lm's own default, and what mlx-community models use
QUANTIZED_DTYPE = (
    "bfloat16"  # scales, norms and embeddings of a 4/8-bit export, as mlx-lm's converter leaves them
)
MARKER = "tunesmith-export.json"


def check_quant(quant: str, group_size: int | None) -> tuple[str, int | None, int | None]:
    """(dtype, bits, group size) for an MLX --quant value, or an error listing the valid ones."""
    if quant in PRECISIONS:
        return PRECISIONS[quant], None, None
    if quant not in BITS:
        raise TunesmithError(
            f"--quant {quant!r} is not an MLX option; choose one of {', '.join([*PRECISIONS, *BITS])}"
        )
    group = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if group not in GROUP_SIZES:
        raise TunesmithError(
            f"MLX quantization groups are {', '.join(map(str, GROUP_SIZES))} weights; got --group-size {group}"
        )
    return QUANTIZED_DTYPE, BITS[quant], group


def export(model_dir: Path, output: Path, quant: str, group_size: int | None, max_seq_len: int) -> Path:
    """Write `model_dir` (a plain HF folder) as an mlx-lm folder at `output`; returns the folder.

    `group_size` None means MLX's default of 64. `max_seq_len` is not used: MLX models take any length.
    """
    dtype, bits, group = check_quant(quant, group_size)
    try:
        import mlx.core as mx
        from mlx.utils import tree_map
        from mlx_lm.utils import load, quantize_model, save
    except ImportError:
        raise missing_extra("mlx-lm", "mlx", "--format mlx") from None
    out = _check_output(Path(output))
    try:
        model, tokenizer, config = load(str(model_dir), return_config=True, lazy=True)
    except (ValueError, FileNotFoundError) as e:  # an architecture mlx-lm does not implement, missing weights
        raise TunesmithError(f"mlx-lm cannot load {model_dir}: {str(e).splitlines()[0]}") from None
    target = getattr(mx, dtype)
    model.update(
        tree_map(lambda p: p.astype(target) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters())
    )
    _legacy_rope(config)
    config.pop("torch_dtype", None)  # transformers 5 names it dtype
    config["dtype"] = dtype
    if bits:
        model, config = quantize_model(model, config, group, bits)
    with atomic_folder(out) as tmp:
        save(tmp, model_dir, model, tokenizer, config)
        provenance = {"format": "mlx", "quant": quant, "dtype": dtype, "bits": bits, "group_size": group}
        (tmp / MARKER).write_text(json.dumps({**provenance, "source": str(model_dir)}, indent=2))
    return out


def _legacy_rope(config: dict) -> None:
    """Spell the rope settings the way mlx-lm's model files read them.

    transformers 5 writes `rope_parameters: {rope_theta, rope_type, ...}`; mlx-lm's llama (and most of its models)
    reads top-level `rope_theta` and `rope_scaling`, and silently falls back to theta 10000 without them. SmolLM2
    uses 100000, so without this the export loads and runs, just as a different model.
    """
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:  # absent, or nested per layer type
        return
    config.setdefault("rope_theta", rope["rope_theta"])
    if rope.get("rope_type", "default") != "default":
        config.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})


def _check_output(out: Path) -> Path:
    if out.suffix in (".gguf", ".mlpackage", ".safetensors"):
        raise TunesmithError(f"--format mlx writes a folder; {out} looks like a file name")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        raise TunesmithError(f"{out} exists and is not a tunesmith export folder; choose an empty --output")
    return out


# ------------------------------------------------------------------------------------------------ the adapter

_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_LAYER = re.compile(r"^model\.layers\.(?P<i>\d+)\.(?P<key>.+)$")


def check_adapter_quant(quant: str) -> None:
    """mlx-lm keeps a LoRA adapter in float32 (its adapters.safetensors); another --quant would be ignored."""
    if PRECISIONS.get(quant) != "float32":
        raise TunesmithError(f"mlx-lm adapters are float32: drop --quant {quant} with --adapter-only --format mlx")


def export_adapter(
    adapter_dir: Path, output: Path, num_hidden_layers: int | None = None, model_dir: Path | None = None,
    quant: str = "fp32", name: str | None = None,
) -> Path:
    """Convert a PEFT LoRA adapter folder into mlx-lm's adapter format at `output`; returns the folder.

    mlx-lm computes y = x W^T + scale * (x @ lora_a) @ lora_b, so lora_a = A^T and lora_b = B^T for PEFT's
    y = x W^T + (alpha / r) * B(A(x)). mlx-lm adapts the last `num_layers` blocks; given the model's
    `num_hidden_layers` (or its folder, `model_dir`) the adapted blocks are checked to be exactly those. The
    folder is written whole, with the modes the user's umask gives (as the model export's); `name` is unused.
    """
    check_adapter_quant(quant)
    out = Path(output)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "adapters.safetensors").is_file())):
        raise TunesmithError(f"{out} exists and is not an mlx-lm adapter folder; choose an empty --output")
    if num_hidden_layers is None and model_dir is not None:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        num_hidden_layers = config.get("num_hidden_layers") or config.get("text_config", {}).get("num_hidden_layers")
    import numpy as np
    from safetensors.numpy import save_file
    from safetensors.torch import load_file

    from tunesmith.lora import check_adapter_folder

    folder = check_adapter_folder(adapter_dir)
    peft = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    check_peft_config(peft, folder, "mlx-lm's LoRA format")
    weights: dict[str, np.ndarray] = {}
    keys: set[str] = set()
    layers: set[int] = set()
    for name, tensor in load_file(folder / "adapter_model.safetensors").items():
        m = _PEFT_KEY.match(name)
        if m is None:
            raise TunesmithError(
                f"{folder}: '{name}' is not a LoRA A/B weight; only LoRA on linear layers converts"
            )
        module = m["module"]
        weights[f"{module}.lora_{m['ab'].lower()}"] = np.ascontiguousarray(tensor.float().numpy().T)
        layer = _LAYER.match(module)
        keys.add(layer["key"] if layer else module)
        if layer:
            layers.add(int(layer["i"]))
    n = len(layers)
    top = num_hidden_layers if num_hidden_layers is not None else max(layers, default=-1) + 1
    if layers != set(range(top - n, top)):
        raise TunesmithError(
            f"{folder}: mlx-lm adapts the last N blocks, but this adapter covers blocks {sorted(layers)}"
            + (f" of {num_hidden_layers}" if num_hidden_layers is not None else "")
        )
    rank = int(peft["r"])
    scale = float(peft["lora_alpha"]) / (rank**0.5 if peft.get("use_rslora") else rank)
    config = {
        "fine_tune_type": "lora",
        "num_layers": n,
        "lora_parameters": {
            "rank": rank,
            "scale": scale,
            "dropout": float(peft.get("lora_dropout", 0.0)),
            "keys": sorted(keys),
        },
        "model": peft.get("base_model_name_or_path"),
    }
    with atomic_folder(out) as tmp:  # safetensors writes its file private (0600); the folder gets the umask's modes
        save_file(weights, str(tmp / "adapters.safetensors"), metadata={"format": "mlx"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def check_peft_config(peft: dict, folder: Path, target: str) -> None:
    """List every PEFT option that plain LoRA (mlx-lm's layers, llama.cpp's adapters) cannot express."""
    problems = []
    if peft.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {peft.get('peft_type')} (only LORA converts)")
    if peft.get("use_dora"):
        problems.append("use_dora")
    if peft.get("bias", "none") != "none":
        problems.append(f"bias={peft['bias']}")
    if peft.get("modules_to_save"):
        problems.append(f"modules_to_save={peft['modules_to_save']}")
    if peft.get("rank_pattern") or peft.get("alpha_pattern"):
        problems.append("per-module rank_pattern/alpha_pattern")
    for option in ("lora_bias", "trainable_token_indices", "layer_replication", "target_parameters"):
        if peft.get(option):
            problems.append(option)
    if problems:
        raise TunesmithError(
            f"{folder}: this adapter cannot be expressed in {target}: {', '.join(problems)}"
        )
