"""Fused q/k/v (kernels.qkv) against PEFT's three LoRA projections and transformers' RoPE."""

import pytest
import torch
import torch.nn.functional as F

from tunesmith.kernels import qkv, rope

from .kernel_fixtures import lora_model, lora_pair, loss_and_grads, make_batch


def _attn(model, i=0):
    return model.base_model.model.model.layers[i].self_attn


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "k_proj", "v_proj"), ("q_proj", "v_proj")])
@pytest.mark.parametrize("rope_kernel", [False, True])
def test_fused_qkv_gives_peft_s_loss_and_gradients(tokenizer, targets, rope_kernel, monkeypatch):
    # rope_kernel: RoPE straight out of the joined product (rope.rope_qkv, its PyTorch reference on the CPU)
    monkeypatch.setattr(qkv, "ROPE_ON_CPU", rope_kernel)
    calls, original = [], rope._forward_reference
    monkeypatch.setattr(rope, "_forward_reference", lambda *a: calls.append(1) or original(*a))
    plain, fast = lora_pair(tokenizer, targets=targets)
    assert qkv.fuse_qkv(fast) == 2
    attn = _attn(fast)
    whole = attn.tunesmith_qkv_weight
    assert whole.shape == (64 + 32 + 32, 64)  # 4 heads of 16 for q, 2 KV heads for k and v
    for p in qkv.QKV:  # the frozen weights are views into the joined one: no second copy
        w = qkv._holder(getattr(attn, p)).weight
        assert w.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() and not w.requires_grad
    batch = make_batch(tokenizer)
    ref_loss, ref = loss_and_grads(plain, batch)
    got_loss, got = loss_and_grads(fast, batch)
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert set(got) == set(ref) and len(ref) == {1: 28, 3: 12, 2: 8}[len(targets)]
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    assert len(calls) == (2 if rope_kernel else 0)  # one call a layer
    # under bf16 autocast it follows PEFT's path as closely as two bf16 paths can
    ref_loss, ref = loss_and_grads(plain, batch, autocast=torch.bfloat16)
    got_loss, got = loss_and_grads(fast, batch, autocast=torch.bfloat16)
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-2)
    for name in ref:
        assert got[name].dtype == torch.float32
        assert F.cosine_similarity(got[name].flatten(), ref[name].flatten(), dim=0) > 0.99, name


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "v_proj")])
def test_over_an_nf4_base_fused_qkv_decodes_the_three_weights_for_one_product(tokenizer, targets, monkeypatch):
    """QLoRA's attentions take fused q/k/v too: the three nf4 weights (k's without an adapter too) decoded into
    one buffer for one product forward and one backward (nf4.nf4_joined_mm), never dequantized whole by the
    layers, and loss and LoRA gradients are PEFT's over the same nf4 layers; undone, the codes are untouched."""
    from tunesmith.kernels import nf4
    from tunesmith.lora import attach_lora
    from tunesmith.qlora import QuantLinear, quantize_base

    from .conftest import make_model

    def model():
        m = attach_lora(quantize_base(make_model(tokenizer).float(), "nf4"), rank=4, alpha=8, dropout=0.0,
                        targets=list(targets))
        torch.manual_seed(1)
        for name, p in m.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        return m

    plain, fast = model(), model()
    assert qkv.fuse_qkv(fast) == 2 and not hasattr(_attn(fast), "tunesmith_qkv_weight")
    codes = qkv._holder(_attn(fast).k_proj).qweight.quantized_data.clone()
    batch = make_batch(tokenizer)
    ref_loss, ref = loss_and_grads(plain, batch)
    joined, real = [], nf4.nf4_joined_mm
    monkeypatch.setattr(nf4, "nf4_joined_mm", lambda x, p, z, t: joined.append((len(p), t)) or real(x, p, z, t))
    with monkeypatch.context() as patch:
        patch.setattr(QuantLinear, "dequantize", lambda *a, **k: pytest.fail("a base dequantized whole"))
        got_loss, got = loss_and_grads(fast, batch)
    # each layer's forward, then the input's gradient of the second (the first's input is the frozen embedding's)
    assert joined == [(15, True)] * 2 + [(15, False)]
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-3, atol=1e-5, msg=name)
    qkv.unfuse_qkv(fast)
    assert "forward" not in _attn(fast).__dict__ and not hasattr(_attn(fast), "tunesmith_qkv_names")
    assert torch.equal(qkv._holder(_attn(fast).k_proj).qweight.quantized_data, codes)


def test_fused_qkv_is_what_runs_and_gives_way_where_it_does_not_apply(tokenizer, monkeypatch):
    plain, fast = lora_pair(tokenizer)
    qkv.fuse_qkv(fast)
    ids = {k: v for k, v in make_batch(tokenizer).items() if k in ("input_ids", "attention_mask")}
    calls = []
    q = _attn(fast).q_proj
    monkeypatch.setattr(q, "forward", lambda x, *a, **k: calls.append(1) or type(q).forward(q, x, *a, **k))
    with torch.no_grad():
        adapted = fast(**ids, use_cache=False).logits
        assert calls == []  # the joined product ran, not q_proj's own forward
        torch.testing.assert_close(adapted, plain(**ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
        with fast.disable_adapter(), plain.disable_adapter():  # adapters off: the model's own forward
            torch.testing.assert_close(fast(**ids, use_cache=False).logits, plain(**ids, use_cache=False).logits)
        assert len(calls) == 1
        # generation with a KV cache: the model's own forward, the same tokens
        prompt = ids["input_ids"][:1, :5]
        out = [m.generate(input_ids=prompt, max_new_tokens=6, do_sample=False) for m in (fast, plain)]
        assert torch.equal(out[0], out[1])


def test_fused_qkv_leaves_dropout_and_partial_targets_alone_and_undoes_itself(tokenizer):
    assert qkv.fuse_qkv(lora_model(tokenizer, dropout=0.1)) == 0  # each projection draws its own dropout mask
    assert qkv.fuse_qkv(lora_model(tokenizer, targets=("o_proj", "up_proj"))) == 0  # no adapter on q, k or v
    plain, fast = lora_pair(tokenizer)
    qkv.fuse_qkv(fast)
    qkv.unfuse_qkv(fast)
    attn = _attn(fast)
    assert "forward" not in attn.__dict__ and not hasattr(attn, "tunesmith_qkv_weight")
    ptrs = {qkv._holder(getattr(attn, p)).weight.untyped_storage().data_ptr() for p in qkv.QKV}
    assert len(ptrs) == 3  # each weight its own tensor again: merging and saving see plain layers
    merged = fast.merge_and_unload()
    ref = plain.merge_and_unload()
    for (n, a), (_, b) in zip(merged.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=n)
