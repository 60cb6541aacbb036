"""`tunesmith <verb>`: parse flags (built from the config dataclasses) and call the stage. No logic beyond that."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
import sys
import typing

from tunesmith import config as C
from tunesmith.errors import TunesmithError


class _Parser(argparse.ArgumentParser):
    """argparse with errors on one line (exit 2): a bad value names its flag, and an unknown verb or flag gets the
    nearest known one suggested."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        verb = next((a for a in args if not a.startswith("-")), None)  # the top level has only -h and --version
        if self.prog == "tunesmith" and verb is not None and verb not in VERBS:
            self.error(f"unknown command {verb!r}{_nearest(verb, VERBS)}; the commands are {', '.join(VERBS)}")
        try:
            namespace, extra = super().parse_known_args(args, namespace)
        except TunesmithError as e:  # raised by a field's parse_value: --lr must be > 0, got -1
            self.error(str(e))
        always = [C.flag(name) for name in getattr(self, "always", ())]  # mlx-lm's --train, --mask-prompt
        extra = [a for a in extra if a not in always]
        if extra and self.prog != "tunesmith":  # a verb's parser: name what it does not know, here
            word = extra[0].split("=", 1)[0]
            if word.startswith("-") and C.removed(word):
                self.error(C.removed(word))
            if word in always:
                self.error(f"{word} takes no value: {C.ALWAYS[word[2:].replace('-', '_')]}")
            if word.startswith("-"):
                self.error(f"unknown flag {word}{_nearest(word, [*self._option_string_actions, *always])}; "
                           f"`{self.prog} --help` lists them")
            self.error(f"unexpected argument {word!r}; `{self.prog} --help` lists what it takes")
        return namespace, extra


