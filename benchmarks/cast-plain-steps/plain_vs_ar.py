"""Per-step wall time with every step plain: CAST (its plain check forced to plain) against AR,
B rows, engines alternating; full-batch steps only.

python benchmarks/cast-plain-steps/plain_vs_ar.py B   (e.g. 8)
"""

from __future__ import annotations

import statistics
import sys
import time

import specdec.engine as engine_module
from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts
from specdec.drafting.cast import PlainDecodingCheck
from specdec.sampling import SamplingParams

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 8
steps: list[tuple[float, float, float, int]] = []  # (wall s, draft s, verify s, active rows)
original_step = engine_module.DecodeSession._decode_step


def timed_step(self):
    start = time.perf_counter()
    record = original_step(self)
    steps.append((time.perf_counter() - start, record.draft_s, record.verify_s, sum(record.active)))
    return record


engine_module.DecodeSession._decode_step = timed_step


class AlwaysPlain(PlainDecodingCheck):
    def plain_next(self, batch, predicted_plain=None):
        return True


decoder = SpeculativeDecoder.from_pretrained(method="cast")
ids = [decoder.encode(p.turns[0])[-160:] for p in load_prompts("specdec/assets/pair/stdlib-heldout.jsonl", batch)]
decoder.prepare_costs(batch)
engines = {m: decoder.make_engine(m) for m in ("ar", "cast")}
engines["cast"].policy.plain_check = AlwaysPlain()
medians: dict[str, list[tuple[float, float]]] = {m: [] for m in engines}
for repeat in range(5):
    for name, engine in engines.items():
        steps.clear()
        engine.generate(ids, 48, SamplingParams(), batch_size=batch)
        most = max(s[3] for s in steps)
        full = [s for s in steps if s[3] == most]
        if repeat:
            medians[name].append((statistics.median(s[0] for s in full) * 1e3, statistics.median(s[2] for s in full) * 1e3))
for name, values in medians.items():
    print(name, f"step {statistics.median(v[0] for v in values):.2f} ms, verify {statistics.median(v[1] for v in values):.2f} ms (medians over calls of full-batch step medians)")
