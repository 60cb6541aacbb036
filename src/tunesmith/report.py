"""The run report: one self-contained report.html (plots embedded as PNG) and a plain-text summary.

Reads only the run-folder contract: config.yaml (and demo-config.yaml), metrics.jsonl, and when they exist
samples.json + summary.json (demo), fit.json (fit planner) and ladder.json (ship stage). A section whose file is
absent is left out, so the same report works after `train`, after `demo`, and after every later stage.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tunesmith.config import read_yaml
from tunesmith.errors import TunesmithError

REPORT_FILE = "report.html"
PHONE = 640  # px: at or below this width the page stacks and shows the narrow plots
TRAIN_KEYS = ("step", "loss")
EVAL_KEYS = ("step", "val_loss")


@dataclass
class Run:
    """Everything the report shows, read and validated from a run folder."""

    dir: Path
    config: dict[str, Any]
    train: list[dict[str, Any]]  # metrics.jsonl rows of kind "train"
    evals: list[dict[str, Any]]  # metrics.jsonl rows of kind "eval"
    samples: list[dict[str, str]] = field(default_factory=list)  # {"prompt", "before", "after"}
    summary: dict[str, Any] | None = None  # the demo's summary.json
    fit: dict[str, Any] | None = None  # the fit planner's prediction
    ladder: list[dict[str, Any]] = field(default_factory=list)  # the ship stage's quality ladder
    artifacts: list[tuple[str, int]] = field(default_factory=list)  # (name, bytes) of what sits in the folder

    @property
    def peak_bytes(self) -> int:
        return max((int(r.get("peak_mem_bytes") or 0) for r in self.train), default=0)

    @property
    def ppl_before(self) -> float | None:
        return (self.summary or {}).get("ppl_before")


# --- reading -----------------------------------------------------------------------------------------------------


def load_run(run_dir: str | Path) -> Run:
    """Read a run folder; every problem a user can cause ends as one TunesmithError naming the file (and line)."""
    d = Path(run_dir)
    if not d.is_dir():
        raise TunesmithError(f"run folder not found: {d}")
    metrics = d / "metrics.jsonl"
    if not metrics.is_file():
        raise TunesmithError(
            f"{d}: no metrics.jsonl; give a run folder written by `tunesmith train` or `tunesmith demo`"
        )
    train, evals = _read_metrics(metrics)
    config: dict[str, Any] = {}
    for name in ("demo-config.yaml", "config.yaml"):  # the resolved training config wins over the demo's
        if (d / name).is_file():
            config.update(read_yaml(d / name))
    return Run(
        dir=d,
        config=config,
        train=train,
        evals=evals,
        samples=_read_samples(d / "samples.json"),
        summary=_read_json(d / "summary.json", dict),
        fit=_read_fit(d / "fit.json"),
        ladder=_read_ladder(d / "ladder.json"),
        artifacts=_artifacts(d),
    )


def _read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    train, evals = [], []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TunesmithError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise TunesmithError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        rows, keys = {"train": (train, TRAIN_KEYS), "eval": (evals, EVAL_KEYS)}.get(
            row.get("kind"), (None, ())
        )
        if rows is None:
            continue  # a kind written by a newer stage; nothing to plot here
        missing = [k for k in keys if not isinstance(row.get(k), int | float)]
        if missing:
            raise TunesmithError(f"{path}:{n}: {row['kind']} row lacks a number for {', '.join(missing)}")
        rows.append(row)
    if not train:
        raise TunesmithError(f"{path}: no training steps logged yet; run `tunesmith train` first")
    return sorted(train, key=lambda r: r["step"]), sorted(evals, key=lambda r: r["step"])


def _read_json(path: Path, expected: type) -> Any:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TunesmithError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(value, expected):
        raise TunesmithError(f"{path}: expected a JSON {'object' if expected is dict else 'list'}")
    return value


def _read_samples(path: Path) -> list[dict[str, str]]:
    samples = _read_json(path, list) or []
    for i, s in enumerate(samples):
        if not (
            isinstance(s, dict) and all(isinstance(s.get(k), str) for k in ("prompt", "before", "after"))
        ):
            raise TunesmithError(f"{path}: item {i} must be an object with string prompt, before and after")
    return samples


def _read_fit(path: Path) -> dict[str, Any] | None:
    fit = _read_json(path, dict)
    if fit is not None and not isinstance(fit.get("predicted_peak_bytes"), int | float):
        raise TunesmithError(f"{path}: needs a number 'predicted_peak_bytes'")
    if fit is not None and not isinstance(fit.get("parts", {}), dict):
        raise TunesmithError(f"{path}: 'parts' must map a part's name to its bytes")
    return fit


def _read_ladder(path: Path) -> list[dict[str, Any]]:
    ladder = _read_json(path, list) or []
    for i, rung in enumerate(ladder):
        if not (isinstance(rung, dict) and isinstance(rung.get("name"), str)):
            raise TunesmithError(f"{path}: item {i} must be an object with a string 'name'")
    return ladder


def _artifacts(d: Path) -> list[tuple[str, int]]:
    def size(p: Path) -> int:
        return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

    return [
        (p.name + ("/" if p.is_dir() else ""), size(p)) for p in sorted(d.iterdir()) if p.name != REPORT_FILE
    ]


# --- numbers -----------------------------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_num(x: Any, spec: str = ".4f") -> str:
    if not isinstance(x, int | float):
        return "—"
    return format(x, spec) if math.isfinite(x) else str(x)


def headline(run: Run) -> dict[str, str]:
    """The key figures, formatted once: shown as cards in the HTML and as lines of the terminal summary."""
    last = run.train[-1]
    tps = [r["tokens_per_s"] for r in run.train if isinstance(r.get("tokens_per_s"), int | float)]
    out = {
        "steps": str(last["step"]),
        "train_loss_first": fmt_num(run.train[0]["loss"]),
        "train_loss_last": fmt_num(last["loss"]),
    }
    if run.evals:
        out["val_loss"] = fmt_num(run.evals[-1]["val_loss"])
        out["val_ppl"] = fmt_num(run.evals[-1].get("val_ppl", math.exp(run.evals[-1]["val_loss"])), ".2f")
    if run.summary and isinstance(run.ppl_before, int | float):
        out["ppl_before"] = fmt_num(run.ppl_before, ".2f")
        out["ppl_after"] = fmt_num(run.summary.get("ppl_after"), ".2f")
    out["tokens"] = f"{last.get('tokens', 0):,}"
    out["tokens_per_s"] = fmt_num(statistics.median(tps), ".0f") if tps else "—"
    out["train_seconds"] = fmt_num(last.get("elapsed_s"), ".0f")
    out["peak_memory"] = fmt_bytes(run.peak_bytes) if run.peak_bytes else "not measured"
    if (run.summary or {}).get("device"):
        out["device"] = f"{run.summary['device']}, {run.summary.get('precision') or '?'}"
    return out


TINY_VALIDATION = 4  # held-out examples below which a validation loss says little


def warnings(run: Run) -> list[str]:
    """What the figures say is wrong: validation loss rising while training loss falls (over-fitting, or a
    learning rate too high for the data), a validation set too small to mean much, or none at all."""
    out = []
    n = (run.summary or {}).get("valid_examples")
    if isinstance(n, int) and n == 0:
        out.append("no validation data: nothing tells over-fitting apart from learning; add a valid.jsonl or "
                   "raise --val-fraction")
    elif isinstance(n, int) and n < TINY_VALIDATION:
        out.append(f"the validation set holds {n} example{'s' if n != 1 else ''}: its loss is noise; hold out "
                   f"at least {TINY_VALIDATION} (a larger valid.jsonl, or a higher --val-fraction)")
    if len(run.evals) >= 2 and len(run.train) >= 2:
        val = [r["val_loss"] for r in run.evals]
        k = max(1, len(run.train) // 5)
        early, late = (statistics.fmean(r["loss"] for r in rows) for rows in (run.train[:k], run.train[-k:]))
        if val[-1] > min(val) and late < early:
            best = run.evals[val.index(min(val))]["step"]
            out.append(f"validation loss rose from {min(val):.4f} (step {best}) to {val[-1]:.4f} while the "
                       "training loss fell: the model is over-fitting; train fewer steps or lower --lr")
    return out


LABELS = {
    "steps": "optimizer steps",
    "train_loss_first": "first train loss",
    "train_loss_last": "last train loss",
    "val_loss": "validation loss",
    "val_ppl": "validation perplexity",
    "ppl_before": "perplexity before",
    "ppl_after": "perplexity after",
    "tokens": "tokens trained",
    "tokens_per_s": "median tokens/s",
    "train_seconds": "training seconds",
    "peak_memory": "peak memory",
    "device": "device, precision",
}


# --- figures -----------------------------------------------------------------------------------------------------


def figures(run: Run, narrow: bool = False) -> dict[str, Any]:
    """Matplotlib figures by name, wide (a laptop, 1:1 pixels) or narrow (a phone: taller, denser, stacked).

    Built on `Figure` directly (the Agg renderer), so there is no pyplot state and no display is needed.
    """
    figs = {"loss": _loss_figure(run, narrow), "speed": _speed_figure(run, narrow)}
    if len(run.ladder) > 1:
        figs["ladder"] = _ladder_figure(run, narrow)
    return figs


def _figure(narrow: bool, wide_height: float, narrow_height: float):
    from matplotlib.figure import Figure

    # Wide: 960 px shown 1:1. Narrow: 540 px drawn at 150 dpi, so text stays legible when a phone scales it down.
    size, dpi = ((3.6, narrow_height), 150) if narrow else ((9.6, wide_height), 100)
    return Figure(figsize=size, dpi=dpi, layout="constrained")


def _loss_figure(run: Run, narrow: bool):
    fig = _figure(narrow, 4.0, 3.0)
    ax = fig.add_subplot()
    steps = [r["step"] for r in run.train]
    losses = [r["loss"] for r in run.train]
    ax.plot(steps, losses, color="#9db8d9", linewidth=1.2, label="train loss")
    if len(losses) >= 10:
        ax.plot(steps, _ema(losses, 0.8), color="#1f5fa8", linewidth=2.2, label="train loss (smoothed)")
    if run.evals or isinstance(run.ppl_before, int | float):
        vs = [r["step"] for r in run.evals]
        vl = [r["val_loss"] for r in run.evals]
        if isinstance(run.ppl_before, int | float) and run.ppl_before > 0:
            vs, vl = [0, *vs], [math.log(run.ppl_before), *vl]  # the demo measured the model before training
            ax.annotate(
                "before training",
                (0, vl[0]),
                textcoords="offset points",
                xytext=(8, 6),
                color="#d9480f",
                fontsize="small",
            )
        ax.plot(vs, vl, color="#d9480f", marker="o", markersize=6, linewidth=2, label="validation loss")
    ax.set(xlabel="optimizer step", ylabel="loss (nats/token)", title="Loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    return fig


def _ema(values: list[float], decay: float) -> list[float]:
    out, acc = [], values[0]
    for v in values:
        acc = decay * acc + (1 - decay) * v if math.isfinite(v) else acc
        out.append(acc)
    return out


def _speed_figure(run: Run, narrow: bool):
    fig = _figure(narrow, 3.4, 5.4)
    left, right = fig.subplots(2, 1) if narrow else fig.subplots(1, 2)
    t = [r.get("elapsed_s", r["step"]) for r in run.train]
    left.plot(t, [r.get("tokens_per_s", math.nan) for r in run.train], color="#2b8a3e", linewidth=1.5)
    left.set(xlabel="seconds", ylabel="tokens / s", title="Throughput")
    right.plot(
        t,
        [(r.get("peak_mem_bytes") or 0) / 2**30 for r in run.train],
        color="#862e9c",
        linewidth=1.5,
        label="measured peak",
    )
    if run.fit:
        right.axhline(
            run.fit["predicted_peak_bytes"] / 2**30, color="#862e9c", linestyle="--", label="fit planner"
        )
        right.legend(loc="lower right", fontsize="small")
    right.set(xlabel="seconds", ylabel="GiB", title="Peak memory")
    top = max(run.peak_bytes, (run.fit or {}).get("predicted_peak_bytes", 0)) / 2**30
    right.set_ylim(0, top * 1.15 or 1)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return fig


def _ladder_figure(run: Run, narrow: bool):
    fig = _figure(narrow, 3.6, 3.0)
    ax = fig.add_subplot()
    rungs = [
        r
        for r in run.ladder
        if isinstance(r.get("bytes"), int | float) and isinstance(r.get("perplexity"), int | float)
    ]
    ax.plot(
        [r["bytes"] / 2**20 for r in rungs],
        [r["perplexity"] for r in rungs],
        "o",
        color="#1f5fa8",
        markersize=7,
    )
    for r in rungs:
        ax.annotate(
            r["name"],
            (r["bytes"] / 2**20, r["perplexity"]),
            textcoords="offset points",
            xytext=(6, 6),
            fontsize="small",
        )
    ax.margins(x=0.2, y=0.15)  # room for the labels
    ax.set(xlabel="size (MiB)", ylabel="perplexity", title="Size vs perplexity")
    ax.grid(alpha=0.3)
    return fig


def _png(fig) -> tuple[str, int, int]:
    """A figure as a base64 PNG data URI, with its pixel size (for width/height, so the layout does not jump)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor="white")
    w, h = (round(v) for v in fig.get_size_inches() * fig.dpi)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii"), w, h


