"""Weight-only int8 / int4 through torchao, for eager inference on the machine at hand.

int8: one scale per output channel. int4: per group of 32 / 64 / 128 input weights, a scale and (the default affine
grid) a float offset, chosen by GPTQ (gptq.py); v_proj int8 per channel unless told otherwise. Every linear layer is
quantized (lm_head int8; a tied one is untied first) and the embedding table is stored as int8 per row.

The output folder is self-describing: config.json, generation_config.json, the tokenizer, model.safetensors and
tunesmith-quant.json (scheme, group size, grid, layers). torchao's tensor subclasses are flattened into plain tensors plus
JSON metadata (its safetensors support), so nothing is pickled; torchao keeps int4 codes one per byte, so they are
packed two per byte here and unpacked on load, which makes the file the size a 4-bit model should be.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tunesmith.errors import TunesmithError, missing_extra
from tunesmith.storage import atomic_folder

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


GRIDS = ("affine", "symmetric")
KEEP_8BIT = ("v_proj",)


def quantize_model(model: torch.nn.Module, scheme: str = "int8", group_size: int = 32,
                   calibration: Sequence[Sequence[int]] | None = None, grid: str = "affine",
                   keep_8bit: Sequence[str] = KEEP_8BIT) -> dict:
    """Quantize `model` in place (torchao tensors); returns what was done, for tunesmith-quant.json.

    int8: every linear (lm_head too) int8 per output channel, run by torchao's int8 weight-only kernel. int4: the
    decoder layers' linears int4 in groups, chosen by GPTQ when `calibration` (token blocks) is given, else rounded
    to nearest; `grid` affine adds a float offset per group (scale * code + offset, as MLX and llama.cpp's Q4_1 /
    Q4_K store 4 bits), symmetric is XNNPACK's bare grid. Linears named in `keep_8bit` (v_proj by default, as
    llama.cpp's Q4_K_M keeps attn_v at 6 bits) are int8 per channel, also by GPTQ. lm_head int8 per channel (4 bits
    there cost as much perplexity as all the layers' down_proj together). Both schemes: the embedding int8 per row.
    """
    check_scheme(scheme, group_size)
    if grid not in GRIDS:
        raise TunesmithError(f"--grid must be one of {', '.join(GRIDS)}, got {grid!r}")
    quantize_ = import_torchao()
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis

    untie_lm_head(model)
    model.requires_grad_(False)
    info: dict = {"scheme": scheme, "group_size": group_size if scheme == "int4" else None,
                  "embedding": "int8 per row", "lm_head": "int8 per channel"}
    if scheme == "int8":
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))
        info.update(method="round to nearest", linear="int8 per channel")
    else:
        info.update(_int4_layers(model, group_size, calibration, grid, tuple(keep_8bit)))
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(int8_rows(head.weight), requires_grad=False)
    info["quantized_linear_layers"] = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
              filter_fn=lambda m, _: isinstance(m, torch.nn.Embedding))
    return info


def _int4_layers(model, group_size: int, calibration, grid: str, keep_8bit: tuple[str, ...]) -> dict:
    """int4 weights for every linear inside model.model.layers: GPTQ with calibration, else round to nearest."""
    from tunesmith import gptq

    if not (hasattr(model, "model") and hasattr(model.model, "layers")):
        raise TunesmithError("int4 needs a decoder-only model with model.model.layers (the Llama / Qwen / Mistral shape)")
    names = {n.rsplit(".", 1)[-1] for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    unknown = sorted(set(keep_8bit) - names)
    if unknown:
        raise TunesmithError(f"--keep-8bit names {', '.join(unknown)}, which this model's layers lack; "
                             f"they have {', '.join(sorted(names))}")
    for name, m in model.model.layers.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in keep_8bit and m.in_features % group_size:
            raise TunesmithError(f"layer {name} has {m.in_features} inputs, not a multiple of --group-size {group_size}")
    four = gptq.INT4_AFFINE if grid == "affine" else gptq.INT4

    def plan(name: str, m: torch.nn.Linear):
        return (gptq.INT8, m.in_features) if name.rsplit(".", 1)[-1] in keep_8bit else (four, group_size)

    if calibration:
        done = gptq.gptq_decoder_layers(model, calibration, plan)
        method = {"method": "gptq (act-order, static groups, sequential)", "calibration_blocks": len(calibration)}
    else:
        done = gptq.rtn_decoder_layers(model, plan)
        method = {"method": "round to nearest", "calibration_blocks": 0}
    for name, (g, group, scales, offsets) in done.items():
        m = model.get_submodule(name)
        sym = m.weight.float() - offsets.repeat_interleave(group, dim=1)  # scale * code: XNNPACK's part
        m.weight = torch.nn.Parameter(intx_groups(sym, scales, group, torch.int8 if g is gptq.INT8 else torch.int4),
                                      requires_grad=False)
        if g.affine:
            GroupOffsetLinear.convert(m, group, offsets)
    kind = "affine (scale and offset per group)" if grid == "affine" else "symmetric (scale per group)"
    return {**method, "grid": grid, "linear": f"int4 {kind}, groups of {group_size}",
            "kept_8bit": list(keep_8bit), "affine_layers": sorted(n for n, v in done.items() if v[0].affine)}


class GroupOffsetLinear(torch.nn.Linear):
    """A linear whose weight is scale * code (a torchao int tensor) plus a float offset per group of inputs.

    y = x W_sym^T + (group sums of x) offset^T: the offset part is two small float products (x times a fixed 0/1
    matrix [groups, in], then times offset [out, groups]), which XNNPACK runs too, so a .pte keeps the affine grid
    with its symmetric int4 kernels. Costs groups / in (1/32) more multiply-adds than the layer, in float.
    """

    group_size: int

    @classmethod
    def convert(cls, m: torch.nn.Linear, group_size: int, offsets: torch.Tensor) -> None:
        m.__class__ = cls
        m.group_size = group_size
        groups = m.in_features // group_size
        # Held in float32, so a .pte gets it as a constant weight XNNPACK runs (a cast at run time would leave the
        # product outside the delegate); the values are float16 (gptq.Grid.offset_dtype), as the file stores them.
        m.register_buffer("group_offset", offsets.float().reshape(m.out_features, groups).contiguous())
        onehot = torch.zeros(groups, m.in_features)
        onehot[torch.arange(m.in_features) // group_size, torch.arange(m.in_features)] = 1.0
        m.register_buffer("group_sum", onehot, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums = torch.nn.functional.linear(x, self.group_sum)
        return super().forward(x) + torch.nn.functional.linear(sums, self.group_offset)


def intx_groups(on_grid: torch.Tensor, scales: torch.Tensor, group_size: int, dtype=torch.int4):
    """A torchao int tensor (codes + scales, no zero point) from weights already on the grid (gptq.py) and their
    scales [out, in / group_size]."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    return IntxUnpackedToInt8Tensor.from_hp(
        on_grid.float(), (1, group_size), dtype, intx_choose_qparams_algorithm=None,
        custom_scale=scales.float(), custom_zero_point=torch.zeros_like(scales, dtype=torch.int8),
    )


