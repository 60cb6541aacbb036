"""The eval verb: it names the data and split it scored; --split valid|train|all; no held-out part is one clear
error that says what to change."""

import json
import re

import pytest

from tests.cli_process import run_cli
from tests.conftest import CORPUS
from tunesmith.cli import main
from tunesmith.config import EvalConfig
from tunesmith.data import SPLITS, source_label
from tunesmith.errors import TunesmithError
from tunesmith.evaluate import evaluate_from_config


def _cfg(tiny_dir, data, **kw):
    return EvalConfig(model=str(tiny_dir), data=str(data), seq_len=32, device="cpu", **kw)


def test_eval_says_what_it_scored_and_labels_each_count(tiny_dir, text_file):
    """The tokens read and the tokens the loss is a mean over differ (an example's first token is never predicted):
    each count says which it is."""
    r = run_cli("eval", "--model", tiny_dir, "--data", text_file, "--seq-len", "32", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    read = re.search(rf"scored {re.escape(str(text_file))}, valid split: ([1-9]\d*) blocks, (\d+) tokens\n", r.stdout)
    scored = re.search(r"loss [\d.]+  perplexity [\d.]+  over (\d+) predicted tokens \(each supervised token but "
                       r"an example's first\)\n", r.stdout)
    assert read and scored, r.stdout
    assert int(scored[1]) == int(read[2]) - int(read[1])  # blocks: every token supervised, less one per block
    assert source_label("shakespeare") == "the built-in 'shakespeare' data"  # the default, named as such
    assert source_label("shakespeare") == "the built-in 'shakespeare' data"  # the default, named as such


def test_split_all_scores_the_whole_file(tiny_dir, text_file):
    r = {s: evaluate_from_config(_cfg(tiny_dir, text_file, split=s)) for s in SPLITS}
    assert r["valid"].tokens > 0 and r["train"].tokens > r["valid"].tokens
    assert r["all"].tokens == r["train"].tokens + r["valid"].tokens
    total = r["train"].loss * r["train"].tokens + r["valid"].loss * r["valid"].tokens
    assert r["all"].loss == pytest.approx(total / r["all"].tokens, rel=1e-5)
    assert "all split" in r["all"].scored


def test_a_txt_without_a_held_out_block_names_val_fraction_not_valid_jsonl(tiny_dir, text_file, capsys):
    code = main(["eval", "--model", str(tiny_dir), "--data", str(text_file), "--seq-len", "32", "--device", "cpu",
                 "--val-fraction", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "--val-fraction" in err and "--split all" in err and "valid.jsonl" not in err


def test_a_folder_without_valid_jsonl_names_it_and_split_train(tiny_dir, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    lines = [json.dumps({"text": block}) for block in CORPUS.split("\n\n") if block]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(TunesmithError, match="has no valid.jsonl to score; add one, or .* --split train"):
        evaluate_from_config(_cfg(tiny_dir, folder))
    r = evaluate_from_config(_cfg(tiny_dir, folder, split="train"))
    assert r.tokens > 0 and f"{folder}, train split: {len(lines)} records" in r.scored
