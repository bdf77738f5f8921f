"""Device traversal's verify time, the rule at a git revision (`--base`) against this checkout's,
on real trees captured from the bundled pair at T = 1 (device walk), with the vocabulary tiled
to larger V (the draft's log-probs spread over the copies, so the maths is unchanged in kind).
Also the host walk on the same trees (the CPU default). Times exclude the verify forward.

    python benchmarks/sampling-trees/traversal-rounds/rounds_micro.py --base 8fa56b0 \
        --out benchmarks/sampling-trees/traversal-rounds/results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import specdec.verification.sampling as current
from specdec.api import SpeculativeDecoder
from specdec.bench.prompts import STDLIB_HELDOUT, load_prompts, resolve_prompt_source
from specdec.sampling import SamplingParams


def module_at(rev: str):
    """specdec.verification.sampling as it was at `rev`."""
    source = subprocess.run(["git", "show", f"{rev}:specdec/verification/sampling.py"], capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampling_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampling_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sampling_base"] = module
    spec.loader.exec_module(module)
    return module


def capture(method: str, batch: int, trees: int) -> list[tuple]:
    """(tree, target logits) of the first `trees` branching trees the device traversal verified."""
    captured = []
    original = current.TraversalTreeTests.verify

    def keep(self, tree, logits, params, generator, *args, **kwargs):
        if len(captured) < trees:
            captured.append((tree, logits.clone()))
        return original(self, tree, logits, params, generator, *args, **kwargs)

    current.TraversalTreeTests.verify = keep
    try:
        prompts = [p.turns[0] for p in load_prompts(resolve_prompt_source(STDLIB_HELDOUT))][:batch]
        decoder = SpeculativeDecoder.from_pretrained(method=method, verify="sampling", verify_options={"walk": "device"})
        decoder.generate(prompts, max_new_tokens=24, temperature=1.0, seed=0, batch_size=batch)
    finally:
        current.TraversalTreeTests.verify = original
    return captured


def tiled(tree, logits, copies: int):
    """The tree and logits with the vocabulary repeated `copies` times."""
    if copies == 1:
        return tree, logits
    draft = None if tree.draft_logprobs is None else tree.draft_logprobs.repeat(1, 1, copies) - math.log(copies)
    return dataclasses.replace(tree, draft_logprobs=draft), logits.repeat(1, 1, copies)


def median_ms(rule, cases, repeats: int) -> float:
    params = SamplingParams(temperature=1.0)
    times = []
    for tree, logits in cases:
        tree.verify_plan = None
        rule.verify(tree, logits, params, torch.Generator().manual_seed(0))  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            tree.verify_plan = None
            rule.verify(tree, logits, params, torch.Generator().manual_seed(0))
        times.append((time.perf_counter() - start) / repeats * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision of the rule to compare against")
    parser.add_argument("--out", default=None)
    parser.add_argument("--trees", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = module_at(args.base)
    rows = []
    for method, batch in (("eagle2", 1), ("eagle2", 4), ("static", 1), ("dynatree", 1)):
        cases = capture(method, batch, args.trees)
        for copies in (1, 4):
            tiled_cases = [tiled(t, lg, copies) for t, lg in cases]
            row = {
                "method": method,
                "batch": batch,
                "vocab": cases[0][1].shape[-1] * copies,
                "nodes_median": statistics.median(t.tokens.shape[1] for t, _ in cases),
                "base_ms": median_ms(base.TraversalTreeTests(), tiled_cases, args.repeats),
                "new_ms": median_ms(current.TraversalTreeTests(), tiled_cases, args.repeats),
                "host_walk_ms": median_ms(current.SamplingRule(walk="host"), tiled_cases, args.repeats),
            }
            row["speedup"] = row["base_ms"] / row["new_ms"]
            rows.append(row)
            print(f"{method} B={batch} V={row['vocab']} N~{row['nodes_median']}: base {row['base_ms']:.2f} ms, new {row['new_ms']:.2f} ms ({row['speedup']:.2f}x), host walk {row['host_walk_ms']:.2f} ms", flush=True)
    if args.out:
        meta = {"base": args.base, "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(), "trees": args.trees, "repeats": args.repeats}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
