"""SPDX license expressions: validation, normalization, and a decision under a use's policy.

Parsing and the license list come from ``license-expression`` (aboutcode-org, the SPDX license
list bundled, no network), so ``mit or apache-2.0`` becomes ``MIT OR Apache-2.0`` and ``GPL-2.0``
-style typos are named. ``LicenseRef-...`` (and ``DocumentRef-...:LicenseRef-...``) are the
SPDX way to name terms outside the list (a model provider's output terms, an internal license):
they are valid by their shape.

A decision under one use (``train`` or ``release``): each license id is ``allow`` when it matches
an ``allow`` pattern, else ``review`` when it matches a ``review`` pattern, else ``block``; a
``WITH`` exception is matched as ``ID WITH EXC`` first, then as its license. ``OR`` is the
licensee's choice (the best branch), ``AND`` binds every part (the worst).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

from trajwh.schemas.errors import ConfigError

DECISION_RANK = {"block": 0, "review": 1, "allow": 2}
_REF = re.compile(r"^(DocumentRef-[A-Za-z0-9.\-]+:)?LicenseRef-[A-Za-z0-9.\-]+$")
_REF_TOKEN = re.compile(r"(?:DocumentRef-[A-Za-z0-9.\-]+:)?LicenseRef-[A-Za-z0-9.\-]+")


@cache
def _licensing() -> Any:
    from license_expression import get_spdx_licensing

    return get_spdx_licensing()


@dataclass(frozen=True)
class Parsed:
    """A checked expression: ``normalized`` when valid, else ``error`` says what is wrong."""

    given: str
    normalized: str | None
    error: str | None
    tree: Any = None  # nested ("AND"|"OR", [children]) / ("ID", key), for decide()

    @property
    def valid(self) -> bool:
        return self.error is None


@lru_cache(maxsize=4096)
def parse(text: str | None) -> Parsed:
    """Validate and normalize an SPDX expression (cached: a warehouse has few distinct ones)."""
    given = (text or "").strip()
    if not given:
        return Parsed(text or "", None, "empty")
    from license_expression import ExpressionError

    # LicenseRef ids are not in the list: stand them in as unique known-shaped placeholders
    refs: dict[str, str] = {}

    def stand_in(m: re.Match[str]) -> str:
        key = f"licenseref-standin-{len(refs)}"
        refs[key] = m.group(0)
        return key

    masked = _REF_TOKEN.sub(stand_in, given)
    lic = _licensing()
    try:
        expr = lic.parse(masked, validate=False, simple=False)
    except ExpressionError as exc:
        return Parsed(given, None, f"not an SPDX expression: {exc}")
    if expr is None:
        return Parsed(given, None, "empty")
    unknown = [k for k in lic.unknown_license_keys(expr) if k not in refs]
    if unknown:
        return Parsed(given, None, f"unknown license id(s) {', '.join(sorted(unknown))} (not on the SPDX list, "
                                   "and not LicenseRef-...)")
    expr = lic.validate(masked).normalized_expression if not refs else str(expr)
    # the normalized text with the LicenseRef ids put back
    text_out = str(expr)
    for key, ref in refs.items():
        text_out = re.sub(re.escape(key), ref, text_out, flags=re.I)
    tree = _tree(lic.parse(masked, validate=False), refs)
    return Parsed(given, text_out, None, tree)


def _tree(node: Any, refs: dict[str, str]) -> Any:
    from license_expression import AND, OR, LicenseSymbol, LicenseWithExceptionSymbol

    if isinstance(node, LicenseWithExceptionSymbol):
        return ("ID", f"{_key(node.license_symbol.key, refs)} WITH {node.exception_symbol.key}")
    if isinstance(node, LicenseSymbol):
        return ("ID", _key(node.key, refs))
    op = "AND" if isinstance(node, AND) else "OR" if isinstance(node, OR) else None
    if op is None:
        raise ConfigError(f"unsupported license expression node {node!r}", valid="SPDX AND / OR / WITH")
    return (op, [_tree(a, refs) for a in node.args])


def _key(key: str, refs: dict[str, str]) -> str:
    return refs.get(key.lower(), key)


def require_valid(text: str, where: str) -> str:
    """The normalized expression, or a ConfigError naming the input and what is valid."""
    p = parse(text)
    if not p.valid:
        raise ConfigError(f"license {text!r} is not a valid SPDX expression: {p.error}", where=where,
                          valid="an SPDX id or expression from spdx.org/licenses (e.g. MIT, Apache-2.0, "
                                "'MIT OR Apache-2.0', 'GPL-2.0-only WITH Classpath-exception-2.0') or LicenseRef-NAME")
    return p.normalized  # type: ignore[return-value]


def _matches(license_id: str, patterns: tuple[str, ...]) -> bool:
    low = license_id.lower()
    return any(fnmatch.fnmatchcase(low, p.lower()) for p in patterns)


def decide_id(license_id: str, allow: tuple[str, ...], review: tuple[str, ...]) -> str:
    candidates = [license_id]
    if " WITH " in license_id:
        candidates.append(license_id.split(" WITH ")[0])
    for cand in candidates:
        if _matches(cand, allow):
            return "allow"
    for cand in candidates:
        if _matches(cand, review):
            return "review"
    return "block"


def decide(parsed: Parsed, allow: tuple[str, ...], review: tuple[str, ...]) -> tuple[str, list[str]]:
    """(decision, the ids that were not allowed) of a valid expression under a use's patterns."""
    not_allowed: list[str] = []

    def walk(node: Any) -> int:
        if node[0] == "ID":
            d = decide_id(node[1], allow, review)
            if d != "allow":
                not_allowed.append(f"{node[1]} ({d})")
            return DECISION_RANK[d]
        ranks = [walk(child) for child in node[1]]
        return min(ranks) if node[0] == "AND" else max(ranks)

    rank = walk(parsed.tree)
    decision = next(k for k, v in DECISION_RANK.items() if v == rank)
    return decision, ([] if decision == "allow" else not_allowed)
