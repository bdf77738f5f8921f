"""PNG plots of a benchmark (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.bench.report import MethodSummary
from specdec.bench.runner import BASELINE

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported on first use: matplotlib comes with the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Figure, path: Path, dpi: int = 110, rect: tuple[float, float, float, float] | None = None) -> Path:
    """Lay `fig` out (within `rect` of the figure, when given), write it to `path` as a PNG and
    close it; returns path."""
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def plot_speedup(summaries: Sequence[MethodSummary], path: Path) -> Path:
    """Bars: median per-prompt speedup over AR with IQR whiskers; x marks the ratio of medians."""
    plt = pyplot()
    labels = [s.label for s in summaries]
    mid = [s.speedup_per_prompt_median for s in summaries]
    lower = [max(0.0, m - s.speedup_per_prompt_q1) for m, s in zip(mid, summaries, strict=True)]
    upper = [max(0.0, s.speedup_per_prompt_q3 - m) for m, s in zip(mid, summaries, strict=True)]
    colors = ["#999999" if s.label == BASELINE else "#d9822b" if s.peer else "#2b6cd9" for s in summaries]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(labels) + 2), 4))
    x = list(range(len(labels)))
    ax.bar(x, mid, color=colors, yerr=[lower, upper], capsize=4)
    ax.scatter(x, [s.speedup for s in summaries], marker="x", color="black", zorder=3, label="ratio of medians")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, labels, rotation=30, ha="right")
    ax.set_ylabel("speedup over AR (x)")
    ax.set_title("Speedup over AR: per-prompt median, IQR whiskers")
    ax.legend(loc="best", fontsize="small")
    return save_figure(fig, path)


def plot_tau(summaries: Sequence[MethodSummary], path: Path) -> Path:
    """Share of verification steps committing 1, 2, ... tokens (accepted_len + 1), per drafting method."""
    plt = pyplot()
    drafting = [s for s in summaries if s.tau_histogram and s.label != BASELINE]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    if not drafting:
        ax.text(0.5, 0.5, "no drafting method measured", ha="center", va="center", transform=ax.transAxes)
    else:
        top = max(max(s.tau_histogram) for s in drafting)
        width = 0.8 / len(drafting)
        for i, s in enumerate(drafting):
            total = sum(s.tau_histogram.values())
            xs = [k + (i - (len(drafting) - 1) / 2) * width for k in range(1, top + 1)]
            ax.bar(xs, [s.tau_histogram.get(k, 0) / total for k in range(1, top + 1)], width=width, label=f"{s.label} (τ {s.tau:.2f})")
        ax.set_xticks(range(1, top + 1))
        ax.legend(fontsize="small")
    ax.set_xlabel("tokens committed per step (accepted + 1)")
    ax.set_ylabel("share of steps")
    ax.set_title("τ distribution")
    return save_figure(fig, path)


def plot_acceptance_by_depth(summaries: Sequence[MethodSummary], path: Path) -> Path:
    """Accepted / drafted nodes at each tree depth, per drafting method."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    drafting = [s for s in summaries if s.drafted_by_depth]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    if not drafting:
        ax.text(0.5, 0.5, "no drafting method measured", ha="center", va="center", transform=ax.transAxes)
    for s in drafting:
        rates = s.acceptance_by_depth
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=s.label)
    if drafting:
        ax.legend(fontsize="small")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("tree depth")
    ax.set_ylabel("accepted / drafted nodes")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by tree depth")
    return save_figure(fig, path)


MARS_PANELS: tuple[tuple[str, str], ...] = (
    ("tau", "τ (tokens per step)"),
    ("speedup", "speedup over AR (x)"),
    ("relaxed_share", "relaxed share of accepted tokens"),
    ("ar_prefix_agreement", "AR prefix agreement (precision)"),
    ("nll", "target NLL (nats/token)"),
    ("parse_share", "code completions that parse"),
)
"""MethodSummary field and axis title of each panel of mars_sweep.png"""

SHARE_PANELS = frozenset({"relaxed_share", "ar_prefix_agreement", "parse_share"})
"""panels whose values are shares in [0, 1]"""


def plot_mars_sweep(summaries: Sequence[MethodSummary], path: Path) -> Path:
    """One panel per figure (τ, speedup, relaxed share, AR agreement, NLL, parse share) against θ.

    Each method is one line over its mars variants; its strict variant is a dashed line in
    the same colour, AR a dotted black line (where AR has the figure).
    """
    plt = pyplot()
    mars = [s for s in summaries if s.theta is not None]
    bases = list(dict.fromkeys(s.base for s in mars))
    ar = next((s for s in summaries if s.label == BASELINE), None)
    panels = [(f, t) for f, t in MARS_PANELS if any(getattr(s, f) is not None for s in mars)]
    cols = 3
    rows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, title) in zip(axes.flat, panels, strict=False):
        for i, base in enumerate(bases):
            color = colors[i % len(colors)]
            points = sorted((s.theta, getattr(s, name)) for s in mars if s.base == base and getattr(s, name) is not None)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=color, label=base)
            strict = next((s for s in summaries if s.base == base and s.theta is None and s.label != BASELINE), None)
            if strict is not None and getattr(strict, name) is not None:
                ax.axhline(getattr(strict, name), color=color, linestyle="--", linewidth=1, label=f"{base} strict")
        if ar is not None and name in ("nll", "parse_share", "speedup") and getattr(ar, name) is not None:
            ax.axhline(getattr(ar, name), color="black", linestyle=":", linewidth=1, label="AR")
        if name in SHARE_PANELS:  # shares: stay within [0, 1], at least 0.1 tall
            shown = [v for s in summaries if s.base in bases and (v := getattr(s, name)) is not None]
            lo, hi = min(shown, default=0.0), max(shown, default=1.0)
            pad = max(0.05, 0.1 * (hi - lo))
            ax.set_ylim(max(-0.02, lo - pad), min(1.02, hi + pad))
        ax.set_xlabel("θ (logit-ratio threshold)")
        ax.set_title(title, fontsize="medium")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if not mars:
        axes.flat[0].text(0.5, 0.5, "no mars variant measured", ha="center", va="center", transform=axes.flat[0].transAxes)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize="small")
    fig.suptitle("MARS θ sweep (dashed: strict verification, dotted: AR)")
    return save_figure(fig, path, rect=(0, 0.08, 1, 0.95))


def write_plots(summaries: Sequence[MethodSummary], out_dir: Path, mars_sweep: bool = False) -> list[Path]:
    """speedup.png, tau_distribution.png, acceptance_by_depth.png (and with `mars_sweep`, mars_sweep.png) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_speedup(summaries, out_dir / "speedup.png"),
        plot_tau(summaries, out_dir / "tau_distribution.png"),
        plot_acceptance_by_depth(summaries, out_dir / "acceptance_by_depth.png"),
    ]
    if mars_sweep:
        paths.append(plot_mars_sweep(summaries, out_dir / "mars_sweep.png"))
    return paths
