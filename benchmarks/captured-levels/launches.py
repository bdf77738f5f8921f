"""Host-launched ops a decoding step outside graphs, with and without captured drafting levels,
on the CPU: what a GPU step launches kernel by kernel (each op a launch, host time on an H100)
next to its graph replays.

Static shapes; every graph (the target's and the draft's forwards, and with --levels the draft's
whole levels) is emulated by a `make_fx` trace, replayed uncounted and counted as one replay, as
`tests/test_graph_replay_semantics.py` does. Two calls of the same prompts (each a new engine, as
`SpeculativeDecoder.generate` makes one per call): the second is counted, after the first has
captured every graph. The drafts must match: τ is printed for both modes.

    python benchmarks/captured-levels/launches.py chain 1        # levels off
    python benchmarks/captured-levels/launches.py chain 1 --levels
    python benchmarks/captured-levels/launches.py eagle2 1 --levels --temperature 1   # sampled children
    python benchmarks/captured-levels/launches.py dynatree 1 --levels --options '{"free_tokens": 13}'
    python benchmarks/captured-levels/launches.py eagle2 1 --levels --temperature 1 --walk device --walks   # a GPU's sampled step
    python benchmarks/captured-levels/launches.py eagle2 1 --levels --temperature 1 --walk device --walks --mars 0.9

--walk device tests sampled trees on the device, as on a GPU (traversal verification, `TraversalTreeTests`;
the CPU's default is the host walk); --walks replays that walk's plan and tests as graphs too
(`specdec.verification.captured`, emulated like the rest).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from torch.fx.experimental.proxy_tensor import make_fx

import specdec.engine as engine_module
from specdec.api import SpeculativeDecoder
from specdec.hostwork import HostWorkCounter, uncounted

PROMPTS = Path(__file__).resolve().parents[2] / "specdec/assets/pair/stdlib-heldout.jsonl"


class Emulator:
    """`CudaGraphRunner`'s interface: capture = a make_fx trace (run for real), replay = the trace, uncounted."""

    def __init__(self) -> None:
        self.traces: dict[tuple[Any, ...], Any] = {}
        self.captures = self.replays = 0
        self.failed = None

    def clear(self) -> None:
        self.traces.clear()

    def run(self, key: tuple[Any, ...], call: Any, keepalive: Any) -> Any:
        trace = self.traces.get(key)
        if trace is None:
            self.captures += 1
            trace = self.traces[key] = make_fx(call, tracing_mode="real")()
            return trace()
        self.replays += 1
        with uncounted():
            return trace()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method")
    ap.add_argument("batch_size", type=int)
    ap.add_argument("--levels", action="store_true")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--options", default="{}", help="the method's options, JSON (DynaTree's levels are captured inside a free width: free_tokens)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled (chain tokens, trees' sampled children)")
    ap.add_argument("--walk", default="auto", choices=("auto", "device", "host"), help="where sampled trees are tested (`SamplingRule(walk=...)`; auto: the host on a CPU)")
    ap.add_argument("--walks", action="store_true", help="with --walk device: the walk replayed as graphs (emulated)")
    ap.add_argument("--mars", type=float, default=None, help="MARS at this theta instead of lossless sampling (its device tests are captured with --walks too)")
    args = ap.parse_args()
    emulators: dict[str, Emulator] = {}
    make = engine_module.SpeculativeEngine.__init__

    def init(self: Any, *a: Any, **k: Any) -> None:  # one emulator per model role, kept across engines (as a model's graphs are)
        make(self, *a, **k)
        runner = self.source.runner
        self.target.graphs = emulators.setdefault("target", Emulator())
        runner.graphs = emulators.setdefault("draft", Emulator())
        runner.level_graphs = emulators.setdefault("levels", Emulator()) if args.levels else None
        runner.capture_every_level = True  # --levels: every step's levels (SPECDEC_CAPTURE_LEVELS=1), greedy ones too
        self.target.time_forwards = runner.time_forwards = False
        self.target.walk_graphs = emulators.setdefault("walks", Emulator()) if args.walks else None

    engine_module.SpeculativeEngine.__init__ = init  # type: ignore[method-assign]
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()][: 2 * args.batch_size]
    rule = {} if args.temperature == 0 or args.walk == "auto" else {"verify": "sampling", "verify_options": {"walk": args.walk}}
    if args.mars is not None:
        rule = {"verify": "mars", "verify_options": {"walk": args.walk}, "mars_theta": args.mars}
    decoder = SpeculativeDecoder.from_pretrained(method=args.method, static_shapes=True, **rule, **json.loads(args.options))
    decoder.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0, batch_size=args.batch_size)
    replays_before = sum(e.replays for e in emulators.values())
    with HostWorkCounter() as counter:
        results = decoder.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0, batch_size=args.batch_size)
    steps = sum(r.stats.steps for r in results) / args.batch_size  # batch steps (rows step together)
    tau = sum(r.stats.new_tokens for r in results) / max(1, sum(r.stats.steps for r in results))
    replays = sum(e.replays for e in emulators.values()) - replays_before
    print(
        f"| {args.method}{' ' + args.options if args.options != '{}' else ''} | {args.batch_size} | {args.temperature:g} | {'on' if args.levels else 'off'} | "
        f"{args.walk}{' captured' if args.walks else ''}{f' (MARS {args.mars:g})' if args.mars is not None else ''} | {tau:.2f} | {counter.ops / steps:.1f} | "
        f"{replays / steps:.1f} | {counter.host_reads / steps:.2f} |"
    )


if __name__ == "__main__":
    main()
