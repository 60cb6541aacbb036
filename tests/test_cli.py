"""The command line a new user meets: a bad value, an unknown flag or verb is one line and exit 2 before anything
loads; mlx-lm's flag names work; --version, --system and --prompt - do what the README says."""

import io
import typing

import pytest

from tunesmith import config as C
from tunesmith.cli import VERBS, build_parser, main

from .cli_process import run_cli

BAD_VALUES = [
    ("train", "--lr", "-1", "--lr must be > 0, got -1"),
    ("train", "--lr", "0", "--lr must be > 0, got 0"),
    ("train", "--lr", "nan", "--lr must be a number, got 'nan'"),
    ("train", "--lr", "inf", "--lr must be a number, got 'inf'"),
    ("train", "--learning-rate", "fast", "--lr must be a number, got 'fast'"),
    ("train", "--batch-size", "0", "--batch-size must be >= 1, got 0"),
    ("train", "--batch-size", "-3", "--batch-size must be >= 1, got -3"),
    ("train", "--batch-size", "many", "--batch-size must be a positive integer or 'auto', got 'many'"),
    ("train", "--grad-accum", "0", "--grad-accum must be >= 1, got 0"),
    ("train", "--seq-len", "1", "--seq-len must be >= 2, got 1"),
    ("train", "--max-seq-length", "0", "--seq-len must be >= 2, got 0"),
    ("train", "--val-fraction", "1", "--val-fraction must be in [0, 1), got 1"),
    ("train", "--val-fraction", "-0.1", "--val-fraction must be in [0, 1), got -0.1"),
    ("train", "--max-steps", "0", "--max-steps must be >= 1, got 0"),
    ("train", "--max-steps", "2.5", "--max-steps must be an integer, got '2.5'"),
    ("train", "--iters", "-5", "--max-steps must be >= 1, got -5"),
    ("train", "--epochs", "0", "--epochs must be > 0, got 0"),
    ("train", "--warmup-steps", "-1", "--warmup-steps must be >= 0, got -1"),
    ("train", "--weight-decay", "-0.5", "--weight-decay must be >= 0, got -0.5"),
    ("train", "--max-grad-norm", "-1", "--max-grad-norm must be >= 0, got -1"),
    ("train", "--lora-rank", "0", "--lora-rank must be >= 1, got 0"),
    ("train", "--lora-alpha", "0", "--lora-alpha must be > 0, got 0"),
    ("train", "--lora-dropout", "1", "--lora-dropout must be in [0, 1), got 1"),
    ("train", "--eval-every", "-1", "--eval-every must be >= 0, got -1"),
    ("train", "--eval-batches", "-1", "--eval-batches must be >= 0, got -1"),
    ("train", "--time-budget", "-1", "--time-budget must be >= 0, got -1"),
    ("train", "--checkpoint-every", "-1", "--checkpoint-every must be >= 0, got -1"),
    ("train", "--seed", "-1", "--seed must be in [0, 4294967295], got -1"),
    ("train", "--precision", "fp8", "--precision must be one of auto, fp32, bf16, fp16, got 'fp8'"),
    ("generate", "--temperature", "-1", "--temperature must be >= 0, got -1"),
    ("generate", "--top-p", "0", "--top-p must be in (0, 1], got 0"),
    ("generate", "--top-p", "1.5", "--top-p must be in (0, 1], got 1.5"),
    ("generate", "--max-tokens", "0", "--max-tokens must be >= 1, got 0"),
    ("eval", "--batch-size", "0", "--batch-size must be >= 1, got 0"),
    ("eval", "--max-batches", "-1", "--max-batches must be >= 0, got -1"),
    ("fit", "--memory-gib", "-1", "--memory-gib must be >= 0, got -1"),
    ("fit", "--lora-rank", "0", "--lora-rank must be >= 1, got 0"),
    ("parity", "--max-tokens", "-1", "--max-tokens must be >= 0, got -1"),
    ("parity", "--tolerance", "-0.1", "--tolerance must be >= 0, got -0.1"),
    ("quantize", "--calibration-blocks", "-1", "--calibration-blocks must be >= 0, got -1"),
    ("quantize", "--eval-blocks", "-1", "--eval-blocks must be >= 0, got -1"),
    ("quantize", "--group-size", "48", "--group-size must be one of 32, 64, 128, got 48"),
    ("export", "--group-size", "0", "--group-size must be >= 1, got 0"),
    ("export", "--max-seq-len", "1", "--max-seq-len must be >= 2, got 1"),
    ("export", "--calibration-blocks", "-1", "--calibration-blocks must be >= 0, got -1"),
    ("run", "--temperature", "-0.5", "--temperature must be >= 0, got -0.5"),
    ("run", "--top-p", "2", "--top-p must be in (0, 1], got 2"),
    ("run", "--max-tokens", "0", "--max-tokens must be >= 1, got 0"),
    ("compare", "--eval-blocks", "0", "--eval-blocks must be >= 1, got 0"),
    ("compare", "--max-tokens", "0", "--max-tokens must be >= 1, got 0"),
    ("serve", "--port", "70000", "--port must be in [0, 65535], got 70000"),
    ("serve", "--parallel", "0", "--parallel must be >= 1, got 0"),
    ("serve", "--max-tokens", "-5", "--max-tokens must be >= 1, got -5"),
    ("serve", "--adapter", "=", "--adapter must be NAME=PATH or an adapter folder, got '='"),
    ("chat", "--temperature", "-1", "--temperature must be >= 0, got -1"),
    ("chat", "--max-tokens", "0", "--max-tokens must be >= 1, got 0"),
    ("demo", "--sample-tokens", "0", "--sample-tokens must be >= 1, got 0"),
    ("demo", "--sample-temperature", "-1", "--sample-temperature must be >= 0, got -1"),
    ("demo", "--lr", "0", "--lr must be > 0, got 0"),
    ("demo", "--iters", "0", "--max-steps must be >= 1, got 0"),
]


