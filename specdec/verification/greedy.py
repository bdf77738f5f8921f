"""Greedy verification: the longest path whose every token is the target's argmax."""

from __future__ import annotations

import torch

from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from specdec.verification.base import Verdict


def greedy_accept(tree: TokenTree, target_argmax: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """Accepted paths and bonus tokens for greedy verification.

    target_argmax: [B, N] int64, the target's argmax at each node.
    A node "matches" when its token equals the target's argmax at its parent; the accepted
    path ends at the deepest node all of whose non-root ancestors (and itself) match. Sibling
    tokens are distinct, so at most one child matches and that path is unique.
    Example: tokens [r, a, b, c], parents [-1, 0, 0, 1], argmax [a, c, x, y] -> nodes 1 and 3
    match, path [1, 3], bonus = argmax at node 3 = y.
    """
    b, n = tree.tokens.shape
    parent_argmax = target_argmax.gather(1, tree.parents.clamp(min=0))  # [B, N]
    match = (tree.tokens == parent_argmax) & tree.valid
    match[:, 0] = True  # the root is committed already
    anc = tree.ancestor_mask()  # [B, N, N]
    path_ok = ~(anc & ~match[:, None, :]).any(dim=2) & tree.valid  # [B, N]
    depth_score = torch.where(path_ok, tree.depths, torch.full_like(tree.depths, -1))
    deepest = depth_score.argmax(dim=1)  # [B]; ties impossible between distinct matching paths
    bonus = target_argmax.gather(1, deepest[:, None]).squeeze(1)
    paths = [tree.path_to(row, int(deepest[row]))[1:] for row in range(b)]
    return paths, bonus


class GreedyRule:
    """Exact-match verification against the target's argmax (lossless for greedy decoding)."""

    name = "greedy"

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verdict:
        paths, bonus = greedy_accept(tree, target_logits.argmax(dim=-1))
        zeros = [0] * tree.batch_size
        return Verdict(accepted_nodes=paths, bonus_tokens=bonus, relaxed=zeros, strict_fallbacks=list(zeros))
