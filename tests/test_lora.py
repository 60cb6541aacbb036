"""Adapter invariants on a tiny Llama: zero-init B is a no-op, adapter == merged, plain PEFT/transformers load."""

import pytest
import torch

from tunesmith.errors import TunesmithError
from tunesmith.lora import attach_lora, trainable_parameters
from tunesmith.merge import merge_model

from .conftest import make_model


def _ids(tokenizer):
    return torch.tensor([tokenizer("ROMEO: But soft, what light", add_special_tokens=False)["input_ids"]])


def _perturbed(model, tokenizer):
    """A LoRA model whose B matrices are non-zero, as after training."""
    peft_model = attach_lora(model, rank=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return peft_model.eval()


def test_fresh_adapter_leaves_logits_unchanged(tokenizer):
    model = make_model(tokenizer)
    x = _ids(tokenizer)
    before = model(x).logits.clone()
    peft_model = attach_lora(model, rank=8, alpha=16, dropout=0.05, targets=["q_proj", "v_proj"]).eval()
    assert torch.equal(peft_model(x).logits, before)


def test_trainable_parameter_count_equals_its_formula(tokenizer):
    model = make_model(tokenizer)  # hidden 64, 4 heads, 2 kv heads (head_dim 16): q 64->64, v 64->32
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    r = 8
    q = r * (cfg.hidden_size + cfg.num_attention_heads * head_dim)
    v = r * (cfg.hidden_size + cfg.num_key_value_heads * head_dim)
    peft_model = attach_lora(model, rank=r, targets=["q_proj", "v_proj"])
    assert trainable_parameters(peft_model) == cfg.num_hidden_layers * (q + v) == 2 * (1024 + 768)


def test_all_linear_adapts_every_projection_but_the_head(tokenizer):
    model = make_model(tokenizer)
    peft_model = attach_lora(model, rank=2, targets=["all-linear"])
    adapted = {n.split(".")[-4] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_merged_logits_equal_adapter_logits(tokenizer, tmp_path):
    peft_model = _perturbed(make_model(tokenizer), tokenizer)
    x = _ids(tokenizer)
    with torch.no_grad():
        adapter_logits = peft_model(x).logits.clone()
    merged_dir = merge_model(peft_model, tokenizer, tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()  # plain transformers, nothing of ours
    with torch.no_grad():
        merged_logits = merged(x).logits
    assert (merged_logits - adapter_logits).abs().max() <= 1e-4
    assert not (adapter_logits - make_model(tokenizer)(x).logits).abs().max() < 1e-3  # the adapter did something
    assert (merged_dir / "model.safetensors").is_file() and (merged_dir / "tokenizer.json").is_file()
    assert not hasattr(merged.config, "quantization_config")


def test_saved_adapter_loads_with_plain_peft(tokenizer, tmp_path):
    peft_model = _perturbed(make_model(tokenizer), tokenizer)
    x = _ids(tokenizer)
    with torch.no_grad():
        expected = peft_model(x).logits.clone()
    peft_model.save_pretrained(tmp_path / "adapter", safe_serialization=True)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["README.md", "adapter_config.json",
                                                                         "adapter_model.safetensors"]
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(make_model(tokenizer), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, expected, atol=1e-6)


def test_a_target_that_matches_no_module_stops_with_the_linear_layer_names(tiny_model):
    with pytest.raises(TunesmithError) as e:
        attach_lora(tiny_model, targets=["q_prj", "v_proj"])
    msg = str(e.value)
    assert msg.startswith("--lora-targets: q_prj (did you mean q_proj?) matches no module")
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in msg
    assert not any("lora_" in n for n, _ in tiny_model.named_modules())  # nothing was attached


def test_targets_match_as_peft_matches_them_by_the_end_of_the_name(tiny_model):
    peft = attach_lora(tiny_model, targets=["self_attn.q_proj", "model.layers.0.self_attn.v_proj"])
    adapted = sorted(n.split(".model.", 1)[-1] for n, m in peft.named_modules() if hasattr(m, "lora_A"))
    assert adapted == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.q_proj"]


def test_a_target_typo_on_the_command_line_is_exit_2_and_writes_nothing(tmp_path, tiny_dir, text_file, capsys):
    from tunesmith.cli import main

    code = main(["train", "--model", str(tiny_dir), "--data", str(text_file), "--output", str(tmp_path / "run"),
                 "--seq-len", "32", "--max-steps", "1", "--device", "cpu", "--lora-targets", "q_prj,v_proj"])
    assert code == 2 and "q_prj (did you mean q_proj?)" in capsys.readouterr().err
    assert not (tmp_path / "run" / "adapter").exists()