def int8_rows(weight: torch.Tensor):
    """A torchao int8 tensor, symmetric, one scale per output row (what XNNPACK runs as 8-bit per channel)."""
    from torchao.quantization import IntxUnpackedToInt8Tensor, MappingType

    return IntxUnpackedToInt8Tensor.from_hp(weight.detach().float(), (1, weight.shape[1]), torch.int8,
                                            mapping_type=MappingType.SYMMETRIC)


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
    for name in [k for k in tensors if k.endswith(".group_offset")]:
        tensors[name] = tensors[name].half()  # float16 values already (GroupOffsetLinear): half the bytes
    for name in json.loads(metadata["tensor_names"]):
        if _is_int4(metadata[name]):
            key = f"{name.rsplit('.', 1)[0]}._{name.rsplit('.', 1)[1]}_qdata"
            tensors[key] = pack_int4(tensors[key])
            packed.append(key)
    with atomic_folder(out) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / WEIGHTS_FILE, metadata=metadata)
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        affine = sorted(n for n, m in model.named_modules() if isinstance(m, GroupOffsetLinear))
        body = {"format": FORMAT, **info, "packed_int4": packed, "affine_layers": affine}
        (tmp / QUANT_FILE).write_text(json.dumps(body, indent=2))
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
    for name in info.get("affine_layers", []):  # their offsets are in the state dict
        m = model.get_submodule(name)
        offsets = state.get(f"{name}.group_offset")
        if not isinstance(m, torch.nn.Linear) or offsets is None:
            raise TunesmithError(f"{weights} lacks the group offsets of {name}; re-run tunesmith quantize")
        GroupOffsetLinear.convert(m, m.in_features // offsets.shape[1], offsets)
        state[f"{name}.group_offset"] = m.group_offset
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


def calibration_blocks(train: Sequence, n: int) -> list[list[int]]:
    """n token blocks spread evenly over the training split (not the first n: those are one play / one file)."""
    if n <= 0 or not train:
        return []
    step = max(1, len(train) // n)
    return [list(ids) for ids, _ in train[::step][:n]]


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
    data = load_data(cfg.data, tokenizer, cfg.seq_len, cfg.val_fraction) if cfg.eval_blocks or cfg.calibration_blocks else None
    examples = data.valid[: cfg.eval_blocks] if data and cfg.eval_blocks else []
    if cfg.eval_blocks and not examples:
        raise TunesmithError(f"{cfg.data} has no held-out blocks of {cfg.seq_len} tokens; lower --seq-len")
    calibration = calibration_blocks(data.train, cfg.calibration_blocks) if data and cfg.scheme == "int4" else None
    before = measure(model, tokenizer, examples, float_bytes, cfg.max_tokens)
    t = time.perf_counter()
    keep = tuple(k for k in cfg.keep_8bit.split(",") if k)
    info = quantize_model(model, cfg.scheme, cfg.group_size, calibration, cfg.grid, keep)
    info.update(source=str(cfg.model), adapter=str(cfg.adapter) if cfg.adapter else None,
                seconds=round(time.perf_counter() - t, 1))
    out = save_quantized(model, tokenizer, cfg.output, info)
    del model
    reloaded, _ = load_quantized(out)  # measure what was written, not what is in memory
    after = measure(reloaded, tokenizer, examples, weights_bytes(out), cfg.max_tokens)
    return QuantizeResult(out, cfg.scheme, cfg.group_size, info["quantized_linear_layers"], before, after)
