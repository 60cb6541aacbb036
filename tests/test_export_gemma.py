"""Gemma 3 in the export formats, on a tiny Gemma 3 (six layers, hidden 64) with a SentencePiece-style tokenizer."""

import json

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3Config

from tunesmith.errors import TunesmithError
from tunesmith.export import gguf as G
from tunesmith.export import kquant as K

from .conftest import CORPUS, SHARED_DATA
from .ship_fixtures import make_gemma3, make_spm_tokenizer

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? 2024  tabs\tand ünïcödé"


@pytest.fixture(scope="module")
def spm_tokenizer():
    return make_spm_tokenizer()


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, spm_tokenizer):
    path = tmp_path_factory.mktemp("tiny-gemma3")
    make_gemma3(spm_tokenizer).save_pretrained(path)
    spm_tokenizer.save_pretrained(path)
    return path


def _ids(tokenizer, text=TEXT):
    return torch.tensor([tokenizer(text)["input_ids"]])


def _logits(folder, ids, gguf_file=None):
    kw = {"gguf_file": gguf_file.name} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent if gguf_file else folder, dtype=torch.float32, **kw)
    with torch.no_grad():
        return model.eval()(ids).logits


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_gguf_f32_reads_back_exactly_with_the_same_tokens(gemma_dir, spm_tokenizer, tmp_path):
    """Exact logits prove the tensor names, the gemma3 hyper-parameters and the norms' +1 (transformers takes it
    off again); the tokenizer read back from the GGUF's SentencePiece tables gives the same ids."""
    path = G.export(gemma_dir, tmp_path, "f32", 32, 256)
    ids = _ids(spm_tokenizer)
    torch.testing.assert_close(_logits(None, ids, path), _logits(gemma_dir, ids), atol=1e-5, rtol=1e-5)
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in (TEXT, CORPUS[:300], "  leading spaces and 0123456789 \u65e5\u672c"):
        assert back(text)["input_ids"] == spm_tokenizer(text)["input_ids"]


