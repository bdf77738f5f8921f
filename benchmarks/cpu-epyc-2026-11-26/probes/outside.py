"""Per step: wall time outside the step records' step_s (policy feedback, retire/admit, loop), AR vs CAST, rolling B."""
import sys
import time

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.sampling import SamplingParams

B = int(sys.argv[1])
for method in ("ar", "cast"):
    dec = SpeculativeDecoder.from_pretrained(method=method, device="cpu")
    prompts = [dec.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 32)]
    dec.generate_ids(prompts[:B], 16, SamplingParams())
    for _ in range(2):
        t0 = time.perf_counter()
        outs = dec.generate_ids(prompts, 96, SamplingParams(), keep_steps=True, batch_size=B)
        wall = time.perf_counter() - t0
        steps = outs[0].steps
        step_s = sum(s.step_s for s in steps)
        admit = sum(s.admit_s for s in steps)
        plain = [s for s in steps if max(s.drafted) == 0]
        rows = sum(sum(s.committed) for s in steps)
        print(f"{method} B={B}: wall {wall:.2f} s, steps {len(steps)} (plain {len(plain)}), in steps {step_s:.2f} s, admissions {admit:.2f} s, "
              f"outside {wall - step_s - admit:.2f} s = {1e3 * (wall - step_s - admit) / len(steps):.2f} ms/step; tokens {rows}", flush=True)
