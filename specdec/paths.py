"""Where specdec keeps files between runs (no torch import)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The folder of everything specdec keeps for later runs (synthetic pairs, measured cost
    profiles): $SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    base = os.environ.get("SPECDEC_CACHE_DIR")
    if base:
        return Path(base).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"
