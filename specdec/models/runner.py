"""ModelRunner: one causal LM, its KV cache, and commit/rollback of cache slots.

The cache holds `S` slots per row. `slot_valid[b, s]` says whether slot `s` of row `b`
holds a committed token (padding and holes left by rows that accepted fewer tokens are
invalid and masked out). A token's position id is the number of valid slots before it,
so holes never shift positions.

A decoding step appends "step slots" with `forward` (any number of calls: the draft
adds one tree level per call), then `commit` keeps a chosen subset of them, gathered to
the end of the committed prefix, and drops the rest; `rollback` drops them all.

The cache is a `SlotCache`: key/value storage preallocated for every layer at once
(`[layers, 2, B, heads, capacity, head_dim]` when all layers share a shape, as in every
standard decoder), written by position. A forward writes its new keys in place and
attends to a view of the used slots; commit moves the kept step slots in place with one
gather for all layers; rollback only moves the length back. Only the public
`transformers` API is used (a `Cache` of `CacheLayerMixin` layers, a 4D additive mask and
explicit `position_ids`), so any decoder-only architecture with a standard cache works.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.errors import SpecDecError
from specdec.hostwork import uncounted
from specdec.models.graphs import CudaGraphRunner
from specdec.models.rope import LongRopeSelector
from specdec.models.static import BUCKETS, WARM_UP_TOKENS, SharedState, StaticInputs, StoragePool, cpu_pool, node_bucket, shared_state
from specdec.models.support import FIX as UNSUPPORTED_FIX
from specdec.models.support import cache_argument, logits_keep_argument, tree_verification_problem

_LOG = logging.getLogger("specdec.runner")

FORWARD_TIMING_ENV = "SPECDEC_TIME_FORWARDS"
"""1: time every model forward (engine efficiency, `ModelRunner.forward_s`) on CUDA too; 0: nowhere"""


def _env_switch(name: str, environ: Mapping[str, str] | None, meaning: str) -> bool | None:
    """An on/off environment variable: True for 1/on/true/yes, False for 0/off/false/no, None when
    unset; anything else is a SpecDecError naming the variable, the value and `meaning` (what 1 does)."""
    value = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    if value:
        raise SpecDecError(f"{name}={value!r} is not understood; set it to 1 ({meaning}) or 0, or unset it")
    return None


def forward_timing_default(device: torch.device, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a runner on `device` times its forwards: SPECDEC_TIME_FORWARDS (1 or 0) when set,
    else on a CPU only. A CPU forward is timed by the host clock, at no cost; a CUDA forward needs
    two timing events, created and recorded per forward; on an H100 (2026-11-25, 3B pair,
    alternating rounds in one process) every method generated 1.4-8.3% faster without them
    (`benchmarks/gpu/timer_ab.py`): so on CUDA engine efficiency is measured only when asked for."""
    value = _env_switch(FORWARD_TIMING_ENV, environ, "time every model forward, for engine efficiency; on CUDA two timing events a forward")
    return device.type != "cuda" if value is None else value


CAPTURE_LEVELS_ENV = "SPECDEC_CAPTURE_LEVELS"
"""with CUDA graphs, which whole drafting levels of the tree policies are captured as graphs
(`specdec.drafting.levels` lists which): 1 every level, 0 none (only model forwards are
graphed), unset the sampled steps' levels of the policies that capture by default
(`CapturedLevels.for_step`)"""


def capture_levels_default(environ: Mapping[str, str] | None = None) -> bool | None:
    """Which drafting levels a draft runner with CUDA graphs captures: True (SPECDEC_CAPTURE_LEVELS=1)
    every level of every policy that has captured levels; False (=0) none; None (unset) the levels
    of sampled steps, except CAST's. Measured on an H100 (2026-11-26, 3B pair, alternating rounds,
    `benchmarks/gpu/2026-11-26`): sampled EAGLE-2 ran 18% faster at B = 1 and 3% at B = 8, DynaTree
    7% and 5%, the chain the same; greedy levels gained at most 2% (DynaTree lost 6% at B = 1), and
    CAST lost 16%: its planned widths change its keys, so it kept capturing."""
    return _env_switch(CAPTURE_LEVELS_ENV, environ, "capture every drafting level as a CUDA graph")


CAPTURE_WALKS_ENV = "SPECDEC_CAPTURE_WALKS"
"""with CUDA graphs, 0 walks sampled trees' traversal verification op by op; unset or 1 replays
it as graphs (`specdec.verification.captured`)"""


