"""Cheap activations recomputed in eager layers (kernels.recompute): less kept for the backward pass, the same
loss and gradients."""

import pytest
import torch

from tunesmith.kernels import liger, recompute

from .conftest import make_model
from .kernel_fixtures import install_fake_liger, kept_loss_grads, lora_pair


def _lean_pair(tokenizer, dtype=torch.float32):
    """One tiny Llama (its base weights in `dtype`, as train loads them) with LoRA on every linear (B not zero),
    and an identical copy with lean layers."""
    plain, lean = lora_pair(tokenizer, dtype=dtype)
    assert recompute.lean_layers(lean) == ["rms_norm", "swiglu"]
    return plain, lean


@pytest.mark.parametrize("autocast", [False, True])
def test_lean_layers_keep_less_and_give_the_same_loss_and_gradients(tokenizer, autocast):
    # bf16 as train runs it: a bf16 base, fp32 LoRA weights, autocast
    plain, lean = _lean_pair(tokenizer, torch.bfloat16 if autocast else torch.float32)
    ids = torch.randint(3, len(tokenizer), (2, 48))
    batch = {"input_ids": ids, "labels": ids.clone()}
    dtype = torch.bfloat16 if autocast else None
    plain_bytes, plain_loss, plain_grads = kept_loss_grads(plain, batch, autocast=dtype)
    lean_bytes, lean_loss, lean_grads = kept_loss_grads(lean, batch, autocast=dtype)
    assert torch.equal(lean_loss, plain_loss)  # the forward is the same computation
    assert plain_grads.keys() == lean_grads.keys() and len(plain_grads) == 2 * 7 * 2
    tol = dict(rtol=2e-2, atol=1e-4) if autocast else dict(rtol=1e-4, atol=1e-6)
    for name in plain_grads:
        torch.testing.assert_close(lean_grads[name], plain_grads[name], **tol)
    tokens, hidden, inter, layers = 2 * 48, 64, 128, 2
    # silu(gate) is no longer kept: one MLP-wide tensor a layer (fp32, or bf16 under autocast); under autocast each
    # norm also keeps its bf16 input instead of the fp32 upcast (half of 4 bytes x hidden, two norms a layer)
    saved = layers * tokens * inter * (2 if autocast else 4) + (layers * 2 * tokens * hidden * 2 if autocast else 0)
    assert plain_bytes - lean_bytes >= saved
    recompute.unlean_layers(lean)
    assert not any("forward" in vars(m) for m in lean.modules() if type(m).__name__.endswith(("RMSNorm", "MLP")))


def test_lean_norm_gives_the_weight_gradient_of_a_training_norm(tokenizer):
    plain, lean = _lean_pair(tokenizer)
    for model in (plain, lean):
        for name, p in model.named_parameters():
            p.requires_grad_("norm" in name)
    ids = torch.randint(3, len(tokenizer), (2, 48))
    batch = {"input_ids": ids, "labels": ids.clone()}
    _, _, plain_grads = kept_loss_grads(plain, batch)
    _, _, lean_grads = kept_loss_grads(lean, batch)
    assert len(plain_grads) == 2 * 2 + 1  # two norms a layer and the final one
    for name in plain_grads:
        torch.testing.assert_close(lean_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6)


def test_lean_layers_leave_other_architectures_alone(tokenizer):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert recompute.lean_layers(Gemma3ForCausalLM(config)) == []


def test_lean_layers_pass_over_modules_liger_already_replaced(tokenizer, monkeypatch):
    fake_liger = install_fake_liger(monkeypatch)
    model = make_model(tokenizer)
    assert liger.PATH.apply(model) == "Liger rms_norm, rope, swiglu"
    assert recompute.lean_layers(model) == []  # Liger's kernels keep no more than the lean functions would
    ids = torch.randint(3, len(tokenizer), (1, 16))
    calls = dict(fake_liger)
    model(input_ids=ids)
    assert fake_liger["swiglu"] > calls["swiglu"] and fake_liger["rms_norm"] > calls["rms_norm"]
    recompute.unlean_layers(model)  # leaves Liger's forwards in place
    assert all("forward" in vars(m) for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP")))
