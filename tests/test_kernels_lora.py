"""Fused LoRA (kernels.lora) against PEFT's LoRA layers."""

import pytest
import torch
import torch.nn.functional as F

from tunesmith.kernels import lora
from tunesmith.lora import attach_lora

from .conftest import make_model
from .kernel_fixtures import lora_pair, loss_and_grads, make_batch


def _fused_pair(tokenizer, dropout=0.0, targets=("all-linear",), dtype=torch.float32):
    """Two copies of one tiny Llama with the same LoRA adapters (B not zero): the second with the fused forward."""
    plain, fast = lora_pair(tokenizer, dropout=dropout, targets=targets, dtype=dtype)
    assert lora.fuse_lora(fast) == (14 if targets == ("all-linear",) else 4)
    return plain, fast


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_lora_gives_peft_s_loss_and_gradients(tokenizer, dropout):
    plain, fast = _fused_pair(tokenizer, dropout=dropout)
    batch = make_batch(tokenizer)
    ref_loss, ref = loss_and_grads(plain, batch)
    got_loss, got = loss_and_grads(fast, batch)
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert set(got) == set(ref) and len(ref) == 28  # A and B of 7 linears x 2 layers
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # the fused path is what ran: its backward node, not PEFT's add
    x = torch.randn(2, 3, 64, requires_grad=True)
    q = fast.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q(x).grad_fn).__name__ == "_LoraLinearBackward"


def test_fused_lora_under_bf16_autocast_follows_peft_s(tokenizer):
    plain, fast = _fused_pair(tokenizer)
    batch = make_batch(tokenizer)
    ref_loss, ref = loss_and_grads(plain, batch, autocast=torch.bfloat16)
    got_loss, got = loss_and_grads(fast, batch, autocast=torch.bfloat16)
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-2)
    for name in ref:
        assert got[name].dtype == torch.float32  # fp32 LoRA weights keep fp32 gradients
        cos = F.cosine_similarity(got[name].flatten(), ref[name].flatten(), dim=0)
        assert cos > 0.99, name


def test_fused_lora_gives_way_where_it_does_not_apply(tokenizer):
    plain, fast = _fused_pair(tokenizer, targets=("q_proj", "v_proj"))
    ids = {k: v for k, v in make_batch(tokenizer).items() if k in ("input_ids", "attention_mask")}
    q = fast.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        adapted = fast(**ids).logits
        torch.testing.assert_close(adapted, plain(**ids).logits, rtol=1e-5, atol=1e-5)
        with fast.disable_adapter(), plain.disable_adapter():  # adapters off: the base layers alone
            torch.testing.assert_close(q(x), q.base_layer(x))
            base = fast(**ids).logits
            torch.testing.assert_close(base, plain(**ids).logits)
        assert (adapted - base).abs().max() > 1e-3  # the adapters do count when on
    # a dropout module PEFT does not make: PEFT's own forward applies it
    q.lora_dropout["default"] = torch.nn.Sequential(torch.nn.Dropout(0.1))
    assert type(q(x.requires_grad_()).grad_fn).__name__ != "_LoraLinearBackward"
    q.lora_dropout["default"] = torch.nn.Identity()
    assert type(q(x).grad_fn).__name__ == "_LoraLinearBackward"
    # fp16 weights outside autocast with fp32 adapters: mixed dtypes, PEFT's own path (which casts)
    q.base_layer.to(torch.float16)
    y = q(x.half().requires_grad_())
    assert type(y.grad_fn).__name__ != "_LoraLinearBackward"


def test_dora_and_a_quantized_base_are_not_routed_through_the_fused_lora(tokenizer):
    pytest.importorskip("torchao")
    from tunesmith.qlora import quantize_base

    dora = attach_lora(make_model(tokenizer), rank=4, alpha=8, dropout=0.0, targets=["q_proj"], dora=True)
    qlora = attach_lora(quantize_base(make_model(tokenizer), "int8"), rank=4, alpha=8, dropout=0.0,
                        targets=["q_proj"])
    assert lora.fuse_lora(qlora) == 0  # a quantized base layer is not a torch Linear
    lora.fuse_lora(dora)
    x = torch.randn(1, 2, 64, requires_grad=True)
    for model in (dora, qlora):
        q = model.base_model.model.model.layers[0].self_attn.q_proj
        assert type(q(x).grad_fn).__name__ != "_LoraLinearBackward"


def test_fused_lora_passes_over_layers_another_path_replaced_and_undoes_only_its_own(tokenizer):
    from tunesmith.kernels.base import replace_forward, replaced_by

    _, fast = lora_pair(tokenizer, targets=("q_proj", "v_proj"))
    q = fast.base_model.model.model.layers[0].self_attn.q_proj
    replace_forward(q, type(q).forward, "another path")
    assert lora.fuse_lora(fast) == 3
    lora.PATH.undo(fast)
    assert replaced_by(q) == "another path"
    assert sum("forward" in vars(m) for m in fast.modules()) == 1
