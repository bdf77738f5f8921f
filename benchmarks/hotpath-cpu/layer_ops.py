"""Torch ops a tree policy issues per drafting level, between two draft forwards, outside model
forwards (each a kernel launch on a GPU, where greedy levels run op by op): the bundled pair, B = 1,
the first three `stdlib-heldout` prompts, 64 new tokens, counted with `specdec.hostwork` after a
warm-up call. Also the step's ops and host reads, the draft phase's ops before the first draft
forward and after the last, and the level's ops by name.

    python benchmarks/hotpath-cpu/layer_ops.py dynatree --options '{"free_tokens": 64}' [--temperature 1]
    python benchmarks/hotpath-cpu/layer_ops.py cast --cost-profile benchmarks/gpu/2026-11-26/cost-profiles/quick-c261dd7e2ebd578b2eb6.json \
        --options '{"plain_steps": false, "deterministic": true}'
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path
from typing import Any

from specdec.api import SpeculativeDecoder
from specdec.drafting import builder as builder_module
from specdec.hostwork import HostWorkCounter, _active

PROMPTS = Path(__file__).resolve().parents[2] / "specdec/assets/pair/stdlib-heldout.jsonl"

Mark = tuple[int, int, dict[str, int]]
"""(ops, host reads, ops by name) so far"""


def mark() -> Mark:
    counter = _active.get()
    assert counter is not None
    return counter.ops, counter.host_reads, dict(counter.op_names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("method")
    ap.add_argument("--options", default="{}", help="the method's options, JSON")
    ap.add_argument("--cost-profile", help="a cost profile whose table CAST uses (no identity check: another device's)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    options: dict[str, Any] = json.loads(args.options)
    if args.cost_profile:
        from specdec.cost.table import CostTable

        options["cost_table"] = CostTable.load(args.cost_profile)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()][:3]
    decoder = SpeculativeDecoder.from_pretrained(method=args.method, **options)
    decoder.generate(prompts[:1], max_new_tokens=24, temperature=args.temperature, seed=0)  # warm-up
    forwards: list[Mark] = []
    steps: list[tuple[Mark, list[Mark], Mark]] = []
    expand = builder_module.TreeBuilder.expand

    def marking_expand(self: Any, *a: Any, **k: Any) -> Any:
        if _active.get() is not None:
            forwards.append(mark())
        return expand(self, *a, **k)

    builder_module.TreeBuilder.expand = marking_expand  # type: ignore[method-assign]
    draft = decoder.policy.draft

    def marking_draft(*a: Any) -> Any:
        forwards.clear()
        start = mark()
        out = draft(*a)
        steps.append((start, list(forwards), mark()))
        return out

    decoder.policy.draft = marking_draft  # type: ignore[method-assign]
    with HostWorkCounter(keep_names=True) as counter:
        results = decoder.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0, batch_size=1)
    n_steps = sum(r.stats.steps for r in results)
    tau = sum(len(r.token_ids) for r in results) / n_steps
    per_level: list[int] = []
    before: list[int] = []
    after: list[int] = []
    names: collections.Counter[str] = collections.Counter()
    for start, marks, end in steps:
        before.append((marks[0] if marks else end)[0] - start[0])
        for a, b in zip(marks, marks[1:], strict=False):
            per_level.append(b[0] - a[0])
            names.update({name: count - a[2].get(name, 0) for name, count in b[2].items()})
        if marks:
            after.append(end[0] - marks[-1][0])
    levels = max(1, len(per_level))
    print(
        f"{args.method} {args.options} T = {args.temperature:g}: τ {tau:.2f}, ops a step {counter.ops / n_steps:.0f}, host reads a step "
        f"{counter.host_reads / n_steps:.2f}, draft forwards a step {statistics.mean(len(m) for _, m, _ in steps):.2f}, draft-phase ops "
        f"before the first forward {statistics.mean(before):.0f}, a level {statistics.mean(per_level) if per_level else 0:.1f}, "
        f"after the last forward {statistics.mean(after) if after else 0:.0f}"
    )
    print("  a level's ops by name:", {name: round(count / levels, 1) for name, count in names.most_common() if round(count / levels, 1)})


if __name__ == "__main__":
    main()
