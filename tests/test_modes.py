"""The training modes beyond LoRA: QLoRA (nf4 / int4 / int8 / fp8 base), DoRA, full fine-tuning, --num-layers, 8-bit AdamW.

Invariants on a tiny Llama: a fresh adapter leaves the (quantized) model unchanged; merged == adapter (on the
dequantized base for QLoRA); every mode resumes exactly; the artifacts load where the other verbs look for them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import make_model, tiny_train_config
from tunesmith.errors import TunesmithError

pytest.importorskip("torchao")

SCHEMES = ["nf4", "int4", "int8", "fp8"]


def _ids(tokenizer):
    return tokenizer("ROMEO:\nBut soft, what light through yonder window breaks?", return_tensors="pt").input_ids


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_base_stays_close_to_the_model_and_holds_its_bits(tokenizer, scheme):
    from tunesmith.qlora import QuantLinear, quantize_base

    model, ids = make_model(tokenizer), _ids(tokenizer)
    ref = _logits(model, ids)
    linears = {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    quantize_base(model, scheme)
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert set(quant) == set(linears) - {"lm_head"}  # every decoder linear, not the output head
    bits = {"nf4": 4.6, "int4": 4.6, "int8": 8.3, "fp8": 17.6}[scheme]  # codes plus their scales, per weight
    # (fp8 keeps two copies, per output row for the forward product and per input column for the backward, and an
    # fp32 scale per row of each: 17.5 bits on the tiny model's 64 x 32 layers)
    for name, m in quant.items():
        assert m.quantized_bytes() * 8 / linears[name] < bits
        assert not any(p.requires_grad for p in m.parameters())
    rel = ((_logits(model, ids) - ref).abs().mean() / ref.abs().mean()).item()
    assert 0 < rel < {"nf4": 0.2, "int4": 0.2, "int8": 0.02, "fp8": 0.05}[scheme]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_a_fresh_adapter_leaves_the_quantized_model_unchanged(tokenizer, scheme, dora):
    from tunesmith.lora import attach_lora
    from tunesmith.qlora import quantize_base

    model, ids = quantize_base(make_model(tokenizer), scheme), _ids(tokenizer)
    ref = _logits(model, ids)
    peft = attach_lora(model, 4, 8, 0.0, ["all-linear"], dora=dora)
    assert torch.equal(_logits(peft, ids), ref)
    trainable = {n for n, p in peft.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("lora_magnitude_vector" in n for n in trainable) == dora


def test_the_backward_pass_gives_the_gradient_of_the_dequantized_product(tokenizer):
    from tunesmith.qlora import QuantLinear

    w = torch.randn(96, 128)
    for scheme in SCHEMES:
        layer = QuantLinear.from_weight(w, scheme)
        x = torch.randn(3, 128, requires_grad=True)
        layer(x).pow(2).sum().backward()
        x2 = x.detach().clone().requires_grad_()
        torch.nn.functional.linear(x2, layer.dequantize()).pow(2).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)


def test_fp8_products_are_the_products_of_the_fp8_rows(monkeypatch):
    """The fp8 path (torch._scaled_mm; it runs on the CPU too, where tunesmith itself dequantizes instead): the
    output is x's fp8 rows times W's, the input's gradient the gradient's fp8 rows times the transposed copy's, each
    with its scales; a layer takes that path only where fp8 products are fast, and under bf16."""
    from tunesmith import qlora
    from tunesmith.qlora import FP8, QuantLinear, fp8_rows

    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    layer = QuantLinear.from_weight(w, "fp8")
    assert not layer.fast  # the CPU: dequantized products
    codes, scale = fp8_rows(w)
    assert codes.dtype == FP8 and torch.equal(layer.w_codes, codes.view(torch.uint8))
    assert scale.shape == (96, 1) and (codes.float().abs().amax(dim=1) == 448).all()  # every row's absmax at the top
    assert torch.equal(layer.dequantize(torch.float32), codes.float() * scale)
    assert (layer.dequantize(torch.float32) - w).abs().max() <= w.abs().max() / 16  # 3 mantissa bits

    x = torch.randn(2, 5, 128, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 5, 96, dtype=torch.bfloat16)
    layer.fast = True
    calls = []
    real = qlora._Fp8Linear.apply
    monkeypatch.setattr(qlora._Fp8Linear, "apply", lambda *a: calls.append(1) or real(*a))
    y = layer(x)
    y.backward(grad)
    assert calls and y.dtype == torch.bfloat16 and y.shape == (2, 5, 96)
    xq, xs = fp8_rows(x.detach().reshape(10, 128))
    ref = (xq.float() * xs) @ (codes.float() * scale).t()
    torch.testing.assert_close(y.float().reshape(10, 96), ref, rtol=1e-2, atol=1e-2)  # bf16 out
    gq, gs = fp8_rows(grad.reshape(10, 96))
    ref_gx = (gq.float() * gs) @ (layer.fp8_weight_t().float() * layer.wt_scale).t()
    torch.testing.assert_close(x.grad.float().reshape(10, 128), ref_gx, rtol=1e-2, atol=1e-2)
    calls.clear()
    layer(x.detach().float())  # fp32 compute: the dequantized product
    assert not calls


def test_fp8_is_chosen_by_the_device_and_survives_a_dtype_cast(monkeypatch):
    from tunesmith.qlora import QuantLinear, fp8_products

    assert not fp8_products(torch.device("cpu"))
    for capability, fast in (((8, 9), True), ((9, 0), True), ((8, 0), False), ((7, 5), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8_products(torch.device("cuda", 0)) is fast
    layer = QuantLinear.from_weight(torch.randn(32, 64), "fp8")
    codes, before = layer.w_codes.clone(), layer.dequantize(torch.float32)
    layer.to(torch.bfloat16)  # what a model's dtype cast does to its buffers: the codes are bytes, kept as they are
    assert torch.equal(layer.w_codes, codes) and layer.w_codes.dtype == torch.uint8
    torch.testing.assert_close(layer.dequantize(torch.float32), before, rtol=2**-8, atol=0)  # scales now in bf16


def test_fp8_on_mps_is_refused_with_the_schemes_that_run_there(tiny_dir):
    from tunesmith.models import load_model
    from tunesmith.qlora import check_scheme

    check_scheme("fp8", torch.device("cpu"))
    check_scheme("nf4", torch.device("mps"))
    with pytest.raises(TunesmithError, match="MPS has no float8 type.*nf4, int4 or int8"):
        check_scheme("fp8", torch.device("mps"))
    with pytest.raises(TunesmithError, match="MPS has no float8 type"):  # before anything is read
        load_model(str(tiny_dir), "mps", quantize_base="fp8")


def test_streaming_load_equals_quantizing_the_loaded_model(tiny_dir, tokenizer):
    from tunesmith.models import load_model
    from tunesmith.qlora import QuantLinear, load_quantized_base, quantize_base

    ids = _ids(tokenizer)
    streamed = load_quantized_base(Path(tiny_dir), torch.device("cpu"), torch.float32, "nf4")
    plain, _ = load_model(str(tiny_dir))
    assert streamed is not None and any(isinstance(m, QuantLinear) for m in streamed.modules())
    assert torch.equal(_logits(streamed, ids), _logits(quantize_base(plain, "nf4"), ids))


def test_loading_a_quantized_base_hands_freed_memory_back_once_per_layer(tiny_dir, monkeypatch):
    """The full-precision copies freed while a base is quantized go back to the OS every TRIM_EVERY linears, in the
    streaming load and in place (tunesmith.device.release_heap says why)."""
    import tunesmith.qlora as Q
    from tunesmith.models import load_model

    calls = []
    monkeypatch.setattr(Q, "release_heap", lambda: calls.append(1))
    model = Q.load_quantized_base(Path(tiny_dir), torch.device("cpu"), torch.float32, "nf4")
    linears = sum(isinstance(m, Q.QuantLinear) for m in model.modules())
    assert linears >= Q.TRIM_EVERY and len(calls) == linears // Q.TRIM_EVERY
    calls.clear()
    plain, _ = load_model(str(tiny_dir))
    Q.quantize_base(plain, "int8")
    assert len(calls) == linears // Q.TRIM_EVERY


def test_streaming_load_declines_tensor_names_it_does_not_know(tmp_path, tokenizer):
    from safetensors.torch import load_file, save_file

    from tunesmith.models import load_model
    from tunesmith.qlora import QuantLinear, load_quantized_base

    folder = tmp_path / "renamed"
    make_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({f"language_model.{k}": v for k, v in tensors.items()}, folder / "model.safetensors")
    assert load_quantized_base(folder, torch.device("cpu"), torch.float32, "int8") is None
    # the verb then loads it plainly (transformers may or may not rename it) or says it cannot
    try:
        model, _ = load_model(str(folder), quantize_base="int8")
    except (TunesmithError, OSError, ValueError, RuntimeError):
        return
    assert any(isinstance(m, QuantLinear) for m in model.modules())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_qlora_merged_equals_the_adapter_on_its_dequantized_base(tmp_path, tiny_dir, text_file, tokenizer, scheme):
    from tunesmith.lora import load_with_adapter, recorded_quantization
    from tunesmith.merge import merge
    from tunesmith.models import load_model
    from tunesmith.train import train

    r = train(tiny_train_config(tmp_path, tiny_dir, text_file, quantize_base=scheme, lora_targets=["all-linear"],
                                max_steps=4, checkpoint_every=0), progress=False)
    assert recorded_quantization(r.adapter_dir) == scheme
    assert json.loads((r.adapter_dir / "tunesmith-adapter.json").read_text())["quantize_base"] == scheme
    peft, _, _ = load_with_adapter(None, r.adapter_dir)  # the base quantized as it was in training
    ids = _ids(tokenizer)
    adapted = _logits(peft, ids)
    merged_dir = merge("", str(r.adapter_dir), str(tmp_path / "merged"))
    merged, _ = load_model(str(merged_dir))
    assert (_logits(merged, ids) - adapted).abs().max().item() < 1e-3
    base, _ = load_model(str(tiny_dir))
    assert (_logits(base, ids) - adapted).abs().max().item() > 1e-2  # the adapter trained: a real check


def test_dora_merged_equals_the_adapter_in_fp32(tmp_path, tiny_dir, text_file, tokenizer):
    from tunesmith.lora import load_with_adapter
    from tunesmith.merge import merge
    from tunesmith.models import load_model
    from tunesmith.train import train

    r = train(tiny_train_config(tmp_path, tiny_dir, text_file, fine_tune_type="dora", lora_targets=["all-linear"],
                                max_steps=4, checkpoint_every=0), progress=False)
    config = json.loads((r.adapter_dir / "adapter_config.json").read_text())
    assert config["use_dora"] is True
    peft, _, _ = load_with_adapter(None, r.adapter_dir)
    ids = _ids(tokenizer)
    merged, _ = load_model(str(merge("", str(r.adapter_dir), str(tmp_path / "merged"))))
    adapted = _logits(peft, ids)
    assert (_logits(merged, ids) - adapted).abs().max().item() < 1e-4
    base, _ = load_model(str(tiny_dir))
    assert (_logits(base, ids) - adapted).abs().max().item() > 1e-2


MODES = {
    "dora": dict(fine_tune_type="dora"),
    "qlora-nf4": dict(quantize_base="nf4"),
    "qlora-int4-dora": dict(quantize_base="int4", fine_tune_type="dora"),
    "qlora-int8": dict(quantize_base="int8"),
    "qlora-fp8": dict(quantize_base="fp8"),
    "qlora-nf4-calibrated": dict(quantize_base="nf4", base_calibration=4),
    "full": dict(fine_tune_type="full", lr=1e-3),
    "full-last-layer": dict(fine_tune_type="full", num_layers=1, lr=1e-3),
    "full-adamw8bit": dict(fine_tune_type="full", optimizer="adamw8bit", lr=1e-3),
    "lora-last-layer": dict(num_layers=1),
}


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_resumes_exactly(tmp_path, tiny_dir, text_file, mode):
    from safetensors.torch import load_file

    from tunesmith.train import train

    kw = dict(MODES[mode], max_steps=6, checkpoint_every=3, lora_dropout=0.05)
    ref = train(tiny_train_config(tmp_path / "ref", tiny_dir, text_file, **kw), progress=False)
    cut = tmp_path / "cut" / "run"
    shutil.copytree(ref.run_dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step-000006")
    shutil.rmtree(cut / ref.adapter_dir.name)
    again = train(tiny_train_config(tmp_path / "cut", tiny_dir, text_file, resume=True, **kw), progress=False)
    assert again.losses == ref.losses and len(ref.losses) == 6
    assert ref.losses[-1] < ref.losses[0]
    name = "model.safetensors" if kw.get("fine_tune_type") == "full" else "adapter_model.safetensors"
    a, b = load_file(ref.adapter_dir / name), load_file(again.adapter_dir / name)
    assert a.keys() == b.keys()
    differ = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not differ, differ


def test_full_fine_tuning_saves_a_whole_model_that_the_verbs_load(tmp_path, tiny_dir, text_file, tokenizer):
    from tunesmith.models import load_model
    from tunesmith.train import train

    r = train(tiny_train_config(tmp_path, tiny_dir, text_file, fine_tune_type="full", lr=1e-3, max_steps=3,
                                checkpoint_every=0), progress=False)
    assert r.adapter_dir == r.run_dir / "model" and not (r.run_dir / "adapter").exists()
    assert r.trainable_params == sum(p.numel() for p in make_model(tokenizer).parameters())
    assert (r.run_dir / "checkpoints" / "step-000003" / "trainable.safetensors").is_file()
    model, tok = load_model(str(r.adapter_dir))
    ids = _ids(tokenizer)
    torch.testing.assert_close(_logits(model, ids), _logits(r.model.eval(), ids))
    base, _ = load_model(str(tiny_dir))
    assert (_logits(base, ids) - _logits(model, ids)).abs().max().item() > 1e-3
    assert json.loads((r.adapter_dir / "tunesmith-train.json").read_text())["fine_tune_type"] == "full"
    from tunesmith.lora import check_adapter_folder

    with pytest.raises(TunesmithError, match=r"fully fine-tuned model, not an adapter: pass --model .*model"):
        check_adapter_folder(r.run_dir)


def test_num_layers_trains_only_the_last_layers(tmp_path, tiny_dir, text_file, tokenizer):
    from tunesmith.train import train

    lora = train(tiny_train_config(tmp_path / "l", tiny_dir, text_file, num_layers=1, max_steps=1,
                                   checkpoint_every=0), progress=False).model
    adapted = {n.split(".lora_")[0] for n, p in lora.named_parameters() if p.requires_grad}
    assert adapted and all(".layers.1." in n for n in adapted)
    every = train(tiny_train_config(tmp_path / "a", tiny_dir, text_file, num_layers=1, lora_targets=["all-linear"],
                                    max_steps=1, checkpoint_every=0), progress=False).model
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in every.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(".layers.1." in n for n, p in every.named_parameters() if p.requires_grad)
    full = train(tiny_train_config(tmp_path / "f", tiny_dir, text_file, fine_tune_type="full", num_layers=1,
                                   max_steps=1, checkpoint_every=0), progress=False).model
    trained = [n for n, p in full.named_parameters() if p.requires_grad]
    assert trained and all(n.startswith("model.layers.1.") for n in trained)
    assert sum(p.numel() for p in full.parameters() if p.requires_grad) == \
        sum(p.numel() for p in make_model(tokenizer).model.layers[1].parameters())


@pytest.mark.parametrize("scheme", ["nf4", "int4", "int8"])
def test_calibrated_codes_move_the_outputs_less_than_rounding_to_nearest(tokenizer, scheme):
    """--base-calibration: GPTQ chooses the codes (the format, its scales and its bytes stay those of rounding to
    nearest), and the quantized model's logits on text it did not calibrate on land closer to the full model's."""
    from tests.conftest import CORPUS
    from tunesmith.qlora import QuantLinear, base_codes, calibrate_base, quantize_base

    ids = tokenizer(CORPUS)["input_ids"]
    calibration = [ids[i : i + 32] for i in range(0, 256, 32)]
    held_out = torch.tensor([ids[300:364]])
    want = _logits(make_model(tokenizer), held_out)
    nearest = quantize_base(make_model(tokenizer), scheme)
    calibrated = make_model(tokenizer)
    assert calibrate_base(calibrated, scheme, calibration, progress=False) == 14  # 7 linears x 2 layers
    layers = [m for m in calibrated.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14 and all(m.scheme == scheme for m in layers)
    err = {name: (_logits(m, held_out) - want).pow(2).mean().item()
           for name, m in (("nearest", nearest), ("calibrated", calibrated))}
    assert err["calibrated"] < 0.5 * err["nearest"]  # measured 0.25-0.28x for the three schemes
    a, b = base_codes(nearest), base_codes(calibrated)
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    for x, y in zip((m for m in nearest.modules() if isinstance(m, QuantLinear)), layers, strict=True):
        assert torch.equal(x.levels_and_scales()[1], y.levels_and_scales()[1])  # the same scales


def test_a_calibrated_base_travels_with_its_adapter(tmp_path, tiny_dir, text_file, tokenizer):
    """The adapter folder holds the calibrated codes: every verb loads the base the adapter trained on, merge
    folds the adapter into that base dequantized, and a folder that lost the codes is refused by name."""
    from tunesmith.lora import load_with_adapter
    from tunesmith.merge import merge
    from tunesmith.models import load_model
    from tunesmith.qlora import BASE_CODES, QuantLinear, base_codes, quantize_base
    from tunesmith.train import train

    r = train(tiny_train_config(tmp_path, tiny_dir, text_file, quantize_base="nf4", base_calibration=4,
                                lora_targets=["all-linear"], max_steps=4, checkpoint_every=2), progress=False)
    assert json.loads((r.adapter_dir / "tunesmith-adapter.json").read_text())["base_calibrated"] is True
    for folder in (r.adapter_dir, r.run_dir / "checkpoints" / "step-000002"):
        assert (folder / BASE_CODES).is_file()
    peft, _, _ = load_with_adapter(None, r.adapter_dir)
    saved = base_codes(peft)
    nearest = base_codes(quantize_base(load_model(str(tiny_dir))[0], "nf4"))
    assert saved.keys() == nearest.keys() and any(not torch.equal(saved[k], nearest[k]) for k in saved)
    ids = _ids(tokenizer)
    adapted = _logits(peft, ids)
    merged, _ = load_model(str(merge("", str(r.adapter_dir), str(tmp_path / "merged"))))
    assert (_logits(merged, ids) - adapted).abs().max().item() < 1e-3
    assert all(not isinstance(m, QuantLinear) for m in merged.modules())
    (r.adapter_dir / BASE_CODES).unlink()
    with pytest.raises(TunesmithError, match=f"codes \\({BASE_CODES}\\) are missing"):
        load_with_adapter(None, r.adapter_dir)


def test_the_server_loads_a_calibrated_base_and_refuses_to_mix_bases(tmp_path, tiny_dir, text_file):
    pytest.importorskip("fastapi")
    from safetensors.torch import load_file

    from tunesmith.config import ServeConfig
    from tunesmith.qlora import BASE_CODES, base_codes
    from tunesmith.serve import load_served
    from tunesmith.train import train

    runs = {name: train(tiny_train_config(tmp_path / name, tiny_dir, text_file, quantize_base="nf4", max_steps=1,
                                          checkpoint_every=0, **kw), progress=False).adapter_dir
            for name, kw in (("a", dict(base_calibration=4)), ("b", dict(base_calibration=6)), ("c", {}))}
    served = load_served(ServeConfig(adapter=[f"a={runs['a']}"], device="cpu"), progress=False)
    saved = load_file(runs["a"] / BASE_CODES)
    assert all(torch.equal(saved[k], v) for k, v in base_codes(served.model).items())
    for pair in (("a", "b"), ("a", "c")):
        with pytest.raises(TunesmithError, match="trained on different bases"):
            load_served(ServeConfig(adapter=[f"{n}={runs[n]}" for n in pair], device="cpu"), progress=False)


def test_base_calibration_needs_a_scheme_with_codes_to_choose():
    from tunesmith.config import TrainConfig

    for scheme in ("none", "fp8"):
        with pytest.raises(TunesmithError, match="--base-calibration chooses the codes"):
            TrainConfig(quantize_base=scheme, base_calibration=8)


def test_full_fine_tuning_refuses_a_quantized_base():
    from tunesmith.config import TrainConfig

    with pytest.raises(TunesmithError, match="--quantize-base is for lora and dora"):
        TrainConfig(fine_tune_type="full", quantize_base="nf4")


def test_a_missing_torchao_names_the_extra(monkeypatch, tokenizer):
    import builtins

    from tunesmith import qlora

    real = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    qlora._torchao_nf4.cache_clear()  # an earlier test's successful lookup is cached
    monkeypatch.setattr(builtins, "__import__", no_torchao)
    try:
        with pytest.raises(TunesmithError, match=r"pip install 'tunesmith\[qlora\]'"):
            qlora.quantize_base(make_model(tokenizer), "nf4")
    finally:
        qlora._torchao_nf4.cache_clear()


def test_the_cli_trains_qlora_and_generates_with_the_adapter_on_its_quantized_base(tmp_path, tiny_dir, text_file,
                                                                                   capsys):
    from tunesmith.cli import main

    out = tmp_path / "run"
    rc = main(["train", "--model", str(tiny_dir), "--data", str(text_file), "--output", str(out), "--device", "cpu",
               "--seq-len", "32", "--batch-size", "2", "--max-steps", "2", "--quantize-base", "nf4",
               "--fine-tune-type", "dora", "--eval-every", "0"])
    assert rc in (0, None)
    assert "adapter saved to" in capsys.readouterr().out
    rc = main(["generate", "--adapter", str(out), "--prompt", "ROMEO:", "--max-tokens", "4", "--device", "cpu"])
    assert rc in (0, None)


def test_compare_scores_a_qlora_run_on_its_quantized_base_and_a_full_run_by_its_model(tmp_path, tiny_dir):
    pytest.importorskip("torchao")
    from tests.conftest import CORPUS
    from tunesmith.cli import main
    from tunesmith.compare import LADDER_FILE
    from tunesmith.merge import merge
    from tunesmith.train import train

    text = tmp_path / "corpus.txt"
    text.write_text(CORPUS * 2, encoding="utf-8")
    args = ["--data", str(text), "--seq-len", "32", "--eval-blocks", "4", "--max-tokens", "4",
            "--calibration-blocks", "0"]
    q = train(tiny_train_config(tmp_path / "q", tiny_dir, text, quantize_base="nf4", max_steps=3,
                                checkpoint_every=0), progress=False)
    merge("", str(q.adapter_dir), str(q.run_dir / "merged"))
    assert main(["compare", str(q.run_dir), *args]) == 0
    rows = {r["name"]: r for r in json.loads((q.run_dir / LADDER_FILE).read_text())}
    assert list(rows)[:4] == ["base", "base (nf4)", "QLoRA (nf4 base + adapter)", "merged fp32"]
    qlora, merged = rows["QLoRA (nf4 base + adapter)"]["perplexity"], rows["merged fp32"]["perplexity"]
    assert abs(qlora - merged) / merged < 1e-4  # merged onto the dequantized base: the same model
    assert rows["base (nf4)"]["perplexity"] != rows["base"]["perplexity"]

    f = train(tiny_train_config(tmp_path / "f", tiny_dir, text, fine_tune_type="full", lr=1e-3, max_steps=3,
                                checkpoint_every=0), progress=False)
    assert main(["compare", str(f.run_dir), *args]) == 0
    rows = {r["name"]: r for r in json.loads((f.run_dir / LADDER_FILE).read_text())}
    assert "merged fp32" in rows and rows["merged fp32"]["path"] == str(f.adapter_dir)
    assert rows["merged fp32"]["perplexity"] != rows["base"]["perplexity"]
