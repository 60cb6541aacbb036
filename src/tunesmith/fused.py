"""The trainer's fast paths, each with a switch back to the plain one (evaluate.loss_sum, eager PyTorch).

- `chunked_loss_sum`: next-token cross-entropy that never holds the [batch, seq, vocab] logits. The decoder runs as
  usual up to its last hidden states; only the supervised positions go on, a few hundred rows at a time, through
  the output layer, log-softmax and its gradient, which is computed right there (as Liger's fused linear
  cross-entropy does), so the backward pass has nothing vocabulary-sized to keep. Plain PyTorch: it serves the CPU,
  MPS and CUDA alike, where the logits of a 128k vocabulary are the largest tensor of a training step.
- `apply_liger`: Liger Kernel's Triton RMSNorm, SwiGLU and RoPE on CUDA (`pip install 'tunesmith[cuda]'`).
- `compile_layers`: torch.compile of each decoder layer (regional: one compiled graph serves every layer), replayed
  as CUDA graphs where asked.
- `fuse_lora`: each PEFT LoRA linear computes base + scaling x B(A(x)) with the low-rank product accumulated into the
  base product's output (and, backward, into the input's gradient) by cuBLAS/BLAS addmm, instead of materialising
  the LoRA output, scaling it and adding it: fewer full-size tensors written and read per layer. Plain PyTorch, so
  every device.
- `fuse_qkv`: a Llama attention's q, k and v projections as one product over their joined frozen weights, with
  their LoRA down-projections as one more and the up-projections added in as one block-diagonal addmm (dropout 0).
  Plain PyTorch, so every device; in compiled layers the compiler derives its backward.
- `fuse_mlp`: a Llama MLP with LoRA on gate, up and down as one autograd function whose SwiGLU kernel makes the
  gate and up rank-r terms in registers instead of as full-size tensors (`lora_mlp`; Triton on CUDA).
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from tunesmith.data import IGNORE

CHUNK_BYTES = {"cuda": 512 << 20, "mps": 64 << 20}  # fp32 logits per chunk; the CPU and others: 32 MiB
DEFAULT_CHUNK_BYTES = 32 << 20


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside accelerate's / DDP's wrapper and PEFT's."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) or type(model).__name__ == "OptimizedModule":
            model = model.module if hasattr(model, "module") else model._orig_mod
        elif hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            return model


def supports_chunked_loss(model: torch.nn.Module) -> bool:
    """Whether the model's output layer is a plain (not LoRA-wrapped) linear with no bias, after a decoder that
    transformers lets us reach (get_decoder) and that takes `logits_to_keep`."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    return (type(head) is torch.nn.Linear and head.bias is None and decoder is not None
            and "logits_to_keep" in _forward_params(lm))


def _forward_params(module) -> set[str]:
    import inspect

    return set(inspect.signature(module.forward).parameters)


def chunked_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                     liger: bool = False) -> tuple[torch.Tensor, int]:
    """evaluate.loss_sum without the full-vocabulary logits: the same value and gradients (to rounding). `liger`:
    through Liger's kernel on CUDA (see linear_cross_entropy_sum)."""
    lm = causal_lm(model)
    head, decoder = lm.get_output_embeddings(), lm.get_decoder()
    captured: list[torch.Tensor] = []

    def keep(_module, _args, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    hook = decoder.register_forward_hook(keep)
    try:
        # logits_to_keep with no positions: the model's own output layer computes nothing. No KV cache: training
        # needs none, and a compiled layer would recompile for every layer's cache object
        model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
              position_ids=batch.get("position_ids"), use_cache=False,
              logits_to_keep=torch.zeros(0, dtype=torch.long, device=batch["input_ids"].device))
    finally:
        hook.remove()
    labels = batch["labels"][:, 1:]
    rows = batch.get("rows")
    if rows is not None:  # the supervised positions, found where the labels were made: no wait for the device
        hidden = captured[0][:, :-1].reshape(-1, captured[0].shape[-1])
        targets = labels.reshape(-1)
        if rows.numel() < targets.numel():
            hidden, targets = hidden.index_select(0, rows), targets.index_select(0, rows)
    else:
        keep_rows = labels != IGNORE
        hidden = captured[0][:, :-1][keep_rows]  # [supervised tokens, hidden]
        targets = labels[keep_rows]
    softcap = getattr(lm.config, "final_logit_softcapping", None) or 0.0
    loss = linear_cross_entropy_sum(hidden, head.weight, targets, softcap, liger=liger)
    if hasattr(head, "reshard") and not head.weight.requires_grad:
        # FSDP2 keeps the output layer's gathered weight until the backward pass is done with it; a frozen head's
        # part of the backward is already computed here, so its whole weight goes back to its shards now.
        head.reshard()
    return loss, int(targets.numel())


