"""Graph captures of a static-shape session whose load moves, with and without row buckets
(`models.static.row_bucket`, `DecodeSession._pad_rows`), on the CPU with emulated graphs.

A `DecodeSession` (max_rows `--max-rows`) of the bundled pair is fed as a server is: before each
step 0-2 prompts arrive (a seeded random draw, the same in both modes) until `--prompts` have come,
each with a budget of 8-40 new tokens, so rows finish at different steps and the batch starts,
grows and ends again. Static shapes, the target's and the draft's forwards traced by `make_fx`
when a key is first met (a capture) and replayed after (`launches.py`'s emulator); drafting levels
run op by op. Printed per mode: graph captures, the batch sizes met, the steps, the row-steps of
rows that decoded nothing (finished riders and padding rows), and whether every output equals
the other mode's.

    python benchmarks/captured-levels/row_buckets.py chain [--max-rows 8] [--prompts 24]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from launches import PROMPTS, Emulator

import specdec.engine as engine_module
from specdec.api import SpeculativeDecoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method")
    ap.add_argument("--max-rows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    bucket = engine_module.row_bucket
    results: dict[str, Any] = {}
    for mode in ("row buckets", "every size"):
        engine_module.row_bucket = bucket if mode == "row buckets" else (lambda rows, limit=None: rows)  # type: ignore[assignment]
        decoder = SpeculativeDecoder.from_pretrained(method=args.method, static_shapes=True)
        engine = decoder.engine("greedy")
        emulators = [Emulator(), Emulator()]
        engine.target.graphs, engine.source.runner.graphs = emulators
        engine.target.time_forwards = engine.source.runner.time_forwards = False
        ids = [decoder.encode(texts[i % len(texts)])[:96] for i in range(args.prompts)]
        rng = random.Random(args.seed)
        arrivals = [rng.choice((0, 0, 1, 2)) for _ in range(10 * args.prompts)]
        budgets = [rng.randint(8, 40) for _ in ids]
        session = engine.session(max_rows=args.max_rows, keep_steps=True)
        requests, fed = [], 0
        for arriving in arrivals:
            for _ in range(min(arriving, len(ids) - fed)):
                requests.append(session.submit(ids[fed], budgets[fed]))
                fed += 1
            session.step()
            if fed == len(ids) and session.idle:
                break
        while not session.idle:
            session.step()
        records = session.records
        results[mode] = {
            "captures": sum(e.captures for e in emulators),
            "batch_sizes": sorted({len(r.active) for r in records}),
            "steps": len(records),
            "idle_row_steps": sum(len(r.active) - sum(r.active) for r in records),
            "row_steps": sum(len(r.active) for r in records),
            "outputs": [r.token_ids for r in requests],
        }
    same = results["row buckets"]["outputs"] == results["every size"]["outputs"]
    for mode, r in results.items():
        print(
            f"{args.method} max_rows {args.max_rows}, {mode}: {r['captures']} captures, batch sizes {r['batch_sizes']}, {r['steps']} steps, "
            f"{r['idle_row_steps']} of {r['row_steps']} row-steps decoded nothing; outputs equal across modes: {same}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"method": args.method, "max_rows": args.max_rows, "prompts": args.prompts, "seed": args.seed, "same_outputs": same,
                                              **{m: {k: v for k, v in r.items() if k != "outputs"} for m, r in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
