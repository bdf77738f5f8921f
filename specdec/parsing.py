"""Parsing comma-separated command-line lists, with errors that name the flag."""

from __future__ import annotations

from specdec.errors import SpecDecError


def parse_int_list(text: str, flag: str) -> list[int]:
    """'3,4,5' -> [3, 4, 5] (positive, duplicates dropped, order kept)."""
    values: list[int] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        try:
            value = int(piece)
        except ValueError:
            raise SpecDecError(f"{flag}: {piece!r} is not an integer; give a comma-separated list such as 3,4,5") from None
        if value < 1:
            raise SpecDecError(f"{flag}: {value} must be a positive integer")
        if value not in values:
            values.append(value)
    if not values:
        raise SpecDecError(f"{flag} is empty; give a comma-separated list such as 3,4,5")
    return values
