"""Accept rules: greedy exact match, lossless rejection sampling (and MARS)."""

from specdec.verification.base import AcceptRule, Verdict
from specdec.verification.greedy import GreedyRule
from specdec.verification.sampling import SamplingRule

__all__ = ["AcceptRule", "GreedyRule", "SamplingRule", "Verdict", "make_rule"]


def make_rule(name: str, **options) -> AcceptRule:
    """Accept rule by name: 'greedy' or 'sampling' (MARS arrives as 'mars')."""
    from specdec.errors import SpecDecError

    if name == "greedy":
        return GreedyRule()
    if name == "sampling":
        return SamplingRule()
    raise SpecDecError(f"--verify {name!r} is not a known accept rule; choose one of greedy, sampling")
