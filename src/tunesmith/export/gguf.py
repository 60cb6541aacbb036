"""HF folder -> one llama.cpp GGUF file (f32, f16, q8_0, q4_1, q4_0, q4_0_mixed, and the k-quants q4_k_m, q4_k_s,
q5_k_m, q6_k) with tokenizer and chat template.

Supported: the Llama family (model_type "llama": SmolLM, SmolLM2, Llama 3.0 and other models with default or
linear rope) with a byte-level BPE tokenizer ("gpt2" in GGUF terms). Tensor names come from the gguf package's own
HF -> GGUF map. With calibration token blocks, q8_0 / q4_0 / q4_0_mixed choose the decoder layers' weights by GPTQ
on llama.cpp's own block grids (gptq.Q8_0 / gptq.Q4_0) and write those codes and fp16 scales as ggml blocks; without,
every q block comes from the gguf package's reference quantizers (round to nearest), so the file is what llama.cpp's
convert_hf_to_gguf.py + llama-quantize would write for the same weights, but for the legacy 4-bit types' output
head (q8_0 here, q6_K there). The k-quant file types take llama-quantize's own per-tensor types and its reference
quantizers (kquant.py). Anything else is a TunesmithError that says what is unsupported.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tunesmith.errors import TunesmithError
from tunesmith.export import kquant

KQUANTS = ("q4_k_m", "q4_k_s", "q5_k_m", "q6_k")  # llama-quantize's file types, per-tensor types as it picks them
QUANTS = ("f32", "f16", "q8_0", "q4_1", "q4_0", "q4_0_mixed", *KQUANTS)
ALIASES = {"fp32": "f32", "fp16": "f16"}  # the export verb's precision names
BLOCK = 32  # q8_0 and q4_0 blocks are fixed at 32 weights; --group-size cannot change that
METHOD_KEY = "tunesmith.quantization"  # how the q blocks were chosen: "round to nearest" or "gptq ..."
SUPPORTED_MODEL_TYPES = {"llama": "llama", "gemma3_text": "gemma3"}  # HF model_type -> GGUF general.architecture
# q4_0_mixed: q4_0 except these (in every block) and the whole last block, kept at q8_0. On SmolLM2-135M they carry
# most of q4_0's perplexity loss (docs/EXPORT.md), the same matrices llama.cpp's Q4_K_M gives more bits.
MIXED_Q8 = ("attn_v", "ffn_down")
# The types whose decoder weights GPTQ can choose from calibration data (q4_1 is affine: rounded to nearest).
CALIBRATED = ("q8_0", "q4_0", "q4_0_mixed", *KQUANTS)  # k-quant files: their Q8_0 / Q5_0 matrices

# llama.cpp picks its pre-tokenizer regex by name; these are the byte-level BPE layouts we can recognise exactly.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def check_quant(quant: str, group_size: int | None = BLOCK) -> str:
    """The GGUF type name for `quant` (fp32 -> f32, fp16 -> f16), or an error listing the valid ones."""
    name = ALIASES.get(quant, quant.lower())
    if name not in QUANTS:
        raise TunesmithError(f"--quant {quant!r} is not a GGUF type; choose one of {', '.join(QUANTS)}")
    if name.startswith("q") and group_size not in (None, BLOCK):
        raise TunesmithError(
            f"GGUF {name} uses fixed blocks of {BLOCK} weights (256 for k-quants); drop --group-size {group_size}"
        )
    return name


def calibrated(quant: str) -> bool:
    """Whether `quant` chooses its decoder weights from calibration data (export's `calibration`)."""
    return ALIASES.get(quant, quant) in CALIBRATED


def export(
    model_dir: Path,
    output: Path,
    quant: str,
    group_size: int | None,
    max_seq_len: int,
    calibration: Sequence[Sequence[int]] | None = None,
    progress: bool = True,
    name: str | None = None,
) -> Path:
    """Write `model_dir` (a plain HF folder) as one GGUF file; returns its path.

    `output` is the .gguf file, or a folder that receives model-<quant>.gguf. `max_seq_len` is not used: the
    file records the model's own context length, and llama.cpp picks the runtime context (-c). `calibration`
    (token blocks): q8_0 / q4_0 / q4_0_mixed decoder weights by GPTQ on them; None or empty: round to nearest.
    `name` is the model's name (general.name; default: the folder's). GPTQ (minutes on a CPU) says each stage and
    shows a bar per layer, and the tensors being written a bar, on stderr unless `progress` is False.
    """
    from tunesmith.progress import status, steps

    qname = check_quant(quant, group_size)
    model_dir = Path(model_dir)
    config = model_config(model_dir)
    chosen, method = {}, "round to nearest"
    plan = kquant.tensor_types(_tensor_shapes(model_dir, config), qname) if qname in KQUANTS else None
    if calibration and qname in CALIBRATED:
        status(f"{qname}: GPTQ over {config.num_hidden_layers} decoder layers"
               + (", after rounding the k-quant matrices" if plan is not None else ""), progress)
        chosen = gptq_blocks(model_dir, config, qname, calibration, progress, plan)
        method = f"gptq (act-order, static groups, sequential), {len(calibration)} calibration blocks"
        if plan is not None:
            method += "; the k-quant matrices rounded to nearest"
    path = Path(output) if Path(output).suffix == ".gguf" else Path(output) / f"model-{qname}.gguf"
    with gguf_file(path, SUPPORTED_MODEL_TYPES[config.model_type], use_temp_file=True) as writer:  # spools to disk
        _add_hparams(writer, config, qname, name or model_dir.resolve().name)
        if qname.startswith("q"):
            writer.add_string(METHOD_KEY, method)
        _add_tokenizer(writer, model_dir, config)
        with steps(f"{path.name}: {qname} tensors", _tensor_count(model_dir, config), progress) as advance:
            for name, data, qtype in _tensors(model_dir, config, qname, chosen, plan):
                writer.add_tensor(name, data, raw_dtype=qtype)
                advance()
    return path


@contextlib.contextmanager
def gguf_file(path: Path, arch: str, **options):
    """A GGUFWriter for `path`: what the block adds is written when it ends, to a .partial file renamed into place
    (a reader never sees half a file); an error inside removes the partial file."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(tmp, arch, **options)
    try:
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    writer.close()
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ the model


def model_config(model_dir: Path):
    """The folder's transformers config, when llama.cpp's graph for it computes what transformers does; else an
    error that names the model type (or the setting) and the supported ones."""
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        raise TunesmithError(f"{model_dir} is not a model folder: it has no config.json")
    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise TunesmithError(
            f"GGUF export supports the Llama family and Gemma 3 ({', '.join(SUPPORTED_MODEL_TYPES)}); this model is "
            f"'{config.model_type}'. Export it with --format mlx, or convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    if config.model_type == "gemma3_text":
        return _gemma3_checked(config)
    problems = []
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.hidden_act} (llama.cpp's llama graph uses silu)")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("bias terms in attention or MLP")
    return _refuse_if(problems, config, "Llama")


def _gemma3_checked(config):
    """Gemma 3 as llama.cpp's gemma3 graph runs it: GELU (tanh) MLP, no biases, 1/sqrt(head_dim) attention, no
    soft-capping, five sliding-window layers (rope base 10000) then one global layer (the file's rope base)."""
    problems = []
    if getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation {config.hidden_activation} (llama.cpp's gemma3 graph uses gelu tanh)")
    if getattr(config, "attention_bias", False):
        problems.append("bias terms in attention")
    if getattr(config, "query_pre_attn_scalar", config.head_dim) != config.head_dim:
        problems.append(f"query_pre_attn_scalar {config.query_pre_attn_scalar} != head_dim {config.head_dim}")
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        problems.append("logit soft-capping")
    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    layer_types = list(getattr(config, "layer_types", None) or [])
    if layer_types != [pattern[i % 6] for i in range(config.num_hidden_layers)]:
        problems.append("a sliding/global layer pattern other than five sliding layers, then one global")
    local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention", {})
    if local and (local.get("rope_theta") != 10000.0 or local.get("rope_type", "default") != "default"):
        problems.append(f"sliding-window rope {local} (llama.cpp uses base 10000, no scaling)")
    return _refuse_if(problems, config, "Gemma 3")


def _refuse_if(problems: list[str], config, family: str):
    """The checks both architectures share (rope scaling), then one error listing every problem, or the config."""
    rope_type = _rope(config).get("rope_type", "default")
    if rope_type not in ("default", "linear"):
        problems.append(f"rope scaling '{rope_type}' (supported: default, linear)")
    if problems:
        raise TunesmithError(f"GGUF export cannot write this {family} model: {'; '.join(problems)}")
    return config


def _arch(config):
    import gguf

    return gguf.MODEL_ARCH.GEMMA3 if config.model_type == "gemma3_text" else gguf.MODEL_ARCH.LLAMA


def _rope(config) -> dict:
    """Rope settings across transformers versions: v5 `rope_parameters`, v4 `rope_theta` + `rope_scaling`.
    Per layer type (Gemma 3): the global layers' settings."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    params = dict(params.get("full_attention", params))
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_hparams(writer, config, qname: str, name: str) -> None:
    import gguf

    file_types = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
        "q4_0_mixed": gguf.LlamaFileType.MOSTLY_Q4_0,
        "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
        "q4_k_s": gguf.LlamaFileType.MOSTLY_Q4_K_S,
        "q5_k_m": gguf.LlamaFileType.MOSTLY_Q5_K_M,
        "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
    }
    head_dim = _head_dim(config)
    rope = _rope(config)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_file_type(file_types[qname])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if config.model_type == "gemma3_text":  # as convert_hf_to_gguf's Gemma3Model writes them
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_dimension_count(head_dim)
    if config.model_type == "llama" and head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF keeps each head's rotary halves apart ([x0..x63 | x64..x127]); llama.cpp interleaves them in pairs.

    The same permutation as convert_hf_to_gguf.py's LlamaModel.permute; transformers' GGUF loader undoes it.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_type(name: str, data: np.ndarray, qname: str, n_layers: int):
    import gguf

    T = gguf.GGMLQuantizationType
    if data.ndim == 1 or qname == "f32":
        return T.F32  # norms stay f32 in every llama.cpp file type
    if qname == "f16":
        return T.F16
    if qname == "q8_0" or name in ("token_embd.weight", "output.weight"):
        # The output head (the tied embedding in SmolLM2) is the most quantization-sensitive matrix; llama-quantize
        # keeps it at 6+ bits for q4 types, and q8_0 is the closest type the gguf package can write.
        return T.Q8_0
    if qname == "q4_1":
        return T.Q4_1
    if qname == "q4_0_mixed" and (name.split(".")[-2] in MIXED_Q8 or name.startswith(f"blk.{n_layers - 1}.")):
        return T.Q8_0
    return T.Q4_0


def _skipped(key: str, config) -> bool:
    """Weights a GGUF file does not hold: rotary tables (recomputed) and a tied output head (the embedding)."""
    return key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and config.tie_word_embeddings)


def _tensor_count(model_dir: Path, config) -> int:
    return len(_tensor_shapes(model_dir, config))


def _tensor_shapes(model_dir: Path, config) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, shape) of every tensor the file will hold, in file order, read from the safetensors headers."""
    import gguf
    from safetensors import safe_open

    names = gguf.TensorNameMap(_arch(config), config.num_hidden_layers)
    shapes = []
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if not _skipped(key, config):
                    name = names.get_name(key, try_suffixes=(".weight", ".bias")) or key
                    shapes.append((name, tuple(f.get_slice(key).get_shape())))
    return shapes


def _tensors(model_dir: Path, config, qname: str, chosen: dict[str, tuple] | None = None,
             plan: dict[str, str] | None = None):
    """(GGUF name, data, GGML type) for every weight, in file order, quantized where the file type says so.

    `chosen` (gptq_blocks): HF weight name -> (GGML type, codes, scales) written as they are, the rest rounded.
    `plan` (k-quant file types): GGUF name -> GGML type name, as llama-quantize picks them (kquant.tensor_types)."""
    import gguf
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TunesmithError(f"{model_dir} has no .safetensors weights")
    names = gguf.TensorNameMap(_arch(config), config.num_hidden_layers)
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if _skipped(key, config):
                    continue
                name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise TunesmithError(f"GGUF export: no llama.cpp tensor for '{key}' in {file.name}")
                heads = (
                    n_head if key.endswith("q_proj.weight") else n_kv if key.endswith("k_proj.weight") else 0
                ) if config.model_type == "llama" else 0  # llama.cpp runs Gemma's rope on HF's (NeoX) order
                if key in (chosen or {}):
                    qtype, codes, scales = chosen[key]
                    if heads:  # the scales' rows move with their weights' rows
                        codes, scales = _permute(codes, heads), _permute(scales, heads)
                    yield name, pack_blocks(codes, scales, qtype), qtype
                    continue
                data = f.get_tensor(key).float().numpy()
                if heads:
                    data = _permute(data, heads)
                if config.model_type == "gemma3_text" and name.endswith("norm.weight"):
                    data = data + 1  # Gemma's RMSNorm scales by 1 + w; llama.cpp's by w (as its converter does)
                if plan is not None:
                    qtype = gguf.GGMLQuantizationType[plan[name]]
                    if plan[name] in kquant.FALLBACK:  # the k-quants the gguf package cannot write
                        yield name, kquant.quantize(data, plan[name]), qtype
                    else:
                        yield name, gguf.quants.quantize(data, qtype), qtype
                    continue
                qtype = _tensor_type(name, data, qname, config.num_hidden_layers)
                try:
                    yield name, gguf.quants.quantize(data, qtype), qtype
                except (
                    gguf.quants.QuantError
                ):  # rows not a multiple of 32 (only in odd tiny models): keep f16
                    yield name, data.astype(np.float16), gguf.GGMLQuantizationType.F16


# ------------------------------------------------------------------------------------------------ GPTQ


def gptq_blocks(
    model_dir: Path, config, qname: str, calibration: Sequence[Sequence[int]], progress: bool = True,
    plan: dict[str, str] | None = None,
) -> dict[str, tuple]:
    """GPTQ over the decoder layers on the grid each matrix gets in a `qname` file (q4_0_mixed: Q8_0 for MIXED_Q8
    and the last block, Q4_0 for the rest; a k-quant file: its `plan`, where the Q8_0 and Q5_0 matrices get GPTQ
    and the k-quant ones stay rounded to nearest): HF weight name -> (GGML type, int8 codes, fp16 scales
    [out, in / 32]). The embedding / output head is not in the decoder layers and stays rounded to nearest.
    The layers after a rounded k-quant matrix calibrate on its rounded output, as GPTQ's sequential pass does."""
    import gguf
    import torch

    from tunesmith import gptq
    from tunesmith.models import load_model

    T = gguf.GGMLQuantizationType
    grids = {T.Q8_0: gptq.Q8_0, T.Q4_0: gptq.Q4_0, T.Q5_0: gptq.Q5_0}
    names = gguf.TensorNameMap(_arch(config), config.num_hidden_layers)

    def grid_of(module: str, linear: torch.nn.Linear):
        name = names.get_name(f"{module}.weight", try_suffixes=(".weight",))
        if plan is not None:
            qtype = T[plan[name]]
            return (grids[qtype], BLOCK) if qtype in grids else None
        if linear.in_features % BLOCK:
            return None  # written as f16, as the rounding path does
        return grids[_tensor_type(name, linear.weight, qname, config.num_hidden_layers)], BLOCK

    def rounded(module: str, linear: torch.nn.Linear) -> None:
        """A k-quant matrix, rounded as the file will hold it, so later layers calibrate on what it computes."""
        name = names.get_name(f"{module}.weight", try_suffixes=(".weight",))
        w = linear.weight.detach().float().numpy()
        back = gguf.quants.dequantize(kquant.quantize(w, plan[name]), T[plan[name]]).reshape(w.shape)
        linear.weight.data.copy_(torch.from_numpy(back))

    model, _ = load_model(str(model_dir), "cpu", torch.float32)
    if plan is not None:  # the k-quant matrices round before the pass (q/k row order is the same either way)
        for module, linear in model.named_modules():
            if isinstance(linear, torch.nn.Linear) and ".layers." in module and grid_of(module, linear) is None:
                rounded(module, linear)
    done = gptq.gptq_decoder_layers(model, calibration, grid_of, progress=progress)
    chosen = {}
    for module, (grid, group, scales, offsets) in done.items():
        deq = model.get_submodule(module).weight.detach()
        qtype = next(t for t, g in grids.items() if g is grid)
        chosen[f"{module}.weight"] = (
            qtype,
            gptq.codes(deq, scales, offsets, group).numpy(),
            scales.numpy().astype(np.float16),
        )
    return chosen


def pack_blocks(codes: np.ndarray, scales: np.ndarray, qtype) -> np.ndarray:
    """ggml Q8_0 / Q4_0 / Q5_0 blocks (uint8 [out, in / 32 * block bytes]) from int8 codes [out, in] and fp16
    scales [out, in / 32]: each block is its fp16 scale d, then Q8_0's 32 int8 codes, or Q4_0's 16 bytes, byte j
    holding codes j and j + 16 as nibbles (code + 8), or Q5_0's 4 bytes of fifth bits and 16 such bytes (code + 16).
    gguf.quants.dequantize of the result is exactly scale * code."""
    import gguf

    out, n = codes.shape
    d = scales.astype("<f2").reshape(out, n // BLOCK, 1).view(np.uint8)
    q = codes.astype(np.int8).reshape(out, n // BLOCK, BLOCK)
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        qs = q.view(np.uint8)
    elif qtype == gguf.GGMLQuantizationType.Q4_0:
        u = (q.astype(np.int16) + 8).astype(np.uint8)
        qs = u[..., : BLOCK // 2] | (u[..., BLOCK // 2 :] << 4)
    elif qtype == gguf.GGMLQuantizationType.Q5_0:  # d, then 32 high bits (bit j: code j + 16 >= 16), then nibbles
        u = (q.astype(np.int16) + 16).astype(np.uint32)
        qh = ((u >> 4) << np.arange(BLOCK, dtype=np.uint32)).sum(-1, dtype=np.uint32)[..., None].astype("<u4")
        low = (u & 0xF).astype(np.uint8)
        qs = np.concatenate([qh.view(np.uint8), low[..., : BLOCK // 2] | (low[..., BLOCK // 2 :] << 4)], axis=-1)
    else:
        raise ValueError(f"no block packing for {qtype!r}")
    return np.concatenate([d, qs], axis=-1).reshape(out, -1)


# -------------------------------------------------------------------------------------------- the tokenizer


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer (tokenizer.ggml.pre), or an error."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if (
        kinds == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits")
        and steps[1].get("use_regex", True)
    ):
        return "smollm"  # SmolLM / SmolLM2 as shipped on the hub
    if kinds == ["Split", "ByteLevel"] and steps[0].get("pattern", {}).get("Regex") == LLAMA3_SPLIT:
        return "llama-bpe"  # Llama 3
    raise TunesmithError(
        f"GGUF export: the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds)) or 'none'}) is not one that "
        "tunesmith maps to llama.cpp (GPT-2 byte-level, SmolLM, Llama 3)"
    )


def _add_tokenizer(writer, model_dir: Path, config) -> None:
    """Byte-level BPE vocab, merges, special ids, add-bos/eos and the chat template, as convert_hf_to_gguf does
    (for Gemma 3: SentencePiece's, in _add_sentencepiece)."""
    import gguf

    vocab_size = config.vocab_size
    file = model_dir / "tokenizer.json"
    if not file.is_file():
        raise TunesmithError(f"GGUF export needs the tokenizer as {file} (a fast tokenizer's tokenizer.json)")
    spec = json.loads(file.read_text(encoding="utf-8"))
    model = spec.get("model", {})
    if config.model_type == "gemma3_text":
        return _add_sentencepiece(writer, model_dir, spec, vocab_size)
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or (spec.get("decoder") or {}).get("type") != "ByteLevel"
    ):
        raise TunesmithError(
            "GGUF export supports byte-level BPE tokenizers (GPT-2 style, as in SmolLM2 and Llama 3); this one is "
            f"{model.get('type')} with a {(spec.get('decoder') or {}).get('type')} decoder"
        )
    T = gguf.TokenType
    tokens: dict[int, tuple[str, int]] = {i: (t, T.NORMAL) for t, i in model["vocab"].items()}
    for added in spec.get("added_tokens", []):
        tokens[added["id"]] = (added["content"], T.CONTROL if added.get("special") else T.USER_DEFINED)
    if max(tokens) >= vocab_size:
        raise TunesmithError(
            f"the tokenizer has token id {max(tokens)} but the model's vocab_size is {vocab_size}"
        )
    padded = [tokens.get(i, (f"[PAD{i}]", T.UNUSED)) for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec))
    writer.add_token_list([t for t, _ in padded])
    writer.add_token_types([k for _, k in padded])

    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    if not special.merges:
        raise TunesmithError(f"{file} has no BPE merges; llama.cpp cannot tokenize without them")
    _add_special(writer, special, file)


def _add_special(writer, special, file: Path) -> None:
    """Special ids, add-bos/eos and the chat template; add-bos/eos as the HF tokenizer really does, so llama.cpp
    neither drops nor doubles a BOS."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(file)).encode("a", add_special_tokens=True).ids
    for kind in ("bos", "eos"):
        tid = special.special_token_ids.get(kind)
        if kind not in special.add_special_token and tid is not None:
            special.add_special_token[kind] = bool(ids) and ids[0 if kind == "bos" else -1] == tid
    special.add_to_gguf(writer, quiet=True)


def _add_sentencepiece(writer, model_dir: Path, spec: dict, vocab_size: int) -> None:
    """Gemma's SentencePiece vocabulary as llama.cpp's "llama" (SPM) tokenizer reads it: pieces, scores, types.

    transformers keeps SentencePiece's BPE as merges, not scores; llama.cpp's SPM tokenizer merges the pair whose
    piece scores highest, and a SentencePiece BPE vocabulary is ordered by merge priority, so a normal piece's score
    is minus its id (Gemma's own GGUF: minus the id plus a constant per range, the same order). Control tokens
    score -1000 and byte pieces (<0x00>...) 0, as in Gemma's GGUF.
    """
    import gguf

    model = spec.get("model", {})
    normalizer = spec.get("normalizer") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise TunesmithError(f"GGUF export of Gemma 3 needs its SentencePiece BPE tokenizer (byte fallback); this "
                             f"one is {model.get('type')}")
    T = gguf.TokenType
    tokens: dict[int, tuple[str, float, int]] = {}
    for piece, i in model["vocab"].items():
        byte = re.fullmatch(r"<0x[0-9A-F]{2}>", piece) is not None
        tokens[i] = (piece, 0.0 if byte else -float(i), T.BYTE if byte else T.NORMAL)
    for added in spec.get("added_tokens", []):
        control = bool(added.get("special"))
        tokens[added["id"]] = (added["content"], -1000.0 if control else 0.0, T.CONTROL if control else T.USER_DEFINED)
    if max(tokens) >= vocab_size:
        raise TunesmithError(f"the tokenizer has token id {max(tokens)} but the model's vocab_size is {vocab_size}")
    padded = [tokens.get(i, (f"[PAD{i}]", -1000.0, T.UNUSED)) for i in range(vocab_size)]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _, _ in padded])
    writer.add_token_scores([s for _, s, _ in padded])
    writer.add_token_types([k for _, _, k in padded])
    prepend = normalizer.get("type") == "Sequence" and any(n.get("type") == "Prepend" for n in normalizer["normalizers"])
    writer.add_add_space_prefix(prepend)  # Gemma 3 replaces spaces by ▁ and prepends nothing
    _add_special(writer, gguf.SpecialVocab(model_dir, load_merges=False, n_vocab=vocab_size), model_dir / "tokenizer.json")


# --------------------------------------------------------------------------------------------- the adapter


ADAPTER_QUANTS = ("f32", "f16", "q8_0")  # what convert_lora_to_gguf.py writes and llama.cpp's LoRA loader takes


def check_adapter_quant(quant: str) -> str:
    """The GGUF type of a LoRA adapter's tensors for --quant, or an error listing the ones an adapter takes."""
    name = ALIASES.get(quant, quant.lower())
    if name not in ADAPTER_QUANTS:
        raise TunesmithError(f"--quant {quant} is not a type for a llama.cpp LoRA adapter; with --adapter-only choose "
                             f"one of {', '.join(ADAPTER_QUANTS)}")
    return name


def export_adapter(adapter_dir: Path, output: Path, model_dir: Path, quant: str = "f32", name: str | None = None
                   ) -> Path:
    """A PEFT LoRA adapter as a llama.cpp LoRA adapter GGUF (what convert_lora_to_gguf.py writes); returns its path.

    `model_dir` is the base model the adapter was trained on (its hyper-parameters name and permute the tensors).
    Metadata: general.type "adapter", adapter.type "lora", adapter.lora.alpha. Tensors: `<base tensor>.lora_a`
    (PEFT's A, [r, in]) and `.lora_b` (B, [out, r]) in `quant` (f32, f16 or q8_0; a q8_0 tensor whose rows are not
    a multiple of 32, such as B's [out, r], is f16, as convert_lora_to_gguf falls back), e.g.
    blk.0.attn_q.weight.lora_a; llama.cpp adds alpha / r * B A x. q_proj / k_proj B rows get the base weights'
    rotary permutation. `output` is the .gguf file, or a folder that receives adapter.gguf. `name`: general.name
    (default: the adapter folder's). Use it with `llama-cli -m base.gguf --lora adapter.gguf` (or Ollama's ADAPTER).
    """
    import gguf
    from safetensors.torch import load_file

    from tunesmith.export.mlx import check_peft_config
    from tunesmith.lora import check_adapter_folder

    qtype = gguf.GGMLQuantizationType[check_adapter_quant(quant).upper()]
    folder = check_adapter_folder(adapter_dir)
    peft = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    check_peft_config(peft, folder, "a llama.cpp LoRA adapter")
    config = model_config(Path(model_dir))
    names = gguf.TensorNameMap(_arch(config), config.num_hidden_layers)
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    rank, alpha = int(peft["r"]), float(peft["lora_alpha"])
    if peft.get("use_rslora"):
        alpha *= rank**0.5  # llama.cpp scales by alpha / r; rsLoRA meant alpha / sqrt(r)
    path = Path(output) if Path(output).suffix == ".gguf" else Path(output) / "adapter.gguf"
    with gguf_file(path, SUPPORTED_MODEL_TYPES[config.model_type]) as writer:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name(f"{name or folder.name} (LoRA)")
        writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                              "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype.name])
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        for key, tensor in sorted(load_file(folder / "adapter_model.safetensors").items()):
            m = re.match(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$", key)
            base = m and names.get_name(f"{m['module']}.weight", try_suffixes=(".weight",))
            if not base:
                raise TunesmithError(f"{folder}: '{key}' is not a LoRA weight of a llama.cpp tensor")
            data = tensor.float().numpy()
            heads = n_head if base.endswith("attn_q.weight") else n_kv if base.endswith("attn_k.weight") else 0
            heads = heads if config.model_type == "llama" else 0
            if heads and m["ab"] == "B":
                data = _permute(data, heads)
            tensor, ggml_type = _adapter_tensor(data, qtype)
            writer.add_tensor(f"{base}.lora_{m['ab'].lower()}", tensor, raw_dtype=ggml_type)
    return path


def _adapter_tensor(data: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    """(bytes, GGML type) of one LoRA matrix in `qtype`, f16 where q8_0's 32-weight rows do not fit."""
    import gguf

    T = gguf.GGMLQuantizationType
    if qtype == T.Q8_0 and data.shape[-1] % BLOCK:
        qtype = T.F16
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype), qtype
