"""Values a row may hold: what an adapter produced must fit the tables' types, or the record is
quarantined at normalize with the reason (and never reaches a table that later stages read).

- integers fit 64 bits (the tables store int64);
- times are real instants between 1900 and 2200 UTC once their offset is applied
  (``0001-01-01T00:00:00+14:00`` is year 0 in UTC: no reader could load it back);
- floats are finite;
- text is valid Unicode (no lone surrogates: ``"\\ud800"`` in JSON decodes to one, and Parquet
  cannot store it).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
EARLIEST = datetime(1900, 1, 1, tzinfo=UTC)
LATEST = datetime(2200, 1, 1, tzinfo=UTC)


def bad_value(value: Any, path: str = "") -> str | None:
    """The first value under ``value`` that no table can hold, as ``path: problem; valid``."""
    if _fits(value):  # the common case, checked without building a path for every value
        return None
    return _find(value, path)


def _fits(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is str:
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return False
        elif t is dict:
            stack.extend(v.values())
        elif t is list or t is tuple:
            stack.extend(v)
        elif t is int:
            if not INT64_MIN <= v <= INT64_MAX:
                return False
        elif v is None or t is bool:
            continue
        elif t is float:
            if not math.isfinite(v):
                return False
        else:  # datetimes, subclasses: the full check
            if _find(v, "") is not None:
                return False
    return True


def _find(value: Any, path: str) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            return f"{path}: integer {str(value)[:40]} does not fit 64 bits; valid: -2**63 .. 2**63-1"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path}: {value} is not a finite number"
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{path}: text holds a lone surrogate at character {exc.start}; valid: Unicode text"
        return None
    if isinstance(value, datetime):
        try:
            moment = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
        except (OverflowError, ValueError):
            return f"{path}: time {value.isoformat()} is out of range once its offset is applied"
        if not EARLIEST <= moment < LATEST:
            return f"{path}: time {value.isoformat()} is out of range; valid: 1900-01-01 .. 2200-01-01 UTC"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            problem = _find(v, f"{path}.{k}" if path else str(k))
            if problem:
                return problem
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            problem = _find(v, f"{path}[{i}]")
            if problem:
                return problem
    return None
