"""forward_cost.png (forward time against new tokens, both MKL modes) and b1_ab.png (tokens/s per
method at B = 1 with MKL's default mode and with MKL_CBWR=AUTO) from this folder's JSON files.

python benchmarks/cpu-blas/plot.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent


def forward_cost() -> None:
    data = json.loads((HERE / "forward_cost.json").read_text())
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, which in zip(axes, ("target", "draft"), strict=True):
        for mode, runs in data["modes"].items():
            ns = sorted(int(n) for n in runs[0][which])
            ms = [sum(r[which][str(n)] for r in runs) / len(runs) for n in ns]
            ax.plot(ns, ms, marker="o", label=f"MKL_CBWR={mode}" if mode != "default" else "MKL default mode")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new tokens in the forward (n)")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"bundled {which}, {data['prefix']} tokens in the cache")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{data['cpu']}: one forward's time against n")
    fig.tight_layout()
    fig.savefig(HERE / "forward_cost.png", dpi=110)


def b1_ab() -> None:
    runs = {label: json.loads((HERE / folder / "results.json").read_text()) for label, folder in (("MKL default mode", "b1-mkl-default"), ("MKL_CBWR=AUTO", "b1"))}
    methods = list(next(iter(runs.values()))["methods"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.4
    for i, (label, result) in enumerate(runs.items()):
        values = [result["methods"][m]["tokens_per_s_median"] for m in methods]
        ax.bar([x + (i - 0.5) * width for x in range(len(methods))], values, width, label=label)
    ax.set_xticks(range(len(methods)), methods, rotation=20)
    ax.set_ylabel("median tokens/s (B = 1, greedy)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "b1_ab.png", dpi=110)


if __name__ == "__main__":
    forward_cost()
    b1_ab()
