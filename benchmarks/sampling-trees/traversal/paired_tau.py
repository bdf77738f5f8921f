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

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
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
    ap = argparse.ArgumentParser()
    ap.add_argument("method")
    ap.add_argument("options", nargs="*", help="NAME=VALUE policy options")
    ap.add_argument("--trees", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=500)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(2)
    options = {k: int(v) if v.isdigit() else v for k, v in (kv.split("=") for kv in args.options)}
    decoder = SpeculativeDecoder.from_pretrained(method=args.method, **options)
    engine = decoder.engine("sampling")
    engine.rule = SamplingRule(walk="device")
    caught: list[tuple[TokenTree, torch.Tensor, SamplingParams]] = []
    steps = [0]
    verify = engine.rule.verify

    def keep(tree, logits, params, generator):
        if len(caught) < args.trees and tree.batch_size == 1 and steps[0] % 3 == 0 and tree.num_nodes > 1 and not tree.chain:
            caught.append((tree, logits.clone(), params))
        steps[0] += 1
        return verify(tree, logits, params, generator)

    engine.rule.verify = keep
    prompts = [p.turns[0] for p in load_prompts(resolve_prompt_source("stdlib-heldout"), args.prompts)]
    for i, prompt in enumerate(prompts):
        engine.generate([decoder.tokenizer.encode(prompt)], 96, SamplingParams(temperature=args.temperature), seed=i)
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
