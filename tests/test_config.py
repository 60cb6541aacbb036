from pathlib import Path

import pytest

from tunesmith import config as C
from tunesmith.cli import VERBS, build_parser, main
from tunesmith.errors import TunesmithError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))


def test_defaults_are_the_wwdc24_recipe():
    cfg = C.TrainConfig()
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets) == (8, 16.0, 0.05, ["q_proj", "v_proj"])
    assert cfg.model == "smollm2-135m-instruct" and cfg.data == "shakespeare"


def test_yaml_then_cli_precedence(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("lr: 0.001\nlora-rank: 16\nlora_targets: all-linear\nmax_steps: 7\n")
    cfg = C.build_config(C.TrainConfig, y, {"lora_rank": 4})
    assert (cfg.lr, cfg.lora_rank, cfg.lora_targets, cfg.max_steps, cfg.seq_len) == (0.001, 4, ["all-linear"], 7, 256)


def test_cli_flags_override_yaml(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("seq_len: 64\nbatch_size: 3\n")
    args = vars(build_parser().parse_args(["train", "--config", str(y), "--batch-size", "5"]))
    verb, path = args.pop("verb"), args.pop("config")
    cfg = C.build_config(VERBS[verb][0], path, args)
    assert (cfg.seq_len, cfg.batch_size) == (64, 5)


@pytest.mark.parametrize("text,msg", [
    ("lr: fast\n", "'lr' must be a float"),
    ("nonsense_option: 1\n", "unknown option(s) nonsense_option"),
    ("- a\n- b\n", "must be a mapping"),
    ("lr: [1, 2\n", "not valid YAML"),
    ("precision: fp8\n", "'precision' must be one of"),
    ("batch_size: 0\n", "batch size must be >= 1"),
])
def test_bad_yaml_is_one_clear_error(tmp_path, text, msg):
    y = tmp_path / "bad.yaml"
    y.write_text(text)
    with pytest.raises(TunesmithError) as e:
        C.build_config(C.TrainConfig, y)
    assert msg in str(e.value)


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


@pytest.mark.parametrize("verb", list(VERBS))
def test_help_documents_every_option(verb, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([verb, "--help"])
    text = capsys.readouterr().out
    for f in C.fields_of(VERBS[verb][0]):
        if not f.metadata.get("positional"):
            assert "--" + f.name.replace("_", "-") in text, f.name


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    kind = {"demo": C.DemoConfig}.get(path.stem.split("-")[0], C.TrainConfig)
    cfg = C.build_config(kind, path)
    assert cfg.lora_rank >= 1 and cfg.model


def test_there_are_shipped_configs():
    assert len(CONFIGS) >= 2