# --- HTML --------------------------------------------------------------------------------------------------------

CSS = """
*{box-sizing:border-box}
body{margin:0;background:#f4f5f7;color:#1c2230;font:16px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif}
main{max-width:1040px;margin:0 auto;padding:16px}
h1{font-size:1.6rem;margin:.3em 0 .1em}
h2{font-size:1.2rem;margin:0 0 .6em}
.sub{color:#5c6472;margin:0 0 12px;overflow-wrap:anywhere}
section{background:#fff;border:1px solid #dfe2e8;border-radius:10px;padding:16px;margin:16px 0}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:10px}
.card{background:#fff;border:1px solid #dfe2e8;border-radius:8px;padding:8px 12px}
.card span{display:block;color:#5c6472;font-size:.8rem}
.card b{font-size:1.25rem;font-variant-numeric:tabular-nums}
img{display:block;max-width:100%;height:auto}
.scroll{overflow-x:auto}
table{border-collapse:collapse;min-width:min(100%,440px);font-size:.9rem}
table.wide{width:100%}
th,td{padding:6px 8px;border-bottom:1px solid #e6e8ec;text-align:left;vertical-align:top}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.sample{margin:0 0 18px}
.pair{display:grid;grid-template-columns:1fr 1fr;gap:10px}
.pair h3{font-size:.85rem;margin:0 0 4px;color:#5c6472;text-transform:uppercase;letter-spacing:.04em}
.text{white-space:pre-wrap;overflow-wrap:anywhere;font:.85rem/1.45 ui-monospace,"DejaVu Sans Mono",monospace;
  background:#f6f7f9;border-radius:6px;padding:8px 10px;margin:0}
.after .text{background:#eef6ee}
.prompt{color:#8a919e}
.good{color:#2b8a3e}
td.sample{min-width:16em}
"""
CSS += f"@media (max-width:{PHONE}px){{main{{padding:8px}}section{{padding:12px}}.pair{{grid-template-columns:1fr}}h1{{font-size:1.3rem}}}}\n"


