"""Sessions that grow: a session file ingested again after the agent appended to it.

Claude Code, Codex, Aider histories and OpenHands event streams are written while the agent
works, so the same session can reach the warehouse twice: once part-way, once complete. Each copy
is its own raw record (raw is append-only and keeps both), but only the longer one may become an
episode: the shorter would be a duplicate (same trajectory key: quarantined, and the full session
lost) or a second, unrelated episode of the same work.

Session identity: two raw records of a growing format (``Adapter.grows``) are the same session
when they come from the same source, have the same format and the same file name (Claude Code
names the file after the session id, Codex after its timestamp and session id, Aider and
OpenHands keep one file per project or conversation), and the earlier one's complete lines are a
byte prefix of the later one (append-only growth; a partial last line, caught mid-write, is
ignored). The shorter record is then *superseded* by the longer: kept in raw, no episode of its
own, linked by a ``supersedes`` lineage edge from the episodes of the longer record, and its
batch rebuilt without it.
"""

from __future__ import annotations

from pathlib import PurePath

from trajwh.ingest.adapters.registry import adapters, get_adapter
from trajwh.lineage.catalog import Warehouse


def growth_prefix(payload: bytes) -> bytes:
    """What a longer copy must start with: the complete lines (a JSON array without its closing
    bracket: the next event follows a comma)."""
    stripped = payload.rstrip()
    if stripped.endswith(b"]"):
        return stripped[:-1].rstrip()
    cut = payload.rfind(b"\n")
    return payload[: cut + 1] if cut >= 0 else payload


def find_superseded(wh: Warehouse) -> dict[str, tuple[str, str, str]]:
    """``{superseded record id: (superseding record id, its batch, the superseded one's batch)}``,
    the superseding record being the longest copy of the session."""
    formats = [a.name for a in adapters() if a.grows]
    if not formats:
        return {}
    rows = wh.query("""SELECT record_id, batch_id, source, format, file_path, byte_length FROM raw_records
                       WHERE list_contains(?, format)""", [formats]).to_pylist()
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["source"], r["format"], PurePath(r["file_path"]).name), []).append(r)
    candidates = [g for g in groups.values() if len(g) > 1]
    if not candidates:
        return {}
    wanted = [r["record_id"] for g in candidates for r in g]
    payload = {r["record_id"]: r["payload"] for r in wh.query(
        "SELECT record_id, payload FROM raw_records WHERE list_contains(?, record_id)", [wanted]).to_pylist()}
    out: dict[str, tuple[str, str]] = {}
    for group in candidates:
        group.sort(key=lambda r: (r["byte_length"], r["record_id"]))
        for i, short in enumerate(group):
            head = growth_prefix(payload[short["record_id"]])
            for long in reversed(group[i + 1:]):  # the longest copy that extends it
                body = payload[long["record_id"]]
                if head and len(body) > len(head) and body.startswith(head):
                    out[short["record_id"]] = (long["record_id"], long["batch_id"], short["batch_id"])
                    break
    return out


def find_parts(wh: Warehouse) -> tuple[dict[str, tuple[str, str, str]], dict[str, list[str]]]:
    """Sessions stored as many files (``Adapter.assembled``): ``(absorbed, parts)`` where
    ``absorbed`` maps each part record to ``(owner record, owner's batch, its batch)`` like
    ``find_superseded`` does, and ``parts`` maps the owner (the part of the latest batch) to every
    part of its session. The owner's episode is the whole session; when a later batch brings more
    parts, ownership moves there and the earlier owner's batch is rebuilt without it."""
    formats = [a.name for a in adapters() if a.assembled]
    if not formats:
        return {}, {}
    rows = wh.query("""SELECT r.record_id, r.batch_id, r.source, r.format, r.file_path, b.committed_at
                       FROM raw_records r JOIN batches b USING (batch_id)
                       WHERE list_contains(?, r.format)""", [formats]).to_pylist()
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        session = get_adapter(r["format"]).session_of(r["file_path"])
        if session:
            groups.setdefault((r["source"], r["format"], session), []).append(r)
    absorbed: dict[str, tuple[str, str, str]] = {}
    parts: dict[str, list[str]] = {}
    for group in groups.values():
        if len(group) < 2:
            continue
        owner = max(group, key=lambda r: (r["committed_at"], r["file_path"], r["record_id"]))
        parts[owner["record_id"]] = [r["record_id"] for r in sorted(group, key=lambda r: r["file_path"])]
        for r in group:
            if r is not owner:
                absorbed[r["record_id"]] = (owner["record_id"], owner["batch_id"], r["batch_id"])
    return absorbed, parts
