"""Shared tools of the distribution tests: the exact target distribution by enumeration and
a chi-square goodness-of-fit p-value."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy.stats import chisquare

from specdec.sampling import SamplingParams, logits_to_logprobs


def exact_joint(target, prompt: list[int], vocab: int, tokens: int, params: SamplingParams) -> np.ndarray:
    """P(x1..x_tokens | prompt) under the processed target distribution, by enumeration:
    shape [vocab] * tokens."""
    cache: dict[tuple[int, ...], np.ndarray] = {}

    def conditional(prefix: tuple[int, ...]) -> np.ndarray:
        if prefix not in cache:
            with torch.no_grad():
                logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            cache[prefix] = logits_to_logprobs(logits, params).exp().double().numpy()
        return cache[prefix]

    joint = np.zeros((vocab,) * tokens)
    for prefix in itertools.product(range(vocab), repeat=tokens - 1):
        joint[prefix] = np.prod([conditional(prefix[:i])[prefix[i]] for i in range(len(prefix))]) * conditional(prefix)
    return joint


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    expected, observed = probs.flatten() * counts.sum(), counts.flatten()
    small = expected < 5
    exp_cells = np.append(expected[~small], expected[small].sum())
    obs_cells = np.append(observed[~small], observed[small].sum())
    if exp_cells[-1] == 0:
        exp_cells, obs_cells = exp_cells[:-1], obs_cells[:-1]
    return float(chisquare(obs_cells, exp_cells * obs_cells.sum() / exp_cells.sum()).pvalue)
