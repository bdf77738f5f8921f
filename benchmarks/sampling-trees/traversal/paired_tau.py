"""Traversal verification against recursive rejection sampling, on the same sampled trees.

Like `../block-segments/paired_tau.py` (whose tree capture and replication it reuses): runs a tree
method on the bundled pair at T = 1, keeps every third step's tree with its target logits (batch
1, up to `--trees`), replicates each tree over `--rows` rows and verifies it on the host walk with
three rules: child by child (recursive rejection sampling), chain segments as blocks (the host
default before traversal), and traversal verification (`segments="traversal"`). The same trees
for every rule: a paired measurement with no drafting noise. Reports each rule's mean accepted
tokens per tree and overall.

    python benchmarks/sampling-trees/traversal/paired_tau.py eagle2 --trees 40 --prompts 8
    python benchmarks/sampling-trees/traversal/paired_tau.py dynatree free_tokens=64 --trees 40 --prompts 8
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from specdec.verification import SamplingRule

_spec = importlib.util.spec_from_file_location("block_paired", Path(__file__).resolve().parents[1] / "block-segments" / "paired_tau.py")
assert _spec is not None and _spec.loader is not None
block_paired = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(block_paired)

RULES = {
    "token": dict(walk="host", segments="token"),
    "block": dict(walk="host", segments="block"),
    "traversal": dict(segments="traversal"),
}


def main() -> None:
    args = block_paired.arguments(temperature=True)
    options, caught = block_paired.capture(args, args.temperature, branching_only=True)
    per_tree = []
    for j, (tree, logits, params) in enumerate(caught):
        big, big_logits = block_paired.replicate(tree, args.rows), logits.expand(args.rows, *logits.shape[1:]).contiguous()
        row: dict[str, float | int] = {"nodes": int(tree.valid.sum())}
        for name, kw in RULES.items():
            v = SamplingRule(**kw).verify(big, big_logits, params, torch.Generator().manual_seed(1000 + j))
            row[name] = float(v.accepted_len.double().mean())
        per_tree.append(row)
        print(j, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    summary: dict[str, float | int] = {name: float(np.mean([r[name] for r in per_tree])) for name in RULES}
    summary.update(
        trees=len(per_tree),
        mean_nodes=float(np.mean([r["nodes"] for r in per_tree])),
        traversal_over_token=summary["traversal"] / summary["token"],
        traversal_over_block=summary["traversal"] / summary["block"],
    )
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"method": args.method, "options": options, "temperature": args.temperature, "rows": args.rows, "summary": summary, "per_tree": per_tree}, f, indent=1)


if __name__ == "__main__":
    main()
