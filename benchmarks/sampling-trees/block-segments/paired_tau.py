"""Paired comparison of the tree rules on the same sampled trees.

Runs a tree method on the bundled pair at T = 1 (device walk, child by child), keeps every third
step's tree with its target logits (batch 1, up to `--trees`), replicates each tree over `--rows`
rows and verifies it with four rules: child by child and block segments, each on the host walk and
on the device (`SamplingRule(walk=..., segments=...)`). Reports each rule's mean accepted tokens
per tree and overall (the same trees for every rule: a paired measurement with no drafting noise),
and two-sample chi-square p-values of the verdicts (accepted path, bonus) between the walks of one
rule (they implement the same algorithm, so their verdicts must follow one distribution).

    python benchmarks/sampling-trees/block-segments/paired_tau.py eagle2 --trees 40 --prompts 8
    python benchmarks/sampling-trees/block-segments/paired_tau.py dynatree free_tokens=64 --trees 40 --prompts 8
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np
import torch
from scipy.stats import chi2_contingency

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from specdec.verification import SamplingRule

RULES = {
    "host-token": dict(walk="host", segments="token"),
    "host-block": dict(walk="host", segments="block"),
    "device-token": dict(walk="device", segments="token"),
    "device-block": dict(walk="device", segments="block"),
}


def replicate(tree: TokenTree, rows: int) -> TokenTree:
    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.expand(rows, *t.shape[1:]).contiguous()

    return TokenTree(
        tokens=rep(tree.tokens), parents=rep(tree.parents), depths=rep(tree.depths), logq=rep(tree.logq), cum_logq=rep(tree.cum_logq),
        valid=rep(tree.valid), sampled=rep(tree.sampled), draft_logprobs=None if tree.draft_logprobs is None else rep(tree.draft_logprobs),
        depth_bound=tree.depth_bound, max_children=tree.max_children, chain=tree.chain,
    )


def pvalue(a: collections.Counter, b: collections.Counter) -> float:
    keys = sorted(set(a) | set(b))
    return float(chi2_contingency(np.array([[a[k] for k in keys], [b[k] for k in keys]], dtype=float))[1])


def arguments(temperature: bool = False) -> argparse.Namespace:
    """The command line both paired scripts take (method, options, --trees, --prompts, --rows, --out)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("method")
    ap.add_argument("options", nargs="*", help="NAME=VALUE policy options")
    ap.add_argument("--trees", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=500)
    if temperature:
        ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out")
    return ap.parse_args()


def capture(args: argparse.Namespace, temperature: float = 1.0, branching_only: bool = False) -> tuple[dict, list[tuple[TokenTree, torch.Tensor, SamplingParams]]]:
    """(the policy options, every third step's tree with its target logits at batch 1, up to
    args.trees): the method run on the bundled pair over args.prompts prompts, device walk."""
    torch.set_num_threads(2)
    options = {k: int(v) if v.isdigit() else v for k, v in (kv.split("=") for kv in args.options)}
    decoder = SpeculativeDecoder.from_pretrained(method=args.method, **options)
    engine = decoder.engine("sampling")
    engine.rule = SamplingRule(walk="device")
    caught: list[tuple[TokenTree, torch.Tensor, SamplingParams]] = []
    steps = [0]
    verify = engine.rule.verify

    def keep(tree, logits, params, generator):
        if len(caught) < args.trees and tree.batch_size == 1 and steps[0] % 3 == 0 and tree.num_nodes > 1 and not (branching_only and tree.chain):
            caught.append((tree, logits.clone(), params))
        steps[0] += 1
        return verify(tree, logits, params, generator)

    engine.rule.verify = keep
    prompts = [p.turns[0] for p in load_prompts(resolve_prompt_source("stdlib-heldout"), args.prompts)]
    for i, prompt in enumerate(prompts):
        engine.generate([decoder.tokenizer.encode(prompt)], 96, SamplingParams(temperature=temperature), seed=i)
    return options, caught


def main() -> None:
    args = arguments()
    options, caught = capture(args)
    per_tree = []
    for j, (tree, logits, params) in enumerate(caught):
        big, big_logits = replicate(tree, args.rows), logits.expand(args.rows, *logits.shape[1:]).contiguous()
        counts, means = {}, {}
        for name, kw in RULES.items():
            v = SamplingRule(**kw).verify(big, big_logits, params, torch.Generator().manual_seed(1000 + j))
            lengths, paths, bonus = v.accepted_len.tolist(), v.path.tolist(), v.bonus_tokens.tolist()
            counts[name] = collections.Counter((tuple(paths[r][: lengths[r]]), bonus[r]) for r in range(args.rows))
            means[name] = float(np.mean(lengths))
        row = {"nodes": int(tree.valid.sum()), **means, "p_token_walks": pvalue(counts["host-token"], counts["device-token"]), "p_block_walks": pvalue(counts["host-block"], counts["device-block"])}
        per_tree.append(row)
        print(j, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    summary = {name: float(np.mean([r[name] for r in per_tree])) for name in RULES}
    token = (summary["host-token"] + summary["device-token"]) / 2
    block = (summary["host-block"] + summary["device-block"]) / 2
    summary.update(trees=len(per_tree), mean_nodes=float(np.mean([r["nodes"] for r in per_tree])), block_over_token=block / token,
                   min_p_token_walks=min(r["p_token_walks"] for r in per_tree), min_p_block_walks=min(r["p_block_walks"] for r in per_tree))
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"method": args.method, "options": options, "rows": args.rows, "summary": summary, "per_tree": per_tree}, f, indent=1)


if __name__ == "__main__":
    main()
