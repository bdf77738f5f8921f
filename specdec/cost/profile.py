"""Measuring f_T(B, c, n) and f_D(B, c, n), and finding the right table for a model pair.

A measurement fills a fresh `ModelRunner`'s KV cache with `c` random entries per row
(the cost of a forward depends on shapes, not values, so no prefill compute is spent),
then times `warmup + repeats` forwards of `n` new tokens per row under a causal step
mask, rolling back after each, and keeps the median of the timed ones. The runner's
forward is exactly the call the engine makes (4D mask build + model + logits), so the
numbers include the same per-call overhead.

`CostTableResolver` picks the table CAST uses for a target/draft pair: an explicit
profile path, else the profile shipped with the bundled pair. A missing file, or one
measured for other models, device type, GPU or dtype, is replaced by a quick measurement
over a small grid of batch sizes (1, 2, 4, ... up to the largest batch asked for), taken
by `CostTableResolver.prepare` when the decoder is built or a decode session starts,
with a progress bar, never inside a decoding step: a step's batch size that the grid
does not hold is interpolated (`CostTable`). A profile from another CPU model or thread
count is used, with a warning naming both values.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers

from specdec.cost.table import CostTable, FieldDiff, check_cost_profile_path, device_identity, model_identity
from specdec.errors import SpecDecError
from specdec.hostwork import sync_device
from specdec.models.loading import BUNDLED_PAIR, context_length
from specdec.models.runner import ModelRunner
from specdec.paths import cache_root

LOG = logging.getLogger("specdec.cost")

SHIPPED_PROFILE = BUNDLED_PAIR / "cost_profile.json"
"""the bundled pair's profile (made by `specdec profile --out` this path)"""


