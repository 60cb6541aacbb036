"""The fit planner: predict a training run's peak memory, part by part, from the model's config alone.

Nothing here loads weights. The model is built on the meta device from its config, which gives the exact
parameter count and the shape of every linear layer (so LoRA targets resolve as PEFT resolves them); the
activation model counts the tensors autograd saves in a Llama-style decoder layer (Llama, Mistral, Qwen2,
SmolLM) as transformers + PEFT run it in tunesmith's loop: LoRA, DoRA, LoRA on a quantized base (QLoRA) and
full fine-tuning, of every layer or the last few. docs/MEMORY.md derives each term and compares the prediction
with measured peaks.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tunesmith.errors import TunesmithError

GIB = 2**30
HEADROOM = 0.90  # plan to use at most this share of the available memory (allocator slack, other processes)
AUTO_MAX_BATCH = 64  # --batch-size auto never goes beyond this
# State bytes per trainable parameter. AdamW: fp32 m and v. adamw8bit (torchao's AdamW8bit): int8 m and v with an
# fp32 scale per block of 256 values each, for tensors of at least 4096 values in whole blocks (smaller ones keep
# fp32 state: `optimizer_state_bytes`).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw8bit": 2 + 8 / 256, "sgd": 0}
ADAMW8BIT_BLOCK, ADAMW8BIT_MIN_NUMEL, ADAMW8BIT_QMAP = 256, 4096, 256
FINE_TUNE_TYPES = ("lora", "dora", "full")
QUANT_SCHEMES = ("nf4", "int4", "int8", "fp8")  # --quantize-base: tunesmith.qlora's layouts
NF4_BLOCK, NF4_SCALER_BLOCK, INT4_GROUP = 64, 256, 64
# A quantized linear is dequantized to the compute dtype for each product, one layer at a time, in the forward
# and again in the backward pass: this many copies of the largest one are counted as alive at the peak. A first
# guess (the dequantized weight and one temporary), to be calibrated against measured peaks.
DEQUANT_COPIES = 2
INFER_LINEAR_BYTES = {"bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 32}  # int4: an fp16 scale and zero per 32
LOGITS_BYTES_PER_VOCAB = 12  # fp32: log-softmax output, its incoming gradient and its result, at once
# On the CPU `train` measures the whole process's peak RSS, so the plan counts what the process holds besides
# tensors, and what glibc's allocator holds besides live tensors. Both measured, glibc's default allocator
# (docs/MEMORY.md, "CPU: the whole process").
CPU_RUNTIME_BYTES = 692 * 2**20  # python, torch, transformers, peft, accelerate, the built-in data
# The tokenizer, held by the `tokenizers` library: about this much per vocabulary entry (measured: SmolLM2's 49k
# entries 0.04 GiB, Gemma 3's 262k 0.31 GiB; docs/MEMORY.md, "CPU: the whole process").
CPU_TOKENIZER_BYTES_PER_VOCAB = 1280
# Freed blocks glibc's heaps keep at the peak, at least (the mean of the measured runs, without and with
# checkpointing). Without checkpointing they grow with the micro-batch: each decoder layer's forward temporaries
# (below) are freed between the tensors autograd keeps, and the heap holds them all when the forward ends
# (measured: malloc_trim there gave back 1.17 GiB at micro-batch 8; docs/MEMORY.md, "CPU: the whole process").
CPU_HEAP_SLACK_BYTES = {False: 256 * 2**20, True: 370 * 2**20}
# --gradient-checkpointing offload: decoder-layer inputs on the device at once (tunesmith.kernels.offload)
OFFLOADED_INPUTS = 2
# An int8 base adds to it: every product dequantizes a weight into fresh memory, forward and backward, and those
# blocks (a few MiB each) come from glibc's heaps, which keep them. Measured on SmolLM2-135M (docs/MEMORY.md,
# "Training modes on the CPU"). Measured with fp32 copies; a bf16 run's copies are half the size. A 4-bit base
# (nf4, int4) adds none measurable since its load gives freed copies back (qlora.TRIM_EVERY): with checkpointing an
# int4 base's run kept what the same LoRA run kept, and nf4's runs were planned within -17%..+7% without
# it. A calibrated base (--base-calibration) is quantized from a model loaded whole, not by that load: it keeps the
# slack (SmolLM2-135M, nf4, all-linear r8, fp32, micro-batch 4, 128 blocks: 4.88 GiB measured). An fp8 base on the
# CPU was not measured again: it keeps the slack.
CPU_DEQUANT_SLACK_BYTES = {False: 512 * 2**20, True: 200 * 2**20}
CPU_UNTRIMMED_SCHEMES = ("int8", "fp8")

# Shapes of well-known models, so `fit` can answer offline (hub configs of gated models need a login).
KNOWN_CONFIGS: dict[str, dict] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192),
    "meta-llama/Llama-3.2-1B": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072),
    "meta-llama/Llama-3.2-3B": dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072),
    "meta-llama/Llama-3.1-8B": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072),
}


def read_model_config(spec: str, trust_remote_code: bool = False):
    """The model's config (a transformers PretrainedConfig), read without loading its weights.

    The spec resolves as every verb resolves it (models.resolve_model: a built-in alias or a .gguf is converted
    once into the cached folder that training then loads). A hub id whose config.json is already cached is read
    offline, with no call to the hub; the known shapes above need nothing at all.
    """
    from transformers import AutoConfig, LlamaConfig

    from tunesmith.models import resolve_model

    if spec in KNOWN_CONFIGS:
        return LlamaConfig(**KNOWN_CONFIGS[spec])
    source = resolve_model(spec)
    try:
        if isinstance(source, str):
            try:
                return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, local_files_only=True)
            except OSError:
                pass  # not cached: ask the hub
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise TunesmithError(
            f"could not read the config of '{spec}' ({str(e).splitlines()[0]}). Offline, pass a local folder, a .gguf "
            f"file, a built-in alias or one of: {', '.join(KNOWN_CONFIGS)}"
        ) from None


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model: sizes from its config, parameters and linears from meta."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # every parameter once (tied embeddings count once)
    buffer_bytes: int  # fp32 buffers (rotary inv_freq)
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)  # full module name -> (in, out)
    head_name: str = "lm_head"
    tied: bool = False  # output head shares the embedding matrix
    parameters: dict[str, int] = field(default_factory=dict)  # parameter name -> numel (tied ones once)
    lean: bool = False  # a Llama-family model with a SiLU MLP: --recompute's eager functions apply (kernels.recompute)
    # (width, rows per token) of every RMSNorm in a decoder layer: Llama's two over the hidden size; Gemma 3's four,
    # and q_norm / k_norm over each head. Empty: Llama's.
    norms: tuple[tuple[int, int], ...] = ()
    saved_bytes: int = 0  # bytes per parameter as the checkpoint stores them (its config's dtype; 0: not known)

    @classmethod
    def from_config(cls, config) -> ModelShape:
        from transformers import AutoModelForCausalLM

        from tunesmith.kernels.liger import MODEL_TYPES as LIGER_MODEL_TYPES

        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        linears = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        head = model.get_output_embeddings()
        head_name = next((n for n, m in model.named_modules() if m is head), "lm_head")
        heads = text.num_attention_heads
        return cls(
            hidden=text.hidden_size,
            intermediate=text.intermediate_size,
            layers=text.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            vocab=text.vocab_size,
            params=sum(p.numel() for p in model.parameters()),
            buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
            linears=linears,
            head_name=head_name,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            lean=getattr(config, "model_type", None) in LIGER_MODEL_TYPES and getattr(text, "hidden_act", "silu") == "silu",
            parameters={n: p.numel() for n, p in model.named_parameters()},
            norms=_layer_norms(model, heads, getattr(text, "num_key_value_heads", None) or heads),
            saved_bytes=_dtype_bytes(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)),
        )

    def norm_bytes(self) -> int:
        """Per token, what a layer's RMSNorms keep: each its input in fp32 and the 1/rms of each row."""
        return sum(4 * w + 4 * rows for w, rows in self.norms or ((self.hidden, 1), (self.hidden, 1)))

    def targeted(self, targets: list[str]) -> dict[str, tuple[int, int]]:
        """The linears LoRA adapts, matched as PEFT matches target_modules (name or dotted suffix)."""
        if list(targets) == ["all-linear"]:
            return {n: s for n, s in self.linears.items() if n != self.head_name}
        hits = {n: s for n, s in self.linears.items() if any(n == t or n.endswith("." + t) for t in targets)}
        if not hits:
            names = sorted({n.rsplit(".", 1)[-1] for n in self.linears})
            raise TunesmithError(f"--lora-targets {','.join(targets)} match no linear layer; here: {', '.join(names)}")
        return hits


