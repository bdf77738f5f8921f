"""Benchmark variants: `--methods` items with their own options and accept rule.

An item of `--methods` is

    METHOD[@RULE][:NAME=VALUE[,NAME=VALUE...]]

- METHOD: an engine method (`ar`, `chain`, `static`, `eagle2`, `dynatree`) or a Hugging Face
  peer (`hf`, `hf-assisted`, `hf-lookup`);
- RULE (optional): the accept rule of this item only (`greedy`, `sampling`, `mars`, `auto`);
  without it the item runs once per `--verify` rule;
- NAME=VALUE: options of the method's policy (its fields, e.g. `k`, `depth`, `phase`) or of
  the rule (`theta` for `mars`). Names may use `-` for `_`; values are typed like the
  field's default (integers, numbers, on/off for switches, text for paths).

Items are separated by commas; a comma-separated piece without a `:` that looks like
NAME=VALUE continues the options of the item before it, so
`ar,chain:k=3,static:depth=5,branching=2,chain@mars:theta=0.85` is four items.

Global method flags (`--k`, `--depth`, ...) are defaults for every item of a method that
takes them; an item's own options override them. `--mars-theta` is the default theta of
every `mars` item. Labels (report rows) are `method[options]` plus `/rule[rule options]`
when the rule is shown (an explicit @RULE, several --verify rules, or `--mars-thetas`),
e.g. `dynatree[phase=0]`, `chain[k=3]/mars[theta=0.85]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.api import resolve_verify
from specdec.bench.defaults import PEERS
from specdec.errors import SpecDecError
from specdec.method_flags import policy_fields as scalar_fields
from specdec.methods import POLICY_CLASSES, make_policy, method_options
from specdec.verification import RULE_OPTION_DEFAULTS, RULE_OPTIONS, make_rule
from specdec.verification.mars import DEFAULT_THETA

BASELINE = "ar"
"""the method every speedup is measured against (always run)"""

RULES = (*RULE_OPTIONS, "auto")
"""accept rules an item may name after @"""

OPTION_ALIASES = {"expand_top_k": "top_k", "top_k_expand": "top_k", "dynatree_phase": "phase", "mars_theta": "theta"}
"""CLI-style option names accepted in an item, and the field they set"""


@dataclass(frozen=True)
class MethodSpec:
    """One parsed `--methods` item."""

    method: str
    rule: str | None = None
    """the item's own accept rule (None: every --verify rule)"""
    options: Mapping[str, Any] = field(default_factory=dict)
    """policy options given in the item, in the order given"""
    rule_options: Mapping[str, Any] = field(default_factory=dict)
    """accept-rule options given in the item (theta)"""

    @property
    def text(self) -> str:
        """The canonical item text (parses back to an equal spec)."""
        opts = _fmt_options({**self.options, **self.rule_options}, sep=",")
        return self.method + (f"@{self.rule}" if self.rule else "") + (f":{opts}" if opts else "")

    @property
    def base_label(self) -> str:
        """`method` or `method[options]` (the label without the accept rule)."""
        return self.method + (f"[{_fmt_options(self.options)}]" if self.options else "")


@dataclass(frozen=True)
class Variant:
    """One column of the benchmark: a method with its options and accept rule, or a peer."""

    label: str
    method: str
    verify: str | None
    """resolved accept rule (greedy/sampling/mars); None for peers"""
    peer: bool
    options: Mapping[str, Any] = field(default_factory=dict)
    """the policy options this variant runs with (global flags merged with the item's own)"""
    rule_options: Mapping[str, Any] = field(default_factory=dict)
    """the accept rule's options (theta for mars)"""
    base: str = ""
    """the label without the accept rule (groups a method's θ variants in plots)"""
    theta: float | None = None
    """the effective MARS theta (None unless verify is mars)"""


def _fmt_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _fmt_options(options: Mapping[str, Any], sep: str = ",") -> str:
    return sep.join(f"{k}={_fmt_value(v)}" for k, v in options.items())


ON = ("on", "true", "yes", "1")
OFF = ("off", "false", "no", "0")


def _field_default(method: str, name: str) -> Any:
    """The default of policy field `name` (None when it has none or is not a dataclass field); a
    switch whose default is None (`bool | None`: chosen by the device) reads as False, so its
    option text is parsed as on / off."""
    cls = POLICY_CLASSES.get(method)
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    for f in dataclasses.fields(cls):
        if f.name == name:
            default = None if f.default is dataclasses.MISSING else f.default
            if default is None and "bool" in str(f.type).split(" | "):
                return False
            return default
    return None


