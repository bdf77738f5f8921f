"""One draw per row from a [B, V] distribution: `torch.multinomial` (what `sample_from_probs`
used before), the exponential race with `exponential_` (the bonus draws before), and the race
over `rand` uniforms (`specdec.sampling.sample_from_probs` now). Median microseconds per draw.

    python benchmarks/chain-path/sample_micro.py
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec.sampling import sample_from_probs


def timed(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples)


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| V | B | multinomial us | exponential_ race us | rand race us (now) | multinomial / now |")
    print("|---:|---:|---:|---:|---:|---:|")
    for vocab in (8192, 32768, 131072):
        for batch in (1, 8):
            probs = torch.rand(batch, vocab).softmax(-1)
            generator = torch.Generator().manual_seed(0)
            multinomial = timed(lambda p=probs, g=generator: torch.multinomial(p, 1, generator=g))
            exponential = timed(lambda p=probs, g=generator: (p / torch.empty_like(p).exponential_(generator=g)).argmax(-1))
            race = timed(lambda p=probs, g=generator: sample_from_probs(p, g))
            print(f"| {vocab} | {batch} | {multinomial:.0f} | {exponential:.0f} | {race:.0f} | {multinomial / race:.1f}x |")


if __name__ == "__main__":
    main()
