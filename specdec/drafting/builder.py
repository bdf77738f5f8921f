"""TreeBuilder: grows a batch of draft trees level by level, then emits a TokenTree."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.sampling import SamplingParams
from specdec.sources.base import DraftSource
from specdec.tree import TokenTree


@dataclass
class DraftContext:
    """What a tree policy knows when it drafts a step."""

    params: SamplingParams
    generator: torch.Generator | None
    max_depth: int
    """deepest node worth drafting this step (tokens left to generate - 1)"""
    active: torch.Tensor
    """[B] bool: rows still generating (finished rows get a root-only tree)"""
    context_len: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    """[B] committed tokens per row (cost-aware policies bucket on it)"""


class TreeBuilder:
    """Candidate nodes in creation order (level by level, so parents precede children).

    Node indices are columns shared by all rows; a row that has fewer nodes at some
    level marks the extra columns invalid. `finish` selects the nodes to verify.
    """

    def __init__(self, source: DraftSource, roots: torch.Tensor, ctx: DraftContext, keep_draft_probs: bool) -> None:
        self.source = source
        self.ctx = ctx
        dev = roots.device
        b = roots.shape[0]
        self.tokens = roots[:, None].clone()  # [B, N]
        self.parents = torch.full((b, 1), -1, dtype=torch.long, device=dev)
        self.depths = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.logq = torch.zeros(b, 1, device=dev)
        self.cum_logq = torch.zeros(b, 1, device=dev)
        self.valid = torch.ones(b, 1, dtype=torch.bool, device=dev)
        self.sampled = torch.zeros(b, 1, dtype=torch.bool, device=dev)
        self.expanded = torch.zeros(b, 1, dtype=torch.bool, device=dev)
        self.keep_draft_probs = keep_draft_probs
        self._draft_logprobs: torch.Tensor | None = None  # [B, N, V] when kept
        self.root_logprobs = source.begin_step(roots, ctx.params)  # [B, V]
        self.expanded[:, 0] = True
        if keep_draft_probs:
            self._draft_logprobs = self.root_logprobs[:, None, :].clone()
        self.draft_forwards = 1

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def add(self, parents: torch.Tensor, tokens: torch.Tensor, logq: torch.Tensor, valid: torch.Tensor, sampled: bool | torch.Tensor = False) -> torch.Tensor:
        """Append k candidate nodes per row; returns their indices [B, k].

        parents: [B, k] int64 builder indices; tokens: [B, k]; logq: [B, k] draft log-prob
        of each token under its parent's distribution; valid: [B, k] bool.
        """
        b, k = tokens.shape
        safe = parents.clamp(min=0)
        valid = valid & self.ctx.active[:, None] & self.valid.gather(1, safe) & torch.isfinite(logq)
        invalid = ~valid
        start = self.num_nodes
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        self.parents = torch.cat([self.parents, parents.masked_fill(invalid, -1)], dim=1)
        self.depths = torch.cat([self.depths, self.depths.gather(1, safe) + 1], dim=1)
        self.logq = torch.cat([self.logq, logq.masked_fill(invalid, float("-inf"))], dim=1)
        self.cum_logq = torch.cat([self.cum_logq, (self.cum_logq.gather(1, safe) + logq).masked_fill(invalid, float("-inf"))], dim=1)
        self.valid = torch.cat([self.valid, valid], dim=1)
        new_sampled = (sampled & valid) if isinstance(sampled, torch.Tensor) else (valid if sampled else torch.zeros_like(valid))
        self.sampled = torch.cat([self.sampled, new_sampled], dim=1)
        self.expanded = torch.cat([self.expanded, torch.zeros_like(valid)], dim=1)
        if self._draft_logprobs is not None:
            pad = torch.zeros(b, k, self._draft_logprobs.shape[2], device=tokens.device)
            self._draft_logprobs = torch.cat([self._draft_logprobs, pad], dim=1)
        return torch.arange(start, start + k, device=tokens.device).expand(b, k)

    def expand(self, nodes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """One draft forward over `nodes` [B, k] (valid [B, k]); returns their children's
        draft log-distributions [B, k, V]."""
        valid = valid & self.valid.gather(1, nodes)
        logprobs = self.source.expand(self, nodes, valid, self.ctx.params)
        self.draft_forwards += 1
        self.expanded.scatter_(1, nodes, self.expanded.gather(1, nodes) | valid)
        if self._draft_logprobs is not None:
            idx = nodes[:, :, None].expand(-1, -1, logprobs.shape[2])
            self._draft_logprobs.scatter_(1, idx, logprobs)
        return logprobs

    def top_children(self, nodes: torch.Tensor, logprobs: torch.Tensor, k: int, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The k most likely children of each node, flattened node-major.

        nodes: [B, m]; logprobs: [B, m, V]; valid: [B, m].
        Returns (parents [B, m*k], tokens [B, m*k], logq [B, m*k], valid [B, m*k]).
        """
        b, m, _ = logprobs.shape
        top = torch.topk(logprobs, k, dim=-1)
        parents = nodes[:, :, None].expand(b, m, k).reshape(b, m * k)
        child_valid = valid[:, :, None].expand(b, m, k).reshape(b, m * k)
        return parents, top.indices.reshape(b, m * k), top.values.reshape(b, m * k), child_valid

    def finish(self, keep: torch.Tensor | None = None) -> tuple[TokenTree, torch.Tensor]:
        """The TokenTree of the kept nodes (all valid nodes when keep is None) and, for each of
        its nodes, the builder index it came from ([B, N'] int64)."""
        full = TokenTree(
            tokens=self.tokens,
            parents=self.parents,
            depths=self.depths,
            logq=self.logq.masked_fill(~self.valid, 0.0),
            cum_logq=self.cum_logq.masked_fill(~self.valid, float("-inf")),
            valid=self.valid,
            sampled=self.sampled,
            draft_logprobs=self._draft_logprobs,
        )
        keep = self.valid if keep is None else keep & self.valid
        keep[:, 0] = True
        return full.select_with_origin(keep)

    def top_by_score(self, score: torch.Tensor, n: int) -> torch.Tensor:
        """Keep mask [B, N] of the root and the n best valid non-root nodes by `score` [B, N].

        With a score that never increases from parent to child (cum_logq), ties broken
        towards the earlier node, the kept set is a valid subtree.
        """
        b, total = score.shape
        order_key = score.masked_fill(~self.valid, float("-inf")).clone()
        order_key[:, 0] = float("inf")
        # stable sort on descending score: equal scores keep creation order (parents first)
        idx = torch.sort(order_key, dim=1, descending=True, stable=True).indices[:, : n + 1]
        keep = torch.zeros(b, total, dtype=torch.bool, device=score.device)
        keep.scatter_(1, idx, True)
        return keep & self.valid
