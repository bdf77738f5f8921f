"""Per-step state of the tree policies on a synthetic draft (specdec.bench.treesim).

python benchmarks/tree-rules/dump.py [--steps 200] [--batch 1] [--power 1.0] [--table gpu|cpu] [--host-ms 0]
"""

from __future__ import annotations

import argparse

from specdec.bench.treesim import Simulation, SyntheticDraft, Truth, cpu_like_table, gpu_like_table, summary
from specdec.methods import make_policy

POLICIES = {
    "static": ("static", {}),
    "static-d5b2": ("static", {"depth": 5, "branching": 2}),
    "eagle2": ("eagle2", {}),
    "dynatree": ("dynatree", {}),
    "dynatree-p0": ("dynatree", {"phase": 0}),
    "dynatree-raw": ("dynatree", {"calibrate": False}),
    "cast": ("cast", {"deterministic": True}),
    "cast-learn": ("cast", {}),
    "cast-paper": ("cast", {"prune_rule": "threshold", "rerank_rule": "threshold", "calibrate": False}),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--power", type=float, default=1.0, help="truth: 1 calibrated draft, <1 underconfident")
    ap.add_argument("--table", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--host-ms", type=float, default=0.0)
    ap.add_argument("--methods", default=",".join(POLICIES))
    ap.add_argument("--lo", type=float, default=0.2)
    ap.add_argument("--hi", type=float, default=0.98)
    ap.add_argument("--shape", type=float, default=0.6)
    ap.add_argument("--steps-shown", type=int, default=0)
    args = ap.parse_args()
    table = gpu_like_table() if args.table == "gpu" else cpu_like_table()
    sim = Simulation(SyntheticDraft(lo=args.lo, hi=args.hi, shape=args.shape), Truth(args.power), table, batch=args.batch, host_ms_per_forward=args.host_ms)
    print(f"table={args.table} B={args.batch} truth power={args.power} host ms/forward={args.host_ms} steps={args.steps}")
    print(f"{'method':12s} {'nodes':>6s} {'depth':>6s} {'levels':>6s} {'E[acc]':>7s} {'draft':>7s} {'verify':>7s} {'rate':>8s}")
    for name in args.methods.split(","):
        method, opts = POLICIES[name]
        policy = make_policy(method, **({**opts, "cost_table": table} if method == "cast" else opts))
        states = sim.run(policy, args.steps)
        s = summary(states[args.steps // 4 :])  # after a warm-up quarter (calibration, history)
        print(f"{name:12s} {s['nodes']:6.1f} {s['depth']:6.2f} {s['levels']:6.2f} {s['expected']:7.3f} {s['draft_ms']:7.2f} {s['verify_ms']:7.2f} {1000 * s['rate']:8.2f}")
        for st in states[-args.steps_shown :] if args.steps_shown else []:
            print(f"    widths={st.widths} nodes={st.nodes:.0f} depth={st.depth:.0f} E={st.expected:.2f} acc={st.accepted}")


if __name__ == "__main__":
    main()
