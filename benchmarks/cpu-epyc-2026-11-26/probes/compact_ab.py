"""KV compaction's waste threshold, A/B in one process: METHOD in one rolling batch of B rows over
64 held-out prompts, with `compact_if_wasteful` at its default (max_waste 0.25), off, and at other
thresholds, in alternating order over ROUNDS rounds. Usage: compact_ab.py B [METHOD] [ROUNDS] [THRESHOLDS]
(THRESHOLDS: comma-separated max_waste values besides the default; "off" for no compaction)"""
import statistics
import sys
import time

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.models.runner import ModelRunner
from specdec.sampling import SamplingParams

B = int(sys.argv[1])
method = sys.argv[2] if len(sys.argv) > 2 else "cast"
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
others = sys.argv[4].split(",") if len(sys.argv) > 4 else ["off", "0.5"]
default = ModelRunner.compact_if_wasteful


def with_threshold(max_waste):
    return lambda self, max_waste_=0.25, min_slots=64: default(self, max_waste, min_slots)


modes = {"0.25": default, **{m: (lambda self, *a, **k: None) if m == "off" else with_threshold(float(m)) for m in others}}
dec = SpeculativeDecoder.from_pretrained(method=method, device="cpu")
prompts = [dec.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 64)]
dec.generate_ids(prompts[:B], 16, SamplingParams())
walls = {m: [] for m in modes}
for r in range(rounds):
    for m in list(modes) if r % 2 == 0 else list(modes)[::-1]:
        ModelRunner.compact_if_wasteful = modes[m]
        t0 = time.perf_counter()
        steps = dec.generate_ids(prompts, 96, SamplingParams(), keep_steps=True, batch_size=B)[0].steps
        walls[m].append(time.perf_counter() - t0)
        print(
            f"{m:5s} wall {walls[m][-1]:.2f} s, steps {len(steps)}, draft {sum(s.draft_s for s in steps):.2f} s, "
            f"verify {sum(s.verify_s for s in steps):.2f} s, admissions {sum(s.admit_s for s in steps):.2f} s",
            flush=True,
        )
ModelRunner.compact_if_wasteful = default
for m, w in walls.items():
    print(m, "median wall", round(statistics.median(w), 2))