def supervised_rows(labels: torch.Tensor) -> torch.Tensor:
    """The flat indices of a batch's supervised next-token positions (labels[:, 1:] not ignored), for
    `chunked_loss_sum`'s batch["rows"]: computed on the host, where collate made the labels, they spare the
    device a boolean selection whose size the host must wait for."""
    return (labels[:, 1:] != IGNORE).reshape(-1).nonzero().squeeze(1)


def chunk_rows(device_type: str, vocab: int) -> int:
    """Rows of logits computed at once: as many as fit the device's chunk budget in fp32 (at least 16)."""
    return max(16, CHUNK_BYTES.get(device_type, DEFAULT_CHUNK_BYTES) // (vocab * 4))


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             softcap: float = 0.0, rows: int | None = None, liger: bool = False) -> torch.Tensor:
    """sum over rows of cross_entropy(hidden @ weight.T, targets), in row chunks; logits in float32 (as the plain
    path upcasts them), softcapped as cap * tanh(logits / cap) when `softcap` > 0.

    `liger` (CUDA tensors only): Liger Kernel's fused linear cross-entropy instead, the same computation with each
    chunk's logits kept in the compute dtype and turned into loss and gradient by one Triton kernel, in place (the
    softmax in float32 inside it): on an H200, 1.11x the tokens/s of the whole Llama-3.2-1B training step."""
    if liger and (hidden.is_cuda or LIGER_ON_CPU) and hidden.shape[0] > 0:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        if torch.is_autocast_enabled(hidden.device.type):
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        if not weight.requires_grad and _liger_kernels() is not None:
            chunk = liger_chunk_rows(hidden.shape[0], hidden.shape[1], weight.shape[0])
            return _LigerLinearCrossEntropy.apply(hidden, weight, targets, float(softcap), chunk)
        # a trained output layer (full fine-tuning) sums its gradient over the chunks in float32, as the plain path does
        return liger_fused_linear_cross_entropy(
            hidden, weight, targets, reduction="sum", softcap=softcap or None,
            accum_dtype=torch.float32 if weight.requires_grad else None,
            chunk_mem_const=liger_chunk_const(hidden.shape[0], hidden.shape[1], weight.shape[0])).float()
    if rows is None:
        rows = chunk_rows(hidden.device.type, weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, float(softcap), int(rows))


