"""DynaTree at T = 1 with calibrated drawn children on the bundled pair: tau, the tree's predicted
accepted drafted tokens per step against the accepted ones, and the drawn children's learned table.

usage: python benchmarks/sampling-trees/dynatree-calibrated/calibration_probe.py [OPTION=VALUE ...]
(DynaTree options, e.g. prune_tau=0.01); 12 `stdlib-heldout` prompts (every fourth), 96 tokens, seed 0.
"""

import json
import sys

import numpy as np

from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import bundled_heldout_path

prompts = [json.loads(line)["prompt"] for line in bundled_heldout_path().read_text().splitlines()][::4][:12]
options = {k: float(v) if "." in v else int(v) for k, v in (a.split("=") for a in sys.argv[1:])}
decoder = SpeculativeDecoder.from_pretrained(method="dynatree", **options)
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
results = decoder.generate(prompts, max_new_tokens=96, temperature=1.0, seed=0, batch_size=1)
new = sum(r.stats.new_tokens for r in results)
steps = sum(r.stats.steps for r in results)
drafted = sum(r.stats.drafted_tokens for r in results)
print(f"tau {new / steps:.3f}, drafted tokens per step {drafted / steps:.1f}")
print(f"predicted accepted drafted tokens per step {np.mean(predicted):.3f}, accepted {np.mean(accepted):.3f}")
table = policy._calibrators[True]
print(f"drawn children's table ({table.observations} observations); rows: draw rank 1, 2, 3+; columns: collision-mass bins of 0.1")
print(np.array(table.state()["rates"]))
print("observations per cell:")
print(np.round(table.seen, 1))
