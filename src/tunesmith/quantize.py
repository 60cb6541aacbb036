"""Weight-only int8 / int4 through torchao, for eager inference on the machine at hand.

int8: one scale per output channel. int4: one scale per group of 32 / 64 / 128 input weights. Every linear layer
is quantized (lm_head too; a tied one is untied first) and the embedding table is stored as int8 per row.

The output folder is self-describing: config.json, generation_config.json, the tokenizer, model.safetensors and
tunesmith-quant.json (scheme, group size, layers). torchao's tensor subclasses are flattened into plain tensors plus
JSON metadata (its safetensors support), so nothing is pickled; torchao keeps int4 codes one per byte, so they are
packed two per byte here and unpacked on load, which makes the file the size a 4-bit model should be.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tunesmith.errors import TunesmithError, missing_extra

SCHEMES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)
QUANT_FILE = "tunesmith-quant.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "tunesmith-torchao-v1"


def import_torchao():
    """torchao, or an error naming the extra. Its optional CUDA kernels fail to load on a CPU box: not our news."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
        from torchao.quantization import quantize_
    except ImportError:
        raise missing_extra("torchao", "ship", "quantization") from None
    return quantize_


def _configs(scheme: str, group_size: int):
    """(config for linear weights, config for the embedding table) as torchao spells them."""
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    embedding = IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    if scheme == "int8":
        return Int8WeightOnlyConfig(), embedding
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size)), embedding