def _value(item: str, name: str, text: str, default: Any) -> Any:
    """Option text -> value, typed like the field's default: on/off for a switch, an int for an
    int field, a float for a float field; otherwise a number if it reads as one, else the text."""
    if isinstance(default, bool):
        if text.lower() in ON:
            return True
        if text.lower() in OFF:
            return False
        raise SpecDecError(f"--methods item {item!r}: option {name}={text!r} must be on or off")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise SpecDecError(f"--methods item {item!r}: option {name}={text!r} must be an integer") from None
    try:
        return int(text) if not isinstance(default, float) else float(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        if isinstance(default, float):
            raise SpecDecError(f"--methods item {item!r}: option {name}={text!r} must be a number") from None
        return text


def split_method_list(text: str) -> list[str]:
    """Split a `--methods` value into items: a piece `NAME=VALUE` without `:` continues the item before it."""
    items: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece and "@" not in piece:
            if not items or ":" not in items[-1]:
                raise SpecDecError(
                    f"--methods: {piece!r} is an option but no item before it takes options; write METHOD:{piece} (e.g. chain:k=3)"
                )
            items[-1] += "," + piece
        else:
            items.append(piece)
    return items


def parse_method_item(item: str) -> MethodSpec:
    """`METHOD[@RULE][:NAME=VALUE,...]` -> a validated MethodSpec (SpecDecError names the item)."""
    head, _, tail = item.partition(":")
    method, _, rule = head.strip().partition("@")
    method, rule = method.strip(), rule.strip() or None
    known = [*POLICY_CLASSES, *PEERS]
    if method not in known:
        raise SpecDecError(f"--methods: {method!r} is not known; choose from {', '.join(known)}")
    if "@" in head and rule is None:
        raise SpecDecError(f"--methods item {item!r}: nothing after @; name an accept rule ({', '.join(RULES)})")
    if rule is not None and rule not in RULES:
        raise SpecDecError(f"--methods item {item!r}: {rule!r} is not a known accept rule; choose one of {', '.join(RULES)}")
    fixed = method in PEERS or method == BASELINE
    if fixed and (rule is not None or tail.strip()):
        what = "a Hugging Face peer" if method in PEERS else "the AR baseline"
        raise SpecDecError(f"--methods item {item!r}: {method} is {what} and takes no options or accept rule; write plain {method}")
    policy_fields = set(method_options(method)) if method in POLICY_CLASSES else set()
    rule_fields = set(RULE_OPTIONS.get(rule or "", ()))
    options: dict[str, Any] = {}
    rule_options: dict[str, Any] = {}
    for pair in (p.strip() for p in tail.split(",")) if tail.strip() else ():
        name, eq, value = pair.partition("=")
        name = name.strip().replace("-", "_")
        name = OPTION_ALIASES.get(name, name)
        if not eq or not name or not value.strip():
            raise SpecDecError(f"--methods item {item!r}: {pair!r} is not NAME=VALUE")
        number = _value(item, name, value.strip(), _field_default(method, name) if name in policy_fields else RULE_OPTION_DEFAULTS.get(name, 0.0))
        if name in options or name in rule_options:
            raise SpecDecError(f"--methods item {item!r}: option {name} is given twice")
        if name in policy_fields:
            options[name] = number
        elif name in rule_fields:
            rule_options[name] = number
        elif any(name in opts for opts in RULE_OPTIONS.values()):
            owners = [r for r, opts in RULE_OPTIONS.items() if name in opts]
            raise SpecDecError(
                f"--methods item {item!r}: {name} is an option of the accept rule {'/'.join(owners)}; "
                f"write {method}@{owners[0]}:{name}={value.strip()}"
            )
        else:
            # the options a NAME=VALUE text can set (an in-memory cost table is Python-API only)
            takes = ", ".join(sorted(f.name for f in scalar_fields().get(method, []))) or "no options"
            raise SpecDecError(f"--methods item {item!r}: {name} is not an option of {method}; it takes {takes}")
    if method in POLICY_CLASSES:
        try:
            make_policy(method, **options)
            if rule is not None and rule != "auto":
                make_rule(rule, **rule_options)
        except SpecDecError as err:
            raise SpecDecError(f"--methods item {item!r}: {err}") from None
    return MethodSpec(method=method, rule=rule, options=options, rule_options=rule_options)


def parse_method_specs(methods: str | Sequence[str]) -> list[MethodSpec]:
    """A `--methods` value (or a list of items) -> specs, AR first (always run), duplicates dropped."""
    items = split_method_list(methods) if isinstance(methods, str) else [i for m in methods for i in split_method_list(m)]
    if not items:
        raise SpecDecError(f"--methods {methods!r} names no method; give a comma-separated list such as ar,chain,eagle2 (ar alone measures the baseline)")
    specs: dict[str, MethodSpec] = {BASELINE: MethodSpec(BASELINE)}
    for item in items:
        spec = parse_method_item(item)
        specs.setdefault(spec.text, spec)
    return list(specs.values())


def parse_thetas(text: str) -> list[float]:
    """`--mars-thetas 0.84,0.86,...` -> validated thetas (duplicates dropped, order kept)."""
    from specdec.parsing import parse_float_list
    from specdec.verification.mars import validate_theta

    return parse_float_list(text, "--mars-thetas", validate_theta, example="0.84,0.86,0.88,0.9")


def make_variants(
    methods: Sequence[str | MethodSpec],
    verify: Sequence[str],
    temperature: float,
    method_options: Mapping[str, Mapping[str, Any]] | None = None,
    mars_thetas: Sequence[float] | None = None,
    mars_theta: float | None = None,
) -> list[Variant]:
    """Items x accept rules -> variants (AR and peers once each), validated, duplicates dropped.

    - an item with @RULE runs with that rule only (its label shows the rule);
    - otherwise it runs once per rule of `verify` (labels show the rule when there are several);
    - `mars_thetas`: instead, once with the strict rule (greedy at temperature 0, sampling
      above) and once per theta with `mars` (items may then not name a rule);
    - `method_options`: per method, defaults (the global flags) under the item's own options;
    - `mars_theta`: theta of every `mars` variant whose item does not set one.
    """
    specs = [m if isinstance(m, MethodSpec) else parse_method_item(m) for m in methods]
    variants: dict[str, Variant] = {}
    for spec in specs:
        if spec.method in PEERS:
            variants.setdefault(spec.method, Variant(label=spec.method, method=spec.method, verify=None, peer=True, base=spec.method))
            continue
        if spec.method == BASELINE:
            variants.setdefault(
                BASELINE, Variant(label=BASELINE, method=BASELINE, verify=resolve_verify(None, temperature), peer=False, base=BASELINE)
            )
            continue
        options = {**(method_options or {}).get(spec.method, {}), **spec.options}
        try:
            make_policy(spec.method, **options)
        except SpecDecError as err:
            raise SpecDecError(f"--methods item {spec.text!r} with the global method flags: {err}") from None
        rules: list[tuple[str, dict[str, Any]]]
        if spec.rule is not None:
            if mars_thetas:
                raise SpecDecError(
                    f"--methods item {spec.text!r} names an accept rule, but --mars-thetas already runs every method "
                    "strictly and with mars at each theta; drop the @rule"
                )
            rules, show = [(spec.rule, dict(spec.rule_options))], True
        elif mars_thetas:
            rules = [("auto", {})] + [("mars", {"theta": t}) for t in mars_thetas]
            show = True
        else:
            rules, show = [(r, {}) for r in verify], len(verify) > 1
        for rule, given in rules:
            try:
                resolved = resolve_verify(rule, temperature)
                effective = dict(given)
                if resolved == "mars" and "theta" not in effective and mars_theta is not None:
                    effective["theta"] = mars_theta
                make_rule(resolved, **effective)
            except SpecDecError as err:
                raise SpecDecError(f"--methods item {spec.text!r}: {err}") from None
            label = spec.base_label
            if show:
                label += f"/{resolved}" + (f"[{_fmt_options(given)}]" if given else "")
            theta = float(effective.get("theta", DEFAULT_THETA)) if resolved == "mars" else None
            variants.setdefault(
                label,
                Variant(
                    label=label,
                    method=spec.method,
                    verify=resolved,
                    peer=False,
                    options=options,
                    rule_options=effective,
                    base=spec.base_label,
                    theta=theta,
                ),
            )
    return list(variants.values())
