"""HF Llama-family folder -> a Core ML .mlpackage (ML Program, iOS 18 / macOS 15) with static shapes.

coremltools cannot convert transformers' own forward (its mask helpers use ops Core ML lacks), so what is converted
is `DecodeStep`: one token in, its logits and its keys/values out, attending over a fixed-size KV cache that the
app keeps and passes back in. Shapes never change, the causal mask is built inside from `position`, and the rotary
tables are precomputed by the model's own rotary module, so rope scaling carries over.

Conversion and spec validation run anywhere coremltools installs; running the model needs macOS (Core ML).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tunesmith.errors import TunesmithError, missing_extra
from tunesmith.models import NO_HUB_KERNELS

# --quant -> (compute precision, weight compression); int8 is per output channel, int4 per block of group_size
QUANTS = {"fp32": ("fp32", None), "fp16": ("fp16", None), "int8": ("fp16", "int8"), "int4": ("fp16", "int4")}
SUPPORTED_MODEL_TYPES = ("llama", "gemma3_text")
INPUTS = ("input_ids", "position", "k_cache", "v_cache")
OUTPUTS = ("logits", "k_new", "v_new")
MASKED = -3.0e4  # additive mask for empty cache slots; finite so fp16 compute stays NaN-free
MARKER = "tunesmith-export.json"


def check_quant(quant: str, group_size: int | None) -> tuple[str, str | None]:
    if quant not in QUANTS:
        raise TunesmithError(f"--quant {quant!r} is not a Core ML option; choose one of {', '.join(QUANTS)}")
    if quant == "int4" and (group_size is None or group_size < 8 or group_size & (group_size - 1)):
        raise TunesmithError(
            f"Core ML int4 blocks must be a power of two >= 8 weights; got --group-size {group_size}"
        )
    return QUANTS[quant]


class DecodeStep(torch.nn.Module):
    """One decode step of a HF Llama-family model, with static shapes and the KV cache passed in and out.

    Inputs: input_ids (1, 1) int32, position (1,) int32 (the token's index, < max_seq_len), k_cache and v_cache
    (layers, kv_heads, max_seq_len, head_dim) whose slots [0, position) hold the earlier tokens.
    Outputs: logits (1, 1, vocab), and this token's k_new / v_new (layers, kv_heads, 1, head_dim), which the
    caller writes into slot `position` of its caches before the next step. A prompt is fed one token at a time.
    """

    def __init__(self, model, max_seq_len: int):
        super().__init__()
        config = model.config
        self.layers = model.model.layers
        self.embed, self.norm, self.lm_head = model.model.embed_tokens, model.model.norm, model.lm_head
        self.n_head = config.num_attention_heads
        self.n_kv = config.num_key_value_heads or self.n_head
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_head
        self.max_seq_len = max_seq_len
        positions = torch.arange(max_seq_len)[None]
        probe = torch.zeros(1, max_seq_len, self.head_dim)
        # Gemma 3: a rope per layer type (sliding base 1e4, global 1e6), q/k normed per head, outputs normed before
        # each residual add; within max_seq_len <= the sliding window every layer sees every earlier token.
        self.gemma = config.model_type == "gemma3_text"
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(self.layers))
        self.scaling = [layer.self_attn.scaling for layer in self.layers]
        for kind in set(self.layer_types):  # the model's own rope, scaling included
            args = (probe, positions, kind) if self.gemma else (probe, positions)
            cos, sin = model.model.rotary_emb(*args)
            self.register_buffer(f"cos_{kind}", cos[0].float(), persistent=False)
            self.register_buffer(f"sin_{kind}", sin[0].float(), persistent=False)
        self.register_buffer("slots", torch.arange(max_seq_len, dtype=torch.int32), persistent=False)

    def cache_shape(self) -> tuple[int, int, int, int]:
        return (len(self.layers), self.n_kv, self.max_seq_len, self.head_dim)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        ids = torch.zeros(1, 1, dtype=torch.int32)
        pos = torch.zeros(1, dtype=torch.int32)
        return ids, pos, torch.zeros(self.cache_shape()), torch.zeros(self.cache_shape())

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2  # a Python int, so the trace holds a constant rather than a shape op
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # HF's rotate_half layout
        return x * cos + rotated * sin

    def forward(self, input_ids, position, k_cache, v_cache):
        x = self.embed(input_ids)
        ropes = {kind: (torch.index_select(getattr(self, f"cos_{kind}"), 0, position),
                        torch.index_select(getattr(self, f"sin_{kind}"), 0, position)) for kind in set(self.layer_types)}
        # Slots before `position` are earlier tokens; the rest are empty. The token always sees itself.
        mask = torch.where(self.slots < position, 0.0, MASKED).to(x.dtype)
        mask = torch.cat([mask, torch.zeros(1, dtype=x.dtype)])
        group = self.n_head // self.n_kv
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, 1, self.n_head, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(1, 1, self.n_kv, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(1, 1, self.n_kv, self.head_dim).transpose(1, 2)
            if self.gemma:
                q, k = attn.q_norm(q), attn.k_norm(k)
            cos, sin = ropes[self.layer_types[i]]
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            keys = torch.cat([k_cache[i : i + 1], k], dim=2).repeat_interleave(group, dim=1)
            values = torch.cat([v_cache[i : i + 1], v], dim=2).repeat_interleave(group, dim=1)
            scores = q @ keys.transpose(-1, -2) * self.scaling[i] + mask
            out = torch.softmax(scores, dim=-1) @ values
            h = attn.o_proj(out.transpose(1, 2).reshape(1, 1, self.n_head * self.head_dim))
            if self.gemma:
                x = x + layer.post_attention_layernorm(h)
                x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            else:
                x = x + h
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            new_k.append(k[0])
            new_v.append(v[0])
        return self.lm_head(self.norm(x)), torch.stack(new_k), torch.stack(new_v)


def load_step(model_dir: Path, max_seq_len: int) -> tuple[DecodeStep, object]:
    """The fp32 decode-step wrapper of the model in `model_dir`, and the loaded HF model's config."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", **NO_HUB_KERNELS
    ).eval()
    if model.config.model_type not in SUPPORTED_MODEL_TYPES:
        raise TunesmithError(
            f"Core ML export supports the Llama family and Gemma 3 ({', '.join(SUPPORTED_MODEL_TYPES)}); this model is "
            f"'{model.config.model_type}'"
        )
    window = getattr(model.config, "sliding_window", None) if model.config.model_type == "gemma3_text" else None
    if window and max_seq_len > window:
        raise TunesmithError(f"--max-seq-len {max_seq_len} exceeds the model's sliding window {window}; lower it")
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "attn_logit_softcapping", None):
        raise TunesmithError("Core ML export does not write logit soft-capping (this model's config sets it)")
    if max_seq_len < 2 or max_seq_len > model.config.max_position_embeddings:
        raise TunesmithError(
            f"--max-seq-len must be between 2 and the model's context ({model.config.max_position_embeddings}); "
            f"got {max_seq_len}"
        )
    return DecodeStep(model, max_seq_len).eval(), model.config


