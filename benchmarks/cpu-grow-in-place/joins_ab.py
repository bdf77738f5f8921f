"""Prompts joining a running batch, two ways of growing its caches against each other,
alternating in one process. Greedy, the bundled pair.

`--feed shrink` (the default; `--switch in-place`): a shrunken batch grown in its own storage
(`ModelRunner._grow_in_place`, since 2026-12-02) against a full gather into new storage (before).
A `DecodeSession` with max_rows=8 is fed as a lightly loaded server feeds it: 4 prompts at the
start, then one more before each step while fewer than 8 rows run or wait, 32 `stdlib-heldout`
prompts in all, each with its own budget (24-96 new tokens), so rows finish at different steps,
the batch shrinks and joining prompts grow it again.

`--feed ramp` (`--switch room`): a batch growing past every size it had, moved into storage laid
out with room to grow (`ModelRunner._grow_with_room`, since 2026-12-02) against a full gather at
every new size (before). A session with max_rows=`--max-rows` (16) is fed as a server starting from
idle: one prompt before each step until max_rows run, 96 new tokens each (nobody finishes during
the ramp), then it drains.

python benchmarks/cpu-grow-in-place/joins_ab.py METHOD ROUNDS [--feed shrink|ramp] [--max-rows N] [--out FILE.json]
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
parser.add_argument("--feed", choices=("shrink", "ramp"), default="shrink")
parser.add_argument("--max-rows", type=int, default=16, help="--feed ramp: the session's max_rows")
parser.add_argument("--out")
args = parser.parse_args()

decoder = SpeculativeDecoder.from_pretrained(method=args.method)
ids = [decoder.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 32 if args.feed == "shrink" else args.max_rows)]
budgets = [24 + (i * 37) % 73 for i in range(len(ids))] if args.feed == "shrink" else [96] * len(ids)
appended_rows = runner_module._appended_rows
grow_with_room = runner_module.ModelRunner._grow_with_room
keep_rows = runner_module.ModelRunner.keep_rows
growth = {"joins": 0, "s": 0.0}
NEW, OLD = ("in place", "full gather") if args.feed == "shrink" else ("room", "full gather")


def timed_keep_rows(self: runner_module.ModelRunner, rows: list[int], room: int | None = None) -> None:
    """`keep_rows`, its time summed when it grows the batch (both models' caches)."""
    grows = len(rows) > self.cache.rows
    start = time.perf_counter()
    keep_rows(self, rows, room=room)
    if grows:
        growth["joins"] += 1
        growth["s"] += time.perf_counter() - start


runner_module.ModelRunner.keep_rows = timed_keep_rows  # type: ignore[method-assign]


def serve(new: bool) -> tuple[float, float, float]:
    """(wall s, median time to first token s, time growing caches s) of the whole feed; `new`:
    the feed's new way of growing (else the full gather)."""
    if args.feed == "shrink":
        runner_module._appended_rows = appended_rows if new else (lambda order, rows: None)  # None: the full gather
    else:
        runner_module.ModelRunner._grow_with_room = grow_with_room if new else (lambda self, appended, room: False)  # type: ignore[method-assign]
    growth.update(joins=0, s=0.0)
    rows = 8 if args.feed == "shrink" else args.max_rows
    session = decoder.engine("greedy").session(max_rows=rows)
    feed = list(zip(ids, budgets, strict=True))
    requests = [session.submit(*feed.pop(0)) for _ in range(4 if args.feed == "shrink" else 1)]
    start = time.perf_counter()
    while not session.idle or feed:
        if feed and session.running + len(session.waiting) < rows:
            requests.append(session.submit(*feed.pop(0)))
        session.step()
    return time.perf_counter() - start, statistics.median(r.stats.ttft_s for r in requests), growth["s"]


serve(True)  # warm-up (CAST measures its cost table here)
runs: dict[str, list[tuple[float, float, float]]] = {NEW: [], OLD: []}
for round_ in range(args.rounds):
    for new in (True, False) if round_ % 2 == 0 else (False, True):
        runs[NEW if new else OLD].append(serve(new))
summary = {
    "machine": platform.processor() or platform.machine(),
    "torch_threads": torch.get_num_threads(),
    "method": args.method,
    "feed": args.feed,
    "max_rows": 8 if args.feed == "shrink" else args.max_rows,
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
