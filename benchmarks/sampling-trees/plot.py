"""sampled_vs_topk.png: τ and speedup over AR of each tree method with drawn (`sampled`) and top-k
children, at T = 1 and T = 0.7, from the two runs' results.json. Run from the repository root:
`python benchmarks/sampling-trees/plot.py`."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).parent
METHODS = ("static", "eagle2", "dynatree", "cast")
fig, axes = plt.subplots(2, 2, figsize=(10, 7))
for col, (run, title) in enumerate((("t1", "T = 1"), ("t0.7", "T = 0.7"))):
    ms = json.loads((ROOT / run / "results.json").read_text())["methods"]
    for row, (key, label) in enumerate((("tau", "τ (tokens per step)"), ("speedup", "speedup over AR"))):
        ax = axes[row][col]
        x = range(len(METHODS))
        sampled = [ms[m][key] for m in METHODS]
        topk = [ms[f"{m}[tree_sampling=topk]"][key] for m in METHODS]
        ax.bar([i - 0.2 for i in x], sampled, width=0.4, label="sampled (default)")
        ax.bar([i + 0.2 for i in x], topk, width=0.4, label="topk")
        ax.axhline(ms["chain"][key], color="k", ls="--", lw=1, label="K = 5 chain")
        if key == "speedup":
            ax.axhline(1.0, color="grey", ls=":", lw=1, label="AR")
        ax.set_xticks(list(x), METHODS)
        ax.set_title(f"{title}: {label}")
        ax.legend(fontsize=8)
fig.suptitle("Sampled vs top-k tree children, bundled pair v2, CPU")
fig.tight_layout()
fig.savefig(ROOT / "sampled_vs_topk.png", dpi=110)
