"""The LoRA-aware MLP (kernels.lora_mlp) against PEFT's gate/up/down LoRA layers, its Triton kernels against
their PyTorch reference, and products_sum (kernels.products) against the addmm chain."""

import os
import subprocess
import sys

import pytest
import torch

from tunesmith.kernels import lora_mlp
from tunesmith.lora import attach_lora

from .conftest import make_model
from .kernel_fixtures import lora_model, lora_pair, loss_and_grads, make_batch


def _mlp(model, i=0):
    return model.base_model.model.model.layers[i].mlp


@pytest.mark.parametrize("rank", [4, 5])
def test_the_lora_aware_mlp_gives_peft_s_loss_and_gradients(tokenizer, rank):
    plain, fast = lora_pair(tokenizer, rank=rank)
    assert lora_mlp.fuse_mlp(fast) == 2
    batch = make_batch(tokenizer)
    ref_loss, ref = loss_and_grads(plain, batch)
    got_loss, got = loss_and_grads(fast, batch)
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert set(got) == set(ref) and len(ref) == 28
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # under bf16 autocast each path rounds its own way: the fused one no further from fp32 than PEFT's
    ref_loss16, ref16 = loss_and_grads(plain, batch, autocast=torch.bfloat16)
    got_loss16, got16 = loss_and_grads(fast, batch, autocast=torch.bfloat16)
    assert got_loss16.item() == pytest.approx(ref_loss.item(), rel=1e-2)
    for name, want in ref.items():
        assert got16[name].dtype == torch.float32
        err16, ref_err16 = ((g[name] - want).norm() / want.norm() for g in (got16, ref16))
        assert err16 < max(2 * ref_err16, 1e-2), name


def test_over_an_nf4_base_the_mlp_multiplies_through_the_nf4_op_and_gives_peft_s_gradients(tokenizer, monkeypatch):
    """QLoRA's MLPs take the LoRA-aware function too: each base product (forward, the input's gradient) goes
    through the nf4 kernels' op, no base weight is dequantized whole, and loss and LoRA gradients are PEFT's over
    the same nf4 layers."""
    from tunesmith.kernels import nf4
    from tunesmith.qlora import QuantLinear

    from .kernel_fixtures import qlora_model

    plain, fast = qlora_model(tokenizer, dtype=torch.float32), qlora_model(tokenizer, dtype=torch.float32)
    assert lora_mlp.fuse_mlp(fast) == 2
    batch = make_batch(tokenizer)
    ref_loss, ref = loss_and_grads(plain, batch)
    products = []
    real_mm = nf4.nf4_mm
    monkeypatch.setattr(nf4, "nf4_mm", lambda x, *a: products.append(a[-1]) or real_mm(x, *a))
    monkeypatch.setattr(QuantLinear, "dequantize", lambda *a, **k: pytest.fail("a base dequantized whole"))
    got_loss, got = loss_and_grads(fast, batch)  # (the attentions' nf4 layers: torchao's linear_nf4, in fp32)
    # per MLP, forward: gate, up, down (x W^T); backward: down, then gate and up for the input's gradient (x W)
    assert products == [True, True, True] * 2 + [False, False, False] * 2
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert set(got) == set(ref) and len(ref) == 28
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-3, atol=1e-5, msg=name)


def test_the_lora_aware_mlp_is_what_runs_and_gives_way_where_it_does_not_apply(tokenizer, monkeypatch):
    plain, fast = lora_pair(tokenizer)
    lora_mlp.fuse_mlp(fast)
    ids = {k: v for k, v in make_batch(tokenizer).items() if k in ("input_ids", "attention_mask")}
    calls = []
    gate = _mlp(fast).gate_proj
    monkeypatch.setattr(gate, "forward", lambda x, *a, **k: calls.append(1) or type(gate).forward(gate, x, *a, **k))
    with torch.no_grad():
        torch.testing.assert_close(fast(**ids).logits, plain(**ids).logits, rtol=1e-5, atol=1e-5)
        assert calls == []  # the function ran, not gate_proj's own forward
        with fast.disable_adapter(), plain.disable_adapter():  # adapters off: the module's own forward
            torch.testing.assert_close(fast(**ids).logits, plain(**ids).logits)
        assert len(calls) == 1