def check_scheme(scheme: str, group_size: int) -> None:
    if scheme not in SCHEMES:
        raise TunesmithError(f"--scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if scheme == "int4" and group_size not in GROUP_SIZES:
        raise TunesmithError(f"--group-size for int4 must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")


def untie_lm_head(model: torch.nn.Module) -> None:
    """Give lm_head its own copy of a tied embedding, so each can be quantized its own way."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embed is not None and head.weight is embed.weight:
        head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def quantize_model(model: torch.nn.Module, scheme: str = "int8", group_size: int = 32) -> list[str]:
    """Quantize `model` in place; returns the names of the quantized linear layers."""
    check_scheme(scheme, group_size)
    quantize_ = import_torchao()
    linear_cfg, embedding_cfg = _configs(scheme, group_size)
    untie_lm_head(model)
    model.requires_grad_(False)
    done: list[str] = []

    def is_linear(m: torch.nn.Module, name: str) -> bool:
        ok = isinstance(m, torch.nn.Linear) and (scheme == "int8" or m.in_features % group_size == 0)
        if ok:
            done.append(name)
        return ok

    quantize_(model, linear_cfg, filter_fn=is_linear)
    quantize_(model, embedding_cfg, filter_fn=lambda m, _: isinstance(m, torch.nn.Embedding))
    return done


# --------------------------------------------------------------------------------------------- the folder


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7], last dimension even -> uint8, two codes per byte (low nibble first)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    lo, hi = (p & 0x0F).to(torch.int8) - 8, (p >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _is_int4(meta_json: str) -> bool:
    data = json.loads(meta_json).get("_data", {})
    return data.get("target_dtype", {}).get("_data") == "int4"


def save_quantized(model, tokenizer, output: str | Path, info: dict) -> Path:
    """Write the quantized model as a self-describing folder, atomically (a temp folder renamed into place)."""
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    out = Path(output)
    if out.exists() and any(out.iterdir()) and not (out / QUANT_FILE).is_file():
        raise TunesmithError(f"{out} exists and is not a tunesmith quantized folder; choose an empty --output")
    state = {k: v for k, v in model.state_dict().items()}
    tensors, metadata = flatten_tensor_state_dict(state)
    packed = []
    for name in json.loads(metadata["tensor_names"]):
        if _is_int4(metadata[name]):
            key = f"{name.rsplit('.', 1)[0]}._{name.rsplit('.', 1)[1]}_qdata"
            tensors[key] = pack_int4(tensors[key])
            packed.append(key)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / WEIGHTS_FILE, metadata=metadata)
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        body = {"format": FORMAT, **info, "packed_int4": packed}
        (tmp / QUANT_FILE).write_text(json.dumps(body, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_quantized(folder: str | Path) -> bool:
    return (Path(folder) / QUANT_FILE).is_file()


def read_info(folder: str | Path) -> dict:
    path = Path(folder) / QUANT_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TunesmithError(f"{path}: unreadable ({e}); re-run tunesmith quantize") from None
    if info.get("format") != FORMAT:
        raise TunesmithError(f"{path}: format {info.get('format')!r} is not {FORMAT!r}; re-run tunesmith quantize")
    return info


def load_quantized(folder: str | Path, device: torch.device | str = "cpu"):
    """(model, tokenizer) from a folder written by save_quantized; the weights stay quantized."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(folder)
    info = read_info(folder)
    import_torchao()
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise TunesmithError(f"{folder} has no {WEIGHTS_FILE}; re-run tunesmith quantize")
    with safe_open(str(weights), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for key in info.get("packed_int4", []):
        tensors[key] = unpack_int4(tensors[key])
    state, leftover = unflatten_tensor_state_dict(tensors, metadata)
    model = _empty_model(AutoConfig.from_pretrained(folder))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    problems = [f"missing {k}" for k in missing] + [f"unexpected {k}" for k in [*unexpected, *leftover]]
    if problems:
        raise TunesmithError(f"{weights} does not fit its config.json: {', '.join(problems[:5])}")
    if (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval().requires_grad_(False), tokenizer


def _empty_model(config):
    """The model's modules with uninitialised weights (they are all assigned next) and computed buffers."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def weights_bytes(folder: str | Path) -> int:
    """Bytes of a model folder's weight files (safetensors / bin), the part that grows with the model."""
    folder = Path(folder)
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))


# --------------------------------------------------------------------------------------------- the verb


@dataclass
class Measure:
    bytes: int
    perplexity: float
    tokens_per_s: float


@dataclass
class QuantizeResult:
    output: Path
    scheme: str
    group_size: int
    layers: int
    float: Measure
    quantized: Measure


def measure(model, tokenizer, examples, nbytes: int, max_tokens: int, prompt: str = "ROMEO:\n") -> Measure:
    """Perplexity on `examples` and greedy decode tokens/s for one prompt."""
    from tunesmith.evaluate import evaluate
    from tunesmith.generate import stream_generate

    ppl = evaluate(model, examples, 4, 0, tokenizer.pad_token_id).perplexity if examples else float("nan")
    tps = float("nan")
    if max_tokens > 0:
        for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
            tps = r.generation_tps
    return Measure(nbytes, ppl, tps)


def quantize(cfg) -> QuantizeResult:
    """The `quantize` verb: load the float model (+ adapter, merged), quantize, save, reload, compare."""
    from tunesmith.data import load_data
    from tunesmith.models import load_model, resolve_model

    check_scheme(cfg.scheme, cfg.group_size)
    if not cfg.output:
        raise TunesmithError("quantize needs --output, the folder for the quantized model")
    import_torchao()
    model, tokenizer = load_model(cfg.model, "cpu", torch.float32)
    source = resolve_model(cfg.model)
    float_bytes = weights_bytes(source) if isinstance(source, Path) else 0
    if cfg.adapter:
        from tunesmith.lora import load_adapter

        model = load_adapter(model, cfg.adapter).merge_and_unload()
    examples = []
    if cfg.eval_blocks:
        examples = load_data(cfg.data, tokenizer, cfg.seq_len, cfg.val_fraction).valid[: cfg.eval_blocks]
        if not examples:
            raise TunesmithError(f"{cfg.data} has no held-out blocks of {cfg.seq_len} tokens; lower --seq-len")
    before = measure(model, tokenizer, examples, float_bytes, cfg.max_tokens)
    t = time.perf_counter()
    layers = quantize_model(model, cfg.scheme, cfg.group_size)
    info = {"scheme": cfg.scheme, "group_size": cfg.group_size if cfg.scheme == "int4" else None,
            "embedding": "int8 per row", "layers": len(layers), "source": str(cfg.model),
            "adapter": str(cfg.adapter) if cfg.adapter else None, "seconds": round(time.perf_counter() - t, 2)}
    out = save_quantized(model, tokenizer, cfg.output, info)
    del model
    reloaded, _ = load_quantized(out)  # measure what was written, not what is in memory
    after = measure(reloaded, tokenizer, examples, weights_bytes(out), cfg.max_tokens)
    return QuantizeResult(out, cfg.scheme, cfg.group_size, len(layers), before, after)
