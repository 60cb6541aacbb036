"""Weight-only int8 / int4: close to float within stated bounds, a self-describing folder that loads exactly."""

import copy
import json

import pytest
import torch

from tests.ship_fixtures import corpus_blocks, save, train_tiny
from tunesmith.cli import main
from tunesmith.config import QuantizeConfig
from tunesmith.errors import TunesmithError
from tunesmith.evaluate import evaluate
from tunesmith.models import load_model

pytest.importorskip("torchao", reason="quantize needs the ship extra: pip install 'tunesmith[ship]'")

from tunesmith.quantformat import (  # noqa: E402
    QUANT_FILE,
    CpuInt4Linear,
    CpuInt8Embedding,
    CpuInt8Linear,
    GroupOffsetLinear,
    load_quantized_model,
    pack_int4,
    save_quantized,
    unpack_int4,
)
from tunesmith.quantize import intx_groups, quantize, quantize_model, weights_bytes  # noqa: E402


@pytest.fixture(scope="module")
def trained(tokenizer):
    return train_tiny(tokenizer, steps=25)


@pytest.fixture(scope="module")
def held_out(tokenizer):
    return [(b, b) for b in corpus_blocks(tokenizer)][:16]


def ppl(model, examples) -> float:
    return evaluate(model, examples, 4, 0, 0).perplexity


@pytest.mark.parametrize("scheme,bound", [("int8", 0.01), ("int4", 0.05)])
def test_quantized_perplexity_within_bound_of_float(trained, held_out, scheme, bound):
    quantized = copy.deepcopy(trained)
    info = quantize_model(quantized, scheme, 32)
    assert info["quantized_linear_layers"] == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head
    float_ppl, q_ppl = ppl(trained, held_out), ppl(quantized, held_out)
    assert float_ppl < 10  # trained: the text is far from uniform (vocabulary ~400), so the bound means something
    assert abs(q_ppl / float_ppl - 1) <= bound


def test_int4_is_coarser_than_int8(trained, held_out):
    x = torch.tensor([held_out[0][0]])
    ref = trained(x).logits
    errors = {}
    for scheme in ("int8", "int4"):
        q = copy.deepcopy(trained)
        quantize_model(q, scheme, 32)
        errors[scheme] = float((q(x).logits - ref).abs().max() / ref.abs().max())
    assert 0 < errors["int8"] < 0.02 and errors["int8"] < errors["int4"] < 0.2


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_folder_round_trip_is_exact_and_self_describing(trained, tokenizer, tmp_path, scheme):
    float_dir = save(trained, tokenizer, tmp_path / "float")
    model, _ = load_model(str(float_dir))
    quantize_model(model, scheme, 64)
    out = save_quantized(model, tokenizer, tmp_path / scheme, {"scheme": scheme, "group_size": 64})
    assert {"config.json", "model.safetensors", "tokenizer.json", QUANT_FILE} <= {p.name for p in out.iterdir()}
    info = json.loads((out / QUANT_FILE).read_text())
    assert info["scheme"] == scheme and info["group_size"] == 64
    assert bool(info["packed_int4"]) == (scheme == "int4")

    x = torch.tensor([tokenizer("ROMEO:\nBut soft")["input_ids"]])
    assert torch.equal(load_quantized_model(out)(x).logits, model(x).logits)  # the weights, exactly
    reloaded, tok = load_model(str(out))  # the same entry point generate / eval use: aten's CPU kernels, bf16 inputs
    assert {type(m) for m in reloaded.modules()} >= {CpuInt8Embedding, CpuInt4Linear if scheme == "int4" else
                                                     CpuInt8Linear}
    ref = model(x).logits
    assert float((reloaded(x).logits - ref).norm() / ref.norm()) < 0.01
    assert tok.get_vocab() == tokenizer.get_vocab()
    # fp32 weights, int8 (1 byte + scales), int4 (half a byte + scales): the embedding is int8 in both.
    ratio = weights_bytes(out) / weights_bytes(float_dir)
    assert ratio < (0.32 if scheme == "int8" else 0.24)


def test_int4_codes_pack_two_per_byte_and_back():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)  # every code, in both nibbles
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16)
    assert torch.equal(unpack_int4(packed), q)


def test_tied_embeddings_are_untied_and_reload(tokenizer, tmp_path):
    tied = train_tiny(tokenizer, steps=5, tie=True)
    x = torch.tensor([tokenizer("JULIET:\nO Romeo")["input_ids"]])
    quantize_model(tied, "int4", 32)
    assert tied.lm_head.weight is not tied.model.embed_tokens.weight
    out = save_quantized(tied, tokenizer, tmp_path / "q", {"scheme": "int4"})
    reloaded = load_quantized_model(out)
    assert not reloaded.config.tie_word_embeddings
    assert torch.equal(reloaded(x).logits, tied(x).logits)


