"""Paired comparison of the two chain rules: on every drafted chain of a sampled run, the expected
accepted tokens under token-by-token verification and under block verification (exact
expectations from each rule's acceptance probabilities, so the coin flips add no noise and both
rules are scored on the same drafts).

    python benchmarks/sampling-trees/block-chains/expected_tau.py TEMPERATURE NUM_PROMPTS

Bundled pair, `stdlib-heldout` prompts, the K = 5 chain, 96 new tokens, one prompt at a time.
"""

import sys

import numpy as np

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.sampling import SamplingParams, logits_to_logprobs
from specdec.verification import SamplingRule

temperature, num_prompts = float(sys.argv[1]), int(sys.argv[2])
prompts = [p.turns[0] for p in load_prompts(resolve_prompt_source("stdlib-heldout"), num_prompts)]
decoder = SpeculativeDecoder.from_pretrained(method="chain")
engine = decoder.engine("sampling")
engine.rule = SamplingRule(chains="block")
totals = {"token": 0.0, "block": 0.0, "steps": 0}
verify = engine.rule.verify


def scored_verify(tree, logits, params, generator):
    target = logits_to_logprobs(logits, params).exp().double().numpy()  # [B, N, V]
    draft = tree.draft_logprobs.exp().double().numpy()
    tokens, valid = tree.tokens.numpy(), tree.valid.numpy()
    for r in range(tokens.shape[0]):
        gamma = int(valid[r, 1:].sum())
        if gamma == 0:
            continue
        x = tokens[r, 1 : gamma + 1]
        p = np.array([target[r, i, x[i]] for i in range(gamma)])
        q = np.array([draft[r, i, x[i]] for i in range(gamma)])
        totals["token"] += np.cumprod(np.minimum(1.0, p / q)).sum()  # sum_i P(first i accepted)
        w, h = 1.0, []
        for i in range(1, gamma + 1):
            w = min(1.0, w * p[i - 1] / q[i - 1])
            if i < gamma:
                mass = np.maximum(w * target[r, i] - draft[r, i], 0.0).sum()
                h.append(mass / (mass + 1.0 - w) if mass + 1.0 - w > 1e-12 else 1.0)
            else:
                h.append(w)
        h = np.array(h)
        totals["block"] += sum(1.0 - np.prod(1.0 - h[i:]) for i in range(gamma))  # sum_i P(tau >= i + 1)
        totals["steps"] += 1
    return verify(tree, logits, params, generator)


engine.rule.verify = scored_verify
for i, ids in enumerate(decoder.tokenizer.encode(p) for p in prompts):
    engine.generate([ids], 96, SamplingParams(temperature=temperature), seed=100 + i)
token, block = (1 + totals[k] / totals["steps"] for k in ("token", "block"))
print(f"T = {temperature}, {num_prompts} prompts, {totals['steps']} steps: expected tau token {token:.3f}, block {block:.3f} ({block / token:.4f}x)")