def liger_chunk_const(rows: int, hidden: int, vocab: int) -> int:
    """Liger's `chunk_mem_const` for a loss over `rows` rows: the largest (up to 64) whose chunks of bf16 logits stay
    within the CUDA chunk budget (CHUNK_BYTES, the plain chunks' fp32 budget, so the fit planner's bound holds).
    Liger's default (1) caps a chunk's logits at the hidden states' size: 256 rows at the Llama-3.1-8B shape, whose
    products against the 128k-token output layer run further below the matmul peak than 2,048-row ones do.
    Liger's rule: chunk = next power of two of rows / ceil(vocab / (const x hidden)), at most rows."""
    limit = max(1, CHUNK_BYTES["cuda"] // (2 * vocab))
    best = 1
    for const in (2, 4, 8, 16, 32, 64):
        if _liger_chunk(rows, hidden, vocab, const) > limit:
            break
        best = const
    return best


def _liger_chunk(rows: int, hidden: int, vocab: int, const: int) -> int:
    """Liger's rule: the rows of a chunk at `chunk_mem_const` const."""
    parts = -(-vocab // (const * hidden))
    return min(1 << (max(1, -(-rows // parts)) - 1).bit_length(), rows)


def liger_chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """The rows of a chunk that Liger's fused linear cross-entropy takes at liger_chunk_const."""
    return _liger_chunk(rows, hidden, vocab, liger_chunk_const(rows, hidden, vocab))


# Liger's cross-entropy kernel as liger-kernel 0.8.5 declares it; another signature falls back to its public function
LIGER_CE_ARGS = ("X_ptr", "X_stride", "Y_ptr", "Y_stride", "weight_ptr", "loss_ptr", "z_loss_ptr", "loss_stride",
                 "token_accuracy_ptr", "token_accuracy_stride", "predicted_tokens_ptr", "predicted_tokens_stride",
                 "n_cols", "n_non_ignore", "sum_non_ignore_weight", "weight_sum", "ignore_index", "lse_square_scale",
                 "label_smoothing", "reduction", "softcap", "RETURN_Z_LOSS", "RETURN_TOKEN_ACCURACY",
                 "RETURN_PREDICTED_TOKENS", "BLOCK_SIZE", "HAS_WEIGHT", "HAS_SOFTCAPPING", "HAS_GRADIENTS")
LIGER_MUL_ARGS = ("X_ptr", "X_stride", "grad_output_ptr", "n_cols", "BLOCK_SIZE", "X_col_stride")
LIGER_ON_CPU = False  # tests: Liger's kernels on CPU tensors, under Triton's interpreter


@functools.cache
def _liger_kernels():
    """Liger's cross-entropy and element-wise scaling kernels, where their signatures are the ones
    _LigerLinearCrossEntropy calls; else None. Looked up once a process."""
    try:
        from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel
        from liger_kernel.ops.utils import element_mul_kernel
    except ImportError:
        return None
    if (tuple(liger_cross_entropy_kernel.arg_names) != LIGER_CE_ARGS
            or tuple(element_mul_kernel.arg_names) != LIGER_MUL_ARGS):
        return None
    return liger_cross_entropy_kernel, element_mul_kernel


class _LigerLinearCrossEntropy(torch.autograd.Function):
    """Liger's fused linear cross-entropy for a frozen output layer, summed, without its two waits for the device.

    The same chunks and kernels as liger_fused_linear_cross_entropy (each chunk's logits in the compute dtype, turned
    into per-row losses and their own gradient in place by Liger's kernel, then through the output layer into the
    hidden states' gradient), but: a sum needs no count of the supervised rows, which Liger reads to the host
    (`.item()`) before its first chunk; the backward scales that gradient by the incoming one on the device, where
    Liger first compares it with 1.0 on the host (a copy there and back); and the hidden states' gradient is written
    chunk by chunk, not zeroed first. So Python keeps launching ahead of the GPU through the loss."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, softcap, chunk):
        import triton

        ce, _ = _liger_kernels()
        hidden = hidden.contiguous()  # (a no-op for the loss's rows; its gradient is written chunk by chunk)
        rows, vocab = hidden.shape[0], weight.shape[0]
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        losses = torch.zeros(rows, dtype=torch.float32, device=hidden.device)  # ignored rows stay 0
        logits = torch.empty(min(chunk, rows), vocab, dtype=hidden.dtype, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, rows, chunk):
                end = min(start + chunk, rows)
                part = logits[: end - start]
                torch.mm(hidden[start:end], weight.t(), out=part)
                t = targets[start:end].contiguous()
                ce[(end - start,)](
                    X_ptr=part, X_stride=part.stride(-2), Y_ptr=t, Y_stride=t.stride(-1), weight_ptr=None,
                    loss_ptr=losses[start:end], z_loss_ptr=None, loss_stride=1, token_accuracy_ptr=None,
                    token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0, n_cols=vocab,
                    n_non_ignore=1.0, sum_non_ignore_weight=1.0, weight_sum=0.0, ignore_index=IGNORE,
                    lse_square_scale=0.0, label_smoothing=0.0, reduction="sum", softcap=softcap or None,
                    RETURN_Z_LOSS=False, RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False,
                    BLOCK_SIZE=min(32768, triton.next_power_of_2(vocab)), HAS_WEIGHT=False,
                    HAS_SOFTCAPPING=bool(softcap), HAS_GRADIENTS=grad_hidden is not None,
                    num_warps=32 if hidden.is_cuda else 4)
                if grad_hidden is not None:  # the kernel left d loss / d logits where the logits were
                    torch.mm(part, weight, out=grad_hidden[start:end])
        ctx.save_for_backward(grad_hidden)
        return losses.sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        import triton

        _, mul = _liger_kernels()
        (grad_hidden,) = ctx.saved_tensors
        if grad_hidden is None:
            return None, None, None, None, None
        rows, width = grad_hidden.shape
        # in place, in float32 inside (the scale is not rounded to bf16 first), as Liger's own backward does
        mul[(rows,)](grad_hidden, grad_hidden.stride(-2), grad_output.contiguous(), width,
                     BLOCK_SIZE=min(32768, triton.next_power_of_2(width)), X_col_stride=grad_hidden.stride(-1),
                     num_warps=32 if grad_hidden.is_cuda else 4)
        return grad_hidden, None, None, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, chunk by chunk, the gradients too: d loss / d logits = softmax - one_hot is
    known as soon as a chunk's logits are, so it goes straight through the output layer (into d hidden, and into
    d weight if the weight trains) and the chunk's logits are dropped. Backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, softcap, chunk_rows):
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else hidden.dtype
        w = weight.to(dtype)
        need_w = weight.requires_grad
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_rows):
                h = hidden[start:start + chunk_rows].to(dtype)
                t = targets[start:start + chunk_rows]
                logits = (h @ w.T).float()
                if softcap:
                    capped = torch.tanh(logits / softcap)
                    logits = capped * softcap
                # log-sum-exp and softmax in the logits' own memory: on the CPU every new chunk-sized tensor is
                # fresh pages from the kernel, which cost as much as the arithmetic
                target_logit = logits.gather(1, t[:, None]).squeeze(1)
                top = logits.amax(dim=-1, keepdim=True)
                probs = logits.sub_(top).exp_()
                sums = probs.sum(dim=-1, keepdim=True)
                total += (sums.log() + top - target_logit[:, None]).sum()
                if grad_hidden is None and grad_weight is None:
                    continue
                grad = probs.div_(sums)  # softmax
                grad[torch.arange(t.shape[0], device=t.device), t] -= 1.0
                if softcap:
                    grad *= 1.0 - capped * capped
                grad = grad.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[start:start + chunk_rows] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += (grad.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_output.to(grad_hidden.dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_output).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None


# ------------------------------------------------------------------------------------------------ fused LoRA


class _LoraLinear(torch.autograd.Function):
    """y = x W^T + b + s (x_d A^T) B^T, with x_d = x (no dropout) or dropout(x) given separately.

    Forward: the base product, then the rank-r product added into it in place (addmm with beta 1). Backward: the
    input's gradient g W, with s (g B) A added into it in place when x_d is x; A's and B's gradients from the rank-r
    intermediates. Saves what PEFT's path saves (the input and the rank-r activation); the frozen weight is the
    parameter itself whenever it is already in the compute dtype."""

    @staticmethod
    def forward(ctx, x, x_drop, weight, bias, lora_a, lora_b, scaling, dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dtype)
        xd = x2 if x_drop is None else x_drop.reshape(-1, shape[-1]).to(dtype)
        w, a, b = weight.to(dtype), lora_a.to(dtype), lora_b.to(dtype)
        y = torch.nn.functional.linear(x2, w, None if bias is None else bias.to(dtype))
        xa = xd @ a.t()
        y.addmm_(xa, b.t(), alpha=scaling)
        ctx.save_for_backward(xd, xa, w, a, b)
        ctx.scaling, ctx.shape, ctx.separate = scaling, shape, x_drop is not None
        ctx.dtypes = (x.dtype, lora_a.dtype, lora_b.dtype)
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        xd, xa, w, a, b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)
        gb = (g @ b).mul_(ctx.scaling)  # d loss / d (x_d A^T), [tokens, r]
        grad_x = grad_drop = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ w
            if not ctx.separate:
                grad_x.addmm_(gb, a)
            grad_x = grad_x.view(ctx.shape).to(ctx.dtypes[0])
        if ctx.separate and ctx.needs_input_grad[1]:
            grad_drop = (gb @ a).view(ctx.shape).to(ctx.dtypes[0])
        grad_a = (gb.t() @ xd).to(ctx.dtypes[1]) if ctx.needs_input_grad[4] else None
        grad_b = (g.t() @ xa).mul_(ctx.scaling).to(ctx.dtypes[2]) if ctx.needs_input_grad[5] else None
        return grad_x, grad_drop, None, None, grad_a, grad_b, None, None


def _lora_name(layer) -> str | None:
    """The adapter's name if `layer` is a PEFT LoRA linear computing base(x) + s B A dropout(x) plainly: one active
    adapter (not disabled or merged), no DoRA or other variant, no LoRA bias, a frozen torch Linear under it; else
    None. What the fused paths below may compute in their own way."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if type(layer) is not LoraLinear or layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name, base = layer.active_adapters[0], layer.base_layer
    if (name not in layer.lora_A or name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name)
            or type(layer.lora_A[name]) is not torch.nn.Linear or layer.lora_B[name].bias is not None
            or type(base) is not torch.nn.Linear or base.weight.requires_grad
            or (base.bias is not None and base.bias.requires_grad)):
        return None
    return name


def _fused_lora_forward(self, x, *args, **kwargs):
    """A PEFT lora.Linear's forward through `_LoraLinear` where it is plain LoRA (`_lora_name`); anything else
    (adapters disabled or merged, DoRA, a LoRA bias, a quantized or trainable base, mixed dtypes outside autocast,
    extra arguments, a dropout module PEFT did not make) takes PEFT's own forward."""
    plain = type(self).forward
    name = None if args or kwargs else _lora_name(self)
    if name is None:
        return plain(self, x, *args, **kwargs)
    base, lora_a, lora_b = self.base_layer, self.lora_A[name], self.lora_B[name]
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    elif x.dtype == base.weight.dtype == lora_a.weight.dtype == lora_b.weight.dtype:
        dtype = x.dtype
    else:
        return plain(self, x, *args, **kwargs)
    dropout = self.lora_dropout[name]
    if isinstance(dropout, torch.nn.Dropout):
        x_drop = dropout(x) if dropout.training and dropout.p > 0 else None
    elif isinstance(dropout, torch.nn.Identity):
        x_drop = None
    else:  # a dropout PEFT did not make: its own forward applies it
        return plain(self, x, *args, **kwargs)
    return _LoraLinear.apply(x, x_drop, base.weight, base.bias, lora_a.weight, lora_b.weight,
                             float(self.scaling[name]), dtype)


def fuse_lora(model: torch.nn.Module) -> int:
    """Route every PEFT LoRA linear of `model` over a torch Linear through the fused forward (instance by instance:
    other models keep PEFT's). Returns how many layers. Saving, merging and loading are PEFT's, unchanged."""
    from types import MethodType

    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if type(module) is LoraLinear and type(module.base_layer) is torch.nn.Linear:
            module.forward = MethodType(_fused_lora_forward, module)
            count += 1
    return count


# ------------------------------------------------------------------------------------------------ fused q/k/v

QKV = ("q_proj", "k_proj", "v_proj")


def _plain_lora(layer) -> str | None:
    """The adapter name if `layer` is plain LoRA (`_lora_name`) with no dropout over a bias-free base, whose output
    is base(x) + s B A x exactly; else None."""
    name = _lora_name(layer)
    if name is None or layer.base_layer.bias is not None:
        return None
    dropout = layer.lora_dropout[name]
    if not (isinstance(dropout, torch.nn.Identity) or (type(dropout) is torch.nn.Dropout and dropout.p == 0)):
        return None
    return name


def _frozen_linear(layer) -> bool:
    return type(layer) is torch.nn.Linear and layer.bias is None and not layer.weight.requires_grad


def _qkv_parts(module) -> list[str | None] | None:
    """For each of q/k/v: its adapter's name (a plain LoRA layer) or None (a frozen bias-free Linear with no
    adapter); None if any projection is neither or none has an adapter."""
    if not all(hasattr(module, p) for p in QKV):
        return None
    layers = [getattr(module, p) for p in QKV]
    names = [_plain_lora(layer) for layer in layers]
    if not any(names) or any(n is None and not _frozen_linear(layer) for n, layer in zip(names, layers, strict=True)):
        return None
    return names


def _fused_qkv_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """LlamaAttention's training forward with q, k and v from one product: x [Wq; Wk; Wv]^T for the frozen
    weights, x [A..]^T for the LoRA down-projections together (the input read once, not once per adapter), and the
    up-projections as one block-diagonal product added into the first in place (`products.products_sum`; a
    projection without an adapter gets a zero block). The same function as PEFT's layers (tests: loss and gradients); anything else -- a KV cache,
    adapters switched off or merged since -- goes through the model's own forward."""
    from tunesmith.products import products_sum

    names = _qkv_parts(self)
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    autocast = torch.is_autocast_enabled(hidden_states.device.type)
    if (cache is not None or names != self.tunesmith_qkv_names or position_embeddings is None
            or not (autocast or len({hidden_states.dtype} | {p.dtype for p in self.parameters()}) == 1)):
        return type(self).forward(self, hidden_states=hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, **kwargs)
    kwargs.pop("past_key_values", None)
    kwargs.pop("cache", None)
    layers = [getattr(self, p) for p in QKV]
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    a = torch.cat([layer.lora_A[n].weight for layer, n in zip(layers, names, strict=True) if n])
    b = torch.block_diag(*[layer.lora_B[n].weight * layer.scaling[n] if n else
                           layer.weight.new_zeros(layer.weight.shape[0], 0)
                           for layer, n in zip(layers, names, strict=True)])
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    xa = torch.nn.functional.linear(x, a)
    # x W^T + (x A^T) B^T, the second product added into the first in place (torch.addmm would copy the first)
    qkv = products_sum([x.to(dtype), self.tunesmith_qkv_weight.to(dtype).t(), xa.to(dtype), b.to(dtype).t()],
                       [1.0, 1.0])
    cos, sin = position_embeddings
    module = sys.modules[type(self).__module__]  # the model file's own RoPE and eager attention (Liger may patch it)
    if _rope_kernel(qkv, hidden_states, cos, module, self.tunesmith_qkv_sizes, self.head_dim):
        from tunesmith.rope import rope_qkv

        hq, hk = (n // self.head_dim for n in self.tunesmith_qkv_sizes[:2])
        q, k, v = (t.transpose(1, 2) for t in rope_qkv(qkv, cos, sin, hidden_states.shape[0], hq, hk))
    else:
        q, k, v = qkv.split(self.tunesmith_qkv_sizes, dim=-1)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        # v goes to the attention kernel as it is, which keeps it for the backward pass: a view would keep all of
        # the joined output alive with it (q and k are rotated into new tensors anyway)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v.contiguous()))
        q, k = module.apply_rotary_pos_emb(q, k, cos, sin)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = self.config._attn_implementation
    attend = module.eager_attention_forward if impl in (None, "eager") else ALL_ATTENTION_FUNCTIONS[impl]
    out, weights = attend(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                          scaling=self.scaling, **kwargs)
    out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
    return self.o_proj(out), weights


# RoPE straight out of the joined q/k/v product and its gradient straight back (`rope.rope_qkv`, Triton on CUDA) in
# place of the split, transformers' RoPE and the compiler's kernels for them. Checked against transformers' RoPE
# and PEFT's layers (CPU tests, the kernels under Triton's interpreter). On an H200 (2026-12-03), with
# lora_mlp.DAD_IN_KERNEL, the 8B training step ran 0.4-0.5% faster (two calls); alone it was level: on.
ROPE_KERNEL = True
ROPE_ON_CPU = False  # tests: rope_qkv's PyTorch reference on the CPU


def _rope_kernel(qkv, hidden_states, cos, module, sizes, head_dim) -> bool:
    """Whether this attention's RoPE goes through rope.rope_qkv: ROPE_KERNEL on, CUDA (Triton) or ROPE_ON_CPU,
    [batch, seq, hidden] inputs, transformers' own apply_rotary_pos_emb (not Liger's) over whole heads with
    cos / sin of [batch or 1, seq, head_dim], and k and v of one size."""
    from tunesmith.rope import triton as rope_triton

    return (ROPE_KERNEL and ((qkv.is_cuda and rope_triton is not None) or ROPE_ON_CPU) and hidden_states.dim() == 3
            and not getattr(module.apply_rotary_pos_emb, "_tunesmith_liger", False) and cos.dim() == 3
            and cos.shape[-1] == head_dim and head_dim % 2 == 0 and cos.shape[1] == hidden_states.shape[1]
            and sizes[1] == sizes[2] and sizes[0] % head_dim == 0 and sizes[1] % head_dim == 0)


def _holder(layer) -> torch.nn.Linear:
    return layer if type(layer) is torch.nn.Linear else layer.base_layer


def fuse_qkv(model: torch.nn.Module) -> int:
    """Give each Llama attention whose q_proj, k_proj and v_proj are plain LoRA layers at dropout 0 (`_plain_lora`)
    or frozen bias-free Linears, at least one with an adapter, the one-product forward. The three frozen weights
    become views into one [Wq; Wk; Wv] buffer (no copy kept). Returns how many attentions; `unfuse_qkv` undoes it."""
    from types import MethodType

    count = 0
    for module in model.modules():
        names = _qkv_parts(module) if type(module).__name__ == "LlamaAttention" else None
        if names is None:
            continue
        holders = [_holder(getattr(module, p)) for p in QKV]
        weights = [h.weight for h in holders]
        if len({(w.dtype, w.device) for w in weights}) != 1:
            continue
        whole = torch.cat([w.detach() for w in weights])
        module.register_buffer("tunesmith_qkv_weight", whole, persistent=False)
        module.tunesmith_qkv_sizes = [w.shape[0] for w in weights]
        module.tunesmith_qkv_names = names
        for holder, part in zip(holders, whole.split(module.tunesmith_qkv_sizes), strict=True):
            holder.weight = torch.nn.Parameter(part, requires_grad=False)
        module.forward = MethodType(_fused_qkv_forward, module)
        count += 1
    return count


def unfuse_qkv(model: torch.nn.Module) -> torch.nn.Module:
    """What `fuse_qkv` did, undone: the model's own attention forward, each weight its own tensor again."""
    for module in model.modules():
        if "tunesmith_qkv_weight" not in getattr(module, "_buffers", {}):
            continue
        for p in QKV:
            holder = _holder(getattr(module, p))
            holder.weight = torch.nn.Parameter(holder.weight.detach().clone(), requires_grad=False)
        del module.tunesmith_qkv_weight, module.tunesmith_qkv_sizes, module.tunesmith_qkv_names
        if "forward" in module.__dict__:
            del module.forward
    return model


# ------------------------------------------------------------------------------------------------ LoRA-aware MLP

MLP = ("gate_proj", "up_proj", "down_proj")
# The kernels hold [rows, rank] blocks in registers beside each tile (measured at rank 16); larger ranks keep PEFT's
# layers rather than spill.
MLP_MAX_RANK = 32


def _mlp_parts(module) -> list[str] | None:
    """The adapters' names if `module` is a Llama-family SiLU-gated MLP whose gate, up and down projections are all
    plain LoRA layers at dropout 0 (`_plain_lora`) of one rank (at most MLP_MAX_RANK) over bias-free bases of one
    dtype; else None."""
    if not all(hasattr(module, p) for p in MLP) or getattr(getattr(module, "config", None), "hidden_act", None) != "silu":
        return None
    layers = [getattr(module, p) for p in MLP]
    names = [_plain_lora(layer) for layer in layers]
    if any(n is None for n in names):
        return None
    ranks = {layer.lora_A[n].weight.shape[0] for layer, n in zip(layers, names, strict=True)}
    if len(ranks) != 1 or ranks.pop() > MLP_MAX_RANK:
        return None
    if len({(layer.base_layer.weight.dtype, layer.base_layer.weight.device) for layer in layers}) != 1:
        return None
    return names


def _fused_mlp_forward(self, x):
    """The MLP through `lora_mlp.LoraMLPFunction` (a SwiGLU kernel that makes the gate and up LoRA terms itself);
    anything else -- adapters switched off or merged since, mixed dtypes outside autocast -- goes through the
    module's own forward."""
    from tunesmith.lora_mlp import LoraMLPFunction

    names = _mlp_parts(self)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    elif len({x.dtype} | {p.dtype for p in self.parameters()}) == 1:
        dtype = x.dtype
    else:
        names = None
    if names != self.tunesmith_mlp_names:
        return type(self).forward(self, x)
    gate, up, down = (getattr(self, p) for p in MLP)
    ng, nu, nd = names
    agu = torch.cat([gate.lora_A[ng].weight, up.lora_A[nu].weight]).to(dtype)
    y = LoraMLPFunction.apply(x.reshape(-1, x.shape[-1]).to(dtype), gate.base_layer.weight.to(dtype),
                              up.base_layer.weight.to(dtype), down.base_layer.weight.to(dtype), agu,
                              gate.lora_B[ng].weight.to(dtype), up.lora_B[nu].weight.to(dtype),
                              down.lora_A[nd].weight.to(dtype), down.lora_B[nd].weight.to(dtype),
                              float(gate.scaling[ng]), float(up.scaling[nu]), float(down.scaling[nd]))
    return y.view(*x.shape[:-1], y.shape[-1])


def fuse_mlp(model: torch.nn.Module) -> int:
    """Give each Llama-family MLP with plain LoRA on gate, up and down (`_mlp_parts`) the LoRA-aware forward.
    Returns how many MLPs; `unfuse_mlp` undoes it."""
    from types import MethodType

    count = 0
    for module in model.modules():
        names = _mlp_parts(module) if type(module).__name__.endswith("MLP") else None
        if names is None:
            continue
        module.tunesmith_mlp_names = names
        module.forward = MethodType(_fused_mlp_forward, module)
        count += 1
    return count


def triton_available() -> bool:
    """Whether Triton is importable (the LoRA-aware MLP's CUDA kernels), without importing it."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def unfuse_mlp(model: torch.nn.Module) -> torch.nn.Module:
    """What `fuse_mlp` did, undone: the module's own forward."""
    for module in model.modules():
        if "tunesmith_mlp_names" in vars(module):
            del module.tunesmith_mlp_names
            if "forward" in module.__dict__:
                del module.forward
    return model


# ------------------------------------------------------------------------------------------------ CUDA kernels

LIGER_MODEL_TYPES = ("llama",)  # RMSNorm + SwiGLU MLP + rotate-half RoPE, the shapes Liger's kernels compute


def liger_available() -> bool:
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError:
        return False
    return True


def apply_liger(model: torch.nn.Module) -> list[str]:
    """Liger Kernel's Triton RMSNorm and SwiGLU on this model's modules (instance by instance: other models in the
    process keep the eager ones), and its RoPE wherever the inputs are CUDA tensors. Call before LoRA is attached
    or after: the MLP still calls its own gate/up/down projections, LoRA-wrapped or not. Returns what was
    replaced (empty: not a Llama-family model)."""
    from liger_kernel.transformers.functional import liger_rms_norm, liger_swiglu

    lm = causal_lm(model)
    if getattr(lm.config, "model_type", None) not in LIGER_MODEL_TYPES:
        return []

    def rms_norm(self, x):
        return liger_rms_norm(x, self.weight, self.variance_epsilon)

    def swiglu(self, x):
        return self.down_proj(liger_swiglu(self.gate_proj(x), self.up_proj(x)))

    done = _replace_norms_and_mlps(lm, rms_norm, swiglu)
    if _patch_rope(lm):
        done.append("rope")
    return sorted(set(done))


def _replace_norms_and_mlps(lm, norm_forward, mlp_forward) -> list[str]:
    """Give each RMSNorm of a Llama-family model `norm_forward` and each SiLU-gated MLP `mlp_forward`, instance by
    instance (other models in the process keep their own), passing over modules already given one; returns what
    was replaced. What Liger's kernels and `lean_layers` both replace."""
    from types import MethodType

    if getattr(lm.config, "model_type", None) not in LIGER_MODEL_TYPES:
        return []
    silu = getattr(lm.config, "hidden_act", "silu") == "silu"
    done = []
    for module in lm.modules():
        if "forward" in vars(module):
            continue
        kind = type(module).__name__
        if kind.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = MethodType(norm_forward, module)
            done.append("rms_norm")
        elif kind.endswith("MLP") and silu and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            module.forward = MethodType(mlp_forward, module)
            done.append("swiglu")
    return sorted(set(done))


def _patch_rope(lm) -> bool:
    """Liger's RoPE kernel in place of transformers' apply_rotary_pos_emb for CUDA inputs (the function is
    module-level in transformers, so the swap is too; other devices still get the original)."""
    import importlib

    from liger_kernel.transformers.functional import liger_rope

    module = importlib.import_module(type(lm).__module__)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    if getattr(original, "_tunesmith_liger", False):
        return True

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if q.is_cuda and not args and set(kwargs) <= {"unsqueeze_dim"} and cos.shape[-1] == q.shape[-1]:
            return liger_rope(q, k, cos, sin, unsqueeze_dim=kwargs.get("unsqueeze_dim", 1))
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._tunesmith_liger = True
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def compile_layers(model: torch.nn.Module, cuda_graphs: bool = False) -> int:
    """torch.compile each decoder layer in place (regional compilation: the layers share code, so the first one
    compiles and the rest reuse it; warm-up stays in seconds, not the minutes of a whole-model compile).

    `cuda_graphs`: the reduce-overhead mode, whose CUDA graph trees record each layer's forward and backward once
    and then replay them: a small model's step is bound by launching thousands of small kernels, not by running
    them. A layer whose graph mutates one of its inputs is not graphed (torch says so and runs it as compiled
    code): Liger's in-place kernels do, so the trainer leaves them out in this mode."""
    layers = causal_lm(model).get_decoder().layers
    for layer in layers:
        layer.compile(mode="reduce-overhead" if cuda_graphs else None)
    return len(layers)


LEAN_BUDGET = 0.9  # torch.compile's activation memory budget (1: keep what the partitioner would; 0: recompute all)


def recomputing(enabled: bool):
    """While layers compile inside this block, the compiler keeps less for their backward pass: its partitioner
    recomputes cheap elementwise results (a norm's output from its input and 1/rms, SwiGLU's product from the gate
    and up projections, which its own backward keeps anyway) instead of storing them, within LEAN_BUDGET of its
    activation memory; products and attention are still kept, not recomputed. Layers compile at their first call,
    so the block spans the training loop. Compiled code already cached in this process for the same layer code
    and shapes is reused as it was compiled."""
    if not enabled:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=LEAN_BUDGET)


class _RMSNorm(torch.autograd.Function):
    """transformers' Llama RMSNorm, w * (x / rms(x)) with the normalisation in fp32 and the product in x's dtype,
    keeping for backward only x as it came (bf16 under autocast, where eager autograd keeps its fp32 upcast) and
    1/rms per token; the normalised x is recomputed from them."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).float()
            grad_x = (rstd * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, None


class _SiLUMul(torch.autograd.Function):
    """silu(a) * b, the gated MLP's product, keeping a and b (what its backward needs anyway) and recomputing
    silu(a), which eager autograd keeps as a third tensor of the MLP's width."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.nn.functional.silu(a) * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = torch.ops.aten.silu_backward(grad * b, a) if ctx.needs_input_grad[0] else None
        grad_b = grad * torch.nn.functional.silu(a) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def _lean_norm(self, x):
    return _RMSNorm.apply(x, self.weight, self.variance_epsilon)


def _lean_mlp(self, x):
    return self.down_proj(_SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))


def lean_layers(model: torch.nn.Module) -> list[str]:
    """Eager decoder layers that keep less for the backward pass (what `recomputing` has the compiler do): each
    RMSNorm keeps its input as it came and 1/rms instead of its fp32 upcast, each gated MLP its gate and up
    projections without silu(gate), recomputing the rest in backward. Plain PyTorch, so the CPU and MPS get it;
    same outputs, gradients to float rounding. Llama-family models only (Liger's kernels, where applied, already
    keep no more); instance by instance, undone by `unlean_layers`. Returns what was replaced."""
    return _replace_norms_and_mlps(causal_lm(model), _lean_norm, _lean_mlp)


def unlean_layers(model: torch.nn.Module) -> torch.nn.Module:
    """What `lean_layers` did, undone: the modules' own forwards again."""
    try:
        modules = causal_lm(model).modules()
    except (AttributeError, TypeError):
        return model
    for module in modules:
        forward = vars(module).get("forward")
        if getattr(forward, "__func__", None) in (_lean_norm, _lean_mlp):
            del module.forward
    return model


def uncompile_layers(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder layers back to eager calls (what `compile_layers` did, undone): the model that `train` returns
    generates with a KV cache, whose per-layer cache objects would make a compiled layer recompile per layer and a
    graphed one record a graph per decoding length."""
    try:
        layers = causal_lm(model).get_decoder().layers
    except (AttributeError, TypeError):
        return model
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is not None:
            layer._compiled_call_impl = None
    return model


@contextlib.contextmanager
def eager_layers(model: torch.nn.Module):
    """Run the decoder layers eagerly inside the block, compiled again after it.

    CUDA graph trees keep one recording per place in a training step; a forward without gradients in between
    (evaluation) would replay the same layer graph for every layer while an earlier layer's output, still needed,
    lives in the memory the replay writes. Evaluation is a small share of a run: it runs eager."""
    layers = causal_lm(model).get_decoder().layers
    saved = [getattr(layer, "_compiled_call_impl", None) for layer in layers]
    for layer in layers:
        layer._compiled_call_impl = None
    try:
        yield model
    finally:
        for layer, impl in zip(layers, saved, strict=True):
            layer._compiled_call_impl = impl


def own_gradients(model: torch.nn.Module) -> None:
    """Copy each gradient that lives in a CUDA graph's memory pool out of it, before the next micro-batch.

    A graphed backward writes its gradients into memory that its next replay writes again; the first micro-batch's
    gradient would be overwritten by the second's before being added to it. Only under CUDA graph trees, and
    only between micro-batches of one step (the optimizer reads the last one's before any replay)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad.clone()
