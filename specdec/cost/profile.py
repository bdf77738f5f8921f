"""Measuring f_T(B, c, n) and f_D(B, c, n), and finding the right table for a model pair.

A measurement fills a fresh `ModelRunner`'s KV cache with `c` random entries per row
(the cost of a forward depends on shapes, not values, so no prefill compute is spent),
then times `warmup + repeats` forwards of `n` new tokens per row under a causal step
mask, rolling back after each, and keeps the median of the timed ones. The runner's
forward is exactly the call the engine makes (4D mask build + model + logits), so the
numbers include the same per-call overhead.

`CostTableResolver` picks the table CAST uses for a target/draft pair: an explicit
profile path, else the profile shipped with the bundled pair; a missing file or one that
was measured for other models/device/dtype is replaced by a quick measurement on first
use (one batch size, a coarse grid), announced with a log warning.
"""

from __future__ import annotations

import datetime
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers

from specdec.cost.table import CostTable, device_identity, model_identity
from specdec.errors import SpecDecError
from specdec.models.loading import BUNDLED_PAIR, context_length
from specdec.models.runner import ModelRunner

LOG = logging.getLogger("specdec.cost")

SHIPPED_PROFILE = BUNDLED_PAIR / "cost_profile.json"
"""the bundled pair's profile (made by `specdec profile --out` this path)"""


