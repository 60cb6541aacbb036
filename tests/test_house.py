"""The house's limits, as tests, so they hold after the work that set them: functions short enough to see whole,
no dates, machines or result files in the source, docs a newcomer can read, a small bench/ and a short `train
--help`. Each failure names the offenders and the limit.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

MAX_FUNCTION_LINES = 80  # the training loop included: split it into named steps before it grows past this
MAX_README_LINES = 350
MAX_PERFORMANCE_LINES = 200
MAX_BENCH_SCRIPTS = 10
MAX_TRAIN_OPTIONS = 40
# A date, the name of the machine a figure came from, or a result file: these belong to docs/ and git, where they
# are kept up to date; in the source they go stale and say when a thing was measured instead of why it is so.
FORBIDDEN = {
    "a date": re.compile(r"20\d\d-\d\d-\d\d"),
    "a hardware name": re.compile(r"H200"),
    "a result path": re.compile(r"bench/results"),
}


def _source_files() -> list[Path]:
    """Every file under src/ that the project keeps: not bytecode, not the egg-info pip writes from the README."""
    return sorted(
        p
        for p in SRC.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and not any(part.endswith(".egg-info") for part in p.parts)
    )


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_function_in_src_is_longer_than_80_lines():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # from `def`: decorators are not counted
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}() is {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_src_holds_no_dates_hardware_names_or_result_paths():
    found = []
    for path in _source_files():
        text = path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if match := pattern.search(line):
                    found.append(
                        f"{path.relative_to(ROOT)}:{number}: {what} ({match.group()}): {line.strip()[:100]}"
                    )
    assert not found, "say why, not when or where it was measured; found in src/:\n" + "\n".join(found)


def test_readme_and_performance_doc_stay_short():
    over = []
    for name, limit in (("README.md", MAX_README_LINES), ("docs/PERFORMANCE.md", MAX_PERFORMANCE_LINES)):
        lines = _line_count(ROOT / name)
        if lines > limit:
            over.append(f"{name} is {lines} lines (at most {limit})")
    assert not over, "; ".join(over)


def test_bench_holds_at_most_10_scripts():
    helpers = {
        "__init__.py",
        "common.py",
    }  # the package marker and the one shared helper module are not scripts
    scripts = sorted(p.name for p in (ROOT / "bench").iterdir() if p.is_file() and p.name not in helpers)
    assert len(scripts) <= MAX_BENCH_SCRIPTS, (
        f"bench/ holds {len(scripts)} scripts (at most {MAX_BENCH_SCRIPTS}): {', '.join(scripts)}; "
        "a finished experiment leaves with its result in the commit message"
    )


def _train_parser() -> argparse.ArgumentParser:
    from tunesmith.cli import build_parser

    verbs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return verbs.choices["train"]


def test_train_help_lists_at_most_40_options():
    options = [
        action.option_strings[0]  # one per action: a flag, its --no- form and its mlx-lm alias are one option
        for action in _train_parser()._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    ]
    assert len(options) <= MAX_TRAIN_OPTIONS, (
        f"`tunesmith train --help` lists {len(options)} options (at most {MAX_TRAIN_OPTIONS}): {' '.join(options)}"
    )
