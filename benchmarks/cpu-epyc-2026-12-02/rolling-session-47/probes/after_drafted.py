"""Run from the repository root: .venv/bin/python benchmarks/cpu-epyc-2026-12-02/rolling-session-47/probes/after_drafted.py 4. CAST with a forced pattern D p p p p (plain steps by position after a drafted step) vs AR steps, same process, B rows."""
import statistics
import sys

import torch

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.drafting import cast as castmod

torch.set_num_threads(2)
B = int(sys.argv[1])
prompts = load_prompts(resolve_prompt_source("stdlib-heldout"), limit=B)
PERIOD = 5
class Pattern(castmod.PlainDecodingCheck):
    def plain_next(self, batch, predicted_plain=None, relative_cost=1.0):
        self.calls = getattr(self, "calls", -1) + 1
        return self.calls % PERIOD != 0
ar = SpeculativeDecoder.from_pretrained(method="ar")
cast = SpeculativeDecoder.from_pretrained(method="cast")
ids = [ar.encode(p.turns[0]) for p in prompts]
cast.generate_ids(ids, 32, batch_size=B)
eng_c = cast.engine("greedy")
eng_c.policy.plain_check = Pattern()
eng_a = ar.engine("greedy")
sa, sc = eng_a.session(max_rows=B, keep_steps=True), eng_c.session(max_rows=B, keep_steps=True)
for p in ids:
    sa.submit(p, 400)
    sc.submit(p, 400)
for _ in range(10):
    for s in (sa, sc):
        for _ in range(PERIOD):
            s.step()
ra, rc = sa.records[-50:], sc.records[-50:]
def med(xs):
    return round(statistics.median(xs) * 1e3, 2)
print("AR verify", med([r.verify_s for r in ra]), "step", med([r.step_s for r in ra]))
for pos in range(PERIOD):
    rs = [r for i, r in enumerate(rc) if i % PERIOD == pos]
    print("CAST pos", pos, "drafted" if sum(rs[0].drafted) else "plain", "verify", med([r.verify_s for r in rs]), "draft", med([r.draft_s for r in rs]), "step", med([r.step_s for r in rs]))
