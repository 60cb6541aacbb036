"""Liger Kernel's fused linear cross-entropy as the fused loss, on CUDA where liger-kernel is installed.

The same computation as `loss.linear_cross_entropy_sum` with each chunk's logits kept in the compute dtype and turned
into loss and gradient by one Triton kernel, in place (the softmax in float32 inside it). For a frozen output layer
tunesmith calls Liger's kernels itself (`_LigerLinearCrossEntropy`), without the two host waits of Liger's own
function. Not under FSDP2, where it was never measured.
"""

from __future__ import annotations

import functools
from functools import partial

import torch

from tunesmith.data import IGNORE
from tunesmith.kernels.base import LossFn, Setting
from tunesmith.kernels.loss import CHUNK_BYTES, chunked_loss_sum, supports_chunked_loss


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


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             softcap: float = 0.0) -> torch.Tensor:
    """loss.linear_cross_entropy_sum through Liger's kernels (CUDA tensors, or any under LIGER_ON_CPU); other
    tensors, and no rows, take the plain chunks."""
    from tunesmith.kernels.loss import linear_cross_entropy_sum as plain

    if not ((hidden.is_cuda or LIGER_ON_CPU) and hidden.shape[0] > 0):
        return plain(hidden, weight, targets, softcap)
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


def liger_available() -> bool:
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError:
        return False
    return True


class LigerLoss:
    """The fused loss through Liger's kernel: CUDA, liger-kernel installed, not under FSDP2."""

    name = "fused loss (Liger's kernel)"
    tolerance = 1e-2  # logits in the compute dtype (bf16) instead of fp32

    def applies(self, setting: Setting, model) -> bool:
        return (setting.auto and setting.device == "cuda" and not setting.fsdp and supports_chunked_loss(model)
                and liger_available())

    def apply(self, model, setting: Setting) -> str:
        return self.name

    def undo(self, model) -> None:
        pass  # it changes no module

    def loss(self, setting: Setting) -> LossFn:
        return partial(chunked_loss_sum, cross_entropy=linear_cross_entropy_sum)


PATH = LigerLoss()
