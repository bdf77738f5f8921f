"""Isotonic regression by pool-adjacent-violators (pure Python: no numpy, no torch)."""

from __future__ import annotations

from collections.abc import Iterable


def isotonic(values: Iterable[float], weights: Iterable[float] | None = None) -> list[float]:
    """The weighted least-squares non-decreasing fit of `values` (pool-adjacent-violators).

    Scanning left to right, a value below the block before it is pooled with that block (their
    weighted mean), repeatedly, so each output is the mean of the block it ended in. Weights
    default to 1; a block of zero total weight takes the plain mean of the two it merged.
    Example: [5, 4, 6, 5.5] -> [4.5, 4.5, 5.75, 5.75].
    """
    values = [float(v) for v in values]
    weights = [1.0] * len(values) if weights is None else [float(w) for w in weights]
    if len(weights) != len(values):
        raise ValueError(f"isotonic: {len(values)} values but {len(weights)} weights")
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            total = w1 + w2
            blocks.append([(m1 * w1 + m2 * w2) / total if total > 0 else (m1 + m2) / 2, total, n1 + n2])
    return [mean for mean, _, count in blocks for _ in range(int(count))]
