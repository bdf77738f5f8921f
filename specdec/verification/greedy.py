"""Greedy verification: the longest path whose every token is the target's argmax."""

from __future__ import annotations

import torch

from specdec import constants
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from specdec.verification.base import Verdict, deepest_path


def greedy_accept(tree: TokenTree, target_argmax: torch.Tensor) -> Verdict:
    """Greedy verification: the longest path whose every token is the target's argmax.

    target_argmax: [B, N] int64, the target's argmax at each node.
    A node "matches" when its token equals the target's argmax at its parent; the accepted
    path ends at the deepest node all of whose non-root ancestors (and itself) match. Sibling
    tokens are distinct, so at most one child matches and that path is unique.
    Example: tokens [r, a, b, c], parents [-1, 0, 0, 1], argmax [a, c, x, y] -> nodes 1 and 3
    match, path [1, 3], bonus = argmax at node 3 = y.
    """
    if tree.num_nodes == 1:  # a root-only tree (AR): nothing to accept, the bonus is the target's choice at the root
        zeros = constants.full((tree.batch_size,), 0, torch.long, target_argmax.device)
        return Verdict(path=zeros[:, None], accepted_len=zeros, bonus_tokens=target_argmax[:, 0], relaxed_count=zeros, fallback_count=zeros)
    if tree.chain:  # node i's parent is node i - 1 (column 0, the root's, is never checked)
        match = torch.nn.functional.pad(tree.tokens[:, 1:] == target_argmax[:, :-1], (1, 0))  # [B, N]
    else:
        parent_argmax = target_argmax.gather(1, tree.parents.clamp(min=0))  # [B, N]
        match = tree.tokens == parent_argmax  # the root's entry is unused (deepest_path never checks the root)
    deepest, _, path, accepted_len = deepest_path(tree, match)
    bonus = target_argmax.gather(1, deepest[:, None]).squeeze(1)
    zeros = constants.full((accepted_len.shape[0],), 0, torch.long, accepted_len.device)
    return Verdict(path=path, accepted_len=accepted_len, bonus_tokens=bonus, relaxed_count=zeros, fallback_count=zeros)



class GreedyRule:
    """Exact-match verification against the target's argmax (lossless for greedy decoding)."""

    name = "greedy"

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verdict:
        return greedy_accept(tree, target_logits.argmax(dim=-1))
