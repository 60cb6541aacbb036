"""tunesmith: fine-tune an open LLM on your own text on the machine you have, then ship it on-device."""

from tunesmith.config import DemoConfig, EvalConfig, GenerateConfig, MergeConfig, TrainConfig
from tunesmith.errors import TunesmithError

__version__ = "0.1.0"

__all__ = [
    "DemoConfig", "EvalConfig", "GenerateConfig", "MergeConfig", "TrainConfig", "TunesmithError",
    "demo", "evaluate", "generate", "merge", "train",
]


def train(cfg: TrainConfig, **kwargs):
    """LoRA-train as `cfg` says; see tunesmith.train.train."""
    from tunesmith.train import train as _train

    return _train(cfg, **kwargs)


def generate(cfg: GenerateConfig, write=None):
    """Generate (streamed to `write`); see tunesmith.generate.generate_from_config."""
    from tunesmith.generate import generate_from_config

    return generate_from_config(cfg, write)


def evaluate(cfg: EvalConfig):
    """Validation loss and perplexity; see tunesmith.evaluate.evaluate_from_config."""
    from tunesmith.evaluate import evaluate_from_config

    return evaluate_from_config(cfg)


def merge(cfg: MergeConfig):
    """Merge an adapter into its base model; see tunesmith.merge.merge."""
    from tunesmith.merge import merge as _merge

    return _merge(cfg.model, cfg.adapter, cfg.output, cfg.dtype, cfg.trust_remote_code)


def demo(cfg: DemoConfig | None = None):
    """The whole workflow on the built-in defaults; see tunesmith.pipeline.demo."""
    from tunesmith.pipeline import demo as _demo

    return _demo(cfg or DemoConfig())
