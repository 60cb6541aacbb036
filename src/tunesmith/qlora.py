"""The frozen base held in 4 or 8 bits (QLoRA): `train --quantize-base nf4|int4|int8|fp8`.

Every linear layer of the decoder (not the embedding, the norms or the output head) becomes a QuantLinear: its
weight is kept quantized and dequantized to the compute dtype for each product, one layer at a time, in the
forward pass and again in the backward pass (the weight's gradient is never needed, only the input's). Plain
PyTorch, so it trains on the CPU, MPS and CUDA alike.

- nf4: torchao's NF4 tensor (`to_nf4`, blocks of 64 with double-quantized scales: the QLoRA recipe torchtune uses)
  and its autograd-aware `linear_nf4`. On CUDA with Triton, `--fast-paths auto` multiplies through
  `tunesmith.kernels.nf4` instead, which decodes the same weight inside its kernels.
- int4: symmetric, one fp16 scale per group of 64 inputs, codes packed two per byte.
- int8: symmetric, one fp16 scale per output row.
- fp8: float8 e4m3, one fp32 scale per output row, plus the transposed weight scaled per input column. On a CUDA GPU
  with fp8 tensor cores (compute capability 8.9 and up) under bf16 the products run in fp8 (`torch._scaled_mm`,
  each row of the input, and of the gradient in the backward pass, scaled by its own absmax): faster than bf16 at
  the same weight memory (two 1-byte copies). Elsewhere it dequantizes like the others.

int4 and int8 quantize with torchao's affine primitives; their dequantization (codes x scales) is the few lines
below, written for this layout because torchao's packed int4 kernels run on CUDA alone and have no backward.

`load_quantized_base` reads a safetensors folder tensor by tensor and quantizes each decoder linear as it arrives,
so the peak while loading is the quantized model plus one weight, not the full-precision model.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from tunesmith.device import release_heap
from tunesmith.errors import TunesmithError, missing_extra
from tunesmith.quantformat import pack_int4, unpack_int4

SCHEMES = ("nf4", "int4", "int8", "fp8")
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # torchao's (and the QLoRA paper's) defaults
INT4_GROUP = 64
SCALE_DTYPE = torch.float16
TRIM_EVERY = 8  # quantized linears between two release_heap calls: about one decoder layer's
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8 e4m3's largest finite value


def fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (float8 e4m3 codes, fp32 scales [rows, 1]): each row scaled so that its absmax is FP8_MAX.
    bf16 stays bf16 on the way (the scale is rounded to bf16 first, so the codes and the scale agree), which
    halves the temporaries of an uncompiled product."""
    dtype = torch.bfloat16 if t.dtype == torch.bfloat16 else torch.float32
    scale = (t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX).to(dtype)
    return (t.to(dtype) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.float()


def fp8_products(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs fp8 products on this device's tensor cores (CUDA, capability 8.9+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T as one fp8 product: x's rows quantized by their absmax, W's fp8 rows; the input's gradient likewise
    from the gradient's rows and the transposed weight's (so W's fp8 copy per input column). bf16 out."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
        ctx.layer = layer
        xq, xs = fp8_rows(x.reshape(-1, x.shape[-1]))
        y = torch._scaled_mm(xq, layer.fp8_weight().t(), scale_a=xs, scale_b=layer.w_scale.float().t(),
                             out_dtype=torch.bfloat16)
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        layer = ctx.layer
        gq, gs = fp8_rows(grad.reshape(-1, grad.shape[-1]))
        gx = torch._scaled_mm(gq, layer.fp8_weight_t().t(), scale_a=gs, scale_b=layer.wt_scale.float().t(),
                              out_dtype=torch.bfloat16)
        return gx.view(*grad.shape[:-1], -1), None


@functools.cache  # every nf4 forward asks: look it up once (a failed import is not cached, and says what to install)
def _torchao_nf4():
    try:
        from torchao.quantization import to_nf4
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4
    except ImportError:
        raise missing_extra("torchao", "qlora", "--quantize-base") from None
    return to_nf4, linear_nf4


class _DequantLinear(torch.autograd.Function):
    """y = x W^T with W dequantized for the product, and again for the input's gradient: nothing of W is kept."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.dequantize(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.layer.dequantize(grad.dtype), None


class QuantLinear(torch.nn.Linear):
    """A frozen linear whose weight is held in 4 or 8 bits.

    It is an nn.Linear to every library that asks (PEFT wraps it as it wraps any linear), but `weight` is computed:
    reading it dequantizes (PEFT's DoRA reads it for the weight norm). The quantized tensors are its buffers
    (nf4: a parameter holding torchao's NF4 tensor, which moves between devices as one), so `.to(device)` moves
    them; a dtype cast of the model would dequantize an NF4 tensor, so nothing here casts one.
    """

    def __init__(self, in_features: int, out_features: int, scheme: str, dtype: torch.dtype,
                 bias: torch.Tensor | None = None):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features, self.scheme, self.compute_dtype = in_features, out_features, scheme, dtype
        self.fast = False  # fp8: products in fp8 on this device (fp8_products)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, scheme: str, bias: torch.Tensor | None = None) -> QuantLinear:
        """Quantize a full-precision weight [out, in]; the result dequantizes to `weight`'s dtype."""
        out_f, in_f = weight.shape
        layer = cls(in_f, out_f, scheme, weight.dtype, bias)
        w = weight.detach()
        if scheme == "nf4":
            to_nf4, _ = _torchao_nf4()
            blocks = w.numel() // NF4_BLOCK
            layer.qweight = torch.nn.Parameter(to_nf4(w, NF4_BLOCK, math.gcd(NF4_SCALER_BLOCK, blocks)),
                                               requires_grad=False)
            return layer
        if scheme == "fp8":  # the codes kept as bytes: a dtype cast of the model leaves them alone
            codes, scale = fp8_rows(w)
            codes_t, scale_t = fp8_rows(w.t())
            layer.register_buffer("w_codes", codes.view(torch.uint8).contiguous())
            layer.register_buffer("w_scale", scale.contiguous())
            layer.register_buffer("wt_codes", codes_t.view(torch.uint8).contiguous())
            layer.register_buffer("wt_scale", scale_t.contiguous())
            layer.fast = fp8_products(w.device)
            return layer
        from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

        group, lo, hi = (INT4_GROUP, -8, 7) if scheme == "int4" else (in_f, -127, 127)
        block = (1, group)
        scale, zero = choose_qparams_affine(w.float(), MappingType.SYMMETRIC, block, torch.int8, lo, hi,
                                            scale_dtype=torch.float32)
        scale = scale.to(SCALE_DTYPE).float()  # codes are rounded against the scale as it is stored
        codes = quantize_affine(w.float(), block, scale, zero, torch.int8, lo, hi)
        if scheme == "int4":
            codes = pack_int4(codes)
        layer.register_buffer("codes", codes.contiguous())
        layer.register_buffer("scales", scale.reshape(out_f, -1).to(SCALE_DTYPE).contiguous())
        return layer

    @staticmethod
    def supports(linear: torch.nn.Linear, scheme: str) -> bool:
        """Whether this layer's shape has whole blocks / groups for the scheme (a model's linears all do)."""
        if scheme == "nf4":
            return linear.weight.numel() % NF4_BLOCK == 0
        if scheme == "int4":
            return linear.in_features % INT4_GROUP == 0
        if scheme == "fp8":  # torch._scaled_mm's operands: both dimensions multiples of 16
            return linear.in_features % 16 == 0 and linear.out_features % 16 == 0
        return True

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.compute_dtype
        if self.scheme == "nf4":
            return self.qweight.get_original_weight().to(dtype)
        if self.scheme == "fp8":
            return (self.fp8_weight().float() * self.w_scale.float()).to(dtype)
        codes = self.codes
        if self.scheme == "int4":
            codes = unpack_int4(codes)
        groups = self.scales.shape[1]
        w = codes.view(self.out_features, groups, -1).to(dtype) * self.scales.to(dtype).unsqueeze(-1)
        return w.view(self.out_features, self.in_features)

    def calibratable(self) -> bool:
        """Whether GPTQ can choose this layer's codes: nf4 / int4 / int8 with every scale's block inside a row."""
        if self.scheme == "nf4":
            return self.in_features % self.qweight.block_size == 0
        return self.scheme in ("int4", "int8")

    def levels_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the format's levels [L], the scales [out, in / group] float32): weight = levels[code] * its scale."""
        if self.scheme == "nf4":
            q = self.qweight
            scales = q.dequantize_scalers(q.quantized_scalers, q.quantization_factor, q.scaler_block_size)
            return q.nf4.float(), scales.float().view(self.out_features, -1)
        lo = -8 if self.scheme == "int4" else -127
        levels = torch.arange(lo, -lo + (0 if self.scheme == "int4" else 1), device=self.scales.device)
        return levels.float(), self.scales.float()

    def set_codes(self, codes: torch.Tensor) -> None:
        """Store codes [out, in] (indices into levels_and_scales' levels) in place of the ones it holds."""
        codes = codes.to(self.code_tensor().device)
        if self.scheme == "nf4":
            flat = codes.flatten().to(torch.uint8)
            self.qweight.quantized_data.copy_(flat[::2] << 4 | flat[1::2])
            return
        values = (codes + (-8 if self.scheme == "int4" else -127)).to(torch.int8)
        self.codes.copy_(pack_int4(values) if self.scheme == "int4" else values)

    def code_tensor(self) -> torch.Tensor:
        """The tensor its codes are stored in (what calibration changes; the scales follow from the weights)."""
        return self.qweight.quantized_data if self.scheme == "nf4" else self.codes

    def fp8_weight(self) -> torch.Tensor:
        return self.w_codes.view(FP8)

    def fp8_weight_t(self) -> torch.Tensor:
        return self.wt_codes.view(FP8)

    def _apply(self, fn, recurse=True):  # a move to or from a GPU decides again whether fp8 products run there
        super()._apply(fn, recurse)
        if self.scheme == "fp8":
            self.fast = fp8_products(self.w_codes.device)
        return self

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme == "nf4":
            _, linear_nf4 = _torchao_nf4()
            y = linear_nf4(x, self.qweight)
        elif self.scheme == "fp8" and self.fast and _compute_dtype(x) == torch.bfloat16:
            y = _Fp8Linear.apply(x.to(torch.bfloat16), self)
        else:
            y = _DequantLinear.apply(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}"

    def quantized_bytes(self) -> int:
        tensors = ([self.qweight.quantized_data, self.qweight.quantized_scalers, self.qweight.quantization_factor,
                    self.qweight.scaler_mean, self.qweight.nf4] if self.scheme == "nf4" else
                   [self.w_codes, self.w_scale, self.wt_codes, self.wt_scale] if self.scheme == "fp8" else
                   [self.codes, self.scales])
        return sum(t.numel() * t.element_size() for t in tensors)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def check_scheme(scheme: str, device: torch.device | None = None) -> None:
    if scheme not in SCHEMES:
        raise TunesmithError(f"--quantize-base must be one of none, {', '.join(SCHEMES)}, got {scheme!r}")
    if scheme == "fp8" and device is not None and torch.device(device).type == "mps":
        raise TunesmithError("--quantize-base fp8: MPS has no float8 type (fp8 is for CUDA GPUs with fp8 tensor "
                             "cores); on a Mac use --quantize-base nf4, int4 or int8")
    if scheme != "fp8":  # nf4, int4 and int8 quantize through torchao: a missing extra fails before any loading
        _torchao_nf4()


def quant_targets(model: torch.nn.Module, scheme: str) -> list[str]:
    """Names of the linears a quantized base holds quantized: every linear but the output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not isinstance(m, QuantLinear) and m is not head
            and QuantLinear.supports(m, scheme)]


def quantize_base(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """Replace the model's linears (not its output head) by QuantLinears in place, one at a time; returns it."""
    check_scheme(scheme, next((p.device for p in model.parameters()), None))
    for i, name in enumerate(quant_targets(model, scheme), 1):
        linear = model.get_submodule(name)
        _set(model, name, QuantLinear.from_weight(linear.weight, scheme, linear.bias))
        del linear
        if i % TRIM_EVERY == 0:
            release_heap()
    return model


def dequantize_base(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Replace every QuantLinear by a plain nn.Linear holding its dequantized weight (what it computed with)."""
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantLinear):
            plain = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
            plain.weight = torch.nn.Parameter(m.dequantize(dtype), requires_grad=False)
            if m.bias is not None:
                plain.bias = torch.nn.Parameter(m.bias.detach().to(dtype), requires_grad=False)
            _set(model, name, plain)
    return model


BASE_CODES = "base-codes.safetensors"  # a calibrated base's codes, beside the adapter trained on it


@torch.no_grad()
def calibrate_base(model: torch.nn.Module, scheme: str, calibration, progress: bool = True) -> int:
    """Quantize a full-precision model's decoder linears to `scheme` with GPTQ-chosen codes, in place.

    Each linear keeps the scales round to nearest gives it (so it loads and dequantizes exactly like any other
    QuantLinear); only which level each weight takes is chosen, column by column, so that the layer's outputs on
    the calibration blocks (lists of token ids; the training data's) move least. Decoder layers go in order, each
    calibrated on the outputs of the layers already quantized, its full-precision linears replaced as it is done.
    Linears outside the decoder layers (none in Llama-family models) are quantized to nearest. Returns how many
    linears were calibrated."""
    from tunesmith.gptq import _hessians, gptq_levels, layer_inputs
    from tunesmith.progress import steps

    check_scheme(scheme, next((p.device for p in model.parameters()), None))
    if scheme == "fp8":
        raise TunesmithError("--base-calibration chooses nf4, int4 or int8 codes; fp8 keeps each weight's nearest "
                             "float8 value: drop --base-calibration")
    if quantized_scheme(model):
        raise TunesmithError("calibrate_base chooses codes from the full-precision weights, but this model is "
                             "already quantized: load it without quantize_base")
    if not calibration:
        raise TunesmithError("--base-calibration: no training blocks to calibrate on")
    targets = set(quant_targets(model, scheme))
    layers = model.model.layers
    hidden, run_all = layer_inputs(model, calibration)
    done = 0
    with steps(f"calibrating the {scheme} base on {len(calibration)} blocks, layer", len(layers), progress) as advance:
        for li, layer in enumerate(layers):
            linears = {n: m for n, m in layer.named_modules()
                       if isinstance(m, torch.nn.Linear) and f"model.layers.{li}.{n}" in targets}
            hessians = _hessians(linears, run_all, layer, hidden)
            for name, linear in linears.items():
                q = QuantLinear.from_weight(linear.weight, scheme, linear.bias)
                if q.calibratable():
                    levels, scales = q.levels_and_scales()
                    q.set_codes(gptq_levels(linear.weight, hessians[name], scales, levels))
                    done += 1
                _set(layer, name, q)
                del linear
            hidden = run_all(layer, hidden)  # through the quantized layer: the next layer's inputs
            advance()
    quantize_base(model, scheme)  # whatever is left outside the decoder layers, to nearest
    return done


def base_codes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{module name: its stored codes} for every QuantLinear: what makes a calibrated base what it is."""
    return {_plain_name(name): m.code_tensor().detach().cpu().contiguous()
            for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def _plain_name(name: str) -> str:
    """A QuantLinear's name in the bare model, whether or not PEFT wraps it (base_model.model. ... .base_layer)."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def apply_base_codes(model: torch.nn.Module, path: Path) -> int:
    """Load codes saved by `base_codes` (a safetensors file) into a base quantized to nearest the same way."""
    from safetensors.torch import load_file

    try:
        saved = load_file(str(path))
    except Exception as e:  # a damaged or truncated file
        raise TunesmithError(f"{path} is unreadable ({e}); it holds the calibrated base's codes the adapter was "
                             "trained on: copy it again from the run") from None
    layers = {_plain_name(name): m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    if missing := sorted(layers.keys() - saved.keys()):
        raise TunesmithError(f"{path} does not fit this model: it has no codes for {missing[0]}"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                             + "; it was saved for another base model or quantization scheme")
    for name, codes in saved.items():
        m = layers.get(name)
        if m is None or m.code_tensor().shape != codes.shape or m.code_tensor().dtype != codes.dtype:
            raise TunesmithError(f"{path} does not fit this model ({name}): it was saved for another base model or "
                                 "quantization scheme")
        m.code_tensor().copy_(codes)
    return len(saved)


def quantized_scheme(model: torch.nn.Module) -> str | None:
    return next((m.scheme for m in model.modules() if isinstance(m, QuantLinear)), None)


def _set(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


# ----------------------------------------------------------------------------------------------- loading


def load_quantized_base(folder: Path, device: torch.device, dtype: torch.dtype, scheme: str,
                        trust_remote_code: bool = False) -> torch.nn.Module | None:
    """A safetensors model folder loaded straight into its quantized form, tensor by tensor.

    The model is built without weights (accelerate's init_empty_weights: parameters on the meta device, buffers
    real); each decoder linear's weight is quantized on `device` as soon as it is read. Returns None when the
    folder's tensor names do not map onto the model's (an architecture whose checkpoint transformers renames on
    load): the caller then loads the plain model and quantizes it in place."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    check_scheme(scheme, device)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa",
                                                 trust_remote_code=trust_remote_code)
    targets = set(quant_targets(model, scheme))
    params = dict(model.named_parameters())
    pending: dict[str, dict[str, torch.Tensor]] = {}  # a target's weight waits for its bias, and the reverse
    done = 0
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                name = key if key in params else f"model.{key}" if f"model.{key}" in params else None
                if name is None:
                    return None
                owner, _, attr = name.rpartition(".")
                # a copy: a tensor safetensors hands out may view the whole mapped file, whose every page this
                # loop reads, and holding one view would keep all of them resident
                tensor = f.get_tensor(key).to(device=device, dtype=dtype, copy=True)
                if owner in targets:
                    parts = pending.setdefault(owner, {})
                    parts[attr] = tensor
                    linear = model.get_submodule(owner)
                    if "weight" in parts and (linear.bias is None or "bias" in parts):
                        _set(model, owner, QuantLinear.from_weight(parts["weight"], scheme, parts.get("bias")))
                        del pending[owner]
                        done += 1
                        if done % TRIM_EVERY == 0:
                            release_heap()  # the freed full-precision copies, back to the OS (see there)
                else:
                    module = model.get_submodule(owner)
                    setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))
    if pending:
        return None
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    if any(p.is_meta for p in model.parameters()):
        return None
    return model.to(device).eval()
