"""The CPU storage pool lending by bytes (any released storage that holds the new cache) against
by exact shape (the pool before 2026-12-02), alternating in one process, as a grouped bench run
meets it: each timed call of B prompts follows a call of B other prompts (another width), whose
batch shrank as its rows finished.

python benchmarks/cpu-pool-by-bytes/pool_fit_ab.py METHOD B ROUNDS [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.models import static
from specdec.sampling import SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("method")
parser.add_argument("batch", type=int)
parser.add_argument("rounds", type=int)
parser.add_argument("--out")
args = parser.parse_args()

decoder = SpeculativeDecoder.from_pretrained(method=args.method)
prompts = [p.turns[0] for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 2 * args.batch)]
ids = [decoder.encode(p) for p in prompts]
timed, other = ids[: args.batch], ids[args.batch :]
params = SamplingParams()
decoder.generate_ids(timed, 96, params, batch_size=args.batch)  # warm-up (CAST measures its cost table here)


def lend_by_bytes(on: bool) -> None:
    for pool in static._CPU_POOLS.values():
        pool.by_bytes = on
        pool.free.clear()


walls: dict[str, list[float]] = {"by bytes": [], "exact shapes": []}
admits: dict[str, list[float]] = {"by bytes": [], "exact shapes": []}
for round_ in range(args.rounds):
    for on in (True, False) if round_ % 2 == 0 else (False, True):
        name = "by bytes" if on else "exact shapes"
        lend_by_bytes(on)
        decoder.generate_ids(other, 96, params, batch_size=args.batch)  # leaves its (shrunk) storage in the pool
        start = time.perf_counter()
        outs = decoder.generate_ids(timed, 96, params, batch_size=args.batch, keep_steps=True)
        walls[name].append(time.perf_counter() - start)
        admits[name].append(sum(record.admit_s for record in outs[0].steps))
summary = {
    "machine": platform.processor() or platform.machine(),
    "torch_threads": torch.get_num_threads(),
    "method": args.method,
    "batch": args.batch,
    "rounds": args.rounds,
    "wall_s": walls,
    "admit_s": admits,
    "median_wall_s": {k: statistics.median(v) for k, v in walls.items()},
    "median_admit_s": {k: statistics.median(v) for k, v in admits.items()},
}
for name in walls:
    print(
        f"{args.method} B={args.batch} {name}: median call {summary['median_wall_s'][name]:.3f} s (admission {summary['median_admit_s'][name]:.3f} s);"
        f" calls {' '.join(f'{w:.2f}' for w in walls[name])}"
    )
if args.out:
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