def batch_grid(max_batch: int) -> tuple[int, ...]:
    """The batch sizes measured to cover batches of up to `max_batch` rows: the powers of two
    below it, and `max_batch` itself (12 -> 1, 2, 4, 8, 12; 16 -> 1, 2, 4, 8, 16)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise SpecDecError(f"max batch size {max_batch!r} must be a positive integer")
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sizes)


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
    passes: int = 1
    """rounds over the whole grid; a point's cost is the median of its rounds' medians. A slow
    period of a shared machine lasts seconds, so it lands in every forward of a point timed at
    once, but in one round of several: on a 2-core AMD EPYC (2026-12-02) a quick profile of the
    bundled pair timed in one round put the target's one-token forward at B = 16 at 36.0 ms
    where eight later timings gave 24.8-30.5 (median 26.6), and CAST, seeing a second token
    verified for free, drafted at every step where plain steps were as fast. Warm-up forwards
    run in the first round only."""
    quick: bool = False
    """a measurement taken because no profile fitted (coarse; extended with larger batch sizes
    before a session that needs them)"""

    def __post_init__(self) -> None:
        for name in ("context_step", "num_contexts", "repeats", "max_repeats", "passes"):
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


def quick_grid(max_batch: int = 1, batch_sizes: Sequence[int] | None = None) -> ProfileGrid:
    """The grid measured when no profile fits: `batch_sizes`, else `batch_grid(max_batch)`;
    2 contexts (256, 512), n up to 96, 3 rounds (`ProfileGrid.passes`) of >= 1 timed forward
    per point (as many forwards as 3 in one round were, spread over the measurement)."""
    return ProfileGrid(
        batch_sizes=tuple(batch_sizes) if batch_sizes is not None else batch_grid(max_batch),
        context_step=256,
        num_contexts=2,
        n_grid=(1, 2, 4, 8, 16, 32, 64, 96),
        warmup=1,
        repeats=1,
        min_time_ms=10.0,
        max_repeats=3,
        passes=3,
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
    Wall time from an idle device to the forward's last kernel done: its launches and its work,
    whichever is longer, as a decoding step pays them. (Until 2026-11-25 a GPU forward was timed
    without waiting for it, so only its launches were measured: the costs of CAST's tables and
    of DynaTree's free width on a GPU came out flat.)

    At least `repeats` timed forwards, more (up to `max_repeats`) until they add up to `min_time_ms`.
    A forward that captured CUDA graphs is not timed (up to 2 a point): a later round of a
    profile (`ProfileGrid.passes`) runs no warm-up, and a cache whose storage is new there would
    capture its graphs inside the first timed forward.
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
    i = captured = 0
    while len(times) < repeats or (sum(times) < min_time_ms and len(times) < max(repeats, max_repeats)):
        captures = runner.graph_captures
        sync_device(dev)  # nothing queued before the clock starts
        t0 = time.perf_counter()
        runner.forward(ids, positions, visibility)
        sync_device(dev)  # a forward only queues its kernels on a GPU (nothing in it reads a device value): wait for them
        elapsed = time.perf_counter() - t0
        runner.rollback()
        if runner.graph_captures != captures and captured < 2:  # a capture, not a replay: not a step's cost
            captured += 1
            continue
        if i >= warmup:
            times.append(elapsed * 1000.0)
        i += 1
    return statistics.median(times)


def profile_models(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    grid: ProfileGrid | None = None,
    progress: Callable[[str], None] | None = None,
    on_point: Callable[[], None] | None = None,
    cuda_graphs: bool = False,
) -> CostTable:
    """Measure f_T and f_D on `grid` (`grid.passes` rounds over it, a point's median over the
    rounds kept); returns a CostTable with its provenance in `meta`.

    progress: gets a line per batch size and model in the last round; on_point: called after
    every grid point of every round (2 * grid.points() * grid.passes calls: target and draft).
    cuda_graphs: measure the forwards as the engine runs them with CUDA graphs (bucketed, replayed)."""
    grid = grid or ProfileGrid()
    generator_dev = next(target.parameters()).device
    generator = torch.Generator(device=generator_dev).manual_seed(0)
    runners = {"target": ModelRunner(target, cuda_graphs=cuda_graphs), "draft": ModelRunner(draft, cuda_graphs=cuda_graphs)}
    # rounds[which][batch][context index][n index]: the point's median in each round
    rounds: dict[str, dict[int, list[list[list[float]]]]] = {
        which: {b: [[[] for _ in grid.n_grid] for _ in range(grid.num_contexts)] for b in grid.batch_sizes} for which in runners
    }
    t_start = time.perf_counter()
    contexts = [(k + 1) * grid.context_step for k in range(grid.num_contexts)]
    with torch.inference_mode():
        for runner in runners.values():  # warm up threads and allocator once before any timing
            _fill_context(runner, grid.batch_sizes[0], contexts[0], generator)
            measure_forward_ms(runner, contexts[0], grid.n_grid[-1], 0, 3, generator)
        for round_ in range(grid.passes):
            warmup = grid.warmup if round_ == 0 else 0  # (later rounds run shapes the first one ran)
            for batch in grid.batch_sizes:
                for which, runner in runners.items():
                    for c, context in enumerate(contexts):
                        _fill_context(runner, batch, context, generator)
                        for i, n in enumerate(grid.n_grid):
                            ms = measure_forward_ms(runner, context, n, warmup, grid.repeats, generator, grid.min_time_ms, grid.max_repeats)
                            rounds[which][batch][c][i].append(ms)
                            if on_point is not None:
                                on_point()
                    if progress is not None and round_ == grid.passes - 1:
                        first = [statistics.median(times) for times in rounds[which][batch][0]]
                        progress(f"{which} B={batch}: {time.perf_counter() - t_start:.0f}s; " + ", ".join(f"n={n} {ms:.1f}ms" for n, ms in zip(grid.n_grid, first, strict=True)))
    tables = {which: {b: [[statistics.median(times) for times in row] for row in per_batch] for b, per_batch in by_batch.items()} for which, by_batch in rounds.items()}
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
        "cuda_graphs": bool(cuda_graphs),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    return CostTable(grid.context_step, grid.num_contexts, list(grid.n_grid), tables["target"], tables["draft"], meta=meta)


def measure_with_progress(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    grid: ProfileGrid,
    description: str = "cost profile",
    enabled: bool = True,
    cuda_graphs: bool = False,
) -> CostTable:
    """`profile_models` under a rich progress bar on stderr (one tick per grid point; the bar
    is removed when done). Without a terminal, or inside another live display, no bar."""
    from rich.errors import LiveError

    from specdec.progress import progress_bar

    bar = progress_bar(enabled, transient=True)
    try:
        bar.start()
    except LiveError:
        return profile_models(target, draft, grid, cuda_graphs=cuda_graphs)
    try:
        task = bar.add_task(description, total=2 * grid.points() * grid.passes)
        return profile_models(target, draft, grid, on_point=lambda: bar.advance(task), cuda_graphs=cuda_graphs)
    finally:
        bar.stop()


_MEASURED: dict[str, CostTable] = {}
"""quick tables measured in this process, by `_fingerprint` of the pair: every resolver of the
same models on the same device, dtype and thread count reuses them instead of measuring again"""


def forget_measured() -> None:
    """Drop the quick tables measured in this process (the next resolver that needs one measures,
    or loads it from the machine's cache, `measured_cache_dir`)."""
    _MEASURED.clear()


def measured_cache_dir() -> Path:
    """Where quick tables measured on this machine are kept for later processes:
    `cache_root()`/cost-profiles (~/.cache/specdec/cost-profiles)."""
    return cache_root() / "cost-profiles"


def _cache_file(key: str) -> Path:
    """The cache file of a `_fingerprint` (models, device, dtype, threads, quick grid)."""
    return measured_cache_dir() / f"quick-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _load_cached(key: str) -> CostTable | None:
    """A quick table an earlier process measured for the same fingerprint, or None."""
    path = _cache_file(key)
    if not path.is_file():
        return None
    try:
        table = CostTable.load(path)
    except (SpecDecError, OSError, ValueError):
        return None
    return table if table.meta.get("fingerprint") == key else None


STALE_RATIO = 1.5
"""a kept quick profile is measured again when a one-token target forward now costs more than this
factor above or below what it holds, at any of its batch sizes (`stale_points`)"""


def stale_points(table: CostTable, target: torch.nn.Module, cuda_graphs: bool = False) -> list[tuple[int, float, float]]:
    """(batch size, kept ms, measured ms) of the target's one-token forward at the table's first
    context, for each batch size the table holds whose kept cost is off by more than `STALE_RATIO`
    from one measured now (a few forwards per batch size: 1.2 s for batch sizes 1-16 on the bundled pair, AMD EPYC CPU).

    A quick profile is kept per machine fingerprint (models, device, dtype, threads) and never
    re-measured, so one taken while something else loaded the machine stays wrong: on the AMD EPYC
    on 2026-11-26 a kept one put B = 4 at 29.5 ms against 13.95 ms measured fresh
    (benchmarks/cpu-epyc-2026-11-26)."""
    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(0)
    runner = ModelRunner(target, cuda_graphs=cuda_graphs)
    context = table.contexts[0]
    stale = []
    with torch.inference_mode():
        for i, batch in enumerate(table.batch_sizes):
            _fill_context(runner, batch, context, generator)
            if i == 0:  # threads and allocator warmed up before the first timing
                measure_forward_ms(runner, context, 1, 0, 2, generator)
            now = measure_forward_ms(runner, context, 1, 1, 3, generator, min_time_ms=30.0, max_repeats=9)
            # the first context row as measured (a lookup at `context` itself would select the next bucket)
            kept = table.target_ms[batch][0][table.n_grid.index(1)] if 1 in table.n_grid else table.target_cost(batch, context - 1, 1)
            if not kept / STALE_RATIO <= now <= kept * STALE_RATIO:
                stale.append((batch, kept, now))
    return stale


def _store_cached(key: str, table: CostTable) -> Path | None:
    """Keep a measured quick table for later processes; None when the cache cannot be written."""
    path = _cache_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace(table, meta={**table.meta, "fingerprint": key}).save(path)
    except OSError as err:
        LOG.warning("could not keep the measured cost profile in %s (%s); set SPECDEC_CACHE_DIR to a writable folder", path.parent, err)
        return None
    return path


def _fingerprint(target: torch.nn.Module, draft: torch.nn.Module, cuda_graphs: bool = False) -> str:
    param = next(target.parameters())
    idents = {which: {k: v for k, v in model_identity(m).items() if k != "path"} for which, m in (("target", target), ("draft", draft))}
    key = {"device": device_identity(param.device), "dtype": str(param.dtype), **idents, "grid": asdict(quick_grid())}
    if cuda_graphs:  # replayed forwards cost what eager ones do not (launches): kept apart
        key["cuda_graphs"] = True
    key["grid"].pop("batch_sizes")
    return json.dumps(key, sort_keys=True, default=str)


def _sizes_text(sizes: Sequence[int]) -> str:
    return f"batch size {sizes[0]}" if len(sizes) == 1 else "batch sizes " + ", ".join(map(str, sizes))


def _same_grid(table: CostTable, grid: ProfileGrid) -> bool:
    return (table.context_step, table.num_contexts, tuple(table.n_grid)) == (grid.context_step, grid.num_contexts, tuple(grid.n_grid))


@dataclass
class ProfileSource:
    """Where the cost table of a resolver came from (for logs and benchmark reports)."""

    kind: str = "none"
    """'file' (a profile given with cost_profile), 'shipped' (the bundled pair's), 'measured'
    (measured in this process before decoding, no profile fitted), 'file+measured' (a quick
    profile from a file, extended here to larger batch sizes), or 'none' (not prepared yet)"""
    path: str | None = None
    """the profile file read or written"""
    created: str | None = None
    """when the table's first measurement was taken (ISO 8601, UTC)"""
    measured_s: float = 0.0
    """seconds this process spent measuring it (before decoding)"""
    reused: bool = False
    """the measurement was taken earlier in this process, for the same models (not repeated)"""
    device: str = ""
    """what it was measured on (device type and name, thread count)"""
    batch_sizes: list[int] = field(default_factory=list)
    saved: bool = False
    """a measured table was written to `path`"""
    cached: str | None = None
    """this machine's cache file (`measured_cache_dir`) the measured table was loaded from or kept in"""
    notes: list[str] = field(default_factory=list)
    """warnings about the table (another CPU model or thread count, batch sizes extrapolated)"""

    def describe(self) -> str:
        """One line, e.g. "measured before the run (12.3 s; batch sizes 1, 2, 4)"."""
        sizes = ", ".join(str(b) for b in self.batch_sizes)
        if self.kind in ("file", "shipped"):
            what = f"{'shipped profile' if self.kind == 'shipped' else 'profile'} {self.path}"
            text = f"{what} (created {self.created or '?'} on {self.device or '?'}; batch sizes {sizes})"
        elif self.kind in ("measured", "file+measured"):
            if self.measured_s == 0 and self.cached and not self.reused:
                took = f"measured by an earlier run on this machine, kept in {self.cached}"
            elif self.reused and self.measured_s == 0:
                took = "reused from an earlier measurement in this process"
            else:
                took = f"{self.measured_s:.1f} s" + (f", kept in {self.cached}" if self.cached else "")
            start = f"quick profile {self.path}, extended before the run" if self.kind == "file+measured" else "measured before the run"
            text = f"{start} ({took}; {self.device}; batch sizes {sizes}"
            text += f"; saved to {self.path})" if self.saved and self.kind == "measured" else ")"
        else:
            text = "not prepared"
        return text + "".join(f"; note: {n}" for n in self.notes)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "text": self.describe()}


