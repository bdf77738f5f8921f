"""Sampling parameters and the one place logits become probabilities.

Both models' distributions go through `logits_to_logprobs` with the same
`SamplingParams`, so temperature, top-p and top-k act on draft and target alike.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from specdec.errors import SpecDecError

TINY_TEMPERATURE = 1e-3
"""temperatures below this are applied after subtracting each row's max logit (`logits_to_logprobs`)"""


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from a distribution."""

    temperature: float = 0.0
    """0 = greedy (argmax); > 0 = sample from softmax(logits / temperature)"""
    top_p: float = 1.0
    """nucleus: keep the smallest set of tokens whose probability reaches top_p; in (0, 1]"""
    top_k: int = 0
    """keep only the k most likely tokens; 0 = no limit"""

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) or not 0 <= self.temperature < float("inf"):  # also refuses nan
            raise SpecDecError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 means greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) or not 0 < self.top_p <= 1:
            raise SpecDecError(f"top_p={self.top_p!r} must be a number in (0, 1]; use 1.0 to disable nucleus sampling")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise SpecDecError(f"top_k={self.top_k!r} must be an integer >= 0 (the number of most likely tokens kept); use 0 to disable top-k filtering")
        if self.top_k < 0:
            raise SpecDecError(f"top_k={self.top_k!r} must be >= 0; use 0 to disable top-k filtering")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities after temperature, top-k and top-p; masked tokens get -inf.

    logits: [..., V] (any float dtype). Returns float32 [..., V].
    Greedy params use temperature 1 and no masks: the result then is the model's own
    distribution, used for draft confidences (tree shaping) while tokens are chosen by argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    if params.temperature < TINY_TEMPERATURE:
        # logits / T could overflow to inf (then inf - inf = nan): each row's max first, so the max
        # entry becomes 0 and the others large negative or -inf (the argmax distribution); T is kept
        # >= float32's smallest normal, below which it would round to 0. Above TINY_TEMPERATURE no
        # float32 logit under 1e35 overflows, and the hot path skips the extra passes
        top = logits.amax(dim=-1, keepdim=True).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # a row of all -inf stays -inf
        logits = (logits - top).div_(max(params.temperature, torch.finfo(torch.float32).tiny))
    elif params.temperature != 1.0:  # x / 1.0 == x exactly: T = 1 skips a pass over [..., V]
        logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One sample per row. probs: [..., V] (need not be normalised; rows of zeros give token 0).
    Returns [...] int64. uniforms: the draw's U(0, 1) numbers, shaped as probs, drawn by the
    caller (left as they are: a captured drafting level reads them from a buffer filled before
    each replay); None draws them from `generator`.

    The exponential race: with E_v = -log(u_v) i.i.d. Exp(1), argmin_v E_v / probs_v is v with
    probability probs_v / sum(probs) (the smallest of independent exponentials of rates probs_v),
    taken as argmax_v log(u_v) / probs_v (4 ops; a zero-probability token gets -inf).
    Uniforms are drawn with `rand` and no input check runs, so nothing waits for the device:
    `torch.multinomial` draws the same race with `exponential_`, 3-5x slower on a CPU (151 against
    47 us a draw at V = 8192, 17.8 against 3.7 ms for 8 rows at V = 131072), and checks its input
    first (a device read in older PyTorch versions). Float32 uniforms are multiples of 2^-24, so
    each E_v is cut at 16.6 and a token is left out of a draw with probability 2^-24: changes to
    the distribution below 1e-7, far under any test's resolution (as for `exponential_`)."""
    flat = probs.reshape(-1, probs.shape[-1]).float()
    if uniforms is None:
        race = torch.rand(flat.shape, generator=generator, device=flat.device).log_()  # [rows, V] -Exp(1)
    else:
        race = uniforms.reshape(flat.shape).log()
    return torch.div(race, flat, out=race).argmax(dim=-1).reshape(probs.shape[:-1])


def choose_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The next token from target logits [..., V]: argmax when greedy, else a sample. Returns [...] int64."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample_from_probs(logits_to_logprobs(logits, params).exp(), generator)
