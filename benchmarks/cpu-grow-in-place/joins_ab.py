"""Prompts joining a shrunken batch: grown in its own storage (`ModelRunner._grow_in_place`, since
2026-12-02) against a full gather into new storage (before), alternating in one process.

A `DecodeSession` with max_rows=8 is fed as a lightly loaded server feeds it: 4 prompts at the
start, then one more before each step while fewer than 8 rows run or wait, 32 `stdlib-heldout`
prompts in all, each with its own budget (24-96 new tokens), so rows finish at different steps,
the batch shrinks and joining prompts grow it again. Greedy, the bundled pair.

python benchmarks/cpu-grow-in-place/joins_ab.py METHOD ROUNDS [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import specdec.models.runner as runner_module
from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source

parser = argparse.ArgumentParser()
parser.add_argument("method")
parser.add_argument("rounds", type=int)
parser.add_argument("--out")
args = parser.parse_args()

decoder = SpeculativeDecoder.from_pretrained(method=args.method)
ids = [decoder.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 32)]
budgets = [24 + (i * 37) % 73 for i in range(len(ids))]
appended_rows = runner_module._appended_rows
keep_rows = runner_module.ModelRunner.keep_rows
growth = {"joins": 0, "s": 0.0}


def timed_keep_rows(self: runner_module.ModelRunner, rows: list[int]) -> None:
    """`keep_rows`, its time summed when it grows the batch (both models' caches)."""
    grows = len(rows) > self.cache.rows
    start = time.perf_counter()
    keep_rows(self, rows)
    if grows:
        growth["joins"] += 1
        growth["s"] += time.perf_counter() - start


runner_module.ModelRunner.keep_rows = timed_keep_rows  # type: ignore[method-assign]


def serve(in_place: bool) -> tuple[float, float, float]:
    """(wall s, median time to first token s, time growing caches s) of the whole feed."""
    runner_module._appended_rows = appended_rows if in_place else (lambda order, rows: None)  # None: the full gather
    growth.update(joins=0, s=0.0)
    session = decoder.engine("greedy").session(max_rows=8)
    feed = list(zip(ids, budgets, strict=True))
    requests = [session.submit(*feed.pop(0)) for _ in range(4)]
    start = time.perf_counter()
    while not session.idle or feed:
        if feed and session.running + len(session.waiting) < 8:
            requests.append(session.submit(*feed.pop(0)))
        session.step()
    return time.perf_counter() - start, statistics.median(r.stats.ttft_s for r in requests), growth["s"]


serve(True)  # warm-up (CAST measures its cost table here)
runs: dict[str, list[tuple[float, float, float]]] = {"in place": [], "full gather": []}
for round_ in range(args.rounds):
    for in_place in (True, False) if round_ % 2 == 0 else (False, True):
        runs["in place" if in_place else "full gather"].append(serve(in_place))
summary = {
    "machine": platform.processor() or platform.machine(),
    "torch_threads": torch.get_num_threads(),
    "method": args.method,
    "rounds": args.rounds,
    "wall_s": {k: [w for w, _, _ in v] for k, v in runs.items()},
    "median_ttft_s": {k: [t for _, t, _ in v] for k, v in runs.items()},
    "growing_s": {k: [g for _, _, g in v] for k, v in runs.items()},
    "cache_growths_a_feed": growth["joins"],
}
for name, values in runs.items():
    print(
        f"{args.method} {name}: median wall {statistics.median(w for w, _, _ in values):.2f} s, median TTFT {1e3 * statistics.median(t for _, t, _ in values):.0f} ms,"
        f" growing caches {statistics.median(g for _, _, g in values):.2f} s ({growth['joins']} growths a feed); walls {' '.join(f'{w:.2f}' for w, _, _ in values)}"
    )
if args.out:
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
