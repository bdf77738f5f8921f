"""CostTable: measured forward latencies f_T(B, c, n) and f_D(B, c, n) as lookup tables.

CAST (Hong, Tan and Hu) keeps, for every batch size B, two tables
S_T(B) = {f_T(B, c, n)} and S_D(B) = {f_D(B, c, n)}: the latency of one target (draft)
forward over `n` new tokens per row, for a batch of `B` rows whose caches hold `c`
tokens. Contexts are bucketed to multiples of L (c = kL, k = 1..M) by `select`; new-token
counts are measured on a sparse grid (e.g. 1, 2, 4, ..., 128) and linearly interpolated.

Batch sizes are measured on a small grid (e.g. 1, 2, 4, 8, ..., the largest batch) and
looked up per (context bucket, n grid point) column: a batch size between two profiled ones
is interpolated linearly in B; below the smallest the smallest is used; above the largest
the last two grid points are extrapolated linearly (slope >= 0: never below the largest's
cost). Costs are made non-decreasing in `n` when a table is built (a longer forward cannot
be cheaper; measured dips are noise; isotonic regression, `specdec.isotonic`), which CAST's
selection rule needs, and non-decreasing in B at lookup (a running maximum over the batch
grid, which keeps them non-decreasing in `n` too), so every lookup is monotone in both.

The JSON file (`CostTable.save` / `CostTable.load`) also records what the numbers were
measured on: device, dtype, torch/transformers versions and each model's identity
(model type, shape, config hash, parameter count, path). `CostTable.differences` compares
them field by field with the models at hand and names each field that differs with both
values, so a profile measured elsewhere is never applied silently.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import numbers
import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.cpu_blas import mkl_mode
from specdec.errors import SpecDecError
from specdec.isotonic import isotonic
from specdec.paths import folder_write_problem

FORMAT = "specdec-cost-profile"
VERSION = 1

_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "architectures",
        "id2label",
        "label2id",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
    }
)
"""config entries that do not change a model's cost (left out of the config hash)"""


def check_cost_profile_path(path: str) -> None:
    """A cost profile path (cost_profile=, --cost-profile): a JSON file that exists, or that a
    measured table may be written to; a SpecDecError for an empty one, a directory, or a new file
    whose folder cannot be made or written to (`folder_write_problem`, before anything is measured)."""
    if not path.strip():
        raise SpecDecError("cost_profile (--cost-profile) is empty; give a JSON file path from `specdec profile`, or leave it out")
    file = Path(path).expanduser()
    if file.is_dir():
        raise SpecDecError(
            f"cost profile {path!r} (--cost-profile) is a directory; give a JSON file path, e.g. {Path(path) / 'cost_profile.json'} (`specdec profile --out FILE` writes one)"
        )
    problem = None if file.exists() else folder_write_problem(file.parent)  # (`save` makes missing folders)
    if problem is not None:
        raise SpecDecError(
            f"cost profile {path!r} (--cost-profile) does not exist, and a measured one could not be saved there ({problem}); "
            "give an existing profile, or a path in a folder you can write to"
        )


