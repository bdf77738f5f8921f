"""Names the CLI's help lists, importable without torch (tests check them against the code
that implements them)."""

from __future__ import annotations

METHOD_NAMES: tuple[str, ...] = ("ar", "chain", "static", "eagle2", "dynatree", "cast")
"""every --method: the keys of `specdec.methods.POLICY_CLASSES`"""
