"""HF folder -> ExecuTorch program (.pte) lowered to XNNPACK, with the tokenizer and a small JSON beside it.

The program has one method, forward(tokens [1, T], input_pos [T]) -> logits [1, T, vocab], for T from 1 to
max_seq_len: prefill passes the prompt at positions 0..T-1, decode passes one token at its position. The KV cache
lives in the program as mutable buffers (zero at load), so a caller only keeps track of the position.

Weights: fp32; 8w (int8 per output channel); 8da4w (int4 in groups of --group-size, lm_head int8). XNNPACK
computes quantized linears with int8 dynamically quantized activations, so 8w runs as 8da8w; the embedding table of
a quantized program is int8 per row. For 8da4w, export a `tunesmith quantize --scheme int4` folder: its GPTQ
weights are kept as they are (from a float folder they are rounded to nearest, which costs more perplexity). An
affine int4 layer (quantformat.GroupOffsetLinear) runs as XNNPACK's symmetric int4 kernel plus its group offsets as two
small float products, all inside the delegate; its int8 (--keep-8bit) layers run as 8da8w.
Weight-only int4 with float activations (4w) has no XNNPACK kernel in ExecuTorch 1.5: the module refuses it and
names the alternatives.

Supported: decoder-only models whose layers are Llama-shaped (model_type llama, mistral, qwen2: SmolLM, SmolLM2,
Llama 2/3, TinyLlama, Mistral, Qwen2/2.5), and Gemma 3 text models (gemma3_text) with --max-seq-len within their
sliding window.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from tunesmith.errors import TunesmithError, missing_extra
from tunesmith.generate import stop_token_ids
from tunesmith.models import NO_HUB_KERNELS

QUANTS = ("fp32", "8w", "8da4w")
REFUSED = {
    "4w": "weight-only int4 with float activations has no XNNPACK kernel in ExecuTorch; use --quant 8da4w "
    "(int4 weights, int8 dynamic activations) for a CPU .pte, or --format coreml --quant int4 for Apple devices",
}
ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3_text")
META_SUFFIX = ".json"  # model.pte -> model.json beside it
META_FORMAT = "tunesmith-pte-v1"


def check_quant(quant: str, group_size: int) -> None:
    if quant in REFUSED:
        raise TunesmithError(f"--quant {quant}: {REFUSED[quant]}")
    if quant not in QUANTS:
        raise TunesmithError(f"--quant {quant!r} is not a .pte weight format; choose one of {', '.join(QUANTS)}")
    if quant == "8da4w" and (group_size < 2 or group_size % 2):
        raise TunesmithError(f"--group-size must be an even number of weights (32 is usual), got {group_size}")


def import_executorch():
    """Check that the ship extra is installed (torch.export lowering needs executorch and torchao)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        import executorch.exir  # noqa: F401
        import torchao  # noqa: F401
    except ImportError as e:
        raise missing_extra(e.name.split(".")[0] if e.name else "executorch", "ship", "--format pte") from None


def pte_paths(output: Path) -> tuple[Path, Path]:
    """(the .pte, its JSON): `output` is the .pte file, or a folder that receives model.pte."""
    pte = output if output.suffix == ".pte" else output / "model.pte"
    return pte, pte.with_suffix(META_SUFFIX)


