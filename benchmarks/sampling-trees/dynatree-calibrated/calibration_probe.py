"""DynaTree's calibration and history rule on a pair (no timing): tau, the tree's predicted accepted
drafted tokens per step against the accepted ones, the learned table of the step's kind of children
(drawn at T > 0, top-k at T = 0), and where the history rule left D_0, tau_h and rho_deep.

usage: [T=1] python benchmarks/sampling-trees/dynatree-calibrated/calibration_probe.py [PAIR_DIR] [OPTION=VALUE ...]
Without PAIR_DIR: the bundled pair, 12 `stdlib-heldout` prompts (every fourth), 96 tokens. With a
PAIR_DIR from `specdec synth-pair ... --out PAIR_DIR`: that pair on the CPU, its first 12 prompts,
64 tokens. Batch 1, seed 0, temperature T (default 1). OPTIONs are DynaTree's (e.g. prune_tau=0.01).
"""

import json
import os
import sys
from pathlib import Path

import numpy as np

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import bundled_heldout_path
from specdec.sampling import SamplingParams

args = sys.argv[1:]
pair = Path(args.pop(0)) if args and "=" not in args[0] else None
options = {k: float(v) if "." in v else int(v) for k, v in (a.split("=") for a in args)}
temperature = float(os.environ.get("T", "1"))
if pair is None:
    lines = bundled_heldout_path().read_text().splitlines()[::4][:12]
    decoder = SpeculativeDecoder.from_pretrained(method="dynatree", **options)
    tokens = 96
else:
    lines = (pair / "prompts.jsonl").read_text().splitlines()[:12]
    decoder = SpeculativeDecoder.from_pretrained(target=str(pair / "target"), draft=str(pair / "draft"), method="dynatree", device="cpu", **options)
    tokens = 64
prompts = [decoder.encode(json.loads(line)["prompt"]) for line in lines]
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
results = decoder.generate_ids(prompts, tokens, SamplingParams(temperature=temperature), batch_size=1, seed=0)
new = sum(r.stats.new_tokens for r in results)
steps = sum(r.stats.steps for r in results)
drafted = sum(r.stats.drafted_tokens for r in results)
print(f"{pair or 'bundled pair'}, T = {temperature}, options {options}: tau {new / steps:.3f}, drafted tokens per step {drafted / steps:.1f}")
print(f"predicted accepted drafted tokens per step {np.mean(predicted):.3f}, accepted {np.mean(accepted):.3f}")
print(f"history rule: {policy.adjustments} moves; D_0 {policy.cur_d0}, tau_h {policy.cur_tau_high}, rho_deep {policy.cur_rho_deep}")
table = policy._calibrators[temperature > 0]
kind = "drawn children's table; columns: collision-mass bins of 0.1" if temperature > 0 else "top-k children's table; columns: draft-probability bins of 0.1"
print(f"{kind} ({table.observations} observations); rows: rank 1, 2, 3+")
print(np.array(table.state()["rates"]))
print("observations per cell:")
print(np.round(table.seen, 1))
