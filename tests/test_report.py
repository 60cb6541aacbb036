import io
import json
import math
import statistics

import numpy as np
import pytest
from PIL import Image

from tunesmith.cli import main
from tunesmith.errors import TunesmithError
from tunesmith.report import figures, load_run, write_report

from .conftest import tiny_train_config
from .report_fixtures import (
    LADDER,
    PEAK,
    PPL_BEFORE,
    PREDICTED,
    SAMPLES,
    Page,
    find_chromium,
    make_run,
    png_bytes,
    screenshot,
)

ALL_SECTIONS = ["summary", "loss", "speed", "samples", "fit", "ladder", "artifacts", "config"]


def metrics_of(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


def test_report_shows_every_section_with_the_numbers_of_the_run_folder(tmp_path):
    run = make_run(tmp_path)
    out = write_report(run, echo=None)
    assert out == run / "report.html"
    page = Page(out.read_text(encoding="utf-8"))
    assert list(page.sections) == ALL_SECTIONS

    train, evals = metrics_of(run)
    summary = json.loads((run / "summary.json").read_text())
    assert page.metrics == {
        "steps": str(train[-1]["step"]),
        "train_loss_first": f"{train[0]['loss']:.4f}",
        "train_loss_last": f"{train[-1]['loss']:.4f}",
        "val_loss": f"{evals[-1]['val_loss']:.4f}",
        "val_ppl": f"{evals[-1]['val_ppl']:.2f}",
        "ppl_before": f"{summary['ppl_before']:.2f}",
        "ppl_after": f"{summary['ppl_after']:.2f}",
        "tokens": f"{train[-1]['tokens']:,}",
        "tokens_per_s": f"{statistics.median(r['tokens_per_s'] for r in train):.0f}",
        "train_seconds": f"{train[-1]['elapsed_s']:.0f}",
        "peak_memory": f"{max(r['peak_mem_bytes'] for r in train) / 2**30:.2f} GiB",
    }
    # Fit planner: prediction next to the largest peak_mem_bytes that metrics.jsonl measured.
    assert page.fit == {
        "predicted peak": f"{PREDICTED / 2**30:.2f} GiB",
        "measured peak": f"{PEAK / 2**30:.2f} GiB",
        "measured / predicted": f"{PEAK / PREDICTED:.2f}×",
    }
    fit_text = page.sections["fit"]
    assert (
        fit_text.index("activations") < fit_text.index("weights") < fit_text.index("optimizer")
    )  # largest first
    for rung in LADDER:
        for shown in (
            rung["name"],
            f"{rung['perplexity']:.2f}",
            f"{rung['bytes'] / 2**20:.2f} MiB",
            rung["sample"],
        ):
            assert shown in page.sections["ladder"]
    for s in SAMPLES:
        assert s["before"] in page.sections["samples"] and s["after"] in page.sections["samples"]
    assert "adapter/" in page.sections["artifacts"] and "2.93 KiB" in page.sections["artifacts"]
    assert "q_proj, v_proj" in page.sections["config"] and "sample_tokens" in page.sections["config"]


def test_user_text_is_escaped_and_the_page_needs_no_network(tmp_path):
    text = write_report(make_run(tmp_path), echo=None).read_text(encoding="utf-8")
    assert "<script>alert" not in text and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    assert "<b>a</b>" not in text and "&lt;thou&gt; &amp; thee" in text
    assert Page(text).external == []  # no <script>, <link>, or src/href outside data: URIs
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in text


def test_embedded_images_are_pngs_that_decode_at_their_stated_size(tmp_path):
    page = Page(write_report(make_run(tmp_path), echo=None).read_text(encoding="utf-8"))
    assert set(page.images) == {"loss-plot", "speed-plot", "ladder-plot"}
    for img in page.images.values():
        phone = img["narrow"]  # each plot also comes drawn for a phone, taller and denser
        assert phone["media"] == "(max-width: 640px)" and int(phone["width"]) < int(img["width"])
        for uri, w, h in (
            (img["src"], img["width"], img["height"]),
            (phone["srcset"], phone["width"], phone["height"]),
        ):
            im = Image.open(io.BytesIO(png_bytes(uri)))
            im.load()
            assert im.format == "PNG" and im.size == (int(w), int(h))
            assert (
                len(im.convert("RGB").getcolors(maxcolors=1 << 20)) > 50
            )  # a drawn plot, not a blank canvas


def test_plots_are_drawn_from_metrics_jsonl(tmp_path):
    run = make_run(tmp_path)
    train, evals = metrics_of(run)
    figs = figures(load_run(run))
    lines = {line.get_label(): line for line in figs["loss"].axes[0].get_lines()}
    assert list(lines["train loss"].get_xdata()) == [r["step"] for r in train]
    assert list(lines["train loss"].get_ydata()) == [r["loss"] for r in train]
    # The validation curve starts at the demo's before-training perplexity (as a loss) at step 0.
    assert list(lines["validation loss"].get_xdata()) == [0] + [r["step"] for r in evals]
    assert list(lines["validation loss"].get_ydata()) == [math.log(PPL_BEFORE)] + [
        r["val_loss"] for r in evals
    ]
    throughput, memory = figs["speed"].axes
    assert list(throughput.get_lines()[0].get_ydata()) == [r["tokens_per_s"] for r in train]
    measured, predicted = memory.get_lines()
    assert list(measured.get_ydata()) == [r["peak_mem_bytes"] / 2**30 for r in train]
    assert list(predicted.get_ydata()) == [PREDICTED / 2**30] * 2


def test_a_plain_train_run_leaves_out_the_sections_it_has_no_files_for(tmp_path):
    run = make_run(tmp_path, demo=False, fit=False, ladder=False, evals=False)
    printed = []
    page = Page(write_report(run, echo=printed.append).read_text(encoding="utf-8"))
    assert list(page.sections) == ["summary", "loss", "speed", "artifacts", "config"]
    assert set(page.images) == {"loss-plot", "speed-plot"}
    assert not {"val_loss", "val_ppl", "ppl_before", "ppl_after"} & set(page.metrics)
    assert {line.get_label() for line in figures(load_run(run))["loss"].axes[0].get_lines()} == {
        "train loss",
        "train loss (smoothed)",
    }
    text = printed[0]
    assert "fit planner" not in text and "quality ladder" not in text and "before:" not in text


def test_terminal_summary_has_the_same_numbers(tmp_path):
    run = make_run(tmp_path)
    train, evals = metrics_of(run)
    printed = []
    out = write_report(run, echo=printed.append)
    [text] = printed
    assert text.splitlines()[0] == f"run report: {out}"
    assert f"train loss {train[0]['loss']:.4f} -> {train[-1]['loss']:.4f}" in text
    assert f"validation loss {evals[-1]['val_loss']:.4f}, perplexity {evals[-1]['val_ppl']:.2f}" in text
    assert f"peak memory {PEAK / 2**30:.2f} GiB" in text
    assert (
        f"fit planner predicted peak {PREDICTED / 2**30:.2f} GiB, measured {PEAK / 2**30:.2f} GiB "
        f"({PEAK / PREDICTED:.2f}x)"
    ) in text
    assert f"before -> after: {PPL_BEFORE:.2f} -> {evals[-1]['val_ppl']:.2f}" in text
    ladder_lines = [line for line in text.splitlines() if "tokens/s" in line and "perplexity" in line]
    assert [line.split()[0] for line in ladder_lines] == ["merged", "int8", "int4"]
    assert "after:  But soft, what light through yonder window breaks?" in text


def _bad_metrics_line(run):
    text = (run / "metrics.jsonl").read_text().splitlines()
    text[2] = '{"kind": "train", "step": 3, "loss": '
    (run / "metrics.jsonl").write_text("\n".join(text))


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda run: run.rename(run.with_name("gone")), "run folder not found"),
        (lambda run: (run / "metrics.jsonl").unlink(), "no metrics.jsonl"),
        (_bad_metrics_line, "metrics.jsonl:3: not valid JSON"),
        (
            lambda run: (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n'),
            "metrics.jsonl:1: train row lacks a number for loss",
        ),
        (
            lambda run: (run / "metrics.jsonl").write_text('{"kind": "eval", "step": 1, "val_loss": 2.0}\n'),
            "no training steps",
        ),
        (lambda run: (run / "samples.json").write_text('[{"prompt": "x"}]'), "samples.json: item 0"),
        (
            lambda run: (run / "ladder.json").write_text('{"name": "int8"}'),
            "ladder.json: expected a JSON list",
        ),
        (
            lambda run: (run / "fit.json").write_text('{"parts": {}}'),
            "fit.json: needs a number 'predicted_peak_bytes'",
        ),
        (
            lambda run: (run / "fit.json").write_text('{"predicted_peak_bytes": 1, "parts": [1]}'),
            "fit.json: 'parts' must map",
        ),
        (lambda run: (run / "summary.json").write_text("{oops"), "summary.json:1: not valid JSON"),
    ],
)
def test_a_broken_run_folder_is_one_clear_error(tmp_path, spoil, message):
    run = make_run(tmp_path)
    spoil(run)
    with pytest.raises(TunesmithError, match=message.replace("(", r"\(")):
        write_report(run, echo=None)
    assert not (run / "report.html").exists()


