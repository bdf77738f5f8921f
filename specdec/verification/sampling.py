"""Lossless rejection sampling for chains and trees.

At a node with target distribution `target_probs` (after temperature/top-p/top-k), the
children are tried in tree order. Child k has a proposal distribution `proposal_k`:

- a **sampled** child (drawn from the draft distribution q, without replacement among
  its sampled siblings): q with the earlier sampled siblings removed, renormalised;
- a **deterministic** child (top-k): a point mass on its token.

Child k is accepted with probability min(1, target_probs(x_k) / proposal_k(x_k)); on
rejection the target distribution becomes the full residual
norm(max(0, target_probs - proposal_k)) and the next child is tried. If all children are
rejected (or the node is a leaf) the bonus token is sampled from the current residual.
With one sampled child this is Leviathan et al.'s rule; with several it is recursive
rejection sampling (SpecInfer / EAGLE's multi-candidate rule). Each acceptance test is
exact, so the committed tokens follow the target distribution whatever the tree's shape
or how it was pruned (for a point mass the test reduces to "accept x with probability
target_probs(x)", and the residual to target_probs with x removed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.sampling import SamplingParams, logits_to_logprobs, sample_from_probs
from specdec.tree import TokenTree
from specdec.verification.base import Verdict

_EPS = 1e-12


def _residual(target_probs: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target_probs - proposal)); falls back to target_probs if nothing is left. [V] -> [V]."""
    res = (target_probs - proposal).clamp(min=0)
    total = res.sum()
    return res / total if total > _EPS else target_probs


RelaxHook = Callable[[int, list[int], torch.Tensor], tuple[int | None, bool]]
"""relax(node, children, target_probs_at_node) -> (child accepted outright or None, fell_back)"""


def exact_tests(
    kids: list[int],
    tokens: list[int],
    sampled: list[bool],
    probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int | None, torch.Tensor]:
    """The exact (lossless) tests of one node's children, in tree order.

    kids: the node's children; tokens/sampled: per node of the row; probs: [V] target
    distribution at the node; draft_probs: [V] draft distribution over the node's children
    (needed when a child is sampled). Returns (the accepted child or None, the distribution
    left after the rejected children: the residual the bonus token is drawn from on rejection).
    """
    removed: list[int] = []  # tokens of earlier sampled siblings (drawn without replacement)
    for kid in kids:
        tok = tokens[kid]
        if sampled[kid]:
            assert draft_probs is not None, "sampled nodes need draft_probs"
            proposal = draft_probs.clone()
            if removed:
                proposal[removed] = 0
            proposal = proposal / proposal.sum().clamp(min=_EPS)
            removed.append(tok)
        else:
            proposal = torch.zeros_like(probs)
            proposal[tok] = 1.0
        ratio = (probs[tok] / proposal[tok].clamp(min=_EPS)).clamp(max=1.0)
        u = torch.rand((), generator=generator, device=probs.device)
        if u < ratio:
            return kid, probs
        probs = _residual(probs, proposal)
    return None, probs


def rejection_walk(
    tree: TokenTree,
    row: int,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
    relax: RelaxHook | None = None,
) -> tuple[list[int], int, int, int]:
    """Walk one row's tree with recursive rejection sampling.

    target_probs: [N, V] float32 target distribution at each node of this row.
    draft_probs:  [N, V] float32 draft distribution over each node's children (sampled nodes only) or None.
    relax: optional hook (node, children, target_probs_at_node) -> (child | None, fell_back) that
           may accept a child outright before the exact tests (MARS). When it does, the exact
           tests are still drawn once at that node, only to count the token as *relaxed* when
           they would not have accepted that same child (the strict rule's counterfactual);
           their outcome never changes the path.
    Returns (accepted path without root, bonus token, relaxed count, strict fallbacks).
    """
    node, path, relaxed, fallbacks = 0, [], 0, 0
    tokens = tree.tokens[row].tolist()
    sampled = tree.sampled[row].tolist()
    while True:
        kids = tree.children(row, node)
        probs = target_probs[node]
        node_draft = None if draft_probs is None else draft_probs[node]
        if relax is not None and kids:
            chosen, fell_back = relax(node, kids, probs)
            fallbacks += int(fell_back)
            if chosen is not None:
                strict_choice, _ = exact_tests(kids, tokens, sampled, probs, node_draft, generator)
                relaxed += int(strict_choice != chosen)
                path.append(chosen)
                node = chosen
                continue
        accepted_child, probs = exact_tests(kids, tokens, sampled, probs, node_draft, generator)
        if accepted_child is None:
            bonus = int(sample_from_probs(probs, generator))
            return path, bonus, relaxed, fallbacks
        path.append(accepted_child)
        node = accepted_child


class SamplingRule:
    """Lossless speculative sampling (see the module docstring)."""

    name = "sampling"

    def verify(self, tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verdict:
        if params.greedy:
            from specdec.verification.greedy import GreedyRule

            return GreedyRule().verify(tree, target_logits, params, generator)
        target_probs = logits_to_logprobs(target_logits, params).exp()  # [B, N, V]
        draft_probs = tree.draft_logprobs.exp() if tree.draft_logprobs is not None else None
        paths, bonus, relaxed, fallbacks = [], [], [], []
        for row in range(tree.batch_size):
            p, bt, r, f = rejection_walk(tree, row, target_probs[row], None if draft_probs is None else draft_probs[row], generator)
            paths.append(p)
            bonus.append(bt)
            relaxed.append(r)
            fallbacks.append(f)
        return Verdict.from_lists(paths, bonus, relaxed, fallbacks, target_logits.device)
