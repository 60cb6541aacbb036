"""Keras export and framework parity: a tiny Llama through KerasHub on JAX and TensorFlow matches PyTorch, the preset
reloads with plain keras_hub in a fresh process, and what cannot convert (or is not installed) is named."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import make_model
from tunesmith.config import ParityConfig
from tunesmith.errors import TunesmithError
from tunesmith.export import keras as K
from tunesmith.parity import ParityMismatch

IDS = [5, 17, 42, 99, 123, 7, 64, 3]


def _installed(backend: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("keras_hub", backend))


BACKENDS = [
    pytest.param(b, marks=[pytest.mark.slow, pytest.mark.skipif(
        not _installed(b), reason=f"needs the {b} extra: pip install 'tunesmith[{b}]' (make test-keras)")])
    for b in K.BACKENDS
]

# ------------------------------------------------------------------------------------------------ no Keras needed


@pytest.mark.parametrize("backend", K.BACKENDS)
def test_a_missing_extra_is_named(monkeypatch, backend):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == backend else real(name, *a))
    with pytest.raises(TunesmithError, match=rf"pip install 'tunesmith\[{backend}\]'"):
        K.require(backend)
    with pytest.raises(TunesmithError, match=rf"tunesmith\[{backend}\]"):
        K.framework_parity(ParityConfig(model="unused", framework=backend), progress=False)


def test_an_architecture_kerashub_does_not_convert_is_refused_by_name(tmp_path):
    config = {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}
    with pytest.raises(TunesmithError, match="no converter for GPTNeoXForCausalLM"):
        K.keras_settings(config, tmp_path)


def test_llama_settings_carry_what_the_converter_drops(tmp_path):
    config = {"model_type": "llama", "num_attention_heads": 4, "hidden_size": 64, "rms_norm_eps": 1e-5}
    assert K.keras_settings(config, tmp_path) == {"layer_norm_epsilon": 1e-5}
    with pytest.raises(TunesmithError, match="head_dim 32.*mlp_bias"):
        K.keras_settings({**config, "head_dim": 32, "mlp_bias": True}, tmp_path)


def test_only_float_precisions_export():
    assert K.check_quant("bf16") == "bf16"
    with pytest.raises(TunesmithError, match="fp32, bf16"):
        K.check_quant("8bit")


def test_export_refuses_a_file_name_or_a_foreign_folder(tmp_path):
    with pytest.raises(TunesmithError, match="preset folder"):
        K._check_output(tmp_path / "model.keras")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(TunesmithError, match="not a tunesmith export"):
        K._check_output(tmp_path / "busy")


def test_the_ladder_skips_a_keras_preset_whose_backend_is_missing(monkeypatch, tmp_path):
    from tunesmith.compare import _keras_presets

    for backend in K.BACKENDS:
        (tmp_path / f"keras-{backend}").mkdir()
        (tmp_path / f"keras-{backend}" / K.MARKER).write_text(json.dumps({"format": "keras", "backend": backend}))
    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx" / K.MARKER).write_text(json.dumps({"format": "mlx"}))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jax" else real(name, *a))
    lines = []
    found = _keras_presets(tmp_path, lines.append)
    assert "keras-jax" not in [f.name for f, _ in found] and "mlx" not in [f.name for f, _ in found]
    assert any("keras-jax skipped" in line and "tunesmith[jax]" in line for line in lines)


# ------------------------------------------------------------------------------------------------ on each backend


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory, tokenizer):
    """Shaped like SmolLM2: tied embeddings, rope theta 100000 and RMSNorm epsilon 1e-5 (KerasHub's default is 1e-6)."""
    model = make_model(tokenizer, seed=3, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)
    path = tmp_path_factory.mktemp("smol-llama-keras")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def exported(smol_dir, tmp_path_factory):
    """backend -> its exported preset folder, made once per backend."""
    made = {}

    def get(backend):
        if backend not in made:
            made[backend] = K.export(smol_dir, tmp_path_factory.mktemp(f"keras-{backend}") / "preset", "fp32", None,
                                     256, backend=backend)
        return made[backend]

    return get


FRESH = """
import json, sys
import numpy as np
import keras_hub
assert "tunesmith" not in sys.modules and "torch" not in sys.modules
lm = keras_hub.models.CausalLM.from_preset(sys.argv[1])
x = np.asarray([json.loads(sys.argv[2])], dtype="int32")
h = lm.backbone({"token_ids": x, "padding_mask": np.ones_like(x)})
np.save(sys.argv[3], np.asarray(lm.backbone.token_embedding(h, reverse=True), dtype="float32")[0])
print(lm.preprocessor.tokenizer.start_token, lm.preprocessor.tokenizer.end_token)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_preset_reloads_with_plain_keras_hub_and_gives_pytorchs_logits(backend, exported, smol_dir, tmp_path):
    folder = exported(backend)
    record = json.loads((folder / K.MARKER).read_text())
    assert record["backend"] == backend and all(record["check"]["greedy_match"])
    assert record["check"]["reload_max_abs"] <= 1e-5
    out = tmp_path / "logits.npy"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"KERAS_BACKEND": backend}
    done = subprocess.run([sys.executable, "-P", "-c", FRESH, str(folder), json.dumps(IDS), str(out)], env=env,
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["<|im_start|>", "<|im_end|>"]  # the model's own bos / eos, not Llama 3's
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(np.load(out), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_framework_parity_passes_in_fp32_and_bf16_and_fails_beyond_a_tolerance(backend, smol_dir):
    cfg = ParityConfig(model=str(smol_dir), framework=backend, max_tokens=8)
    fp32, bf16 = K_results = parity_with_console(cfg)
    assert [r.precision for r in K_results] == ["fp32", "bf16"]
    assert fp32.passed and all(fp32.greedy_match) and fp32.top1_agreement == 1.0 and fp32.max_abs < 1e-4
    assert bf16.passed and bf16.positions == fp32.positions
    strict = ParityConfig(model=str(smol_dir), framework=backend, precision="fp32", max_tokens=0, tolerance=1e-12)
    with pytest.raises(ParityMismatch) as e:
        parity_with_console(strict)
    assert e.value.exit_code == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_logits_come_out_of_an_fp32_projection(backend, smol_dir, tokenizer):
    """bf16 weights and compute, but the output projection in fp32: logits rounded to bf16 flip near-tied top-1
    tokens (the bf16 criterion in docs/EXPORT.md). Rounded logits would all survive a trip through bf16."""
    out = K.run_worker(backend, K.hf_request(smol_dir, "bf16", tokenizer, sequences=[IDS]))
    logits = torch.from_numpy(out.logits[0])
    assert logits.dtype == torch.float32 and logits.shape[0] == len(IDS)
    assert not torch.equal(logits, logits.bfloat16().float())
    fp32 = torch.from_numpy(K.run_worker(backend, K.hf_request(smol_dir, "fp32", tokenizer, sequences=[IDS])).logits[0])
    assert (logits - fp32).abs().max() < 0.1 * fp32.abs().max()  # still the same model, in bf16


def parity_with_console(cfg):
    from rich.console import Console

    with open(os.devnull, "w") as sink:
        return K.framework_parity(cfg, Console(file=sink), progress=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_ladder_scores_a_keras_preset_as_pytorch_scores_the_model(backend, exported, smol_dir, tokenizer):
    from tunesmith.compare import score_keras
    from tunesmith.evaluate import evaluate

    folder = exported(backend)
    examples = [(IDS, IDS), (IDS[::-1], IDS[::-1])]
    rung = score_keras(folder, json.loads((folder / K.MARKER).read_text()), tokenizer, examples, ["the quick"], 4)
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    want = evaluate(model, examples, 4, 0, tokenizer.pad_token_id).perplexity
    assert rung.name == f"keras {backend} fp32" and rung.bytes > 0 and len(rung.samples) == 1
    assert rung.perplexity == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma3_exports_with_its_check_passing_and_reloads(backend, tmp_path):
    """Gemma 3 (text) through KerasHub's own converter: the export's check (PyTorch's greedy tokens, logits within
    the fp32 tolerance) and the fresh reload pass. KerasHub's generate() fails on Gemma 3 with the preprocessor
    detached (its text-only `images: None` output); the worker calls the compiled generate function instead."""
    from .ship_fixtures import make_gemma3, make_spm_tokenizer

    tokenizer = make_spm_tokenizer()
    source = tmp_path / "gemma3"
    make_gemma3(tokenizer, layers=6, hidden=64).save_pretrained(source)
    tokenizer.save_pretrained(source)
    folder = K.export(source, tmp_path / "preset", "fp32", None, 256, backend=backend)
    record = json.loads((folder / K.MARKER).read_text())
    assert all(record["check"]["greedy_match"]) and record["check"]["reload_max_abs"] <= 1e-5
    assert record["check"]["max_abs"] < 1e-3
