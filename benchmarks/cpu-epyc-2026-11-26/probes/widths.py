"""Mean committed cache width (slots a row attends over) and rows per target verify forward, rolling vs groups."""
import sys
import time

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.models import runner as runner_mod
from specdec.sampling import SamplingParams

method, B = sys.argv[1], int(sys.argv[2])
dec = SpeculativeDecoder.from_pretrained(method=method, device="cpu")
prompts = [dec.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 64)]
log = []
fwd = runner_mod.ModelRunner.forward


def spy(self, input_ids, *a, **k):
    if self.model is dec.target:
        valid = self.slot_valid
        log.append((self.past_len, valid.shape[0], int(valid.sum(1).max()) if valid.numel() else 0, input_ids.shape[1]))
    return fwd(self, input_ids, *a, **k)


runner_mod.ModelRunner.forward = spy
for mode in ("rolling", "groups"):
    log.clear()
    t0 = time.perf_counter()
    groups = [prompts] if mode == "rolling" else [prompts[i : i + B] for i in range(0, 64, B)]
    for g in groups:
        dec.generate_ids(g, 96, SamplingParams(), batch_size=B)
    wall = time.perf_counter() - t0
    n = len(log)
    print(f"{method} {mode}: wall {wall:.1f}s forwards {n}, mean width {sum(x[0] for x in log) / n:.0f}, mean longest row {sum(x[2] for x in log) / n:.0f}, "
          f"mean rows {sum(x[1] for x in log) / n:.1f}, row-slots {sum(x[0] * x[1] for x in log) / 1e6:.2f}M, tokens {sum(x[1] * x[3] for x in log)}")
