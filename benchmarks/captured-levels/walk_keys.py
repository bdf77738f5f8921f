"""How many graph keys a captured walk would have (`specdec.verification.captured`): over a call of
sampled steps tested on the device by traversal, the distinct round widths the walk waits for, and
the distinct keys under two paddings: every round the widest round's node bucket (what
`CapturedWalks.verify` keys by) and each round its own node bucket. Bundled pair, the first 16
`stdlib-heldout` prompts, 64 new tokens, T = 1, seed 0, on the CPU (the keys follow the trees,
not the device).

    python benchmarks/captured-levels/walk_keys.py eagle2 1
    python benchmarks/captured-levels/walk_keys.py dynatree 1
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from specdec.api import SpeculativeDecoder
from specdec.models.static import node_bucket
from specdec.verification import sampling

PROMPTS = Path(__file__).resolve().parents[2] / "specdec/assets/pair/stdlib-heldout.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("method")
    ap.add_argument("batch_size", type=int)
    ap.add_argument("--options", default="{}", help="the method's options, JSON")
    args = ap.parse_args()
    widths_seen: collections.Counter[tuple[int, ...]] = collections.Counter()
    widest: collections.Counter[tuple[int, int]] = collections.Counter()
    per_round: collections.Counter[tuple[int, ...]] = collections.Counter()
    read = sampling.Wavefront.widths

    def counting(self: sampling.Wavefront) -> list[int]:
        widths = read(self)
        widths_seen[tuple(widths)] += 1
        widest[(len(widths), node_bucket(max(widths, default=0)))] += 1
        per_round[tuple(node_bucket(w) for w in widths)] += 1
        return widths

    sampling.Wavefront.widths = counting  # type: ignore[method-assign]
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()][:16]
    decoder = SpeculativeDecoder.from_pretrained(method=args.method, verify="sampling", verify_options={"walk": "device"}, **json.loads(args.options))
    decoder.generate(prompts, max_new_tokens=64, temperature=1.0, seed=0, batch_size=args.batch_size)
    print(
        f"{args.method} B = {args.batch_size}: {sum(widths_seen.values())} walks, {len(widths_seen)} distinct round widths, "
        f"{len(widest)} keys with the widest round's bucket, {len(per_round)} with a bucket per round"
    )


if __name__ == "__main__":
    main()