def _device_text(meta: dict[str, Any]) -> str:
    dev = meta.get("device") or {}
    text = f"{dev.get('type', '?')} {dev.get('name', '?')!r}"
    if dev.get("type") == "cpu" and dev.get("threads") is not None:
        text += f", {dev['threads']} thread{'' if dev['threads'] == 1 else 's'}"
    return text + f", {meta.get('dtype', '?')}"


def profile_command(target: torch.nn.Module, draft: torch.nn.Module) -> str:
    """The `specdec profile` command that measures a full profile of these models as loaded."""
    param = next(target.parameters())
    parts = ["specdec profile"]
    paths = [model_identity(m)["path"] for m in (target, draft)]
    bundled = all(p and Path(p).resolve().parent == BUNDLED_PAIR.resolve() for p in paths)
    if not bundled:
        parts += [f"--target {paths[0] or 'TARGET'}", f"--draft {paths[1] or 'DRAFT'}"]
    if param.device.type != "cpu":
        parts.append(f"--device {param.device.type}")
    dtype = str(param.dtype).removeprefix("torch.")
    if dtype != "float32" or param.device.type != "cpu":
        parts.append(f"--dtype {dtype}")
    return " ".join(parts + ["--out FILE"])


def advice(diffs: Sequence[FieldDiff], target: torch.nn.Module, draft: torch.nn.Module) -> str:
    """What to do about `diffs`: the command that re-measures a full profile for these models,
    and the flag that would make the models match the profile instead, where one exists."""
    text = f"to measure a full profile for these models run `{profile_command(target, draft)}` and pass --cost-profile FILE (cost_profile=FILE)"
    for d in diffs:
        if d.field == "dtype" and d.profile:
            text += f"; or load the models in {d.profile} (--dtype {d.profile}) to use this profile"
        elif d.field == "device type" and d.profile:
            text += f"; or run on {d.profile} (--device {d.profile}) to use this profile"
        elif d.field == "torch threads" and d.profile:
            text += f"; or run with {d.profile} torch threads (OMP_NUM_THREADS={d.profile} or torch.set_num_threads({d.profile})) to match it"
    return text


