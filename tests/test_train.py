import json

import pytest
import torch

from tunesmith.data import load_data
from tunesmith.errors import TunesmithError
from tunesmith.train import Schedule, train

from .conftest import make_model, tiny_train_config


def _run(tmp_path, tiny_dir, text_file, tokenizer, name="run", **kw):
    cfg = tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / name), **kw)
    return train(cfg, progress=False)


def test_same_seed_same_losses_and_adapter(tmp_path, tiny_dir, text_file, tokenizer):
    a = _run(tmp_path, tiny_dir, text_file, tokenizer, "a")
    b = _run(tmp_path, tiny_dir, text_file, tokenizer, "b")
    c = _run(tmp_path, tiny_dir, text_file, tokenizer, "c", seed=1)
    assert len(a.losses) == 5 and a.losses == b.losses
    assert a.losses != c.losses
    from safetensors.torch import load_file

    wa, wb = load_file(a.adapter_dir / "adapter_model.safetensors"), load_file(b.adapter_dir / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_training_lowers_the_loss_and_writes_the_run_folder(tmp_path, tiny_dir, text_file, tokenizer):
    r = _run(tmp_path, tiny_dir, text_file, tokenizer, max_steps=30, eval_every=10, lora_targets=["all-linear"])
    assert sum(r.losses[-5:]) / 5 < sum(r.losses[:5]) / 5 - 0.3  # nats
    rows = [json.loads(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in rows if row["kind"] == "train"]
    evals = [row for row in rows if row["kind"] == "eval"]
    assert [row["step"] for row in train_rows] == list(range(1, 31))
    assert [row["loss"] for row in train_rows] == r.losses
    assert [row["step"] for row in evals] == [10, 20, 30]
    assert evals[-1]["val_ppl"] == pytest.approx(r.evals[-1][1].perplexity)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert (r.run_dir / "config.yaml").is_file() and (r.adapter_dir / "adapter_model.safetensors").is_file()


def test_gradient_accumulation_matches_the_larger_batch(tmp_path, tiny_dir, text_file, tokenizer):
    big = _run(tmp_path, tiny_dir, text_file, tokenizer, "big", batch_size=4, grad_accum=1, lora_dropout=0.0)
    acc = _run(tmp_path, tiny_dir, text_file, tokenizer, "acc", batch_size=2, grad_accum=2, lora_dropout=0.0)
    assert acc.losses == pytest.approx(big.losses, abs=1e-6)


def test_injected_model_and_data_are_used(tmp_path, tokenizer, text_file):
    data = load_data(str(text_file), tokenizer, seq_len=16)
    cfg = tiny_train_config(tmp_path, "unused-model-name", "unused-data", max_steps=2)
    r = train(cfg, model=make_model(tokenizer), tokenizer=tokenizer, data=data, progress=False)
    assert r.steps == 2 and r.tokens == 2 * 2 * 15  # 2 steps x 2 blocks x 15 predicted tokens


def test_epochs_set_the_step_count(tmp_path, tiny_dir, text_file, tokenizer):
    data = load_data(str(text_file), tokenizer, seq_len=32, val_fraction=0.05)
    r = _run(tmp_path, tiny_dir, text_file, tokenizer, max_steps=None, epochs=0.5, batch_size=4)
    assert r.steps == max(1, round(0.5 * (len(data.train) // 4)))


def test_schedule_warms_up_then_decays_to_a_tenth():
    s = Schedule(total=100, warmup=10)
    assert s(0) == pytest.approx(1 / 11) and s(10) == pytest.approx(1.0)
    assert s(55) < s(20) and s(100) == pytest.approx(0.1)


@pytest.mark.parametrize("kw,msg", [({"grad_accum": 0}, "--grad-accum"), ({"max_steps": 0}, "--max-steps"),
                                    ({"lora_targets": ["nope_proj"]}, "Linear layers here")])
def test_bad_settings_are_clear_errors(tmp_path, tiny_dir, text_file, tokenizer, kw, msg):
    with pytest.raises(TunesmithError, match=msg):
        _run(tmp_path, tiny_dir, text_file, tokenizer, **kw)
