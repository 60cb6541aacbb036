"""`tunesmith VERB ...` in a child process, as a user runs it: its exit code, stdout and stderr, nothing patched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def run_cli(*args, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the CLI from this checkout's src/ with the test environment (its cache, offline hub, fp32 on the CPU)."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "tunesmith.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)
