"""Captured drafting levels: one tree level's whole work replayed as one CUDA graph.

Between two draft forwards a tree policy runs 15-30 small ops (the forward's inputs, the
log-softmax, top-k, the builder's bookkeeping, the next frontier). On an H100 each cost more
host time than GPU time, so a drafting level took 1.2-1.8 ms against 0.4-0.7 ms for its forward
(`benchmarks/gpu/2026-11-25/README.md`, runs 10-16). A captured level is one graph replay.

What makes a level replayable (`CapturedLevels.run`):

- Everything it reads or writes sits at the same address every step, whichever engine drafts:
  the draft model's `SharedState` keeps the builder's node buffers (`TreeBuilder(workspace=...)`), the tensors handed from
  one level to the next (`buffer`: frontiers, distributions), the draft source's slot bookkeeping
  and root positions, the runner's KV storage, and S_past with the committed slots' mask row,
  which the runner writes into device buffers once a step (`ModelRunner.begin_levels`), so no
  host value inside a level depends on the cache's length.
- The graph's key names every host value that shapes the level (the policy and its options, the
  level, the batch size, the builder's nodes and the step slots before it, the capacity) and
  every address it reads.
- Where a policy's level widths vary from step to step (CAST's planned layers, DynaTree's
  growing counts), each level sits at a builder column and a step slot fixed by its level alone
  (`place`, after `begin(fixed_layout=True)`), so the builder's nodes and the step slots before
  it, in its key, do not follow the widths drafted before it: one key per level and width, not
  one per sequence of widths.
- The host-side state a level advances (the builder's node count and level counters, the
  runner's step slots and forward counters) is recorded when the level runs for real and set
  after each replay.
- A level is captured at its second use: a key met once (the last steps of a shrinking batch,
  a shorter last step) runs op by op. When the model's level graphs are at their bound
  (`MAX_LEVEL_GRAPHS`), a new key is captured only in place of a graph that has not run for
  `STALE_RUNS` level runs, else it runs op by op (`room_for`): keys that outnumber the bound
  would otherwise evict each other in turn, each run a capture. Capture runs the level twice (`CudaGraphRunner`: a
  warm-up, then the capture's first replay), so a level must be idempotent: it writes only new
  node columns and step slots, and its output buffer is not its input.

- Sampled children (the chain's tokens at T > 0, the static tree's and EAGLE-2's drawn
  children) read their random numbers from a buffer that `uniforms` fills before the level's
  replay, from the step's generator, with the same shape and in the same order as op-by-op
  drafting draws them: no random draw is inside a graph, and one seed gives the same trees
  either way. A level reads that buffer and never overwrites it (a capture runs the level twice
  on one fill). The draft distributions such a step keeps for verification are written to output
  buffers (`TreeBuilder.expand(out=...)`), recorded as part of the level's host-side effects and
  handed back to the builder after each replay.
- The sampling params (temperature, top-p, top-k) are part of every key: they shape the
  draft's distributions inside the level.

Capture needs a model draft source whose runner has `level_graphs` (CUDA graphs, unless
SPECDEC_CAPTURE_LEVELS=0, `specdec.models.runner.capture_levels_default`), forwards untimed and no
sliding-window layers; by default only sampled steps capture, and not CAST's (`for_step`). Policies, greedy or sampled unless said:
- the chain's levels and the static tree's, each level's children with their forward, and the
  last level's children alone;
- EAGLE-2's levels, the root's children included (its distribution is copied to a level buffer
  once), and its selection of the verified nodes (`finish`);
- DynaTree's levels inside a free width (CUDA's default rules), the root's children included:
  every level's width is fixed by the host's options, the growing count it reads from D_0 on is
  bucketed; and its selection;
- CAST's planned layers and the root's children: a layer's width is bucketed, the columns beyond
  it masked out by a device mask filled before the replay (a drawn layer's first `width` columns
  of random numbers are drawn as op by op draws them, `uniforms(width=...)`); and a greedy step's
  selection, at the node bucket of its width.
A policy's own lists that a level appends to (DynaTree's and CAST's table cells) are tracked like
the builder's kept distributions (`run(lists=...)`), and the tables a level reads (calibration)
are refreshed in place. One drafting thread per draft model, as its static buffers assume.
`tests/test_graph_replay_semantics.py` checks captured levels by emulated replay on the CPU, and
its CUDA tests passed on an H100 (2026-11-26), where `benchmarks/gpu/levels_ab.py` measured them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from specdec.drafting.builder import Draft, TreeBuilder
from specdec.models.runner import ModelRunner
from specdec.models.static import node_bucket, room_for
from specdec.sources.base import DraftSource
from specdec.tree import TokenTree

MAX_KEYS = 4096
"""level keys counted per draft model before the counts start over"""

_BUILDER_STATE = ("_n", "_last", "levels", "max_children", "draft_forwards", "_dist_rows", "_any_sampled")
"""host-side fields of a `TreeBuilder` that a level advances (set after a replay)"""

_BUILDER_COUNTERS = ("_added",)
"""`TreeBuilder` counters a level advances (added after a replay: not in a level's key, since at
a fixed place (`place`) the nodes added before a level follow the widths drafted before it)"""

_RUNNER_COUNTERS = ("forward_calls", "forward_tokens")
"""`ModelRunner` counters a level advances (added after a replay)"""


class CapturedLevels:
    """One step's captured levels for a tree policy (made by `for_step`, then `begin`)."""

    def __init__(self, source: DraftSource, runner: ModelRunner, tag: tuple[Any, ...]) -> None:
        self.source = source
        self.runner = runner
        self.tag = tag
        self.builder: TreeBuilder | None = None
        self._base: tuple[Any, ...] = ()
        self._first_slot = 0
        """the runner's step slots when the levels began (after the root's forward)"""

    @classmethod
    def for_step(cls, source: DraftSource | None, tag: tuple[Any, ...], *, sampled: bool, by_default: bool = True) -> CapturedLevels | None:
        """Captured levels for this step, or None when its levels run op by op (see the module).
        tag: the policy and every option that shapes its levels (the sampling params are added by `begin`).
        sampled: the step draws its tokens or children (T > 0). by_default: the policy's sampled
        levels are captured with SPECDEC_CAPTURE_LEVELS unset (CAST's are not: its planned widths
        change its keys, `capture_levels_default`); with it set to 1 every step's are."""
        runner = getattr(source, "runner", None)
        if source is None or not isinstance(runner, ModelRunner) or not hasattr(source, "reserve_step_slots"):
            return None
        if runner.level_graphs is None or runner.time_forwards or runner.window is not None:
            return None
        if not runner.capture_every_level and not (sampled and by_default):
            return None
        if not runner.claims_levels():  # another thread drafts with this model's levels
            return None
        return cls(source, runner, tag)

    @property
    def workspace(self) -> dict[tuple[object, ...], torch.Tensor]:
        """Where the builder's node buffers live across steps (`TreeBuilder(workspace=...)`)."""
        return self.runner.level_buffers

    def begin(self, builder: TreeBuilder, step_slots: int, fixed_layout: bool = False) -> None:
        """After the builder's root forward: room for `step_slots` more step slots and this step's
        device-side offsets (`ModelRunner.begin_levels`). fixed_layout: the policy places each
        level (`place`), so those step slots are hidden first (one op): a slot no level of this
        step writes must not show a node of an earlier step."""
        self.builder = builder
        runner = self.runner
        self._first_slot = runner.step_len
        slots = self.source.reserve_step_slots(runner.step_len + step_slots)  # type: ignore[attr-defined]
        if fixed_layout:
            self.source.hide_step_slots(runner.step_len, step_slots)  # type: ignore[attr-defined]
        buffers = (builder._ints, builder._floats, builder._flags, builder._anc, *(() if builder._dist_slot is None else (builder._dist_slot,)))
        # the sampling params shape every level (the draft's distributions: temperature, top-p, top-k)
        self._base = (builder.ctx.params, *runner.begin_levels(step_slots), *slots, *(t.data_ptr() for t in buffers))

    def place(self, column: int, slot: int) -> None:
        """A fixed layout (`begin(fixed_layout=True)`): the next level adds its nodes from builder
        column `column` and forwards its frontier from step slot `slot` (counted from the step's
        first level slot), places that depend on the level alone, not on the widths of the
        levels before it. The columns and slots passed over are left unused (invalid nodes, hidden
        slots). What a level graph's key holds of the builder and the runner (`key`) is then the
        same at a level whatever came before it, so a policy whose widths vary from step to step
        (CAST's planned layers, DynaTree's growing counts) keeps one graph per level and width
        instead of one per sequence of widths (on an H100, 457 captures in 10 calls of CAST with
        the old layout, `benchmarks/gpu/2026-11-26`)."""
        builder = self.builder
        assert builder is not None, "begin() first"
        first = self._first_slot + slot
        if first < self.runner.step_len:
            raise ValueError(f"place: step slot {slot} is before the {self.runner.step_len - self._first_slot} the step's levels have used")
        builder.skip_to(column)
        self.runner.step_len = first

    def buffer(self, name: tuple[Any, ...], like: torch.Tensor) -> torch.Tensor:
        """`output(name)` shaped as `like`, with `like` copied in: how the first level gets what
        was computed before the levels (a frontier, a distribution) at a fixed address."""
        return self.output(name, tuple(like.shape), like.dtype).copy_(like)

    def uniforms(self, name: tuple[Any, ...], shape: tuple[int, ...], width: int | None = None) -> torch.Tensor:
        """`output(name)` filled with U(0, 1) numbers from the step's generator (one op, outside
        any graph): the random numbers of the next level's draws (`TreeBuilder.sample_children`,
        `sample_from_probs`), drawn as op-by-op drafting draws them, in the same order.
        width: a level whose op-by-op draws are [B, width, ...] inside a wider bucket (CAST's
        layers): only the first `width` columns are drawn, as op by op (a draw and a copy); the
        others keep earlier numbers (0.5 when the buffer is new), read only by masked-out columns."""
        assert self.builder is not None, "begin() first"
        gen = self.builder.ctx.generator
        if width is None or width == shape[1]:
            buf = self.output(name, shape, torch.float32)
            return torch.rand(shape, generator=gen, device=buf.device, out=buf)
        buf = self.output(name, shape, torch.float32, fill=0.5)
        drawn = torch.rand((shape[0], width, *shape[2:]), generator=gen, device=buf.device, out=self.output((*name, "drawn", width), (shape[0], width, *shape[2:]), torch.float32))
        buf[:, :width].copy_(drawn)
        return buf

    def output(self, name: tuple[Any, ...], shape: tuple[int, ...], dtype: torch.dtype, fill: float | None = None) -> torch.Tensor:
        """A tensor of `shape` at the same address every step (made on first use, contents
        unspecified, or `fill` when made): where a level writes what the next one reads."""
        key = ("level_buffer", self.tag, name, shape, dtype)
        buf = self.runner.level_buffers.get(key)
        if buf is None:
            make = torch.empty if fill is None else partial(torch.full, fill_value=fill)
            buf = self.runner.level_buffers[key] = make(shape, dtype=dtype, device=self.runner.device)
        return buf

    @property
    def begun(self) -> bool:
        """`begin` was called this step (levels ran, captured or op by op)."""
        return self.builder is not None

    def finish(self, select: Callable[[], Draft], width: int, reads: Sequence[torch.Tensor] = ()) -> Draft:
        """The step's `Draft` from `select()` (the builder's selection of the verified nodes:
        `TreeBuilder.finish` with a keep mask and `width`, with the kept nodes' draft
        distributions when the builder keeps them), replayed like a level: the tree's tensors
        land in buffers at fixed addresses (overwritten by the next step's selection), and the
        Draft is rebuilt around them. reads: what `select` reads besides the builder (a keep mask)."""
        builder = self.builder
        assert builder is not None, "begin() first"
        chunks = builder._dist_chunks
        if chunks:  # the root's distribution, made before the levels: at a fixed address (the levels' are at theirs)
            root = self.output(("dist", 0), tuple(chunks[0].shape), chunks[0].dtype)
            if chunks[0].data_ptr() != root.data_ptr():  # not copied there yet (a policy whose first level is captured copies it first)
                chunks[0] = root.copy_(chunks[0])
        fields = _tree_fields(builder.batch_size, min(width, builder.num_nodes), chunks[0].shape[-1] if builder.keep_draft_probs else 0)

        def selection() -> torch.Tensor:
            drafted = select()
            for name, shape, dtype in fields:
                value = drafted.builder_nodes if name == "builder_nodes" else getattr(drafted.tree, name)
                assert tuple(value.shape) == shape and value.dtype == dtype, (name, tuple(value.shape), value.dtype)
                self.output(("selection", name), shape, dtype).copy_(value)
            return self.output(("selection", "tokens"), fields[0][1], fields[0][2])

        self.run(("selection", width), selection, reads=(*chunks, *reads))
        out = {name: self.output(("selection", name), shape, dtype) for name, shape, dtype in fields}
        builder_nodes = out.pop("builder_nodes")
        draft_logprobs = out.pop("draft_logprobs", None)
        tree = TokenTree(**out, depth_bound=builder.levels, max_children=builder.max_children)
        tree.draft_logprobs = draft_logprobs
        return Draft(tree, builder, builder_nodes)

    def key(self, name: tuple[Any, ...], reads: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """The graph key of the level `name` that reads `reads`, as the builder and the runner stand:
        besides the step's base (`begin`), every host field a replay sets (`_BUILDER_STATE` and the
        runner's step slots) as it is before the level. A replay sets them to what the capture left,
        which is right only for the state the capture started from: two layouts with the same node
        count can differ in their count of levels (CAST's layers of other widths), the tree's depth bound."""
        builder = self.builder
        assert builder is not None, "begin() first"
        return (self.tag, name, *(getattr(builder, f) for f in _BUILDER_STATE), self.runner.step_len, *self._base, *(t.data_ptr() for t in reads))

    def run(self, name: tuple[Any, ...], level: Callable[[], torch.Tensor], reads: Sequence[torch.Tensor], lists: Sequence[list[torch.Tensor]] = ()) -> None:
        """Run `level()` (tensor ops on the builder, the source and `reads`, the level-to-level
        buffers it reads and writes), replayed from its graph when its key was captured.
        lists: the policy's own lists of tensors the level appends to (as the builder's kept
        draft distributions): what it appends must be output buffers, appended again after a replay."""
        runner, builder = self.runner, self.builder
        assert builder is not None, "begin() first"
        graphs = runner.level_graphs
        assert graphs is not None
        key = self.key(name, reads)
        # a key met for the first time, or with no room among the level graphs: op by op
        if not runner.level_uses.meet(key, MAX_KEYS) or not room_for(graphs, key, runner.level_uses):
            level()
            return
        if key not in runner.level_effects and len(runner.level_effects) >= MAX_KEYS:  # addresses moved many times: start over
            runner.level_effects.clear()
            graphs.clear()
        tracked = (builder._dist_chunks, *lists)
        before = _host_state(builder, runner, tracked)
        ran = False

        def call() -> torch.Tensor:
            nonlocal ran
            _set_host_state(builder, runner, tracked, before)  # a warm-up and a capture each run the level from its start
            runner.in_level = True
            try:
                out = level()
            finally:
                runner.in_level = False
            ran = True
            return out

        with torch.inference_mode():  # as the runner's forwards (the KV storage is an inference tensor)
            graphs.run(key, call, keepalive=(tuple(reads), builder._ints, builder._floats, builder._flags, builder._anc))
        if ran:  # captured now (or graphs were given up and it ran op by op): what it did on the host
            fields, counters, items = _host_state(builder, runner, tracked)
            appended = tuple(now[len(then) :] for now, then in zip(items, before[2], strict=True))  # what the level kept: buffers it writes
            if any(appended):
                outputs = {id(t) for t in runner.level_buffers.values()}
                assert all(id(t) in outputs for new in appended for t in new), "a captured level keeps tensors in output buffers (`TreeBuilder.expand(out=...)`)"
            runner.level_effects[key] = (fields, tuple(a - b for a, b in zip(counters, before[1], strict=True)), appended)
        else:
            fields, deltas, appended = runner.level_effects[key]
            items = tuple((*then, *new) for then, new in zip(before[2], appended, strict=True))
            _set_host_state(builder, runner, tracked, (fields, tuple(b + d for b, d in zip(before[1], deltas, strict=True)), items))
        cache = runner.cache
        assert cache is not None
        cache.length = runner.past_len + runner.step_len


def fixed_place(level: int, k: int, room: int) -> tuple[int, int]:
    """Where a tree policy's captured level `level` (>= 1; the root's children are level 0, the
    builder's columns 1..k) adds its children and forwards its frontier at a fixed layout
    (`CapturedLevels.place`): (builder column, step slot counted from the step's first level slot).
    Each level has room for a frontier of `room` nodes with k children each, and its forward for
    `room` padded to its node bucket, so the place depends on the level alone. The place of level
    L is also the room levels 1..L-1 take: a builder for levels up to L - 1 needs that many columns."""
    return 1 + k + (level - 1) * room * k, (level - 1) * node_bucket(room)


def _tree_fields(b: int, m: int, vocab: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """(field, shape, dtype) of a selected tree's tensors of B rows and M nodes, with their draft
    distributions over `vocab` tokens when it is not 0 (`CapturedLevels.finish`)."""
    long, flt, flag = torch.long, torch.float32, torch.bool
    dists = (("draft_logprobs", (b, m, vocab), flt),) if vocab else ()
    return (
        ("tokens", (b, m), long),
        ("parents", (b, m), long),
        ("depths", (b, m), long),
        ("logq", (b, m), flt),
        ("cum_logq", (b, m), flt),
        ("valid", (b, m), flag),
        ("sampled", (b, m), flag),
        ("ancestors", (b, m, m), flag),
        ("builder_nodes", (b, m), long),
        *dists,
    )


HostState = tuple[tuple[Any, ...], tuple[int, ...], tuple[tuple[torch.Tensor, ...], ...]]
"""(builder fields and the runner's step slots, the runner's and then the builder's counters, the
items of each tracked list: the builder's kept draft distributions, then the policy's lists)"""


def _host_state(builder: TreeBuilder, runner: ModelRunner, tracked: Sequence[list[torch.Tensor]]) -> HostState:
    fields = (*(getattr(builder, f) for f in _BUILDER_STATE), runner.step_len)
    counters = (*(getattr(runner, f) for f in _RUNNER_COUNTERS), *(getattr(builder, f) for f in _BUILDER_COUNTERS))
    return fields, counters, tuple(tuple(items) for items in tracked)


def _set_host_state(builder: TreeBuilder, runner: ModelRunner, tracked: Sequence[list[torch.Tensor]], state: HostState) -> None:
    fields, counters, items = state
    for name, value in zip(_BUILDER_STATE, fields[:-1], strict=True):
        setattr(builder, name, value)
    runner.step_len = fields[-1]
    for name, value in zip((*_RUNNER_COUNTERS, *_BUILDER_COUNTERS), counters, strict=True):
        setattr(runner if name in _RUNNER_COUNTERS else builder, name, value)
    for target, values in zip(tracked, items, strict=True):
        target[:] = values