class StaticCacheLM(torch.nn.Module):
    """forward(tokens [1, T], input_pos [T]) -> logits [1, T, vocab] with the KV cache held as buffers.

    The HF model's own modules do the work (embedding, projections, MLPs, rotary table, lm_head); attention and
    RMSNorm are written out here in ops XNNPACK runs whole: the mean square as a matmul with a 1/d vector,
    rotate_half as a matmul with a fixed +-1 matrix, grouped-query attention by stacking the query heads of each
    key/value head. Every op XNNPACK cannot run (here only the cache writes and the mask lookup) splits the graph,
    and each split costs lowering time and per-token dispatch.
    """

    def __init__(self, model: torch.nn.Module, max_seq_len: int):
        super().__init__()
        c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.model = model
        self.n_heads = c.num_attention_heads
        self.n_kv = getattr(c, "num_key_value_heads", None) or self.n_heads
        self.n_rep = self.n_heads // self.n_kv
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.n_heads
        self.n_layers = c.num_hidden_layers
        # Gemma 3: norms scale by 1 + w, q/k are normed per head, attention and MLP outputs are normed before the
        # residual add, and sliding-window layers use their own rope (within max_seq_len <= window they attend to
        # every earlier token, as global layers do).
        self.gemma = c.model_type == "gemma3_text"
        self.layer_types = list(getattr(c, "layer_types", None) or ["full_attention"] * self.n_layers)
        self.register_buffer("inv_head", torch.full((1, self.head_dim), 1.0 / self.head_dim), persistent=False)
        for i in range(self.n_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(self.n_kv, max_seq_len, self.head_dim), persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(self.n_kv, max_seq_len, self.head_dim), persistent=False)
        # Row p: 0 where a query at position p may look (keys 0..p), -inf elsewhere.
        mask = torch.full((max_seq_len, max_seq_len), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)
        self.register_buffer("inv_hidden", torch.full((1, c.hidden_size), 1.0 / c.hidden_size), persistent=False)
        half = self.head_dim // 2
        rot = torch.zeros(self.head_dim, self.head_dim)  # x @ rot.T == cat(-x[half:], x[:half]), HF's rotate_half
        rot[torch.arange(half), torch.arange(half) + half] = -1.0
        rot[torch.arange(half) + half, torch.arange(half)] = 1.0
        self.register_buffer("rotate_half", rot, persistent=False)

    def _norm(self, norm: torch.nn.Module, x: torch.Tensor, inv: torch.Tensor | None = None) -> torch.Tensor:
        inv = self.inv_hidden if inv is None else inv
        if self.gemma:
            return (1.0 + norm.weight) * (x * torch.rsqrt(F.linear(x * x, inv) + norm.eps))
        return norm.weight * (x * torch.rsqrt(F.linear(x * x, inv) + norm.variance_epsilon))

    @staticmethod
    def _gemma_mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Gemma's gated MLP with GELU's tanh form spelled out: lowered as one gelu op, XNNPACK computed another
        GELU (3.7e-2 off in the 270M model's logits); these elementwise ops keep the program on the model's."""
        g = mlp.gate_proj(x)
        gelu = 0.5 * g * (1.0 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
        return mlp.down_proj(gelu * mlp.up_proj(x))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + F.linear(x, self.rotate_half) * sin

    def _attention(self, attn, x, i: int, cos, sin, input_pos, mask) -> torch.Tensor:
        # Shapes carry -1 for the token dimension: XNNPACK takes a reshape with one inferred size, not a symbolic one.
        q = attn.q_proj(x).view(-1, self.n_heads, self.head_dim)  # [T, heads, head_dim]
        k = attn.k_proj(x).view(-1, self.n_kv, self.head_dim)
        if self.gemma:
            q, k = self._norm(attn.q_norm, q, self.inv_head), self._norm(attn.k_norm, k, self.inv_head)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        v = attn.v_proj(x).view(-1, self.n_kv, self.head_dim)
        k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")  # [kv heads, S, head_dim]
        k_cache.index_copy_(1, input_pos, k.transpose(0, 1))
        v_cache.index_copy_(1, input_pos, v.transpose(0, 1))
        # Query head h reads key/value head h // n_rep: stack each group's n_rep heads as the rows of one matmul.
        q = q.view(-1, self.n_kv, self.n_rep, self.head_dim).permute(1, 2, 0, 3).reshape(self.n_kv, -1, self.head_dim)
        scores = torch.bmm(q, k_cache.transpose(1, 2)) * attn.scaling + mask
        out = torch.bmm(torch.softmax(scores, dim=-1), v_cache).view(self.n_kv, self.n_rep, -1, self.head_dim)
        return attn.o_proj(out.permute(2, 0, 1, 3).reshape(1, -1, self.n_heads * self.head_dim))

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        base = self.model.model
        x = base.embed_tokens(tokens)  # Gemma's embedding module scales by sqrt(hidden) itself
        ropes = {}
        for kind in set(self.layer_types):
            cos, sin = base.rotary_emb(x, input_pos.unsqueeze(0), kind) if self.gemma else \
                base.rotary_emb(x, input_pos.unsqueeze(0))
            ropes[kind] = cos.view(-1, 1, self.head_dim), sin.view(-1, 1, self.head_dim)  # [T, 1, head_dim]
        mask = self.mask[input_pos]
        if self.n_rep > 1:
            mask = mask.repeat(self.n_rep, 1)
        for i, layer in enumerate(base.layers):
            cos, sin = ropes[self.layer_types[i]]
            h = self._attention(layer.self_attn, self._norm(layer.input_layernorm, x), i, cos, sin, input_pos, mask)
            if self.gemma:
                x = x + self._norm(layer.post_attention_layernorm, h)
                x = x + self._norm(layer.post_feedforward_layernorm, self._gemma_mlp(layer.mlp, self._norm(
                    layer.pre_feedforward_layernorm, x)))
            else:
                x = x + h
                x = x + layer.mlp(self._norm(layer.post_attention_layernorm, x))
        return self.model.lm_head(self._norm(base.norm, x))

    def reset(self) -> None:
        for i in range(self.n_layers):
            getattr(self, f"k_cache_{i}").zero_()
            getattr(self, f"v_cache_{i}").zero_()


def check_architecture(config, max_seq_len: int) -> None:
    kind = getattr(config, "model_type", "?")
    if kind not in ARCHITECTURES:
        raise TunesmithError(
            f"--format pte supports Llama-shaped models ({', '.join(ARCHITECTURES)}), not model_type {kind!r}; "
            "try --format gguf"
        )
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        raise TunesmithError("--format pte does not write logit soft-capping (this model's config sets it)")
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", window is not None) and window and max_seq_len > window:
        raise TunesmithError(f"--max-seq-len {max_seq_len} exceeds the model's sliding window {window}; lower it")
    limit = getattr(config, "max_position_embeddings", None)
    if limit and max_seq_len > limit:
        raise TunesmithError(f"--max-seq-len {max_seq_len} exceeds the model's context ({limit} tokens); lower it")


def load_wrapper(model_dir: Path, max_seq_len: int, quant: str = "fp32", group_size: int = 32):
    """(StaticCacheLM, tokenizer, where the weights come from) for a plain HF folder (fp32 weights), or for a
    `tunesmith quantize` int4 folder, whose weights (GPTQ) an 8da4w program keeps as they are."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tunesmith.quantformat import is_quantized, load_quantized_model, read_info

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise TunesmithError(f"{model_dir} is not a model folder: it has no config.json")
    check_architecture(AutoConfig.from_pretrained(model_dir), max_seq_len)
    if is_quantized(model_dir):
        info = read_info(model_dir)
        if (quant, info.get("scheme"), info.get("group_size")) != ("8da4w", "int4", group_size):
            held = f"{info.get('scheme')}" + (f" g{info['group_size']}" if info.get("group_size") else "")
            raise TunesmithError(
                f"{model_dir} holds {held} weights from `tunesmith quantize`; a .pte keeps int4 weights as 8da4w: "
                f"pass --quant 8da4w --group-size {info.get('group_size') or 32} (for an int4 folder), or export "
                f"the float model for --quant {quant}"
            )
        model = load_quantized_model(model_dir)
        source = f"tunesmith quantize: {info.get('method')}"
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **NO_HUB_KERNELS)
        model = model.eval().requires_grad_(False)
        source = "float weights" + ("" if quant == "fp32" else ", quantized here (round to nearest)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # padding_idx only shapes training gradients, and with it set the int8 gather is not recognised when lowering.
    model.get_input_embeddings().padding_idx = None
    return StaticCacheLM(model, max_seq_len).eval(), tokenizer, source


def quantize_for_xnnpack(wrapper: StaticCacheLM, quant: str, group_size: int) -> int:
    """Quantize the weights the way XNNPACK runs them (int8 dynamic activations); returns linear layers quantized.

    8w: every linear int8 per channel. 8da4w: the layers' linears int4 in groups and lm_head int8 per channel, as
    `tunesmith quantize --scheme int4` makes them (weights already quantized there are kept). Both: the embedding
    table int8 per row, which lowers to quantized_decomposed::embedding_byte (a gather of the rows it needs).
    """
    if quant == "fp32":
        return 0
    from torchao.quantization import (
        Int8DynamicActivationIntxWeightConfig,
        IntxUnpackedToInt8Tensor,
        IntxWeightOnlyConfig,
        quantize_,
    )
    from torchao.quantization.granularity import PerAxis

    from tunesmith.quantize import quantize_model, untie_lm_head

    model = wrapper.model
    already = isinstance(model.get_output_embeddings().weight, IntxUnpackedToInt8Tensor)
    if quant == "8w":
        untie_lm_head(model)
        quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
                  filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))
        quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
                  filter_fn=lambda m, _: isinstance(m, torch.nn.Embedding))
    elif not already:
        quantize_model(model, "int4", group_size)
    done = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Linear) and isinstance(w, IntxUnpackedToInt8Tensor):
            m.weight = torch.nn.Parameter(IntxUnpackedToInt8Tensor(
                w.qdata, w.scale, w.zero_point, w.target_dtype, w.block_size, w.dtype, "int8_asym_per_token"
            ), requires_grad=False)
            done += 1
    return done


