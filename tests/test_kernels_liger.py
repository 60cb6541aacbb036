"""Liger's RMSNorm, SwiGLU and RoPE (kernels.liger), with eager stand-ins for its CUDA kernels."""

import pytest
import torch

from tunesmith.kernels import liger
from tunesmith.lora import attach_lora

from .conftest import make_model
from .kernel_fixtures import install_fake_liger


@pytest.fixture
def fake_liger(monkeypatch):
    return install_fake_liger(monkeypatch)


def test_liger_replaces_this_model_s_norms_and_mlps_only(tokenizer, fake_liger):
    assert liger.liger_available()
    model, other = make_model(tokenizer), make_model(tokenizer)
    ids = torch.randint(3, len(tokenizer), (2, 10))
    with torch.no_grad():
        ref = model(ids).logits
    assert liger.PATH.apply(model) == "Liger rms_norm, rope, swiglu"
    model = attach_lora(model, 4, 8, 0.0, "all-linear")  # LoRA-wrapped projections inside the new MLP forward
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref)
        other(ids)
    layers = len(model.get_base_model().model.layers)
    assert fake_liger["swiglu"] == layers and fake_liger["rms_norm"] == 2 * layers + 1
    assert fake_liger["rope"] == 0  # CPU tensors keep transformers' RoPE


def test_liger_undone_gives_back_the_modules_and_transformers_rope(tokenizer, fake_liger):
    import transformers.models.llama.modeling_llama as modeling

    rope = modeling.apply_rotary_pos_emb
    model = make_model(tokenizer)
    liger.PATH.apply(model)
    assert modeling.apply_rotary_pos_emb is not rope
    liger.PATH.apply(make_model(tokenizer))  # a second model: the module's RoPE is swapped once
    assert modeling.apply_rotary_pos_emb._tunesmith_original is rope
    liger.PATH.undo(model)
    assert modeling.apply_rotary_pos_emb is rope
    assert not any("forward" in vars(m) or "_tunesmith_forwards" in vars(m) for m in model.modules())


def test_liger_leaves_other_architectures_alone(tokenizer, fake_liger):
    model = make_model(tokenizer)
    model.config.model_type = "gemma3_text"
    assert liger.PATH.apply(model) is None
