import json
from pathlib import Path

import pytest
import yaml

from tunesmith import config as C
from tunesmith.cli import VERBS, build_parser, main
from tunesmith.errors import TunesmithError

from .cli_process import run_cli

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
    ("nonsense_option: 1\n", "unknown option 'nonsense_option'; the command's --help lists its options"),
    ("lora_rnak: 4\n", "unknown option 'lora_rnak' (did you mean lora_rank?)"),
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


# ---- mlx-lm's and Hugging Face's names, through a child process -------------------------------------------------

MLX_LM_CONFIG = """\
train: true
mask_prompt: true
iters: 2
learning_rate: 1e-2
max_seq_length: 32
batch_size: 2
lora_parameters:
  keys: ["self_attn.q_proj", "self_attn.v_proj"]
  rank: 4
  scale: 20.0
  dropout: 0.0
"""


def test_an_mlx_lm_config_and_hf_flags_train_as_what_they_mean(tmp_path, tiny_dir, text_file):
    """mlx-lm's scale is the adapter's multiplier, PEFT's alpha / rank: scale 20 at rank 4 is alpha 80."""
    y = tmp_path / "lora_config.yaml"
    y.write_text(MLX_LM_CONFIG)
    run = tmp_path / "adapters"
    r = run_cli("train", "--config", y, "--model", tiny_dir, "--data", text_file, "--device", "cpu",
                "--adapter-path", run, "--train", "--mask-prompt", "--gradient-accumulation-steps", "2",
                "--save-every", "1", "--steps-per-eval", "2", "--num-train-epochs", "3", "--grad-checkpoint",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert {k: saved[k] for k in ("max_steps", "lr", "seq_len", "lora_rank", "lora_alpha", "lora_dropout",
                                  "lora_targets", "grad_accum", "checkpoint_every", "eval_every", "epochs",
                                  "gradient_checkpointing")} == {
        "max_steps": 2, "lr": 1e-2, "seq_len": 32, "lora_rank": 4, "lora_alpha": 80.0, "lora_dropout": 0.0,
        "lora_targets": ["self_attn.q_proj", "self_attn.v_proj"], "grad_accum": 2, "checkpoint_every": 1,
        "eval_every": 2, "epochs": 3.0, "gradient_checkpointing": True}
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 80.0)
    assert set(adapter["target_modules"]) == {"self_attn.q_proj", "self_attn.v_proj"}


def test_lora_parameters_scale_follows_the_rank_the_command_line_gives(tmp_path):
    y = tmp_path / "mlx.yaml"
    y.write_text("lora_parameters: {rank: 8, scale: 20.0}\n")
    assert C.build_config(C.TrainConfig, y).lora_alpha == 160.0
    assert C.build_config(C.TrainConfig, y, {"lora_rank": 16}).lora_alpha == 320.0  # still scale 20
    assert C.build_config(C.TrainConfig, y, {"lora_alpha": 8.0}).lora_alpha == 8.0  # --lora-alpha wins


@pytest.mark.parametrize("text,message", [
    ("lora_rnak: 4\n", "unknown option 'lora_rnak' (did you mean lora_rank?)\n"),
    ("lr: 1e-3\nmask_prompt: false\n", "'mask_prompt' must be true (or left out): the loss is always on the "
                                       "completion"),
    ("train: false\n", "'train' must be true (or left out): tunesmith train always trains; to score a model "
                       "without training it, run tunesmith eval\n"),
    ("lora_parameters: {rank: 8, alpha: 16}\n", "lora_parameters.alpha is ambiguous: mlx-lm now ignores it"),
    ("lora_parameters: {rank: 8, scael: 20}\n", "unknown key 'scael' in lora_parameters; it takes rank, scale, "
                                                 "dropout and keys\n"),
    ("lora_rank: 4\nlora_parameters: {rank: 8}\n", "'lora_rank' and 'lora_parameters.rank' are the same option"),
    ("steps_per_report: 10\n", "--steps-per-report is mlx-lm's; tunesmith reports every step"),
])
def test_a_yaml_key_gets_one_suggestion_or_its_meaning_here_on_one_line(tmp_path, text, message):
    y = tmp_path / "run.yaml"
    y.write_text(text)
    r = run_cli("train", "--config", y)
    assert r.returncode == 2 and r.stderr.startswith(f"tunesmith train: error: {y}: {message}"), r.stderr
    assert r.stderr.count("\n") == 1


def test_fit_reads_a_lora_parameters_block_for_what_moves_memory(tmp_path):
    y = tmp_path / "mlx.yaml"
    y.write_text("lora_parameters: {rank: 16, scale: 20.0, keys: [self_attn.q_proj]}\n")
    cfg = C.build_config(C.FitConfig, y)
    assert (cfg.lora_rank, cfg.lora_targets) == (16, ["self_attn.q_proj"])
