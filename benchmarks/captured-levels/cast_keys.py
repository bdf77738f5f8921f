"""How often CAST's captured layers are captured against replayed: CAST with a GPU-like synthetic
table (target flat up to 64 new tokens, draft cheap) on the bundled pair, every graph emulated
(`launches.py`'s `Emulator`), two calls of 4B `stdlib-heldout` prompts; per call, how many level
runs went op by op (a key's first use), were captured (its second) and were replayed. A layer's
key names the buckets of the widths before it, so a plan that kept changing would keep capturing.

    python benchmarks/captured-levels/cast_keys.py B TOKENS
"""

from __future__ import annotations

import collections
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import specdec.engine as engine_module
from specdec.api import SpeculativeDecoder
from specdec.cost import CostTable
from specdec.drafting import levels as levels_module

_spec = importlib.util.spec_from_file_location("launches", Path(__file__).with_name("launches.py"))
assert _spec is not None and _spec.loader is not None
launches = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launches)


def main() -> None:
    batch, tokens = int(sys.argv[1]), int(sys.argv[2])
    runs: collections.Counter[str] = collections.Counter()
    run = levels_module.CapturedLevels.run

    def counting_run(self: Any, name: Any, level: Any, reads: Any, lists: Any = ()) -> None:
        key = self.key(name, reads)
        uses = self.runner.level_uses.get(key, 0)
        runs["op by op" if uses + 1 < levels_module.MIN_USES else "replayed" if key in self.runner.level_graphs.traces else "captured"] += 1
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
        self.target.time_forwards = runner.time_forwards = False

    engine_module.SpeculativeEngine.__init__ = init  # type: ignore[method-assign]
    table = CostTable.synthetic(lambda b, c, n: 20.0 + 0.02 * b * max(0, n - 64), lambda b, c, n: 1.0 + 0.002 * b * n)
    decoder = SpeculativeDecoder.from_pretrained(method="cast", static_shapes=True, cost_table=table, deterministic=True)
    prompts = [json.loads(line)["prompt"] for line in launches.PROMPTS.read_text().splitlines()][: 4 * batch]
    for call in range(2):
        runs.clear()
        results = decoder.generate(prompts, max_new_tokens=tokens, seed=0, batch_size=batch)
        tau = sum(r.stats.new_tokens for r in results) / sum(r.stats.steps for r in results)
        print(f"call {call + 1}: tau {tau:.2f}, level runs {dict(runs)}, level graphs so far {emulators['levels'].captures}", flush=True)


if __name__ == "__main__":
    main()
