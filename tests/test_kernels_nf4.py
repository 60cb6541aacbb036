"""The nf4 kernels (tunesmith.kernels.nf4): the decoding equals torchao's weight bit for bit; the op's products and
gradients equal torchao's linear_nf4; the Triton kernels equal the reference under Triton's interpreter (where
Triton is installed); the path applies on CUDA with Triton only, elsewhere the plain path runs; compiled layers
capture the op whole."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tunesmith.config import TrainConfig
from tunesmith.kernels import nf4
from tunesmith.kernels.base import Setting, replaced_by
from tunesmith.qlora import QuantLinear, _torchao_nf4

from .kernel_fixtures import eager_aot_compile, qlora_model, relative_error

ROOT = Path(__file__).resolve().parents[1]


def _layer(out_f=96, in_f=256, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return QuantLinear.from_weight(torch.randn(out_f, in_f, generator=g).to(dtype), "nf4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_decoding_is_torchao_s_weight_bit_for_bit(dtype):
    layer = _layer(dtype=dtype)
    q = layer.qweight
    got = nf4.dequantize_reference(*nf4.nf4_parts(q), 96, 256, q.scaler_block_size)
    assert got.dtype == dtype and torch.equal(got, q.get_original_weight())


def test_the_op_s_product_and_input_gradient_are_linear_nf4_s():
    """On the CPU the op decodes in PyTorch: x W^T forward, g W backward, and no gradient for the frozen codes."""
    _, linear_nf4 = _torchao_nf4()
    layer = _layer()
    q = layer.qweight
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 256, generator=g).to(torch.bfloat16)
    dy = torch.randn(2, 5, 96, generator=g).to(torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = linear_nf4(xa, q)
    got = nf4.nf4_mm(xb.reshape(-1, 256), *nf4.nf4_parts(q), 96, 256, q.scaler_block_size, True).view(2, 5, 96)
    want.backward(dy)
    got.backward(dy)
    assert relative_error(got.detach(), want.detach()) < 1e-2
    assert relative_error(xb.grad, xa.grad) < 1e-2


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(quantize_base="nf4", **kw)


def test_the_path_applies_on_cuda_with_triton_and_an_nf4_base_only(tokenizer, monkeypatch):
    """The dispatch CI can check without Triton or a GPU: CUDA, Triton importable, --fast-paths auto, nf4."""
    model = qlora_model(tokenizer)
    monkeypatch.setattr(nf4, "triton_available", lambda: True)
    assert nf4.PATH.applies(Setting(_cfg(), "cuda"), model)
    assert not nf4.PATH.applies(Setting(_cfg(), "cpu"), model)
    assert not nf4.PATH.applies(Setting(_cfg(), "mps"), model)
    assert not nf4.PATH.applies(Setting(_cfg(fast_paths="off"), "cuda"), model)
    assert not nf4.PATH.applies(Setting(TrainConfig(quantize_base="int4"), "cuda"), model)
    monkeypatch.setattr(nf4, "triton_available", lambda: False)
    assert not nf4.PATH.applies(Setting(_cfg(), "cuda"), model)


def test_applied_every_nf4_linear_runs_the_op_and_undo_gives_torchao_s_forward_back(tokenizer, monkeypatch):
    model = qlora_model(tokenizer)
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    calls = []
    op = nf4.nf4_mm

    def counted(*args):
        calls.append(args[-1])
        return op(*args)

    monkeypatch.setattr(nf4, "nf4_mm", counted)
    x = torch.randn(3, 4, 64).to(torch.bfloat16)
    want = [m(x) for m in quant if m.in_features == 64]
    assert nf4.PATH.apply(model) == nf4.PATH.name
    assert all(replaced_by(m) == nf4.PATH.name for m in quant)
    got = [m(x) for m in quant if m.in_features == 64]
    assert calls and all(calls)  # each forward product through the op
    for a, b in zip(got, want, strict=True):
        assert relative_error(a, b) < 1e-2
    nf4.PATH.undo(model)
    assert not any(replaced_by(m) for m in quant)
    assert all(torch.equal(m(x), w) for m, w in zip([m for m in quant if m.in_features == 64], want, strict=True))


def test_fp32_outside_autocast_takes_the_plain_product(monkeypatch):
    """The kernels multiply in bf16 or fp16: an fp32 product keeps torchao's exact path."""
    layer = _layer(dtype=torch.float32)
    nf4.fuse_nf4(layer)
    monkeypatch.setattr(nf4, "nf4_mm", lambda *a: pytest.fail("fp32 reached the op"))
    x = torch.randn(4, 256)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.qweight.get_original_weight()))


def test_the_faster_strategy_is_timed_once_per_shape_and_kept(monkeypatch):
    monkeypatch.setattr(nf4, "CHOICE", {})
    timed = []

    def fake_timed(fn, repeat=3):
        name = fn()
        timed.append(name)
        return {"fused": 2.0, "dequantize": 1.0}[name]

    monkeypatch.setattr(nf4, "_timed", fake_timed)
    x = torch.empty(300, 64)
    assert nf4.strategy(x, 128, 64, True, lambda name: name) == "dequantize"
    assert nf4.strategy(torch.empty(400, 64), 128, 64, True, lambda name: name) == "dequantize"  # same bucket
    assert timed == ["fused", "dequantize"]
    assert nf4.strategy(x, 128, 64, False, lambda name: name) == "dequantize"  # another shape: timed again
    assert len(timed) == 4
    monkeypatch.setattr(nf4, "FORCE", "fused")
    assert nf4.strategy(x, 128, 64, True, lambda name: name) == "fused"