def select_context(c: int, step: int, buckets: int) -> int:
    """CAST's select(c) = (min(floor(c / L), M - 1) + 1) * L: the context bucket of `c`.

    Rounds up to the next multiple of L (an exact multiple goes to the next one: c = L -> 2L,
    a conservative choice that the formula implies) and caps at M * L. The paper prints
    `max` where `min` is meant: with `max` every context would map to at least M * L.
    Example (L=256, M=4): 0 -> 256, 255 -> 256, 256 -> 512, 700 -> 768, 5000 -> 1024.
    """
    return (min(max(int(c), 0) // step, buckets - 1) + 1) * step


SHAPE_FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hidden_size": ("hidden size", ("hidden_size", "n_embd", "d_model")),
    "num_layers": ("layers", ("num_hidden_layers", "n_layer", "num_layers")),
    "num_heads": ("attention heads", ("num_attention_heads", "n_head")),
    "num_kv_heads": ("key/value heads", ("num_key_value_heads",)),
    "intermediate_size": ("intermediate size", ("intermediate_size", "n_inner", "ffn_dim")),
    "vocab_size": ("vocabulary size", ("vocab_size",)),
}
"""the shape entries of a model identity: key -> (label in messages, config attributes tried in order)"""


def model_shape(model: torch.nn.Module) -> dict[str, int]:
    """The cost-relevant shape of a model's (text) config: hidden size, layers, heads,
    key/value heads, intermediate size, vocabulary size (the entries its config has)."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shape: dict[str, int] = {}
    for key, (_, names) in SHAPE_FIELDS.items():
        for name in names:
            value = getattr(text, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                shape[key] = value
                break
    return shape


def model_identity(model: torch.nn.Module) -> dict[str, Any]:
    """What a cost profile is tied to: model type, shape (`model_shape`), a hash of the
    cost-relevant config, the parameter count, and the folder it was loaded from (informational)."""
    config = getattr(model, "config", None)
    cfg = config.to_dict() if config is not None else {}
    stable = {k: v for k, v in cfg.items() if k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {
        "path": str(getattr(model, "name_or_path", "") or cfg.get("_name_or_path", "")),
        "model_type": str(cfg.get("model_type", type(model).__name__)),
        "shape": model_shape(model),
        "config_hash": digest,
        "params": int(sum(p.numel() for p in model.parameters())),
    }


def device_identity(device: torch.device) -> dict[str, Any]:
    """Device type and name (the GPU's name, or the CPU model) plus the thread count; on a CPU
    also MKL's numerical mode (`specdec.cpu_blas`: it changes small products' speed)."""
    if device.type == "cuda":
        return {"type": device.type, "name": torch.cuda.get_device_name(device), "threads": torch.get_num_threads()}
    return {"type": device.type, "name": _cpu_name(), "threads": torch.get_num_threads(), "mkl_cbwr": mkl_mode()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


@dataclass(frozen=True)
class FieldDiff:
    """One field in which a cost profile's provenance differs from the models at hand."""

    field: str
    """what differs, e.g. 'CPU model', 'dtype', 'target hidden size'"""
    profile: Any
    """the profile's value (None: not recorded)"""
    here: Any
    """the value for the models at hand"""
    blocking: bool
    """True: the profile's timings do not describe these models (it is not used); False: they
    come from another machine of the same kind (used, with a warning)"""

    @property
    def about_models(self) -> bool:
        """The difference is in the target or draft model itself (type, shape, parameters, config),
        not in the device, dtype or machine (`CostTable.differences` names those fields so)."""
        return self.field.startswith(("target ", "draft "))

    def __str__(self) -> str:
        return f"{self.field}: profile {_show(self.profile)}, here {_show(self.here)}"


def _show(value: Any) -> str:
    if value is None:
        return "(not recorded)"
    return repr(value) if isinstance(value, str) else str(value)


@dataclass
class CostTable:
    """Forward latencies in milliseconds, indexed [batch size][context bucket][n grid point].

    target_ms[B][k][j] = f_T(B, (k + 1) * context_step, n_grid[j]); draft_ms likewise.
    `meta` holds the provenance (device, dtype, versions, model identities, grid settings).
    """

    context_step: int
    """L: context buckets are L, 2L, ..., M*L tokens"""
    num_contexts: int
    """M: number of context buckets"""
    n_grid: list[int]
    """new-token counts measured (strictly increasing, >= 1); others are interpolated"""
    target_ms: dict[int, list[list[float]]]
    """batch size -> [M][len(n_grid)] target forward latency (ms)"""
    draft_ms: dict[int, list[list[float]]]
    """batch size -> [M][len(n_grid)] draft forward latency (ms)"""
    meta: dict[str, Any] = field(default_factory=dict)
    _cache: dict[tuple[str, int, int], list[float]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _mono: dict[str, dict[int, list[list[float]]]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.context_step, int) or self.context_step < 1:
            raise SpecDecError(f"cost table context_step L={self.context_step!r} must be a positive integer")
        if not isinstance(self.num_contexts, int) or self.num_contexts < 1:
            raise SpecDecError(f"cost table num_contexts M={self.num_contexts!r} must be a positive integer")
        if isinstance(self.n_grid, (str, bytes)) or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in self.n_grid):
            raise SpecDecError(f"cost table n grid {self.n_grid!r} must be a list of integers (new tokens per row), e.g. [1, 2, 4, 8]")
        grid = [int(n) for n in self.n_grid]
        if not grid or grid[0] < 1 or any(b <= a for a, b in zip(grid, grid[1:], strict=False)):
            raise SpecDecError(f"cost table n grid {self.n_grid!r} must be strictly increasing positive integers, e.g. 1,2,4,8")
        self.n_grid = grid
        if not self.target_ms or set(self.target_ms) != set(self.draft_ms):
            raise SpecDecError(
                f"cost table needs the same batch sizes for target and draft (target {sorted(self.target_ms)}, draft {sorted(self.draft_ms)})"
            )
        bad = [b for b in self.target_ms if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1]
        if bad:
            raise SpecDecError(f"cost table batch size {bad[0]!r} must be a positive integer (rows per forward); re-run `specdec profile`")
        self.target_ms = {int(b): self._checked(rows, "target", int(b)) for b, rows in self.target_ms.items()}
        self.draft_ms = {int(b): self._checked(rows, "draft", int(b)) for b, rows in self.draft_ms.items()}

    def _checked(self, rows: Sequence[Sequence[float]], which: str, batch: int) -> list[list[float]]:
        if len(rows) != self.num_contexts or any(len(r) != len(self.n_grid) for r in rows):
            raise SpecDecError(
                f"cost table {which} entry for batch {batch} must be {self.num_contexts} contexts x {len(self.n_grid)} n values; "
                "re-run `specdec profile`"
            )
        odd = [v for r in rows for v in r if isinstance(v, bool) or not isinstance(v, numbers.Real)]
        if odd:
            raise SpecDecError(
                f"cost table {which} entry for batch {batch} holds {odd[0]!r}, not a number of milliseconds; "
                "write numbers (12.5, not \"12.5\"), or re-run `specdec profile`"
            )
        # the closest non-decreasing rows in least squares: unlike a running maximum, one slow
        # outlier is averaged with its neighbours instead of lifting every later point
        out = [isotonic(r) for r in rows]
        if any(not math.isfinite(v) or v < 0 for r in out for v in r):
            raise SpecDecError(
                f"cost table {which} entry for batch {batch} holds a negative or non-finite latency; re-run `specdec profile`"
            )
        return out

    # ----- lookups -------------------------------------------------------------------------
    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self.target_ms)

    @property
    def contexts(self) -> list[int]:
        """The context buckets L, 2L, ..., M*L."""
        return [(k + 1) * self.context_step for k in range(self.num_contexts)]

    def select(self, c: int) -> int:
        """The context bucket of `c` (see `select_context`)."""
        return select_context(c, self.context_step, self.num_contexts)

    def target_cost(self, batch: int, ctx: int, n: float) -> float:
        """f_T(B, select(ctx), n) in ms; 0 for n <= 0."""
        return self._cost("target", batch, ctx, n)

    def draft_cost(self, batch: int, ctx: int, n: float) -> float:
        """f_D(B, select(ctx), n) in ms; 0 for n <= 0."""
        return self._cost("draft", batch, ctx, n)

    def target_costs(self, batch: int, ctx: int, n_max: int) -> list[float]:
        """[f_T(B, select(ctx), n) for n = 0..n_max] (index n; entry 0 is 0)."""
        return self._costs("target", batch, ctx, n_max)

    def draft_costs(self, batch: int, ctx: int, n_max: int) -> list[float]:
        """[f_D(B, select(ctx), n) for n = 0..n_max] (index n; entry 0 is 0)."""
        return self._costs("draft", batch, ctx, n_max)

    def _costs(self, which: str, batch: int, ctx: int, n_max: int) -> list[float]:
        key = (which, int(batch), self.select(ctx))
        cached = self._cache.get(key)
        if cached is None or len(cached) <= n_max:
            grid_ms = self._batch_row(which, int(batch), key[2])
            cached = [0.0] + [_interp(self.n_grid, grid_ms, n) for n in range(1, max(n_max, self.n_grid[-1]) + 1)]
            self._cache[key] = cached
        return cached[: n_max + 1]

    def _cost(self, which: str, batch: int, ctx: int, n: float) -> float:
        if n <= 0:
            return 0.0
        return _interp(self.n_grid, self._batch_row(which, int(batch), self.select(ctx)), float(n))

    def _batch_row(self, which: str, batch: int, bucket: int) -> list[float]:
        """Latencies over the n grid for `batch` rows at context bucket `bucket`: per column,
        linear in B between grid batch sizes, the smallest's below them, extrapolated from the
        last two past them (slope >= 0); from costs made non-decreasing in B (`_monotone`)."""
        if batch < 1:
            raise SpecDecError(f"batch size {batch} must be >= 1")
        table = self._monotone(which)
        k = bucket // self.context_step - 1
        sizes = self.batch_sizes
        if batch in table:
            return table[batch][k]
        if batch < sizes[0] or len(sizes) == 1:
            return table[sizes[0] if batch < sizes[0] else sizes[-1]][k]
        if batch > sizes[-1]:
            b0, b1 = sizes[-2], sizes[-1]
            row0, row1 = table[b0][k], table[b1][k]
            return [y1 + max(0.0, y1 - y0) * (batch - b1) / (b1 - b0) for y0, y1 in zip(row0, row1, strict=True)]
        i = bisect.bisect_left(sizes, batch)
        b0, b1 = sizes[i - 1], sizes[i]
        w = (batch - b0) / (b1 - b0)
        return [(1 - w) * y0 + w * y1 for y0, y1 in zip(table[b0][k], table[b1][k], strict=True)]

    def _monotone(self, which: str) -> dict[int, list[list[float]]]:
        """The table made non-decreasing in the batch size: each entry is the running maximum
        over the batch grid up to its batch size (more rows never cost less; a dip is noise).
        A maximum of rows non-decreasing in n stays non-decreasing in n."""
        cached = self._mono.get(which)
        if cached is not None:
            return cached
        table = self.target_ms if which == "target" else self.draft_ms
        out: dict[int, list[list[float]]] = {}
        prev: list[list[float]] | None = None
        for b in self.batch_sizes:
            rows = table[b] if prev is None else [[max(x, y) for x, y in zip(r, p, strict=True)] for r, p in zip(table[b], prev, strict=True)]
            out[b] = rows
            prev = rows
        self._mono[which] = out
        return out

    # ----- building, merging, I/O ----------------------------------------------------------
    @classmethod
    def synthetic(
        cls,
        target: Callable[[int, int, int], float],
        draft: Callable[[int, int, int], float],
        batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
        context_step: int = 256,
        num_contexts: int = 4,
        n_grid: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
    ) -> CostTable:
        """A table from cost functions f(B, c, n) -> ms (tests, what-if studies)."""
        for name, fn in (("target", target), ("draft", draft)):
            if not callable(fn):
                raise SpecDecError(f"CostTable.synthetic {name}={fn!r} must be a function f(batch, context, n) -> milliseconds")
        for name, sizes in (("batch_sizes", batch_sizes), ("n_grid", n_grid)):
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
                raise SpecDecError(f"CostTable.synthetic {name}={sizes!r} must be a list of integers, e.g. [1, 2, 4, 8]")

        def ms(fn: Callable[[int, int, int], float], name: str, b: int, c: int, n: int) -> float:
            value = fn(b, c, n)
            try:
                return float(value)
            except (TypeError, ValueError):
                raise SpecDecError(f"CostTable.synthetic {name}({b}, {c}, {n}) returned {value!r}, not a number of milliseconds") from None

        ctxs = [(k + 1) * context_step for k in range(num_contexts)] if isinstance(context_step, int) and isinstance(num_contexts, int) else []  # (else refused below)
        return cls(
            context_step=context_step,
            num_contexts=num_contexts,
            n_grid=list(n_grid),
            target_ms={b: [[ms(target, "target", b, c, n) for n in n_grid] for c in ctxs] for b in batch_sizes},
            draft_ms={b: [[ms(draft, "draft", b, c, n) for n in n_grid] for c in ctxs] for b in batch_sizes},
            meta={"synthetic": True},
        )

    def merged(self, other: CostTable) -> CostTable:
        """This table plus the batch sizes of `other` (same grid; `other` wins on overlap)."""
        if (other.context_step, other.num_contexts, other.n_grid) != (self.context_step, self.num_contexts, self.n_grid):
            raise SpecDecError("cannot merge cost tables measured on different grids (L, M or n grid differ)")
        meta = dict(self.meta)
        if isinstance(meta.get("grid"), dict):
            meta["grid"] = {**meta["grid"], "batch_sizes": sorted(set(self.batch_sizes) | set(other.batch_sizes))}
        if "seconds" in meta and "seconds" in other.meta:
            meta["seconds"] = round(float(meta["seconds"]) + float(other.meta["seconds"]), 1)
        return CostTable(
            context_step=self.context_step,
            num_contexts=self.num_contexts,
            n_grid=list(self.n_grid),
            target_ms={**self.target_ms, **other.target_ms},
            draft_ms={**self.draft_ms, **other.draft_ms},
            meta=meta,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            **self.meta,
            "context_step": self.context_step,
            "num_contexts": self.num_contexts,
            "contexts": self.contexts,
            "n_grid": self.n_grid,
            "batch_sizes": self.batch_sizes,
            "units": "ms per forward; [batch][context bucket][n grid point]",
            "target_ms": {str(b): self.target_ms[b] for b in self.batch_sizes},
            "draft_ms": {str(b): self.draft_ms[b] for b in self.batch_sizes},
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "cost profile") -> CostTable:
        if not isinstance(data, Mapping):
            raise SpecDecError(f"{source} holds a JSON {type(data).__name__}, not a specdec cost profile (a JSON object); create one with `specdec profile`")
        if data.get("format") != FORMAT:
            raise SpecDecError(f"{source} is not a specdec cost profile (no 'format': '{FORMAT}'); create one with `specdec profile`")
        if data.get("version") != VERSION:
            raise SpecDecError(
                f"{source} has version {data.get('version')!r}, this specdec reads version {VERSION}; re-run `specdec profile`"
            )
        try:
            reserved = {
                "format",
                "version",
                "context_step",
                "num_contexts",
                "contexts",
                "n_grid",
                "batch_sizes",
                "units",
                "target_ms",
                "draft_ms",
            }
            return cls(
                context_step=int(data["context_step"]),
                num_contexts=int(data["num_contexts"]),
                n_grid=[int(n) for n in data["n_grid"]],
                target_ms={int(b): rows for b, rows in data["target_ms"].items()},
                draft_ms={int(b): rows for b, rows in data["draft_ms"].items()},
                meta={k: v for k, v in data.items() if k not in reserved},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            if isinstance(err, SpecDecError):
                raise
            raise SpecDecError(f"{source} is malformed ({type(err).__name__}: {err}); re-run `specdec profile`") from err

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        if not isinstance(path, (str, Path)):
            raise SpecDecError(f"cost profile path={path!r} must be a file path (str or Path) of a JSON file from `specdec profile`")
        path = Path(path)
        check_cost_profile_path(str(path))
        if not path.is_file():
            raise SpecDecError(f"cost profile {str(path)!r} does not exist; create it with `specdec profile --out {path}`")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SpecDecError(f"cost profile {str(path)!r} is not readable JSON ({err}); re-run `specdec profile --out {path}`") from err
        return cls.from_json(data, source=f"cost profile {str(path)!r}")

    def differences(self, target: torch.nn.Module | None, draft: torch.nn.Module | None) -> list[FieldDiff]:
        """Every provenance field in which this table differs from these models on their
        device and dtype, field by field, with both values.

        Blocking (the timings do not describe these models): device type, GPU name, dtype,
        and per model its type, each shape entry (hidden size, layers, heads, intermediate
        and vocabulary size), parameter count and, when nothing more specific differs, the
        rest of its config (hash). Not blocking (same kind of machine, other timings): the
        CPU model and the torch thread count. Paths and versions are informational only.
        """
        diffs: list[FieldDiff] = []
        probe = target if target is not None else draft
        if probe is not None:
            param = next(probe.parameters())
            dev = device_identity(param.device)
            have = self.meta.get("device", {})
            if have.get("type") != dev["type"]:
                diffs.append(FieldDiff("device type", have.get("type"), dev["type"], True))
            elif have.get("name") != dev["name"]:
                gpu = dev["type"] != "cpu"
                diffs.append(FieldDiff("GPU" if gpu else "CPU model", have.get("name"), dev["name"], gpu))
            if dev["type"] == "cpu" and have.get("type") == "cpu" and have.get("threads") != dev["threads"]:
                diffs.append(FieldDiff("torch threads", have.get("threads"), dev["threads"], False))
            if dev["type"] == "cpu" and have.get("type") == "cpu" and have.get("mkl_cbwr", "default") != dev["mkl_cbwr"]:
                diffs.append(FieldDiff("MKL_CBWR", have.get("mkl_cbwr", "default"), dev["mkl_cbwr"], False))
            dtype = str(param.dtype).removeprefix("torch.")
            if self.meta.get("dtype") != dtype:
                diffs.append(FieldDiff("dtype", self.meta.get("dtype"), dtype, True))
        for which, model in (("target", target), ("draft", draft)):
            if model is None:
                continue
            ident = model_identity(model)
            have = self.meta.get(which, {})
            found: list[FieldDiff] = []
            if have.get("model_type") != ident["model_type"]:
                found.append(FieldDiff(f"{which} model type", have.get("model_type"), ident["model_type"], True))
            recorded = have.get("shape") or {}
            for key, (label, _) in SHAPE_FIELDS.items():
                if key in recorded and key in ident["shape"] and recorded[key] != ident["shape"][key]:
                    found.append(FieldDiff(f"{which} {label}", recorded[key], ident["shape"][key], True))
            if have.get("params") != ident["params"]:
                found.append(FieldDiff(f"{which} parameters", have.get("params"), ident["params"], True))
            if not found and have.get("config_hash") != ident["config_hash"]:
                found.append(FieldDiff(f"{which} config (other entries; hash)", have.get("config_hash"), ident["config_hash"], True))
            diffs.extend(found)
        return diffs

    def mismatch(self, target: torch.nn.Module | None, draft: torch.nn.Module | None) -> str | None:
        """Why this table does not describe these models on their device and dtype (None if it
        does): the blocking `differences`, each as 'field: profile X, here Y', joined by '; '."""
        blocking = [str(d) for d in self.differences(target, draft) if d.blocking]
        return "; ".join(blocking) or None


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation of ys over increasing xs; linear extrapolation past the
    last point (from the last two); the first value below the first point (small forwards
    are dominated by fixed per-call overhead)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (x - xs[-1])
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def check_cost_options(cost_table: object, cost_profile: object, owner: str | None = None) -> None:
    """A policy's cost options (CAST's, DynaTree's): a `CostTable` or None, a profile path or
    None, not both; `owner` (e.g. "dynatree") names the policy in the messages."""
    prefix = f"{owner} " if owner else ""
    if cost_table is not None and not isinstance(cost_table, CostTable):
        raise SpecDecError(f"{prefix}cost_table must be a specdec.cost.CostTable, got {type(cost_table).__name__}; pass a file path as cost_profile")
    if cost_profile is not None and not isinstance(cost_profile, str):
        raise SpecDecError(f"{prefix}cost_profile={cost_profile!r} must be a file path (a string); fix --cost-profile")
    if cost_profile is not None:
        check_cost_profile_path(cost_profile)
    if cost_table is not None and cost_profile is not None:
        raise SpecDecError(f"{owner + ': ' if owner else ''}give either cost_table or cost_profile, not both")