def test_quantize_verb_reports_float_and_quantized(trained, tokenizer, tmp_path, text_file):
    float_dir = save(trained, tokenizer, tmp_path / "float")
    cfg = QuantizeConfig(model=str(float_dir), data=str(text_file), seq_len=32, scheme="int4", group_size=32,
                         output=str(tmp_path / "q4"), eval_blocks=4, max_tokens=4, calibration_blocks=8)
    r = quantize(cfg)
    assert r.layers == 15 and (r.output / QUANT_FILE).is_file()
    info = json.loads((r.output / QUANT_FILE).read_text())
    assert info["method"].startswith("gptq") and info["calibration_blocks"] == 8
    assert r.float.bytes == weights_bytes(float_dir) and r.quantized.bytes == weights_bytes(r.output)
    assert info["grid"] == "affine" and info["kept_8bit"] == ["v_proj"] and len(info["affine_layers"]) == 12
    # int4 codes (half a byte) + a bf16 scale and a float16 offset per 32, v_proj and lm_head int8, embedding int8.
    assert r.quantized.bytes < 0.27 * r.float.bytes
    assert abs(r.quantized.perplexity / r.float.perplexity - 1) <= 0.05
    assert r.float.tokens_per_s > 0 and r.quantized.tokens_per_s > 0


