"""Per-step wall time at B = 8 in CAST's default (mixed) mode against AR: median wall and verify
time of CAST's plain and drafted steps and of AR's steps, over steps with (nearly) every row
active, three alternating calls each.

python benchmarks/cast-plain-steps/mixed_plain.py
"""

from __future__ import annotations

import statistics
import time

import specdec.engine as engine_module
from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts
from specdec.sampling import SamplingParams

BATCH = 8
steps: list[tuple[float, bool, int, float]] = []  # (wall s, plain, active rows, verify s)
original_step = engine_module.DecodeSession._decode_step


def timed_step(self):
    start = time.perf_counter()
    record = original_step(self)
    steps.append((time.perf_counter() - start, record.tree_depth == 0, sum(record.active), record.verify_s))
    return record


engine_module.DecodeSession._decode_step = timed_step
decoder = SpeculativeDecoder.from_pretrained(method="cast")
ids = [decoder.encode(p.turns[0]) for p in load_prompts("specdec/assets/pair/stdlib-heldout.jsonl", 16)][:BATCH]
decoder.prepare_costs(BATCH)
engines = {m: decoder.make_engine(m) for m in ("ar", "cast")}
for engine in engines.values():
    engine.generate(ids, 96, SamplingParams(), batch_size=BATCH)  # warm-up
for _ in range(3):
    for name, engine in engines.items():
        steps.clear()
        engine.generate(ids, 96, SamplingParams(), batch_size=BATCH)
        most = max(s[2] for s in steps)
        full = [s for s in steps if s[2] >= most - 1]
        for label, group in (("plain", [s for s in full if s[1]]), ("drafted", [s for s in full if not s[1]])):
            if group:
                wall = statistics.median(s[0] for s in group) * 1e3
                verify = statistics.median(s[3] for s in group) * 1e3
                print(f"{name} {label}: {len(group)} steps, wall {wall:.2f} ms, verify {verify:.2f} ms")
