"""The τ / tokens-per-second frontier of tree shapes at T = 1 (issue 19's bar: τ >= 1.3x and tokens/s
>= 1x the K = 5 chain's, both from one run). Prints the table and draws frontier.png:

    python benchmarks/sampling-trees/frontier-t1/plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
methods = json.loads((HERE / "results.json").read_text())["methods"]
chain = methods["chain"]
rows = []
for label, m in methods.items():
    if label == "ar":
        continue
    ms_step = 1000 * m["tau"] / m["tokens_per_s_median"]  # wall ms per verification step (τ tokens each)
    rows.append((label, m["tau"] / chain["tau"], m["tokens_per_s_median"] / chain["tokens_per_s_median"], m["drafted_per_step"], ms_step, m["speedup"]))
print("| method | τ | τ / chain τ | tok/s / chain | × AR | drafted / step | wall ms / step |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for label, tau_ratio, speed_ratio, drafted, ms_step, speedup in rows:
    print(f"| `{label}` | {methods[label]['tau']:.2f} | {tau_ratio:.2f} | {speed_ratio:.2f} | {speedup:.2f}x | {drafted:.1f} | {ms_step:.1f} |")

fig, ax = plt.subplots(figsize=(7, 5))
for label, tau_ratio, speed_ratio, _, _, _ in rows:
    family = label.split("[")[0]
    ax.scatter(tau_ratio, speed_ratio, color={"chain": "tab:gray", "static": "tab:green", "eagle2": "tab:blue", "dynatree": "tab:orange"}.get(family, "k"))
    ax.annotate(label.replace("total_tokens", "n").replace("free_tokens", "free"), (tau_ratio, speed_ratio), fontsize=7, xytext=(3, 3), textcoords="offset points")
ax.axvline(1.3, ls="--", color="tab:red")
ax.axhline(1.0, ls="--", color="tab:red")
ax.fill_between([1.3, 1.45], 1.0, 1.15, color="tab:red", alpha=0.08, label="issue 19's bar (empty here)")
ax.set_xlabel("τ / K = 5 chain's τ")
ax.set_ylabel("tokens/s / K = 5 chain's")
ax.set_title("T = 1, bundled pair, Intel Xeon 2 cores (one run)")
ax.legend(loc="lower left")
fig.tight_layout()
fig.savefig(HERE / "frontier.png", dpi=120)