def lower(wrapper: StaticCacheLM, max_seq_len: int) -> bytes:
    """torch.export (dynamic T) -> edge -> XNNPACK -> the serialized program."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    seq = torch.export.Dim("seq", min=1, max=max_seq_len)
    example = (torch.zeros(1, 2, dtype=torch.long), torch.arange(2))
    with torch.no_grad(), warnings.catch_warnings():
        program = torch.export.export(wrapper, example, dynamic_shapes=({1: seq}, {0: seq}), strict=False)
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        # Serialize the caches' zeros: attention reads every slot (masked), and 0 * garbage could be NaN. The
        # emitter warns about mutated buffers whether or not this pass ran.
        warnings.filterwarnings("ignore", message="Mutation on a buffer in the model is detected")
        et = edge.to_executorch(ExecutorchBackendConfig(
            extract_delegate_segments=True,
            do_quant_fusion_and_const_prop=True,
            passes=[InitializedMutableBufferPass(["k_cache", "v_cache"])],
        ))
    return et.buffer


def export(model_dir: Path, output: Path, quant: str, group_size: int, max_seq_len: int) -> Path:
    """Write <output>.pte, its JSON and the tokenizer files beside it; returns the .pte path."""
    check_quant(quant, group_size)
    import_executorch()
    pte, meta_path = pte_paths(Path(output))
    started = time.perf_counter()
    wrapper, tokenizer, source = load_wrapper(Path(model_dir), max_seq_len, quant, group_size)
    layers = quantize_for_xnnpack(wrapper, quant, group_size)
    buffer = lower(wrapper, max_seq_len)
    pte.parent.mkdir(parents=True, exist_ok=True)
    tmp = pte.with_name(pte.name + ".partial")
    tmp.write_bytes(buffer)
    os.replace(tmp, pte)
    tokenizer.save_pretrained(pte.parent)
    config = wrapper.model.config
    meta = {
        "format": META_FORMAT,
        "pte": pte.name,
        "method": "forward",
        "signature": "forward(tokens int64 [1, T], input_pos int64 [T]) -> logits float32 [1, T, vocab], 1 <= T <= max_seq_len",
        "quant": quant,
        "group_size": group_size if quant == "8da4w" else None,
        "quantized_linear_layers": layers,
        "weights": source,
        "max_seq_len": max_seq_len,
        "vocab_size": config.vocab_size,
        "eos_token_ids": sorted(stop_token_ids(tokenizer, wrapper.model)),
        "bos_token_id": tokenizer.bos_token_id,
        "model_type": config.model_type,
        "backend": "xnnpack",
        "seconds": round(time.perf_counter() - started, 1),
    }
    meta_path.write_text(json.dumps(meta, indent=2))
    return pte