@dataclass
class ProfileGrid:
    """Where f(B, c, n) is measured. Defaults profile the bundled pair in a few CPU minutes."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    context_step: int = 256
    """L: contexts c = L, 2L, ..., M*L"""
    num_contexts: int = 4
    """M"""
    n_grid: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    """new tokens per row; costs in between are interpolated linearly"""
    warmup: int = 1
    """untimed forwards before each grid point"""
    repeats: int = 3
    """timed forwards per grid point at least (the median is kept)"""
    min_time_ms: float = 100.0
    """cheap points repeat until their timed forwards add up to this (at most `max_repeats`)"""
    max_repeats: int = 25
    quick: bool = False
    """a first-use measurement (coarse; extended batch by batch as new batch sizes appear)"""

    def __post_init__(self) -> None:
        for name in ("context_step", "num_contexts", "repeats", "max_repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecDecError(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise SpecDecError(f"warmup={self.warmup!r} must be an integer >= 0")
        self.batch_sizes = tuple(sorted({int(b) for b in self.batch_sizes}))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise SpecDecError(f"batch sizes {self.batch_sizes!r} must be positive integers, e.g. 1,2,4,8,16")
        grid = tuple(int(n) for n in self.n_grid)
        if not grid or grid[0] < 1 or any(b <= a for a, b in zip(grid, grid[1:], strict=False)):
            raise SpecDecError(f"n grid {self.n_grid!r} must be strictly increasing positive integers, e.g. 1,2,4,8,16,32,64,128")
        self.n_grid = grid

    def points(self) -> int:
        """Grid points per model."""
        return len(self.batch_sizes) * self.num_contexts * len(self.n_grid)


def quick_grid(batch_size: int) -> ProfileGrid:
    """The first-use grid: one batch size, 2 contexts (256, 512), n up to 96, >= 3 timed forwards."""
    return ProfileGrid(
        batch_sizes=(batch_size,),
        context_step=256,
        num_contexts=2,
        n_grid=(1, 2, 4, 8, 16, 32, 64, 96),
        warmup=1,
        repeats=3,
        min_time_ms=30.0,
        max_repeats=9,
        quick=True,
    )


def _fill_context(runner: ModelRunner, batch: int, context: int, generator: torch.Generator) -> None:
    """Reset `runner` to `batch` rows whose caches hold `context` random committed entries."""
    runner.fill_random(batch, context, generator)


def measure_forward_ms(
    runner: ModelRunner,
    context: int,
    n: int,
    warmup: int,
    repeats: int,
    generator: torch.Generator,
    min_time_ms: float = 0.0,
    max_repeats: int = 25,
) -> float:
    """Median latency (ms) of one forward of `n` new tokens per row over the runner's current
    cache (filled by `_fill_context` to `context` entries); the cache is rolled back after each.

    At least `repeats` timed forwards, more (up to `max_repeats`) until they add up to `min_time_ms`.
    """
    dev = runner.device
    batch = runner.batch_size
    vocab = runner.model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (batch, n), generator=generator, device=dev)  # [B, n]
    limit = context_length(runner.model)
    positions = context + torch.arange(n, device=dev)
    if limit is not None:  # the position value does not change the cost; stay inside learned position tables
        positions = positions.clamp(max=limit - 1)
    positions = positions.expand(batch, n)  # [B, n]
    visibility = torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev)).expand(batch, n, n)  # [B, n, n]
    times: list[float] = []
    i = 0
    while len(times) < repeats or (sum(times) < min_time_ms and len(times) < max(repeats, max_repeats)):
        t0 = time.perf_counter()
        runner.forward(ids, positions, visibility)  # synchronises on CUDA
        elapsed = time.perf_counter() - t0
        runner.rollback()
        if i >= warmup:
            times.append(elapsed * 1000.0)
        i += 1
    return statistics.median(times)


def profile_models(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    grid: ProfileGrid | None = None,
    progress: Callable[[str], None] | None = None,
    cuda_graphs: bool = False,
) -> CostTable:
    """Measure f_T and f_D on `grid`; returns a CostTable with its provenance in `meta`.
    cuda_graphs: measure the forwards as the engine runs them with CUDA graphs (bucketed, replayed)."""
    grid = grid or ProfileGrid()
    generator_dev = next(target.parameters()).device
    generator = torch.Generator(device=generator_dev).manual_seed(0)
    runners = {"target": ModelRunner(target, cuda_graphs=cuda_graphs), "draft": ModelRunner(draft, cuda_graphs=cuda_graphs)}
    tables: dict[str, dict[int, list[list[float]]]] = {"target": {}, "draft": {}}
    t_start = time.perf_counter()
    contexts = [(k + 1) * grid.context_step for k in range(grid.num_contexts)]
    with torch.inference_mode():
        for runner in runners.values():  # warm up threads and allocator once before any timing
            _fill_context(runner, grid.batch_sizes[0], contexts[0], generator)
            measure_forward_ms(runner, contexts[0], grid.n_grid[-1], 0, 3, generator)
        for batch in grid.batch_sizes:
            for which, runner in runners.items():
                rows = []
                for context in contexts:
                    _fill_context(runner, batch, context, generator)
                    rows.append(
                        [
                            measure_forward_ms(runner, context, n, grid.warmup, grid.repeats, generator, grid.min_time_ms, grid.max_repeats)
                            for n in grid.n_grid
                        ]
                    )
                tables[which][batch] = rows
                if progress is not None:
                    progress(
                        f"{which} B={batch}: {time.perf_counter() - t_start:.0f}s; "
                        + ", ".join(f"n={n} {ms:.1f}ms" for n, ms in zip(grid.n_grid, rows[0], strict=True))
                    )
    for runner in runners.values():
        runner.reset(0)
    param = next(target.parameters())
    meta = {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_identity(param.device),
        "dtype": str(param.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "target": model_identity(target),
        "draft": model_identity(draft),
        "grid": asdict(grid),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    return CostTable(grid.context_step, grid.num_contexts, list(grid.n_grid), tables["target"], tables["draft"], meta=meta)


@dataclass
class CostTableResolver:
    """The cost table of one target/draft pair, found or measured on first use.

    Order: `path` (an explicit profile) else the shipped bundled-pair profile. A file that
    is missing or was measured for other models, device or dtype is replaced by a quick
    measurement (`quick_grid`) with a warning; a quick table grows by one batch size at a
    time as new batch sizes appear, and is written back when `path` was given.
    """

    target: torch.nn.Module
    draft: torch.nn.Module
    path: str | None = None
    _table: CostTable | None = field(default=None, init=False, repr=False)
    _extendable: bool = field(default=False, init=False, repr=False)

    def table_for(self, batch: int) -> CostTable:
        """A table covering `batch` rows (measuring what is missing, when it was measured here)."""
        if self._table is None:
            self._table = self._load(batch)
        if self._extendable and batch not in self._table.batch_sizes:
            LOG.warning("CAST: measuring forward costs for batch size %d (first use at this batch size)", batch)
            self._table = self._table.merged(profile_models(self.target, self.draft, quick_grid(batch)))
            self._save()
        return self._table

    def _load(self, batch: int) -> CostTable:
        source = Path(self.path).expanduser() if self.path else SHIPPED_PROFILE
        reason = None
        if source.is_file():
            table = CostTable.load(source)
            reason = table.mismatch(self.target, self.draft)
            if reason is None:
                self._extendable = bool(table.meta.get("grid", {}).get("quick", False))
                return table
            if self.path is None:
                reason = "the shipped profile is for the bundled pair"
            LOG.warning("CAST: cost profile %s does not fit these models (%s)", source, reason)
        elif self.path is not None:
            LOG.warning("CAST: cost profile %s does not exist", source)
        LOG.warning(
            "CAST: measuring a quick cost profile for batch size %d (a few seconds); `specdec profile --out FILE` and "
            "--cost-profile FILE give a full one",
            batch,
        )
        self._table = profile_models(self.target, self.draft, quick_grid(batch))
        self._extendable = True
        self._save()
        return self._table

    def _save(self) -> None:
        """Write a measured table to `path`, unless that would overwrite a full profile or one
        of other models (those are left alone)."""
        if self.path is None or self._table is None or not self._extendable:
            return
        path = Path(self.path).expanduser()
        if path.is_file():
            try:
                existing = CostTable.load(path)
            except SpecDecError:
                return
            if not existing.meta.get("grid", {}).get("quick", False) or existing.mismatch(self.target, self.draft) is not None:
                return
        self._table.save(path)
        LOG.warning("CAST: cost profile saved to %s", path)


def describe(table: CostTable, batch_sizes: Sequence[int] | None = None) -> str:
    """A short text summary: per batch size, target and draft ms at the smallest context."""
    lines = [f"contexts {table.contexts}, n grid {table.n_grid}"]
    for b in batch_sizes or table.batch_sizes:
        t = ", ".join(f"{n}:{ms:.1f}" for n, ms in zip(table.n_grid, table.target_ms[b][0], strict=True))
        d = ", ".join(f"{n}:{ms:.1f}" for n, ms in zip(table.n_grid, table.draft_ms[b][0], strict=True))
        lines.append(f"B={b} target ms [n:ms] {t}\n     draft  ms [n:ms] {d}")
    return "\n".join(lines)
