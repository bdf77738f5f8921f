"""AR, CAST with max_draft_rows=1 (every step with more than one row plain) and CAST, alternating
over two rounds in one process: one rolling batch of B rows over 64 held-out prompts each; wall
time, admissions, and the median full-batch step's parts. Usage: plain_only.py B"""
import statistics
import sys
import time

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.sampling import SamplingParams

B = int(sys.argv[1])
cast = SpeculativeDecoder.from_pretrained(method="cast", device="cpu")
prompts = [cast.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 64)]
decoders = {
    "ar": SpeculativeDecoder(cast.target, cast.tokenizer, cast.draft, method="ar"),
    "cast-plain": SpeculativeDecoder(cast.target, cast.tokenizer, cast.draft, method="cast", max_draft_rows=1),
    "cast": cast,
}
for dec in decoders.values():
    dec.generate_ids(prompts[:B], 16, SamplingParams())


def median_ms(steps, field):
    return statistics.median(field(s) for s in steps) * 1e3


for _ in range(2):
    for label, dec in decoders.items():
        t0 = time.perf_counter()
        steps = dec.generate_ids(prompts, 96, SamplingParams(), keep_steps=True, batch_size=B)[0].steps
        wall = time.perf_counter() - t0
        full = [s for s in steps if sum(s.active) == B]
        print(
            f"{label:10s} wall {wall:5.1f} s admit {sum(s.admit_s for s in steps):4.1f} s in-steps {sum(s.step_s for s in steps):5.1f} s "
            f"steps {len(steps)}; full steps {len(full)}: step {median_ms(full, lambda s: s.step_s):.1f} ms "
            f"draft {median_ms(full, lambda s: s.draft_s):.1f} verify {median_ms(full, lambda s: s.verify_s):.1f} "
            f"other {median_ms(full, lambda s: s.step_s - s.draft_s - s.verify_s):.1f}",
            flush=True,
        )
