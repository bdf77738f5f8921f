"""Per-step trace of the tree policies: draft forwards, expanded nodes, measured draft and
verification time, and (CAST) what its cost model predicted for the same step.

The tree methods lose to EAGLE-2 on a GPU on drafting time (2026-11-25). Whether a policy's
trees are too deep for what a layer really costs, or its layers cost more than EAGLE-2's, is
read here from the engine's own step records: a least-squares fit of measured draft ms on
(1, draft forwards, expanded nodes) per method gives each method's real cost per layer and per
node, and CAST's predicted draft time and tokens sit beside the measured ones.

    python benchmarks/gpu/step_trace.py --target PAIR/target --draft PAIR/draft \
        --prompts PAIR/prompts.jsonl --methods eagle2,cast,dynatree --device cuda --out OUT/trace

Writes `summary.md` and `METHOD-steps.jsonl` (one record per step) under --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_common import add_pair_arguments, method_items, read_prompts

from specdec.api import SpeculativeDecoder
from specdec.drafting import cast as cast_module
from specdec.sources import model as model_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(ap, methods="eagle2,cast,dynatree", num_prompts=12)
    ap.add_argument("--batch-size", type=int, default=1)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(args.prompts, args.num_prompts)

    counts = {"expand": 0, "nodes": 0}
    original_expand = model_source.ModelDraftSource.expand

    def counted_expand(self: Any, batch: Any, params: Any) -> torch.Tensor:
        counts["expand"] += 1
        counts["nodes"] += int(batch.nodes.shape[1])
        return original_expand(self, batch, params)

    model_source.ModelDraftSource.expand = counted_expand  # type: ignore[method-assign]
    cast_seen: list[dict[str, Any]] = []
    original_cast_feedback = cast_module.CastPolicy._feedback

    def cast_feedback(self: Any, record: Any) -> None:
        expected = self.overheads._expected
        o = self.overheads
        row: dict[str, Any] = {"widths": list(self.last_widths), "verified": self.last_verified, "expected_tokens": self._expected_tokens, "plain": self._step_plain}
        if expected is not None:
            forward_ms, layers, nodes, verify_forward_ms, tree_nodes = expected
            row["predicted_draft_ms"] = forward_ms + o.draft_step_ms + o.other_ms * 0 + o.draft_ms * layers + o.draft_node_ms * nodes
            row["predicted_verify_ms"] = verify_forward_ms + o.verify_ms + o.verify_node_ms * tree_nodes
            row["table_draft_forward_ms"] = forward_ms
        row["overheads"] = {"step": o.draft_step_ms, "layer": o.draft_ms, "node": o.draft_node_ms, "verify": o.verify_ms, "verify_node": o.verify_node_ms, "other": o.other_ms}
        cast_seen.append(row)
        original_cast_feedback(self, record)

    cast_module.CastPolicy._feedback = cast_feedback  # type: ignore[method-assign]

    lines = ["| method | steps | τ | draft ms/step | verify ms/step | forwards/step | nodes/step | fit: ms + ms/forward + ms/node |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for spec, method, opts, stem in method_items(args.methods):
        dec = SpeculativeDecoder.from_pretrained(args.target, args.draft, method=method, device=args.device, **opts)
        for _ in range(2):  # warm: graphs captured, costs measured, adaptive state settled
            for group_start in range(0, len(prompts), args.batch_size):
                dec.generate(prompts[group_start : group_start + args.batch_size], max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
        steps: list[dict[str, Any]] = []
        policy_feedback = dec.policy.feedback
        seen = {"expand": counts["expand"], "nodes": counts["nodes"]}

        def traced_feedback(record: Any, policy_feedback: Any = policy_feedback, steps: list[dict[str, Any]] = steps, seen: dict[str, int] = seen) -> None:
            active = sum(record.active)
            steps.append(
                {
                    "draft_ms": record.draft_s * 1e3,
                    "verify_ms": record.verify_s * 1e3,
                    "step_ms": record.step_s * 1e3,
                    "committed": sum(c for c, a in zip(record.committed, record.active, strict=True) if a) / max(1, active),
                    "forwards": counts["expand"] - seen["expand"],
                    "nodes": counts["nodes"] - seen["nodes"],
                    "captures": record.graph_captures,
                }
            )
            seen["expand"], seen["nodes"] = counts["expand"], counts["nodes"]
            policy_feedback(record)

        cast_seen.clear()
        dec.policy.feedback = traced_feedback  # type: ignore[method-assign]
        for group_start in range(0, len(prompts), args.batch_size):
            dec.generate(prompts[group_start : group_start + args.batch_size], max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
        dec.policy.feedback = policy_feedback  # type: ignore[method-assign]
        for row, cast_row in zip(steps, cast_seen if method == "cast" else [], strict=False):
            row.update(cast_row)
        with (out / f"{stem}-steps.jsonl").open("w") as f:
            for row in steps:
                f.write(json.dumps(row) + "\n")
        drafted = [s for s in steps if s["forwards"] > 0]
        if drafted:
            x = np.array([[1.0, s["forwards"], s["nodes"]] for s in drafted])
            y = np.array([s["draft_ms"] for s in drafted])
            theta = np.linalg.lstsq(x, y, rcond=None)[0]
            fit = f"{theta[0]:.2f} + {theta[1]:.3f} f + {theta[2]:.4f} n"
        else:
            fit = "-"
        n = max(1, len(steps))
        tau = sum(s["committed"] for s in steps) / n
        lines.append(
            f"| {spec} | {len(steps)} | {tau:.2f} | {sum(s['draft_ms'] for s in steps) / n:.2f} | {sum(s['verify_ms'] for s in steps) / n:.2f} | "
            f"{sum(s['forwards'] for s in steps) / n:.2f} | {sum(s['nodes'] for s in steps) / n:.1f} | {fit} |"
        )
        if method == "cast" and cast_seen:
            pred = [s for s in steps if "predicted_draft_ms" in s and s["forwards"] > 0]
            if pred:
                lines.append(
                    f"| {spec} predicted | | {np.mean([s['expected_tokens'] for s in pred if s['expected_tokens'] is not None]):.2f} (measured {np.mean([s['committed'] for s in pred]):.2f}) | "
                    f"{np.mean([s['predicted_draft_ms'] for s in pred]):.2f} (measured {np.mean([s['draft_ms'] for s in pred]):.2f}) | "
                    f"{np.mean([s['predicted_verify_ms'] for s in pred]):.2f} (measured {np.mean([s['verify_ms'] for s in pred]):.2f}) | | | overheads {json.dumps({k: round(v, 3) for k, v in cast_seen[-1]['overheads'].items()})} |"
                )
        del dec
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
