"""Core ML export: the static decode-step wrapper equals the HF model, and the saved .mlpackage spec is what it claims.

Conversion runs on Linux; prediction needs macOS's Core ML, so off macOS the prediction test skips and the spec
(inputs, outputs, dtypes, ops, compression) is what is checked.
"""

import json
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tunesmith.errors import TunesmithError
from tunesmith.export import coreml as C

from .conftest import CORPUS

ct = pytest.importorskip("coremltools", reason="needs the coreml extra: pip install 'tunesmith[coreml]'")

SEQ = 32


def _step_through(step, ids):
    """Feed `ids` one token at a time, keeping the KV cache as an app would; the logits at every position."""
    k, v = torch.zeros(step.cache_shape()), torch.zeros(step.cache_shape())
    out = []
    with torch.no_grad():
        for pos, token in enumerate(ids):
            logits, k_new, v_new = step(
                torch.tensor([[token]], dtype=torch.int32), torch.tensor([pos], dtype=torch.int32), k, v
            )
            k[:, :, pos], v[:, :, pos] = k_new[:, :, 0], v_new[:, :, 0]
            out.append(logits[0, 0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def step(tiny_dir):
    return C.load_step(tiny_dir, SEQ)[0]


def test_decode_step_with_its_cache_equals_the_hf_forward(step, tiny_dir, tokenizer):
    """The wrapper is what gets converted, so it must be the model: logits at every position of a full cache."""
    ids = tokenizer(CORPUS)["input_ids"][:SEQ]
    assert len(ids) == SEQ  # fills every cache slot, so the mask edge is exercised
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_step_through(step, ids), want, atol=1e-5, rtol=1e-5)


def test_traced_wrapper_equals_eager(step):
    """Conversion goes through torch.jit.trace; a trace must not freeze the position or the cache contents."""
    g = torch.Generator().manual_seed(0)
    inputs = (
        torch.tensor([[7]], dtype=torch.int32),
        torch.tensor([5], dtype=torch.int32),
        torch.randn(step.cache_shape(), generator=g),
        torch.randn(step.cache_shape(), generator=g),
    )
    with torch.no_grad():
        traced = torch.jit.trace(step, step.example_inputs())
        for got, want in zip(traced(*inputs), step(*inputs), strict=True):
            torch.testing.assert_close(got, want)


@pytest.fixture(scope="module")
def packages(tiny_dir, tmp_path_factory):
    """One export per --quant (conversion is the slow part, so the tests share them)."""
    root = tmp_path_factory.mktemp("coreml")
    return {q: C.export(tiny_dir, root / q, q, 32, SEQ) for q in C.QUANTS}


@pytest.mark.parametrize("quant", list(C.QUANTS))
def test_saved_spec_has_the_static_io_ops_and_compression(quant, packages, step):
    package = packages[quant]
    info = C.validate(package, step, quant)  # raises on any mismatch of names, shapes or dtypes
    assert info["spec_version"] >= 9  # iOS 18 / macOS 15
    assert info["inputs"]["k_cache"] == (2, 2, SEQ, 16) and info["outputs"]["logits"] == (
        1,
        1,
        step.lm_head.out_features,
    )
    ops = info["ops"]
    assert ops["linear"] == 2 * 7 + 1  # q, k, v, o, gate, up, down per block + the output head
    assert ops["softmax"] == 2 and "gather" in ops  # one attention per block; the embedding is a gather
    quantized = {k: v for k, v in ops.items() if k.startswith("constexpr_")}
    if quant in ("int8", "int4"):
        assert quantized.get("constexpr_blockwise_shift_scale", 0) >= 2 * 5  # every matrix over 2048 weights
    else:
        assert not quantized
    spec = ct.utils.load_spec(str(package))
    assert json.loads(spec.description.metadata.userDefined["max_seq_len"]) == SEQ
    assert spec.description.metadata.userDefined["quant"] == quant


def test_weight_compression_shrinks_the_package(packages):
    def weights(q):
        return sum(f.stat().st_size for f in (packages[q] / "Data").rglob("*.bin"))

    assert weights("fp16") < 0.55 * weights("fp32")
    assert weights("int8") < weights("fp16") and weights("int4") < weights("int8")


def test_output_folder_carries_tokenizer_and_description(packages):
    folder = packages["fp16"].parent
    assert packages["fp16"].name == "model.mlpackage"
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    meta = json.loads((folder / C.MARKER).read_text())
    assert meta["inputs"] == list(C.INPUTS) and meta["outputs"] == list(C.OUTPUTS)
    assert (meta["layers"], meta["kv_heads"], meta["head_dim"], meta["max_seq_len"]) == (2, 2, 16, SEQ)


@pytest.mark.skipif(
    sys.platform != "darwin", reason="Core ML prediction runs only on macOS; on Linux the spec is validated"
)
def test_prediction_matches_pytorch_on_macos(packages, step, tokenizer):
    model = ct.models.MLModel(str(packages["fp32"]), compute_units=ct.ComputeUnit.CPU_ONLY)
    ids = tokenizer("ROMEO:\nBut soft")["input_ids"]
    k, v = torch.zeros(step.cache_shape()).numpy(), torch.zeros(step.cache_shape()).numpy()
    got = []
    for pos, token in enumerate(ids):
        out = model.predict({"input_ids": [[token]], "position": [pos], "k_cache": k, "v_cache": v})
        k[:, :, pos], v[:, :, pos] = out["k_new"][:, :, 0], out["v_new"][:, :, 0]
        got.append(torch.from_numpy(out["logits"][0, 0]))
    torch.testing.assert_close(torch.stack(got), _step_through(step, ids), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "quant,group,seq,msg",
    [
        ("q4_0", 32, SEQ, "choose one of fp32, fp16, int8, int4"),
        ("int4", 48, SEQ, "power of two"),
        ("fp16", 32, 4096, "between 2 and the model's context"),
    ],
)
def test_bad_options_are_clear_errors(quant, group, seq, msg, tiny_dir, tmp_path):
    with pytest.raises(TunesmithError, match=msg):
        C.export(tiny_dir, tmp_path / "out", quant, group, seq)


def test_other_architectures_are_refused_by_name(tmp_path):
    from transformers import Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen")
    with pytest.raises(TunesmithError, match="supports the Llama family and Gemma 3.*'qwen2'"):
        C.export(tmp_path / "qwen", tmp_path / "out", "fp16", 32, SEQ)


def test_missing_coremltools_names_the_extra(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "coremltools", None)
    with pytest.raises(TunesmithError, match=r"pip install 'tunesmith\[coreml\]'"):
        C.export(tiny_dir, tmp_path / "out", "fp16", 32, SEQ)


@pytest.mark.parametrize(
    "target,msg", [("model.mlpackage", "not an .mlpackage"), ("ship", "not a tunesmith export folder")]
)
def test_a_foreign_path_is_not_overwritten(target, msg, tiny_dir, tmp_path):
    (tmp_path / target).mkdir()
    (tmp_path / target / "notes.txt").write_text("mine")
    with pytest.raises(TunesmithError, match=msg):
        C.export(tiny_dir, tmp_path / target, "fp16", 32, SEQ)
    assert [p.name for p in (tmp_path / target).iterdir()] == ["notes.txt"]
