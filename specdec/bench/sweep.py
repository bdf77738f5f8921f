"""`specdec sweep`: the DynaTree paper's grid over tree depth D, branching B and pruning threshold τ.

Every grid point is the `dynatree` policy with
    phase (default 0, the fixed tree), d0 = D, b_mid = B, prune_tau = τ, max_nodes,
    d_max = max(D, 8), b_min = 1, b_max = max(B, 3)
(phase 0 uses only d0, b_mid, prune_tau and max_nodes: a full B-ary tree of depth D whose
children with path probability below τ are dropped, at most max_nodes draft tokens; the
other bounds only matter for phases 1-3). All points and the AR baseline run in one
`specdec.bench.runner.run_bench` call: models loaded once, one warm-up each, method order
shuffled per prompt and repeat, greedy decoding (temperature 0). The speedup of a point is
its median tokens/s over AR's median tokens/s from the same run (`specdec.stats.speedup`).

Outputs (in `out`): sweep.md (one row per point, best first in a second table), sweep.json
and one heatmap per τ, heatmap_tau_<τ>.png (D x B, colour = speedup, cells annotated).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.bench.config import MeasuredRunConfig, shared_fields
from specdec.bench.defaults import DEFAULT_BRANCHINGS, DEFAULT_DEPTHS, DEFAULT_TAUS
from specdec.bench.defaults import estimate_text as estimate_text  # re-exported
from specdec.bench.defaults import estimate_tokens as estimate_tokens  # re-exported
from specdec.bench.report import MethodSummary, command_line, machine_info, summarize, versions
from specdec.bench.runner import BASELINE, BenchConfig, BenchResult, run_bench
from specdec.bench.variants import Variant
from specdec.errors import SpecDecError
from specdec.methods import make_policy
from specdec.parsing import parse_float_list as parse_floats

D_MAX_FLOOR = 8
"""d_max of a grid point is max(D, this) (used by phases 2-3 only)"""


@dataclass
class SweepConfig(MeasuredRunConfig):
    """Everything that defines a sweep (saved in sweep.json): the prompts, pair and measurement
    fields of `MeasuredRunConfig`, and the grid."""

    num_prompts: int | None = 3
    repeats: int = 2
    depths: list[int] = field(default_factory=lambda: [int(x) for x in DEFAULT_DEPTHS.split(",")])
    branchings: list[int] = field(default_factory=lambda: [int(x) for x in DEFAULT_BRANCHINGS.split(",")])
    taus: list[float] = field(default_factory=lambda: [float(x) for x in DEFAULT_TAUS.split(",")])
    phase: int = 0
    """dynatree phase of every point (0: the paper's fixed tree)"""
    max_nodes: int = 256
    """N_max, draft tokens per step (the paper's 256)"""


@dataclass(frozen=True)
class GridPoint:
    """One configuration of the grid."""

    depth: int
    branching: int
    tau: float

    @property
    def label(self) -> str:
        return f"D={self.depth},B={self.branching},tau={self.tau:g}"

    def options(self, phase: int, max_nodes: int) -> dict[str, Any]:
        """The dynatree options of this point."""
        return {
            "phase": phase,
            "d0": self.depth,
            "d_max": max(self.depth, D_MAX_FLOOR),
            "b_min": 1,
            "b_mid": self.branching,
            "b_max": max(self.branching, 3),
            "prune_tau": self.tau,
            "max_nodes": max_nodes,
        }


@dataclass
class SweepRow:
    """One grid point and its figures."""

    point: GridPoint
    summary: MethodSummary

    def to_dict(self) -> dict[str, Any]:
        s = self.summary
        return {
            "depth": self.point.depth,
            "branching": self.point.branching,
            "tau": self.point.tau,
            "label": self.point.label,
            "options": s.options,
            "tokens_per_s_median": s.tokens_per_s_median,
            "tokens_per_s_aggregate": s.tokens_per_s_aggregate,
            "speedup": s.speedup,
            "speedup_per_prompt_median": s.speedup_per_prompt_median,
            "speedup_per_prompt_q1": s.speedup_per_prompt_q1,
            "speedup_per_prompt_q3": s.speedup_per_prompt_q3,
            "tau_tokens_per_step": s.tau,
            "acceptance_rate": s.acceptance_rate,
            "drafted_per_step": s.drafted_per_step,
            "tau_max": s.tau_max,
            "matches_ar": s.matches_ar,
            "calls": s.calls,
            "new_tokens": s.new_tokens,
        }


@dataclass
class SweepOutputs:
    """What a sweep leaves behind."""

    result: BenchResult
    rows: list[SweepRow]
    ar: MethodSummary
    markdown: Path
    json: Path
    heatmaps: list[Path]


# ----- configuration -----------------------------------------------------------------


def parse_float_list(text: str, flag: str) -> list[float]:
    """'0.01,0.03' -> [0.01, 0.03], each a pruning threshold in [0, 1)."""

    def in_unit(value: float) -> float:
        if not 0 <= value < 1:
            raise SpecDecError(f"{flag}: {value} must be in [0, 1) (0 disables pruning)")
        return value

    return parse_floats(text, flag, in_unit)


def grid_points(config: SweepConfig) -> list[GridPoint]:
    """Every (D, B, τ) of the grid, in D, B, τ order."""
    return [GridPoint(d, b, t) for d in config.depths for b in config.branchings for t in config.taus]


def grid_variants(config: SweepConfig) -> list[Variant]:
    """AR, then one dynatree variant per grid point (options validated before any model is loaded)."""
    variants = [Variant(label=BASELINE, method=BASELINE, verify="greedy", peer=False, base=BASELINE)]
    for point in grid_points(config):
        options = point.options(config.phase, config.max_nodes)
        try:
            make_policy("dynatree", **options)
        except SpecDecError as err:
            raise SpecDecError(f"sweep point {point.label}: {err}") from None
        variants.append(Variant(label=point.label, method="dynatree", verify="greedy", peer=False, options=options, base=point.label))
    return variants


def bench_config(config: SweepConfig) -> BenchConfig:
    """The `BenchConfig` the sweep runs under (greedy, batch size 1)."""
    return BenchConfig(**shared_fields(config, MeasuredRunConfig), methods=[BASELINE], verify=["greedy"], temperature=0.0, batch_size=1)


# ----- the run -------------------------------------------------------------------------


PHASES = (0, 1, 2, 3)
"""the dynatree phases a sweep can run"""


def check_phase(phase: int) -> None:
    """A SpecDecError for a --phase the dynatree policy does not have (checked before the plan is printed)."""
    if phase not in PHASES:
        raise SpecDecError(f"--phase {phase} must be 0, 1, 2 or 3 (0: the fixed tree; 1-3 add the adaptive rules)")


def run_sweep(config: SweepConfig, argv: Sequence[str] = ()) -> SweepOutputs:
    """Run the grid (one interleaved bench run), write sweep.md, sweep.json and the heatmaps."""
    check_phase(config.phase)
    points = grid_points(config)
    variants = grid_variants(config)
    result = run_bench(bench_config(config), variants=variants)
    summaries = {s.label: s for s in summarize(result)}
    ar = summaries[BASELINE]
    rows = [SweepRow(point=p, summary=summaries[p.label]) for p in points if p.label in summaries]
    out_dir = Path(config.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    heatmaps = plot_heatmaps(rows, config, out_dir)
    markdown = out_dir / "sweep.md"
    markdown.write_text(render_sweep_markdown(config, result, rows, ar, argv, heatmaps), encoding="utf-8")
    path = out_dir / "sweep.json"
    path.write_text(json.dumps(sweep_dict(config, result, rows, ar, argv, heatmaps), indent=1, default=str), encoding="utf-8")
    return SweepOutputs(result=result, rows=rows, ar=ar, markdown=markdown, json=path, heatmaps=heatmaps)


def best_row(rows: Sequence[SweepRow]) -> SweepRow | None:
    """The point with the highest speedup (ratio of median tokens/s)."""
    return max(rows, key=lambda r: r.summary.speedup, default=None)


# ----- outputs -------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else f"{value:{spec}}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _row_line(r: SweepRow) -> str:
    s = r.summary
    matches = "n/a" if s.matches_ar is None else ("yes" if s.matches_ar else f"NO: {s.equality_mismatches}/{s.equality_compared}")
    return (
        f"| {r.point.depth} | {r.point.branching} | {r.point.tau:g} | {s.tokens_per_s_median:.1f} | {s.speedup:.2f}x | "
        f"{s.speedup_per_prompt_median:.2f}x [{s.speedup_per_prompt_q1:.2f}, {s.speedup_per_prompt_q3:.2f}] | "
        f"{_fmt(s.tau)} | {_pct(s.acceptance_rate)} | "
        f"{_fmt(s.drafted_per_step, '.1f')} | {matches} |"
    )


TABLE_HEADER = (
    "| D | B | prune τ | tok/s (median) | speedup | per-prompt speedup median [IQR] | τ (tokens/step) | acceptance | drafted/step | = AR |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
)


def render_sweep_markdown(
    config: SweepConfig, result: BenchResult, rows: Sequence[SweepRow], ar: MethodSummary, argv: Sequence[str], heatmaps: Sequence[Path]
) -> str:
    """sweep.md: setup, the best point, every point (grid order), the top 10, the heatmaps."""
    machine = machine_info(result.device)
    ver = versions()
    best = best_row(rows)
    lines = [
        "# specdec sweep: DynaTree grid (depth x branching x pruning threshold)",
        "",
        f"- **Machine**: {machine['cpu']}, {machine['logical_cores']} logical cores, torch threads {machine['torch_threads']}, device {result.device}"
        + (f" ({machine['gpu']})" if "gpu" in machine else ""),
        f"- **Versions**: python {ver['python']}, torch {ver['torch']}, transformers {ver['transformers']}, specdec {ver['specdec']}",
        f"- **Command**: `{command_line(argv)}`",
        f"- **Models**: target `{result.target_path}`, draft `{result.draft_path or 'none'}`, dtype {result.dtype}",
        f"- **Prompts**: `{result.prompt_file}`: {len(result.prompts)} prompt(s)",
        f"- **Grid**: D {config.depths} x B {config.branchings} x prune τ {config.taus} = {len(rows)} configs; dynatree phase {config.phase}, "
        f"max_nodes {config.max_nodes} (d0 = D, b_mid = B, prune_tau = τ)",
        f"- **Run**: greedy, max_new_tokens {config.max_new_tokens}, repeats {config.repeats}, seed {config.seed}; AR and every config "
        "in one interleaved run (method order shuffled per prompt and repeat)",
        f"- **AR**: {ar.tokens_per_s_median:.1f} median tokens/s; sweep wall time {result.wall_s:.1f} s",
        "",
    ]
    if best is not None:
        lines += [
            f"**Best**: D={best.point.depth}, B={best.point.branching}, prune τ={best.point.tau:g}: {best.summary.speedup:.2f}x AR "
            f"({best.summary.tokens_per_s_median:.1f} tok/s, τ {_fmt(best.summary.tau)} tokens/step).",
            "",
        ]
    lines += ["## Every configuration", "", *TABLE_HEADER]
    lines += [_row_line(r) for r in rows]
    lines += ["", "## Top 10 by speedup", "", *TABLE_HEADER]
    lines += [_row_line(r) for r in sorted(rows, key=lambda r: r.summary.speedup, reverse=True)[:10]]
    lines += [
        "",
        "## How to read it",
        "",
        "- **speedup**: the config's median tokens/s over every call divided by AR's, both from this run (`specdec.stats.speedup`); "
        "**per-prompt**: each prompt's median over repeats divided by AR's on that prompt, median and IQR.",
        "- **τ (tokens/step)**: tokens committed per verification step (`specdec.stats.tau`); **prune τ** is the pruning threshold "
        "(a different τ). **acceptance**: accepted / drafted tokens; **drafted/step**: draft tokens (tree nodes) verified per step.",
        "- **= AR**: greedy decoding is lossless, so every output must equal AR's.",
        "",
    ]
    if result.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in result.notes] + [""]
    if heatmaps:
        lines += ["## Heatmaps", ""] + [f"![{p.stem}]({p.name})" for p in heatmaps] + [""]
    return "\n".join(lines)


def sweep_dict(
    config: SweepConfig, result: BenchResult, rows: Sequence[SweepRow], ar: MethodSummary, argv: Sequence[str], heatmaps: Sequence[Path]
) -> dict[str, Any]:
    """Everything, for sweep.json."""
    best = best_row(rows)
    return {
        "command": command_line(argv),
        "argv": list(argv),
        "config": dataclasses.asdict(config),
        "machine": machine_info(result.device),
        "versions": versions(),
        "models": {"target": result.target_path, "draft": result.draft_path, "device": result.device, "dtype": result.dtype},
        "prompt_file": result.prompt_file,
        "prompts": [p.id for p in result.prompts],
        "ar": {"tokens_per_s_median": ar.tokens_per_s_median, "tokens_per_s_aggregate": ar.tokens_per_s_aggregate, "calls": ar.calls},
        "rows": [r.to_dict() for r in rows],
        "best": best.to_dict() if best is not None else None,
        "heatmaps": [p.name for p in heatmaps],
        "notes": result.notes,
        "sweep_wall_s": result.wall_s,
    }


def heatmap_name(tau: float) -> str:
    """heatmap_tau_<τ>.png"""
    return f"heatmap_tau_{tau:g}.png"


def plot_heatmaps(rows: Sequence[SweepRow], config: SweepConfig, out_dir: Path) -> list[Path]:
    """One PNG per τ: rows D, columns B, colour = speedup over AR (one scale for all, centred on 1x),
    each cell annotated with its speedup and tokens/s; the best cell of each map has a dashed border."""
    from specdec.bench.plots import pyplot, save_figure

    plt = pyplot()
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    speedups = [r.summary.speedup for r in rows]
    if not speedups:
        return []
    vmin, vmax = min(min(speedups), 0.99), max(max(speedups), 1.01)
    norm = TwoSlopeNorm(vcenter=1.0, vmin=vmin, vmax=vmax)
    by_point = {(r.point.depth, r.point.branching, r.point.tau): r for r in rows}
    paths: list[Path] = []
    for tau in config.taus:
        grid = [[by_point.get((d, b, tau)) for b in config.branchings] for d in config.depths]
        values = [[r.summary.speedup if r is not None else math.nan for r in line] for line in grid]
        fig, ax = plt.subplots(figsize=(1.3 * len(config.branchings) + 2.6, 0.7 * len(config.depths) + 1.8))
        image = ax.imshow(values, cmap="RdYlGn", norm=norm, aspect="auto", origin="lower")
        cells = [(i, j, r) for i, line in enumerate(grid) for j, r in enumerate(line) if r is not None]
        for i, j, r in cells:
            dark = abs(float(norm(r.summary.speedup)) - 0.5) > 0.35  # white text on the saturated ends of the colour map
            text = f"{r.summary.speedup:.2f}x\n{r.summary.tokens_per_s_median:.0f} t/s"
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
        if cells:
            i, j, _ = max(cells, key=lambda c: c[2].summary.speedup)
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, linestyle="--", linewidth=2, edgecolor="black"))
        ax.set_xticks(range(len(config.branchings)), [str(b) for b in config.branchings])
        ax.set_yticks(range(len(config.depths)), [str(d) for d in config.depths])
        ax.set_xlabel("branching B")
        ax.set_ylabel("depth D")
        ax.set_title(f"speedup over AR, prune τ = {tau:g}")
        fig.colorbar(image, ax=ax, label="speedup (x)")
        paths.append(save_figure(fig, out_dir / heatmap_name(tau)))
    return paths