def export(model_dir: Path, output: Path, quant: str, group_size: int | None, max_seq_len: int) -> Path:
    """Convert `model_dir` into a static-shape .mlpackage; returns its path.

    `output` is the .mlpackage, or a folder that receives model.mlpackage plus the tokenizer files and a
    tunesmith-export.json describing the inputs and outputs. The spec is validated before returning.
    """
    precision, compression = check_quant(quant, group_size)
    try:
        import coremltools as ct
    except ImportError:
        raise missing_extra("coremltools", "coreml", "--format coreml") from None
    import numpy as np

    model_dir, output = Path(model_dir), Path(output)
    package = output if output.suffix == ".mlpackage" else output / "model.mlpackage"
    if package.exists() and not (package / "Manifest.json").is_file():
        raise TunesmithError(f"{package} exists and is not an .mlpackage; choose another --output")
    if (
        package.parent == output
        and output.is_dir()
        and any(output.iterdir())
        and not (output / MARKER).is_file()
    ):
        raise TunesmithError(
            f"{output} exists and is not a tunesmith export folder; choose an empty --output"
        )
    step, config = load_step(model_dir, max_seq_len)
    with torch.no_grad():
        traced = torch.jit.trace(step, step.example_inputs())
    float_type = np.float32 if precision == "fp32" else np.float16
    mlmodel = ct.convert(
        traced,
        inputs=[
            ct.TensorType(name="input_ids", shape=(1, 1), dtype=np.int32),
            ct.TensorType(name="position", shape=(1,), dtype=np.int32),
            ct.TensorType(name="k_cache", shape=step.cache_shape(), dtype=float_type),
            ct.TensorType(name="v_cache", shape=step.cache_shape(), dtype=float_type),
        ],
        outputs=[ct.TensorType(name=n, dtype=float_type) for n in OUTPUTS],
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT32 if precision == "fp32" else ct.precision.FLOAT16,
        skip_model_load=True,  # loading compiles with Core ML, which exists only on macOS
    )
    if compression:
        mlmodel = _compress(mlmodel, compression, group_size)
    meta = {
        "format": "coreml",
        "quant": quant,
        "group_size": group_size if compression == "int4" else None,
        "max_seq_len": max_seq_len,
        "layers": len(step.layers),
        "kv_heads": step.n_kv,
        "head_dim": step.head_dim,
        "vocab_size": config.vocab_size,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "inputs": list(INPUTS),
        "outputs": list(OUTPUTS),
        "usage": "one token per call; write k_new/v_new into slot `position` of k_cache/v_cache before the next call",
        "source": str(model_dir),
    }
    mlmodel.short_description = "tunesmith decode step: one token in, logits and its KV out (static KV cache)"
    shown = {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items() if k != "source"}
    mlmodel.user_defined_metadata.update(shown)
    _save(mlmodel, package)
    validate(package, step, quant)
    if package.parent == output:
        _copy_tokenizer(model_dir, output)
        (output / MARKER).write_text(json.dumps(meta, indent=2))
    return package