def render_html(run: Run) -> str:
    """The whole report as one HTML string: no external files, scripts or network requests."""
    wide, narrow = figures(run), figures(run, narrow=True)
    pngs = {name: (_png(fig), _png(narrow[name])) for name, fig in wide.items()}
    name = html.escape(run.dir.resolve().name)
    body = "".join(
        [
            _cards(run),
            _warnings_section(run),
            f'<section id="loss"><h2>Loss</h2>{_img("loss-plot", pngs["loss"], "training and validation loss")}</section>\n',
            f'<section id="speed"><h2>Throughput and memory</h2>'
            f"{_img('speed-plot', pngs['speed'], 'tokens per second and peak memory')}</section>\n",
            _samples_section(run),
            _fit_section(run),
            _ladder_section(run, pngs.get("ladder")),
            _artifacts_section(run),
            _config_section(run),
        ]
    )
    when = datetime.now().strftime("%Y-%m-%d %H:%M")
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>tunesmith report: {name}</title><style>{CSS}</style></head>\n<body><main>"
        f"<h1>tunesmith run report: {name}</h1>"
        f'<p class="sub">{html.escape(str(run.dir.resolve()))} · written {when}</p>\n{body}</main></body></html>\n'
    )


def _img(img_id: str, pngs: tuple[tuple[str, int, int], tuple[str, int, int]], alt: str) -> str:
    (uri, w, h), (small, sw, sh) = pngs
    return (
        f'<picture><source media="(max-width: {PHONE}px)" srcset="{small}" width="{sw}" height="{sh}">'
        f'<img id="{img_id}" alt="{alt}" width="{w}" height="{h}" src="{uri}"></picture>'
    )


