"""Sums of matrix products written once: the first product, then each further one added into it in place.

torch.addmm(c, a, b) copies c into its result before the product adds into it (eagerly, and as Inductor lowers it:
a device-to-device copy of the whole output), so a frozen product plus LoRA's rank-r term through addmm moves the
full-size output twice more than it needs to. `products_sum` writes the first product once and adds each further
one into it in place (cuBLAS's beta = 1), in the same order and so with the same bits as the addmm chain. It is a
custom op, so torch.compile calls it whole instead of lowering it back to a copy and a product.
"""

from __future__ import annotations

import torch
import torch.utils.flop_counter


@torch.library.custom_op("tunesmith::products_sum", mutates_args=())
def products_sum(mats: list[torch.Tensor], alphas: list[float]) -> torch.Tensor:
    """sum over i of alphas[i] * mats[2i] @ mats[2i + 1] (2-D operands of one dtype; views such as w.t() are
    fine): the first product written, the others added into it in place."""
    out = torch.mm(mats[0], mats[1])
    if alphas[0] != 1.0:
        out.mul_(alphas[0])
    for i in range(1, len(alphas)):
        out.addmm_(mats[2 * i], mats[2 * i + 1], alpha=alphas[i])
    return out


@products_sum.register_fake
def _(mats, alphas):
    return mats[0].new_empty(mats[0].shape[0], mats[1].shape[1])


def _products_sum_setup(ctx, inputs, output):
    mats, alphas = inputs
    ctx.needs = [m.requires_grad for m in mats]
    ctx.save_for_backward(*(m if ctx.needs[i ^ 1] else None for i, m in enumerate(mats)))  # a's grad needs b
    ctx.alphas = alphas
    ctx.col_major = [m.stride() == (1, m.shape[0]) for m in mats]  # autograd's own test for column-major


def _products_sum_backward(ctx, grad):
    mats, grads = ctx.saved_tensors, []
    for i, need in enumerate(ctx.needs):
        if not need:
            grads.append(None)
            continue
        other, alpha = mats[i ^ 1], ctx.alphas[i // 2]
        # d a = g b^T, d b = a^T g, in the layout that autograd's own mm backward picks (torch's mm_mat1_backward
        # and mm_mat2_backward): for an operand given column-major, such as w.t(), the transposed product,
        # transposed back. So the same BLAS calls as the addmm chain's backward, and the same bits on every CPU.
        if ctx.col_major[i]:
            g = (other @ grad.t()).t() if i % 2 == 0 else (grad.t() @ other).t()
        else:
            g = grad @ other.t() if i % 2 == 0 else other.t() @ grad
        grads.append(g.mul_(alpha) if alpha != 1.0 else g)
    return grads, None


products_sum.register_autograd(_products_sum_backward, setup_context=_products_sum_setup)


@torch.utils.flop_counter.register_flop_formula(torch.ops.tunesmith.products_sum)
def _products_sum_flops(mats, alphas, *args, **kwargs) -> int:
    """For FlopCounterMode, which sees the op whole: 2 m k n for each product."""
    return sum(2 * a[0] * a[1] * b[1] for a, b in zip(mats[::2], mats[1::2], strict=True))