def test_compiled_layers_capture_the_op_in_one_graph(monkeypatch):
    """torch.compile (dynamo + AOT autograd) takes the replaced forward and the op's backward without a break."""
    eager_aot_compile(monkeypatch)
    layer = _layer()
    nf4.fuse_nf4(layer)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(6, 256).to(torch.bfloat16).requires_grad_()
    y = compiled(x)
    y.float().square().sum().backward()
    want_x = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(want_x, layer.qweight.get_original_weight()).float().square().sum().backward()
    assert relative_error(x.grad, want_x.grad) < 2e-2
    torch._dynamo.reset()


KERNEL_CHECK = """
import sys, torch
from tunesmith.kernels import nf4
from tunesmith.qlora import QuantLinear
nf4.INTERPRET = True
worst = 0.0
torch.manual_seed(0)
# fp32 and fp16 weights (the interpreter's bf16 casts and products are not the GPU's; bf16 is checked there)
for dtype in (torch.float32, torch.float16):
    for out_f, in_f, m in ((96, 256, 40), (80, 192, 7)):  # row and column tiles cut short, a block's scales
        layer = QuantLinear.from_weight(torch.randn(out_f, in_f).to(dtype), "nf4")
        q = layer.qweight
        parts = (*nf4.nf4_parts(q), out_f, in_f, q.scaler_block_size)
        ref = q.get_original_weight()
        assert torch.equal(nf4.dequantize_triton(*parts, dtype), ref)
        joined = nf4.joined_weight([*nf4.nf4_parts(q)] * 2, [out_f, in_f, q.scaler_block_size] * 2, dtype)
        assert torch.equal(joined, torch.cat([ref, ref]))  # each decoded into its rows of one buffer
        x, g = torch.randn(m, in_f).to(dtype), torch.randn(m, out_f).to(dtype)
        for tiles in ((32, 32, 64, 2, 4, 1), (16, 64, 32, 1, 4, 1)):
            y = nf4.mm_triton(x, *parts, True, tiles)
            gx = nf4.mm_triton(g, *parts, False, tiles)
            for got, want in ((y, x.double() @ ref.double().t()), (gx, g.double() @ ref.double())):
                assert got.dtype == dtype and got.shape == want.shape
                worst = max(worst, ((got.double() - want).abs().max() / want.abs().max()).item())
        for strategy in nf4.STRATEGIES:  # the op, forward and backward, through each strategy
            nf4.FORCE = strategy
            xr = x.clone().requires_grad_()
            y = nf4.nf4_mm(xr, *parts, True)
            y.backward(g)
            want = x.double() @ ref.double().t()
            worst = max(worst, ((y.double() - want).abs().max() / want.abs().max()).item())
            want = g.double() @ ref.double()
            worst = max(worst, ((xr.grad.double() - want).abs().max() / want.abs().max()).item())
print(worst)
"""


def test_the_kernels_equal_the_reference_under_triton_s_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed: the kernels are checked where it is")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) < 1e-3


def test_the_fused_loss_takes_the_4_bit_path_too(tokenizer):
    """A QLoRA model's output head stays a plain linear: the fused loss applies (on every device; Liger's kernel on
    CUDA) and gives the plain loss and LoRA gradients."""
    from tunesmith import kernels
    from tunesmith.kernels import liger_loss, loss

    from .kernel_fixtures import loss_and_grads, make_batch

    model = qlora_model(tokenizer, dtype=torch.float32)
    for device in ("cpu", "mps", "cuda"):
        assert loss.PATH.applies(Setting(_cfg(), device), model)
    assert liger_loss.supports_chunked_loss(model)
    applied = kernels.apply_paths(model, Setting(_cfg(), "cpu"))
    assert applied.loss is loss.chunked_loss_sum
    batch = make_batch(tokenizer)
    want, want_grads = loss_and_grads(model, batch)
    got, got_grads = loss_and_grads(model, batch, loss=applied.loss)
    applied.undo(model)
    assert relative_error(got, want) <= loss.PATH.tolerance
    assert max(relative_error(got_grads[n], want_grads[n]) for n in want_grads) <= 1e-4


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("arch", [80, 90])
def test_the_kernels_compile_for_ampere_and_hopper(arch, transposed):
    """The kernels as the GPU builds them (Triton's own ptxas, no GPU needed), at the trainer's tiles and bf16:
    what the interpreter cannot check (the products' precision, the joined nibbles' layout, the registers)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    bm, bn, bk, group, warps, stages = nf4.FUSED_TILES
    types = {"X": "*bf16", "Q": "*u8", "QS": "*i8", "QF": "*bf16", "LUT": "*bf16", "MEAN": "*bf16", "Y": "*bf16"}
    consts = {"TRANSPOSED": transposed, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group,
              "PRECISION": "tf32"}
    names = nf4._mm_kernel.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    # as a launch on the trainer's shapes specializes it: every pointer and size a multiple of 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in consts and n != "MEAN"}
    src = ASTSource(nf4._mm_kernel, signature, {(names.index(n),): v for n, v in consts.items()}, attrs)
    built = compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    assert built.asm["cubin"] and built.metadata.shared <= 228 * 1024
    nb, dwarps = nf4.DEQUANT_TILES
    names = nf4._dequant_kernel.arg_names
    consts = {"NB": nb}
    signature = {n: "constexpr" if n in consts else {**types, "W": "*bf16"}.get(n, "i32") for n in names}
    src = ASTSource(nf4._dequant_kernel, signature, {(names.index(n),): v for n, v in consts.items()})
    assert compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": dwarps}).asm["cubin"]
