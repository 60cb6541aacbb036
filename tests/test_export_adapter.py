"""export --adapter-only: the PEFT adapter as mlx-lm's adapter folder and as a llama.cpp LoRA adapter GGUF."""

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tunesmith.cli import main
from tunesmith.export import gguf as G

from .ship_fixtures import make_adapter

PROMPT = "ROMEO:\nBut soft"


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory, tiny_dir):
    """A rank-4 adapter (alpha 8) on q_proj / v_proj of tiny_dir, with non-zero B."""
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return make_adapter(base, tmp_path_factory.mktemp("peft") / "adapter")


def _export(tiny_dir, peft_dir, fmt, out):
    return main(["export", "--model", str(tiny_dir), "--adapter", str(peft_dir), "--adapter-only", "--format", fmt,
                 "--output", str(out)])


def test_gguf_adapter_holds_the_peft_tensors_under_llama_cpp_names(tiny_dir, peft_dir, tmp_path):
    assert _export(tiny_dir, peft_dir, "gguf", tmp_path / "out") == 0
    path = tmp_path / "out" / "adapter.gguf"
    reader = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in reader.fields.items()}
    assert kv["general.type"] == "adapter" and kv["general.architecture"] == "llama"
    assert kv["adapter.type"] == "lora" and kv["adapter.lora.alpha"] == 8.0
    got = {t.name: np.array(t.data).reshape(tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}
    peft = load_file(peft_dir / "adapter_model.safetensors")
    assert len(got) == len(peft) == 2 * 2 * 2
    config = json.loads((tiny_dir / "config.json").read_text())
    for i in range(2):
        for hf, ggml in (("q_proj", "attn_q"), ("v_proj", "attn_v")):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{hf}"
            a, b = (peft[f"{prefix}.lora_{x}.weight"].numpy() for x in "AB")
            ga, gb = got[f"blk.{i}.{ggml}.weight.lora_a"], got[f"blk.{i}.{ggml}.weight.lora_b"]
            assert ga.dtype == np.float32 and ga.shape == (4, 64) and (ga == a).all()
            # B's rows move with the base weight's rows (llama.cpp's rotary order for attn_q), so the merged
            # product is the permuted merged weight.
            want_b = G._permute(b, config["num_attention_heads"]) if hf == "q_proj" else b
            assert (gb == want_b).all()
            np.testing.assert_array_equal(gb @ ga, G._permute(b @ a, 4) if hf == "q_proj" else b @ a)
    assert path.stat().st_size < 64 * 1024  # the adapter alone: small


def test_mlx_adapter_gives_the_peft_model_s_greedy_tokens(tiny_dir, peft_dir, tokenizer, tmp_path):
    mx = pytest.importorskip("mlx.core", reason="needs the mlx extra: pip install 'tunesmith[mlx]'")
    mlx_lm = pytest.importorskip("mlx_lm")
    from mlx_lm.generate import generate_step
    from peft import PeftModel

    assert _export(tiny_dir, peft_dir, "mlx", tmp_path / "adapter") == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["num_layers"] == 2 and config["lora_parameters"]["scale"] == 2.0
    assert main(["export", "--model", str(tiny_dir), "--format", "mlx", "--output", str(tmp_path / "base")]) == 0
    model, _ = mlx_lm.load(str(tmp_path / "base"), adapter_path=str(tmp_path / "adapter"))
    ids = tokenizer(PROMPT)["input_ids"]
    got = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=24)]

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), peft_dir)
    want, seq = [], list(ids)
    with torch.no_grad():
        for _ in range(24):
            seq.append(int(peft.eval()(torch.tensor([seq])).logits[0, -1].argmax()))
            want.append(seq[-1])
    assert got == want


@pytest.mark.parametrize("args,msg", [(["--format", "pte"], "no adapter form"), (["--format", "gguf", "--no-adapter"],
                                                                                  "needs --adapter")])
def test_adapter_only_errors_are_one_line(args, msg, tiny_dir, peft_dir, tmp_path, capsys):
    adapter = [] if "--no-adapter" in args else ["--adapter", str(peft_dir)]
    args = [a for a in args if a != "--no-adapter"]
    code = main(["export", "--model", str(tiny_dir), *adapter, "--adapter-only", *args, "--output", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and msg in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------- as a user runs it (the CLI)


def test_gguf_adapter_honours_f16_and_q8_0_and_refuses_other_types(tiny_dir, peft_dir, tmp_path):
    """llama.cpp LoRA files take f32, f16 and q8_0: each is written as asked (a q8_0 matrix whose rows are not 32
    weights, B's [out, r=4], is f16, as convert_lora_to_gguf does); a k-quant is one line naming those three."""
    from .cli_process import run_cli

    T = gguf.GGMLQuantizationType
    peft = load_file(peft_dir / "adapter_model.safetensors")
    for quant, a_type, b_type, bound in (("f16", T.F16, T.F16, 1e-3), ("q8_0", T.Q8_0, T.F16, 1e-2)):
        out = tmp_path / f"{quant}.gguf"
        done = run_cli("export", "--model", tiny_dir, "--adapter", peft_dir, "--adapter-only", "--format", "gguf",
                       "--quant", quant, "--output", out)
        assert done.returncode == 0, done.stderr
        tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
        a, b = tensors["blk.1.attn_v.weight.lora_a"], tensors["blk.1.attn_v.weight.lora_b"]
        assert (a.tensor_type, b.tensor_type) == (a_type, b_type)
        want = peft["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"].numpy()
        got = gguf.quants.dequantize(a.data, a.tensor_type).reshape(want.shape)
        assert np.abs(got - want).max() <= bound * np.abs(want).max()
    done = run_cli("export", "--model", tiny_dir, "--adapter", peft_dir, "--adapter-only", "--format", "gguf",
                   "--quant", "q4_k_m", "--output", tmp_path / "k.gguf")
    assert done.returncode == 2 and "f32, f16, q8_0" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "k.gguf").exists()


def test_mlx_adapter_files_have_the_modes_of_the_user_s_other_files(tiny_dir, peft_dir, tmp_path):
    """safetensors writes its file private (0600); the adapter folder is meant to be shared as the user's files are.
    A folder that is not an adapter export is not written over."""
    import os

    from .cli_process import run_cli

    mask = os.umask(0o022)
    os.umask(mask)
    done = run_cli("export", "--model", tiny_dir, "--adapter", peft_dir, "--adapter-only", "--format", "mlx",
                   "--output", tmp_path / "mlx")
    assert done.returncode == 0, done.stderr
    for name in ("adapters.safetensors", "adapter_config.json"):
        assert (tmp_path / "mlx" / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    done = run_cli("export", "--model", tiny_dir, "--adapter", peft_dir, "--adapter-only", "--format", "mlx",
                   "--output", tmp_path / "mine")
    assert done.returncode == 2 and "choose an empty --output" in done.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"
