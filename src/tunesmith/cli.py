"""`tunesmith <verb>`: parse flags (built from the config dataclasses) and call the stage. No logic beyond that."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from tunesmith import config as C
from tunesmith.errors import TunesmithError


def _add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in C.fields_of(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = ",".join(default) if isinstance(default, list) else default
        kw: dict = {"help": f"{f.metadata.get('help', '')} (default: {shown})", "default": argparse.SUPPRESS}
        hint = hints[f.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if "type" in f.metadata:
            kw["type"] = f.metadata["type"]
        elif base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif base in (int, float):
            kw["type"] = base
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        parser.add_argument(flag, **kw)


def _train(cfg):
    from tunesmith.train import train

    r = train(cfg)
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
    print(f"loss {r.loss:.4f}  perplexity {r.perplexity:.2f}  ({r.tokens} tokens)")


def _merge(cfg):
    from tunesmith.merge import merge

    print(f"merged model saved to {merge(cfg.model, cfg.adapter, cfg.output, cfg.dtype, cfg.trust_remote_code)}")


def _demo(cfg):
    from tunesmith.pipeline import demo

    demo(cfg)


VERBS: dict[str, tuple[type, typing.Callable, str]] = {
    "train": (C.TrainConfig, _train, "LoRA-train a model on your text; writes a PEFT adapter and metrics"),
    "generate": (C.GenerateConfig, _generate, "generate text from a model, with or without an adapter"),
    "eval": (C.EvalConfig, _eval, "loss and perplexity on a dataset's validation split"),
    "merge": (C.MergeConfig, _merge, "fold an adapter into the model and save a plain HF folder"),
    "demo": (C.DemoConfig, _demo, "the whole workflow on the built-in model and Shakespeare"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunesmith", description="Fine-tune an open LLM on your own text, then ship it.")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, (cls, _, help_text) in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", metavar="YAML", help="YAML file of options; flags given here override it")
        _add_fields(p, cls)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    verb, yaml_path = args.pop("verb"), args.pop("config", None)
    cls, run, _ = VERBS[verb]
    try:
        run(C.build_config(cls, yaml_path, args))
    except TunesmithError as e:
        print(f"tunesmith {verb}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"tunesmith {verb}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