def _layer_norms(model, heads: int, kv_heads: int) -> tuple[tuple[int, int], ...]:
    """(width, rows per token) of the norms in the first decoder layer (meta model): q_norm and k_norm normalise
    each head of q and k (Gemma 3, Qwen3), the others the hidden state."""
    per_head = {"q_norm": heads, "k_norm": kv_heads}
    norms = []
    for name, m in model.named_modules():
        weight = getattr(m, "weight", None)
        if _layer_of(name + ".") == 0 and type(m).__name__.endswith("RMSNorm") and weight is not None:
            rows = per_head.get(name.rpartition(".")[2], 1)
            norms.append((weight.numel() * rows, rows))
    return tuple(norms)


def _dtype_bytes(dtype) -> int:
    names = {"float32": 4, "float16": 2, "bfloat16": 2}
    return names.get(str(dtype).removeprefix("torch."), 0) if dtype is not None else 0


@dataclass(frozen=True)
class TrainSetup:
    """The knobs that move training memory."""

    seq_len: int = 256
    batch_size: int = 4
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    lora_dropout: float = 0.05
    precision: str = "fp32"  # fp32 | bf16 | fp16 (bf16/fp16: weights in that dtype, autocast compute)
    optimizer: str = "adamw"  # adamw | adamw8bit (| sgd: no state)
    gradient_checkpointing: bool | str = False  # True, or "offload": the layer inputs wait in host memory (CUDA)
    fused_sdpa: bool = True  # False: attention scores (B x heads x S x S) are materialised
    fused_loss: bool = False  # True: cross-entropy in row chunks (tunesmith.kernels.loss), no [B x S x vocab] logits
    device_type: str = "cuda"  # cuda's dropout keeps a 1-byte mask; the CPU and MPS keep fp32 noise
    fine_tune_type: str = "lora"  # lora | dora | full (the weights themselves, held in fp32 under autocast)
    quantize_base: str = "none"  # none | nf4 | int4 | int8 | fp8: the frozen base's decoder linears (lora, dora)
    num_layers: int = 0  # adapt (full: train) only the last N decoder layers; 0, -1 or >= the layers: all
    world: int = 1  # processes (GPUs) training together; the plan is per process
    strategy: str = "ddp"  # ddp (every GPU the whole model) | fsdp (FSDP2: weights, gradients, moments sharded)
    recompute: bool = False  # --recompute: norms and the gated MLP keep their inputs only (where the model allows)
    base_calibration: int = 0  # --base-calibration: blocks GPTQ calibrates the quantized base on, before training
    nf4_kernels: bool = False  # the nf4 base's products through tunesmith.kernels.nf4 (CUDA, Triton, fast paths)
    liger_loss: bool = False  # the fused loss through Liger's kernels (CUDA, liger-kernel installed; not FSDP2)
    compiled: bool = False  # the decoder layers compiled by Inductor (kernels.base.Setting.compiled)

    @property
    def full(self) -> bool:
        return self.fine_tune_type == "full"

    @property
    def offloaded(self) -> bool:
        """--gradient-checkpointing offload where it moves the layer inputs off the device: one process (not
        FSDP2, not DDP: tunesmith.kernels.offload) on a CUDA GPU."""
        return self.gradient_checkpointing == "offload" and self.device_type == "cuda" and self.world == 1


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")  # as tunesmith.lora finds a decoder layer's index
_ATTN_IN = ("q_proj", "k_proj", "v_proj")
# Projections that read the same tensor: with fp32 and no dropout their LoRA branches keep that one tensor.
_SHARED_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "gate_proj": "mlp_in", "up_proj": "mlp_in"}


def trained_layers(shape: ModelShape, num_layers: int) -> range:
    """The decoder layers a run adapts (full: trains): the last `num_layers`, or all of them for 0, -1 or more than
    there are (as tunesmith.lora.last_layers reads --num-layers)."""
    n = shape.layers if num_layers <= 0 or num_layers >= shape.layers else num_layers
    return range(shape.layers - n, shape.layers)


def _layer_of(name: str) -> int | None:
    hit = _LAYER.search(name)
    return int(hit.group(1)) if hit else None


def _every_layer(shape: ModelShape, s: TrainSetup) -> bool:
    return len(trained_layers(shape, s.num_layers)) == shape.layers