def capture_walks_default(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a target runner with CUDA graphs captures the traversal walk of sampled trees
    (SPECDEC_CAPTURE_WALKS, on unless 0). Counted on the CPU (emulated replay, bundled pair,
    EAGLE-2 at T = 1, B = 1, 160 tokens, `benchmarks/captured-levels/walks.md`): 437 host-launched
    ops a step without, 127 with; not timed on a GPU yet."""
    return _env_switch(CAPTURE_WALKS_ENV, environ, "capture the verification walk of sampled trees as CUDA graphs") is not False


MAX_WALK_GRAPHS = 64
"""captured verification-walk graphs kept per target model (least recently used dropped first)"""


CAPACITY_STEP = 256
"""cache capacity grows in multiples of this many slots"""

MAX_LEVEL_GRAPHS = 96
"""captured drafting-level graphs kept per draft model (least recently used dropped first)"""


class SlotLayer(CacheLayerMixin):
    """One layer's view of a `SlotCache`: writes new keys at the cache's write offset and
    returns the used slots. `keys`/`values` are [B, H, used, D] views of the storage."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: SlotCache, index: int) -> None:
        super().__init__()
        self.cache = cache
        self.index = index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache._allocate_layer(self.index, key_states, value_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [B, H, n, D] of the n new tokens. Returns [B, H, used + n, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache = self.cache
        keys, values = cache.kv(self.index)
        if cache.static is not None:  # static shapes: write at the slot indices of a device tensor, attend over the full capacity
            keys.index_copy_(2, cache.static.slots, key_states)  # slots [n]: the same step slots in every row
            values.index_copy_(2, cache.static.slots, value_states)
            return keys, values  # [B, H, capacity, D]; the mask hides every slot that is not visible
        start, n = cache.length, key_states.shape[2]
        if start + n > cache.capacity:
            raise RuntimeError(f"SlotCache overflow: {start} + {n} > capacity {cache.capacity} (ModelRunner reserves room before forwards)")
        keys[:, :, start : start + n].copy_(key_states)
        values[:, :, start : start + n].copy_(value_states)
        return keys[:, :, : start + n], values[:, :, : start + n]

    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        return self.cache.kv(self.index)[0][:, :, : self.cache.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:  # CacheLayerMixin.__init__ assigns None
        if value is not None:
            raise AttributeError("SlotLayer.keys is a view of the SlotCache storage; write through ModelRunner")

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        return self.cache.kv(self.index)[1][:, :, : self.cache.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("SlotLayer.values is a view of the SlotCache storage; write through ModelRunner")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.cache.static is not None:
            return self.cache.capacity, 0
        return self.cache.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.length

    def get_max_length(self) -> int:
        return -1


Layout = tuple[int, int, int, int]
"""a layer's cache shape: (key heads, key dim, value heads, value dim)"""


def _layout_views(keys: torch.Tensor, values: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a layer's storage [B, H, capacity, D] (H, D: the larger of keys' and values')
    at the sizes its keys and values have: the storage itself when they agree."""
    hk, dk, hv, dv = layout
    if (hk, dk) == (hv, dv):
        return keys, values
    return keys[:, :hk, :, :dk], values[:, :hv, :, :dv]


class SlotCache(Cache):
    """Preallocated KV storage for every layer, written by position.

    `length` slots per row are in use (committed + this step's); `capacity` are allocated.
    Layers with the first layer's `Layout` share one tensor `storage` [L, 2, B, H, capacity, D]
    (so a commit or a row reorder is one op for all of them); any other layer gets its own
    [2, B, H', capacity, D'] tensor in `extra`. Keys and values may differ in shape (DeepSeek-V2/V3's
    compressed latent-attention cache stores the latent as keys and the rotary key as values):
    the storage is then sized for the larger of each and a layer gets views of the sizes it writes.
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int, pool: StoragePool | None = None) -> None:
        """pool: released storage tensors to take the storage from when one has the right shape
        (stale contents, hidden: no slot is valid yet), so storage addresses, which CUDA graphs
        capture, repeat across caches."""
        self.length = 0
        self.capacity = capacity
        self.rows = batch_size
        self.num_layers = num_layers
        self.storage: torch.Tensor | None = None
        self.layout: Layout | None = None
        """the layout of the layers in `storage` (set with it)"""
        self.extra: dict[int, torch.Tensor] = {}
        self.extra_layouts: dict[int, Layout] = {}
        """the layout of each layer in `extra`"""
        self.static: StaticInputs | None = None
        """set during a static-shape forward: layers write at `static.slots` and return the full capacity"""
        self.pool = pool
        super().__init__(layers=[SlotLayer(self, i) for i in range(num_layers)])

    def _zeros(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A storage tensor: a pooled one of this shape when there is one (stale values, never
        visible before they are overwritten), else zeros."""
        reused = self.pool.take(shape, like.dtype, like.device) if self.pool is not None else None
        return reused if reused is not None else torch.zeros(shape, dtype=like.dtype, device=like.device)

    def _allocate_layer(self, index: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Storage for layer `index`, from its first keys and values [B, H, n, D]."""
        layout = (key_states.shape[1], key_states.shape[3], value_states.shape[1], value_states.shape[3])
        b, h, d = key_states.shape[0], max(layout[0], layout[2]), max(layout[1], layout[3])
        if self.storage is None:
            self.storage, self.layout = self._zeros((self.num_layers, 2, b, h, self.capacity, d), key_states), layout
        if layout == self.layout and index not in self.extra:
            return
        self.extra[index], self.extra_layouts[index] = self._zeros((2, b, h, self.capacity, d), key_states), layout

    def kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Storage views of layer `index`: keys, values [B, H, capacity, D]."""
        own = self.extra.get(index)
        if own is not None:
            return _layout_views(own[0], own[1], self.extra_layouts[index])
        assert self.storage is not None and self.layout is not None
        return _layout_views(self.storage[index, 0], self.storage[index, 1], self.layout)

    def tensors(self) -> list[tuple[torch.Tensor, int, int]]:
        """Every storage tensor with its batch and slot dimensions: [(tensor, batch_dim, slot_dim)]."""
        out = [] if self.storage is None else [(self.storage, 2, 4)]
        return out + [(t, 1, 3) for t in self.extra.values()]

    def map_tensors(self, fn: Any) -> None:
        """Replace every storage tensor t (batch dim, slot dim) by fn(t, batch_dim, slot_dim)."""
        if self.storage is not None:
            self.storage = fn(self.storage, 2, 4)
        self.extra = {i: fn(t, 1, 3) for i, t in self.extra.items()}
        for t, batch_dim, slot_dim in self.tensors():
            self.capacity = t.shape[slot_dim]
            self.rows = t.shape[batch_dim]
            break


def _kept(logits: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """The last `logits_to_keep` positions of logits [B, n, V] (all when 0), whether or not the
    model already cut them."""
    return logits[:, -logits_to_keep:] if 0 < logits_to_keep < logits.shape[1] else logits


def hole_filling_order(finished: Sequence[bool]) -> list[int]:
    """The rows to keep when the `finished` ones leave the batch, in an order that moves the fewest:
    each unfinished row among the first L (L = unfinished rows) stays in place, and each finished
    row's place among them is taken by an unfinished row from beyond L, in order.
    Example: finished [F, T, F, T, F, F] -> [0, 4, 2, 5] (rows 4 and 5 fill the holes 1 and 3)."""
    live = [r for r, done in enumerate(finished) if not done]
    fillers = iter(r for r in live if r >= len(live))
    return [r if not finished[r] else next(fillers) for r in range(len(live))]


def _hole_fills(order: list[int]) -> tuple[list[int], list[int]] | None:
    """(holes, fillers) when `order` keeps every row i < len(order) in place or fills it with a
    distinct row >= len(order) (`hole_filling_order`), else None."""
    n = len(order)
    holes = [i for i, r in enumerate(order) if r != i]
    fillers = [order[i] for i in holes]
    if any(r < n for r in fillers) or len(set(fillers)) != len(fillers):
        return None
    return holes, fillers


def _appended_rows(order: list[int], rows: int) -> list[int] | None:
    """The rows copied into the new places when `order` keeps all `rows` rows in place and appends
    more (a batch that grows: `DecodeSession._fill_rows`), else None."""
    if len(order) <= rows or order[:rows] != list(range(rows)):
        return None
    return order[rows:]


def _widened(t: torch.Tensor, batch_dim: int, rows: int) -> torch.Tensor | None:
    """`t` ([.., B, ..], a view of the first B rows of a tensor laid out for more rows, as
    `keep_rows` narrows the storage when rows finish) as a view of its first `rows` rows, when its
    storage holds them in that layout; else None. The rows past B hold stale values."""
    if batch_dim == 0 or t.stride(batch_dim) == 0 or t.stride(batch_dim - 1) % t.stride(batch_dim):
        return None
    if t.stride(batch_dim - 1) // t.stride(batch_dim) < rows:  # the layout's rows: fewer than asked
        return None
    size = list(t.shape)
    size[batch_dim] = rows
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(size, t.stride(), strict=True))
    if any(n == 0 for n in size) or last >= t.untyped_storage().nbytes() // t.element_size():
        return None
    span = -1  # the widened view must not address one element twice (a layout where other dims interleave with rows)
    for st, n in sorted((st, n) for n, st in zip(size, t.stride(), strict=True) if n > 1):
        if st <= span:
            return None
        span += (n - 1) * st
    return t.as_strided(size, t.stride(), t.storage_offset())


class ModelRunner:
    """Runs one model over a batch of rows with a KV cache it can commit and roll back.

    static_shapes: every forward is padded to a node-count bucket, attends over the cache's full
    capacity and reads its inputs from fixed buffers (`specdec.models.static`): capturable.
    cuda_graphs: static shapes, and bucketed forwards are captured and replayed as CUDA graphs
    (`specdec.models.graphs`; needs a CUDA device).
    """

    def __init__(self, model: PreTrainedModel, static_shapes: bool = False, cuda_graphs: bool = False, time_forwards: bool | None = None) -> None:
        """time_forwards: time every forward (`forward_s`); None: `forward_timing_default`
        (on a CPU, not on CUDA unless SPECDEC_TIME_FORWARDS=1)."""
        problem = tree_verification_problem(model.config, type(model))
        if problem is not None:
            raise SpecDecError(f"{type(model).__name__} {problem}; {UNSUPPORTED_FIX}")
        self.model = model
        self._cache_arg = cache_argument(model)  # 'cache' (transformers >= 5.24) or 'past_key_values'
        self._keep_arg = logits_keep_argument(model)  # 'logits_to_keep', an older name, or None (sliced here)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.time_forwards = forward_timing_default(self.device) if time_forwards is None else time_forwards
        """`forward_s` is measured (else it stays 0: the caller reports engine efficiency as not measured)"""
        self.static_shapes = static_shapes or cuda_graphs
        self._shared = shared_state(model) if self.static_shapes else None
        # released KV storage is reused: with static shapes (addresses repeat for CUDA graphs), and
        # on a CPU (a new cache's fresh pages cost up to a few hundred ms per call there; CUDA's
        # caching allocator already reuses memory)
        self._pool: StoragePool | None = self._shared.pool if self._shared is not None else (cpu_pool(model) if self.device.type == "cpu" else None)
        self.graphs: CudaGraphRunner | None = None
        if cuda_graphs:
            assert self._shared is not None
            if self._shared.graphs is None:
                self._shared.graphs = CudaGraphRunner(model, self.device)
            self.graphs = self._shared.graphs
        levels_mode = capture_levels_default()
        capture_levels = cuda_graphs and levels_mode is not False and self._shared is not None
        if capture_levels and self._shared is not None and self._shared.level_graphs is None:
            self._shared.level_graphs = CudaGraphRunner(model, self.device, max_graphs=MAX_LEVEL_GRAPHS, what="its drafting levels (SPECDEC_CAPTURE_LEVELS=0 turns them off)")
        self.level_graphs: CudaGraphRunner | None = self._shared.level_graphs if capture_levels and self._shared is not None else None
        """graphs of whole drafting levels (`specdec.drafting.levels`), the model's (`SharedState`);
        None: levels run op by op"""
        capture_walks = cuda_graphs and capture_walks_default() and self._shared is not None
        if capture_walks and self._shared is not None and self._shared.walk_graphs is None:
            self._shared.walk_graphs = CudaGraphRunner(model, self.device, max_graphs=MAX_WALK_GRAPHS, what="its verification walks (SPECDEC_CAPTURE_WALKS=0 turns them off)")
        self.walk_graphs: CudaGraphRunner | None = self._shared.walk_graphs if capture_walks and self._shared is not None else None
        """graphs of sampled trees' verification walks (`specdec.verification.captured`), the
        model's (`SharedState`); None: walks run op by op"""
        walks = self._shared if self._shared is not None else SharedState()
        self.walk_uses, self.walk_buffers = walks.walk_uses, walks.walk_buffers
        self.capture_every_level = levels_mode is True
        """with `level_graphs`: every step's levels are captured (SPECDEC_CAPTURE_LEVELS=1); False:
        only sampled steps' levels, of policies that capture by default (`CapturedLevels.for_step`)"""
        levels = self._shared if self._shared is not None else SharedState()
        self.level_effects, self.level_uses, self.level_buffers, self.level_owner = levels.level_effects, levels.level_uses, levels.level_buffers, levels.level_owner
        self.in_level = False
        """a captured drafting level is running: forwards fill their inputs from the device-side
        offsets of `begin_levels` and call the model directly (inside the level's graph)"""
        self._level_committed: torch.Tensor | None = None  # [B, capacity] the committed slots' mask row (`begin_levels`)
        self._level_past: torch.Tensor | None = None  # [1] S_past of the step (`begin_levels`)
        self.num_layers, self.window = _cache_layout(model)
        self._longrope = LongRopeSelector.for_model(model)
        """LongRoPE models: their rotary modules pick frequencies per token in this runner's forwards (None: no LongRoPE)"""
        self.reencode_length = self._longrope.reencode_length if self._longrope is not None else None
        """the sequence length at which the model's own `generate()` re-encodes a sequence (Phi-3 family with LongRoPE;
        `DecodeSession._reencode_rows` does the same), None for other models"""
        self._prefilling = False
        """a prefill forward is running (LongRoPE picks by each row's prompt length: `_rope_scope`)"""
        self.cache: SlotCache | None = None
        self.slot_valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, S_past]
        self.step_len = 0  # step slots appended since the last commit/rollback
        self.forward_calls = 0
        self.forward_tokens = 0
        self._forward_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: timed without a sync per forward
        self._eye: dict[int, torch.Tensor] = {}
        self._mask_values = (torch.zeros((), dtype=self.dtype, device=self.device), torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device))
        self._compact_checked_at = 0
        self._holes_from: int | None = None
        """no row has a hole (an invalid slot after one of its valid ones) before this column (None: no
        hole at all); a lower bound kept on the host, so compaction moves only the slots from it on"""
        self._step_pos = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [B, step_len] position ids of the step slots (sliding windows only)
        self._layer_types = _layer_types(model) if self.window is not None else None

    # ----- state -------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.slot_valid.shape[0]

    @property
    def past_len(self) -> int:
        """S_past: committed slots per row (valid or not)."""
        return self.slot_valid.shape[1]

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far for this runner's model (0 without graphs)."""
        return self.graphs.captures if self.graphs is not None else 0

    @property
    def forward_s(self) -> float:
        """Wall time inside model forwards (on CUDA from events, synchronised when read); 0 when
        `time_forwards` is off."""
        if self._events:
            torch.cuda.synchronize(self.device)
            self._forward_s += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events.clear()
        return self._forward_s

    def committed_len(self) -> torch.Tensor:
        """[B] number of committed tokens per row = position id of the next token."""
        return self.slot_valid.sum(dim=1)

    def reset(self, batch_size: int, capacity: int = CAPACITY_STEP) -> None:
        capacity = _round_up(max(capacity, 1))
        pool = self._pool
        if pool is not None:  # storage comes from (and returns to) the model's pool
            self._release()
            capacity = pool.capacity_for(batch_size, capacity) or capacity
        self.cache = SlotCache(self.num_layers, batch_size, capacity, pool=pool)
        self.slot_valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.step_len = 0
        self._compact_checked_at = 0
        self._holes_from = None
        self.dense = False
        """True while the host knows every committed slot is valid (set by `prefill(dense=True)`, kept by dense commits)"""

    def _release(self) -> None:
        """Hand the cache's storage back to the model's pool (static shapes, or a CPU)."""
        if self._pool is not None and self.cache is not None:
            self._pool.give(self.cache.tensors())
            self.cache.storage, self.cache.layout, self.cache.extra, self.cache.extra_layouts = None, None, {}, {}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at interpreter shutdown)
            self._release()

    def reserve(self, slots: int) -> None:
        """Make room for `slots` slots per row in total (grows the storage; rare)."""
        cache = self._cache()
        if slots <= cache.capacity:
            return
        new_capacity = _round_up(max(slots, 2 * cache.capacity))

        def grow(t: torch.Tensor, batch_dim: int, slot_dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[slot_dim] = new_capacity - t.shape[slot_dim]
            return torch.cat([t, t.new_zeros(shape)], dim=slot_dim)

        self._map_storage(grow)
        cache.capacity = new_capacity

    def _map_storage(self, fn: Any) -> None:
        """`cache.map_tensors(fn)`; with static shapes each result lands in storage that keeps
        addresses repeating (CUDA graphs captured on them stay valid): the old tensor when the
        shape is unchanged, else a pooled one of the new shape; replaced storage goes to the pool."""
        cache = self._cache()
        if self._shared is None:
            cache.map_tensors(fn)
            return
        pool = self._shared.pool
        old = cache.tensors()

        def place(t: torch.Tensor, batch_dim: int, slot_dim: int) -> torch.Tensor:
            new = fn(t, batch_dim, slot_dim)
            if new is t:
                return t
            if new.shape == t.shape:
                return t.copy_(new)
            pooled = pool.take(tuple(new.shape), new.dtype, new.device)
            return new if pooled is None else pooled.copy_(new)

        cache.map_tensors(place)
        kept = {id(t) for t, _, _ in cache.tensors()}
        pool.give([entry for entry in old if id(entry[0]) not in kept])

    def _cache(self) -> SlotCache:
        if self.cache is None:
            raise RuntimeError("ModelRunner used before reset()")
        return self.cache

    # ----- forwards ----------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        step_visibility: torch.Tensor,
        logits_to_keep: int = 0,
        model_inputs: dict[str, Any] | None = None,
        capture: bool = True,
    ) -> torch.Tensor:
        """Append `n` step slots and return their logits.

        input_ids:       [B, n] int64
        position_ids:    [B, n] int64
        step_visibility: [B, n, step_len + n] bool: which step slots (earlier ones of this
                         step, then the n new ones) each new token attends to; or
                         [B, n, step_len]: the new tokens see none of each other (tree
                         levels). Every new token also attends to all valid committed
                         slots and to itself.
        model_inputs:    extra model inputs for this forward (prefill of a multimodal
                         prompt: pixel_values and the like).
        capture:         with CUDA graphs, False runs this forward eagerly (static shapes, no
                         graph captured or replayed): for one-off widths, such as a draft's
                         catch-up after steps that drafted nothing, which a graph would be
                         captured for mid-decode and rarely replayed.
        Returns logits [B, n, V] float32 (or [B, logits_to_keep, V]).
        """
        cache = self._cache()
        b, n = input_ids.shape
        s_past, s_step = self.past_len, self.step_len
        if step_visibility.shape not in ((b, n, s_step + n), (b, n, s_step)):
            raise ValueError(f"step_visibility shape {tuple(step_visibility.shape)} != {(b, n, s_step + n)} or {(b, n, s_step)}")
        timer = self._start_timer() if self.time_forwards else None  # (captured levels need untimed forwards: `CapturedLevels.for_step`)
        if self.static_shapes:
            logits = self._forward_static(input_ids, position_ids, step_visibility, logits_to_keep, model_inputs, capture)
        else:
            logits = self._forward_dynamic(input_ids, position_ids, step_visibility, logits_to_keep, model_inputs)
        if timer is not None:
            self._stop_timer(timer)
        self.step_len += n
        cache.length = s_past + self.step_len
        self.forward_calls += 1
        self.forward_tokens += b * n
        return logits

    def _forward_dynamic(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, step_visibility: torch.Tensor, logits_to_keep: int, model_inputs: dict[str, Any] | None
    ) -> torch.Tensor:
        """Attention over the used slots only (shapes change every step); logits [B, n or logits_to_keep, V] float32."""
        cache = self._cache()
        b, n = input_ids.shape
        s_past, s_step = self.past_len, self.step_len
        self.reserve(s_past + s_step + n)
        cache.length = s_past + s_step
        eye = self._eye.get(n)
        if eye is None:
            eye = self._eye[n] = torch.eye(n, dtype=torch.bool, device=self.device)
        mask: torch.Tensor | dict[str, torch.Tensor] | None = None  # a single token over a cache without holes sees everything: no mask (SDPA's fastest path)
        if not (n == 1 and s_step == 0 and self.dense and self.window is None):
            committed = self.slot_valid[:, None, :].expand(b, n, s_past)
            if step_visibility.shape[2] == s_step:  # the new block: each token sees only itself
                visible = torch.cat([committed, step_visibility, eye.expand(b, n, n)], dim=2)  # [B, n, S]
            else:
                visible = torch.cat([committed, step_visibility[:, :, :s_step], step_visibility[:, :, s_step:] | eye], dim=2)
            mask = torch.where(visible, *self._mask_values)[:, None]  # [B, 1, n, S] additive: 0 where visible, dtype min elsewhere
            if self.window is not None:
                mask = self._sliding_masks(visible, mask, position_ids)
        with uncounted(), _attention_backends(self.device), self._rope_scope():
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                **{self._cache_arg: cache},
                **self._keep_kwargs(logits_to_keep),
                **(model_inputs or {}),
            )
        return _kept(out.logits, logits_to_keep).float()

    def _sliding_masks(self, visible: torch.Tensor, full: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """The attention masks of a model with sliding-window layers: a key at position j is in
        the window of a query at position i when j > i - window (as transformers' sliding
        layers), positions being the keys' own position ids (committed slots: valid slots
        before them; step slots: the ids they were forwarded with), so holes and tree branches
        never shift the window. Returns the sliding mask alone when every layer slides (one 4D
        mask, e.g. Mistral), else {layer type: mask} (mixed layers, e.g. Qwen2, Gemma-2/3).

        visible: [B, n, S] bool; full: [B, 1, n, S] additive (the full-attention mask);
        position_ids: [B, n]. Also records the new slots' positions for later forwards of the step.
        """
        assert self.window is not None
        n = visible.shape[1]
        key_pos = self._key_positions(position_ids, n)  # [B, S]
        in_window = key_pos[:, None, :] > position_ids.expand(-1, n)[:, :, None] - self.window  # [B, n, S]
        sliding = torch.where(visible & in_window, *self._mask_values)[:, None]  # [B, 1, n, S]
        if self._layer_types is None:
            return sliding
        return {"full_attention": full, "sliding_attention": sliding}

    def _key_positions(self, position_ids: torch.Tensor, n: int) -> torch.Tensor:
        """The position of every used slot once this forward's n tokens are appended, [B, S_past +
        step_len + n] (committed slots: the number of valid slots before them, holes included as -1
        or a repeat, always masked; step slots: the ids they were forwarded with). Records the new
        slots' positions for later forwards of the step. Sliding windows only (`_sliding_masks`).
        position_ids: [B, n], or broadcastable to it ([B, 1]: every token at one position)."""
        position_ids = position_ids.expand(-1, n)
        committed_pos = self.slot_valid.long().cumsum(dim=1) - 1  # [B, S_past]
        self._step_pos = torch.cat([self._step_pos[:, : self.step_len], position_ids], dim=1) if self.step_len else position_ids  # [B, s_step + n]
        return torch.cat([committed_pos, self._step_pos], dim=1)

    def _forward_static(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        step_visibility: torch.Tensor,
        logits_to_keep: int,
        model_inputs: dict[str, Any] | None,
        capture: bool = True,
    ) -> torch.Tensor:
        """Attention over the full capacity, inputs in fixed buffers, n padded to a bucket m;
        replayed as a CUDA graph when graphs are on. Logits [B, n or logits_to_keep, V] float32.

        The m - n padding tokens write step slots past the n real ones; `step_len` advances by
        n only, so the next forward overwrites them and no commit can keep them (commit keeps
        step slots < step_len). Each padding token sees only its own slot.
        A forward with model inputs (a multimodal prefill) or logits_to_keep (a prefill) is not
        padded (its one-off width would be wasted) and always runs eagerly.
        """
        cache = self._cache()
        shared = self._shared
        assert shared is not None
        b, n = input_ids.shape
        s_past, s_step = self.past_len, self.step_len
        bucketed = logits_to_keep == 0 and not model_inputs
        m = node_bucket(n) if bucketed else n
        self.reserve(s_past + s_step + m)
        capacity = cache.capacity
        if self.in_level:  # inside a drafting level's graph: offsets from the device, the model called directly
            return self._forward_in_level(input_ids, position_ids, step_visibility, m)
        with shared.lock:  # the buffers are the model's, shared by its runners: fill, run and read out in one go
            sliding = self.window is not None
            if bucketed:
                buf = shared.inputs(b, m, capacity, self.dtype, self.device, sliding=sliding)
            else:
                buf = StaticInputs.allocate(b, m, capacity, self.dtype, self.device, sliding=sliding)
            buf.fill(input_ids, position_ids, s_past + s_step, self.slot_valid, step_visibility)
            if sliding:
                assert self.window is not None
                buf.fill_window(self._key_positions(position_ids, n), position_ids.expand(-1, n), self.window)
            cache.length = s_past + s_step
            cache.static = buf
            try:
                if self.graphs is not None and bucketed and capture and cache.tensors():  # (the first forward allocates the storage: eager)
                    key = (b, m, capacity, *(t.data_ptr() for t, _, _ in cache.tensors()), *(t.data_ptr() for t in buf.masks()), buf.input_ids.data_ptr())
                    with uncounted():  # a replay dispatches no SDPA call: the backend choice is made inside capture (and eager fallback) only
                        out = self.graphs.run(key, lambda: self._call_static_backends(buf), keepalive=buf)
                        return out[:, :n].to(torch.float32, copy=True)  # [B, n, V]; the graph's output is overwritten by its next replay
                with uncounted(), _attention_backends(self.device):
                    out = self._call_static(buf, logits_to_keep, model_inputs)
            finally:
                cache.static = None
        return out[:, :n].float() if bucketed else out.float()

    def _forward_in_level(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step_visibility: torch.Tensor, m: int) -> torch.Tensor:
        """A bucketed static forward inside a drafting level (`in_level`): the committed slots'
        mask and S_past come from `begin_levels`' device buffers, so nothing here depends on the
        cache's length, and the model runs as part of the level's graph (not a graph of its own).
        Logits [B, n, V] float32."""
        cache, shared = self._cache(), self._shared
        assert shared is not None and self.window is None and self._level_past is not None and self._level_committed is not None, "begin_levels() first"
        b, n = input_ids.shape
        s_step = self.step_len
        with shared.lock:
            buf = shared.inputs(b, m, cache.capacity, self.dtype, self.device)
            buf.fill_at(input_ids, position_ids, s_step, self._level_past, self._level_committed, step_visibility)
            cache.length = self.past_len + s_step
            cache.static = buf
            try:
                with uncounted():
                    out = self._call_static_backends(buf)
            finally:
                cache.static = None
        return out[:, :n].float()

    def claims_walks(self) -> bool:
        """Whether this thread may verify with the model's captured walks (`claims_levels`' rule:
        the first thread to ask owns the walk buffers while it lives; others walk op by op)."""
        return self._claim("walk_thread")

    def claims_levels(self) -> bool:
        """Whether this thread may draft with the model's captured levels: the first thread to ask
        owns them while it lives (a restarted server's new decode thread, or a thread after the
        main one's own `generate`, takes them over), and every other thread drafts op by op. The level buffers
        (builder nodes, kept draft distributions, the source's slot bookkeeping) are the model's,
        not a runner's, and a step reads them until its verification: two threads drafting with
        one draft model at once would overwrite each other's trees. A server steps its sessions
        from one thread; `generate` calls from a pool of threads keep their forwards' graphs
        (those take `SharedState.lock` per forward) and lose only the levels' graphs."""
        return self._claim("level_thread")

    def _claim(self, field: str) -> bool:
        """Whether this thread owns the model's `field` (`SharedState.level_thread` or
        `walk_thread`), taking it when its owner is gone."""
        shared = self._shared
        if shared is None:
            return False
        me = threading.current_thread()
        owner = getattr(shared, field)
        if owner is not me and (owner is None or not owner.is_alive()):
            with shared.lock:
                owner = getattr(shared, field)
                if owner is None or not owner.is_alive():
                    setattr(shared, field, me)
                    owner = me
        return owner is me

    def begin_levels(self, step_slots: int) -> tuple[Any, ...]:
        """Prepare this step's captured drafting levels (`specdec.drafting.levels`): room for
        `step_slots` more step slots (so no level grows the cache), S_past and the committed
        slots' mask row in device buffers (3 ops). Returns what a level graph's key needs of
        this runner: batch size, capacity and the addresses of the storage and buffers it reads."""
        cache = self._cache()
        self.reserve(self.past_len + self.step_len + step_slots)
        b, capacity = self.batch_size, cache.capacity
        key = ("committed_mask", b, capacity)
        committed = self.level_buffers.get(key)
        if committed is None:  # one per shape: a shape met again (the next prompt's cache) finds its graphs' address
            mask_dtype = self.dtype if self.dtype.is_floating_point else torch.float32
            committed = self.level_buffers[key] = torch.empty(b, capacity, dtype=mask_dtype, device=self.device)
        self._level_committed = committed
        past = self.level_buffers.get(("past",))
        if past is None:
            past = self.level_buffers[("past",)] = torch.zeros(1, dtype=torch.long, device=self.device)
        self._level_past = past
        past.fill_(self.past_len)
        hidden = torch.finfo(committed.dtype).min
        committed.fill_(hidden)
        committed[:, : self.past_len].masked_fill_(self.slot_valid, 0.0)
        return (b, capacity, committed.data_ptr(), past.data_ptr(), *(t.data_ptr() for t, _, _ in cache.tensors()))

    def _call_static_backends(self, buf: StaticInputs) -> torch.Tensor:
        """`_call_static` of a bucketed forward under the allowed attention backends (what a CUDA
        graph captures, or runs eagerly once graphs are given up)."""
        with _attention_backends(self.device):
            return self._call_static(buf, 0, None)

    def _call_static(self, buf: StaticInputs, logits_to_keep: int, model_inputs: dict[str, Any] | None) -> torch.Tensor:
        """The model on the static buffers (cache.static is set): logits [B, m, V] in the model's dtype."""
        mask: torch.Tensor | dict[str, torch.Tensor] = buf.mask
        if buf.sliding is not None:  # every layer slides (one mask), or {layer type: mask}
            mask = buf.sliding if self._layer_types is None else {"full_attention": buf.mask, "sliding_attention": buf.sliding}
        with self._rope_scope():
            out = self.model(
                input_ids=buf.input_ids,
                attention_mask=mask,
                position_ids=buf.position_ids,
                use_cache=True,
                **{self._cache_arg: self._cache()},
                **self._keep_kwargs(logits_to_keep),
                **(model_inputs or {}),
            )
        return _kept(out.logits, logits_to_keep)

    def _rope_scope(self) -> contextlib.AbstractContextManager[None]:
        """Around the model's call: LongRoPE frequencies per token (`specdec.models.rope`), by row in a prefill."""
        return self._longrope.scope(prefill=self._prefilling) if self._longrope is not None else contextlib.nullcontext()

    def _keep_kwargs(self, logits_to_keep: int) -> dict[str, int]:
        """logits_to_keep under the name the model's forward takes ({} when it takes none)."""
        return {} if self._keep_arg is None else {self._keep_arg: logits_to_keep}

    def _start_timer(self) -> Any:
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def _stop_timer(self, timer: Any) -> None:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((timer, end))
        else:
            self._forward_s += time.perf_counter() - timer

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict[str, Any] | list[dict[str, Any]] | None = None, dense: bool = False
    ) -> torch.Tensor:
        """Run left-padded prompts and commit them; return the logits of the last position.

        input_ids: [B, L] int64 (left-padded); attention_mask: [B, L] (1 = real token);
        model_inputs: the batch's other inputs (pixel_values of its images, in row order), or one
        dict per row (`prefill_inputs`, for models whose images do not batch exactly): then each
        row is prefilled in a forward of its own, as its prompt alone would be.
        dense: the caller knows no row is padded (every attention_mask entry is 1).
        Returns [B, V] float32: the distribution of each row's first new token.
        """
        if isinstance(model_inputs, list):
            if len(model_inputs) != input_ids.shape[0]:
                raise ValueError(f"prefill got {len(model_inputs)} rows of model inputs for {input_ids.shape[0]} prompts")
            if input_ids.shape[0] == 1:
                model_inputs = model_inputs[0] or None
            else:
                lengths = attention_mask.sum(dim=1).tolist()
                order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
                return self._prefill_grouped(input_ids, attention_mask, [[row] for row in order], lengths, row_inputs=model_inputs)
        # one host read of the rows' lengths (batches only): prompts of very different lengths are
        # prefilled a group of similar lengths at a time, each padded to its own longest
        grouping = not (model_inputs or dense) and input_ids.shape[0] > 1
        lengths = attention_mask.sum(dim=1).tolist() if grouping else []
        groups = prefill_groups(lengths, self.device) if grouping else None
        if groups is not None:
            return self._prefill_grouped(input_ids, attention_mask, groups, lengths)
        return self._prefill_padded(input_ids, attention_mask, model_inputs, dense)

    def _prefill_padded(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict[str, Any] | None, dense: bool, spare: int = CAPACITY_STEP
    ) -> torch.Tensor:
        """`prefill` as one forward over the left-padded batch (room for `spare` more slots per row)."""
        self.reset(input_ids.shape[0], capacity=input_ids.shape[1] + spare)
        real = attention_mask.bool()
        positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        causal = torch.tril(torch.ones(input_ids.shape[1], input_ids.shape[1], dtype=torch.bool, device=self.device))
        visibility = causal[None] & real[:, None, :]  # [B, L, L]
        self._prefilling = True
        try:
            logits = self.forward(input_ids, positions, visibility, logits_to_keep=1, model_inputs=model_inputs)[:, -1]
        finally:
            self._prefilling = False
        self.commit_prefix(real)
        self.dense = dense and not model_inputs
        return logits

    @torch.inference_mode()
    def _prefill_grouped(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: list[list[int]], lengths: list[int], row_inputs: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        """`prefill` one group of similar-length rows at a time (`prefill_groups`), each padded only
        to its own longest prompt, then copied right-aligned into one batch cache (one copy per
        group, no full-cache passes). Returns [B, V] float32 in row order. The committed slots are
        those of a padded prefill (left padding: invalid slots), so nothing after it can tell them apart.
        lengths: each row's prompt length (already read by `prefill`). row_inputs: each row's own
        model inputs (images), with groups of one row each."""
        b, width = input_ids.shape
        out: torch.Tensor | None = None
        valid = torch.zeros(b, width, dtype=torch.bool, device=self.device)
        for group in groups:
            index = torch.tensor(group, dtype=torch.long, device=input_ids.device)
            longest = max(lengths[row] for row in group)
            part = ModelRunner(self.model, time_forwards=self.time_forwards)
            ids, mask = input_ids[index, width - longest :], attention_mask[index, width - longest :]
            inputs = (row_inputs[group[0]] or None) if row_inputs is not None else None  # (groups of one row when given)
            logits = part._prefill_padded(ids, mask, inputs, dense=False, spare=0)  # [|g|, V]; its cache is copied below, never grown
            self._absorb_forward_stats(part)
            if out is None:  # the first (longest) group: the batch cache, shaped like its storage
                out = logits.new_empty(b, logits.shape[-1])
                self._allocate_like(part._cache(), b, width + CAPACITY_STEP)
            out.index_copy_(0, index.to(out.device), logits)
            index = index.to(self.device)
            s_part = part.past_len
            for (dst, batch_dim, slot_dim), (src, _, _) in zip(self._cache().tensors(), part._cache().tensors(), strict=True):
                dst.narrow(slot_dim, width - s_part, s_part).index_copy_(batch_dim, index, src.narrow(slot_dim, 0, s_part))
            valid[index, width - s_part :] = part.slot_valid
            del part  # one group's cache alive at a time, besides the batch's
        assert out is not None
        self.commit_prefix(valid)
        return out

    def _allocate_like(self, like: SlotCache, batch_size: int, capacity: int) -> None:
        """Reset to `batch_size` rows with storage allocated now (not at the first forward), each
        storage tensor shaped like `like`'s but for these rows and this capacity."""
        self.reset(batch_size, capacity=capacity)
        cache = self._cache()

        def batch_storage(t: torch.Tensor, batch_dim: int, slot_dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[batch_dim], shape[slot_dim] = batch_size, cache.capacity
            return cache._zeros(tuple(shape), t)

        cache.storage, cache.layout = None if like.storage is None else batch_storage(like.storage, 2, 4), like.layout
        cache.extra, cache.extra_layouts = {i: batch_storage(t, 1, 3) for i, t in like.extra.items()}, dict(like.extra_layouts)
        for layer in cache.layers:
            layer.is_initialized = True

    def _absorb_forward_stats(self, other: ModelRunner) -> None:
        """Count another runner's forwards (a prefill run on its own for this batch) as this one's."""
        self.forward_calls += other.forward_calls
        self.forward_tokens += other.forward_tokens
        self._forward_s += other._forward_s
        self._events.extend(other._events)

    # ----- commit / rollback -------------------------------------------------------
    def commit_prefix(self, keep_valid: torch.Tensor) -> None:
        """Keep every step slot in place (keep_valid [B, step_len] marks the real ones)."""
        self.slot_valid = torch.cat([self.slot_valid, keep_valid.to(self.device).bool()], dim=1)
        self.step_len = 0
        self._cache().length = self.past_len

    @torch.inference_mode()
    def commit(self, keep: torch.Tensor, keep_valid: torch.Tensor, dense: bool = False, in_place: bool = False) -> None:
        """Keep step slots `keep` (in order) after the committed prefix; drop the others.

        keep:       [B, K] int64 step-slot indices (0 = first slot appended this step)
        keep_valid: [B, K] bool; False entries are padding and become invalid slots.
        Example: step slots [r, a, b, c] with keep [[0, 1, 3]] -> the cache ends in r, a, c.
        One gather and one in-place copy for all layers (a few more for odd-shaped layers).
        dense: the caller knows keep_valid is all True (no new holes), so a cache without
        holes stays one (then a single-token forward needs no attention mask).
        in_place: the caller knows keep[b, j] == j wherever keep_valid[b, j] (the kept slots lead
        the step already, as a chain's accepted prefix does): nothing is gathered or copied.
        """
        cache = self._cache()
        s_past, k = self.past_len, keep.shape[1]
        if not dense and self._holes_from is None:  # rows that keep fewer slots than others leave holes from here on
            self._holes_from = s_past
        if k > self.step_len:  # padding columns past the step's slots (a chain keeps a path column for the leaf it never forwarded)
            self.reserve(s_past + k)
        if k > 0 and not in_place:
            src = s_past + keep.clamp(0, max(self.step_len - 1, 0))  # [B, K]
            for t, batch_dim, slot_dim in cache.tensors():
                # idx: src broadcast over every dim but batch and slot
                shape = [1] * t.dim()
                shape[batch_dim], shape[slot_dim] = src.shape[0], k
                idx = src.reshape(shape).expand(*[k if d == slot_dim else s for d, s in enumerate(t.shape)])
                kept = t.gather(slot_dim, idx)
                t.narrow(slot_dim, s_past, k).copy_(kept)
        self.slot_valid = torch.cat([self.slot_valid, keep_valid.to(self.device).bool()], dim=1)
        self.step_len = 0
        self.dense = self.dense and dense
        cache.length = self.past_len
        self.compact_if_wasteful()

    @torch.inference_mode()
    def keep_rows(self, rows: torch.Tensor | Sequence[int], room: int | None = None) -> None:
        """Shrink (or reorder/repeat) the batch to `rows` ([B'] row indices, in their new order).

        Given as a host list in hole-filling order (`hole_filling_order`: every kept row stays
        where it is, or moves from beyond the new batch size into a finished row's place), only
        the moved rows are copied and the storage is cut to the first B' rows (a view): a row
        that finishes costs one row's copy, not the whole cache's (with rows finishing one by one
        at batch 16 the full copies were ~9% of a speculative method's time on the CPU). Given as
        a host list that keeps every row in place and appends rows (a batch that grows), the
        storage is widened over the rows an earlier cut left behind when it has them, and only
        the appended rows are copied (`_grow_in_place`). A batch that grows past the rows its
        storage holds, given `room` (the most rows it may reach: a session's `max_rows`), moves on
        a CPU into storage laid out for twice its rows, at most `room` (`_grow_with_room`), so a
        batch that keeps growing (a server ramping up) copies its cache a logarithmic number of
        times, not once per joining prompt. Any other order (or static shapes, whose storage keeps
        its addresses) copies every kept row."""
        cache = self._cache()
        if self.step_len:
            raise RuntimeError("keep_rows needs a committed cache (call it between steps)")
        moves = None if isinstance(rows, torch.Tensor) or self._shared is not None else _hole_fills(list(rows))
        index = (rows if isinstance(rows, torch.Tensor) else torch.tensor(list(rows), dtype=torch.long)).to(self.device)
        appended = None if isinstance(rows, torch.Tensor) or self._shared is not None else _appended_rows(list(rows), cache.rows)
        if appended is not None and (self._grow_in_place(appended) or (room is not None and self._grow_with_room(appended, room))):
            pass
        elif moves is None:
            self._map_storage(lambda t, batch_dim, slot_dim: t.index_select(batch_dim, index))
        else:
            holes, fillers = moves
            if holes:
                to = torch.tensor(holes, dtype=torch.long, device=self.device)
                source = torch.tensor(fillers, dtype=torch.long, device=self.device)
                for t, batch_dim, _ in cache.tensors():
                    t.index_copy_(batch_dim, to, t.index_select(batch_dim, source))
            kept = index.shape[0]
            cache.map_tensors(lambda t, batch_dim, slot_dim: t.narrow(batch_dim, 0, kept))
        cache.rows = index.shape[0]
        self.slot_valid = self.slot_valid.index_select(0, index)
        self.compact_if_wasteful()

    def _grow_in_place(self, appended: list[int]) -> bool:
        """`keep_rows` of an order that keeps every row in place and appends copies of rows
        `appended`: when every storage tensor is a cut of one laid out for enough rows (a batch
        that shrank as rows finished, then grows as prompts join, as a server's does), widen the
        views and copy only the appended rows. A full copy of the cache (the other way) took
        29-359 ms a joining prompt for the bundled target at B = 4-16 on the CPU, this 2.6-3.5 ms
        (benchmarks/cpu-grow-in-place). False when a tensor lacks the room (nothing changed then)."""
        cache = self._cache()
        rows = cache.rows + len(appended)
        widened = [(_widened(t, batch_dim, rows), batch_dim) for t, batch_dim, _ in cache.tensors()]
        if not widened or any(w is None for w, _ in widened):
            return False
        source = torch.tensor(appended, dtype=torch.long, device=self.device)
        for w, batch_dim in widened:
            assert w is not None
            w.narrow(batch_dim, cache.rows, len(appended)).copy_(w.index_select(batch_dim, source))
        views = iter(w for w, _ in widened)
        cache.map_tensors(lambda t, batch_dim, slot_dim: next(views))
        return True

    def _grow_with_room(self, appended: list[int], room: int) -> bool:
        """`keep_rows` of an order that keeps every row and appends copies of rows `appended`,
        past the rows the storage holds: on a CPU, the batch moves into new storage laid out for
        min(room, 2 x the rows) rows (a cut of its first rows), then grows in place there as any
        join into a cut does (`_grow_in_place`), and so do later joins. The old storage goes to
        the pool. False (nothing changed) elsewhere:
        on a GPU a gather is cheap and memory is not, and static shapes keep exact shapes.
        A ramp from 1 to 16 rows, one joining prompt at a time, copies the cache 4 times, not 15
        (on the CPU a full copy of the bundled target's cache took up to 359 ms at B = 16,
        benchmarks/cpu-grow-in-place)."""
        cache = self._cache()
        rows = cache.rows + len(appended)
        laid_out = min(room, max(rows, 2 * cache.rows))
        if self._shared is not None or self.device.type != "cpu" or laid_out <= rows:
            return False
        old = cache.tensors()

        def relay(t: torch.Tensor, batch_dim: int, slot_dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[batch_dim] = laid_out
            new = cache._zeros(tuple(shape), t)  # [.., laid_out, ..]: rows past the batch are written when they join
            return new.narrow(batch_dim, 0, cache.rows).copy_(t)  # the batch as it was, a cut of the new layout

        cache.map_tensors(relay)
        if self._pool is not None:
            self._pool.give(old)
        grown = self._grow_in_place(appended)  # the appended rows, as any join into a cut grows
        assert grown, "a fresh layout of laid_out > rows rows must widen"
        return True

    @torch.inference_mode()
    def replace_rows(
        self, rows: list[int], input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict[str, Any] | list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        """Prefill new prompts into batch rows `rows` (their old contents are dropped).

        input_ids, attention_mask: [len(rows), L] left-padded. The new rows are prefilled on
        their own and their cache spliced in right-aligned. When L exceeds the cache's width the
        width grows on the right: the other rows get invalid slots after their committed ones
        (holes, as a step that accepts fewer tokens than another row leaves; position ids count
        valid slots, so theirs do not change), and nothing of theirs moves. Growing on the left
        instead shifted every row's slots, a copy of the whole cache each time a longer prompt
        joined. Returns the new rows' last logits [len(rows), V].
        """
        cache = self._cache()
        if self.step_len:
            raise RuntimeError("replace_rows needs a committed cache (call it between steps)")
        fresh = ModelRunner(self.model, time_forwards=self.time_forwards)
        logits = fresh.prefill(input_ids, attention_mask, model_inputs)
        self._absorb_forward_stats(fresh)
        fresh_cache = fresh._cache()
        s_new = fresh.past_len
        if s_new > self.past_len:
            self._grow_right(s_new - self.past_len)
        s = self.past_len
        self.reserve(s)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for (t, batch_dim, slot_dim), (new, _, _) in zip(cache.tensors(), fresh_cache.tensors(), strict=True):
            # each new row's s committed slots, written in place: zeros (invalid) then its prompt, right-aligned
            # (not a copy of the old rows' whole storage, which cost ~8 ms an admission at B = 16 on the CPU)
            row_slot_dim = slot_dim - 1 if slot_dim > batch_dim else slot_dim
            for i, row in enumerate(rows):
                dst = t.select(batch_dim, row)
                dst.narrow(row_slot_dim, 0, s - s_new).zero_()
                dst.narrow(row_slot_dim, s - s_new, s_new).copy_(new.select(batch_dim, i).narrow(row_slot_dim, 0, s_new))
        self.dense = False
        valid = torch.zeros(len(rows), s, dtype=torch.bool, device=self.device)
        valid[:, s - s_new :] = fresh.slot_valid
        self.slot_valid[index] = valid
        self.compact_if_wasteful()
        return logits

    def _grow_right(self, extra: int) -> None:
        """Append `extra` invalid (zeroed) slots after every row's committed slots: holes from
        the old width on, which compaction removes when they grow wasteful."""
        cache = self._cache()
        s = self.past_len
        self.reserve(s + extra)
        for t, _, slot_dim in cache.tensors():
            t.narrow(slot_dim, s, extra).zero_()  # (stale step slots: finite, but masked attention should read zeros)
        self.dense = False
        self.slot_valid = torch.cat([self.slot_valid, torch.zeros(self.batch_size, extra, dtype=torch.bool, device=self.device)], dim=1)
        self._holes_from = s if self._holes_from is None else min(self._holes_from, s)
        cache.length = self.past_len

    def rollback(self) -> None:
        """Drop every step slot appended since the last commit."""
        self.step_len = 0
        self._cache().length = self.past_len

    @torch.inference_mode()
    def fill_random(self, batch_size: int, context: int, generator: torch.Generator) -> None:
        """Reset to `batch_size` rows whose caches hold `context` random committed entries
        (for latency measurements: attention cost depends on the cache, not its values)."""
        self.reset(batch_size, capacity=context + CAPACITY_STEP)
        one = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self.forward(one, one, torch.ones(batch_size, 1, 1, dtype=torch.bool, device=self.device))  # allocates every layer
        self.rollback()
        cache = self._cache()

        def randomize(t: torch.Tensor, batch_dim: int, slot_dim: int) -> torch.Tensor:
            noise = torch.randn(t.shape, generator=generator, device="cpu" if generator.device.type == "cpu" else t.device, dtype=torch.float32)
            return noise.to(device=t.device, dtype=t.dtype)

        self._map_storage(randomize)
        self.slot_valid = torch.ones(batch_size, context, dtype=torch.bool, device=self.device)
        cache.length = context

    @torch.inference_mode()
    def warm_up(self, batch_sizes: Sequence[int], context: int = 0, max_tokens: int = WARM_UP_TOKENS) -> int:
        """Run one static-shape forward of every node-count bucket up to `max_tokens` at each
        batch size, over a cache with room for `context` slots (capturing CUDA graphs when they
        are on), so that capture costs are paid here and not inside a timed call. The caches go
        back to the model's pool, where a later prefill of the same batch size and a similar
        context takes them (their addresses are what the graphs captured). Returns the number
        of forwards run: 0 without static shapes. Leaves the runner empty (reset it before use)."""
        if not self.static_shapes:
            return 0
        runs = 0
        buckets = [m for m in BUCKETS if m <= node_bucket(max(1, max_tokens))]
        for b in batch_sizes:
            self.reset(b, capacity=context + CAPACITY_STEP)
            one = torch.zeros(b, 1, dtype=torch.long, device=self.device)
            self.forward(one, one, torch.ones(b, 1, 1, dtype=torch.bool, device=self.device))  # allocates every layer (eager)
            self.rollback()
            for m in buckets:
                ids = torch.zeros(b, m, dtype=torch.long, device=self.device)
                self.forward(ids, ids, torch.zeros(b, m, 0, dtype=torch.bool, device=self.device))  # each token sees only itself
                self.rollback()
                runs += 1
        self._release()
        self.reset(0)
        return runs

    @torch.inference_mode()
    def compact_if_wasteful(self, max_waste: float = 0.25, min_slots: int = 64) -> None:
        """Remove invalid slots when they exceed `max_waste` of the cache.

        Rows keep their valid slots in order, right-aligned after left padding, so
        position ids (counts of valid slots) are unchanged. Checked (one host read) only
        each time the committed width has grown by `min_slots` since the last check, so a
        decoding step normally reads nothing here.

        Only the slots from the first hole on move (a hole: an invalid slot after one of its
        row's valid ones, as a step that accepts fewer tokens than another row leaves; the
        column is kept on the host, `_holes_from`). The prompts before it stay where they are,
        and each row's later valid slots are packed right-aligned behind them, in place (their
        left padding stays as it is). Where that would remove less than half of the invalid
        slots that moving every slot would (rows admitted into a running batch, whose left
        padding sits anywhere), every slot moves. Both copy the moved slots within the storage,
        never the whole of it: on the bundled pair at B = 16 the
        old compaction (a zeroed copy of the whole storage) took 175 ms a time on the CPU, about
        1 s of a K = 5 chain's 7 s bench run, and 26-74 ms this way (docs/ARCHITECTURE.md, "The KV
        cache, slot by slot"). In place, the storage also keeps its addresses (static shapes).
        """
        self._cache()  # (raises without one)
        b, s = self.slot_valid.shape
        if self.step_len or b == 0 or s < self._compact_checked_at + min_slots:
            return
        self._compact_checked_at = s
        valid = self.slot_valid  # [B, S]
        a = s if self._holes_from is None else min(self._holes_from, s)
        # the most valid slots of a row, in all and from column a on, in one int64: the check's one host read
        packed = valid.sum(dim=1).max() * (s + 1) + valid[:, a:].sum(dim=1).max()
        width, tail_width = divmod(int(packed.item()), s + 1)
        if s - width < max(min_slots, max_waste * s):
            return
        if 2 * (s - a - tail_width) >= s - width:  # moving the slots from the first hole on removes at least half of what moving all would
            self._compact_from(a, tail_width)
        else:
            self._compact_from(0, width)

    def _compact_from(self, start: int, width: int) -> None:
        """Pack each row's valid slots at `start` and after into slots start..start + width - 1,
        right-aligned, in order (rows with fewer than `width` lead with invalid slots); slots
        before `start` stay. In place: the moved slots are gathered, then copied back."""
        cache = self._cache()
        b, s = self.slot_valid.shape
        region = self.slot_valid[:, start:]  # [B, S - start]
        order = torch.argsort(region.to(torch.int8), dim=1, stable=True)[:, region.shape[1] - width :]  # [B, width]: invalid first, then valid in order
        new_region = region.gather(1, order)
        for t, batch_dim, slot_dim in cache.tensors():
            shape = [1] * t.dim()
            shape[batch_dim], shape[slot_dim] = b, width
            moved = t.narrow(slot_dim, start, s - start)
            idx = order.reshape(shape).expand(*[width if d == slot_dim else n for d, n in enumerate(moved.shape)])
            t.narrow(slot_dim, start, width).copy_(moved.gather(slot_dim, idx))
        self.dense = False
        self.slot_valid = torch.cat([self.slot_valid[:, :start], new_region], dim=1)
        self._holes_from = start if start else None  # rows with fewer slots lead their packed region with invalid ones; from 0 that is left padding
        self._compact_checked_at = start + width
        cache.length = start + width


PREFILL_FORWARD_TOKENS = {"cpu": 32, "cuda": 512}
"""the fixed cost of one more prefill forward, in prompt tokens: on a 2-core CPU the bundled target's
one-token forward takes about as long as 25 tokens of its prefill; for CUDA an estimate (an eager,
launch-bound forward of a 3B model against its prefill throughput), not measured. Other device
types count as CUDA."""


def prefill_groups(lengths: Sequence[int], device: torch.device) -> list[list[int]] | None:
    """Split a batch's prompts into groups of similar length to prefill one group at a time, when
    that forwards fewer tokens than one padded batch; None: one batched prefill is as cheap.

    lengths: each row's real (unpadded) prompt length. Rows are sorted longest first and cut
    into contiguous runs minimising sum over groups of (rows x the group's longest prompt) plus
    `PREFILL_FORWARD_TOKENS` per forward (an exact dynamic program over the cut points). Example,
    CPU: lengths [600, 40, 580, 30] -> [[0, 2], [1, 3]] (1,240 + 80 + 2 x 32 tokens against 2,400 + 32).
    Returns the groups (row indices, longest group first) or None when one group is best."""
    n = len(lengths)
    if n < 2 or min(lengths) < 1:
        return None
    overhead = PREFILL_FORWARD_TOKENS.get(device.type, PREFILL_FORWARD_TOKENS["cuda"])
    order = sorted(range(n), key=lambda row: -lengths[row])
    best = [0.0] + [math.inf] * n  # best[j]: cost of prefilling the j longest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last group is sorted rows i .. j-1, padded to row i's length
            cost = best[i] + (j - i) * lengths[order[i]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], n
    while j > 0:
        bounds.append((cut[j], j))
        j = cut[j]
    if len(bounds) == 1:
        return None
    return [order[i:j] for i, j in reversed(bounds)]


def _round_up(slots: int) -> int:
    return -(-slots // CAPACITY_STEP) * CAPACITY_STEP


def _cache_layout(model: PreTrainedModel) -> tuple[int, int | None]:
    """(decoder layers that keep a KV cache, as transformers lays them out for this config;
    the sliding window in tokens when some of them slide, else None)."""
    layers = DynamicCache(config=model.config).layers
    if not layers:
        raise SpecDecError(f"cannot tell how many decoder layers {type(model).__name__} has from its config")
    if not any(getattr(layer, "is_sliding", False) for layer in layers):
        return len(layers), None
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window < 1:
        raise SpecDecError(f"{type(model).__name__} has sliding-window layers but its config gives no sliding_window size ({window!r})")
    return len(layers), window


def _layer_types(model: PreTrainedModel) -> list[str] | None:
    """The config's per-layer attention types when it declares them (mixed full and sliding
    layers take a mask per type), None when it does not (every layer slides, e.g. Mistral)."""
    types = getattr(model.config.get_text_config(), "layer_types", None)
    if types is None:
        return None
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise SpecDecError(f"{type(model).__name__} has attention layer types {unknown} that specdec cannot mask yet (supported: full_attention, sliding_attention)")
    return list(types)


class _attention_backends:
    """On CUDA, SDPA without cuDNN attention: cuDNN builds a new execution plan for every new
    key length (the cache grows every step and tree sizes vary), costing milliseconds per
    call. Flash/efficient/math kernels need no plan. A no-op elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self._ctx: Any = sdpa_kernel(_NO_CUDNN) if device.type == "cuda" else None

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""the SDPA backends allowed on CUDA (all but cuDNN attention)"""
