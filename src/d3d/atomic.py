"""Writes that leave either the old version or the new one, whole, also across a power loss.

A file or folder is written beside its destination under a temp name (the destination's name + TEMP),
fsynced, renamed into place, and the folder holding it fsynced (a rename is recorded in the folder, not
in the file). An error or an interruption (KeyboardInterrupt included) deletes the temp; one left by a
killed process has the same fixed name, so the next write of that destination deletes or overwrites it.
Two processes must not write the same destination at once (the cache takes d3d.runtime.checkpoints.cache_lock).
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

TEMP = ".tmp"


def umask_modes(path: Path) -> Path:
    """Give `path` (a file, or a folder and the files in it) the permissions a plain write would have had
    under the process umask. Temp files and folders (tempfile, safetensors) are created private (0600 /
    0700), and an atomic write renames them into place as they are: a drafter saved for a team, or a model
    cache shared on a machine, would be unreadable to everyone else."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [path, *(path.iterdir() if path.is_dir() else [])]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)
    return path


def fsync_path(path: str | Path) -> None:
    """fsync a file, or a folder (which holds the renames done in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> Path:
    """fsync every file and folder under the folder `root`, root included (before it is renamed into place)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)
    return root


@contextmanager
def atomic_path(path: Path):
    """Yields the temp path to write the file `path` at; when the block ends the file is fsynced and renamed
    to `path`, or deleted if the block raised."""
    path = Path(path)
    tmp = path.with_name(path.name + TEMP)
    try:
        yield tmp
        fsync_path(umask_modes(tmp))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


@contextmanager
def atomic_folder(path: Path):
    """Yields an empty temp folder to write the folder `path`'s files in; when the block ends it takes
    `path`'s place (replace_folder), or is deleted if the block raised."""
    path = Path(path)
    tmp = path.with_name(path.name + TEMP)
    shutil.rmtree(tmp, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        yield tmp
        replace_folder(fsync_tree(umask_modes(tmp)), path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one rename (Linux renameat2 with RENAME_EXCHANGE); False where the C library or
    the file system cannot (then nothing moved)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def replace_folder(new: Path, path: Path) -> None:
    """Put the folder `new` in `path`'s place, deleting the folder that was there. `path` is never missing
    and never half written: the two folders swap in one rename, so each lookup of `path` finds the old
    folder or the new one, whole (a reader that opens several files by path across the swap can get some
    of each). Where the file system cannot swap (renameat2 unsupported: some network file systems), the old
    folder is renamed aside first and `path` is missing between the two renames."""
    if not path.exists():
        os.replace(new, path)
    elif not _exchange(new, path):
        aside = new.with_name(new.name + ".old")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        os.replace(new, path)
        new = aside
    fsync_path(path.parent)
    shutil.rmtree(new, ignore_errors=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all, durably (atomic_path: fsynced, renamed into place, the folder
    fsynced; an interruption deletes the temp file)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=1) + "\n").encode())
