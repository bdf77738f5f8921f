"""Static-shape forwards: the pieces that make a `ModelRunner` forward capturable.

In static-shape mode a forward of `n` tokens is padded to a node-count *bucket* `m`
(`node_bucket`), attends over the cache's full capacity and reads its inputs from
preallocated buffers (`StaticInputs`): token ids, position ids, the slot indices its new
keys and values are written at (one `index_copy_` per layer) and the 4D additive mask. Every
shape then depends only on (batch size, bucket, capacity), and nothing in the forward reads
a device value on the host, so the forward can be captured as a CUDA graph
(`specdec.models.graphs`) and replayed after the buffers are refilled.

What must stay put for a captured graph to be replayed is shared per model (`shared_state`):
the buffers (keyed by shape, reused by every runner of the model) and a pool of released KV
storage tensors (`StoragePool`), from which a new cache of the same shape takes its storage, so
the addresses a graph captured repeat across runs and engines.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdec import constants

if TYPE_CHECKING:
    from specdec.models.graphs import CudaGraphRunner

BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256)
"""node-count buckets: a forward of n tokens runs as one of the smallest bucket >= n"""

WARM_UP_TOKENS = 128
"""tokens a row up to which `warm_up` runs (captures) every bucket by default: the widest
verification of the default trees (CAST's 72 draft tokens and the root, bucket 96; DynaTree's
measured free width, at most 127 and the root; EAGLE-2's 33); until 2026-11-25 it was 64, so
CAST's bucket 96 was captured inside the first timed call"""

BUCKET_STEP_BEYOND = 128
"""past the last bucket, forwards are padded to a multiple of this"""

MAX_BUFFERS = 32
"""static input buffers kept per model (least recently used dropped first)"""

MAX_POOLED = 8
"""released storage tensors kept per model for reuse"""

MAX_OVERSIZE = 4
OVERSIZE_SLACK = 2**16
"""a pool by bytes lends a storage of at most MAX_OVERSIZE times the asked elements plus OVERSIZE_SLACK"""

CPU_POOL_BYTES = 2 * 2**30
"""released storage kept per model on a CPU without static shapes (`cpu_pool`)"""


def node_bucket(n: int) -> int:
    """The padded token count of a forward of `n` tokens."""
    for bucket in BUCKETS:
        if n <= bucket:
            return bucket
    return -(-n // BUCKET_STEP_BEYOND) * BUCKET_STEP_BEYOND


@dataclass
class StaticInputs:
    """The inputs of a static-shape forward of B rows and m tokens over `capacity` cache slots."""

    input_ids: torch.Tensor  # [B, m] int64
    position_ids: torch.Tensor  # [B, m] int64
    slots: torch.Tensor  # [m] int64: the cache slots the m tokens write (the same in every row)
    mask: torch.Tensor  # [B, 1, m, capacity] additive: 0 = visible, dtype min = hidden
    arange: torch.Tensor  # [m] int64: 0 .. m-1 (slots = arange + first slot, one op)
    min_value: float
    sliding: torch.Tensor | None = None
    """[B, 1, m, capacity] the sliding-window layers' mask (models with sliding windows only)"""

    @classmethod
    def allocate(cls, b: int, m: int, capacity: int, dtype: torch.dtype, device: torch.device, sliding: bool = False) -> StaticInputs:
        min_value = torch.finfo(dtype).min if dtype.is_floating_point else torch.finfo(torch.float32).min
        mask_dtype = dtype if dtype.is_floating_point else torch.float32
        return cls(
            input_ids=torch.zeros(b, m, dtype=torch.long, device=device),
            position_ids=torch.zeros(b, m, dtype=torch.long, device=device),
            slots=torch.arange(m, dtype=torch.long, device=device),
            mask=torch.full((b, 1, m, capacity), min_value, dtype=mask_dtype, device=device),
            arange=torch.arange(m, dtype=torch.long, device=device),
            min_value=min_value,
            sliding=torch.full((b, 1, m, capacity), min_value, dtype=mask_dtype, device=device) if sliding else None,
        )

    def masks(self) -> list[torch.Tensor]:
        """Every mask buffer a forward reads (the full one, and the sliding one when there is one)."""
        return [self.mask] if self.sliding is None else [self.mask, self.sliding]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, m, capacity)"""
        b, _, m, capacity = self.mask.shape
        return b, m, capacity

    def fill(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        first_slot: int,
        slot_valid: torch.Tensor,
        step_visibility: torch.Tensor,
    ) -> None:
        """Copy a forward's inputs in; tokens past the n real ones are padding.

        input_ids, position_ids: [B, n] (n <= m). Padding columns keep whatever ids and
        positions they held (valid values; their outputs are dropped).
        first_slot: S_past + step_len, where the first new token's keys go.
        slot_valid: [B, S_past] committed slots; step_visibility: [B, n, w] the step slots
        S_past .. S_past + w that each new token sees (w = step_len or step_len + n).
        Each of the m tokens also sees its own slot; padding tokens see nothing else, and
        every slot at or past first_slot + m is hidden (unwritten, or stale padding).
        """
        b, n = input_ids.shape
        s_past = slot_valid.shape[1]
        m = self.slots.shape[0]
        self.input_ids[:, :n].copy_(input_ids)
        self.position_ids[:, :n].copy_(position_ids)
        torch.add(self.arange, first_slot, out=self.slots)
        mask = self.mask[:, 0]  # [B, m, capacity]
        mask.fill_(self.min_value)
        mask[:, :n, :s_past].masked_fill_(slot_valid[:, None, :], 0.0)
        mask[:, :n, s_past : s_past + step_visibility.shape[2]].masked_fill_(step_visibility, 0.0)
        mask[:, :, first_slot : first_slot + m].diagonal(dim1=1, dim2=2).fill_(0.0)  # each token's own slot

    def fill_at(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        step_offset: int,
        past: torch.Tensor,
        committed: torch.Tensor,
        step_visibility: torch.Tensor,
    ) -> None:
        """`fill` with the committed length on the device, so that a captured graph of a whole
        drafting level (`specdec.drafting.levels`) replays at every step whatever the cache's
        length: no host value here changes from one step to the next.

        past: [1] int64, S_past (the first step slot's column); committed: [B, capacity] the
        additive mask row of the committed slots (0 at valid ones, `min_value` at every other
        column: holes, step slots, unused capacity), made once a step (`ModelRunner.begin_levels`).
        step_offset: the step slots before this forward (the first new token's keys go to
        column S_past + step_offset). input_ids, position_ids, step_visibility: as in `fill`.
        """
        b, n = input_ids.shape
        m = self.slots.shape[0]
        self.input_ids[:, :n].copy_(input_ids)
        self.position_ids[:, :n].copy_(position_ids)
        torch.add(self.arange, past + step_offset, out=self.slots)  # [m] the new tokens' columns
        mask = self.mask[:, 0]  # [B, m, capacity]
        mask.copy_(committed[:, None, :].expand_as(mask))
        w = step_visibility.shape[2]
        if w:  # the earlier step slots each new token sees, at columns S_past .. S_past + w - 1
            cols = constants.arange(w, past.device) + past  # [w]
            hidden = constants.full((), self.min_value, mask.dtype, past.device)
            visible = torch.where(step_visibility, constants.full((), 0.0, mask.dtype, past.device), hidden)  # [B, n, w]
            mask[:, :n].scatter_(2, cols.expand(b, n, w), visible)
        mask.scatter_(2, self.slots[None, :, None].expand(b, m, 1), 0.0)  # each token's own slot

    def fill_window(self, key_pos: torch.Tensor, position_ids: torch.Tensor, window: int) -> None:
        """The sliding layers' mask, after `fill`: the full mask with every key at position j
        hidden from a query at position i when j <= i - window (as transformers' sliding layers).

        key_pos: [B, S] the positions of the used slots (committed and this step's, this forward's
        n included: S = first_slot + n); position_ids: [B, n] the n real tokens' positions.
        Padding tokens keep the full mask's rows (only their own slot)."""
        assert self.sliding is not None
        n, used = position_ids.shape[1], key_pos.shape[1]
        sliding = self.sliding[:, 0]  # [B, m, capacity]
        sliding.copy_(self.mask[:, 0])
        outside = key_pos[:, None, :] <= position_ids[:, :, None] - window  # [B, n, S]
        sliding[:, :n, :used].masked_fill_(outside, self.min_value)


@dataclass(eq=False)
class StoragePool:
    """Released KV storage tensors of one model. A new cache takes its storage from here (of the
    same shape with static shapes, any that holds it on a CPU: `by_bytes`; stale values, hidden by
    the mask until overwritten), so storage addresses repeat
    across runs (CUDA graphs capture them) and, on a CPU, a new cache does not pay for fresh
    pages (zeroing 150 MB of new storage took 38 ms to 340 ms per call on the AMD EPYC, page
    faults included). Entries: (tensor, batch dim, slot dim), most recently released last; at
    most `max_tensors` of them and `max_bytes` in all (the oldest go first). Thread-safe."""

    free: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    max_tensors: int = MAX_POOLED
    max_bytes: int | None = None
    """None: no limit (static shapes, whose storage CUDA graphs hold on to anyway)"""
    by_bytes: bool = False
    """False (static shapes): `take` hands out a released tensor of exactly the asked shape (a
    captured graph's addresses belong to one shape). True (a CPU without static shapes): a
    released tensor is kept as its whole storage, flat ([N], batch and slot dims 0), and `take`
    serves any shape that fits in one, from the smallest that does. A batch's cache ends its call
    cut to its last rows (`ModelRunner.keep_rows` narrows the storage), and the next call's prompts
    set another width, so exact shapes almost never met again: at B = 16 on the bundled pair the
    zeroed storage of each call's target and draft caches took 0.15-0.4 s of a 5-6 s call."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def give(self, entries: list[tuple[torch.Tensor, int, int]]) -> None:
        if self.by_bytes:
            entries = self._whole_storages(entries)
        with self.lock:
            if self.by_bytes:  # a storage is lent to one cache at a time: never pooled twice
                pooled = {t.untyped_storage().data_ptr() for t, _, _ in self.free}
                entries = [e for e in entries if e[0].untyped_storage().data_ptr() not in pooled]
            self.free.extend(entries)
            del self.free[: max(0, len(self.free) - self.max_tensors)]
            if self.max_bytes is not None:
                while self.free and sum(t.numel() * t.element_size() for t, _, _ in self.free) > self.max_bytes:
                    del self.free[0]

    def capacity_for(self, rows: int, needed: int) -> int | None:
        """The capacity of a pooled storage for `rows` rows that fits `needed` slots without
        being much wider (attention in static mode spans the whole capacity): the smallest such."""
        if self.by_bytes:  # any width fits some storage: the asked capacity stands
            return None
        with self.lock:
            fits = [t.shape[slot_dim] for t, batch_dim, slot_dim in self.free if t.shape[batch_dim] == rows and needed <= t.shape[slot_dim] <= 2 * needed + 256]
        return min(fits) if fits else None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A released tensor of `shape` (stale values), or None when none fits."""
        if self.by_bytes:
            return self._take_fitting(shape, dtype, device)
        with self.lock:
            for i in range(len(self.free) - 1, -1, -1):
                t = self.free[i][0]
                if tuple(t.shape) == shape and t.dtype == dtype and t.device == device:
                    del self.free[i]
                    return t
        return None

    def _take_fitting(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """`take` of a `by_bytes` pool: the first elements of the smallest flat storage of this
        dtype and device that holds `shape`, viewed as `shape` (contiguous); none much larger
        (`MAX_OVERSIZE`): a small cache (one prompt group's prefill, a batch of 1 after one of 16)
        would hold it while the large cache that follows zeroes fresh storage."""
        needed = math.prod(shape)
        with self.lock:
            fits = [
                i for i, (t, _, _) in enumerate(self.free) if t.dtype == dtype and t.device == device and needed <= t.numel() <= MAX_OVERSIZE * needed + OVERSIZE_SLACK
            ]
            if not fits:
                return None
            best = min(fits, key=lambda i: self.free[i][0].numel())
            flat = self.free.pop(best)[0]
        return flat[:needed].view(shape)

    @staticmethod
    def _whole_storages(entries: list[tuple[torch.Tensor, int, int]]) -> list[tuple[torch.Tensor, int, int]]:
        """Each entry's whole storage as a flat tensor of its dtype (a narrowed view gives back the
        rows it no longer shows too), each storage once."""
        flats: list[tuple[torch.Tensor, int, int]] = []
        seen: set[int] = set()
        for t, _, _ in entries:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() < t.element_size():
                continue
            seen.add(storage.data_ptr())
            n = storage.nbytes() // t.element_size()
            flats.append((torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (n,), (1,)), 0, 0))
        return flats


@dataclass(eq=False)
class LevelUses:
    """When each captured-level key was last met, on a clock that counts one draft model's level
    runs (`specdec.drafting.levels.CapturedLevels.run`)."""

    last: dict[tuple[object, ...], int] = field(default_factory=dict)
    """per key, the clock at its last run"""
    clock: int = 0

    def meet(self, key: tuple[object, ...], max_keys: int) -> bool:
        """Count one run of `key`; whether it was met before. At `max_keys` keys a new one starts
        the record over (levels whose buffers moved leave keys that never recur)."""
        self.clock += 1
        seen = key in self.last
        if not seen and len(self.last) >= max_keys:
            self.last.clear()
        self.last[key] = self.clock
        return seen

    def idle(self, key: tuple[object, ...]) -> int:
        """Runs counted since `key` last ran (the whole clock for a key not on record)."""
        return self.clock - self.last.get(key, 0)


STALE_RUNS = 2048
"""runs (of a draft model's levels, of a target model's walks) after which a graph that was not
replayed is stale: a full cache of graphs (`MAX_LEVEL_GRAPHS`, `MAX_WALK_GRAPHS`) makes room for a
new key only by dropping a stale one (`room_for`)"""


def room_for(graphs: Any, key: tuple[Any, ...], uses: LevelUses) -> bool:
    """Whether the level (or walk) of `key` replays or may be captured now. With `graphs.max_graphs` graphs
    held, a capture would drop the least recently used one: allowed only when that one has not run
    for `STALE_RUNS` level runs. Where more keys recur than graphs fit, dropping in turn makes every
    run a capture (a warm-up and a recording, slower than op by op: CAST's planned layers on an
    H100, 457 captures in 10 calls, 16% slower, `benchmarks/gpu/2026-11-26`); this way the graphs
    held keep replaying and the other keys run op by op until a graph goes stale (a server whose
    batch size moved on). A runner with no bound (the CPU's emulators) always has room."""
    limit = getattr(graphs, "max_graphs", None)
    if limit is None or key in graphs or len(graphs) < limit:
        return True
    oldest = graphs.least_recent()
    return oldest is None or uses.idle(oldest) >= STALE_RUNS


@dataclass(eq=False)
class SharedState:
    """Per-model static-shape state shared by every runner of the model."""

    pool: StoragePool = field(default_factory=StoragePool)
    buffers: OrderedDict[tuple[int, int, int], StaticInputs] = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    """held from filling the buffers to reading the forward's output"""
    graphs: CudaGraphRunner | None = None
    level_graphs: CudaGraphRunner | None = None
    """captured drafting levels (`specdec.drafting.levels`) of the model as a draft, shared by
    every runner of it (a bench's or a server's engines come and go; their levels replay)"""
    level_effects: dict[tuple[object, ...], object] = field(default_factory=dict)
    """per level-graph key, the host-side state a level leaves behind"""
    level_uses: LevelUses = field(default_factory=LevelUses)
    """when each level-graph key was last met (a level is captured at its second use)"""
    level_buffers: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)
    """tensors captured levels read and write at the same address every step, whichever runner
    of the model drafts: the builder's node buffers, the buffers levels hand on, S_past and the
    committed mask row, the draft source's slot bookkeeping"""
    level_owner: dict[tuple[object, ...], int] = field(default_factory=dict)
    """per shared buffer that carries state from one step to the next, the id of the object that
    last laid it out (another must lay it out afresh)"""
    level_thread: threading.Thread | None = None
    """the thread whose drafting uses the captured levels (`ModelRunner.claims_levels`): the
    first to ask, while it lives; other threads draft op by op, since the level buffers are the model's"""
    walk_graphs: CudaGraphRunner | None = None
    """captured verification walks (`specdec.verification.captured`) of the model as a target"""
    walk_uses: LevelUses = field(default_factory=LevelUses)
    """when each walk-graph key was last met (a walk is captured at its second use)"""
    walk_buffers: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)
    """the tree, logits and random numbers a captured walk reads, at the same address every step"""
    walk_thread: threading.Thread | None = None
    """the thread whose verification uses the captured walks (`ModelRunner.claims_walks`)"""

    def inputs(self, b: int, m: int, capacity: int, dtype: torch.dtype, device: torch.device, sliding: bool = False) -> StaticInputs:
        key = (b, m, capacity)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = StaticInputs.allocate(b, m, capacity, dtype, device, sliding=sliding)
            while len(self.buffers) > MAX_BUFFERS:
                self.buffers.popitem(last=False)
        else:
            self.buffers.move_to_end(key)
        return buf


_SHARED: weakref.WeakKeyDictionary[torch.nn.Module, SharedState] = weakref.WeakKeyDictionary()
_CPU_POOLS: weakref.WeakKeyDictionary[torch.nn.Module, StoragePool] = weakref.WeakKeyDictionary()


def cpu_pool(model: torch.nn.Module) -> StoragePool:
    """The pool of a model's released KV storage for runners without static shapes on a CPU
    (at most `CPU_POOL_BYTES`): a later cache of the same rows reuses pages already mapped."""
    pool = _CPU_POOLS.get(model)
    if pool is None:
        pool = _CPU_POOLS[model] = StoragePool(max_bytes=CPU_POOL_BYTES, by_bytes=True)
    return pool


def shared_state(model: torch.nn.Module) -> SharedState:
    state = _SHARED.get(model)
    if state is None:
        state = _SHARED[model] = SharedState()
    return state
