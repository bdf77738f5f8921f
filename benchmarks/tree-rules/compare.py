"""The tree simulation of tests/test_tree_rules.py as a table: rate (expected tokens per ms) and
expected accepted tokens per step, for each draft, cost table and batch size.

python benchmarks/tree-rules/compare.py   (from the repository root; no models, ~1 minute on a CPU)
"""

from __future__ import annotations

import sys

sys.path.insert(0, "tests")
from test_tree_rules import DRAFTS, Simulation, run  # noqa: E402

from specdec.bench.treesim import cpu_like_table, gpu_like_table  # noqa: E402

print("| draft | table | B | cast | eagle2 | static | dynatree | dynatree, calibrate off |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for draft in DRAFTS:
    for device, table in (("cpu", cpu_like_table), ("gpu", gpu_like_table)):
        for batch in (1, 4):
            sim = Simulation(*DRAFTS[draft], table(), batch=batch)
            rows = [run("cast", sim), run("eagle2", sim), run("static", sim), run("dynatree", sim), run("dynatree", sim, calibrate=False)]
            print(f"| {draft} | {device} | {batch} | " + " | ".join(f"{r['rate']:.3f} ({r['expected']:.2f})" for r in rows) + " |", flush=True)
