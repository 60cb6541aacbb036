"""The fused loss: next-token cross-entropy that never holds the [batch, seq, vocab] logits.

The decoder runs as usual up to its last hidden states; only the supervised positions go on, a few hundred rows at
a time, through the output layer, log-softmax and its gradient, which is computed right there (as Liger's fused
linear cross-entropy does), so the backward pass has nothing vocabulary-sized to keep. Plain PyTorch: it serves the
CPU, MPS and CUDA alike, where the logits of a 128k vocabulary are the largest tensor of a training step. On CUDA
with liger-kernel installed, `liger_loss` takes its place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from tunesmith.data import IGNORE
from tunesmith.kernels.base import LossFn, Setting, causal_lm

CHUNK_BYTES = {"cuda": 512 << 20, "mps": 64 << 20}  # fp32 logits per chunk; the CPU and others: 32 MiB
DEFAULT_CHUNK_BYTES = 32 << 20


def supports_chunked_loss(model: torch.nn.Module) -> bool:
    """Whether the model's output layer is a plain (not LoRA-wrapped) linear with no bias, after a decoder that
    transformers lets us reach (get_decoder) and that takes `logits_to_keep`."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    return (type(head) is torch.nn.Linear and head.bias is None and decoder is not None
            and "logits_to_keep" in _forward_params(lm))


def _forward_params(module) -> set[str]:
    return set(inspect.signature(module.forward).parameters)


def chunked_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                     cross_entropy: Callable | None = None) -> tuple[torch.Tensor, int]:
    """evaluate.loss_sum without the full-vocabulary logits: the same value and gradients (to rounding).
    `cross_entropy(hidden, weight, targets, softcap)`: the summed loss of the supervised rows (default:
    linear_cross_entropy_sum; liger_loss passes Liger's)."""
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
    loss = (cross_entropy or linear_cross_entropy_sum)(hidden, head.weight, targets, softcap)
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
                             softcap: float = 0.0, rows: int | None = None) -> torch.Tensor:
    """sum over rows of cross_entropy(hidden @ weight.T, targets), in row chunks; logits in float32 (as the plain
    path upcasts them), softcapped as cap * tanh(logits / cap) when `softcap` > 0."""
    if rows is None:
        rows = chunk_rows(hidden.device.type, weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, float(softcap), int(rows))


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


class ChunkedLoss:
    """The fused loss in plain PyTorch, on every device, wherever the model's output layer allows it."""

    name = "fused loss"
    tolerance = 1e-5  # the same sums in another order (fp32)

    def applies(self, setting: Setting, model) -> bool:
        return setting.auto and supports_chunked_loss(model)  # (liger_loss comes first where it applies)

    def apply(self, model, setting: Setting) -> str:
        return self.name

    def undo(self, model) -> None:
        pass  # it changes no module: the trainer stops calling its loss

    def loss(self, setting: Setting) -> LossFn:
        return chunked_loss_sum


PATH = ChunkedLoss()
