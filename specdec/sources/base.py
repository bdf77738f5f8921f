"""The draft-source protocol: next-token distributions for a batch of tree nodes."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specdec.sampling import SamplingParams, logits_to_logprobs

if TYPE_CHECKING:
    from specdec.stats import StepRecord


@dataclass(frozen=True)
class NodeBatch:
    """The tree nodes one draft forward expands, and the tree grown so far.

    Node indices are the step's creation order (0 = the root, the last committed token).
    """

    nodes: torch.Tensor
    """[B, k] int64 the nodes to expand"""
    valid: torch.Tensor
    """[B, k] bool; invalid entries are padding (their outputs are ignored)"""
    tokens: torch.Tensor
    """[B, N] int64 the token of every node so far"""
    depths: torch.Tensor
    """[B, N] int64 depth of every node (root 0)"""
    ancestors: torch.Tensor
    """[B, N, N] bool: [b, i, j] when node j is node i or one of its ancestors"""
    depth: int | None = None
    """the depth of every entry of `nodes` when they share one (level-by-level policies), else None"""
    chain: bool = False
    """the tree is a chain (`TreeBuilder(chain=True)`) and `nodes` [B, 1] is its newest node,
    every earlier one expanded by this step's earlier forwards: a node's ancestors are then
    exactly the nodes forwarded so far, and a source may skip reading `ancestors`"""


@dataclass(frozen=True)
class TargetPath:
    """The target's distributions on the accepted paths, computed only when asked for."""

    logits: torch.Tensor
    """[B0, N, V] the verify forward's logits over the step's tree (the engine's own tensor, not a copy)"""
    rows: torch.Tensor
    """[B] int64 the `logits` row of each row (arange(B0) unless rows were repeated)"""
    index: torch.Tensor
    """[B, 1 + D] int64 the tree positions in `logits` of the root and of each accepted node
    (entries past 1 + the row's accepted length are padding)"""
    params: SamplingParams
    """the step's sampling parameters"""

    def logprobs(self) -> torch.Tensor:
        """[B, 1 + D, V] float32: the target's log-distributions (after `params`) at the root
        and at each accepted node, the distributions that decided each committed token; one
        batched gather, on the logits' device."""
        return logits_to_logprobs(self.logits[self.rows[:, None], self.index], self.params)

    def repeat_rows(self, m: int) -> TargetPath:
        """Each row repeated m times in place (no copy of the logits)."""
        return TargetPath(self.logits, self.rows.repeat_interleave(m), self.index.repeat_interleave(m, dim=0), self.params)


@dataclass(frozen=True)
class AcceptedPaths:
    """What the accept rule kept this step, in the builder's node indices (the numbering of
    `NodeBatch.nodes`; `Draft.accepted_paths` maps the verified tree's path to it)."""

    nodes: torch.Tensor
    """[B, D] int64 the accepted path's nodes, root excluded, root-to-leaf; entries at and past `length` are padding"""
    length: torch.Tensor
    """[B] int64 accepted draft tokens per row (0 for finished rows)"""
    tokens: torch.Tensor
    """[B, N] int64 the token of every builder node (tokens.gather(1, nodes) are the accepted tokens)"""
    host_tokens: list[list[int]]
    """per row, the accepted tokens on the host (read once per step by the engine; row b holds
    `length[b]` of them)"""
    host_active: list[bool]
    """per row, whether it ran this step (finished rows did not)"""
    target: TargetPath
    """the target's distributions at the root and on the accepted path (adaptive sources learn
    from them; nothing is computed unless a source calls `target.logprobs()`)"""
    chain: bool = False
    """the step's tree was a chain (`NodeBatch.chain`): nodes[:, j] is node j + 1 wherever j < length"""

    def repeat_rows(self, m: int) -> AcceptedPaths:
        """Each row repeated m times in place (row r -> rows r*m .. r*m + m - 1), for a source
        that runs m rows of its own per row of the batch."""
        return AcceptedPaths(
            nodes=self.nodes.repeat_interleave(m, dim=0),
            length=self.length.repeat_interleave(m, dim=0),
            tokens=self.tokens.repeat_interleave(m, dim=0),
            host_tokens=[t for t in self.host_tokens for _ in range(m)],
            host_active=[a for a in self.host_active for _ in range(m)],
            target=self.target.repeat_rows(m),
            chain=self.chain,
        )


class DraftSource(Protocol):
    """Where draft distributions come from (a draft model, an ensemble of views, n-gram lookup).

    A step is `begin_step` (the root's distribution), any number of `expand` calls (one per
    tree level, all frontier nodes of all rows batched), then `end_step` with the verdict.
    """

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: list[int] | None = None, prompts: Sequence[Sequence[int]] | None = None
    ) -> None:
        """input_ids, attention_mask: [B', L] left-padded prompts (1 = real token), as the
        target sees them. With `rows` None they start a new batch; otherwise they replace
        those rows of the running batch. `prompts` are the prompt objects themselves (a
        `MultimodalPrompt` carries images and text, from which a source builds its own view)."""
        ...

    def keep_rows(self, rows: list[int], room: int | None = None) -> None:
        """Shrink the batch to `rows` (finished rows retire), or grow it (an order that keeps
        every row and appends rows, later overwritten by prompts joining). room: the most rows the
        batch may reach (a session's `max_rows`; None: unknown), for sources that lay out storage
        ahead (`ModelRunner.keep_rows`); a source may leave the parameter out (`keep_source_rows`)."""
        ...

    always_proposes: bool
    """every distribution `begin_step` and `expand` return has mass somewhere (a model's). A
    source that may return a row of all -inf (nothing to propose there, as n-gram lookup
    without a match) sets it False, and policies then treat that node's children as invalid
    (a policy that samples checks for the empty rows only then; `getattr(source,
    "always_proposes", False)` for sources that do not say)"""

    def begin_step(self, roots: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """roots: [B] int64, the last committed token of each row. Returns the draft
        log-distribution of the root's children: [B, V] float32 (after `params`)."""
        ...

    def defer(self, roots: torch.Tensor) -> bool:
        """Instead of `begin_step`: this step drafts nothing (a policy found plain decoding
        faster; its tree is the root alone). The source takes note of the roots [B] it never
        saw, to catch up at the next drafted step, and `end_step` follows as usual. Returns
        False, taking no note, when it cannot defer now; the policy must then draft."""
        ...

    def expand(self, batch: NodeBatch, params: SamplingParams) -> torch.Tensor:
        """One draft forward over `batch.nodes` [B, k]. Returns the draft log-distribution over
        each node's children: [B, k, V] float32."""
        ...

    def end_step(self, accepted: AcceptedPaths) -> None:
        """The verdict of the step: keep what the accepted path needs, drop the rest (an
        adaptive source may also learn from `accepted.target.logprobs()` here)."""
        ...

    def feedback(self, record: StepRecord) -> None:
        """Called after every step (adaptive sources learn here)."""
        ...

    @property
    def forward_s(self) -> float:
        """Cumulative wall time inside model forwards (0 for sources without a model)."""
        ...


def keep_source_rows(source: DraftSource, rows: list[int], room: int | None) -> None:
    """`source.keep_rows(rows, room=room)`; without `room` for a source whose `keep_rows` does not
    take it (one written before the parameter existed)."""
    if room is not None and _keep_rows_takes_room(type(source)):
        source.keep_rows(rows, room=room)
    else:
        source.keep_rows(rows)


@functools.cache
def _keep_rows_takes_room(cls: type) -> bool:
    try:
        return "room" in inspect.signature(cls.keep_rows).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):  # (no signature to read: call it the old way)
        return False
