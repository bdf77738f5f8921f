"""Where a rolling batch's time goes, by function: AR then CAST, one rolling batch of B rows over
64 held-out prompts each; total time and calls of the policy's draft / feedback / plan_ahead, the
draft source's step end and prefills, the runners' forwards, commits, compactions and row moves,
and the session's admissions. Usage: step_parts.py B [plain] ("plain": AR against CAST with
max_draft_rows=1, every step with more than one row plain, alternating over two rounds)"""
import collections
import sys
import time

from specdec import engine as engine_mod
from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.models.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.sources import ModelDraftSource

B = int(sys.argv[1])
plain = len(sys.argv) > 2 and sys.argv[2] == "plain"
totals = collections.defaultdict(float)
counts = collections.Counter()


def timed(cls, name, label):
    fn = getattr(cls, name)

    def wrapper(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return fn(self, *a, **k)
        finally:
            totals[label] += time.perf_counter() - t0
            counts[label] += 1

    setattr(cls, name, wrapper)


cast = SpeculativeDecoder.from_pretrained(method="cast", device="cpu")
prompts = [cast.encode(p.turns[0]) for p in load_prompts(resolve_prompt_source("stdlib-heldout"), 64)]
ar = SpeculativeDecoder(cast.target, cast.tokenizer, cast.draft, method="ar")
cast_plain = SpeculativeDecoder(cast.target, cast.tokenizer, cast.draft, method="cast", max_draft_rows=1)
for name in ("feedback", "plan_ahead", "draft", "note_plain_step"):
    timed(type(cast.policy), name, "policy." + name)
for name in ("end_step", "keep_rows", "prefill"):
    timed(ModelDraftSource, name, "source." + name)
for name in ("commit", "forward", "keep_rows", "compact_if_wasteful"):
    timed(ModelRunner, name, "runner." + name)
for name in ("_retire_and_admit", "_decode_step", "_admit"):
    timed(engine_mod.DecodeSession, name, name)
runs = ((ar, "ar"), (cast_plain, "cast-plain")) * 2 if plain else ((ar, "ar"), (cast, "cast"))
for dec, label in runs:
    dec.generate_ids(prompts[:B], 16, SamplingParams())
    totals.clear()
    counts.clear()
    t0 = time.perf_counter()
    steps = dec.generate_ids(prompts, 96, SamplingParams(), keep_steps=True, batch_size=B)[0].steps
    wall = time.perf_counter() - t0
    print(f"{label}: wall {wall:.2f} s, steps {len(steps)}, draft {sum(s.draft_s for s in steps):.2f} s, verify {sum(s.verify_s for s in steps):.2f} s")
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"   {k:28s} {v:6.2f} s / {counts[k]:5d} = {1e3 * v / max(1, counts[k]):6.2f} ms")