def test_the_lora_aware_mlp_leaves_dropout_and_partial_targets_alone_and_undoes_itself(tokenizer):
    assert lora_mlp.fuse_mlp(lora_model(tokenizer, dropout=0.1)) == 0
    for targets in (("q_proj", "v_proj"), ("gate_proj", "up_proj")):  # down_proj without an adapter: PEFT's layers
        assert lora_mlp.fuse_mlp(lora_model(tokenizer, targets=targets)) == 0
    assert lora_mlp.fuse_mlp(lora_model(tokenizer, rank=lora_mlp.MLP_MAX_RANK + 1)) == 0
    from tunesmith.qlora import quantize_base

    dora = attach_lora(make_model(tokenizer), rank=4, alpha=8, dropout=0.0, targets=["all-linear"], dora=True)
    assert lora_mlp.fuse_mlp(dora) == 0
    qlora = attach_lora(quantize_base(make_model(tokenizer), "fp8"), rank=4, alpha=8, dropout=0.0,
                        targets=["all-linear"])
    assert lora_mlp.fuse_mlp(qlora) == 0  # a quantized base (fp8 codes) is not a torch Linear to cast
    plain, fast = lora_pair(tokenizer)
    lora_mlp.fuse_mlp(fast)
    lora_mlp.unfuse_mlp(fast)
    assert "forward" not in _mlp(fast).__dict__ and not hasattr(_mlp(fast), "tunesmith_mlp_names")
    merged, ref = fast.merge_and_unload(), plain.merge_and_unload()
    for (n, a), (_, b) in zip(merged.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=n)


KERNEL_CHECK = """
import itertools
import torch
from tunesmith.kernels import lora_mlp as L
torch.manual_seed(0)
worst = 0.0
shapes = [(70, 200, 8, torch.float32), (33, 130, 5, torch.float32), (64, 256, 16, torch.float16)]
# a row's width in one tile; in several (the sums run across them; a pipeline depth given); in segments of several
# (summed afterwards). (64, 256) in tiles of 32 x 256 or 16 x 64: the maskless tiles
tiles = [(32, 256, 4, 1), (16, 64, 4, 1, 2), (16, 32, 4, 3)]
for (m, n, r, dt), t in itertools.product(shapes, tiles):
    g0, u0, dh0 = (torch.randn(m, n, dtype=dt) for _ in range(3))
    xa, dyb = torch.randn(m, 2 * r, dtype=dt), torch.randn(m, r, dtype=dt)
    bg, bu, ad = torch.randn(n, r, dtype=dt), torch.randn(n, r, dtype=dt), torch.randn(r, n, dtype=dt)
    args = (g0, u0, xa, bg, bu, ad, 0.5, 2.0)
    forward = L._forward_reference(*args)
    pairs = list(zip(forward, L._forward_triton(*args, tiles=t), strict=True))
    args = (dh0, dyb, ad, g0, u0, xa, bg, bu, 0.5, 2.0, 1.5)
    backward = L._backward_reference(*args)
    pairs += list(zip(backward, L._backward_triton(*args, tiles=t), strict=True))
    # A_d's gradient, summed in the backward kernel from the SwiGLU output it never writes: sd dyb^T h
    pairs.append((backward[2], (dyb.float().t() @ forward[0].float() * 1.5).to(dt)))
    for a, b in pairs:
        assert a.shape == b.shape and a.dtype == b.dtype
        worst = max(worst, ((a.float() - b.float()).abs().max() / a.float().abs().max()).item())
print(worst)
"""


