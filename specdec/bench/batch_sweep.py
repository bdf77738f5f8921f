"""`specdec bench --batch-sizes 1,2,4,8,16`: the same benchmark at several batch sizes.

Each batch size is a full `specdec bench` run (its own report in `OUT/batch-B/`, AR at
that batch size as its baseline); this module adds the comparison across them:
`batch_sweep.md`, `batch_sweep.json` and `speedup_vs_batch.png` (speedup over batched AR
at the same B, and summed tokens/s, against B).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from specdec.bench.report import MethodSummary, command_line
from specdec.bench.runner import BenchConfig


def run_batch_sweep(config: BenchConfig, batch_sizes: Sequence[int], argv: Sequence[str] = ()) -> Path:
    """Run the bench at each batch size; returns the path of `batch_sweep.md`."""
    from specdec.bench import run_and_report

    out = Path(config.out)
    per_batch: dict[int, list[MethodSummary]] = {}
    for b in batch_sizes:
        cfg = replace(config, batch_size=b, out=str(out / f"batch-{b}"))
        per_batch[b] = run_and_report(cfg, argv).summaries
    return write_batch_sweep(per_batch, out, argv)


def draft_row_limits(table: dict[str, dict[int, MethodSummary]], sizes: Sequence[int]) -> dict[str, int | None]:
    """Per engine method (AR and Hugging Face peers left out): the largest measured batch size B
    such that the method's speedup over batched AR was at least 1 at every measured size up to
    B (None when it was below AR at the smallest), a value for `--max-draft-rows`."""
    limits: dict[str, int | None] = {}
    for label, by_batch in table.items():
        if label == "ar" or any(s.peer for s in by_batch.values()):
            continue
        limit = None
        for b in sizes:
            summary = by_batch.get(b)
            if summary is None or summary.speedup < 1.0:
                break
            limit = b
        limits[label] = limit
    return limits


def write_batch_sweep(per_batch: dict[int, list[MethodSummary]], out: Path, argv: Sequence[str] = ()) -> Path:
    """The cross-batch table, JSON and plot from per-batch summaries."""
    from specdec.bench.plots import pyplot, save_figure

    plt = pyplot()

    out.mkdir(parents=True, exist_ok=True)
    sizes = sorted(per_batch)
    labels: list[str] = []
    for b in sizes:
        for s in per_batch[b]:
            if s.label not in labels:  # peers too: hf at every batch size (batched generate), the others at 1
                labels.append(s.label)
    table: dict[str, dict[int, MethodSummary]] = {lab: {} for lab in labels}
    for b in sizes:
        for s in per_batch[b]:
            if s.label in table:
                table[s.label][b] = s

    lines = [
        "# Speedup against batch size",
        "",
        f"Command: `{command_line(argv)}`" if argv else "",
        "",
        "Speedup is over plain autoregressive decoding (our engine) at the same batch size, measured in the same run",
        "(`hf`: Hugging Face's own generate(), one batched call per group above batch size 1);",
        "tokens/s is summed over the batch (aggregate: all new tokens / all wall time). Per-batch reports: `batch-B/report.md`.",
        "",
        "| method | " + " | ".join(f"B={b} speedup" for b in sizes) + " | " + " | ".join(f"B={b} tok/s" for b in sizes) + " |",
        "| --- | " + " | ".join("---:" for _ in sizes * 2) + " |",
    ]
    for lab in labels:
        speed = [f"{table[lab][b].speedup:.2f}x" if b in table[lab] else "–" for b in sizes]
        tps = [f"{table[lab][b].tokens_per_s_aggregate:.1f}" if b in table[lab] else "–" for b in sizes]
        lines.append(f"| {lab} | " + " | ".join(speed) + " | " + " | ".join(tps) + " |")
    best = []
    for b in sizes:
        engine = [s for s in per_batch[b] if not s.peer and s.label != "ar"]
        if engine:
            top = max(engine, key=lambda s: s.speedup)
            best.append(f"B={b}: {top.label} {top.speedup:.2f}x")
    lines += ["", "Fastest method per batch size: " + "; ".join(best) + "." if best else ""]
    limits = draft_row_limits(table, sizes)
    if limits:
        lines += [
            "",
            "`--max-draft-rows` from this sweep (the largest batch size up to which a method stayed at or above batched AR at "
            "every size measured; steps with more rows would then decode as AR): "
            + "; ".join(f"{lab}: {n}" if n is not None else f"{lab}: below AR already at B={sizes[0]}" for lab, n in limits.items())
            + ".",
        ]
    md = out / "batch_sweep.md"
    md.write_text("\n".join(lines) + "\n")
    data = {
        "batch_sizes": sizes,
        "methods": {lab: {str(b): table[lab][b].to_dict() for b in table[lab]} for lab in labels},
        "command": command_line(argv) if argv else None,
    }
    (out / "batch_sweep.json").write_text(json.dumps(data, indent=1, default=str))

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for lab in labels:
        xs = [b for b in sizes if b in table[lab]]
        ax1.plot(xs, [table[lab][b].speedup for b in xs], marker="o", label=lab)
        ax2.plot(xs, [table[lab][b].tokens_per_s_aggregate for b in xs], marker="o", label=lab)
    for ax, title in ((ax1, "speedup over batched AR"), (ax2, "tokens/s summed over the batch")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.axhline(1.0, color="grey", lw=1, ls="--")
    ax2.legend(fontsize=7)
    save_figure(fig, out / "speedup_vs_batch.png", dpi=120)
    return md
