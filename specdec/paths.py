"""Where specdec keeps files between runs, and whether an output location can be written (no torch import)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """The folder of everything specdec keeps for later runs (synthetic pairs, measured cost
    profiles): $SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    base = os.environ.get("SPECDEC_CACHE_DIR")
    if base:
        return Path(base).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def folder_write_problem(folder: Path) -> str | None:
    """Why files cannot be written in `folder` (made if missing), or None when they can.

    Found by trying, with no trace left: the missing folders are made and removed again, and
    a file is created in the folder and removed (permission bits say little to root, or on a
    read-only file system). E.g. "/proc/version is a file", "/sys/foo: Operation not permitted"."""
    folder = folder.expanduser().absolute()
    missing: list[Path] = []
    existing = folder
    while not os.path.exists(existing) and existing.parent != existing:
        missing.append(existing)
        existing = existing.parent
    if not os.path.isdir(existing):
        return f"{existing} is a file"
    made: list[Path] = []
    try:
        try:
            for path in reversed(missing):
                path.mkdir()
                made.append(path)
        except OSError as err:
            return f"{err.filename or folder}: {err.strerror or err}"
        try:
            handle, name = tempfile.mkstemp(dir=folder, prefix=".specdec-write-check-")
            os.close(handle)
            os.unlink(name)
        except OSError as err:
            return f"no file can be written in {folder}: {err.strerror or err}"
    finally:
        for path in reversed(made):
            with contextlib.suppress(OSError):
                path.rmdir()
    return None
