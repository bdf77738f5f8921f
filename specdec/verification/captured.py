"""Traversal verification on the device replayed as CUDA graphs (`CapturedWalks`).

On a GPU, sampled trees are tested on the device (`TraversalTreeTests`): the tree's `Wavefront`
plan before the verify forward (about 40 small ops), and after it the walk, a round of about 30
ops per step of the wavefront (EAGLE-2's trees at T = 1: about 7 rounds), 350 ops a step in all.
Each op is a kernel launch of a few microseconds that keeps the GPU waiting on the host: on an
H100 (2026-11-26) sampled EAGLE-2 steps still launched 451 ops from the host with their drafting
levels captured, most of them this walk. Here the plan and the walk are each one graph replay:

- **Inputs at fixed addresses.** `plan` copies the tree's fields (tokens, parents, depths,
  validity, which nodes were drawn, the ancestor mask, the kept draft distributions) into buffers
  of the target model (one flat tensor per field, shared by every shape: `empty`), before the
  verify forward; `verify` copies the target's logits into one
  after it, and draws the walk's random numbers into two more (`TraversalTreeTests.draws`: the
  same numbers, from the step's generator in the same order, as op by op).
- **A host key.** The plan's graph is keyed by the shapes and the host bounds the tree carries
  (`max_children`, `depth_bound`); the walk's also by its rounds and their width (the walk waits
  for the plan's round widths, which `plan` sends to the host before the forward, as op by op).
  The rounds keep their number, and every round takes the widest one's node bucket: padding slots
  change no result (`TraversalTreeTests.states`), and the keys stay few (EAGLE-2 at T = 1 on the
  bundled pair: 7 keys over 257 steps at B = 1, DynaTree 15; per-round buckets would give 15 and 38,
  `benchmarks/captured-levels/walk_keys.py`).
- **Second use.** A key met for the first time runs op by op (on the same buffers); its second
  use captures it, later ones replay. Beyond `MAX_WALK_GRAPHS` a key is captured only in place
  of a stale graph (`room_for`), as captured drafting levels do.
- **Outputs copied out.** The walk's path, accepted length and bonus come out of the graph as
  one packed tensor, copied once (one op), so nothing of the step's verdict is overwritten by
  the next replay.
- **Inference mode.** They run inside `DecodeSession.step`, which runs under `torch.inference_mode()`, so
  the buffers are made and written in one mode.
- **One thread.** The buffers are the target model's (shared by every engine over it, as its
  forward graphs are); the first thread to verify with them owns them while it lives and others
  walk op by op (`ModelRunner.claims_walks`).

MARS at T > 0 on the device (`MarsRule`, `relaxed`) is captured the same way: its margins, its
outright choices and the child-by-child tests it relaxes (`TreeTests.tests`, K rounds of about 30
ops) as one replay after the forward, its tree staged before it (`plan(wavefront=False)`).

Same verdicts as op by op, bit for bit on the CPU's emulated replay
(`tests/test_graph_replay_semantics.py`). Captured: traversal verification (the default) and
MARS on the device; the lossless rule's child-by-child and block tests and the host walk run op
by op. SPECDEC_CAPTURE_WALKS=0 turns it off.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specdec import constants
from specdec.hostwork import HostCopy
from specdec.models.runner import ModelRunner
from specdec.models.static import LevelUses, node_bucket, room_for
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from specdec.verification.base import Verdict
from specdec.verification.mars import margins, outright_children
from specdec.verification.sampling import ChildTable, TraversalTreeTests, TreeTests, Wavefront, round_widths

MAX_WALK_KEYS = 1024
"""walk keys counted per target model before the counts start over"""


@dataclass(eq=False)
class CapturedPlan:
    """`SamplingRule.prepare`'s plan when the walk is captured (`TokenTree.verify_plan`)."""

    walks: CapturedWalks
    tree: TokenTree
    """the step's tree on the target model's buffers (what the graphs read)"""
    counts: HostCopy | None
    """the plan's round widths on their way to the host (None: child-by-child tests need none)"""
    captured = True
    """(what `TraversalTreeTests.verify` looks for)"""


