"""A/B of the plain check's early plain timing at a rolling batch's tail (B = 8, bundled pair).

`cast` times a plain step at once where the cost model predicts it faster than the drafted
steps timed so far at a batch bucket; `cast-wait` (the earlier rule) waits for 16 drafted steps
there. Both engines and AR run on the same prompt groups in one process, alternating; per call,
the steps' wall time is split by mode: drafted / plain / catch-up (the drafted step after plain
ones) while 6 or more rows run, and the tail (fewer rows: the rows still running after the
others finished). With `fresh`, every call gets new engines (new policies: what one
`specdec generate` call over a batch of prompts sees); without, the engines and what their
policies learned persist across calls (a server, or the bench's repeated calls).
Usage: python benchmarks/cast-plain-steps/tail_ab.py [repeats] [fresh]
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time

import torch

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts
from specdec.sampling import SamplingParams

BATCH = 8
repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 4
fresh = "fresh" in sys.argv[2:]
torch.set_num_threads(2)
dec = SpeculativeDecoder.from_pretrained(method="cast")
prompts = load_prompts("specdec/assets/pair/stdlib-heldout.jsonl", 16)
ids = [list(dec.encode(p.turns[0]))[-160:] for p in prompts]
dec.prepare_costs(BATCH, progress=False)


def make_engines() -> dict:
    engines = {m: dec.make_engine(m) for m in ("ar", "cast")}
    engines["cast-wait"] = dec.make_engine("cast")
    engines["cast-wait"].policy._predicted_plain_ms = lambda batch, ctx: None  # the earlier rule
    return engines


engines = make_engines()
walls: dict[str, list[float]] = collections.defaultdict(list)
tails: dict[str, list[float]] = collections.defaultdict(list)
for rep in range(repeats + 1):
    for group in (0, 1):
        if fresh:
            engines = make_engines()
        for name, engine in engines.items():
            t0 = time.perf_counter()
            outs = engine.generate(ids[group * BATCH : (group + 1) * BATCH], 96, SamplingParams(), batch_size=BATCH, keep_steps=True)
            wall = time.perf_counter() - t0
            if rep == 0:
                continue  # warm-up
            modes: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
            previous_plain = False
            for r in outs[0].steps:
                active = sum(r.active)
                if active < 6:
                    mode = "tail"
                else:
                    plain = max(r.drafted) == 0
                    mode = "plain" if plain else ("catch-up" if previous_plain else "drafted")
                    previous_plain = plain
                modes[mode][0] += 1
                modes[mode][1] += r.step_s * 1e3
                modes[mode][2] += sum(r.committed) / active
            walls[f"{name} g{group}"].append(wall * 1e3)
            tails[f"{name} g{group}"].append(modes["tail"][1] if "tail" in modes else 0.0)
            split = "  ".join(f"{k} {int(v[0])} steps {v[1] / v[2]:.2f} ms/token" for k, v in sorted(modes.items()))
            print(f"rep {rep} {name:9s} g{group} wall {wall * 1e3:7.1f} ms  {split}", flush=True)
summary = {k: {"wall_ms_median": statistics.median(v), "tail_ms_median": statistics.median(tails[k])} for k, v in sorted(walls.items())}
print(json.dumps(summary, indent=1))