@pytest.fixture
def nothing_loads(monkeypatch):
    """A model load or a stage call fails the test: a bad value must stop before either."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded or a stage ran despite a bad value")

    import tunesmith.models

    monkeypatch.setattr(tunesmith.models, "load_model", refuse)
    for verb, (cls, _, help_text) in list(VERBS.items()):
        monkeypatch.setitem(VERBS, verb, (cls, refuse, help_text))


@pytest.mark.parametrize("verb,flag,value,message", BAD_VALUES, ids=[f"{v} {f} {x}" for v, f, x, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_and_exit_2_before_anything_loads(verb, flag, value, message, nothing_loads, capsys):
    positional = {"report": ["runs/x"], "run": ["m.pte"], "compare": ["runs/x"]}.get(verb, [])
    assert main([verb, *positional, flag, value]) == 2
    out = capsys.readouterr()
    assert out.err == f"tunesmith {verb}: error: {message}\n" and out.out == ""


def test_every_numeric_option_of_every_verb_is_bounded():
    """A new numeric flag has to say which values it takes (bounds= or choices=), or it escapes the checks above."""
    for verb, (cls, _, _) in VERBS.items():
        hints = typing.get_type_hints(cls)
        for f in C.fields_of(cls):
            args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
            if int in args or float in args:
                assert "bounds" in f.metadata or "choices" in f.metadata, f"{verb} --{f.name} has no bounds"


def test_a_bad_value_in_a_yaml_file_names_the_file_and_key(tmp_path, nothing_loads, capsys):
    y = tmp_path / "run.yaml"
    y.write_text("learning_rate: -1e-3\n")
    assert main(["train", "--config", str(y)]) == 2
    assert capsys.readouterr().err == f"tunesmith train: error: {y}: 'learning_rate' must be > 0, got -0.001\n"


@pytest.mark.parametrize("argv,message", [
    (["trian"], "tunesmith: error: unknown command 'trian' (did you mean train?); the commands are train, generate,"),
    (["genrate", "--prompt", "x"], "tunesmith: error: unknown command 'genrate' (did you mean generate?)"),
    (["train", "--lora-rnak", "4"], "tunesmith train: error: unknown flag --lora-rnak (did you mean --lora-rank?)"),
    (["train", "--learning_rate=1e-3"], "tunesmith train: error: unknown flag --learning_rate (did you mean --learning-rate?)"),
    (["generate", "--adpater", "a"], "tunesmith generate: error: unknown flag --adpater (did you mean --adapter?)"),
    (["export", "--max-seq-length", "64"], "tunesmith export: error: unknown flag --max-seq-length (did you mean --max-seq-len?)"),
    (["train", "my.txt"], "tunesmith train: error: unexpected argument 'my.txt'"),
])
def test_an_unknown_verb_or_flag_suggests_the_nearest_on_one_line(argv, message, nothing_loads, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["train", "--no-fused-loss"], "--fused-loss was removed: the fast paths are chosen for the model and device; "
                                   "--fast-paths off turns them all off"),
    (["train", "--fused-mlp", "on"], "--fused-mlp was removed: the fast paths are chosen"),
    (["train", "--overlap-steps"], "--overlap-steps was removed: steps no longer overlap"),
    (["train", "--keep", "3"], "--keep was removed: the two newest checkpoints are kept"),
    (["train", "--dist-timeout", "60"], "--dist-timeout was removed: set TUNESMITH_DIST_TIMEOUT"),
    (["demo", "--cuda-graphs", "off"], "--cuda-graphs was removed"),
])
def test_a_removed_flag_names_what_replaces_it(argv, message, nothing_loads, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tunesmith {argv[0]}: error: {message}") and err.count("\n") == 1


def test_a_removed_key_in_a_yaml_file_names_what_replaces_it(tmp_path, nothing_loads, capsys):
    y = tmp_path / "run.yaml"
    y.write_text("lr: 1e-3\nliger: false\n")
    assert main(["train", "--config", str(y)]) == 2
    assert capsys.readouterr().err.startswith(f"tunesmith train: error: {y}: --liger was removed: the fast paths")


def test_the_fast_paths_and_their_two_escape_hatches_are_train_flags():
    from tunesmith.config import TrainConfig

    cfg = C.build_config(TrainConfig, None, {"fast_paths": "off", "compile": "on", "recompute": False})
    assert (cfg.fast_paths, cfg.compile, cfg.recompute) == ("off", "on", False)
    assert TrainConfig().fast_paths == "auto"


def test_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"tunesmith {version('tunesmith')}\n"


def _parse(argv):
    args = vars(build_parser().parse_args(argv))
    verb, path = args.pop("verb"), args.pop("config", None)
    return C.build_config(VERBS[verb][0], path, args)


def test_mlx_lm_flag_names_are_aliases():
    cfg = _parse(["train", "--iters", "600", "--learning-rate", "1e-5", "--max-seq-length", "128",
                  "--adapter-path", "adapters"])
    assert (cfg.max_steps, cfg.lr, cfg.seq_len, cfg.output) == (600, 1e-5, 128, "adapters")
    for verb in ("generate", "eval", "merge", "parity", "quantize", "export"):
        assert _parse([verb, "--adapter-path", "somewhere"]).adapter == "somewhere"


def test_adapter_path_takes_the_run_folder_that_train_wrote(tmp_path):
    """mlx-lm saves and loads with the same --adapter-path; train puts the adapter in <it>/adapter, so a run folder
    given where an adapter is expected means the adapter inside it."""
    (tmp_path / "run" / "adapter").mkdir(parents=True)
    (tmp_path / "run" / "adapter" / "adapter_config.json").write_text("{}")
    assert _parse(["generate", "--adapter-path", str(tmp_path / "run")]).adapter == str(tmp_path / "run" / "adapter")
    assert _parse(["eval", "--adapter", str(tmp_path / "run" / "adapter")]).adapter == str(tmp_path / "run" / "adapter")
    assert _parse(["merge", "--adapter", str(tmp_path / "elsewhere")]).adapter == str(tmp_path / "elsewhere")


def test_help_shows_the_aliases(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    assert all(a in text for a in ("--iters", "--learning-rate", "--max-seq-length", "--adapter-path"))


def test_system_needs_chat(nothing_loads, capsys):
    assert main(["generate", "--system", "Be brief.", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == "tunesmith generate: error: --system is a message of the chat template; add --chat\n"


def test_generate_reads_the_prompt_from_stdin_and_takes_a_system_message(tiny_dir, tokenizer, monkeypatch, capsys):
    from tunesmith.generate import generate
    from tunesmith.models import load_model

    model, _ = load_model(str(tiny_dir), "cpu")
    monkeypatch.setattr("sys.stdin", io.StringIO("ROMEO:\n"))
    assert main(["generate", "--model", str(tiny_dir), "--device", "cpu", "--prompt", "-", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out == "ROMEO:\n" + generate(model, tokenizer, "ROMEO:\n", max_tokens=6) + "\n"

    monkeypatch.setattr("sys.stdin", io.StringIO("hello"))
    argv = ["generate", "--model", str(tiny_dir), "--device", "cpu", "--prompt", "-", "--chat", "--system", "Be brief.",
            "--max-tokens", "6"]
    assert main(argv) == 0
    expected = generate(model, tokenizer, "hello", max_tokens=6, chat=True, system="Be brief.")
    assert capsys.readouterr().out == expected + "\n"

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["generate", "--model", str(tiny_dir), "--device", "cpu", "--prompt", "-"]) == 2
    assert "nothing came on stdin" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["train", "eval", "quantize", "export", "demo"])
def test_a_mistyped_data_path_stops_before_the_model_is_looked_at(verb, tmp_path, capsys):
    """The model named here does not exist either: the data's error coming first shows that no model was resolved
    (let alone converted, downloaded or merged) before --data was checked."""
    data = tmp_path / "my-typo.txt"
    args = {"train": ["--output", str(tmp_path / "run")], "demo": ["--output", str(tmp_path / "demo")],
            "quantize": ["--output", str(tmp_path / "q")],
            "export": ["--format", "gguf", "--quant", "q4_0", "--output", str(tmp_path / "m.gguf")]}.get(verb, [])
    device = ["--device", "cpu"] if verb in ("train", "eval", "demo") else []
    code = main([verb, "--model", str(tmp_path / "no-model"), "--data", str(data), *device, *args])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [f"tunesmith {verb}: error: data not found: {data} (give a .txt or "
                                                    ".jsonl file, a folder with train.jsonl, or one of: shakespeare, "
                                                    "tinyshakespeare)"]
    assert not (tmp_path / "q").exists() and not (tmp_path / "m.gguf").exists()


def test_a_model_that_is_not_there_is_one_line_not_a_plan_warning_and_then_the_error(text_file, tmp_path, capsys):
    assert main(["train", "--model", str(tmp_path / "no-model"), "--data", str(text_file), "--device", "cpu",
                 "--output", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"tunesmith train: error: model '{tmp_path / 'no-model'}' not "
                                                    "found: no such folder or file, and not a built-in alias "
                                                    "(smollm2-135m-instruct, gemma3-270m) or a hub id (owner/name)"]


# ---- through a child process, as a user meets them ----------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--gradient-acumulation-steps", "2"], "unknown flag --gradient-acumulation-steps (did you mean "
                                            "--gradient-accumulation-steps?)"),
    (["--save-steps", "5"], "--save-steps is Hugging Face's; here it is --checkpoint-every (mlx-lm's --save-every)"),
    (["--eval-steps", "5"], "--eval-steps is Hugging Face's; here it is --eval-every"),
    (["--steps-per-report", "5"], "--steps-per-report is mlx-lm's; tunesmith reports every step"),
    (["--mask-prompts"], "unknown flag --mask-prompts (did you mean --mask-prompt?)"),
    (["--mask-prompt=false"], "--mask-prompt takes no value: the loss is always on the completion"),
])
def test_other_tools_names_point_at_the_flag_that_means_the_same(argv, message):
    """A look-alike of another meaning is never suggested: --save-steps is not --max-steps."""
    r = run_cli("train", *argv)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"tunesmith train: error: {message}") and r.stderr.count("\n") == 1, r.stderr


def test_help_names_the_aliases_the_accepted_mlx_lm_flags_and_keras():
    train = run_cli("train", "--help")
    assert train.returncode == 0
    text = " ".join(train.stdout.split())  # argparse wraps lines
    for alias in ("--save-every", "--steps-per-eval", "--gradient-accumulation-steps", "--grad-accumulation-steps",
                  "--num-train-epochs", "--grad-checkpoint"):
        assert alias in text, alias
    assert "mlx-lm's --train and --mask-prompt are accepted and change nothing" in text
    assert "loss is always on the completion (Alpaca: the output) or the assistant's turns only" in text
    export = run_cli("export", "--help")
    assert "ExecuTorch .pte, GGUF, Ollama, MLX, Core ML or a Keras 3 preset" in " ".join(export.stdout.split())
    top = run_cli("--help")
    assert "Keras 3 preset" in " ".join(top.stdout.split())
