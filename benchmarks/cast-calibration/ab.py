"""CAST's calibration table, this layout against the previous one, in one process.

    previous: 10 equal q bins, ranks 3-12 sharing one row, 2 pseudo-observations per bin at a
              prior moving from the bin's centre to the rank's pooled rate
              (= today's `AcceptanceCalibrator.pooled()`, still used for drawn children)
    current:  `AcceptanceCalibrator.top_k(top_k)`: log-spaced bins below q = 0.1, one row per
              proposed rank, 10 pseudo-observations per bin at the rank's fitted power law q^γ

python benchmarks/cast-calibration/ab.py sim          # tree simulator, no models (~4 min)
python benchmarks/cast-calibration/ab.py real 1,4,8   # bundled pair, greedy, CPU (~15 min)

Writes benchmarks/cast-calibration/{sim,real}.json. Greedy only: at T > 0 CAST draws children and
uses the drawn table, which did not change.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "tests")
from test_tree_rules import DRAFTS  # noqa: E402

from specdec.bench.treesim import Simulation, cpu_like_table, gpu_like_table, summary  # noqa: E402
from specdec.drafting.calibration import AcceptanceCalibrator  # noqa: E402
from specdec.drafting.cast import CastPolicy  # noqa: E402
from specdec.methods import make_policy  # noqa: E402

OUT = Path("benchmarks/cast-calibration")
LAYOUTS = ("previous", "current")


def with_layout(policy: CastPolicy, layout: str) -> CastPolicy:
    if layout == "previous":  # the top-k table as it was (the private field: an A/B probe, not an API)
        policy._calibrators[False] = AcceptanceCalibrator.pooled()
    return policy


def sim(steps: int = 100, seeds: int = 4) -> None:
    rows = []
    for device, table in (("gpu", gpu_like_table()), ("cpu", cpu_like_table())):
        for draft in sorted(DRAFTS):
            for batch in (1, 2, 4, 8, 16):
                sims = [Simulation(*DRAFTS[draft], table, batch=batch, seed=s) for s in range(seeds)]

                def mean(make, sims: list[Simulation] = sims) -> float:
                    return statistics.mean(summary(s.run(make(), steps)[10:])["rate"] for s in sims)

                row = {"device": device, "draft": draft, "batch": batch}
                for layout in LAYOUTS:
                    row[f"cast ({layout})"] = mean(lambda layout=layout, table=table: with_layout(make_policy("cast", cost_table=table, deterministic=True), layout))
                row["cast (uncalibrated)"] = mean(lambda table=table: make_policy("cast", cost_table=table, deterministic=True, calibrate=False))
                row["eagle2"] = mean(lambda: make_policy("eagle2"))
                if device == "gpu":
                    row["dynatree (free_tokens=64)"] = mean(lambda: make_policy("dynatree", free_tokens=64))
                print(json.dumps(row), flush=True)
                rows.append(row)
    (OUT / "sim.json").write_text(json.dumps({"steps": steps, "warmup": 10, "seeds": seeds, "rate": "expected accepted tokens per simulated ms", "rows": rows}, indent=1))


def real(batches: list[int], prompts_n: int = 16, new_tokens: int = 96) -> None:
    from specdec.api import SpeculativeDecoder
    from specdec.bench.prompts import bundled_heldout_path

    prompts = [json.loads(line)["prompt"] for line in Path(bundled_heldout_path()).read_text().splitlines() if line.strip()][::4][:prompts_n]
    decoders = {layout: SpeculativeDecoder.from_pretrained(method="cast", deterministic=True) for layout in LAYOUTS}
    for layout, dec in decoders.items():
        with_layout(dec.policy, layout)
        dec.generate(prompts[0], max_new_tokens=32)  # warm-up (and the cost profile, if it is measured)
    rows = []
    for batch in batches:
        tot = {layout: {"new_tokens": 0, "steps": 0, "drafted": 0, "wall_s": 0.0} for layout in LAYOUTS}
        texts: dict[str, list[str]] = {layout: [] for layout in LAYOUTS}
        groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        for rep in range(2):
            for i, group in enumerate(groups):
                for layout in LAYOUTS if (i + rep) % 2 == 0 else LAYOUTS[::-1]:  # alternate the order
                    t0 = time.perf_counter()
                    res = decoders[layout].generate(group if batch > 1 else group[0], max_new_tokens=new_tokens)
                    tot[layout]["wall_s"] += time.perf_counter() - t0
                    for r in res if isinstance(res, list) else [res]:
                        tot[layout]["new_tokens"] += r.stats.new_tokens
                        tot[layout]["steps"] += r.stats.steps
                        tot[layout]["drafted"] += r.stats.drafted_tokens
                        if rep == 0:
                            texts[layout].append(r.text)
        row = {"batch": batch, "same_text": texts["previous"] == texts["current"]}
        for layout, t in tot.items():
            row[layout] = {"tau": t["new_tokens"] / t["steps"], "drafted_per_step": t["drafted"] / t["steps"], "tok_s": t["new_tokens"] / t["wall_s"], **t}
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(), "prompts": prompts_n, "new_tokens": new_tokens, "repeats": 2}
    (OUT / "real.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "sim":
        sim()
    else:
        real([int(b) for b in sys.argv[2].split(",")])
