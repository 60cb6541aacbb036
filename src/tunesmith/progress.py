"""What a user sees while a long step runs: a progress bar (rich) or a status line, both on stderr.

Every step that can take more than a few seconds (GPTQ over the layers, a first GGUF conversion, parity's prompts,
the quantize verb's stages) says what it is doing here; library callers turn it off with progress=False.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


def status(text: str, enabled: bool = True) -> None:
    """One line on stderr, as `tunesmith: text`."""
    if enabled:
        print(f"tunesmith: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def steps(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[], None]]:
    """A progress bar of `total` steps on stderr; yields the function that advances it by one."""
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True))
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)
