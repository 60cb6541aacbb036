"""`tunesmith merge`: the folder it writes is shared as the user's other files are, and a broken adapter is refused."""

from __future__ import annotations

import os
import stat

import torch

from tests.conftest import make_model
from tests.ship_fixtures import make_adapter
from tunesmith.cli import main


def test_merge_writes_the_modes_the_umask_gives(tiny_dir, tokenizer, tmp_path, capsys):
    adapter = make_adapter(make_model(tokenizer), tmp_path / "adapter")
    out = tmp_path / "merged"
    old = os.umask(0o022)
    try:
        code = main(["merge", "--model", str(tiny_dir), "--adapter", str(adapter), "--output", str(out)])
    finally:
        os.umask(old)
    assert code == 0, capsys.readouterr().err
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert set(modes.values()) == {0o644}, modes
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left


def test_an_adapter_that_makes_the_weights_non_finite_is_one_clear_error(tiny_dir, tokenizer, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    adapter = make_adapter(make_model(tokenizer), tmp_path / "adapter")
    weights = load_file(adapter / "adapter_model.safetensors")
    name = next(k for k in weights if "lora_B" in k)
    weights[name][0, 0] = torch.inf
    save_file(weights, adapter / "adapter_model.safetensors")
    out = tmp_path / "merged"
    assert main(["merge", "--model", str(tiny_dir), "--adapter", str(adapter), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "non-finite (NaN or inf)" in err and "earlier checkpoint" in err and "Traceback" not in err
    assert not out.exists()


def test_a_saved_adapter_has_the_modes_the_umask_gives(tokenizer, tmp_path):
    from tunesmith.lora import attach_lora, save_adapter

    old = os.umask(0o022)
    try:
        folder = save_adapter(attach_lora(make_model(tokenizer)), tmp_path / "adapter", "smollm2-135m-instruct")
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert "adapter_model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]  # no temporary folder left
