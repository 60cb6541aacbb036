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
    ("lr: fast\n", "'lr' must be a number, got 'fast'"),
    ("lr: -1e-3\n", "'lr' must be > 0, got -0.001"),
    ("max_steps: 2.5\n", "'max_steps' must be an integer, got 2.5"),
    ("lora_dropout: 1\n", "'lora_dropout' must be in [0, 1), got 1"),
    ("iters: 5\nmax_steps: 6\n", "'iters' and 'max_steps' are the same option"),
    ("nonsense_option: 1\n", "unknown option(s) nonsense_option"),
    ("- a\n- b\n", "must be a mapping"),
    ("lr: [1, 2\n", "not valid YAML"),
    ("precision: fp8\n", "'precision' must be one of"),
    ("batch_size: 0\n", "'batch_size' must be >= 1, got 0"),
    ("batch_size: lots\n", "'batch_size' must be a positive integer or 'auto', got 'lots'"),
])
def test_bad_yaml_is_one_clear_error(tmp_path, text, msg):
    y = tmp_path / "bad.yaml"
    y.write_text(text)
    with pytest.raises(TunesmithError) as e:
        C.build_config(C.TrainConfig, y)
    assert msg in str(e.value)


def test_yaml_numbers_written_as_yaml_1_1_strings_are_numbers(tmp_path):
    """YAML 1.1 reads `1e-3` (no dot) as a string; mlx-lm's and axolotl's configs write learning rates that way."""
    y = tmp_path / "mlx.yaml"
    y.write_text("lr: 1e-3\nweight_decay: 1E-2\nmax_steps: '30'\nepochs: 1e0\nseq_len: 1e2\n")
    assert isinstance(C.read_yaml(y)["lr"], str)  # what the YAML parser hands over
    cfg = C.build_config(C.TrainConfig, y)
    assert (cfg.lr, cfg.weight_decay, cfg.max_steps, cfg.epochs, cfg.seq_len) == (1e-3, 1e-2, 30, 1.0, 100)
    assert type(cfg.max_steps) is int and type(cfg.lr) is float


def test_mlx_lm_names_are_yaml_keys_too(tmp_path):
    y = tmp_path / "mlx.yaml"
    y.write_text("iters: 600\nlearning_rate: 1e-5\nmax_seq_length: 128\nadapter_path: adapters\nbatch_size: 2\n")
    cfg = C.build_config(C.TrainConfig, y)
    assert (cfg.max_steps, cfg.lr, cfg.seq_len, cfg.output, cfg.batch_size) == (600, 1e-5, 128, "adapters", 2)
    y.write_text("adapter-path: adapters\n")
    assert C.build_config(C.GenerateConfig, y).adapter == "adapters"


def test_a_config_built_in_python_is_checked_too():
    with pytest.raises(TunesmithError, match=r"^--lr must be > 0, got -1$"):
        C.TrainConfig(lr=-1)
    with pytest.raises(TunesmithError, match=r"^--top-p must be in \(0, 1\], got 1.5$"):
        C.GenerateConfig(top_p=1.5)
    assert C.DemoConfig().lr == 3e-3 and C.TrainConfig(batch_size="auto").batch_size == "auto"


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
