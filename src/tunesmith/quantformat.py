"""The folder `tunesmith quantize` writes, and everything needed to read it back; the quantizing itself (GPTQ,
round to nearest, the verb) is quantize.py.

The folder is self-describing: config.json, generation_config.json, the tokenizer, model.safetensors and
tunesmith-quant.json (scheme, group size, grid, layers). torchao's tensor subclasses are flattened into plain tensors
plus JSON metadata (its safetensors support), so nothing is pickled; torchao keeps int4 codes one per byte, so they
are packed two per byte here and unpacked on load, which makes the file the size a 4-bit model should be.

A low-level module: models.py loads such a folder through it, so it imports no stage.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from tunesmith.errors import TunesmithError, missing_extra
from tunesmith.storage import atomic_folder

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


def load_quantized_model(folder: str | Path, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model in a folder written by save_quantized, its weights still quantized (models.load_model gives it
    with its tokenizer)."""
    from safetensors import safe_open
    from transformers import AutoConfig

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
    return model.to(device).eval().requires_grad_(False)


def _empty_model(config):
    """The model's modules with uninitialised weights (they are all assigned next) and computed buffers."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# ------------------------------------------------------------------------------------ eager decoding on the CPU

# torchao's int tensors dequantize the whole matrix at every call (a 135M model decoded 3x slower than in float).
# aten's packed CPU kernels multiply the codes directly, and they are fast with bf16 activations (the fp32 path is
# scalar): a layer's input is rounded to bf16 for the product, the result comes back in the model's dtype.
KERNEL_DTYPE = torch.bfloat16


class CpuInt4Linear(torch.nn.Module):
    """An int4 linear (codes in groups, a scale and an offset per group: w = scale * code + offset) through aten's
    packed CPU kernel (tinygemm's layout: w = scale * (q - 8) + zero, so q = code + 8 and zero = offset)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight
        self.out_features, self.in_features = w.shape
        self.group_size = int(w.block_size[-1])
        scale = w.scale.reshape(self.out_features, -1).float()
        offset = getattr(linear, "group_offset", None)
        zero = torch.zeros_like(scale) if offset is None else offset.reshape(scale.shape).float()
        codes = w.qdata.to(torch.int32) + 8
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1))
        from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

        self.register_buffer("scale_and_zero", pack_tinygemm_scales_and_zeros(
            scale.to(KERNEL_DTYPE), zero.to(KERNEL_DTYPE), KERNEL_DTYPE))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scale_and_zero)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class CpuInt8Linear(torch.nn.Module):
    """An int8 linear with one scale per output channel through aten's CPU int8 weight-only kernel."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight
        self.out_features, self.in_features = w.shape
        # A copy: the loaded codes may sit unaligned inside the safetensors file's buffer, which the kernel's vector
        # loads do not allow (it crashes).
        self.register_buffer("qdata", w.qdata.clone(memory_format=torch.contiguous_format))
        self.register_buffer("scale", w.scale.reshape(-1).to(KERNEL_DTYPE))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qdata, self.scale)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class CpuInt8Embedding(torch.nn.Module):
    """An int8 embedding table (a scale per row) that dequantizes only the rows it looks up."""

    def __init__(self, embedding: torch.nn.Embedding):
        super().__init__()
        w = embedding.weight
        self.num_embeddings, self.embedding_dim = w.shape
        self.register_buffer("qdata", w.qdata.contiguous())
        self.register_buffer("scale", w.scale.reshape(-1, 1).float())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.qdata).float() * torch.nn.functional.embedding(ids, self.scale)


def _kernel_for(module: torch.nn.Module):
    """The CPU kernel module for a quantized linear / embedding, or None (float, or a layout it does not take)."""
    w = getattr(module, "weight", None)
    if not hasattr(w, "qdata") or w.ndim != 2 or getattr(w, "zero_point", None) is not None and w.zero_point.any():
        return None
    groups = tuple(getattr(w, "block_size", ()))
    per_row = groups == (1, w.shape[1]) and w.qdata.dtype == torch.int8
    if isinstance(module, torch.nn.Embedding):
        return CpuInt8Embedding(module) if per_row and getattr(w, "target_dtype", torch.int8) == torch.int8 else None
    if not isinstance(module, torch.nn.Linear):
        return None
    if getattr(w, "target_dtype", None) == torch.int4 and groups[-1:] and groups[-1] in (32, 64, 128, 256):
        return CpuInt4Linear(module)
    if per_row and getattr(w, "target_dtype", torch.int8) == torch.int8:
        return CpuInt8Linear(module)
    return None


def use_cpu_kernels(model: torch.nn.Module) -> int:
    """Swap the quantized linears and embedding of a model on the CPU for modules that run aten's packed int4 /
    int8 kernels (what the model computes stays the same weights; a layer's input is rounded to bf16); returns
    how many were swapped. For eager inference: the swapped model no longer saves or exports as torchao tensors."""
    swaps = [(name, kernel) for name, m in model.named_modules() if (kernel := _kernel_for(m)) is not None]
    for name, kernel in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, kernel)
    return len(swaps)
