"""Where the bundled model pairs live (importable without torch)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
BUNDLED_PAIR = ASSETS / "pair"
"""the bundled GPT-NeoX target/draft pair (trained by `specdec train pair`)"""
BUNDLED_LVLM = ASSETS / "lvlm"
"""the bundled tiny LLaVA-style pair (trained by `specdec train lvlm`)"""


def bundled_target() -> str:
    """Folder of the bundled GPT-NeoX target (trained by `specdec train pair`)."""
    return str(BUNDLED_PAIR / "target")


def bundled_draft() -> str:
    """Folder of the bundled GPT-NeoX draft."""
    return str(BUNDLED_PAIR / "draft")


def bundled_lvlm_target() -> str:
    """Folder of the bundled LLaVA-style target (trained by `specdec train lvlm`)."""
    return str(BUNDLED_LVLM / "target")


def bundled_lvlm_draft() -> str:
    """Folder of the bundled LLaVA-style draft."""
    return str(BUNDLED_LVLM / "draft")
