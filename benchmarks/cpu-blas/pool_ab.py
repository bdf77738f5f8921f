"""Whole generate calls with and without the CPU storage pool (`specdec.models.static.cpu_pool`),
alternating, fresh engines per call (as each `specdec generate` or a new engine sees).

python benchmarks/cpu-blas/pool_ab.py B METHOD   (e.g. 8 ar)
"""

from __future__ import annotations

import statistics
import sys
import time

import specdec.models.runner as runner_module
from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts
from specdec.sampling import SamplingParams

batch, method = int(sys.argv[1]), sys.argv[2]
decoder = SpeculativeDecoder.from_pretrained(method=method)
prompts = load_prompts("specdec/assets/pair/stdlib-heldout.jsonl", 16)
ids = [decoder.encode(p.turns[0]) for p in prompts][:batch]
if method == "cast":
    decoder.prepare_costs(batch)
original_init = runner_module.ModelRunner.__init__
use_pool = {"on": True}


def init(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    if not use_pool["on"] and not self.static_shapes:
        self._pool = None


runner_module.ModelRunner.__init__ = init
walls: dict[bool, list[float]] = {True: [], False: []}
for repeat in range(6):
    for on in (True, False):
        use_pool["on"] = on
        engine = decoder.make_engine(method)
        start = time.perf_counter()
        engine.generate(ids, 96, SamplingParams(), batch_size=batch)
        if repeat:  # the first pair warms up
            walls[on].append(time.perf_counter() - start)
for on, values in walls.items():
    print(method, batch, "pool" if on else "no pool", f"median {statistics.median(values):.3f} s", " ".join(f"{v:.2f}" for v in values))
