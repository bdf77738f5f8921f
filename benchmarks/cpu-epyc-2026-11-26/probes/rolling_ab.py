"""Same process, alternating: AR (or METHOD) over 64 held-out prompts as groups of B vs one rolling batch of B rows.
Prints wall, prefill (sum of admissions), steps and decode time per mode."""
import statistics
import sys
import time

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.sampling import SamplingParams
from specdec.stats import batch_stats

method = sys.argv[1] if len(sys.argv) > 1 else "ar"
B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
n = int(sys.argv[4]) if len(sys.argv) > 4 else 64
dec = SpeculativeDecoder.from_pretrained(method=method, device="cpu")
prompts = [dec.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), n)]
params = SamplingParams()
dec.generate_ids(prompts[:B], 16, params)


def run(mode):
    t0 = time.perf_counter()
    prefill = steps = decode = 0.0
    tokens = 0
    groups = [prompts] if mode == "rolling" else [prompts[i : i + B] for i in range(0, len(prompts), B)]
    for g in groups:
        outs = dec.generate_ids(g, 96, params, keep_steps=True, batch_size=B)
        st = batch_stats([o.stats for o in outs], steps=outs[0].steps)
        prefill += st.prefill_s
        steps += st.steps
        decode += st.draft_s + st.verify_s
        tokens += st.new_tokens
    wall = time.perf_counter() - t0
    return wall, prefill, steps, decode, tokens


res = {"groups": [], "rolling": []}
for r in range(rounds):
    for mode in (("groups", "rolling") if r % 2 == 0 else ("rolling", "groups")):
        res[mode].append(run(mode))
        w, p, s, d, t = res[mode][-1]
        print(f"{mode:8s} wall {w:6.2f} s  prefill {p:5.2f}  decode {d:6.2f}  other {w - p - d:5.2f}  steps {s:5.0f}  tok/s {t / w:6.1f}", flush=True)
for mode, rows in res.items():
    print(mode, "median wall", statistics.median(x[0] for x in rows), "prefill", statistics.median(x[1] for x in rows), "steps", statistics.median(x[2] for x in rows))
print("rolling/groups wall", statistics.median(x[0] for x in res["rolling"]) / statistics.median(x[0] for x in res["groups"]))
