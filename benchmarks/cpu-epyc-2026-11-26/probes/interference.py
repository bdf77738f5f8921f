"""Does running other methods in the same process (shared models and KV storage pool, as `specdec
bench` does) slow CAST down? CAST alone, then each of METHODS, then CAST again; one rolling batch of
16 rows over 64 held-out prompts each. Usage: interference.py METHODS (comma-separated)"""
import statistics
import sys
import time

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.sampling import SamplingParams

B = 16
base = SpeculativeDecoder.from_pretrained(method="cast", device="cpu")
prompts = [base.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 64)]
others = {m: SpeculativeDecoder(base.target, base.tokenizer, base.draft, method=m) for m in sys.argv[1].split(",")}


def run(dec, label):
    t0 = time.perf_counter()
    steps = dec.generate_ids(prompts, 96, SamplingParams(), keep_steps=True, batch_size=B)[0].steps
    wall = time.perf_counter() - t0
    full = [s for s in steps if sum(s.active) == B and max(s.drafted) > 0]
    if not full:
        print(f"{label}: wall {wall:.1f} s, steps {len(steps)}, no full drafted step", flush=True)
        return
    draft, verify = (statistics.median(f(s) for s in full) * 1e3 for f in (lambda s: s.draft_s, lambda s: s.verify_s))
    nodes = statistics.median(sum(s.drafted) / B for s in full)
    print(f"{label}: wall {wall:.1f} s, steps {len(steps)}, full drafted steps {len(full)}: draft {draft:.1f} ms, verify {verify:.1f} ms, drafted/row {nodes:.1f}", flush=True)


base.generate_ids(prompts[:B], 16, SamplingParams())
run(base, "cast alone")
for m, dec in others.items():
    dec.generate_ids(prompts[:B], 16, SamplingParams())
    run(dec, m)
run(base, "cast after")
state = base.policy.state()
print(state["plain_vs_drafted"][B], state["overheads_ms"])
