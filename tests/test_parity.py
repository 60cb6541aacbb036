"""Parity: device vs CPU logits and greedy output, and the precision-dependent verdict."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import make_model
from tunesmith import parity as P
from tunesmith.config import ParityConfig
from tunesmith.data import read_prompts
from tunesmith.errors import TunesmithError


def test_compare_logits_values():
    ref = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.5, -0.2]])
    out = ref + torch.tensor([[0.1, 0.0], [0.0, -0.2], [0.0, 0.0]])
    got = P.compare_logits(ref, out)
    assert got["max_abs"] == pytest.approx(0.2)
    assert got["mean_abs"] == pytest.approx(0.3 / 6)
    assert got["max_rel"] == pytest.approx(0.1)  # 0.1 / max(|1|, 1) beats 0.2 / 4
    assert got["mean_rel"] == pytest.approx((0.1 + 0.05) / 6)
    assert got["top1_agreement"] == 1.0
    flipped = P.compare_logits(ref, ref.flip(-1))
    assert flipped["top1_agreement"] == 0.0


def _prompts(tokenizer):
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("ROMEO:", "JULIET:\nO Romeo")]


def test_cpu_against_cpu_is_exact(tokenizer):
    model = make_model(tokenizer)
    r = P.compare_models(model, copy.deepcopy(model), _prompts(tokenizer), "fp32", max_tokens=8)
    assert r.exact and r.passed
    assert (r.max_abs, r.top1_agreement, r.greedy_match) == (0.0, 1.0, [True, True])
    assert r.first_divergence == [None, None]


def test_bf16_copy_is_close_but_not_exact(tokenizer):
    model = make_model(tokenizer)
    r = P.compare_models(model, copy.deepcopy(model).to(torch.bfloat16), _prompts(tokenizer), "bf16", max_tokens=8)
    assert 0.0 < r.max_abs and 0.0 < r.mean_rel <= P.TOLERANCES["bf16"].mean_rel
    assert r.passed and not r.exact


def test_a_perturbed_model_fails_the_fp32_tolerance(tokenizer):
    model = make_model(tokenizer)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.add_(0.05 * torch.randn_like(other.lm_head.weight))
    r = P.compare_models(model, other, _prompts(tokenizer), "fp32", max_tokens=8)
    assert not r.passed and r.mean_rel > P.TOLERANCES["fp32"].mean_rel
    loose = P.compare_models(model, other, _prompts(tokenizer), "fp32", 8, tolerance=10.0)
    assert loose.tolerance.mean_rel == 10.0 and loose.mean_rel == r.mean_rel  # --tolerance widens only the mean


def test_tolerances_widen_with_lower_precision():
    t = P.TOLERANCES
    assert t["fp32"].mean_rel < t["fp16"].mean_rel < t["bf16"].mean_rel
    assert t["fp32"].min_top1 > t["fp16"].min_top1 > t["bf16"].min_top1


def test_parity_verb_on_cpu_is_exact_and_checks_the_adapter(tmp_path, tiny_dir, tokenizer, capsys):
    from tunesmith.cli import main
    from tunesmith.lora import attach_lora

    adapter = attach_lora(make_model(tokenizer), 4, 8.0, 0.0, ["q_proj", "v_proj"])
    with torch.no_grad():  # a non-zero B, so the adapter changes the output
        for n, p in adapter.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    adapter.save_pretrained(tmp_path / "adapter")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\n\nFirst Citizen:\n", encoding="utf-8")
    code = main(["parity", "--model", str(tiny_dir), "--device", "cpu", "--adapter", str(tmp_path / "adapter"),
                 "--prompts", str(prompts), "--max-tokens", "4"])
    assert code == 0
    assert "parity exact" in capsys.readouterr().out


def test_parity_mismatch_exits_1(monkeypatch, tiny_dir, tokenizer):
    from tunesmith.cli import main

    real = P.compare_models

    def worse(reference, candidate, *args, **kw):
        with torch.no_grad():
            candidate.lm_head.weight.mul_(1.5)
        return real(reference, candidate, *args, **kw)

    monkeypatch.setattr(P, "compare_models", worse)
    assert main(["parity", "--model", str(tiny_dir), "--device", "cpu", "--max-tokens", "2"]) == 1
    assert P.ParityMismatch.exit_code == 1


def test_prompts_file_errors(tmp_path):
    with pytest.raises(TunesmithError, match="prompts file not found"):
        read_prompts(str(tmp_path / "nope.txt"), P.DEFAULT_PROMPTS)
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(TunesmithError, match="no prompts"):
        read_prompts(str(tmp_path / "blank.txt"), P.DEFAULT_PROMPTS)
    assert read_prompts(None, P.DEFAULT_PROMPTS) == list(P.DEFAULT_PROMPTS)
    assert ParityConfig().max_tokens == 32


def test_parity_shows_a_bar_per_prompt_unless_told_not_to(tokenizer, tiny_dir, capfd):
    from tunesmith.cli import main

    model = make_model(tokenizer)
    prompts = [[5, 6, 7], [8, 9]]
    P.compare_models(model, copy.deepcopy(model), prompts, "fp32", max_tokens=2)
    err = capfd.readouterr().err
    assert "parity: prompt" in err and "2/2" in err
    P.compare_models(model, copy.deepcopy(model), prompts, "fp32", max_tokens=2, progress=False)
    assert "parity" not in capfd.readouterr().err
    assert main(["parity", "--model", str(tiny_dir), "--device", "cpu", "--max-tokens", "2"]) == 0
    err = capfd.readouterr().err
    assert f"parity: 4 prompts x 2 greedy tokens, {tiny_dir} on cpu (fp32)" in err and "4/4" in err
