"""Ragged token lists -> one padded tensor and its attention mask."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_rows(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] long tensor of `seqs` padded with `pad_id` on `side` ("left" or "right") to the
    longest, and its [B, L] 0/1 mask (1 on each row's own tokens), both on the CPU."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be left or right, got {side!r}")
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[row, cols] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, cols] = 1
    return ids, mask