def test_cli_report_takes_the_run_folder_as_a_positional(tmp_path, capsys):
    run = make_run(tmp_path)
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").is_file()
    assert f"run report: {run / 'report.html'}" in capsys.readouterr().out
    assert main(["report", str(run), "--output", str(tmp_path / "elsewhere" / "r.html")]) == 0
    assert (tmp_path / "elsewhere" / "r.html").is_file()
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "tunesmith report: error: run folder not found" in capsys.readouterr().err


def test_the_train_verb_writes_the_report_and_the_library_leaves_it_to_its_caller(tmp_path, tiny_dir, text_file,
                                                                                   capsys):
    from tunesmith.train import train

    result = train(tiny_train_config(tmp_path, tiny_dir, text_file, output=str(tmp_path / "lib")), progress=False)
    assert result.steps == 5 and not (result.run_dir / "report.html").exists()
    assert capsys.readouterr().out == ""

    run = tmp_path / "cli"
    assert main(["train", "--model", str(tiny_dir), "--data", str(text_file), "--output", str(run), "--device", "cpu",
                 "--seq-len", "32", "--batch-size", "2", "--max-steps", "5", "--lr", "1e-2", "--warmup-steps", "1",
                 "--eval-every", "0"]) == 0
    train_rows, evals = metrics_of(run)
    page = Page((run / "report.html").read_text(encoding="utf-8"))
    assert page.metrics["steps"] == "5"
    assert page.metrics["train_loss_last"] == f"{train_rows[-1]['loss']:.4f}"
    assert page.metrics["val_loss"] == f"{evals[-1]['val_loss']:.4f}"
    out = capsys.readouterr().out
    assert f"run report: {run / 'report.html'}" in out and "trained 5 steps" in out


