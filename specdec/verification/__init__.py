"""Accept rules: greedy exact match, lossless rejection sampling, MARS margin-aware."""

from typing import Any

from specdec.verification.base import AcceptRule, Verdict
from specdec.verification.greedy import GreedyRule
from specdec.verification.mars import MarsRule
from specdec.verification.sampling import SamplingRule

__all__ = ["RULE_OPTIONS", "RULE_OPTION_DEFAULTS", "AcceptRule", "GreedyRule", "MarsRule", "SamplingRule", "Verdict", "make_rule"]

RULE_OPTIONS: dict[str, tuple[str, ...]] = {"greedy": (), "sampling": ("walk", "chains", "segments"), "mars": ("theta", "walk")}
"""every `--verify` name and the options its rule takes"""

RULE_OPTION_DEFAULTS: dict[str, Any] = {"walk": "auto", "theta": 0.9, "chains": "block", "segments": "auto"}
"""each rule option's default (its type types the option's text in `--methods` items)"""


def make_rule(name: str, **options: Any) -> AcceptRule:
    """Accept rule by name: 'greedy', 'sampling' (options: walk, where trees are tested: 'auto',
    'device' or 'host'; chains, how chains are verified: 'block', the default, or 'token';
    segments, how branching trees are verified: 'auto', the default, and 'traversal' the whole
    tree from the leaves up, 'block' chain segments as blocks or 'token' child by child) or
    'mars' (options: theta, default 0.9, and walk).

    An option the rule does not take is an error, e.g. make_rule("greedy", theta=0.9).
    """
    from specdec.errors import SpecDecError

    if name not in RULE_OPTIONS:
        raise SpecDecError(f"--verify {name!r} is not a known accept rule; choose one of {', '.join(RULE_OPTIONS)}")
    unknown = sorted(set(options) - set(RULE_OPTIONS[name]))
    if unknown:
        takes = f"it takes {', '.join(RULE_OPTIONS[name])}" if RULE_OPTIONS[name] else "it takes no options"
        raise SpecDecError(f"option(s) {', '.join(unknown)} do not apply to --verify {name}; {takes}")
    if name == "greedy":
        return GreedyRule()
    if name == "sampling":
        return SamplingRule(**options)
    return MarsRule(**options)
