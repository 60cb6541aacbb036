"""What a user sees while a long step runs, on stderr: a status line, and progress that suits where stderr goes.

On a terminal, a rich bar per task. Anywhere else (a log file, a pipe, a job scheduler's capture) a bar cannot
redraw, and rich would print it once, at the end; there each task prints plain lines instead, as the HF Trainer's
logs do: one at its first step, then one every INTERVAL seconds, and one at its last, each with the step, what
the caller adds (loss, tok/s), the time taken and the time left.

Every step that can take more than a few seconds (training, its evaluation, GPTQ over the layers, a first GGUF
conversion, parity's prompts, the quantize verb's stages) says what it is doing here; library callers turn it off
with progress=False.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

INTERVAL = 30.0  # seconds between two plain progress lines of a task


def status(text: str, enabled: bool = True) -> None:
    """One line on stderr, as `tunesmith: text`."""
    if enabled:
        print(f"tunesmith: {text}", file=sys.stderr, flush=True)


def on_terminal() -> bool:
    """Whether stderr is a terminal (as rich decides it, so FORCE_COLOR and TTY_COMPATIBLE are honoured)."""
    from rich.console import Console

    return Console(stderr=True).is_terminal


def clock(seconds: float) -> str:
    """A duration as the logs show it: 42s, 3m07s, 1h02m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Task:
    """One task's progress: `advance()` after each step (with what to show beside the count), `resize()` when the
    total changes. Plain lines: at the task's first step in this process (unless not `first`: then a task that
    ends within `interval` seconds prints nothing), every `interval` seconds, and at the last step."""

    def __init__(self, owner: Progress, description: str, total: int, completed: int = 0, first: bool = True):
        self.owner, self.description, self.total, self.completed = owner, description, total, completed
        self.started, self.start_count = owner.now(), completed  # the pace counts this process's steps only
        self.last_line: float | None = None if first else self.started
        self.printed = False
        self.id = owner.bar.add_task(description, total=total, completed=completed, info="") if owner.bar else None

    def advance(self, n: int = 1, info: str = "") -> None:
        self.completed += n
        if self.owner.bar is not None:
            self.owner.bar.update(self.id, advance=n, info=info)
        elif self.owner.plain:
            now = self.owner.now()
            due = self.last_line is None or now - self.last_line >= self.owner.interval
            if due or (self.completed >= self.total and self.printed):
                self.last_line, self.printed = now, True
                self.owner.write(self.line(now, info))

    def resize(self, total: int) -> None:
        self.total = total
        if self.owner.bar is not None:
            self.owner.bar.update(self.id, total=total)

    def line(self, now: float, info: str = "") -> str:
        """`train 10/200 (5%): loss 2.3415, 1250 tok/s; 1m02s, about 19m38s left`."""
        elapsed, done = now - self.started, self.completed - self.start_count
        ahead = self.total - self.completed
        left = f", about {clock(elapsed / done * ahead)} left" if done > 0 and ahead > 0 else ""
        share = f" ({self.completed / self.total:.0%})" if self.total else ""
        return (f"{self.description} {self.completed}/{self.total}{share}" + (f": {info}" if info else "")
                + f"; {clock(elapsed)}{left}")

    def remove(self) -> None:
        if self.owner.bar is not None:
            self.owner.bar.remove_task(self.id)


class Progress:
    """Progress on stderr for one or more tasks at once: a rich bar each on a terminal, plain lines elsewhere, nothing
    when not `enabled`. A context manager; `note()` prints a line above the bars."""

    def __init__(self, enabled: bool = True, interval: float = INTERVAL, stream: TextIO | None = None,
                 terminal: bool | None = None, now: Callable[[], float] = time.monotonic):
        self.enabled, self.interval, self.stream, self.now = enabled, interval, stream, now
        terminal = enabled and (on_terminal() if terminal is None else terminal)
        self.plain = enabled and not terminal
        self.bar = _rich_bar() if terminal else None

    def task(self, description: str, total: int, completed: int = 0, first: bool = True) -> Task:
        return Task(self, description, total, completed, first)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(f"tunesmith: {text}")
        elif self.enabled:
            self.write(text)

    def write(self, text: str) -> None:
        print(f"tunesmith: {text}", file=self.stream or sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def _rich_bar():
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as RichProgress

    # `info` is empty until the first step: no "loss nan, 0 tok/s" before there is a loss
    return RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                        console=Console(stderr=True))


@contextlib.contextmanager
def steps(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[], None]]:
    """Progress of `total` steps on stderr (a bar, or plain lines off a terminal); yields the function that advances
    it by one."""
    if not enabled:
        yield lambda: None
        return
    with Progress() as progress:
        yield progress.task(description, total).advance