MARKER = (255, 0, 255)


def _solid_png(rgb, size) -> str:
    import base64

    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("width, height", [(1280, 2000), (390, 2400)], ids=["laptop", "phone"])
def test_report_renders_in_headless_chromium(tmp_path, width, height):
    browser = find_chromium()
    if browser is None:
        pytest.skip("chromium not found on PATH; `make browser` installs it (apt-get install chromium)")
    report = write_report(make_run(tmp_path), echo=None)
    text = report.read_text(encoding="utf-8")
    wide = Page(text).images["loss-plot"]
    phone = wide["narrow"]
    # Same page with the loss plot swapped for a solid colour: where that colour lands is where the plot is drawn.
    marked = tmp_path / "marked.html"
    marked_text = text.replace(wide["src"], _solid_png(MARKER, (int(wide["width"]), int(wide["height"]))))
    marked_text = marked_text.replace(
        phone["srcset"], _solid_png(MARKER, (int(phone["width"]), int(phone["height"])))
    )
    marked.write_text(marked_text, encoding="utf-8")
    loss = phone if width <= 640 else wide  # the <picture> picks the phone rendering on a narrow screen
    screenshot(browser, report, tmp_path / "report.png", width, height)
    screenshot(browser, marked, tmp_path / "marked.png", width, height)
    shot = np.asarray(Image.open(tmp_path / "report.png").convert("RGB")).astype(int)
    ref = np.asarray(Image.open(tmp_path / "marked.png").convert("RGB")).astype(int)
    assert shot.shape == ref.shape == (height, width, 3)

    # Not blank: many colours, and no single colour covers most of the page.
    colours, counts = np.unique(shot[..., 0] << 16 | shot[..., 1] << 8 | shot[..., 2], return_counts=True)
    assert len(colours) > 200 and counts.max() < 0.8 * shot.shape[0] * shot.shape[1]

    # The plot's box: on screen, inside the viewport, scaled with its aspect ratio kept.
    ys, xs = np.nonzero(np.abs(ref - MARKER).sum(axis=2) < 30)
    assert len(xs) > 0, "the loss plot is not on the first screen"
    top, bottom, left, right = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    box_w, box_h = right - left, bottom - top
    assert (
        right <= width and box_w >= min(int(loss["width"]), width) * 0.8
    )  # fits the screen, fills the column
    assert abs(box_w / box_h - int(loss["width"]) / int(loss["height"])) < 0.05

    # In the real page that box holds a drawn plot (axes, text, the orange validation curve) and nothing else moved.
    plot = shot[top:bottom, left:right]
    assert (plot.sum(axis=2) < 600).mean() > 0.02  # non-white ink
    orange = (np.abs(plot - (217, 72, 15)).sum(axis=2) < 60).sum()
    assert orange > 30
    outside = np.ones(shot.shape[:2], bool)
    outside[top:bottom, left:right] = False
    assert (shot[outside] == ref[outside]).all()


def test_the_report_warns_of_rising_validation_loss_and_a_tiny_validation_set(tmp_path):
    from tunesmith.report import Run, summary_text, warnings

    train = [{"step": i, "loss": 3.0 - 0.1 * i} for i in range(1, 21)]
    evals = [{"step": 10, "val_loss": 2.0}, {"step": 20, "val_loss": 2.4}]
    run = Run(tmp_path, {}, train, evals, summary={"device": "cpu", "precision": "bf16", "valid_examples": 2})
    found = warnings(run)
    assert any("validation loss rose from 2.0000 (step 10) to 2.4000" in w for w in found)
    assert any("validation set holds 2 examples" in w for w in found)
    text = summary_text(run)
    assert "trained on cpu, bf16" in text and text.count("warning: ") == 2
    healthy = Run(tmp_path, {}, train, [{"step": 10, "val_loss": 2.4}, {"step": 20, "val_loss": 2.0}],
                  summary={"valid_examples": 40})
    assert warnings(healthy) == []