def _cards(run: Run) -> str:
    cards = "".join(
        f'<div class="card"><span>{LABELS[k]}</span><b data-metric="{k}">{html.escape(v)}</b></div>'
        for k, v in headline(run).items()
    )
    return f'<section id="summary"><h2>Summary</h2><div class="cards">{cards}</div></section>\n'


def _warnings_section(run: Run) -> str:
    found = warnings(run)
    if not found:
        return ""
    items = "".join(f"<li>{html.escape(w)}</li>" for w in found)
    return f'<section id="warnings"><h2>Warnings</h2><ul>{items}</ul></section>\n'


def _samples_section(run: Run) -> str:
    if not run.samples:
        return ""
    ppl = ""
    if run.summary and isinstance(run.ppl_before, int | float):
        ppl = (
            f"<p>Held-out perplexity {fmt_num(run.ppl_before, '.2f')} → "
            f'<b class="good">{fmt_num(run.summary.get("ppl_after"), ".2f")}</b></p>'
        )
    items = []
    for s in run.samples:
        p = html.escape(s["prompt"])
        cells = "".join(
            f'<div class="{k}"><h3>{k}</h3><p class="text"><span class="prompt">{p}</span>{html.escape(s[k])}</p></div>'
            for k in ("before", "after")
        )
        items.append(f'<div class="sample"><div class="pair">{cells}</div></div>')
    return f'<section id="samples"><h2>Before / after fine-tuning</h2>{ppl}{"".join(items)}</section>\n'


