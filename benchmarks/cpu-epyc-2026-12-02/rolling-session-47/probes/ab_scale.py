"""Run from the repository root: .venv/bin/python benchmarks/cpu-epyc-2026-12-02/rolling-session-47/probes/ab_scale.py 16 48 4. Interleaved A/B in one process: AR, CAST (bucket-scaled check), CAST (unscaled: relative cost 1), rolling."""
import statistics
import sys
import time

import torch

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source

torch.set_num_threads(2)
B, N, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
prompts = load_prompts(resolve_prompt_source("stdlib-heldout"), limit=N)
decs = {"ar": SpeculativeDecoder.from_pretrained(method="ar"), "cast": SpeculativeDecoder.from_pretrained(method="cast"), "cast-unscaled": SpeculativeDecoder.from_pretrained(method="cast")}
unscaled_policy = decs["cast-unscaled"].engine("greedy").policy
unscaled_policy._relative_cost = lambda b, ctx: 1.0
ids = [decs["ar"].encode(p.turns[0]) for p in prompts]
for d in decs.values():
    d.generate_ids(ids, 96, batch_size=B)  # warm-up call: the check learns, as in bench
res = {k: [] for k in decs}
for r in range(rounds):
    for k, d in decs.items():
        t = time.perf_counter()
        out = d.generate_ids(ids, 96, batch_size=B)
        w = time.perf_counter() - t
        res[k].append(sum(len(o.token_ids) for o in out) / w)
    print(r, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
ar = res["ar"]
for k, v in res.items():
    print(k, "median tok/s", round(statistics.median(v), 1), "ratio to AR per round", [round(x / a, 3) for x, a in zip(v, ar, strict=False)])
