"""`tunesmith <verb>`: parse flags (built from the config dataclasses) and call the stage. No logic beyond that."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing

from tunesmith import config as C
from tunesmith.errors import TunesmithError


def _add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in C.fields_of(cls):
        if f.metadata.get("positional"):  # `tunesmith report RUN_DIR`
            parser.add_argument(f.name, metavar=f.name.upper(), help=f.metadata.get("help", ""))
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = ",".join(default) if isinstance(default, list) else default
        suffix = f" (default: {shown})" if shown != "" else ""  # an empty default's help says what it means
        kw: dict = {"help": f"{f.metadata.get('help', '')}{suffix}", "default": argparse.SUPPRESS}
        hint = hints[f.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if "type" in f.metadata:
            kw["type"] = f.metadata["type"]
        elif base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif base in (int, float):
            kw["type"] = base
        for extra in ("choices", "metavar", "nargs", "const"):  # nargs="?" + const: a flag with an optional value
            if extra in f.metadata:
                kw[extra] = f.metadata[extra]
        parser.add_argument(flag, **kw)


def _train(cfg):
    from tunesmith.report import write_report  # looked up now, so a test can replace it
    from tunesmith.train import train

    r = train(cfg)
    write_report(r.run_dir)  # report.html and a plain-text summary of the run
    last = f", validation perplexity {r.evals[-1][1].perplexity:.2f}" if r.evals else ""
    print(f"trained {r.steps} steps in {r.seconds:.1f}s{last}; adapter saved to {r.adapter_dir}")


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
    print(f"scored {r.scored}")
    print(f"loss {r.loss:.4f}  perplexity {r.perplexity:.2f}  ({r.tokens} tokens)")


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

    print(f"exported {cfg.format} ({cfg.quant}) to {export(cfg)}")


def _run(cfg):
    from tunesmith.run import run

    responses = run(cfg)
    r = responses[-1]
    print(f"[{r.prompt_tokens} prompt tokens at {r.prompt_tps:.1f} tok/s, {r.generated_tokens} generated at "
          f"{r.generation_tps:.1f} tok/s, peak memory {r.peak_memory_bytes / 2**20:.0f} MiB]", file=sys.stderr)


def _compare(cfg):
    from tunesmith.compare import compare

    compare(cfg)

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
    "export": (C.ExportConfig, _export, "write an on-device artifact: ExecuTorch .pte, GGUF, MLX or Core ML"),
    "run": (C.RunConfig, _run, "generate from a .pte with the ExecuTorch runtime, streaming, with tokens/s"),
    "compare": (C.CompareConfig, _compare, "the quality ladder: base, LoRA, merged, int8, int4, .pte on the same text"),
    "demo": (C.DemoConfig, _demo, "the whole workflow on the built-in model and Shakespeare"),
}


TRAINING_EXITS = (
    "exit codes: 0 done; 2 a problem to fix (the message says how); 130 stopped by Ctrl-C (SIGINT) or 143 by SIGTERM, "
    "each after finishing the current step and saving a checkpoint: run the same command with --resume to continue"
)
EPILOGS = {"train": TRAINING_EXITS, "demo": TRAINING_EXITS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunesmith", description="Fine-tune an open LLM on your own text, then ship it.")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, (cls, _, help_text) in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=EPILOGS.get(name))
        p.add_argument("--config", metavar="YAML", help="YAML file of options; flags given here override it")
        _add_fields(p, cls)
    return parser


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
    args = vars(build_parser().parse_args(argv))
    if sys.platform == "darwin":  # torch reads this when it loads: ops MPS lacks then run on the CPU, not fail
        os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")
    _quiet_libraries()
    verb, yaml_path = args.pop("verb"), args.pop("config", None)
    cls, run, _ = VERBS[verb]
    try:
        run(C.build_config(cls, yaml_path, args))
    except TunesmithError as e:
        print(f"tunesmith {verb}: {e.label}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"tunesmith {verb}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
