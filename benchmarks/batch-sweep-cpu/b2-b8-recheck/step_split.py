"""A method against AR at one batch size, step by step: wall time, the steps' own time, plain and
drafted steps and the tokens each committed (the bundled pair, 16 stdlib-heldout prompts spread
over the file, 96 new tokens, greedy, two timed calls after a warm-up):

    python benchmarks/batch-sweep-cpu/b2-b8-recheck/step_split.py 2 cast
    python benchmarks/batch-sweep-cpu/b2-b8-recheck/step_split.py 2 ar
"""

import json
import sys
import time
from pathlib import Path

from specdec.api import SpeculativeDecoder

batch, method = int(sys.argv[1]), sys.argv[2]
lines = Path("specdec/assets/pair/stdlib-heldout.jsonl").read_text().splitlines()
prompts = [json.loads(lines[int(i * len(lines) / 16)])["prompt"] for i in range(16)]
dec = SpeculativeDecoder.from_pretrained(method=method)
dec.prepare_costs(batch, progress=False)
dec.generate(prompts[:batch], max_new_tokens=32, temperature=0, batch_size=batch)
ids = [dec.tokenizer(p)["input_ids"] for p in prompts]
for _ in range(2):
    start = time.perf_counter()
    outs = dec.engine("greedy").generate(ids, 96, batch_size=batch, keep_steps=True)
    wall = time.perf_counter() - start
    steps = outs[0].steps  # the call's steps (shared by its rows)
    plain = [s for s in steps if max(s.drafted) == 0]
    drafted = [s for s in steps if max(s.drafted) > 0]
    tokens = sum(len(o.token_ids) for o in outs)
    print(
        f"{method} B={batch} wall {wall:.2f} s, {tokens / wall:.1f} tok/s; {len(steps)} steps, {sum(s.step_s for s in steps):.2f} s in steps; "
        f"plain {len(plain)} steps {sum(s.step_s for s in plain):.2f} s {sum(sum(s.committed) for s in plain)} tokens; "
        f"drafted {len(drafted)} steps {sum(s.step_s for s in drafted):.2f} s {sum(sum(s.committed) for s in drafted)} tokens"
    )