_WARNED: set[tuple[str, str]] = set()
"""(profile path, fingerprint) pairs whose other-machine warning was logged (once per process)"""


@dataclass
class CostTableResolver:
    """The cost table of one target/draft pair, loaded or measured before decoding.

    Order: `path` (an explicit profile) else the shipped bundled-pair profile. A file that
    is missing or was measured for other models, device type, GPU or dtype is replaced by a
    quick measurement (`quick_grid`), announced with a warning that names every differing
    field with both values (the shipped profile is skipped without one when the models are not
    the bundled pair: measuring is then the normal path); a file from another CPU model or
    thread count is used, with a warning. `prepare(max_batch)` does all of this, and extends a measured table to batch
    sizes up to `max_batch` (`batch_grid`); `table_for` only looks up and never measures:
    a batch size between or beyond the measured ones is interpolated. A measured table is
    written back when `path` was given (never over a full profile or one of other models).
    """

    target: torch.nn.Module
    draft: torch.nn.Module
    path: str | None = None
    progress: bool = True
    """show a progress bar while measuring"""
    cuda_graphs: bool | None = None
    """measure forwards as decoding runs them: replayed CUDA graphs (True) or eagerly (False); None:
    as decoding does by default (`resolve_cuda_graphs('auto', ...)`: graphs on one CUDA device).
    On a GPU an eager forward waits on its kernel launches, so it looks flat for more tokens
    than a replayed one costs: a free width or tree shape read from it would be too wide"""
    _table: CostTable | None = field(default=None, init=False, repr=False)
    _extendable: bool = field(default=False, init=False, repr=False)
    _source: ProfileSource = field(default_factory=ProfileSource, init=False, repr=False)
    _noted_beyond: int = field(default=0, init=False, repr=False)

    @property
    def source(self) -> ProfileSource:
        """Where the table came from (kind 'none' before `prepare`)."""
        return self._source

    @property
    def table(self) -> CostTable | None:
        """The table, once prepared."""
        return self._table

    def prepare(self, max_batch: int = 1, progress: bool | None = None) -> CostTable:
        """Load or measure the table so that it covers batches of up to `max_batch` rows. Call
        it before decoding (SpeculativeDecoder does when it is built, and every decode session
        at its start with its largest batch). All measuring happens here."""
        show = self.progress if progress is None else progress
        grid = batch_grid(max_batch)
        if self._table is None:
            self._table = self._load()
            if self._table is None:
                self._table = self._measure(grid, show, announce=True)
                self._extendable = True
                self._source.kind = "measured"
                self._source.path = self.path
                self._save()
                self._finish_source()
                return self._table
        covered = self._table.batch_sizes
        if max_batch <= covered[-1]:
            return self._table
        if self._extendable:
            missing = tuple(b for b in grid if b not in covered)
            LOG.warning(
                "measuring forward costs for %s before decoding (the cost table holds %s; a session may run %d rows)",
                _sizes_text(missing),
                _sizes_text(covered),
                max_batch,
            )
            self._table = self._table.merged(self._measure(missing, show))
            if self._source.kind == "file":
                self._source.kind = "file+measured"
            self._save()
        elif max_batch > self._noted_beyond:
            self._noted_beyond = max_batch
            note = (
                f"the profile holds batch sizes up to {covered[-1]}; costs at up to {max_batch} rows are extrapolated from its last two "
                f"(measure them with `specdec profile --batch-sizes {','.join(map(str, batch_grid(max_batch)))} --out FILE`)"
            )
            LOG.warning("cost profile: %s", note)
            self._source.notes.append(note)
        self._finish_source()
        return self._table

    def table_for(self, batch: int) -> CostTable:
        """The table for a batch of `batch` rows. Never measures: batch sizes the table does not
        hold are interpolated (or extrapolated) by its lookups; `prepare` must have run."""
        if self._table is None:
            raise SpecDecError(
                "the cost table was not prepared before decoding; call CostTableResolver.prepare(max_batch) "
                "(SpeculativeDecoder and every decode session do this)"
            )
        return self._table

    # ----- loading, measuring, saving ------------------------------------------------------
    def _load(self) -> CostTable | None:
        source = Path(self.path).expanduser() if self.path else SHIPPED_PROFILE
        if self.path is not None:
            check_cost_profile_path(self.path)
        if not source.is_file():
            if self.path is not None:
                LOG.warning("cost profile %s does not exist", source)
            return None
        table = CostTable.load(source)
        diffs = table.differences(self.target, self.draft)
        blocking = [d for d in diffs if d.blocking]
        shipped = " (the shipped profile of the bundled pair)" if self.path is None else ""
        if blocking and self.path is None and any(d.about_models for d in blocking):
            # no profile was asked for and the shipped one is the bundled pair's: these are other
            # models, so the quick measurement `prepare` announces next is the normal path, not a mismatch
            LOG.debug("the shipped cost profile is for the bundled pair, not these models (%s)", "; ".join(map(str, blocking)))
            return None
        if blocking:
            also = [d for d in diffs if not d.blocking]
            LOG.warning(
                "cost profile %s%s does not fit these models (%s)%s; measuring a quick one before decoding instead; %s",
                source,
                shipped,
                "; ".join(map(str, blocking)),
                f"; it was also measured on another machine ({'; '.join(map(str, also))})" if also else "",
                advice(blocking, self.target, self.draft),
            )
            return None
        self._extendable = bool(table.meta.get("grid", {}).get("quick", False)) and _same_grid(table, quick_grid())
        self._source = ProfileSource(
            kind="file" if self.path is not None else "shipped", path=str(source), created=table.meta.get("created"),
            device=_device_text(table.meta), batch_sizes=list(table.batch_sizes),
        )
        if diffs and self.path is None:  # the shipped profile, measured on another CPU: this machine's own, measured once and cached
            LOG.warning(
                "the shipped cost profile of the bundled pair was measured on another machine (%s); using this machine's own "
                "quick profile instead (measured once before decoding, then kept in %s for later runs)",
                "; ".join(map(str, diffs)),
                measured_cache_dir(),
            )
            self._source = ProfileSource()
            return None
        if diffs:
            note = (
                f"timings measured on another machine ({'; '.join(map(str, diffs))}); used, since the models, device type and dtype "
                f"match, but tree shapes follow that machine's costs; {advice(diffs, self.target, self.draft)}"
            )
            self._source.notes.append(note)
            key = (str(source), _fingerprint(self.target, self.draft, self._graphs()))
            if key not in _WARNED:
                _WARNED.add(key)
                LOG.warning("cost profile %s%s: %s", source, shipped, note)
        measured_graphs, graphs = bool(table.meta.get("cuda_graphs", False)), self._graphs()
        if measured_graphs != graphs:  # eager forwards on a GPU wait on their launches: they look flat for longer
            mode = "on" if graphs else "off"
            note = (
                f"measured with CUDA graphs {'on' if measured_graphs else 'off'}, and decoding runs with them {mode}: used, but its costs "
                f"are not the ones decoding pays; measure one as decoding runs with `specdec profile --cuda-graphs {mode} --out FILE`"
            )
            self._source.notes.append(note)
            LOG.warning("cost profile %s%s: %s", source, shipped, note)
        return table

    def _measure(self, batch_sizes: Sequence[int], show: bool, announce: bool = False) -> CostTable:
        """A quick table holding (at least) `batch_sizes`, reusing what this process measured or
        an earlier one kept in this machine's cache (`measured_cache_dir`). announce: log the
        measurement (if one is needed) before taking it."""
        key = _fingerprint(self.target, self.draft, self._graphs())
        have = _MEASURED.get(key)
        from_disk = have is None and (have := _load_cached(key)) is not None  # measured by an earlier process on this machine
        if from_disk and have is not None and (stale := stale_points(have, self.target, self._graphs())):
            LOG.warning(
                "the cost profile kept in %s no longer matches this machine (target one-token forward %s); measuring it again",
                _cache_file(key),
                "; ".join(f"B = {b}: kept {k:.2f} ms, now {n:.2f} ms" for b, k, n in stale),
            )
            self._source.notes.append(f"a kept quick profile was measured again: it was off by more than {STALE_RATIO}x at batch sizes {[b for b, _, _ in stale]}")
            have, from_disk = None, False
        if from_disk:
            assert have is not None
            _MEASURED[key] = have
            self._source.cached = str(_cache_file(key))
        todo = [b for b in batch_sizes if have is None or b not in have.batch_sizes]
        if todo and announce:
            LOG.warning(
                "measuring a quick cost profile for %s before decoding (seconds to a few minutes; kept for later runs); "
                "`specdec profile --out FILE` and --cost-profile FILE give a full one",
                _sizes_text(todo),
            )
        if todo:
            t0 = time.perf_counter()
            new = measure_with_progress(
                self.target,
                self.draft,
                quick_grid(batch_sizes=todo),
                f"cost profile (batch sizes {', '.join(map(str, todo))})",
                show,
                cuda_graphs=self._graphs(),
            )
            self._source.measured_s += time.perf_counter() - t0
            have = new if have is None else have.merged(new)
            _MEASURED[key] = have
            stored = _store_cached(key, have)
            if stored is not None:
                self._source.cached = str(stored)
        elif not from_disk:
            self._source.reused = True
        assert have is not None
        if self._source.created is None:
            self._source.created = have.meta.get("created")
        if not self._source.device:
            self._source.device = _device_text(have.meta)
        return have

    def _graphs(self) -> bool:
        """Whether forwards are measured as replayed CUDA graphs (`cuda_graphs`, resolved)."""
        if self.cuda_graphs is None:
            from specdec.models.graphs import resolve_cuda_graphs

            self.cuda_graphs = resolve_cuda_graphs("auto", next(self.target.parameters()).device)
        return self.cuda_graphs

    def _finish_source(self) -> None:
        if self._table is not None:
            self._source.batch_sizes = self._table.batch_sizes

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
        self._source.saved = True
        LOG.warning("cost profile saved to %s", path)


