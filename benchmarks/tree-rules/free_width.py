"""DynaTree's free verification width (`free_tokens`) on the tree simulator: every tree policy's
rate (expected tokens per ms of simulated step time), expected accepted tokens and verified nodes
per step, on a GPU-like table (verification flat up to 64 tokens) and a CPU-like one (every token
costs), at B = 1, 2, 4, 8, 16, for the two synthetic drafts of tests/test_tree_rules.py.

python benchmarks/tree-rules/free_width.py   (from the repository root; no models, ~3 minutes on a CPU)

Writes benchmarks/tree-rules/free-width/{results.json, table.md, rate_vs_batch.png}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, "tests")
from test_tree_rules import DRAFTS, Simulation, run  # noqa: E402

from specdec.bench.treesim import cpu_like_table, gpu_like_table  # noqa: E402

OUT = Path("benchmarks/tree-rules/free-width")
BATCHES = (1, 2, 4, 8, 16)
METHODS = {
    "chain": ("chain", {}),
    "static": ("static", {}),
    "eagle2": ("eagle2", {}),
    "cast": ("cast", {}),
    "dynatree (paper rules, free_tokens=0)": ("dynatree", {"free_tokens": 0}),
    "dynatree (free_tokens=64)": ("dynatree", {"free_tokens": 64}),
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    for draft in DRAFTS:
        for device, table in (("gpu", gpu_like_table), ("cpu", cpu_like_table)):
            for batch in BATCHES:
                sim = Simulation(*DRAFTS[draft], table(), batch=batch)
                for label, (method, options) in METHODS.items():
                    r = run(method, sim, **options)
                    results.append({"draft": draft, "table": device, "batch": batch, "method": label, **r})
                    print(draft, device, batch, label, f"{r['rate']:.3f}", flush=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = ["| draft | table | B | " + " | ".join(METHODS) + " |", "| --- | --- | ---: |" + " ---: |" * len(METHODS)]
    for draft in DRAFTS:
        for device in ("gpu", "cpu"):
            for batch in BATCHES:
                cells = {r["method"]: r for r in results if (r["draft"], r["table"], r["batch"]) == (draft, device, batch)}
                lines.append(
                    f"| {draft} | {device} | {batch} | "
                    + " | ".join(f"{cells[m]['rate']:.3f} ({cells[m]['expected']:.2f}, {cells[m]['nodes']:.0f})" for m in METHODS)
                    + " |"
                )
    (OUT / "table.md").write_text("\n".join(lines) + "\n")
    plot(results)


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for i, device in enumerate(("gpu", "cpu")):
        for j, draft in enumerate(DRAFTS):
            ax = axes[i][j]
            static = {r["batch"]: r["rate"] for r in results if (r["draft"], r["table"], r["method"]) == (draft, device, "static")}
            for label in METHODS:
                rows = sorted((r["batch"], r["rate"] / static[r["batch"]]) for r in results if (r["draft"], r["table"], r["method"]) == (draft, device, label))
                ax.plot([b for b, _ in rows], [v for _, v in rows], marker="o", label=label, linewidth=2.5 if "64" in label else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
            ax.set_title(f"{device}-like table, {draft} draft")
            ax.set_ylabel("rate / static tree's")
            ax.axhline(1.0, color="grey", linewidth=0.8)
            if i == 1:
                ax.set_xlabel("batch size")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Tree simulator: expected tokens per unit time relative to the static tree")
    fig.tight_layout()
    fig.savefig(OUT / "rate_vs_batch.png", dpi=110)


if __name__ == "__main__":
    main()