def test_the_mlp_kernels_equal_their_reference_under_triton_s_interpreter(tmp_path):
    """The Triton kernels themselves, run on the CPU by Triton's interpreter (fp32 and fp16: the interpreter's
    bf16 products are not exact; bf16 is checked on the GPU by the benchmark)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) < 1e-3


@pytest.mark.parametrize(("row_blocks", "multiprocessors", "expected"), [
    (256, 132, 4), (128, 132, 8), (2048, 132, 1), (1, 132, 8), (264, 132, 2), (64, 108, 8), (512, 108, 1)])
def test_the_mlp_kernels_cut_the_width_until_every_multiprocessor_has_four_programs(row_blocks, multiprocessors,
                                                                                      expected):
    """TILES' segments 0: a GPU of 132 multiprocessors gets 4 segments for 256 row blocks of 64 and 8 for 128, as
    measured fastest; enough row blocks need none; never more than MAX_SEGMENTS."""
    assert lora_mlp.TILES["forward"][3] == lora_mlp.TILES["backward"][3] == 0
    assert lora_mlp.auto_segments(row_blocks, multiprocessors) == expected


def test_auto_segments_cut_the_width_into_whole_tiles(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(lora_mlp, "_multiprocessors", lambda device: 132)
    assert lora_mlp._segments(14336, 64, 0, 128, None) == (1792, 8)  # the 8B's width, 8 x 28 tiles of 64
    assert lora_mlp._segments(8192, 64, 0, 256, None) == (2048, 4)
    assert lora_mlp._segments(200, 64, 0, 1, None) == (64, 4)  # no more segments than tiles
    assert lora_mlp._segments(200, 64, 3) == (128, 2)  # an explicit count, rounded to whole tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_sum_equals_the_addmm_chain_and_its_gradients(dtype):
    """x W^T + s (x A^T) B^T as products_sum (the second product added in place) gives addmm's bits and gradients,
    and skips the gradient of an operand that needs none (the frozen weight)."""
    from torch.utils.flop_counter import FlopCounterMode

    from tunesmith.kernels.products import products_sum

    g = torch.Generator().manual_seed(0)
    m, k, n, r = 10, 16, 12, 4
    x, xa, b = (torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in ((m, k), (m, r), (n, r)))
    w = torch.randn(n, k, generator=g).to(dtype)  # frozen
    dy = torch.randn(m, n, generator=g).to(dtype)
    want = torch.addmm(x @ w.t(), xa, b.t(), alpha=0.5)
    want_grads = torch.autograd.grad(want, [x, xa, b], dy)
    got = products_sum([x, w.t(), xa, b.t()], [1.0, 0.5])
    with FlopCounterMode(display=False) as count:
        got_grads = torch.autograd.grad(got, [x, xa, b], dy)
    assert torch.equal(got, want)
    for a, e in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert count.get_total_flops() == 2 * m * n * (k + 2 * r)  # dx, d xa, d b: not W's


def test_products_sum_of_three_scales_its_first_term_too():
    from tunesmith.kernels.products import products_sum

    g = torch.Generator().manual_seed(1)
    a, b, c, d, e, f = (torch.randn(*s, generator=g) for s in ((5, 3), (3, 4), (5, 2), (2, 4), (5, 6), (6, 4)))
    got = products_sum([a, b, c, d, e, f], [2.0, 1.0, -0.5])
    torch.testing.assert_close(got, 2 * a @ b + c @ d - 0.5 * e @ f)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as count:
        products_sum([a, b, c, d, e, f], [2.0, 1.0, -0.5])
    assert count.get_total_flops() == 2 * 5 * 4 * (3 + 2 + 6)


def test_the_lora_aware_mlp_skips_the_input_gradient_where_none_is_asked_for():
    """An MLP whose input needs no gradient (LoRA on MLPs only: the first one's input comes from frozen layers)
    skips the three products of the input's gradient, and its LoRA gradients stay the same."""
    from torch.utils.flop_counter import FlopCounterMode

    m, h, n, r = 6, 8, 12, 2
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(*shape, generator=g) for shape in ((n, h), (n, h), (h, n))]
    lora = [torch.randn(*shape, generator=g, requires_grad=True) for shape in ((2 * r, h), (n, r), (n, r), (r, n),
                                                                                 (h, r))]
    x = torch.randn(m, h, generator=g)
    grads, flops = [], []
    for needs in (True, False):
        xin = x.clone().requires_grad_(needs)
        y = lora_mlp.LoraMLPFunction.apply(xin, *lora, 0.5, 2.0, 1.5, False, ((), (), ()), *weights)
        with FlopCounterMode(display=False) as count:
            got = torch.autograd.grad(y.sum(), [xin, *lora] if needs else lora)
        grads.append(got[-len(lora):])
        flops.append(count.get_total_flops())
    assert flops[0] - flops[1] == 2 * m * h * (2 * n + 2 * r)  # [dg | du] [W_g; W_u] and dxa [A_g; A_u], skipped
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("even", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("arch", [80, 90])
def test_the_mlp_kernels_compile_for_ampere_and_hopper(dtype, arch, even):
    """The kernels as the GPU would build them (Triton's own ptxas, no GPU needed): what the interpreter cannot
    check, such as the products' input precision for each dtype, at the tiles the trainer uses."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    constexprs = {"R": 16, "RP": 16, "PRECISION": "ieee" if dtype == "fp32" else "tf32", "EVEN": even}
    # the fp32 slots: the forward's h A_d^T; the backward's xa gradient and its row blocks' shares of A_d's
    for kernel, tiles, sums in ((lora_mlp._swiglu_fwd_kernel, lora_mlp.TILES["forward"], ("HA",)),
                                (lora_mlp._swiglu_bwd_kernel, lora_mlp.TILES["backward"], ("DXA", "H"))):
        names = kernel.arg_names
        consts = {**constexprs, "BLOCK_M": tiles[0], "BLOCK_N": tiles[1]}
        signature = {n: "constexpr" if n in consts else "fp32" if n in ("sg", "su", "sd") else
                     "*fp32" if n in sums else
                     f"*{dtype}" if n.isupper() and n not in ("M", "N", "W") else "i32" for n in names}
        src = ASTSource(kernel, signature, {(names.index(n),): v for n, v in consts.items()})
        built = compile(src, target=GPUTarget("cuda", arch, 32),
                        options=lora_mlp._options(tiles, {"bf16": torch.bfloat16, "fp16": torch.float16,
                                                          "fp32": torch.float32}[dtype]))
        assert built.asm["cubin"] and ".target sm_" in built.asm["ptx"]
        # what a program may have on every GPU the kernels serve (sm_75's 64 KB the least): bf16 and fp16 pipeline
        # only the rank-r tiles, fp32 its full-size tiles at one stage
        assert built.metadata.shared <= 64 * 1024
