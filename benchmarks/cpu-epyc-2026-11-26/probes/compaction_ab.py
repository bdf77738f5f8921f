"""Same-process A/B of the KV cache compaction: the one before 2026-11-26 (a zeroed copy of the
whole storage, every slot moved) against today's (in place, from the first hole on). Prints the
wall time of `generate()` over the first 16 stdlib-heldout prompts at batch size B, the two
alternating, and each run's compactions (count, ms).

python compaction_ab.py METHOD B REPEATS   # e.g. chain 16 4
"""

import json
import statistics
import sys
import time
from typing import Any

import torch

from specdec.api import SpeculativeDecoder
from specdec.bundled import bundled_target
from specdec.models import runner

NEW = runner.ModelRunner.compact_if_wasteful


@torch.inference_mode()
def old_compact_if_wasteful(self: Any, max_waste: float = 0.25, min_slots: int = 64) -> None:
    """The compaction as it was (specdec 0af44de)."""
    cache = self._cache()
    b, s = self.slot_valid.shape
    if self.step_len or b == 0 or s < self._compact_checked_at + min_slots:
        return
    self._compact_checked_at = s
    width = int(self.slot_valid.sum(dim=1).max().item())
    if s - width < max(min_slots, max_waste * s):
        return
    order = torch.argsort(self.slot_valid.to(torch.int8), dim=1, stable=True)[:, s - width :]
    new_valid = self.slot_valid.gather(1, order)

    def gather(t: torch.Tensor, batch_dim: int, slot_dim: int) -> torch.Tensor:
        shape = [1] * t.dim()
        shape[batch_dim], shape[slot_dim] = b, width
        idx = order.reshape(shape).expand(*[width if d == slot_dim else n for d, n in enumerate(t.shape)])
        out = torch.zeros_like(t)
        out.narrow(slot_dim, 0, width).copy_(t.gather(slot_dim, idx))
        return out

    self._map_storage(gather)
    self.dense = False
    self.slot_valid = new_valid
    self._compact_checked_at = width
    self._holes_from = None
    cache.length = width


def timed(impl: Any, log: list[float]) -> Any:
    def compact(self: Any, *args: Any, **kwargs: Any) -> None:
        before = self.slot_valid.shape[1]
        t = time.perf_counter()
        impl(self, *args, **kwargs)
        if self.slot_valid.shape[1] != before:
            log.append((time.perf_counter() - t) * 1e3)

    return compact


def main() -> None:
    method, batch, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    decoder = SpeculativeDecoder.from_pretrained(method=method)
    path = f"{bundled_target().rsplit('/', 1)[0]}/stdlib-heldout.jsonl"
    with open(path) as f:
        prompts = [json.loads(line)["prompt"] for line in f][:16]
    decoder.generate(prompts[:batch], max_new_tokens=16, batch_size=batch)  # warm-up
    times: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(repeats):
        order = [("old", old_compact_if_wasteful), ("new", NEW)]
        for name, impl in order if r % 2 == 0 else order[::-1]:
            log: list[float] = []
            runner.ModelRunner.compact_if_wasteful = timed(impl, log)
            t = time.perf_counter()
            decoder.generate(prompts, max_new_tokens=96, batch_size=batch)
            times[name].append(time.perf_counter() - t)
            print(f"{name}: {times[name][-1]:.2f} s, {len(log)} compactions, {sum(log):.0f} ms", flush=True)
    ratio = statistics.median(times["new"]) / statistics.median(times["old"])
    print(f"{method} B = {batch}: median new / old {ratio:.3f}")


if __name__ == "__main__":
    main()