def adapted_linears(shape: ModelShape, s: TrainSetup) -> dict[str, tuple[int, int]]:
    """The linears that carry LoRA (DoRA) branches: the targets, in the trained layers only."""
    hits = shape.targeted(list(s.lora_targets))
    if _every_layer(shape, s):
        return hits
    layers = trained_layers(shape, s.num_layers)
    return {n: io for n, io in hits.items() if _layer_of(n) in layers}


def _input_needs_grad(shape: ModelShape, s: TrainSetup, name: str) -> bool:
    """Whether an adapted linear's input needs a gradient. The first adapted layer's q/k/v read the normed output
    of a layer that trains nothing below (or of the frozen embedding), unless checkpointing, whose
    enable_input_require_grads makes every layer's input require it."""
    first = trained_layers(shape, s.num_layers).start
    return s.gradient_checkpointing or not (_layer_of(name) == first and name.rpartition(".")[2] in _ATTN_IN)


def trainable_tensors(shape: ModelShape, s: TrainSetup) -> list[int]:
    """The numel of every trainable tensor: LoRA's A and B (DoRA: and the magnitude vector) per adapted linear, or
    with full fine-tuning the model's own parameters (of the trained layers only, when not all of them train)."""
    if s.full:
        if _every_layer(shape, s):
            return list(shape.parameters.values())
        layers = trained_layers(shape, s.num_layers)
        return [n for name, n in shape.parameters.items() if _layer_of(name) in layers]
    tensors = []
    for i, o in adapted_linears(shape, s).values():
        tensors += [s.lora_rank * i, o * s.lora_rank] + ([o] if s.fine_tune_type == "dora" else [])
    return tensors


