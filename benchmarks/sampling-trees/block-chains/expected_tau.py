"""Paired comparison of the two chain rules: on every drafted chain of a sampled run, the expected
accepted tokens under token-by-token verification and under block verification (exact
expectations from each rule's acceptance probabilities: min(1, p / q) per node for the token
rule, the rule's own thresholds `BlockChainTests.thresholds` for the block, so the coin flips add
no noise and both rules are scored on the same drafts).

    python benchmarks/sampling-trees/block-chains/expected_tau.py TEMPERATURE NUM_PROMPTS

Bundled pair, `stdlib-heldout` prompts, the K = 5 chain, 96 new tokens, one prompt at a time.
"""

import sys

import numpy as np

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.sampling import SamplingParams, logits_to_logprobs
from specdec.verification import SamplingRule
from specdec.verification.sampling import BLOCK_CHAIN

temperature, num_prompts = float(sys.argv[1]), int(sys.argv[2])
prompts = [p.turns[0] for p in load_prompts(resolve_prompt_source("stdlib-heldout"), num_prompts)]
decoder = SpeculativeDecoder.from_pretrained(method="chain")
engine = decoder.engine("sampling")
engine.rule = SamplingRule(chains="block")
totals = {"token": 0.0, "block": 0.0, "steps": 0}
verify = engine.rule.verify


def scored_verify(tree, logits, params, generator):
    target = logits_to_logprobs(logits, params).exp()  # [B, N, V]
    draft = tree.draft_logprobs.exp()
    h, gamma, _ = BLOCK_CHAIN.thresholds(tree, target, draft)  # the rule's own thresholds [B, K]
    x = tree.tokens[:, 1:, None]
    accept = (target[:, :-1].gather(2, x) / draft[:, :-1].gather(2, x)).clamp(max=1.0).squeeze(2).double().numpy()  # [B, K] min(1, p / q)
    h, gamma = h.double().numpy(), gamma.tolist()
    for r, g in enumerate(gamma):
        if g == 0:
            continue
        totals["token"] += np.cumprod(accept[r, :g]).sum()  # sum_i P(the first i accepted)
        totals["block"] += sum(1.0 - np.prod(1.0 - h[r, i:g]) for i in range(g))  # sum_i P(tau >= i + 1): some test at or past i + 1 passes
        totals["steps"] += 1
    return verify(tree, logits, params, generator)


engine.rule.verify = scored_verify
for i, ids in enumerate(decoder.tokenizer.encode(p) for p in prompts):
    engine.generate([ids], 96, SamplingParams(temperature=temperature), seed=100 + i)
token, block = (1 + totals[k] / totals["steps"] for k in ("token", "block"))
print(f"T = {temperature}, {num_prompts} prompts, {totals['steps']} steps: expected tau token {token:.3f}, block {block:.3f} ({block / token:.4f}x)")
