"""What the host pays per torch op on this GPU machine, and what one EAGLE-2 tree level's bookkeeping
costs eagerly against the same ops replayed as one CUDA graph.

The tree methods' draft phase is host-bound on a GPU (2026-11-25: a tree layer cost 1.7-1.8 ms
of step time against 0.69 ms per chain forward, with the GPU idle). This measures the pieces of
that cost without a model: the draft's distributions come from a fixed tensor, so only the tree
bookkeeping (`TreeBuilder`, the policy's selection) runs. All times are host wall time per call
with one synchronisation after the loop (the GPU is never the bottleneck here, which the
`gpu_us` columns check), medians of 5 rounds.

    python benchmarks/gpu/op_costs.py --device cuda --vocab 128256 --out OUT/op_costs.json

On a CPU (`--device cpu`) the graph rows are skipped and the rest measures CPU op costs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_common import gpu_us, host_us

from specdec.drafting.builder import DraftContext, TreeBuilder
from specdec.drafting.policies import ChainPolicy, Eagle2Policy
from specdec.sampling import SamplingParams


class FixedSource:
    """A draft source whose every distribution is one fixed [B, k, V] tensor (no model, no op)."""

    def __init__(self, logprobs: torch.Tensor) -> None:
        self.logprobs = logprobs  # [B, K, V]

    def begin_step(self, roots: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return self.logprobs[:, 0]

    def expand(self, batch: Any, params: SamplingParams) -> torch.Tensor:
        return self.logprobs[:, : batch.nodes.shape[1]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device(args.device)
    b, k, v = args.batch, args.top_k, args.vocab
    rows: dict[str, dict[str, float | None]] = {}

    def record(name: str, call: Callable[[], object], reps: int) -> None:
        rows[name] = {"host_us": host_us(call, dev, reps), "gpu_us": gpu_us(call, dev, reps)}
        print(f"{name:44s} host {rows[name]['host_us']:9.1f} us   gpu {rows[name]['gpu_us'] if rows[name]['gpu_us'] is None else round(rows[name]['gpu_us'], 1)} us", flush=True)

    small = torch.zeros(b, 64, device=dev)
    record("tiny op (add_ on [B, 64])", lambda: small.add_(1.0), 2000)
    idx = torch.zeros(b, 8, dtype=torch.long, device=dev)
    record("tiny gather ([B, 64] by [B, 8])", lambda: small.gather(1, idx), 2000)
    logits = torch.randn(b, k, v, device=dev)
    record(f"topk k={k} of [B, {k}, V]", lambda: torch.topk(logits, k, dim=-1), 200)
    record(f"log_softmax of [B, {k}, V]", lambda: torch.log_softmax(logits, dim=-1), 200)
    bf16 = logits.to(torch.bfloat16)
    record(f"bf16 -> float32 copy of [B, {k}, V]", lambda: bf16.to(torch.float32, copy=True), 200)

    lp = torch.log_softmax(torch.randn(b, k * k, v, device=dev) * 3, dim=-1)
    source = FixedSource(lp)
    roots = torch.zeros(b, dtype=torch.long, device=dev)
    ctx = DraftContext(SamplingParams(), None, max_depth=64, active=torch.ones(b, dtype=torch.bool, device=dev), context_len=torch.full((b,), 100, device=dev), host_active=[True] * b, host_context_len=[100] * b)
    eagle2 = Eagle2Policy(depth=args.depth, top_k=k, total_tokens=59)
    record(f"EAGLE-2 tree bookkeeping, depth {args.depth} (no forwards)", lambda: eagle2.draft(source, roots, ctx), 50)
    chain = ChainPolicy(k=5)
    record("chain bookkeeping, K = 5 (no forwards)", lambda: chain.draft(source, roots, ctx), 50)

    # one EAGLE-2 level (after the first): add the top-k children of k frontier nodes, keep the best k
    builder = TreeBuilder(source, roots, ctx, keep_draft_probs=False, capacity=128)
    frontier = builder.add_top_children(builder.root, builder.root_logprobs[:, None, :], k, None, depth=1)
    n0 = builder.num_nodes
    level_lp = lp[:, :k]

    def level() -> torch.Tensor:
        builder._n = n0  # the same columns every call
        start = builder.num_nodes
        builder.add_top_children(frontier, level_lp, k, None, depth=2)
        return torch.topk(builder.score[:, start:], k, dim=1).indices.add_(start)

    record("one EAGLE-2 level, eager (topk children, add, select)", level, 200)
    if dev.type == "cuda":
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            level()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            level()
        record("one EAGLE-2 level, one CUDA graph replay", graph.replay, 500)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__, "batch": b, "top_k": k, "vocab": v, "depth": args.depth}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