def optimizer_state_bytes(tensors: list[int], optimizer: str) -> int:
    """Optimizer state for these trainable tensors (their numel). torchao's AdamW8bit quantizes a tensor's m and v
    only when it has at least 4096 values in whole blocks of 256: uint8 codes, an fp32 scale per block and a
    256-entry fp32 code map, each for m and for v; smaller tensors keep fp32 m and v."""
    if optimizer != "adamw8bit":
        return int(sum(tensors) * OPTIMIZER_STATE_BYTES[optimizer])
    total = 0
    for n in tensors:
        if n >= ADAMW8BIT_MIN_NUMEL and n % ADAMW8BIT_BLOCK == 0:
            total += 2 * (n + n // ADAMW8BIT_BLOCK * 4 + ADAMW8BIT_QMAP * 4)
        else:
            total += 8 * n
    return total


def quantized_bytes(numel: int, out_features: int, scheme: str, weight_bytes: int = 2) -> int:
    """Bytes of one linear's weight held as tunesmith.qlora holds it (`weight_bytes`: the dtype it was quantized
    from, which torchao's nf4 keeps its per-256-scalers factors, lookup table and mean in)."""
    if scheme == "nf4":  # to_nf4(w, 64, scaler block): 4-bit codes, an int8 scaler per block of 64, double-quantized
        blocks = numel // NF4_BLOCK
        factors = blocks // math.gcd(NF4_SCALER_BLOCK, blocks)
        return numel // 2 + blocks + (factors + 16 + 1) * weight_bytes
    if scheme == "int4":  # symmetric, codes packed two per byte, an fp16 scale per group of 64 inputs
        return numel // 2 + numel // INT4_GROUP * 2
    if scheme == "int8":  # symmetric per output row: int8 codes and an fp16 scale per row
        return numel + out_features * 2
    if scheme == "fp8":  # e4m3 codes per output row and, transposed, per input column: an fp32 scale for each
        return 2 * numel + 4 * (out_features + numel // out_features)
    raise TunesmithError(f"--quantize-base must be one of none, {', '.join(QUANT_SCHEMES)}, got {scheme!r}")


def quantized_linears(shape: ModelShape, scheme: str) -> dict[str, tuple[int, int]]:
    """The linears a quantized base holds quantized: every one but the output head, in whole blocks / groups."""
    whole = {"nf4": lambda i, o: i * o % NF4_BLOCK == 0, "int4": lambda i, o: i % INT4_GROUP == 0,
             "int8": lambda i, o: True, "fp8": lambda i, o: i % 16 == 0 and o % 16 == 0}[scheme]
    return {n: (i, o) for n, (i, o) in shape.linears.items() if n != shape.head_name and whole(i, o)}


def weight_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """The model's own weights: in the weight dtype, quantized linears aside. Full fine-tuning loads the whole
    model in fp32 (tunesmith.train: fp32 master weights, the frozen layers too), whatever the precision."""
    w = 4 if s.precision == "fp32" or s.full else 2
    total = shape.params * w + shape.buffer_bytes
    if s.quantize_base != "none":
        for i, o in quantized_linears(shape, s.quantize_base).values():
            total += quantized_bytes(i * o, o, s.quantize_base, w) - i * o * w
    return total


def layer_activation_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """Bytes autograd keeps per token for one decoder layer, LoRA branches aside (no checkpointing).

    Frozen linears keep nothing (their weight grad is never needed); what stays is what RMSNorm, rotary
    attention and the gated MLP need to pass gradients down to the LoRA weights of earlier layers.
    """
    a = 4 if s.precision == "fp32" else 2  # activation bytes: autocast runs matmuls in bf16/fp16
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if _lean(shape, s):  # --recompute's functions: each norm keeps its input as the residual stream holds it (the
        residual = 4 if s.precision == "fp32" or s.full else 2  # weights' dtype; fp32 masters for full) and 1/rms
        total = 2 * (residual * shape.hidden + 4)
    else:
        total = shape.norm_bytes()  # each RMSNorm keeps its input in fp32 and the 1/rms per token (per head)
    total += (q + 2 * kv + q) * a + shape.heads * 4  # attention keeps q, k, v (un-repeated: GQA), output, logsumexp
    # gated MLP keeps gate (for SiLU), SiLU(gate) and up (for the product); --recompute: gate and up only
    total += (2 if _lean(shape, s) else 3) * shape.intermediate * a
    return total


def _compiled_qlora(s: TrainSetup) -> bool:
    """Whether the layers keep what a compiled layer over an nf4 base keeps (`compiled_layer_bytes`): LoRA over an
    nf4 base on CUDA, compiled, without checkpointing (the setup measured; elsewhere the eager bound stands)."""
    return (s.compiled and s.quantize_base == "nf4" and s.fine_tune_type == "lora" and s.device_type == "cuda"
            and not s.gradient_checkpointing)


def compiled_layer_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """Bytes a decoder layer compiled by Inductor keeps per token, its LoRA branches included, over an nf4 base.

    Inductor's partitioner keeps what only a product or attention makes and recomputes the rest in backward: q, k,
    v and attention's output and logsumexp, the MLP's gate and up, and the residual stream, from which the norms,
    the rotary embedding, SiLU and every LoRA input are computed again (dropout draws its mask again from its seed);
    LoRA's own products keep their rank-sized outputs. Counted: the residual stream twice (the layer's input and
    its mid point), what backward cannot do without. Measured on CUDA for a layer of the Llama-3.1-8B shape in bf16
    (LoRA q_proj, v_proj r8, dropout 0.05 or 0): 86.1 KB per token, one hidden-size tensor under this count (94.3),
    where the eager layer keeps 119.1 (docs/MEMORY.md). How many hidden-size tensors the partitioner keeps moves
    with the shape (one to two beyond this count on compiled bf16 layers), so the plan keeps this bound."""
    a = 4 if s.precision == "fp32" else 2
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = (q + 2 * kv + q) * a + shape.heads * 4
    lora = len(adapted_linears(shape, s)) // max(1, len(trained_layers(shape, s.num_layers))) * s.lora_rank * a
    return attention + 2 * shape.intermediate * a + 2 * shape.hidden * a + lora


def fused_loss_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """The fused loss's chunk at its largest, beside the supervised rows' hidden states and their gradient (which
    the loss computes in the forward pass and keeps). The plain chunks: one chunk's fp32 logits (softmax and
    gradient in the same memory) and, under autocast, their half copy. Liger's (a frozen output layer): one chunk's
    logits in the compute dtype, turned into their own gradient in place, and every row's fp32 loss."""
    from tunesmith.kernels.liger_loss import liger_chunk_rows
    from tunesmith.kernels.loss import chunk_rows

    a = 4 if s.precision == "fp32" else 2
    n = s.batch_size * (s.seq_len - 1)
    if s.liger_loss and not (s.full and s.num_layers <= 0):
        return liger_chunk_rows(n, shape.hidden, shape.vocab) * shape.vocab * a + 4 * n
    return min(n, chunk_rows(s.device_type, shape.vocab)) * shape.vocab * (4 if s.precision == "fp32" else 6)


def _lean(shape: ModelShape, s: TrainSetup) -> bool:
    """Whether train applies --recompute's eager functions (kernels.recompute; not under FSDP2, whose layers it
    leaves as they are)."""
    return s.recompute and shape.lean and not (s.strategy == "fsdp" and s.world > 1)


def full_layer_extra_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """What a layer whose own weights train keeps per token on top of `layer_activation_bytes`: what the weight
    gradients need. Each RMSNorm's normalised input (for its weight; fp32, as the whole model is); the input of
    every linear: in fp32 q/k/v read one tensor and gate/up another, under autocast each keeps its own half copy
    of the fp32 normed output; o_proj reads the fused attention's output, which attention keeps already;
    down_proj the SwiGLU product."""
    a = 4 if s.precision == "fp32" else 2
    h = shape.hidden
    inputs = 2 * 4 * h if s.precision == "fp32" else 5 * 2 * h
    o_proj = 0 if s.fused_sdpa else shape.heads * shape.head_dim * a  # the math kernel's output is copied first
    norms = 0 if _lean(shape, s) else 2 * 4 * h  # --recompute's norm recomputes its normalised input for its weight
    return norms + inputs + o_proj + shape.intermediate * a


def tail_activation_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """Per token, outside the decoder layers: the final norm's fp32 input and 1/rms; when every layer of a full
    fine-tuning trains, also its normed input (its weight trains), the head's input and the embedding's token ids."""
    lean = _lean(shape, s)  # --recompute: the final norm keeps its input as the residual stream holds it
    total = (4 if s.precision == "fp32" or s.full or not lean else 2) * shape.hidden + 4
    if s.full and _every_layer(shape, s):
        total += (0 if lean else 4 * shape.hidden) + (4 if s.precision == "fp32" else 2) * shape.hidden + 8
    return total


def lora_activation_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """Bytes per token that all LoRA branches keep: lora_A's input, lora_A's output and the dropout mask.

    PEFT casts a branch's input to the adapter's fp32 before dropout; under autocast lora_A then reads a
    half-precision copy. Dropout keeps its mask only where its input needs a gradient (not for the first adapted
    layer's q/k/v, which read the frozen embedding or frozen layers, unless checkpointing makes it require grad):
    a 1-byte mask from CUDA's fused kernel, an fp32 noise tensor on the CPU and MPS. DoRA keeps two outputs more
    per branch: the base result (scaled by the magnitude) and the LoRA result (its scale's gradient needs both).
    """
    if s.full:
        return 0
    a = 4 if s.precision == "fp32" else 2
    dropout = s.lora_dropout > 0
    mask = 1 if s.device_type == "cuda" else 4
    total, seen = 0, set()
    for name, (d, out) in adapted_linears(shape, s).items():
        parent, _, kind = name.rpartition(".")
        total += mask * d if dropout and _input_needs_grad(shape, s, name) else 0
        total += 2 * out * a if s.fine_tune_type == "dora" else 0
        if s.precision != "fp32":
            total += 2 * d + 2 * s.lora_rank  # each branch's own half-precision copy for lora_A
            continue
        if dropout:
            total += 4 * d  # the dropout output, lora_A's input
        elif kind == "o_proj" and s.fused_sdpa:
            pass  # o_proj reads the fused attention's output, which attention keeps already
        else:
            key = (parent.rpartition(".")[0], _SHARED_INPUT.get(kind, name))
            if key not in seen:  # the very tensor the projection reads, kept once per distinct input
                seen.add(key)
                total += 4 * d
        total += 4 * s.lora_rank
    return total


def dora_fixed_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """What DoRA keeps per adapted linear whatever the tokens: the weight norm, magnitude / norm and that minus one
    (fp32, out_features each); and, with dropout, a copy of the base weight: PEFT then recomputes the base output
    from the dropped-out input with the weight cast to the input's fp32, and the product keeps that weight for
    the input's gradient: under autocast its half-precision cast, on a quantized fp32 base the dequantized copy
    (an fp32 base weight is the parameter itself)."""
    if s.fine_tune_type != "dora":
        return 0
    copy = 2 if s.precision != "fp32" else 4 if s.quantize_base != "none" else 0
    total = 0
    for name, (i, o) in adapted_linears(shape, s).items():
        total += 3 * o * 4
        if s.lora_dropout > 0 and _input_needs_grad(shape, s, name):
            total += copy * i * o
    return total


def dora_norm_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """The transient of PEFT's DoRA forward, for the adapted linear where it is largest: the update B A is built by
    running an in x in identity through the branch, and the column norm of W + scale B A takes W (in fp32),
    B A, scale B A and their sum, fp32 each. In fp32 the identity stays (lora_A keeps it for its gradient) while
    the norm runs; under autocast lora_A keeps a half copy instead, and the fp32 identity, that copy and B A's
    half output peak together earlier."""
    if s.fine_tune_type != "dora":
        return 0
    worst = 0
    for i, o in adapted_linears(shape, s).values():
        if s.precision == "fp32":
            n = 4 * i * i + (3 if s.quantize_base == "none" else 4) * 4 * i * o
        else:
            n = max(6 * i * i + 2 * i * o, 2 * i * i + 4 * 4 * i * o)
        worst = max(worst, n)
    return worst


def weight_copy_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """Full fine-tuning under autocast: the half-precision copy of each trained linear's fp32 weight, cast once and
    cached for the step (autocast caches casts of weights that require grad; backward runs inside it), and of the
    output head, which a frozen head keeps as well: its product saves the cast weight for the input's gradient."""
    layers = trained_layers(shape, s.num_layers)
    every = _every_layer(shape, s)
    return 2 * sum(i * o for n, (i, o) in shape.linears.items() if every or n == shape.head_name or _layer_of(n) in layers)


def lora_parameters(shape: ModelShape, targets: list[str], rank: int) -> int:
    return sum(rank * (i + o) for i, o in shape.targeted(targets).values())


def _check_setup(s: TrainSetup) -> None:
    if s.optimizer not in OPTIMIZER_STATE_BYTES:
        raise TunesmithError(f"unknown optimizer {s.optimizer!r}; use {', '.join(OPTIMIZER_STATE_BYTES)}")
    if s.fine_tune_type not in FINE_TUNE_TYPES:
        raise TunesmithError(f"--fine-tune-type must be one of {', '.join(FINE_TUNE_TYPES)}, got {s.fine_tune_type!r}")
    if s.quantize_base not in ("none", *QUANT_SCHEMES):
        raise TunesmithError(f"--quantize-base must be one of none, {', '.join(QUANT_SCHEMES)}, got {s.quantize_base!r}")
    if s.full and s.quantize_base != "none":
        raise TunesmithError("--quantize-base is for lora and dora; full fine-tuning trains the weights themselves: "
                             "drop --quantize-base, or use --fine-tune-type lora")


def train_parts(shape: ModelShape, s: TrainSetup) -> dict[str, int]:
    """Predicted peak memory of one training step, by part (bytes)."""
    _check_setup(s)
    a = 4 if s.precision == "fp32" else 2
    residual = 4 if s.full else a  # the decoder's hidden states: the model's weight dtype
    tokens = s.batch_size * s.seq_len
    kept = len(trained_layers(shape, s.num_layers))  # layers below the trained ones keep nothing: no grad flows there
    tensors = trainable_tensors(shape, s)
    trainable = sum(tensors)
    lora = lora_activation_bytes(shape, s)
    layer = layer_activation_bytes(shape, s) + (full_layer_extra_bytes(shape, s) if s.full else 0)
    if _compiled_qlora(s):
        layer, lora = compiled_layer_bytes(shape, s), 0
    fixed = dora_fixed_bytes(shape, s)
    # Without a fused kernel each layer keeps its softmax probabilities (B x heads x S x S), and the layer being
    # computed holds one more such tensor for a moment.
    scores = 0 if s.fused_sdpa else s.batch_size * shape.heads * s.seq_len**2 * a
    logits = LOGITS_BYTES_PER_VOCAB * shape.vocab * s.batch_size * (s.seq_len - 1)
    if s.fused_loss:
        logits = fused_loss_bytes(shape, s) + 2 * s.batch_size * s.seq_len * shape.hidden * a
        if s.full and s.num_layers <= 0:  # the head trains: its fp32 gradient, built in the forward pass and kept,
            logits += 2 * shape.vocab * shape.hidden * 4  # then scaled into a second one as backward starts
    if s.gradient_checkpointing:
        # Each layer keeps only its input (every layer: the trainer makes the embedding's output require grad).
        # Backward recomputes one layer at a time, after the logits' gradient is gone, so that layer counts only
        # where it outweighs the logits peak.
        # Offloaded, two inputs at most are on the device at once: the one being copied out while the next layer
        # computes (its memory held until the copy has read it) or, backward, the one in use and the next one
        # being copied back. While its backward runs, that layer also holds its MLP's gate and up gradients.
        one = (layer + lora // kept) * tokens + 2 * scores + fixed // kept + 2 * shape.intermediate * a * tokens
        inputs = min(OFFLOADED_INPUTS, shape.layers) if s.offloaded else shape.layers
        activations = inputs * shape.hidden * residual * tokens + max(0, one - logits)
    else:
        # The lowest trained layer's first norm keeps nothing for its input, which needs no gradient (the frozen
        # embedding's output); a full fine-tuning of every layer trains the embedding, so there it does.
        # --recompute's norm keeps its input (as the residual stream holds it) only for a gradient, and under full
        # fine-tuning its weight trains and needs it.
        if (s.full and (kept == shape.layers or _lean(shape, s))) or _compiled_qlora(s):
            first = 0
        elif _lean(shape, s):
            first = (4 if s.precision == "fp32" else 2) * shape.hidden + 4
        else:
            first = 4 * shape.hidden + 4
        per_token = kept * layer - first + lora
        activations = per_token * tokens + (kept + 1) * scores + fixed
    activations += tail_activation_bytes(shape, s) * tokens
    parts = {"weights": weight_bytes(shape, s)}
    if not s.full:  # fp32 LoRA weights (and DoRA magnitudes) + autocast's cached half copy of A and B
        ab = sum(s.lora_rank * (i + o) for i, o in adapted_linears(shape, s).values())
        parts["adapter"] = trainable * 4 + (0 if s.precision == "fp32" else 2 * ab)
    elif s.precision != "fp32":
        parts["weight_copies"] = weight_copy_bytes(shape, s)
    parts |= {
        "gradients": trainable * 4,
        "optimizer": optimizer_state_bytes(tensors, s.optimizer),
        "activations": activations,
        "logits": logits,
    }
    if s.quantize_base != "none":  # one layer's weight dequantized at a time, alive while it multiplies
        biggest = max((i * o for i, o in quantized_linears(shape, s.quantize_base).values()), default=0)
        # the nf4 kernels decode in registers, or into one weight-sized buffer cuBLAS multiplies (the faster wins)
        copies = 1 if s.nf4_kernels and s.quantize_base == "nf4" else DEQUANT_COPIES
        parts["dequant"] = copies * a * biggest
    if s.fine_tune_type == "dora":
        parts["dora_norm"] = dora_norm_bytes(shape, s)
    if s.world > 1:
        parts |= distributed_parts(shape, s, parts, trainable)
    if s.device_type == "cpu":  # measured there: the whole process's peak RSS, not an allocator's live bytes
        parts |= cpu_parts(shape, s, parts)
    if s.base_calibration and s.quantize_base != "none":
        if s.device_type == "cpu":
            # The process's resident set: glibc keeps what calibration used (the full-precision model it freed, the
            # blocks' activations) in its heaps, and training's peak comes on top (measured: bench/bench_modes.py)
            parts["calibration"] = calibration_bytes(shape, s)
        else:  # an accelerator's allocator reuses the freed blocks: the peak is whichever phase is larger
            parts["calibration"] = max(0, calibration_bytes(shape, s) - sum(parts.values()))
    return parts


def cpu_parts(shape: ModelShape, s: TrainSetup, parts: dict[str, int]) -> dict[str, int]:
    """What the CPU's peak resident set adds: the runtime and tokenizer, glibc's heap slack, and the peak of loading
    when it is higher than training's. A checkpoint stored in another dtype than the weights' is read through its
    mapped file while the converted copy is made: for that moment the file's pages are resident beside the
    weights (Gemma 3 270M's fp32 file, 1 GiB, loaded in bf16)."""
    slack = CPU_HEAP_SLACK_BYTES[bool(s.gradient_checkpointing)]
    if s.quantize_base in CPU_UNTRIMMED_SCHEMES or (s.quantize_base != "none" and s.base_calibration):
        copy = 4 if s.precision == "fp32" else 2  # bytes of a dequantized weight: the slack is measured in fp32
        slack += CPU_DEQUANT_SLACK_BYTES[bool(s.gradient_checkpointing)] * copy // 4
    # the forward's temporaries fill the same freed blocks: whichever is larger (measured: an int8 base at
    # micro-batch 4 kept no more than the constants, 2.74 and 2.56 GiB)
    out = {"runtime": CPU_RUNTIME_BYTES + CPU_TOKENIZER_BYTES_PER_VOCAB * shape.vocab,
           "allocator": max(slack, forward_temporary_bytes(shape, s))}
    w = 4 if s.precision == "fp32" or s.full else 2
    if shape.saved_bytes and shape.saved_bytes != w and s.quantize_base == "none":
        loading = out["runtime"] + parts["weights"] + shape.params * shape.saved_bytes
        out["loading"] = max(0, loading - sum(parts.values()) - sum(out.values()))
    return out


def forward_temporary_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """What glibc's heaps hold at the end of a CPU forward without checkpointing: every trained layer's freed
    temporaries, which the blocks autograd keeps pin in place (the heap grows by them layer after layer instead of
    reusing them). Per token, a layer frees its gated MLP's product (and SiLU(gate), which --recompute drops and
    recomputes) and about three hidden-size tensors (the norm's output, attention's q and k before rotary, its
    output before o_proj); a DoRA linear two of its outputs more (PEFT's base output recomputed on the dropped-out
    input, and the scaled LoRA output). Fitted on the real SmolLM2-135M in fp32 (micro-batch 1 to 32, q,v r8 and
    all-linear r16; docs/MEMORY.md); 0 with checkpointing, whose forward keeps only the layers' inputs."""
    if s.gradient_checkpointing:
        return 0
    a = 4 if s.precision == "fp32" else 2
    tokens = s.batch_size * s.seq_len
    per_token = ((2 if _lean(shape, s) else 1) * shape.intermediate + 3 * shape.hidden) * a
    dora = 2 * sum(o for _, o in adapted_linears(shape, s).values()) * a if s.fine_tune_type == "dora" else 0
    return (per_token * len(trained_layers(shape, s.num_layers)) + dora) * tokens


def calibration_bytes(shape: ModelShape, s: TrainSetup) -> int:
    """The peak of --base-calibration (tunesmith.qlora.calibrate_base): the model at full precision in the weight
    dtype (its linears become quantized one layer at a time, but the first layer's Hessians are taken with all
    of them present), one decoder layer's Hessians (fp32, in x in for each linear), and each calibration block's
    inputs and outputs of the layer being calibrated."""
    w = 4 if s.precision == "fp32" else 2
    first = {n: io for n, io in quantized_linears(shape, s.quantize_base).items() if _layer_of(n) == 0}
    hessians = sum(4 * i * i for i, _ in first.values())
    blocks = 2 * s.base_calibration * s.seq_len * shape.hidden * w
    return shape.params * w + shape.buffer_bytes + hessians + blocks


def infer_parts(shape: ModelShape, bits: str, context: int) -> dict[str, int]:
    """Inference memory with weight-only quantization of the linears; embeddings and norms stay bf16 (so does a
    head tied to the embedding). KV cache in bf16 for `context` tokens, batch 1."""
    linear = sum(i * o for n, (i, o) in shape.linears.items() if not (shape.tied and n == shape.head_name))
    return {
        "weights": int(linear * INFER_LINEAR_BYTES[bits] + (shape.params - linear) * 2),
        "kv_cache": 2 * shape.layers * shape.kv_heads * shape.head_dim * context * 2,
        "logits": shape.vocab * 4,
    }


@dataclass
class FitPlan:
    """A prediction, the device's memory, and what to do about it."""

    parts: dict[str, int]
    total_bytes: int
    available_bytes: int
    setup: TrainSetup
    best_batch: int  # largest power-of-two micro-batch that fits (0: not even 1)
    checkpointing_helps: bool  # gradient checkpointing would let a larger batch (or any batch) fit
    inference: dict[str, dict[str, int]] = field(default_factory=dict)
    shape: ModelShape | None = None  # the model planned for (`mode_table` plans its other modes)

    @property
    def peak_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def budget_bytes(self) -> int:
        return int(self.available_bytes * HEADROOM)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    def to_json(self) -> dict:
        return {"predicted_peak_bytes": self.peak_bytes, "parts": dict(self.parts),
                "device_total_bytes": self.total_bytes, "device_available_bytes": self.available_bytes,
                "micro_batch": self.setup.batch_size, "fits": self.fits, "best_batch": self.best_batch}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")


def largest_batch(shape: ModelShape, s: TrainSetup, budget: int, cap: int = AUTO_MAX_BATCH) -> int:
    """The largest power-of-two micro-batch <= cap whose predicted peak is within `budget` (0 if none)."""
    from dataclasses import replace

    best, b = 0, 1
    while b <= cap and sum(train_parts(shape, replace(s, batch_size=b)).values()) <= budget:
        best, b = b, b * 2
    return best


def plan(shape: ModelShape, s: TrainSetup, total: int, available: int) -> FitPlan:
    from dataclasses import replace

    budget = int(available * HEADROOM)
    best = largest_batch(shape, s, budget)
    ckpt_best = best if s.gradient_checkpointing else largest_batch(shape, replace(s, gradient_checkpointing=True), budget)
    inference = {bits: infer_parts(shape, bits, s.seq_len) for bits in ("bf16", "int8", "int4")}
    return FitPlan(train_parts(shape, s), total, available, s, best, ckpt_best > best, inference, shape)


# The ways to train that `fit` compares: what each sets on the requested setup (the rest: rank, targets, dropout,
# precision, --num-layers, seq_len and, for the adapters, the optimizer, stay as asked).
MODES: dict[str, dict[str, str]] = {
    "lora": {"fine_tune_type": "lora", "quantize_base": "none"},
    "dora": {"fine_tune_type": "dora", "quantize_base": "none"},
    **{f"qlora {q}": {"fine_tune_type": "lora", "quantize_base": q} for q in QUANT_SCHEMES},
    **{f"full ({o})": {"fine_tune_type": "full", "quantize_base": "none", "optimizer": o} for o in ("adamw", "adamw8bit")},
}


@dataclass(frozen=True)
class ModeFit:
    """One way to train, with or without gradient checkpointing: the largest micro-batch that fits and its peak."""

    mode: str
    gradient_checkpointing: bool
    best_batch: int  # largest power-of-two micro-batch within the budget (0: not even 1)
    peak_bytes: int  # predicted peak at best_batch, or at micro-batch 1 when nothing fits


def mode_table(shape: ModelShape, s: TrainSetup, budget: int) -> list[ModeFit]:
    """Every mode in MODES, without and then with gradient checkpointing, planned against `budget` bytes."""
    from dataclasses import replace

    rows = []
    for mode, knobs in MODES.items():
        if s.world > 1 and s.strategy == "fsdp" and knobs.get("quantize_base", "none") != "none":
            continue  # a quantized base is not sharded (train refuses it under FSDP2)
        for ckpt in (False, True):
            m = replace(s, **knobs, gradient_checkpointing=ckpt, batch_size=1)
            best = largest_batch(shape, m, budget)
            peak = sum(train_parts(shape, replace(m, batch_size=max(1, best))).values())
            rows.append(ModeFit(mode, ckpt, best, peak))
    return rows


def verdict(p: FitPlan) -> str:
    """One or two sentences: does it fit, and what to change."""
    s = p.setup
    gib = f"{p.peak_bytes / GIB:.2f} GiB predicted, {p.budget_bytes / GIB:.2f} GiB usable " \
          f"({HEADROOM:.0%} of {p.available_bytes / GIB:.2f} GiB available)"
    if p.fits:
        text = f"fits: {gib}."
        if p.best_batch > s.batch_size:
            text += f" Micro-batch up to {p.best_batch} fits (--batch-size auto picks it)."
        return text
    text = f"does NOT fit: {gib}."
    if p.best_batch:
        text += f" Use --batch-size {p.best_batch} (and raise --grad-accum to keep the effective batch)."
    if p.checkpointing_helps and not s.gradient_checkpointing:
        text += " Turn on --gradient-checkpointing: it lets a larger micro-batch fit."
    if not p.best_batch and not p.checkpointing_helps:
        text += " Not even micro-batch 1 fits: use a smaller model, a shorter --seq-len or a machine with more memory."
    return text


def distributed_parts(shape: ModelShape, s: TrainSetup, parts: dict[str, int], trainable: int) -> dict[str, int]:
    """What changes per GPU when `s.world` processes train together.

    DDP: every GPU holds the whole model, plus the buckets that all-reduce the gradients (a second copy of them).
    FSDP2 (accelerate's plugin: one shard group per decoder layer, the embedding one, the final norm and the head
    one): weights, adapter, gradients and optimizer state are split `world` ways; a layer's weights are gathered
    whole just before it runs (the next one prefetched: two layers at once), the head's from the end of the forward
    pass. Activations are per process as on one GPU.
    """
    if s.strategy != "fsdp":
        return {"ddp_buckets": trainable * 4}
    w = 4 if s.precision == "fp32" or s.full else 2
    in_layers = sum(n for name, n in shape.parameters.items() if _layer_of(name) is not None)
    head = shape.parameters.get(f"{shape.head_name}.weight", shape.vocab * shape.hidden)  # tied: the embedding
    sharded = {k: -(-parts[k] // s.world) for k in ("weights", "adapter", "gradients", "optimizer") if k in parts}
    a = 4 if s.precision == "fp32" else 2
    layers = 2 * (in_layers // max(1, shape.layers)) * a
    # The output layer's group stays gathered from the end of the forward pass until its backward; the fused loss
    # of a frozen head gives it back before the backward pass (tunesmith.kernels.loss), when the layers' turn comes.
    frozen_head = s.fused_loss and not (s.full and s.num_layers <= 0)
    sharded["fsdp_gathered"] = max(head * w, layers) if frozen_head else head * w + layers
    return sharded


def plan_run(
    cfg, device: torch.device, precision: str, config=None, memory_gib: float = 0.0, resident_bytes: int = 0,
    world: int = 1,
) -> FitPlan:
    """Plan a run described by a TrainConfig-like `cfg` (or FitConfig) on `device`; 'auto' batch picks the largest.

    `config` is the model's config when the caller already has it (an injected model, whose weights already on
    the device are `resident_bytes`: counted as available, since the plan counts them again; on the CPU the whole
    process's resident set is, since the plan counts the process from its start); otherwise it is read from
    cfg.model. `memory_gib` > 0 plans for a machine with that much memory instead of this one.
    """
    from dataclasses import replace

    from tunesmith.device import fused_sdpa, memory_bytes

    shape = ModelShape.from_config(config if config is not None else read_model_config(cfg.model, cfg.trust_remote_code))
    if memory_gib > 0:
        total = available = int(memory_gib * GIB)
    else:
        total, available = memory_bytes(device)
        # What this process already holds is counted by the plan (the CPU's runtime part; weights on the device),
        # so it is no burden on top of the plan: give it back to the available memory.
        held = _process_rss() if device.type == "cpu" else resident_bytes
        available = min(total, available + held)
    auto = cfg.batch_size == "auto"
    setup = TrainSetup(
        seq_len=cfg.seq_len, batch_size=1 if auto else int(cfg.batch_size), lora_rank=cfg.lora_rank,
        lora_targets=tuple(cfg.lora_targets), lora_dropout=cfg.lora_dropout, precision=precision,
        optimizer=getattr(cfg, "optimizer", "adamw"), gradient_checkpointing=cfg.gradient_checkpointing,
        fused_sdpa=fused_sdpa(device, precision, shape.kv_heads < shape.heads), device_type=device.type,
        fused_loss=getattr(cfg, "fast_paths", None) == "auto",
        fine_tune_type=getattr(cfg, "fine_tune_type", "lora"), quantize_base=getattr(cfg, "quantize_base", "none"),
        num_layers=int(getattr(cfg, "num_layers", 0)), world=max(1, world),
        strategy=getattr(cfg, "strategy", "ddp"), recompute=bool(getattr(cfg, "recompute", True)) and getattr(cfg, "fast_paths", "auto") == "auto",
        base_calibration=int(getattr(cfg, "base_calibration", 0)) if not getattr(cfg, "resume", False) else 0,
        nf4_kernels=_nf4_kernels(cfg, device),
        liger_loss=_liger_loss(cfg, device, world),
        compiled=_compiled_layers(cfg, device, world),
    )
    p = plan(shape, setup, total, available)
    if auto:
        if not p.best_batch:
            raise TunesmithError(f"--batch-size auto: {verdict(p)}")
        p = plan(shape, replace(setup, batch_size=p.best_batch), total, available)
    return p


def _nf4_kernels(cfg, device: torch.device) -> bool:
    """Whether train takes the nf4 kernels (tunesmith.kernels.nf4's path) for this run."""
    from tunesmith.kernels.base import triton_available

    return (device.type == "cuda" and getattr(cfg, "fast_paths", "auto") == "auto"
            and getattr(cfg, "quantize_base", "none") == "nf4" and triton_available())


def _compiled_layers(cfg, device: torch.device, world: int) -> bool:
    """Whether train compiles the decoder layers for this run (kernels.base.Setting.compiled)."""
    from tunesmith.kernels.base import Setting

    return Setting(cfg, device.type, world, fsdp=getattr(cfg, "strategy", "ddp") == "fsdp" and world > 1).compiled


def _liger_loss(cfg, device: torch.device, world: int) -> bool:
    """Whether train's fused loss runs through Liger's kernels (tunesmith.kernels.liger_loss) for this run."""
    from tunesmith.kernels.liger_loss import liger_available

    fsdp = getattr(cfg, "strategy", "ddp") == "fsdp" and world > 1
    return device.type == "cuda" and getattr(cfg, "fast_paths", "auto") == "auto" and not fsdp and liger_available()


def _process_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def print_plan(p: FitPlan, device_line: str, console=None) -> None:
    """The `fit` verb's output: a table of parts, the verdict, and inference memory at bf16 / int8 / int4."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    s = p.setup
    console.print(f"[bold]device[/] {device_line}")
    console.print(f"[bold]training peak[/] at seq {s.seq_len} x micro-batch {s.batch_size}, {describe(s)}, "
                  f"{s.precision}, {s.optimizer}{checkpointing_words(s)}")
    table = Table()
    table.add_column("part")
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    for name, b in p.parts.items():
        table.add_row(name, f"{b / GIB:.3f}", f"{b / max(1, p.peak_bytes):.0%}")
    table.add_row("[bold]peak[/]", f"[bold]{p.peak_bytes / GIB:.3f}[/]", "")
    console.print(table)
    console.print(verdict(p))
    inf = ", ".join(f"{bits} {sum(parts.values()) / GIB:.2f} GiB" for bits, parts in p.inference.items())
    console.print(f"inference (weights + KV cache for {s.seq_len} tokens): {inf}")


def checkpointing_words(s: TrainSetup) -> str:
    if not s.gradient_checkpointing:
        return ""
    return ", gradient checkpointing" + (" (layer inputs in pinned host memory)" if s.offloaded else "")


def describe(s: TrainSetup) -> str:
    """The way a setup trains, in words: 'QLoRA r8 on q_proj,v_proj (nf4 base), last 4 layers'."""
    if s.full:
        what = "full fine-tuning"
    else:
        kind = "DoRA" if s.fine_tune_type == "dora" else "QLoRA" if s.quantize_base != "none" else "LoRA"
        base = f" ({s.quantize_base} base)" if s.quantize_base != "none" else ""
        what = f"{kind} r{s.lora_rank} on {','.join(s.lora_targets)}{base}"
    return what + (f", last {s.num_layers} layers" if s.num_layers > 0 else "")


def print_modes(rows: list[ModeFit], s: TrainSetup, budget: int, console=None) -> None:
    """The `fit` verb's second table: each way to train, its largest micro-batch and peak, without and with
    gradient checkpointing."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    lora = f"r{s.lora_rank} on {','.join(s.lora_targets)}" + (f", last {s.num_layers} layers" if s.num_layers > 0 else "")
    console.print(f"[bold]ways to train[/] at seq {s.seq_len}, {s.precision} ({lora}): the largest power-of-two "
                  f"micro-batch within {budget / GIB:.2f} GiB, and its peak (at micro-batch 1 where none fits)")
    table = Table()
    for name, justify in (("mode", "left"), ("batch", "right"), ("GiB", "right"), ("ckpt batch", "right"),
                          ("ckpt GiB", "right")):
        table.add_column(name, justify=justify)
    cells: dict[str, list[str]] = {}
    for r in rows:
        cells.setdefault(r.mode, []).extend([str(r.best_batch) if r.best_batch else "does not fit",
                                             f"{r.peak_bytes / GIB:.2f}"])
    for mode, row in cells.items():
        table.add_row(mode, *row)
    console.print(table)


def fit_from_config(cfg, console=None) -> FitPlan:
    """The `fit` verb: predict a run's peak memory from the model's config and compare it with the device."""
    from tunesmith.device import capabilities, resolve_device, resolve_precision

    device = resolve_device(cfg.device)
    precision = resolve_precision(device, cfg.precision, training=True)
    world = max(1, cfg.gpus)
    p = plan_run(cfg, device, precision, memory_gib=cfg.memory_gib, world=world)
    line = capabilities(device).summary()
    if cfg.memory_gib > 0:
        line += f" (planning for {cfg.memory_gib:g} GiB instead)"
    if world > 1:
        line += f"; {world} processes, {'FSDP2' if cfg.strategy == 'fsdp' else 'DDP'}: every figure is per GPU"
    print_plan(p, line, console)
    print_modes(mode_table(p.shape, p.setup, p.budget_bytes), p.setup, p.budget_bytes, console)
    return p
