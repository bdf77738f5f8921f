"""AR against CAST in one rolling batch of B rows over 64 held-out prompts: the median wall time of
full-batch steps, plain (nothing drafted) and drafted, and CAST's own plain / drafted timings and
learned overheads afterwards. Usage: plain_steps.py B"""
import statistics
import sys

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.sampling import SamplingParams

B = int(sys.argv[1])


def median_ms(steps, field):
    return statistics.median(field(s) for s in steps) * 1e3


for method in ("ar", "cast"):
    dec = SpeculativeDecoder.from_pretrained(method=method, device="cpu")
    prompts = [dec.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 64)]
    dec.generate_ids(prompts[:B], 16, SamplingParams())
    steps = dec.generate_ids(prompts, 96, SamplingParams(), keep_steps=True, batch_size=B)[0].steps
    for label, plain in (("plain", True), ("drafted", False)):
        full = [s for s in steps if (max(s.drafted) == 0) == plain and sum(s.active) == B]
        if not full:
            continue
        tokens = statistics.mean(sum(s.committed) / B for s in full)
        step_ms = median_ms(full, lambda s: s.step_s)
        print(
            f"{method} {label}: {len(full)} full steps, step {step_ms:.1f} ms, draft {median_ms(full, lambda s: s.draft_s):.1f}, "
            f"verify {median_ms(full, lambda s: s.verify_s):.1f}, tokens/row {tokens:.2f}, ms/token {step_ms / tokens:.1f}",
            flush=True,
        )
    if method == "cast":
        state = dec.policy.state()
        print(state["plain_vs_drafted"], state["overheads_ms"])
