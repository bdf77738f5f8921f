"""Where a batched call's wall time goes: the engine's step records (drafting, verification, the
rest of each step) against the call's wall time, greedy, after two warm-up calls.

    python benchmarks/gpu/wall_parts.py PAIR METHOD BATCH_SIZE ['{"option": value}'] [DEVICE]

PAIR: a `specdec synth-pair` folder (target/, draft/, prompts.jsonl; its first 24 prompts,
64 new tokens each). Prints one line: wall, steps, tokens per second, the step records' sums,
the time outside steps (admissions, prefills) and the steps that drafted nothing.
"""

from __future__ import annotations

import json
import sys
import time

from specdec.api import SpeculativeDecoder
from specdec.sampling import SamplingParams


def main() -> None:
    pair, method, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    device = sys.argv[5] if len(sys.argv) > 5 else "cuda"
    with open(f"{pair}/prompts.jsonl") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()][:24]
    dec = SpeculativeDecoder.from_pretrained(f"{pair}/target", f"{pair}/draft", method=method, device=device, **options)
    ids = [dec.encode(p) for p in prompts]
    params = SamplingParams()
    for _ in range(2):
        dec.generate_ids(ids, 64, params, batch_size=batch)
    t0 = time.perf_counter()
    results = dec.generate_ids(ids, 64, params, batch_size=batch, keep_steps=True)
    wall = time.perf_counter() - t0
    records = results[0].steps
    draft, verify, steps = (sum(getattr(r, name) for r in records) for name in ("draft_s", "verify_s", "step_s"))
    new = sum(len(r.token_ids) for r in results)
    root_only = sum(1 for r in records if max(r.drafted) == 0)
    print(
        f"{method} B={batch} wall {wall:.3f}s steps {len(records)} new {new} tok/s {new / wall:.1f} | draft {draft:.3f} "
        f"verify {verify:.3f} steps_total {steps:.3f} outside_steps {wall - steps:.3f} root_only {root_only}"
    )


if __name__ == "__main__":
    main()
