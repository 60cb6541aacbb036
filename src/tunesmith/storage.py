"""Files on disk, the ground every stage stands on: where the cache lives, safe reading of tensor files, fsync, and
the one way a stage writes its output folder (atomically, durably, with the modes the user's umask asks for).

Imports only the standard library, torch / safetensors and tunesmith.errors, so any module may use it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tunesmith.errors import TunesmithError

# Weight files that pickle can hide code in: tunesmith refuses them unless --allow-pickle (then weights_only=True).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TMP_PREFIX, TRASH_PREFIX = ".tmp-", ".trash-"  # siblings of a folder being written / being deleted


def cache_dir() -> Path:
    """Where converted models and downloaded data are kept: $TUNESMITH_CACHE or ~/.cache/tunesmith."""
    root = os.environ.get("TUNESMITH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tunesmith")
    return Path(root)


# ------------------------------------------------------------------------------------------- tensor files


def read_safetensors(path: str | Path):
    """The one way tunesmith reads tensors from disk: safetensors only (never pickle); a truncated or corrupted
    file is an error naming it. Returns {name: tensor}."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _unreadable(path, e) from None


def check_safetensors(path: str | Path) -> None:
    """Validate a safetensors file's header and size without reading the tensors (cheap, for large weights)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _unreadable(path, e) from None


def _unreadable(path: str | Path, e: BaseException) -> TunesmithError:
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return TunesmithError(f"{path}: not a readable safetensors file ({first}); it is truncated or corrupted")


# ------------------------------------------------------------------------------------------------- fsync


def fsync_file(f) -> None:
    """Flush an open file to the disk itself."""
    f.flush()
    os.fsync(f.fileno())
    if sys.platform == "darwin":  # macOS fsync leaves data in the drive's cache; F_FULLFSYNC flushes it
        import fcntl

        fcntl.fcntl(f.fileno(), fcntl.F_FULLFSYNC)


def fsync_dir(path: Path) -> None:
    """Make a rename or new file in `path` durable (POSIX; Windows has no directory fsync)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file below `root`, then every folder from the deepest up (a folder's entries after its files)."""
    folders = []
    for here, _, files in os.walk(root):
        folders.append(Path(here))
        for name in files:
            path = Path(here) / name
            if path.is_symlink():
                continue
            with open(path, "rb") as f:
                fsync_file(f)
    for folder in reversed(folders):
        fsync_dir(folder)


# ------------------------------------------------------------------------------------------------ modes


def current_umask() -> int:
    """The process's umask, read without changing it where the system allows (Linux), else set and put back."""
    with contextlib.suppress(OSError, ValueError):
        match = re.search(r"^Umask:\s*([0-7]+)", Path("/proc/self/status").read_text(), re.MULTILINE)
        if match:
            return int(match.group(1), 8)
    mask = os.umask(0o077)  # for the instant it is set, new files are private rather than open
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give `root` and everything below it the modes a plain mkdir / open would: folders 0o777 and files 0o666
    (0o777 when executable) less the umask. Temporary folders are private (mkdtemp: 0o700), and some writers make
    private files; the output is meant to be shared as the user's other files are."""
    mask = current_umask()
    for here, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(here) / name
            if path.is_symlink():  # chmod would follow it
                continue
            full = 0o777 if path.is_dir() or path.stat().st_mode & 0o111 else 0o666
            path.chmod(full & ~mask)
    root.chmod(0o777 & ~mask)


# ------------------------------------------------------------------------------------------ folder writes


def remove_folder(path: Path) -> None:
    """Delete a folder so that a crash midway never leaves a half-deleted one under its real name: it is renamed to
    a hidden trash name first."""
    trash = path if path.name.startswith(".") else path.with_name(f"{TRASH_PREFIX}{path.name}-{os.getpid()}")
    try:
        os.replace(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def swap_in(tmp: Path, target: Path) -> Path | None:
    """Rename the finished folder `tmp` to its sibling `target` and fsync the parent, so the rename survives a crash.

    A folder already at `target` is first renamed aside (a directory cannot be renamed over a full one); the aside
    path is returned, for the caller to delete once the new folder is committed (or to rename back). On failure
    everything is put back as it was and the error raised."""
    aside = None
    if target.exists():
        aside = target.with_name(f"{TRASH_PREFIX}{target.name}-{os.getpid()}")
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(target, aside)
    placed = False
    try:
        os.replace(tmp, target)
        placed = True
        fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            if placed:
                os.replace(target, tmp)
            if aside is not None:
                os.replace(aside, target)
        raise
    return aside


@contextlib.contextmanager
def atomic_folder(target: str | Path) -> Iterator[Path]:
    """Write a folder all at once: yields an empty temporary sibling to fill. On success its modes follow the umask,
    every file and folder is fsynced, and it is renamed to `target`, replacing what was there; on failure it is
    removed and `target` is untouched. Readers see the old folder or the whole new one, never a part."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))
    try:
        yield tmp
        apply_umask(tmp)
        fsync_tree(tmp)
        old = swap_in(tmp, target)
        if old is not None:
            remove_folder(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
