"""Time `SamplingRule.verify` alone, host walk against device tests, on real sampled trees.

One 32-token call at T = 1 per method and batch size (bundled pair) records every step's tree
and target logits; each recorded step is then verified three times with each walk.

    python benchmarks/sampling-trees/device-walk/walk_micro.py eagle2,dynatree
"""

from __future__ import annotations

import sys
import time

import torch

from specdec.api import SpeculativeDecoder
from specdec.sampling import SamplingParams
from specdec.verification import SamplingRule

PROMPT = "import os\nimport sys\n\ndef main():\n    "
REPEATS = 3


class Recorder(SamplingRule):
    """The host walk, keeping every step's (tree, target logits, params)."""

    def __init__(self) -> None:
        super().__init__(walk="host")
        self.steps: list[tuple] = []

    def verify(self, tree, target_logits, params, generator):  # type: ignore[no-untyped-def]
        self.steps.append((tree, target_logits.clone(), params))
        return super().verify(tree, target_logits, params, generator)


def time_walk(walk: str, steps: list[tuple]) -> float:
    """Mean ms per verify over `REPEATS` passes (after one warm-up pass over three steps)."""
    rule, generator = SamplingRule(walk=walk), torch.Generator().manual_seed(0)
    for tree, logits, params in steps[:3]:
        rule.verify(tree, logits, params, generator)
    start = time.perf_counter()
    for _ in range(REPEATS):
        for tree, logits, params in steps:
            rule.verify(tree, logits, params, generator)
    return (time.perf_counter() - start) / (REPEATS * len(steps)) * 1000


def main(methods: list[str]) -> None:
    torch.manual_seed(0)
    for method in methods:
        for batch in (1, 4):
            decoder = SpeculativeDecoder.from_pretrained(method=method)
            engine = decoder.engine("sampling")
            engine.rule = recorder = Recorder()
            engine.generate([decoder.encode(PROMPT)] * batch, 32, SamplingParams(temperature=1.0), seed=0)
            tree = recorder.steps[0][0]
            host, device = time_walk("host", recorder.steps), time_walk("device", recorder.steps)
            print(f"{method} B={batch} nodes={tree.num_nodes} K={tree.max_children} host {host:.2f} ms device {device:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["eagle2", "dynatree"])
