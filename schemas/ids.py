"""Identifiers (ARCHITECTURE.md section 3).

- ``record_id``: sha256 over (source, NUL, the record's bytes), full 64 hex digits. The same
  record from the same source always gets the same id, so re-ingesting is a no-op.
- ``trajectory_key``: sha256 over the canonical JSON of the key fields that are present,
  first 32 hex digits (128 bits). The row records which fields it was built from.
- ``step_id``: sha256(trajectory_key, step_index), 32 hex digits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import orjson

#: fields that make an episode the same episode, in key order
TRAJECTORY_KEY_FIELDS: tuple[str, ...] = (
    "task_digest",
    "initial_state_digest",
    "env_image_digest",
    "policy_checkpoint",
    "harness_name",
    "harness_commit",
    "tool_schema_digest",
    "verifier_commit",
    "sampling_digest",
    "attempt",
    "source_episode_id",
)

#: used only when a source gives neither an attempt number nor its own episode id: without
#: it two rollouts of one task by one policy would collide. It is the raw record id and the
#: episode's position in that record, and the key lists it so nobody mistakes it for content.
FALLBACK_KEY_FIELD = "raw_origin"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record_id(source: str, payload: bytes) -> str:
    h = hashlib.sha256(source.encode("utf-8"))
    h.update(b"\0")
    h.update(payload)
    return h.hexdigest()


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON: sorted keys, no whitespace, UTC datetimes."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_UTC_Z | orjson.OPT_NAIVE_UTC)


def digest(value: Any) -> str:
    """Short content digest (32 hex) of a JSON-able value or a string."""
    data = value.encode("utf-8") if isinstance(value, str) else canonical_json(value)
    return sha256_hex(data)[:32]


def text_digests(values: Iterable[str]) -> list[str]:
    """``digest`` of each string (its string case, next to it above), in one loop without a call per
    value (84,000 cluster roots: 0.16 s through ``digest``, 0.06 s here)."""
    return [hashlib.sha256(v.encode("utf-8")).hexdigest()[:32] for v in values]


def trajectory_key(fields: dict[str, Any], *, raw_origin: str | None = None) -> tuple[str, list[str], list[str]]:
    """Return (key, fields used, fields missing) for the given key-field values."""
    present = {k: fields[k] for k in TRAJECTORY_KEY_FIELDS if fields.get(k) is not None}
    missing = [k for k in TRAJECTORY_KEY_FIELDS if k not in present]
    if "attempt" not in present and "source_episode_id" not in present:
        if raw_origin is None:
            raise ValueError("raw_origin is required when a source has no attempt and no episode id")
        present[FALLBACK_KEY_FIELD] = raw_origin
    return digest(present), list(present), missing


def step_id(trajectory_key: str, step_index: int) -> str:
    return sha256_hex(f"{trajectory_key}:{step_index}".encode())[:32]


def short_id(*parts: str) -> str:
    """A 32-hex id from text parts (batches, runs, quarantine rows)."""
    return sha256_hex("\x1f".join(parts).encode("utf-8"))[:32]
