"""Why a greedy output differs from AR's: a numerical tie, or a real mismatch.

A lossless method reproduces the target's own greedy output only up to the arithmetic: a
tree or a batch changes the shapes of the verify forward, so matrix products reduce in
another order and the logits move by a few units in the last place of the run's dtype.
In float32 that almost never flips an argmax; in bfloat16 (8 bits of mantissa) it does
whenever the top two logits are closer than that noise.

At the first position where a method's tokens and AR's differ, the target is run once, on
its own, over the prompt and AR's tokens before that position (the dtype of the run), and
the two competing tokens' logits are compared:

- **numerical tie**: |z(AR's token) - z(method's token)| <= `TIE_ULPS` units in the last
  place of the run's dtype at the larger magnitude (the tokens are equally likely to the
  precision the model computes in: either is the target's greedy choice);
- **mismatch**: anything else (a bug, or a lossy accept rule).

In float32 the tolerance is ~1e-6 relative, so a float32 divergence is classified
"mismatch" unless the logits really tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec.models.support import logits_keep_argument

TIE_ULPS = 8
"""logit differences up to this many units in the last place count as a numerical tie"""


@dataclass
class Divergence:
    """The first differing position of one output against AR's."""

    position: int
    """index into the generated tokens"""
    ar_token: int
    method_token: int
    margin: float
    """z(AR's token) - z(method's token) at that position, in the run's dtype, as float"""
    tolerance: float
    """the tie tolerance at that position (TIE_ULPS ulps at the larger |z|)"""

    @property
    def kind(self) -> str:
        """'numerical tie' or 'mismatch'."""
        return "numerical tie" if abs(self.margin) <= self.tolerance else "mismatch"

    def to_dict(self) -> dict[str, object]:
        return {
            "position": self.position,
            "ar_token": self.ar_token,
            "method_token": self.method_token,
            "margin": self.margin,
            "tolerance": self.tolerance,
            "kind": self.kind,
        }


def first_difference(output: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end); None if equal."""
    for i, (a, b) in enumerate(zip(output, reference, strict=False)):
        if a != b:
            return i
    return None if len(output) == len(reference) else min(len(output), len(reference))


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s numbers at magnitude |value| (at least at 1.0)."""
    magnitude = max(abs(value), 1.0)
    return torch.finfo(dtype).eps * 2.0 ** torch.tensor(magnitude).log2().floor().item()


@torch.inference_mode()
def classify(model: PreTrainedModel, context: Sequence[int], output: Sequence[int], reference: Sequence[int]) -> Divergence | None:
    """The first divergence of `output` from `reference` (AR's), classified; None when they agree
    or one merely stops earlier (EOS/length cut: no competing token)."""
    i = first_difference(output, reference)
    if i is None or i >= len(output) or i >= len(reference):
        return None
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    ids = torch.tensor([list(context) + list(reference[:i])], dtype=torch.long, device=device)
    keep = logits_keep_argument(model)
    z = model(input_ids=ids, **({keep: 1} if keep else {})).logits[0, -1]  # [V] in the run's dtype
    a, m = int(reference[i]), int(output[i])
    za, zm = float(z[a]), float(z[m])
    return Divergence(position=i, ar_token=a, method_token=m, margin=za - zm, tolerance=TIE_ULPS * ulp(max(abs(za), abs(zm)), dtype))
