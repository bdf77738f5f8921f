"""Small device tensors made once and reused by the decode loop (read-only).

Every tensor built on the hot path is a kernel launch on a GPU (`specdec.hostwork`), so index
ranges and constant columns that only depend on a size and a device are made once per
(size, device) here and shared. Callers must never write into them (no in-place ops, no
`out=`); views (slices, `expand`) are free.
"""

from __future__ import annotations

import torch

_BLOCK = 64
"""aranges are made in blocks of this many, so nearby lengths share one tensor"""

_CACHE: dict[tuple[object, ...], torch.Tensor] = {}


def arange(n: int, device: torch.device) -> torch.Tensor:
    """[n] int64 `torch.arange(n)` on `device` (a view of a shared, read-only tensor)."""
    size = -(-max(n, 1) // _BLOCK) * _BLOCK
    key = ("arange", size, device)
    t = _CACHE.get(key)
    if t is None:
        t = _CACHE[key] = torch.arange(size, device=device)
    return t[:n]


def full(shape: tuple[int, ...], value: bool | int | float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.full(shape, value)` on `device`, made once per (shape, value, dtype, device) (read-only)."""
    key = ("full", shape, value, dtype, device)
    t = _CACHE.get(key)
    if t is None:
        t = _CACHE[key] = torch.full(shape, value, dtype=dtype, device=device)
    return t


def ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n] ones of `dtype` on `device` (a view of a shared, read-only tensor made in blocks)."""
    size = -(-max(n, 1) // _BLOCK) * _BLOCK
    return full((size,), 1, dtype, device)[:n]


def below(k: int, bound: int, device: torch.device) -> torch.Tensor:
    """[k] bool: position r < bound (read-only)."""
    key = ("below", k, bound, device)
    t = _CACHE.get(key)
    if t is None:
        t = _CACHE[key] = arange(k, device) < bound
    return t


def prefix_masks(n: int, device: torch.device) -> torch.Tensor:
    """[n + 1, n] bool: row e is `arange(n) < e`, the first e columns (a view of a shared,
    read-only tensor; select rows with views and stack them)."""
    size = -(-max(n, 1) // _BLOCK) * _BLOCK
    key = ("prefix_masks", size, device)
    t = _CACHE.get(key)
    if t is None:
        cols = torch.arange(size, device=device)
        t = _CACHE[key] = cols[None, :] < torch.arange(size + 1, device=device)[:, None]
    return t[: n + 1, :n]