class CapturedWalks:
    """One step's captured walk over a target model's graphs and buffers (`for_step`)."""

    def __init__(self, runner: ModelRunner) -> None:
        assert runner.walk_graphs is not None
        self.runner = runner
        self.graphs = runner.walk_graphs
        self.uses: LevelUses = runner.walk_uses
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = runner.walk_buffers

    @classmethod
    def for_step(cls, runner: ModelRunner) -> CapturedWalks | None:
        """The target's captured walks, or None when its walks run op by op (no CUDA graphs,
        SPECDEC_CAPTURE_WALKS=0, or another thread owns the model's walk buffers)."""
        if runner.walk_graphs is None or not runner.claims_walks():
            return None
        return cls(runner)

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The model's buffer `name` shaped as `like`, with `like` copied in (one op)."""
        return self.empty(name, tuple(like.shape), like.dtype).copy_(like)

    def empty(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The model's buffer `name` of `shape` (contents unspecified): the front of one flat
        tensor per name and dtype, whatever the shape, so the buffers of every batch size and
        tree size share its memory (a walk's logits at B = 16, 64 nodes and a 128k vocabulary
        alone take 268 MB) and the graph keys need no address. Walks run one at a time (one
        thread, `ModelRunner.claims_walks`), each filling its inputs first. When a larger shape
        comes, the flat tensor is replaced, and every walk graph, which may read the old one, is
        dropped (captured again at its key's next use): a few times while a batch's sizes grow."""
        numel = math.prod(shape)
        key = (name, dtype)
        flat = self.buffers.get(key)
        if flat is None or flat.numel() < numel:
            if flat is not None:
                self.graphs.clear()
            flat = self.buffers[key] = torch.empty(max(numel, 1), dtype=dtype, device=self.runner.device)
        return flat[:numel].view(shape)

    def run(self, key: tuple[Any, ...], call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`call()` (tensor work on the buffers), replayed from its graph when `key` was met
        before and there is room for it (captured at its second use), else op by op. A replay's
        output is the graph's, overwritten by its next replay."""
        if self.uses.meet(key, MAX_WALK_KEYS) and room_for(self.graphs, key, self.uses):
            return self.graphs.run(key, call, keepalive=())
        return call()

    def plan(self, tree: TokenTree, wavefront: bool = True) -> CapturedPlan:
        """Before the verify forward: the tree copied to the model's buffers, its `Wavefront`
        round widths computed there (a replay) and sent to the host. wavefront: False for child-by-child
        tests (`relaxed`), which need no rounds."""
        b, n = tree.tokens.shape
        fields = {name: self.buffer(name, getattr(tree, name)) for name in ("tokens", "parents", "depths", "valid", "sampled")}
        zeros = constants.full((b, n), 0.0, torch.float32, tree.tokens.device)  # (logq, cum_logq: not read by the walk)
        static = TokenTree(
            **fields,
            logq=zeros,
            cum_logq=zeros,
            draft_logprobs=None if tree.draft_logprobs is None else self.buffer("draft_logprobs", tree.draft_logprobs),
            ancestors=self.buffer("ancestors", tree.ancestor_mask()),
            depth_bound=tree.depth_limit(),  # (host bounds: nothing inside a graph reads the device)
            max_children=tree.children_bound(),
        )
        if not wavefront:
            return CapturedPlan(walks=self, tree=static, counts=None)
        key = ("plan", b, n, static.max_children, static.depth_bound, str(tree.tokens.device))
        widths = self.run(key, lambda: Wavefront.of(static, host_counts=False).round_widths)  # [N]
        return CapturedPlan(walks=self, tree=static, counts=HostCopy(widths))

    def verify(self, tests: TraversalTreeTests, plan: CapturedPlan, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verdict:
        """`TraversalTreeTests.verify` of the planned tree: its draws into buffers, then the walk
        replayed (or op by op at a key's first use)."""
        tree = plan.tree
        b, n = tree.tokens.shape
        vocab = target_logits.shape[-1]
        assert plan.counts is not None, "plan(wavefront=True) first"
        widths = round_widths(plan.counts)
        padded = [node_bucket(max(widths))] * len(widths) if widths else []
        uniform, race = tests.draws(tree, 1, vocab, generator, out=(self.empty("uniform", (b, n), torch.float32), self.empty("race", (b, vocab), torch.float32)))
        logits = self.buffer("logits", target_logits)
        draft = tree.draft_logprobs

        def walk() -> torch.Tensor:
            path, accepted_len, bonus = tests.walk(tree, Wavefront.of(tree, host_counts=False), padded, logits, params, uniform, race)
            return torch.cat([path, accepted_len[:, None], bonus[:, None]], dim=1)  # [B, D + 2]

        key = (
            "walk", type(tests), b, n, vocab, logits.dtype, None if draft is None else draft.dtype, tree.max_children, tree.depth_bound,
            tuple(padded), params, str(logits.device),
        )  # fmt: skip
        packed = self.run(key, walk).clone()  # [B, D + 2], out of the graph's output
        d = packed.shape[1] - 2
        zeros = constants.full((b,), 0, torch.long, logits.device)
        return Verdict(path=packed[:, :d], accepted_len=packed[:, d], bonus_tokens=packed[:, d + 1], relaxed_count=zeros, fallback_count=zeros)

    def relaxed(
        self, tests: TreeTests, plan: CapturedPlan, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, theta: float
    ) -> Verdict:
        """MARS at T > 0 on the device (`MarsRule`): its margins, its outright choices and the
        child-by-child tests (`TreeTests.tests`) of the planned tree as one replay (or op by op at
        a key's first use), the tests' random numbers drawn into buffers first."""
        tree = plan.tree
        b, n = tree.tokens.shape
        vocab = target_logits.shape[-1]
        k = tree.children_bound()
        uniform, race = tests.draws(tree, k, vocab, generator, out=(self.empty("uniform", (b, n * k), torch.float32), self.empty("race", (b, vocab), torch.float32)))
        logits = self.buffer("logits", target_logits)
        draft = tree.draft_logprobs

        def tested() -> torch.Tensor:
            m = margins(logits, theta)
            fields = tests.tests(tree, ChildTable.of(tree), logits, params, uniform, race, outright=outright_children(tree, m), fallback=m.fallback)
            path, rest = fields[0], [f[:, None] for f in fields[1:]]
            return torch.cat([path, *rest], dim=1)  # [B, D + 4]

        key = (
            "relaxed", type(tests), theta, b, n, vocab, logits.dtype, None if draft is None else draft.dtype, k, tree.depth_bound, params,
            str(logits.device),
        )  # fmt: skip
        packed = self.run(key, tested).clone()  # [B, D + 4], out of the graph's output
        d = packed.shape[1] - 4
        return Verdict(path=packed[:, :d], accepted_len=packed[:, d], bonus_tokens=packed[:, d + 1], relaxed_count=packed[:, d + 2], fallback_count=packed[:, d + 3])
