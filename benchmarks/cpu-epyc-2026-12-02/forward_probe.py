"""What a forward of n new tokens costs on this machine today, for the bundled pair's two models,
plus the machine's memory bandwidth and matmul throughput: the numbers that decide whether
verifying a wide tree is nearly free (memory-bound forwards, GPU-like) or costs in proportion to
its tokens (compute-bound, the CPU of earlier sweeps).

    python benchmarks/cpu-epyc-2026-12-02/forward_probe.py

Plain transformers forwards (specdec only names the cache argument) over a 200-token cache, median of 20 each.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from specdec.models.support import cache_argument, output_cache

PAIR = Path(__file__).resolve().parents[2] / "specdec/assets/pair"


def median_ms(call: object, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def forward_and_drop(model: Any, ids: torch.Tensor, cache_kwargs: dict[str, Any], cache: Any) -> None:
    """One forward of ids [1, n] over the cache, then the n new entries dropped again."""
    model(ids, use_cache=True, **cache_kwargs)
    cache.crop(-ids.shape[1])


def main() -> None:
    torch.manual_seed(0)
    big = torch.empty(64 * 2**20)  # 256 MiB of float32
    dst = torch.empty_like(big)
    copy_ms = median_ms(lambda: dst.copy_(big), 10)
    print(f"memory: copy of 256 MiB {copy_ms:.1f} ms = {2 * big.numel() * 4 / copy_ms / 1e6:.1f} GB/s (read + write)")
    a = torch.randn(2048, 2048)
    mm_ms = median_ms(lambda: a @ a, 10)
    print(f"matmul 2048^3 float32: {mm_ms:.1f} ms = {2 * 2048**3 / mm_ms / 1e6:.0f} GFLOP/s ({torch.get_num_threads()} threads)")
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(PAIR / name, dtype=torch.float32).eval()
        params = sum(p.numel() for p in model.parameters())
        arg = cache_argument(model)  # 'cache' (transformers >= 5.24) or 'past_key_values'
        with torch.inference_mode():
            cache = output_cache(model(torch.randint(0, 1000, (1, 200)), use_cache=True))
            row = []
            for n in (1, 6, 16, 64):
                step = partial(forward_and_drop, model, torch.randint(0, 1000, (1, n)), {arg: cache}, cache)
                step()
                row.append(f"n={n} {median_ms(step):.2f} ms")
        print(f"{name} ({params / 1e6:.1f} M parameters, {params * 4 / 2**20:.0f} MiB float32): " + ", ".join(row))


if __name__ == "__main__":
    main()