def _compress(mlmodel, compression: str, group_size: int | None):
    from coremltools.optimize.coreml import (
        OpLinearQuantizerConfig,
        OptimizationConfig,
        linear_quantize_weights,
    )

    if compression == "int8":
        op = OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel")
    else:
        op = OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=group_size
        )
    return linear_quantize_weights(mlmodel, config=OptimizationConfig(global_config=op))


def _save(mlmodel, package: Path) -> None:
    package.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=package.stem + ".", dir=package.parent)) / package.name
    try:
        mlmodel.save(str(tmp))
        if package.exists():
            shutil.rmtree(package)
        os.replace(tmp, package)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def _copy_tokenizer(model_dir: Path, output: Path) -> None:
    for pattern in ("tokenizer*", "special_tokens_map.json", "chat_template.jinja", "generation_config.json"):
        for f in model_dir.glob(pattern):
            shutil.copy(f, output / f.name)


def validate(package: Path, step: DecodeStep, quant: str) -> dict:
    """Check the saved spec against the wrapper it came from: an iOS 18 ML Program with the expected input and
    output names, shapes and dtypes, and (for int8/int4) the constexpr ops that dequantize the weights.

    Returns {"inputs": {name: shape}, "outputs": {name: shape}, "ops": {op type: count}, "spec_version": n}; a
    mismatch is a RuntimeError (a bug in the wrapper or the converter, not a user error).
    """
    import coremltools as ct

    precision, compression = QUANTS[quant]
    spec = ct.utils.load_spec(str(package))
    dtype = "FLOAT32" if precision == "fp32" else "FLOAT16"
    cache, vocab = step.cache_shape(), step.lm_head.out_features
    new = (*cache[:2], 1, cache[3])
    want_in = {
        "input_ids": ((1, 1), "INT32"),
        "position": ((1,), "INT32"),
        "k_cache": (cache, dtype),
        "v_cache": (cache, dtype),
    }
    want_out = {"logits": ((1, 1, vocab), dtype), "k_new": (new, dtype), "v_new": (new, dtype)}

    def described(features) -> dict:
        arrays = {f.name: f.type.multiArrayType for f in features}
        return {name: (tuple(a.shape), a.ArrayDataType.Name(a.dataType)) for name, a in arrays.items()}

    ops: dict[str, int] = {}
    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            for op in block.operations:
                ops[op.type] = ops.get(op.type, 0) + 1
    problems = []
    if spec.WhichOneof("Type") != "mlProgram":
        problems.append(f"model type {spec.WhichOneof('Type')}, expected mlProgram")
    if spec.specificationVersion < 9:
        problems.append(f"spec version {spec.specificationVersion} < 9 (iOS 18)")
    if (got := described(spec.description.input)) != want_in:
        problems.append(f"inputs {got}, expected {want_in}")
    if (got := described(spec.description.output)) != want_out:
        problems.append(f"outputs {got}, expected {want_out}")
    if compression and not any(k.startswith("constexpr_") for k in ops):
        problems.append(f"{compression} compression left no constexpr dequantization ops")
    if problems:
        raise RuntimeError(f"{package}: invalid Core ML spec: {'; '.join(problems)}")
    return {
        "inputs": {k: v[0] for k, v in want_in.items()},
        "outputs": {k: v[0] for k, v in want_out.items()},
        "ops": ops,
        "spec_version": spec.specificationVersion,
    }
