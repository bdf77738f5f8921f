"""The accept-rule protocol and its result.

Terms, defined once and used in every name, metric and report:

- **drafted tokens**: the draft tokens of a tree sent to verification (valid nodes except the root).
- **accepted tokens**: drafted tokens on the path the accept rule keeps; `accepted_len` per row.
- **bonus token**: the one token the target adds after the accepted path in every step: the
  target's own choice at the last accepted node (a "correction" when a draft token there was
  rejected, a free extra token when the path ended at a leaf).
- **committed tokens** of a step: accepted tokens + the bonus token (`accepted_len + 1`).
- **relaxed tokens**: accepted tokens that a strict rule would have rejected (MARS only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.sampling import SamplingParams
from specdec.tree import TokenTree


@dataclass
class Verdict:
    """What the accept rule decided for each row of a batch of trees."""

    accepted_nodes: list[list[int]]
    """per row: node indices of the accepted path, root excluded, root-to-leaf order"""
    bonus_tokens: torch.Tensor
    """[B] int64: the bonus token of each row"""
    relaxed: list[int]
    """per row: how many accepted tokens were accepted only by a relaxed rule (MARS)"""
    strict_fallbacks: list[int]
    """per row: positions where a relaxed rule fell back to strict verification (MARS, z1 <= 0)"""

    @property
    def accepted_len(self) -> torch.Tensor:
        """[B] int64 accepted tokens per row."""
        return torch.tensor([len(p) for p in self.accepted_nodes], dtype=torch.long)


class AcceptRule(Protocol):
    """Given target logits at every tree node, choose the accepted path and the bonus token."""

    name: str

    def verify(
        self,
        tree: TokenTree,
        target_logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Verdict:
        """tree: B rows of N nodes; target_logits: [B, N, V] float32, the target's logits at each
        node (its distribution over that node's children)."""
        ...
