"""Parsing comma-separated command-line lists, with errors that name the flag."""

from __future__ import annotations

from collections.abc import Callable

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


def parse_float_list(text: str, flag: str, check: Callable[[float], float] | None = None, example: str = "0.01,0.03,0.1") -> list[float]:
    """'0.01,0.03' -> [0.01, 0.03] (duplicates dropped, order kept); `check` validates (and may
    normalise) each value, raising SpecDecError."""
    values: list[float] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        try:
            value = float(piece)
        except ValueError:
            raise SpecDecError(f"{flag}: {piece!r} is not a number; give a comma-separated list such as {example}") from None
        if check is not None:
            value = check(value)
        if value not in values:
            values.append(value)
    if not values:
        raise SpecDecError(f"{flag} is empty; give a comma-separated list such as {example}")
    return values


SEED_MIN, SEED_MAX = 0, 2**64 - 1
"""the seeds specdec takes: torch.Generator.manual_seed's unsigned 64 bits (it also takes negative
ones, as aliases of large ones: -1 seeds as 2**64 - 1, so they are refused rather than silently mapped)"""


def check_seed(seed: object, flag: str = "--seed") -> None:
    """None or an integer torch can seed a generator with; a SpecDecError otherwise. flag: how the
    message names it, "--seed" (the CLI's "--seed -1") or "seed=" (the Python API's "seed=-1")."""
    if seed is None:
        return
    named = f"{flag}{seed!r}" if flag.endswith("=") else f"{flag} {seed!r}"
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SpecDecError(f"{named} must be an integer")
    if seed < SEED_MIN:
        raise SpecDecError(f"{named} must be at least 0; give an integer from 0 to {SEED_MAX}")
    if seed > SEED_MAX:
        raise SpecDecError(f"{named} does not fit in 64 bits; give an integer from 0 to {SEED_MAX}")


def check_callback(callback: object, name: str, signature: str) -> None:
    """A SpecDecError unless `callback` is None or callable; `signature` shows how it is called."""
    if callback is not None and not callable(callback):
        raise SpecDecError(f"{name}={callback!r} must be a function {signature}, or None")


def check_max_draft_rows(value: object) -> int | None:
    """`value` if it is None (no limit) or a positive integer, else a SpecDecError naming it.

    max_draft_rows: a decoding step with more active rows than this drafts nothing: the target
    alone decodes one token a row (a plain step, as AR), and the draft catches up on those
    tokens at the next drafted step. Speculation pays at small batches and loses once the batch
    fills the device (vLLM's `speculative_disable_by_batch_size` is a similar knob); measure where with
    `specdec bench --batch-sizes`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecDecError(
            f"max_draft_rows={value!r} must be a positive integer (steps with more active rows than this draft nothing), or None for no limit"
        )
    return value
