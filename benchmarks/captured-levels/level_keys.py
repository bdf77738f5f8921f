"""How often a policy's captured drafting levels are captured against replayed, over a rolling
batch: the bundled pair, every graph emulated (`launches.py`'s `Emulator`), several calls of
`--prompts` `stdlib-heldout` prompts (default 4B); per call, how many level runs went op by op (a
key's first use), were captured (its second) and were replayed, and how many distinct level and
forward graphs exist so far, against the caps a GPU keeps (`MAX_LEVEL_GRAPHS`, `MAX_GRAPHS`: the
least recently used are dropped beyond them, so keys that never settle would churn captures).
A level's key names the builder's host state before it (node and level counts, ...), so plans
that kept changing would keep capturing. CAST runs deterministic on a GPU-like synthetic table
(target flat up to 64 new tokens, draft cheap) unless `--options` gives its own; DynaTree's levels
are captured inside a free width (`--options '{"free_tokens": 24}'`).

    python benchmarks/captured-levels/level_keys.py METHOD B TOKENS [--prompts N] [--calls C] [--options JSON] [--temperature T] [--cost-profile PATH]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
from pathlib import Path
from typing import Any

import specdec.engine as engine_module
from specdec.api import SpeculativeDecoder
from specdec.cost import CostTable
from specdec.drafting import levels as levels_module
from specdec.models.graphs import MAX_GRAPHS
from specdec.models.runner import MAX_LEVEL_GRAPHS

_spec = importlib.util.spec_from_file_location("launches", Path(__file__).with_name("launches.py"))
assert _spec is not None and _spec.loader is not None
launches = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launches)

GPU_LIKE_TABLE = CostTable.synthetic(lambda b, c, n: 20.0 + 0.02 * b * max(0, n - 64), lambda b, c, n: 1.0 + 0.002 * b * n)
"""CAST's default here: verification flat up to 64 new tokens, a cheap draft (CAST's trees grow as on a GPU)"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method")
    ap.add_argument("batch_size", type=int)
    ap.add_argument("tokens", type=int, help="new tokens per prompt")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per call (default 4 x batch size)")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--options", default="{}", help="the method's options, JSON")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--cost-profile", help="a `specdec profile` file whose table CAST uses instead of the GPU-like synthetic one (no identity check: another device's, e.g. ../gpu/2026-11-26/cost-profiles)")
    args = ap.parse_args()
    runs: collections.Counter[str] = collections.Counter()
    run = levels_module.CapturedLevels.run

    def counting_run(self: Any, name: Any, level: Any, reads: Any, lists: Any = ()) -> None:
        key = self.key(name, reads)
        met = key in self.runner.level_uses.last  # a key met before replays or is captured (the emulator has no bound)
        runs["replayed" if key in self.runner.level_graphs.traces else "captured" if met else "op by op"] += 1
        run(self, name, level, reads, lists)

    levels_module.CapturedLevels.run = counting_run  # type: ignore[method-assign]
    emulators: dict[str, Any] = {}
    make = engine_module.SpeculativeEngine.__init__

    def init(self: Any, *a: Any, **k: Any) -> None:  # one emulator per model role, kept across engines
        make(self, *a, **k)
        runner = self.source.runner
        self.target.graphs = emulators.setdefault("target", launches.Emulator())
        runner.graphs = emulators.setdefault("draft", launches.Emulator())
        runner.level_graphs = emulators.setdefault("levels", launches.Emulator())
        runner.capture_every_level = True  # every step's levels (SPECDEC_CAPTURE_LEVELS=1), greedy ones too
        self.target.time_forwards = runner.time_forwards = False

    engine_module.SpeculativeEngine.__init__ = init  # type: ignore[method-assign]
    options = json.loads(args.options)
    if args.method == "cast" and "cost_table" not in options:
        table = CostTable.load(args.cost_profile) if args.cost_profile else GPU_LIKE_TABLE
        options = {"cost_table": table, "deterministic": True, **options}
    decoder = SpeculativeDecoder.from_pretrained(method=args.method, static_shapes=True, **options)
    prompts = [json.loads(line)["prompt"] for line in launches.PROMPTS.read_text().splitlines()]
    count = args.prompts or 4 * args.batch_size
    prompts = (prompts * (count // len(prompts) + 1))[:count]
    for call in range(args.calls):
        runs.clear()
        results = decoder.generate(prompts, max_new_tokens=args.tokens, seed=call, batch_size=args.batch_size, temperature=args.temperature)
        tau = sum(r.stats.new_tokens for r in results) / sum(r.stats.steps for r in results)
        print(
            f"{args.method} B={args.batch_size} call {call + 1}: tau {tau:.2f}, level runs {dict(runs)}, "
            f"level graphs so far {len(emulators['levels'].traces)} (cap {MAX_LEVEL_GRAPHS}), "
            f"forward graphs target {len(emulators['target'].traces)} / draft {len(emulators['draft'].traces)} (cap {MAX_GRAPHS} each)",
            flush=True,
        )


if __name__ == "__main__":
    main()