def _fit_section(run: Run) -> str:
    if not run.fit:
        return ""
    predicted = run.fit["predicted_peak_bytes"]
    rows = [
        ("predicted peak", fmt_bytes(predicted)),
        ("measured peak", fmt_bytes(run.peak_bytes) if run.peak_bytes else "not measured"),
    ]
    if run.peak_bytes and predicted:
        rows.append(("measured / predicted", f"{run.peak_bytes / predicted:.2f}×"))
    table = "".join(f'<tr><th>{k}</th><td class="n" data-fit="{k}">{v}</td></tr>' for k, v in rows)
    parts = (
        {k: v for k, v in (run.fit.get("parts") or {}).items() if isinstance(v, int | float)}
        if predicted
        else {}
    )
    part_rows = "".join(
        f'<tr><td>{html.escape(str(k))}</td><td class="n">{fmt_bytes(v)}</td><td class="n">{v / predicted:.0%}</td></tr>'
        for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
    )
    parts_table = (
        (
            f'<h3>Predicted parts</h3><div class="scroll"><table><tr><th>part</th><th class="n">bytes</th>'
            f'<th class="n">share</th></tr>{part_rows}</table></div>'
        )
        if part_rows
        else ""
    )
    return (
        f'<section id="fit"><h2>Fit planner: predicted vs measured memory</h2>'
        f'<div class="scroll"><table>{table}</table></div>{parts_table}</section>\n'
    )


