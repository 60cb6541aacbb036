"""The quality ladder on a tiny run folder: every rung scored on the same text, and the invariants between rungs hold
(adapter == merged == fp32 .pte; int8 / int4 close to float; bytes are the files' sizes)."""

import json

import pytest
import yaml

from tests.ship_fixtures import make_adapter, save, train_tiny
from tunesmith.cli import main
from tunesmith.compare import LADDER_FILE, ladder
from tunesmith.config import DEMO_PROMPTS, CompareConfig, ExportConfig
from tunesmith.data import read_prompts
from tunesmith.errors import TunesmithError
from tunesmith.quantize import weights_bytes

pytest.importorskip("torchao", reason="the int8 / int4 rungs need the ship extra: pip install 'tunesmith[ship]'")
pytest.importorskip("executorch", reason="the .pte rung needs the ship extra: pip install 'tunesmith[ship]'")

NAMES = ["base", "LoRA (base + adapter)", "merged fp32", "int8", "int4 g32", "pte fp32", "gguf f32"]


@pytest.fixture(scope="module")
def run_dir(tokenizer, tmp_path_factory):
    """A run folder as the demo leaves it (config.yaml, adapter/, merged/) plus exports/model.pte and an f32 GGUF."""
    from tunesmith.export import export
    from tunesmith.merge import merge

    root = tmp_path_factory.mktemp("ladder")
    base = save(train_tiny(tokenizer, steps=25), tokenizer, root / "base")
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": str(base)}))
    from transformers import AutoModelForCausalLM

    make_adapter(AutoModelForCausalLM.from_pretrained(base), run / "adapter")
    merge(str(base), str(run / "adapter"), str(run / "merged"))
    export(ExportConfig(model=str(run / "merged"), format="pte", quant="fp32", max_seq_len=64,
                        output=str(run / "exports" / "model.pte")))
    export(ExportConfig(model=str(run / "merged"), format="gguf", quant="f32", output=str(run / "exports")))
    return run


@pytest.fixture(scope="module")
def rungs(run_dir, tmp_path_factory):
    text = tmp_path_factory.mktemp("data") / "corpus.txt"
    from tests.conftest import CORPUS

    text.write_text(CORPUS * 2, encoding="utf-8")
    assert main(["compare", str(run_dir), "--data", str(text), "--seq-len", "32", "--eval-blocks", "4",
                 "--max-tokens", "6"]) == 0
    return {r["name"]: r for r in json.loads((run_dir / LADDER_FILE).read_text())}


def test_every_rung_is_scored_in_order(rungs, run_dir):
    assert list(rungs) == NAMES
    for r in rungs.values():
        assert r["perplexity"] > 1 and r["tokens_per_s"] > 0 and r["bytes"] > 0
        assert [s["prompt"] for s in r["samples"]] == list(DEMO_PROMPTS)
        assert r["sample"] == DEMO_PROMPTS[0] + r["samples"][0]["text"]
    from tunesmith.report import _read_ladder  # the report draws this file: it must read it

    assert [r["name"] for r in _read_ladder(run_dir / LADDER_FILE)] == NAMES


def test_adapter_merged_fp32_pte_and_f32_gguf_agree(rungs):
    merged = rungs["merged fp32"]
    for name in ("LoRA (base + adapter)", "pte fp32", "gguf f32"):
        assert rungs[name]["perplexity"] == pytest.approx(merged["perplexity"], rel=1e-4)
        assert rungs[name]["samples"] == merged["samples"]  # the same greedy continuations
    assert rungs["base"]["perplexity"] != pytest.approx(merged["perplexity"], rel=1e-3)  # the adapter does something


def test_quantized_rungs_stay_near_float(rungs):
    merged = rungs["merged fp32"]["perplexity"]
    assert abs(rungs["int8"]["perplexity"] / merged - 1) <= 0.01
    assert abs(rungs["int4 g32"]["perplexity"] / merged - 1) <= 0.05


def test_bytes_are_what_each_rung_ships(rungs, run_dir):
    base = weights_bytes(run_dir.parent / "base")
    assert rungs["base"]["bytes"] == base
    assert rungs["LoRA (base + adapter)"]["bytes"] == base + weights_bytes(run_dir / "adapter")
    assert rungs["merged fp32"]["bytes"] == weights_bytes(run_dir / "merged")
    assert rungs["int8"]["bytes"] == weights_bytes(run_dir / "quantized-int8") < 0.35 * base
    assert rungs["int4 g32"]["bytes"] == weights_bytes(run_dir / "quantized-int4-g32") < rungs["int8"]["bytes"]
    assert rungs["pte fp32"]["bytes"] == (run_dir / "exports" / "model.pte").stat().st_size
    assert rungs["gguf f32"]["bytes"] == (run_dir / "exports" / "model-f32.gguf").stat().st_size
    assert rungs["gguf f32"]["path"] == str(run_dir / "exports" / "model-f32.gguf")


def test_the_quantized_folders_are_reused(rungs, run_dir, text_file):
    before = (run_dir / "quantized-int8" / "model.safetensors").stat().st_mtime_ns
    cfg = CompareConfig(run_dir=str(run_dir), data=str(text_file), seq_len=32, eval_blocks=1, max_tokens=2)
    again = ladder(cfg, echo=lambda s: None)
    assert [r.name for r in again] == NAMES
    assert (run_dir / "quantized-int8" / "model.safetensors").stat().st_mtime_ns == before


def test_prompts_file_and_bad_inputs(tmp_path, capsys):
    p = tmp_path / "prompts.txt"
    p.write_text("ROMEO:\\n\n\nKING:\\nNow,\n", encoding="utf-8")
    assert read_prompts(str(p), DEMO_PROMPTS) == ["ROMEO:\n", "KING:\nNow,"]
    assert read_prompts(None, DEMO_PROMPTS) == list(DEMO_PROMPTS)
    assert main(["compare", str(tmp_path / "nope")]) == 2
    assert "run folder not found" in capsys.readouterr().err
    with pytest.raises(TunesmithError, match="pass --model"):
        ladder(CompareConfig(run_dir=str(tmp_path)), echo=lambda s: None)


def test_demo_ship_step_ends_with_the_ladder(run_dir, tmp_path, text_file):
    """`demo --ship`: int4 (GPTQ) -> an 8da4w .pte from it -> the ladder with that .pte as its last rung."""
    import io
    import shutil

    from rich.console import Console

    from tunesmith.config import DemoConfig
    from tunesmith.data import load_data
    from tunesmith.models import load_tokenizer
    from tunesmith.pipeline import ship

    run = tmp_path / "run"  # the run as the demo leaves it before its ship step
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("exports", "quantized-*", LADDER_FILE))
    cfg = DemoConfig(model=str(run_dir.parent / "base"), data=str(text_file), seq_len=32, ship=True)
    train = load_data(str(text_file), load_tokenizer(str(run / "merged")), 32).train
    ship(cfg, run / "merged", Console(file=io.StringIO()), train)
    rungs = json.loads((run / LADDER_FILE).read_text())
    assert [r["name"] for r in rungs] == NAMES[:-2] + ["pte 8da4w g32"]
    meta = json.loads((run / "exports" / "model-8da4w.json").read_text())
    assert meta["weights"].startswith("tunesmith quantize: gptq") and meta["max_seq_len"] == 32
    assert json.loads((run / "quantized-int4-g32" / "tunesmith-quant.json").read_text())["calibration_blocks"] > 0
