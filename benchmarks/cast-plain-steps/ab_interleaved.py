"""Interleaved A/B of CAST with and without its plain-step check, against batched AR.

Each repeat runs the three decoders (AR, CAST drafting every step, CAST with the check) over
the same prompts at one batch size, in a shuffled order, after one untimed warm-up call each
(which also lets the check time both modes); prints each decoder's median wall time over the
repeats and its ratio to AR's. Greedy, the bundled pair, `stdlib-heldout`.

    python benchmarks/cast-plain-steps/ab_interleaved.py --batch-size 16 --repeats 14
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft", default=None, help="another draft model directory (default: the bundled draft)")
    parser.add_argument("--json", default=None, help="write the per-repeat times here")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    prompts = [p.turns[0] for p in load_prompts(resolve_prompt_source("stdlib-heldout"), args.num_prompts)]
    extra = {"draft": args.draft} if args.draft else {}
    decoders = {
        "ar": SpeculativeDecoder.from_pretrained(method="ar"),
        "cast, drafting every step": SpeculativeDecoder.from_pretrained(method="cast", plain_steps=False, **extra),
        "cast, plain-step check": SpeculativeDecoder.from_pretrained(method="cast", plain_steps=True, **extra),
    }
    ids = [decoders["ar"].tokenizer.encode(p) for p in prompts]
    params = SamplingParams()
    for decoder in decoders.values():  # warm-up: allocations, the cost profile, the check's first timings
        decoder.generate_ids(ids, args.max_new_tokens, params, batch_size=args.batch_size)
    times: dict[str, list[float]] = {name: [] for name in decoders}
    rng = random.Random(0)
    for _ in range(args.repeats):
        order = list(decoders)
        rng.shuffle(order)
        for name in order:
            started = time.perf_counter()
            decoders[name].generate_ids(ids, args.max_new_tokens, params, batch_size=args.batch_size)
            times[name].append(time.perf_counter() - started)
    ar = statistics.median(times["ar"])
    print(f"batch size {args.batch_size}, {args.num_prompts} prompts x {args.max_new_tokens} tokens, {args.repeats} repeats (median wall s; speedup = AR's / its)")
    for name, values in times.items():
        print(f"  {name:28s} {statistics.median(values):7.3f} s  {ar / statistics.median(values):.3f}x AR")
    print("  the check's last timings (ms per committed token, per batch bucket):", decoders["cast, plain-step check"].policy.plain_check.state())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "times_s": times}, f, indent=1)


if __name__ == "__main__":
    main()
