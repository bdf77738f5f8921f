"""Run from the repository root: .venv/bin/python benchmarks/cpu-epyc-2026-12-02/rolling-session-47/probes/probe_check.py 16 48. Log every observation of CAST's plain check in a rolling B=16 run; compare with naive per-mode rates."""
import json
import sys

import torch

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.drafting import cast as castmod

torch.set_num_threads(2)
B, N = int(sys.argv[1]), int(sys.argv[2])
prompts = load_prompts(resolve_prompt_source("stdlib-heldout"), limit=N)
dec = SpeculativeDecoder.from_pretrained(method="cast")
ids = [dec.encode(p.turns[0]) for p in prompts]
log = []
orig = castmod.PlainDecodingCheck.observe
def observe(self, batch, plain, step_ms, tokens, expected=None, rel=1.0):
    log.append((batch, plain, step_ms / rel, tokens, expected))
    return orig(self, batch, plain, step_ms, tokens, expected, rel)
castmod.PlainDecodingCheck.observe = observe
dec.generate_ids(ids[:B], 16, batch_size=B)
log.clear()
res = dec.generate_ids(ids, 96, batch_size=B, keep_steps=True)
for bucket in (8, 16):
    for plain in (True, False):
        obs = [o for o in log if castmod.batch_bucket(o[0]) == bucket and o[1] == plain]
        full = [o for o in obs if o[0] == B]
        if obs:
            print(bucket, "plain" if plain else "drafted", len(obs), "all rows Σms/Σtok", round(sum(o[2] for o in obs) / sum(o[3] for o in obs), 2),
                  "at B rows", len(full), round(sum(o[2] for o in full) / max(1e-9, sum(o[3] for o in full)), 2),
                  "Σexp/Σtok", round(sum((o[4] or o[3]) for o in obs) / sum(o[3] for o in obs), 3))
print(json.dumps({k: {kk: (round(vv, 2) if isinstance(vv, float) else vv) for kk, vv in v.items()} for k, v in dec.engine("greedy").policy.state()["plain_vs_drafted"].items() if k >= 8}))
seq = "".join("p" if o[1] else "D" for o in log if o[0] == B)
print(seq)
with open(f"/tmp/check_log_b{B}.json", "w") as f:
    json.dump(log, f)
