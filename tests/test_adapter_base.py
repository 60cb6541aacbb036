"""An adapter folder records the base model it was trained on; the verbs that take --adapter load that model when
--model is not given, and a --model that does not match is one clear error naming both."""

import json
import warnings

import pytest
import torch

from tests.conftest import make_model, tiny_train_config
from tunesmith.cli import build_parser, main
from tunesmith.config import DEFAULT_MODEL, EvalConfig, GenerateConfig, MergeConfig
from tunesmith.errors import TunesmithError
from tunesmith.lora import BASE_FILE, attach_lora, base_model_for, recorded_base, save_adapter


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory, tokenizer):
    """A second tiny model whose shapes differ from tiny_dir's (hidden 96, not 64)."""
    path = tmp_path_factory.mktemp("wide-llama")
    make_model(tokenizer, hidden=96).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _adapter_on(model_dir, folder, tokenizer, hidden: int):
    """A fresh adapter with non-zero B on the tiny model of `hidden`, saved as trained on `model_dir`."""
    peft = attach_lora(make_model(tokenizer, hidden=hidden), 4, 8.0, 0.0, ["q_proj", "v_proj"])
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return save_adapter(peft, folder, str(model_dir))


def test_train_records_the_base_in_the_adapter_and_in_every_checkpoint(tmp_path, tiny_dir, text_file):
    from tunesmith.checkpoint import verify
    from tunesmith.train import train

    r = train(tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=2, checkpoint_every=1),
              progress=False)
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 2
    for folder in [r.adapter_dir, *checkpoints]:
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(tiny_dir.resolve())
        assert json.loads((folder / BASE_FILE).read_text()) == {"model": str(tiny_dir.resolve())}
        assert recorded_base(folder) == (str(tiny_dir.resolve()), True)
    verify(checkpoints[-1])  # the record is one of the checkpoint's hashed files


def test_a_builtin_alias_is_its_hub_id_for_peft_and_itself_for_tunesmith(tmp_path, tiny_model):
    from peft import PeftConfig

    folder = save_adapter(attach_lora(tiny_model, 4), tmp_path / "adapter", "gemma3-270m")
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "google/gemma-3-270m"
    assert recorded_base(folder) == ("gemma3-270m", True)
    assert base_model_for("", folder) == "gemma3-270m"
    assert base_model_for("google/gemma-3-270m", folder) == "google/gemma-3-270m"  # the same model by its hub id
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # plain PEFT reads the folder without a word about unknown keys
        assert PeftConfig.from_pretrained(folder).base_model_name_or_path == "google/gemma-3-270m"


def test_generate_without_model_loads_the_model_the_adapter_was_trained_on(tmp_path, wide_dir, tokenizer):
    from tunesmith.generate import generate_from_config

    adapter = _adapter_on(wide_dir, tmp_path / "adapter", tokenizer, hidden=96)
    out = []
    responses = generate_from_config(GenerateConfig(adapter=str(adapter), prompt="ROMEO:", max_tokens=3, device="cpu"),
                                     write=out.append)
    assert len(responses) >= 1 and "".join(out).startswith("ROMEO:")


def test_merge_without_model_uses_the_recorded_base(tmp_path, wide_dir, tokenizer):
    from tunesmith.merge import merge

    adapter = _adapter_on(wide_dir, tmp_path / "adapter", tokenizer, hidden=96)
    cfg = MergeConfig(adapter=str(adapter), output=str(tmp_path / "merged"))
    assert cfg.model == ""
    out = merge(cfg.model, cfg.adapter, cfg.output)
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 96
    assert json.loads((out / "tunesmith-merge.json").read_text())["base_model"] == str(wide_dir.resolve())


def test_a_different_model_is_one_error_naming_both(tmp_path, tiny_dir, wide_dir, tokenizer, capsys):
    adapter = _adapter_on(wide_dir, tmp_path / "adapter", tokenizer, hidden=96)
    code = main(["generate", "--model", str(tiny_dir), "--adapter", str(adapter), "--device", "cpu",
                 "--max-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert str(wide_dir.resolve()) in err and str(tiny_dir) in err and "leave --model out" in err


def test_a_plain_peft_adapter_that_does_not_fit_names_both_models(tmp_path, tiny_dir, wide_dir, tokenizer):
    from tunesmith.evaluate import evaluate_from_config

    adapter = _adapter_on(wide_dir, tmp_path / "adapter", tokenizer, hidden=96)
    (adapter / BASE_FILE).unlink()  # as PEFT alone writes it: only base_model_name_or_path says where it came from
    cfg = EvalConfig(model=str(tiny_dir), adapter=str(adapter), data="shakespeare", device="cpu")
    with pytest.raises(TunesmithError) as e:
        evaluate_from_config(cfg)
    msg = str(e.value)
    assert f"does not fit the model {tiny_dir}" in msg and "size mismatch" in msg
    assert f"pass --model {wide_dir.resolve()}" in msg and "\n" not in msg


def test_a_copy_of_the_model_in_another_folder_is_the_same_model(tmp_path, tiny_dir, tokenizer):
    import shutil

    adapter = _adapter_on(tiny_dir, tmp_path / "adapter", tokenizer, hidden=64)
    copy = shutil.copytree(tiny_dir, tmp_path / "copy")
    assert base_model_for(str(copy), adapter) == str(copy)
    assert base_model_for("", None) == DEFAULT_MODEL


def test_help_says_what_an_empty_model_means():
    parser = build_parser()
    for verb in ("generate", "eval", "merge", "export", "quantize", "parity"):
        sub = parser._subparsers._group_actions[0].choices[verb]
        text = " ".join(sub.format_help().split())
        assert "the one --adapter was trained on, else smollm2-135m-instruct" in text, verb
        assert "(default: )" not in text, verb