def _nearest(word: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word.replace("_", "-"), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in C.fields_of(cls):
        if f.metadata.get("positional"):  # `tunesmith report RUN_DIR`
            parser.add_argument(f.name, metavar=f.metadata.get("metavar", f.name.upper()), help=f.metadata.get("help", ""))
            continue
        names = [C.flag(n) for n in C.names_of(f)]  # --max-steps, and mlx-lm's --iters
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = ",".join(default) if isinstance(default, list) else default
        takes = f"; must be {f.metadata['bounds']}" if "bounds" in f.metadata else ""
        suffix = f" (default: {shown}{takes})" if shown != "" else (f" ({takes[2:]})" if takes else "")
        kw: dict = {"help": f"{f.metadata.get('help', '')}{suffix}", "default": argparse.SUPPRESS, "dest": f.name}
        hint = hints[f.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if base is bool and "type" not in f.metadata:
            kw["action"] = argparse.BooleanOptionalAction
        else:  # converted and checked as it is read: a bad value stops here, before anything loads
            kw["type"] = functools.partial(C.parse_value, f, hint, name=names[0])
        for extra in ("choices", "metavar", "nargs", "const", "action"):  # nargs="?" + const: an optional value;
            # action="extend": a flag given once per item, each converted to a list
            if extra in f.metadata:
                kw[extra] = f.metadata[extra]
        parser.add_argument(*names, **kw)


def _train(cfg):
    from tunesmith.distributed import launch, launched
    from tunesmith.report import write_report  # looked up now, so a test can replace it
    from tunesmith.train import train

    if cfg.gpus > 1 and not launched():  # this process becomes the launcher of cfg.gpus training processes
        launch(cfg, C.save_config)
        return
    r = train(cfg)
    if not r.main or r.finished:  # under several processes the main one reports; a finished run was reported
        return
    from tunesmith.pipeline import sample_train_run

    sample_train_run(r)  # greedy samples before / after, the resolved device: for the report
    write_report(r.run_dir)  # report.html and a plain-text summary of the run
    last = f", validation perplexity {r.evals[-1][1].perplexity:.2f}" if r.evals else ""
    what = "model" if cfg.fine_tune_type == "full" else "adapter"
    print(f"trained {r.steps} steps in {r.seconds:.1f}s{last}; {what} saved to {r.adapter_dir}")


def _generate(cfg):
    from tunesmith.generate import generate_from_config

    responses = generate_from_config(cfg)
    if responses:
        r = responses[-1]
        print(f"[{r.prompt_tokens} prompt tokens at {r.prompt_tps:.1f} tok/s, {r.generated_tokens} generated at "
              f"{r.generation_tps:.1f} tok/s, peak memory {r.peak_memory_bytes / 2**20:.0f} MiB]", file=sys.stderr)


def _eval(cfg):
    from tunesmith.evaluate import evaluate_from_config

    r = evaluate_from_config(cfg)
    print(f"scored {r.scored}")  # ... N blocks (or records), T tokens: what was read
    print(f"loss {r.loss:.4f}  perplexity {r.perplexity:.2f}  over {r.tokens} predicted tokens (each supervised "
          "token but an example's first)")


def _merge(cfg):
    from tunesmith.merge import merge

    print(f"merged model saved to {merge(cfg.model, cfg.adapter, cfg.output, cfg.dtype, cfg.trust_remote_code)}")


def _report(cfg):
    from tunesmith.report import write_report

    write_report(cfg.run_dir, cfg.output or None)


def _fit(cfg):
    from tunesmith.memory import fit_from_config

    fit_from_config(cfg)


def _parity(cfg):
    if cfg.framework != "torch":
        from tunesmith.export.keras import framework_parity

        framework_parity(cfg)
        return
    from tunesmith.parity import parity_from_config

    parity_from_config(cfg)


def _quantize(cfg):
    from tunesmith.quantize import quantize

    r = quantize(cfg)
    print(f"{r.scheme}{f' g{r.group_size}' if r.scheme == 'int4' else ''}: {r.layers} linear layers quantized; "
          f"saved to {r.output}")
    if r.calibrated:
        print(f"  GPTQ calibrated on {r.calibrated}")
    print(f"  perplexity on {r.scored}" if r.scored else "  perplexity not measured (--eval-blocks 0)")
    for label, m in (("float", r.float), (r.scheme, r.quantized)):
        print(f"  {label:>6}: {m.bytes / 2**20:8.1f} MiB  perplexity {m.perplexity:8.3f}  {m.tokens_per_s:6.1f} tok/s")


def _export(cfg):
    from tunesmith.export import export

    path = export(cfg)
    print(f"exported {cfg.format} ({cfg.quant}) to {path}")
    if cfg.format == "ollama":
        from tunesmith.export.ollama import create_command

        print(f"import it into Ollama with: {create_command(path)}")


def _run(cfg):
    from tunesmith.pte_runtime import run_from_config

    responses = run_from_config(cfg)
    r = responses[-1]
    print(f"[{r.prompt_tokens} prompt tokens at {r.prompt_tps:.1f} tok/s, {r.generated_tokens} generated at "
          f"{r.generation_tps:.1f} tok/s, peak memory {r.peak_memory_bytes / 2**20:.0f} MiB]", file=sys.stderr)


def _compare(cfg):
    from tunesmith.compare import compare

    compare(cfg)

def _serve(cfg):
    from tunesmith.serve import serve

    serve(cfg)


def _chat(cfg):
    from tunesmith.chat import chat

    chat(cfg)


def _demo(cfg):
    from tunesmith.pipeline import demo

    demo(cfg)


VERBS: dict[str, tuple[type, typing.Callable, str]] = {
    "train": (C.TrainConfig, _train, "LoRA-train a model on your text; writes a PEFT adapter and metrics"),
    "generate": (C.GenerateConfig, _generate, "generate text from a model, with or without an adapter"),
    "eval": (C.EvalConfig, _eval, "loss and perplexity on a dataset: its held-out part, or --split train / all"),
    "merge": (C.MergeConfig, _merge, "fold an adapter into the model and save a plain HF folder"),
    "report": (C.ReportConfig, _report, "write a run folder's report.html: loss curves, samples, memory, quality ladder"),
    "fit": (C.FitConfig, _fit, "will it fit? predict training peak memory by part from the model's config alone"),
    "parity": (C.ParityConfig, _parity, "check that the device's logits and greedy output match the CPU's"),
    "quantize": (C.QuantizeConfig, _quantize, "int8 / int4 weight-only copy of a model for eager inference, vs float"),
    "export": (C.ExportConfig, _export, "write an on-device artifact: ExecuTorch .pte, GGUF, Ollama, MLX, Core ML or a "
               "Keras 3 preset (or an adapter alone)"),
    "run": (C.RunConfig, _run, "generate from an exported .pte (ExecuTorch runtime) or .gguf, streaming, with tokens/s"),
    "compare": (C.CompareConfig, _compare, "the quality ladder: base, LoRA, merged, int8, int4, each .pte and .gguf on the same text"),
    "serve": (C.ServeConfig, _serve, "an OpenAI-compatible HTTP server for a model and its adapters (needs "
              "tunesmith[serve])"),
    "chat": (C.ChatConfig, _chat, "talk to a model (+ adapter) in the terminal: streamed answers, /reset, /quit"),
    "demo": (C.DemoConfig, _demo, "the whole workflow on the built-in model and Shakespeare"),
}


TRAINING_EXITS = (
    "exit codes: 0 done; 2 a problem to fix (the message says how); 130 stopped by Ctrl-C (SIGINT) or 143 by SIGTERM, "
    "each after finishing the current step and saving a checkpoint: run the same command with --resume to continue"
)
MLX_LM_FLAGS = (
    "mlx-lm's --train and --mask-prompt are accepted and change nothing: train always trains, and the loss is always "
    "on the completion (Alpaca: the output) or the assistant's turns only, never on the prompt"
)
EPILOGS = {"train": f"{TRAINING_EXITS}. {MLX_LM_FLAGS}", "demo": TRAINING_EXITS}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tunesmith", description="Fine-tune an open LLM on your own text, then ship it.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, (cls, _, help_text) in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=EPILOGS.get(name))
        p.add_argument("--config", metavar="YAML", help="YAML file of options; flags given here override it")
        p.always = cls.always  # accepted without an option of their own: the epilog says what they mean
        _add_fields(p, cls)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tunesmith")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from tunesmith import __version__

        return __version__


def _quiet_libraries() -> None:
    """Library progress bars and deprecation chatter would bury tunesmith's own output."""
    import logging
    import os
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("torchao", "torch.utils._pytree"):  # import-time chatter once torchao (tunesmith[ship]) is installed
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    try:  # a bad verb, flag or value ends here: one line on stderr, exit 2 (--help and --version: 0)
        args = vars(build_parser().parse_args(argv))
    except SystemExit as e:
        return int(e.code or 0)
    if sys.platform == "darwin":  # torch reads this when it loads: ops MPS lacks then run on the CPU, not fail
        os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")
    verb, yaml_path = args.pop("verb"), args.pop("config", None)
    cls, run, _ = VERBS[verb]
    try:
        cfg = C.build_config(cls, yaml_path, args)  # checked before any library or model loads
        _quiet_libraries()
        run(cfg)
    except TunesmithError as e:
        print(f"tunesmith {verb}: {e.label}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"tunesmith {verb}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
