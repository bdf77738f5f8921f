"""Where a rolling batch's admissions spend their time: ModelRunner.replace_rows, its _left_pad,
keep_rows and compaction, over generate(64 prompts, batch_size=B). Usage: admit_parts.py METHOD B"""
import collections
import sys
import time

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.models import runner as runner_mod
from specdec.sampling import SamplingParams

method, B = sys.argv[1], int(sys.argv[2])
dec = SpeculativeDecoder.from_pretrained(method=method, device="cpu")
prompts = [dec.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 64)]
totals = collections.defaultdict(float)
counts = collections.Counter()


def timed(name):
    fn = getattr(runner_mod.ModelRunner, name)

    def wrapper(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return fn(self, *a, **k)
        finally:
            totals[name] += time.perf_counter() - t0
            counts[name] += 1

    setattr(runner_mod.ModelRunner, name, wrapper)


for name in ("replace_rows", "_left_pad", "_grow_right", "keep_rows", "_compact_from", "prefill"):
    if hasattr(runner_mod.ModelRunner, name):
        timed(name)
dec.generate_ids(prompts[:B], 16, SamplingParams())
for mode in ("rolling", "groups"):
    totals.clear()
    counts.clear()
    t0 = time.perf_counter()
    groups = [prompts] if mode == "rolling" else [prompts[i : i + B] for i in range(0, 64, B)]
    for g in groups:
        dec.generate_ids(g, 96, SamplingParams(), batch_size=B)
    wall = time.perf_counter() - t0
    print(f"{method} B={B} {mode}: wall {wall:.2f} s; " + ", ".join(f"{k} {v:.2f} s/{counts[k]}" for k, v in sorted(totals.items())), flush=True)
