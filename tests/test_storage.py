"""The one folder writer: all or nothing, fsynced before the rename, modes from the umask; the cache location."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

import pytest

from tunesmith import storage


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _fill(folder: Path, text: str) -> None:
    (folder / "weights.bin").write_text(text)
    (folder / "sub").mkdir()
    (folder / "sub" / "nested.json").write_text("{}")
    fd = os.open(folder / "private.json", os.O_WRONLY | os.O_CREAT, 0o600)  # a writer that makes private files
    os.close(fd)


def test_the_umask_is_read_without_changing_it():
    with umask(0o027):
        assert storage.current_umask() == 0o027
        assert os.umask(0o027) == 0o027  # still in place


@pytest.mark.parametrize("mask,folder_mode,file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600),
                                                        (0o002, 0o775, 0o664)])
def test_the_written_folder_has_the_modes_the_umask_gives(tmp_path, mask, folder_mode, file_mode):
    with umask(mask), storage.atomic_folder(tmp_path / "out") as tmp:
        assert _mode(tmp) == 0o700  # private while it is being written
        _fill(tmp, "new")
    out = tmp_path / "out"
    assert {_mode(p) for p in [out, out / "sub"]} == {folder_mode}
    assert {_mode(p) for p in [out / "weights.bin", out / "private.json", out / "sub" / "nested.json"]} == {file_mode}


def test_a_finished_write_replaces_the_old_folder_and_leaves_nothing_beside_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("from the last run")
    with storage.atomic_folder(out) as tmp:
        assert tmp.parent == tmp_path and tmp != out
        _fill(tmp, "new")
        assert (out / "stale.txt").is_file()  # readers see the old folder until the rename
    assert _tree(out) == {"private.json": b"", "sub": None, "sub/nested.json": b"{}", "weights.bin": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_write_leaves_the_old_folder_as_it_was(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "weights.bin").write_text("old")
    before = _tree(out)
    with pytest.raises(OSError, match="No space left"), storage.atomic_folder(out) as tmp:
        (tmp / "weights.bin").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_every_file_and_folder_is_fsynced_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    events: list[tuple[str, str, bool]] = []  # (kind, path, target in place yet)
    out = tmp_path / "out"
    real_file, real_dir = storage.fsync_file, storage.fsync_dir

    def on_file(f):
        events.append(("file", Path(f.name).name, out.exists()))
        real_file(f)

    def on_dir(path):
        events.append(("dir", Path(path).name, out.exists()))
        real_dir(path)

    monkeypatch.setattr(storage, "fsync_file", on_file)
    monkeypatch.setattr(storage, "fsync_dir", on_dir)
    with storage.atomic_folder(out) as tmp:
        _fill(tmp, "new")
    before = {(kind, name) for kind, name, placed in events if not placed}
    assert before == {("file", "weights.bin"), ("file", "private.json"), ("file", "nested.json"), ("dir", "sub"),
                      ("dir", tmp.name)}
    assert events[-1] == ("dir", tmp_path.name, True)  # the rename itself made durable
    assert [e for e in events if e[2]] == [events[-1]]


def test_a_rename_that_cannot_be_made_durable_puts_the_old_folder_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "weights.bin").write_text("old")
    real = storage.fsync_dir

    def broken_parent(path):
        if Path(path) == tmp_path:
            raise OSError(errno.EIO, "Input/output error")
        real(path)

    monkeypatch.setattr(storage, "fsync_dir", broken_parent)
    with pytest.raises(OSError, match="Input/output"), storage.atomic_folder(out) as tmp:
        (tmp / "weights.bin").write_text("new")
    assert _tree(out) == {"weights.bin": b"old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_remove_folder_leaves_nothing(tmp_path):
    victim = tmp_path / "step-000002"
    (victim / "deep").mkdir(parents=True)
    (victim / "deep" / "f").write_text("x")
    storage.remove_folder(victim)
    storage.remove_folder(tmp_path / "never-was")  # nothing to do is not an error
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TUNESMITH_CACHE", str(tmp_path / "c"))
    assert storage.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TUNESMITH_CACHE")
    assert storage.cache_dir() == Path.home() / ".cache" / "tunesmith"
