"""Method names -> tree policies, with their options validated up front."""

from __future__ import annotations

import dataclasses
from typing import Any

from specdec.drafting.base import TreePolicy
from specdec.drafting.cast import CastPolicy
from specdec.drafting.dynatree import DynaTreePolicy
from specdec.drafting.policies import ARPolicy, ChainPolicy, Eagle2Policy, StaticTreePolicy
from specdec.errors import SpecDecError

POLICY_CLASSES: dict[str, type[TreePolicy]] = {
    "ar": ARPolicy,
    "chain": ChainPolicy,
    "static": StaticTreePolicy,
    "eagle2": Eagle2Policy,
    "dynatree": DynaTreePolicy,
    "cast": CastPolicy,
}
"""every `--method` name and the policy class that implements it"""


def method_options(method: str) -> list[str]:
    """The option names a method accepts (its config fields)."""
    cls = _policy_class(method)
    if not dataclasses.is_dataclass(cls):
        return []
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("name", "uses_draft")]


def method_uses_draft(method: str) -> bool:
    """Whether `method` drafts at all (its policy's `uses_draft`; False only for plain AR)."""
    return _policy_class(method).uses_draft


def _policy_class(method: str) -> type[TreePolicy]:
    if not isinstance(method, str):
        raise SpecDecError(f"method={method!r} must be a method's name, one of {', '.join(POLICY_CLASSES)}")
    if method not in POLICY_CLASSES:
        hint = ""
        if ":" in method:  # bench's `--methods name:option=value` form
            hint = "; a method's options are their own flags here (for example --k, --depth, --total-tokens: see --help), `name:option=value` is bench's --methods form"
        raise SpecDecError(f"--method {method!r} is not known; choose one of {', '.join(POLICY_CLASSES)}{hint}")
    return POLICY_CLASSES[method]


def make_policy(method: str, **options: Any) -> TreePolicy:
    """A fresh policy for `method`; an option the method does not take is an error."""
    cls = _policy_class(method)
    allowed = method_options(method)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        hint = f"it takes {', '.join(allowed)}" if allowed else "it takes no options"
        raise SpecDecError(f"option(s) {', '.join(unknown)} do not apply to --method {method}; {hint}")
    return cls(**options)