def test_gguf_holds_gemma3_metadata_sentencepiece_tables_and_plus_one_norms(gemma_dir, spm_tokenizer, tmp_path):
    reader = gguf.GGUFReader(G.export(gemma_dir, tmp_path / "m.gguf", "f16", 32, 256))
    kv = {k: f.contents() for k, f in reader.fields.items()}
    assert kv["general.architecture"] == "gemma3"
    assert kv["gemma3.block_count"] == 6 and kv["gemma3.embedding_length"] == 64
    assert kv["gemma3.attention.key_length"] == kv["gemma3.attention.value_length"] == 256
    assert kv["gemma3.attention.head_count_kv"] == 1 and kv["gemma3.attention.sliding_window"] == 64
    assert kv["gemma3.rope.freq_base"] == 1e6  # the global layers'; llama.cpp fixes the sliding layers' at 1e4
    assert kv["tokenizer.ggml.model"] == "llama" and kv["tokenizer.ggml.add_space_prefix"] is False
    tokens, scores, types = (kv[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    assert tokens == spm_tokenizer.convert_ids_to_tokens(list(range(len(spm_tokenizer))))
    assert types[2] == gguf.TokenType.CONTROL and types[4 + 0x41] == gguf.TokenType.BYTE
    assert types[300] == gguf.TokenType.NORMAL and scores[300] > scores[301]  # merge priority by id
    assert kv["tokenizer.ggml.bos_token_id"] == 2 and kv["tokenizer.ggml.add_bos_token"] is True
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors and "blk.0.post_ffw_norm.weight" in tensors
    w = AutoModelForCausalLM.from_pretrained(gemma_dir).model.layers[0].self_attn.q_norm.weight.detach().numpy()
    np.testing.assert_array_equal(np.array(tensors["blk.0.attn_q_norm.weight"].data), w + 1)


@pytest.mark.parametrize("quant,bound", [("f16", 2e-3), ("q8_0", 4e-2), ("q4_k_m", 0.25)])
def test_gguf_quantized_reads_back_close(quant, bound, gemma_dir, spm_tokenizer, tmp_path):
    """Measured on this random tiny model: f16 8.7e-4, q8_0 2.3e-2, q4_k_m 0.19 (q4_0: 0.32). The 64-wide rows fall
    back from the k-quants to Q5_0 / Q8_0, as Gemma 3 270M's 640-wide rows do; attn_output (rows of 1024) is Q4_K.
    Gemma 3 270M's per-tensor types against llama.cpp's own Q4_K_M: test_export_kquant."""
    path = G.export(gemma_dir, tmp_path / f"m-{quant}.gguf", quant, 32, 256)
    ids = _ids(spm_tokenizer)
    assert _rel(_logits(None, ids, path), _logits(gemma_dir, ids)) < bound
    if quant == "q4_k_m":
        reader = gguf.GGUFReader(path)
        shapes = [(t.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors]
        assert {t.name: t.tensor_type.name for t in reader.tensors} == K.tensor_types(shapes, "q4_k_m")


@pytest.mark.parametrize("quant,ratio", [("q4_0", 0.75), ("q4_k_m", 0.95)])  # measured 0.64, 0.90
def test_gguf_gptq_reads_back_closer_than_round_to_nearest(quant, ratio, gemma_dir, spm_tokenizer, tmp_path):
    """GPTQ on Gemma 3: calibration replays each layer with its own mask and rotary table (the sixth layer is
    global), and the file is closer to the float model on held-out text than rounding to nearest. In the
    q4_k_m file the 64-wide rows are GPTQ's Q5_0 / Q8_0 and attn_output stays a rounded Q4_K."""
    speeches = (SHARED_DATA / "tinyshakespeare.txt").read_text().split("\n\n")[:400]
    ids = torch.tensor(sum((spm_tokenizer(s)["input_ids"] for s in speeches), [])[: 18 * 96]).view(18, 96)
    blocks, held_out = ids[:16].tolist(), ids[16:]
    ref = _logits(gemma_dir, held_out)
    rtn = _logits(None, held_out, G.export(gemma_dir, tmp_path / "rtn.gguf", quant, 32, 256))
    path = G.export(gemma_dir, tmp_path / "gptq.gguf", quant, 32, 256, calibration=blocks, progress=False)
    assert gguf.GGUFReader(path).fields[G.METHOD_KEY].contents().startswith("gptq")
    assert _rel(_logits(None, held_out, path), ref) < ratio * _rel(rtn, ref)


def test_multimodal_gemma3_and_other_architectures_are_refused_with_the_supported_list(tmp_path):
    Gemma3Config().save_pretrained(tmp_path / "g")
    with pytest.raises(TunesmithError, match=r"Llama family and Gemma 3 \(llama, gemma3_text\); this model is 'gemma3'"):
        G.export(tmp_path / "g", tmp_path / "out.gguf", "f16", 32, 256)


def test_gemma3_with_soft_capping_is_refused_by_setting(gemma_dir, tmp_path):
    import shutil

    src = tmp_path / "capped"
    shutil.copytree(gemma_dir, src)
    config = json.loads((src / "config.json").read_text())
    config["final_logit_softcapping"] = 30.0
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(TunesmithError, match="soft-capping"):
        G.export(src, tmp_path / "out.gguf", "f16", 32, 256)


def test_mlx_fp32_generates_the_same_32_greedy_tokens(gemma_dir, spm_tokenizer, tmp_path):
    mx = pytest.importorskip("mlx.core", reason="needs the mlx extra: pip install 'tunesmith[mlx]'")
    mlx_lm = pytest.importorskip("mlx_lm")
    from mlx_lm.generate import generate_step

    from tunesmith.export import mlx as M

    model, _ = mlx_lm.load(str(M.export(gemma_dir, tmp_path / "mlx", "fp32", None, 256)))
    ref = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    for prompt in ("ROMEO:\n", "JULIET:\nO Romeo"):
        ids = spm_tokenizer(prompt)["input_ids"]
        got = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=32)]
        seq = list(ids)
        with torch.no_grad():
            for _ in range(32):
                seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
        assert got == seq[len(ids):]


# ------------------------------------------------------------------------------------------ ExecuTorch (.pte)


def test_static_cache_wrapper_equals_hf_for_gemma3(gemma_dir):
    """Prefill then one token at a time through the wrapper's KV cache == the HF forward (no lowering)."""
    from tunesmith.export.executorch import StaticCacheLM

    from .test_export_pte import eager_step, prefill_then_decode

    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval().requires_grad_(False)
    x = list(range(5, 45))
    ref = model(torch.tensor([x])).logits[0]
    got = prefill_then_decode(eager_step(StaticCacheLM(model, 64)), x, 24)
    assert (got - ref).abs().max() <= 1e-5


def test_fp32_pte_logits_match_eager_within_1e_3(spm_tokenizer, tmp_path):
    """Lowered to XNNPACK: two layers (sliding-window ones) keep the lowering to seconds; the wrapper test above
    covers the six-layer pattern with both rope bases."""
    pytest.importorskip("executorch", reason="needs the ship extra: pip install 'tunesmith[ship]'")
    from tunesmith.export.executorch import export
    from tunesmith.pte_runtime import PteModel

    from .test_export_pte import prefill_then_decode

    folder = tmp_path / "gemma2l"
    make_gemma3(spm_tokenizer, layers=2).save_pretrained(folder)
    spm_tokenizer.save_pretrained(folder)
    pte = PteModel(export(folder, tmp_path / "model.pte", "fp32", 32, 64))
    ids = spm_tokenizer(CORPUS[:200])["input_ids"][:40]
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    got = prefill_then_decode(pte.logits, ids, 24)
    assert (got - ref.detach()).abs().max() <= 1e-3


def test_pte_beyond_the_sliding_window_is_refused(gemma_dir, tmp_path):
    from tunesmith.export.executorch import export

    with pytest.raises(TunesmithError, match="sliding window 64"):
        export(gemma_dir, tmp_path / "model.pte", "fp32", 32, 128)


# ------------------------------------------------------------------------------------------------- Core ML


def test_coreml_decode_step_equals_hf_and_the_spec_validates(gemma_dir, spm_tokenizer, tmp_path):
    """The converted wrapper stepped through a sequence with its cache is the HF forward; the saved fp16 package's
    spec validates (prediction itself needs macOS)."""
    pytest.importorskip("coremltools", reason="needs the coreml extra: pip install 'tunesmith[coreml]'")
    from tunesmith.export import coreml as C

    from .test_export_coreml import _step_through

    step = C.load_step(gemma_dir, 32)[0]
    ids = spm_tokenizer(CORPUS)["input_ids"][:32]
    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_step_through(step, ids), want, atol=1e-5, rtol=1e-5)
    package = C.export(gemma_dir, tmp_path / "coreml", "fp16", 32, 32)
    info = C.validate(package, step, "fp16")
    assert info["spec_version"] >= 9 and info["inputs"]["k_cache"] == (6, 1, 32, 256)
    assert info["ops"]["softmax"] == 6


def test_coreml_beyond_the_sliding_window_is_refused(gemma_dir, tmp_path):
    from tunesmith.export import coreml as C

    with pytest.raises(TunesmithError, match="sliding window 64"):
        C.load_step(gemma_dir, 128)