def bound_resolver(target: torch.nn.Module, draft: torch.nn.Module, cost_profile: str | None, resolver: CostTableResolver | None = None) -> CostTableResolver:
    """The resolver a cost-aware policy binds to: `resolver` (a decoder's, shared by every policy
    over the pair) when it is for these models and this profile, else a new one; prepared for
    batch 1 now, so a measurement, when no profile fits, happens before any generation is timed."""
    if resolver is not None and (resolver.target is not target or resolver.draft is not draft or resolver.path != cost_profile):
        raise ValueError("bind_models: the shared resolver is for other models or another cost profile")
    bound = resolver or CostTableResolver(target, draft, cost_profile)
    bound.prepare(1)
    return bound


def describe(table: CostTable, batch_sizes: Sequence[int] | None = None) -> str:
    """A short text summary: per batch size, target and draft ms at the smallest context."""
    lines = [f"contexts {table.contexts}, n grid {table.n_grid}"]
    for b in batch_sizes or table.batch_sizes:
        t = ", ".join(f"{n}:{ms:.1f}" for n, ms in zip(table.n_grid, table.target_ms[b][0], strict=True))
        d = ", ".join(f"{n}:{ms:.1f}" for n, ms in zip(table.n_grid, table.draft_ms[b][0], strict=True))
        lines.append(f"B={b} target ms [n:ms] {t}\n     draft  ms [n:ms] {d}")
    return "\n".join(lines)
