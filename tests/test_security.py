"""tunesmith never executes code hidden in a file it loads: pickle is refused (or read weights_only), remote code
is off, and a damaged safetensors file is a named error."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from tunesmith import checkpoint as ck
from tunesmith.cli import main
from tunesmith.config import TrainConfig
from tunesmith.lora import attach_lora
from tunesmith.train import train

from .conftest import make_model, tiny_train_config


class _Payload:
    """Unpickling this calls open(marker, "w"): the marker file appearing means the pickle ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _evil(path: Path, marker: Path) -> Path:
    torch.save({"base_model.model.lm_head.weight": _Payload(marker)}, path)
    return path


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()[-1] if err.strip() else ""


def test_the_payload_is_live(tmp_path):
    """The control: loading the crafted file the unsafe way does run its code."""
    marker = tmp_path / "ran"
    torch.load(_evil(tmp_path / "evil.bin", marker), weights_only=False)
    assert marker.exists()


@pytest.fixture
def adapter_dir(tmp_path, tokenizer) -> Path:
    path = tmp_path / "adapter"
    attach_lora(make_model(tokenizer)).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("verb", ["generate", "merge"])
def test_a_pickle_adapter_is_refused_and_never_run(tmp_path, tiny_dir, adapter_dir, capsys, verb):
    marker = tmp_path / "ran"
    (adapter_dir / "adapter_model.safetensors").unlink()
    _evil(adapter_dir / "adapter_model.bin", marker)
    extra = ["--max-tokens", "2"] if verb == "generate" else ["--output", str(tmp_path / "merged")]
    code, err = _cli([verb, "--model", str(tiny_dir), "--adapter", str(adapter_dir), "--device", "cpu", *extra], capsys)
    assert code == 2 and "holds its adapter as pickle (adapter_model.bin), which can run code" in err
    assert not marker.exists()


def test_beside_a_safetensors_adapter_a_pickle_one_is_ignored(tmp_path, tiny_dir, adapter_dir, capsys):
    marker = tmp_path / "ran"
    _evil(adapter_dir / "adapter_model.bin", marker)
    code, _ = _cli(["generate", "--model", str(tiny_dir), "--adapter", str(adapter_dir), "--device", "cpu",
                    "--max-tokens", "2"], capsys)
    assert code == 0 and not marker.exists()


@pytest.fixture
def pickled_model(tmp_path, tiny_dir) -> Path:
    path = tmp_path / "pickled-model"
    shutil.copytree(tiny_dir, path)
    (path / "model.safetensors").unlink()
    _evil(path / "pytorch_model.bin", tmp_path / "ran")
    return path


def test_pickle_model_weights_are_refused_and_with_allow_pickle_not_run(tmp_path, pickled_model, text_file, capsys):
    argv = ["train", "--model", str(pickled_model), "--data", str(text_file), "--output", str(tmp_path / "run"),
            "--device", "cpu", "--seq-len", "32", "--max-steps", "1"]
    code, err = _cli(argv, capsys)
    assert code == 2 and "holds its weights only as pickle files (pytorch_model.bin), which can run code" in err
    assert "--allow-pickle" in err
    code, err = _cli([*argv, "--allow-pickle"], capsys)  # read with weights_only=True: the payload is rejected
    assert code == 2 and "refused to load" in err and "its pickle weights hold more than tensors" in err
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("target", [ck.OPTIMIZER, ck.ADAPTER])
def test_a_pickle_in_a_checkpoint_is_never_unpickled(tmp_path, tiny_dir, text_file, capsys, target):
    cfg = tiny_train_config(tmp_path, tiny_dir, text_file, max_steps=2, checkpoint_every=2)
    train(cfg, progress=False)
    ckpt, marker = tmp_path / "run" / "checkpoints" / "step-000002", tmp_path / "ran"
    _evil(ckpt / target, marker)
    _evil(ckpt / "optimizer.pt", marker)  # a file tunesmith never looks at
    # Re-seal the checkpoint so that its sha256s match: the loader itself must refuse the pickle.
    state = json.loads((ckpt / ck.STATE).read_text())
    state["files"][target] = hashlib.sha256((ckpt / target).read_bytes()).hexdigest()
    (ckpt / ck.STATE).write_text(json.dumps(state))
    (ckpt / ck.MARKER).write_text(json.dumps({ck.STATE: hashlib.sha256((ckpt / ck.STATE).read_bytes()).hexdigest()}))
    code, err = _cli(["train", "--model", str(tiny_dir), "--data", str(text_file), "--output", str(tmp_path / "run"),
                      "--device", "cpu", "--seq-len", "32", "--batch-size", "2", "--max-steps", "5", "--lr", "1e-2",
                      "--warmup-steps", "1", "--eval-every", "0", "--resume"], capsys)
    assert code == 2 and f"step-000002/{target}: not a readable safetensors file" in err
    assert not marker.exists()


def _damaged(raw: bytes, how: str) -> bytes:
    return raw[: len(raw) // 2] if how == "truncated" else raw[:12] + bytes([raw[12] ^ 0x20]) + raw[13:]


@pytest.mark.parametrize("how", ["truncated", "bit-flipped"])
def test_a_damaged_safetensors_adapter_or_model_is_a_named_error(tmp_path, tiny_dir, adapter_dir, text_file, capsys,
                                                                  how):
    f = adapter_dir / "adapter_model.safetensors"
    f.write_bytes(_damaged(f.read_bytes(), how))
    code, err = _cli(["generate", "--model", str(tiny_dir), "--adapter", str(adapter_dir), "--device", "cpu",
                      "--max-tokens", "2"], capsys)
    assert code == 2 and f"{f}: not a readable safetensors file" in err
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "model.safetensors").write_bytes(_damaged((model / "model.safetensors").read_bytes(), how))
    code, err = _cli(["train", "--model", str(model), "--data", str(text_file), "--output", str(tmp_path / "run"),
                      "--device", "cpu", "--seq-len", "32", "--max-steps", "1"], capsys)
    assert code == 2 and f"{model / 'model.safetensors'}: not a readable safetensors file" in err


def test_remote_code_is_off_by_default_and_never_runs(tmp_path, tiny_dir, text_file, capsys):
    assert TrainConfig().trust_remote_code is False
    model, marker = tmp_path / "custom", tmp_path / "ran"
    shutil.copytree(tiny_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "tinycustom"  # an architecture transformers does not know: only its own code could load it
    config["auto_map"] = {"AutoConfig": "custom.Config", "AutoModelForCausalLM": "custom.Model"}
    (model / "config.json").write_text(json.dumps(config))
    (model / "custom.py").write_text(f"open({str(marker)!r}, 'w')\n"
                                     "from transformers import LlamaConfig as Config, LlamaForCausalLM as Model\n")
    code, err = _cli(["train", "--model", str(model), "--data", str(text_file), "--output", str(tmp_path / "run"),
                      "--device", "cpu", "--seq-len", "32", "--max-steps", "1"], capsys)
    assert code == 2 and "ships its own Python code" in err and "--trust-remote-code" in err
    assert not marker.exists()
