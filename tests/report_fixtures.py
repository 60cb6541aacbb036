"""Helpers for the report tests: a tiny fake run folder, an HTML reader, and a headless-Chromium screenshot."""

from __future__ import annotations

import base64
import json
import math
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import yaml

STEPS = 40
EVAL_STEPS = (20, 40)
PPL_BEFORE = 44.8
PEAK = 1_610_612_736  # 1.50 GiB, at the last step
PREDICTED = 1_400_000_000
SAMPLES = [
    {
        "prompt": "ROMEO:\n",
        "before": "Sure! Here is <b>a</b> list & more.",
        "after": "But soft, what light through yonder window breaks?",
    },
    {
        "prompt": "First Citizen:\n",
        "before": "<script>alert('x')</script>",
        "after": "Before we proceed any further, hear me speak.",
    },
]
LADDER = [
    {
        "name": "merged fp32",
        "perplexity": 12.5,
        "bytes": 538_000_000,
        "tokens_per_s": 41.5,
        "sample": "O Romeo, Romeo",
    },
    {
        "name": "int8",
        "perplexity": 12.61,
        "bytes": 140_000_000,
        "tokens_per_s": 55.0,
        "sample": "Wherefore art thou",
    },
    {
        "name": "int4",
        "perplexity": 13.9,
        "bytes": 80_000_000,
        "tokens_per_s": 63.25,
        "sample": "<thou> & thee",
    },
]


def train_rows(steps: int = STEPS) -> list[dict]:
    """Falling, slightly noisy loss; throughput and memory that grow a little and level off."""
    rows = []
    for s in range(1, steps + 1):
        rows.append(
            {
                "kind": "train",
                "step": s,
                "loss": 1.5 + 2.0 * math.exp(-s / 12) + 0.05 * math.sin(s),
                "lr": 1e-3,
                "grad_norm": 0.3,
                "tokens": 1024 * s,
                "tokens_per_s": 180.0 + s,
                "elapsed_s": 5.0 * s,
                "peak_mem_bytes": PEAK - (steps - s) * 1_000_000,
            }
        )
    return rows


def eval_rows() -> list[dict]:
    return [
        {
            "kind": "eval",
            "step": s,
            "val_loss": 1.6 + 1.5 * math.exp(-s / 12),
            "val_ppl": math.exp(1.6 + 1.5 * math.exp(-s / 12)),
            "val_tokens": 4096,
        }
        for s in EVAL_STEPS
    ]


def make_run(
    root: Path, *, demo: bool = True, fit: bool = True, ladder: bool = True, evals: bool = True
) -> Path:
    """A run folder as train (and optionally demo / fit / ship) leaves it, without any model."""
    run = root / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"\0" * 3000)
    config = {
        "model": "smollm2-135m-instruct",
        "data": "shakespeare",
        "output": str(run),
        "lr": 0.001,
        "lora_targets": ["q_proj", "v_proj"],
        "max_steps": STEPS,
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    lines = train_rows() + (eval_rows() if evals else [])
    lines.sort(key=lambda r: (r["step"], r["kind"] == "eval"))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    if demo:
        (run / "demo-config.yaml").write_text(
            yaml.safe_dump({"name": "run", "sample_tokens": 60}), encoding="utf-8"
        )
        (run / "samples.json").write_text(json.dumps(SAMPLES), encoding="utf-8")
        summary = {
            "ppl_before": PPL_BEFORE,
            "ppl_after": eval_rows()[-1]["val_ppl"],
            "ppl_drop": 0.5,
            "train_steps": STEPS,
            "train_seconds": 200.0,
            "wall_seconds": 260.0,
            "merged_dir": str(run / "merged"),
        }
        (run / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    if fit:
        parts = {"weights": 540_000_000, "activations": 700_000_000, "optimizer": 160_000_000}
        (run / "fit.json").write_text(
            json.dumps({"predicted_peak_bytes": PREDICTED, "parts": parts}), encoding="utf-8"
        )
    if ladder:
        (run / "ladder.json").write_text(json.dumps(LADDER), encoding="utf-8")
    return run


class Page(HTMLParser):
    """What the tests look at in report.html: section ids, images, headline cards, and the text of each section."""

    def __init__(self, text: str):
        super().__init__()
        self.sections: dict[str, str] = {}
        self.images: dict[str, dict[str, str]] = {}
        self.metrics: dict[str, str] = {}
        self.fit: dict[str, str] = {}
        self.external: list[str] = []
        self._section: str | None = None
        self._capture: tuple[dict, str] | None = None
        self._source: dict[str, str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self._section = a.get("id", "")
            self.sections[self._section] = ""
        if tag == "source":  # the phone rendering of the <img> that follows it in a <picture>
            self._source = a
        if tag == "img":
            self.images[a.get("id", "")] = {**a, "narrow": self._source}
            self._source = None
        if tag in ("script", "link", "iframe") or any(
            k in ("src", "srcset", "href") and v and not v.startswith("data:") for k, v in a.items()
        ):
            self.external.append(f"<{tag} {a}>")
        if "data-metric" in a:
            self._capture = (self.metrics, a["data-metric"])
        if "data-fit" in a:
            self._capture = (self.fit, a["data-fit"])

    def handle_endtag(self, tag):
        if tag == "section":
            self._section = None
        self._capture = None

    def handle_data(self, data):
        if self._section is not None:
            self.sections[self._section] += data
        if self._capture:
            d, k = self._capture
            d[k] = d.get(k, "") + data


def png_bytes(data_uri: str) -> bytes:
    prefix = "data:image/png;base64,"
    assert data_uri.startswith(prefix), data_uri[:40]
    return base64.b64decode(data_uri[len(prefix) :], validate=True)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


def screenshot(browser: str, page: Path, png: Path, width: int, height: int) -> None:
    """Headless Chromium, fresh profile, no network chatter; raises with Chromium's stderr if no PNG appears."""
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--screenshot={png}",
            f"--window-size={width},{height}",
            page.resolve().as_uri(),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if not png.is_file():
        raise AssertionError(f"chromium wrote no screenshot (exit {done.returncode}):\n{done.stderr[-3000:]}")