def test_generate_and_eval_load_the_quantized_folder(trained, tokenizer, tmp_path, text_file, capsys):
    model = copy.deepcopy(trained)
    quantize_model(model, "int8", 32)
    out = save_quantized(model, tokenizer, tmp_path / "q8", {"scheme": "int8"})
    assert main(["generate", "--model", str(out), "--prompt", "ROMEO:", "--max-tokens", "5", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    assert main(["eval", "--model", str(out), "--data", str(text_file), "--seq-len", "32", "--device", "cpu"]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_bad_inputs_are_one_clear_error(tiny_dir, tmp_path, capsys):
    with pytest.raises(TunesmithError, match="group-size"):
        quantize_model(copy.deepcopy(load_model(str(tiny_dir))[0]), "int4", 48)
    with pytest.raises(TunesmithError, match="--output"):
        quantize(QuantizeConfig(model=str(tiny_dir), output=""))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_dir / "config.json").read_text())
    (bad / QUANT_FILE).write_text('{"format": "something-else"}')
    with pytest.raises(TunesmithError, match="re-run tunesmith quantize"):
        load_model(str(bad))
    assert main(["quantize", "--model", str(tiny_dir), "--scheme", "int4", "--output", str(tmp_path / "x"),
                 "--data", "nope.txt"]) == 2
    assert "data not found" in capsys.readouterr().err


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    from tunesmith.gptq import QMAX, QMIN, gptq, rtn

    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(64, 64, generator=gen)
    x = torch.randn(512, 64, generator=gen) @ mix  # correlated features, as real activations are
    w = torch.randn(48, 64, generator=gen)
    hessian = 2 * x.T @ x / len(x)
    (q_rtn, _, _), (q_gptq, scales, offsets) = rtn(w, 32), gptq(w, hessian, 32)
    assert not offsets.any()  # the default grid is XNNPACK's symmetric one
    out_err = {k: float((x @ (w - q).T).pow(2).mean()) for k, q in (("rtn", q_rtn), ("gptq", q_gptq))}
    assert out_err["gptq"] < 0.7 * out_err["rtn"]
    # On XNNPACK's grid: integer codes in [-8, 7] times a bfloat16 scale per group.
    codes = q_gptq / scales.repeat_interleave(32, dim=1)
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.min() >= QMIN and codes.max() <= QMAX
    assert torch.equal(scales, scales.bfloat16().float())


def test_gptq_calibration_lowers_int4_perplexity(trained, tokenizer, held_out):
    blocks = corpus_blocks(tokenizer)
    results = {}
    for label, calibration in (("rtn", None), ("gptq", blocks[::2][:16])):
        q = copy.deepcopy(trained)
        info = quantize_model(q, "int4", 32, calibration)
        results[label] = ppl(q, held_out)
        assert info["calibration_blocks"] == (len(calibration) if calibration else 0)
    assert results["gptq"] < results["rtn"]


def test_affine_grid_is_idempotent_and_the_offset_linear_computes_it():
    """Weights already on an affine 4-bit grid (as in a model dequantized from Q4_1 / Q4_K) are found exactly, and
    the eager layer (torchao int4 codes * scales, plus offsets times group sums) computes exactly those weights."""
    from tunesmith.gptq import INT4, INT4_AFFINE, rtn
    gen = torch.Generator().manual_seed(1)
    # Q4_1's quantizer maps each block's min and max to codes 0 and 15: every group here uses both ends too.
    codes = torch.randint(-8, 8, (24, 96), generator=gen)
    codes[:, ::32], codes[:, 1::32] = -8, 7
    scales = (0.002 + 0.01 * torch.rand(24, 3, generator=gen)).bfloat16().float()
    offsets = (0.02 * torch.randn(24, 3, generator=gen)).half().float()
    on_grid = codes * scales.repeat_interleave(32, dim=1) + offsets.repeat_interleave(32, dim=1)
    again, scales2, offsets2 = rtn(on_grid, 32, INT4_AFFINE)
    torch.testing.assert_close(again, on_grid, atol=1e-7, rtol=0)
    assert torch.equal(scales2, scales) and torch.equal(offsets2, offsets)
    assert (rtn(on_grid, 32, INT4)[0] - on_grid).norm() > 0.05 * on_grid.norm()  # the symmetric grid cannot

    layer = torch.nn.Linear(96, 24, bias=False)
    sym = on_grid - offsets.repeat_interleave(32, dim=1)
    layer.weight = torch.nn.Parameter(intx_groups(sym, scales, 32), requires_grad=False)
    GroupOffsetLinear.convert(layer, 32, offsets)
    x = torch.randn(5, 96, generator=gen)
    torch.testing.assert_close(layer(x), x @ on_grid.T, atol=1e-5, rtol=1e-5)


def test_affine_beats_symmetric_and_keep_8bit_is_checked(trained, held_out):
    x = torch.tensor([held_out[0][0]])
    ref = trained(x).logits
    errors = {}
    for grid in ("affine", "symmetric"):
        q = copy.deepcopy(trained)
        info = quantize_model(q, "int4", 32, grid=grid, keep_8bit=())
        assert info["grid"] == grid and bool(info["affine_layers"]) == (grid == "affine")
        errors[grid] = float((q(x).logits - ref).norm() / ref.norm())
    assert errors["affine"] < errors["symmetric"]
    with pytest.raises(TunesmithError, match="--keep-8bit names wq"):
        quantize_model(copy.deepcopy(trained), "int4", 32, keep_8bit=("wq",))


def test_gptq_shows_a_bar_per_layer_unless_told_not_to(trained, tokenizer, capfd):
    blocks = corpus_blocks(tokenizer)[:4]
    quantize_model(copy.deepcopy(trained), "int4", 32, blocks)
    err = capfd.readouterr().err
    assert "GPTQ on 4 blocks, layer" in err and "2/2" in err
    quantize_model(copy.deepcopy(trained), "int4", 32, blocks, progress=False)
    assert "GPTQ" not in capfd.readouterr().err


def test_quantize_verb_names_its_data_and_says_each_stage(trained, tokenizer, tmp_path, text_file, capfd):
    import re

    float_dir = save(trained, tokenizer, tmp_path / "float")
    assert main(["quantize", "--model", str(float_dir), "--data", str(text_file), "--seq-len", "32", "--scheme",
                 "int4", "--output", str(tmp_path / "q4"), "--eval-blocks", "2", "--max-tokens", "2",
                 "--calibration-blocks", "4"]) == 0
    out, err = capfd.readouterr()
    data = re.escape(str(text_file))
    assert re.search(rf"GPTQ calibrated on {data}, training part: 4 blocks, 128 tokens", out)
    assert re.search(rf"perplexity on {data}, held-out part: \d+ blocks, \d+ tokens", out)
    for stage in ("scoring the float model on", f"quantizing {float_dir} to int4 (GPTQ calibrated on",
                  "GPTQ on 4 blocks, layer", "scoring the int4 model as saved in"):
        assert stage in err


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_layer_by_layer_replay_reproduces_the_model(arch):
    """GPTQ runs the decoder one layer at a time on recorded inputs: through every layer that must give the model's
    own hidden states. Gemma 3's global layer takes a different mask and rotary table than its sliding-window
    layers (replaying the first layer's arguments everywhere got them wrong); blocks of equal length run batched,
    the odd-length one alone."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    from tunesmith.gptq import layer_inputs

    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    if arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**shape, sliding_window=4, rope_theta=1e6, query_pre_attn_scalar=8,
                                                   layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"]))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model.eval()
    blocks = [torch.randint(0, 64, (12,)).tolist() for _ in range(3)] + [torch.randint(0, 64, (7,)).tolist()]
    with torch.no_grad():
        hidden, run_all = layer_inputs(model, blocks, batch_tokens=24)  # batches of two 12-token blocks
        for layer in model.model.layers:
            hidden = run_all(layer, hidden)
        for ids, h in zip(blocks, hidden, strict=True):
            assert h.shape == (1, len(ids), 32)
            # the model's last hidden state comes after the final norm
            want = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
            torch.testing.assert_close(model.model.norm(h), want, rtol=1e-5, atol=1e-5)
