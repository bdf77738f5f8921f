"""DynaTree on a synthetic pair (no timing): tau, the tree's predicted accepted drafted tokens per
step against the accepted ones, the learned table of the step's kind of children, and where the
history rule left D_0, tau_h and rho_deep.

usage: T=1 python benchmarks/dynatree-history-test/synthetic_probe.py PAIR_DIR [OPTION=VALUE ...]
(PAIR_DIR from `specdec synth-pair ... --out PAIR_DIR`); 12 of its prompts, 64 tokens, batch 1, seed 0.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np

from specdec.api import SpeculativeDecoder
from specdec.sampling import SamplingParams

pair = Path(sys.argv[1])
temperature = float(os.environ.get("T", "1"))
rows = [json.loads(line) for line in (pair / "prompts.jsonl").read_text().splitlines()][:12]
options = {k: float(v) if "." in v else int(v) for k, v in (a.split("=") for a in sys.argv[2:])}
decoder = SpeculativeDecoder.from_pretrained(target=str(pair / "target"), draft=str(pair / "draft"), method="dynatree", device="cpu", **options)
policy = decoder.policy
predicted: list[float] = []
accepted: list[int] = []
feedback = policy.feedback


def recording_feedback(record):  # the tree's prediction is read before feedback consumes it
    if policy._predicted_sum is not None:
        predicted.append(float(policy._predicted_sum.sum()))
        accepted.append(sum(record.accepted_len))
    feedback(record)


policy.feedback = recording_feedback
results = decoder.generate_ids([decoder.encode(r["prompt"]) for r in rows], 64, SamplingParams(temperature=temperature), batch_size=1, seed=0)
new = sum(r.stats.new_tokens for r in results)
steps = sum(r.stats.steps for r in results)
print(f"T = {temperature}, options {options}: tau {new / steps:.3f}")
print(f"predicted accepted drafted tokens per step {np.mean(predicted):.3f}, accepted {np.mean(accepted):.3f}")
print(f"history rule: {policy.adjustments} moves; D_0 {policy.cur_d0}, tau_h {policy.cur_tau_high}, rho_deep {policy.cur_rho_deep}")
