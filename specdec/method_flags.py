"""The CLI's method-option flags, generated from the policy dataclasses without importing them.

The policy modules import torch, and `specdec --help` must not, so the dataclasses are read
with `ast` from their source files: each init field's name, type, default and docstring (the
string literal after the field) becomes a flag. tests/test_cli.py checks the result against
`dataclasses.fields` of `specdec.methods.POLICY_CLASSES`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from specdec.names import METHOD_NAMES

POLICY_SOURCES: dict[str, tuple[str, str]] = {
    "ar": ("drafting/policies.py", "ARPolicy"),
    "chain": ("drafting/policies.py", "ChainPolicy"),
    "static": ("drafting/policies.py", "StaticTreePolicy"),
    "eagle2": ("drafting/policies.py", "Eagle2Policy"),
    "dynatree": ("drafting/dynatree.py", "DynaTreePolicy"),
    "cast": ("drafting/cast.py", "CastPolicy"),
}
"""method -> (source file below specdec/, class name) of `specdec.methods.POLICY_CLASSES` (tested)"""

FLAG_NAMES: dict[str, str] = {
    "top_k": "expand-top-k",  # --top-k is the sampling filter
    "phase": "dynatree-phase",
    "c1": "cast-c1",
    "c2": "cast-c2",
    "c3": "cast-c3",
    "buffer": "cast-buffer",
    "lookahead": "cast-lookahead",
}
"""fields whose flag is not `--field-name` (a clash, or a name too short to stand alone)"""

NOT_OPTIONS = ("name", "uses_draft")
"""init fields that are no method options"""

SCALARS = ("int", "float", "str", "bool")
"""field types a flag can carry (others, e.g. an in-memory cost table, are Python-API only)"""


@dataclass(frozen=True)
class PolicyField:
    """One method option as its policy dataclass declares it."""

    name: str
    type: str
    """int, float, str or bool (`X | None` is X)"""
    default: Any
    doc: str
    """the field's docstring, white space folded ('' if none)"""


@dataclass(frozen=True)
class MethodFlag:
    """One CLI flag: a policy field name shared by the methods that declare it."""

    field: str
    flag: str
    """e.g. --expand-top-k"""
    dest: str
    type: str
    methods: dict[str, PolicyField]
    """method -> its declaration of the field, in METHOD_NAMES order"""

    def help(self) -> str:
        """Each method's doc and default; methods with the same doc share it, e.g.
        `static/eagle2: levels below the root (4 / 6); cast: ...` (no default shown for None)."""
        fallback = next((f.doc for f in self.methods.values() if f.doc), self.field.replace("_", " "))
        groups: dict[str, list[tuple[str, Any]]] = {}
        for method, decl in self.methods.items():
            groups.setdefault(decl.doc or fallback, []).append((method, decl.default))
        parts = []
        for doc, entries in groups.items():
            defaults = [_shown(d) for _, d in entries if d is not None]
            shown = f" ({' / '.join(defaults)})" if len(defaults) == len(entries) else ""
            parts.append(f"{'/'.join(m for m, _ in entries)}: {doc}{shown}")
        return "; ".join(parts).replace("%", "%%")  # argparse formats help with %


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _literal(node: ast.expr | None) -> tuple[bool, Any]:
    """(init, default) of a field's value: a literal, or `field(default=..., init=...)`."""
    if node is None:
        return True, None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "field":
        kw = {k.arg: k.value for k in node.keywords}
        init = ast.literal_eval(kw["init"]) if "init" in kw else True
        return init, ast.literal_eval(kw["default"]) if "default" in kw else None
    return True, ast.literal_eval(node)


def _scalar(annotation: ast.expr) -> str | None:
    parts = [p.strip() for p in ast.unparse(annotation).split("|")]
    kept = [p for p in parts if p != "None"]
    return kept[0] if len(kept) == 1 and kept[0] in SCALARS else None


def _class_fields(tree: ast.Module, class_name: str) -> list[PolicyField]:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    out: list[PolicyField] = []
    body = node.body
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        init, default = _literal(stmt.value)
        kind = _scalar(stmt.annotation)
        if not init or name in NOT_OPTIONS or name.startswith("_") or kind is None:
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        doc = ""
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            doc = re.sub(r"\s+", " ", after.value.value).strip()
        out.append(PolicyField(name, kind, default, doc))
    return out


def _is_dataclass(tree: ast.Module, class_name: str) -> bool:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return any(getattr(d.func if isinstance(d, ast.Call) else d, "id", None) == "dataclass" for d in node.decorator_list)


@lru_cache(maxsize=1)
def policy_fields() -> dict[str, list[PolicyField]]:
    """method -> its flag-able option fields, read from the policy sources."""
    root = Path(__file__).resolve().parent
    trees: dict[str, ast.Module] = {}
    out: dict[str, list[PolicyField]] = {}
    for method in METHOD_NAMES:
        path, class_name = POLICY_SOURCES[method]
        if path not in trees:
            trees[path] = ast.parse((root / path).read_text())
        out[method] = _class_fields(trees[path], class_name) if _is_dataclass(trees[path], class_name) else []
    return out


@lru_cache(maxsize=1)
def method_flags() -> tuple[MethodFlag, ...]:
    """Every method-option flag, in the order of first declaration over METHOD_NAMES."""
    by_field: dict[str, dict[str, PolicyField]] = {}
    for method, fields in policy_fields().items():
        for decl in fields:
            by_field.setdefault(decl.name, {})[method] = decl
    flags = []
    for name, methods in by_field.items():
        kinds = {d.type for d in methods.values()}
        if len(kinds) != 1:
            raise TypeError(f"policy field {name} has different types across methods: {sorted(kinds)}")
        flag = FLAG_NAMES.get(name, name.replace("_", "-"))
        flags.append(MethodFlag(name, "--" + flag, flag.replace("-", "_"), kinds.pop(), methods))
    return tuple(flags)