def _ladder_section(run: Run, png: tuple | None) -> str:
    if not run.ladder:
        return ""
    plot = _img("ladder-plot", png, "size vs perplexity") if png else ""
    rows = "".join(
        f'<tr><td>{html.escape(r["name"])}</td><td class="n">{fmt_bytes(r["bytes"]) if isinstance(r.get("bytes"), int | float) else "—"}</td>'
        f'<td class="n">{fmt_num(r.get("perplexity"), ".2f")}</td><td class="n">{fmt_num(r.get("tokens_per_s"), ".1f")}</td>'
        f'<td class="sample"><p class="text">{html.escape(str(r.get("sample", "")))}</p></td></tr>'
        for r in run.ladder
    )
    head = '<tr><th>artifact</th><th class="n">size</th><th class="n">perplexity</th><th class="n">tokens/s</th><th>sample</th></tr>'
    return (
        f'<section id="ladder"><h2>Quality ladder</h2>{plot}'
        f'<div class="scroll"><table class="wide">{head}{rows}</table></div></section>\n'
    )


def _artifacts_section(run: Run) -> str:
    rows = "".join(
        f'<tr><td>{html.escape(n)}</td><td class="n">{fmt_bytes(b)}</td></tr>' for n, b in run.artifacts
    )
    return f'<section id="artifacts"><h2>Run folder</h2><div class="scroll"><table>{rows}</table></div></section>\n'


def _config_section(run: Run) -> str:
    def show(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"  # as the YAML file says it
        return ", ".join(map(str, v)) if isinstance(v, list) else str(v)

    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(show(v))}</td></tr>" for k, v in run.config.items()
    )
    return f'<section id="config"><h2>Configuration</h2><div class="scroll"><table class="wide">{rows}</table></div></section>\n'


# --- terminal ----------------------------------------------------------------------------------------------------


def summary_text(run: Run, report_path: Path | None = None) -> str:
    """The report's key numbers as plain text, for the end of a run."""
    h = headline(run)
    lines = [f"run report: {report_path}" if report_path else f"run: {run.dir}"]
    lines.append(
        f"  {h['steps']} steps, {h['tokens']} tokens in {h['train_seconds']}s "
        f"({h['tokens_per_s']} tokens/s median), peak memory {h['peak_memory']}"
    )
    if "device" in h:
        lines.append(f"  trained on {h['device']}")
    lines.append(f"  train loss {h['train_loss_first']} -> {h['train_loss_last']}")
    if "val_loss" in h:
        lines.append(
            f"  validation loss {h['val_loss']}, perplexity {h['val_ppl']} (step {run.evals[-1]['step']})"
        )
    if "ppl_before" in h:
        lines.append(f"  held-out perplexity before -> after: {h['ppl_before']} -> {h['ppl_after']}")
    if run.fit:
        predicted = run.fit["predicted_peak_bytes"]
        measured = (
            f", measured {h['peak_memory']} ({run.peak_bytes / predicted:.2f}x)"
            if run.peak_bytes and predicted
            else ""
        )
        lines.append(f"  fit planner predicted peak {fmt_bytes(predicted)}{measured}")
    if run.ladder:
        lines.append("  quality ladder:")
        width = max(len(r["name"]) for r in run.ladder)
        for r in run.ladder:
            size = fmt_bytes(r["bytes"]) if isinstance(r.get("bytes"), int | float) else "—"
            lines.append(
                f"    {r['name']:<{width}}  {size:>10}  perplexity {fmt_num(r.get('perplexity'), '.2f'):>8}"
                f"  {fmt_num(r.get('tokens_per_s'), '.1f'):>7} tokens/s"
            )
    lines += [f"  warning: {w}" for w in warnings(run)]
    for s in run.samples:
        lines.append(f"  {_one_line(s['prompt'])}")
        lines.append(f"    before: {_one_line(s['before'])}")
        lines.append(f"    after:  {_one_line(s['after'])}")
    return "\n".join(lines)


def _one_line(text: str, width: int = 90) -> str:
    flat = " / ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


# --- entry point -------------------------------------------------------------------------------------------------


def write_report(
    run_dir: str | Path, output: str | Path | None = None, echo: Callable[[str], Any] | None = print
) -> Path:
    """Write <run_dir>/report.html (or `output`) and pass the plain-text summary to `echo` (None: stay quiet)."""
    run = load_run(run_dir)
    out = Path(output) if output else run.dir / REPORT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render_html(run), encoding="utf-8")
    tmp.replace(out)  # a reader never sees half a report
    if echo is not None:
        echo(summary_text(run, out))
    return out
