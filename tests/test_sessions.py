"""Sessions that grow: a session file ingested part-way, then again complete, is one episode
(the longer), the shorter copy kept in raw and linked by lineage (ingest/sessions.py)."""

from __future__ import annotations

import json
import shutil

from ingest.normalize import normalize_warehouse
from ingest.raw_store import IngestOptions, ingest_paths
from ingest.sessions import growth_prefix


def _rows(wh, sql, params=None):
    return wh.query(sql, params).to_pylist()


def _ingest(wh, path):
    ingest_paths(wh, [path], IngestOptions(source="laptop"))
    return normalize_warehouse(wh, run_id="n")


def test_codex_session_ingested_part_way_then_complete_is_one_episode(wh, cases, tmp_path):
    full = cases / "codex" / "rollout-2025-11-03T10-00-00-sess-codex-2.jsonl"
    lines = full.read_bytes().splitlines(keepends=True)
    part = tmp_path / "early" / full.name
    part.parent.mkdir()
    part.write_bytes(b"".join(lines[:6]) + lines[6][:40])  # caught mid-write: a partial last line
    _ingest(wh, part)
    first = _rows(wh, "SELECT trajectory_key, n_steps FROM episodes")
    assert len(first) == 1
    later = tmp_path / "later" / full.name
    later.parent.mkdir()
    shutil.copy(full, later)
    s = _ingest(wh, later)
    eps = _rows(wh, "SELECT trajectory_key, n_steps, _record_id FROM episodes")
    assert len(eps) == 1 and eps[0]["n_steps"] > first[0]["n_steps"] and s.superseded == 1
    assert _rows(wh, "SELECT count(*) AS n FROM raw_records")[0]["n"] == 2  # raw keeps both copies
    assert _rows(wh, "SELECT count(*) AS n FROM quarantine")[0]["n"] == 0  # not a quarantined duplicate
    old = _rows(wh, "SELECT record_id FROM raw_records WHERE record_id <> ?", [eps[0]["_record_id"]])[0]["record_id"]
    edge = _rows(wh, "SELECT transform FROM lineage_edges WHERE child_id = ? AND parent_id = ?",
                 [eps[0]["trajectory_key"], old])
    assert edge == [{"transform": "supersedes"}]


def test_claude_session_grown_in_place_and_ingested_in_any_order(wh, cases, tmp_path):
    src = cases / "claude" / "5b1f0c2e-7a41-4c55-9d0e-1a2b3c4d5e6f.jsonl"
    lines = src.read_bytes().splitlines(keepends=True)
    grown = tmp_path / "b" / src.name
    grown.parent.mkdir()
    grown.write_bytes(b"".join(lines))
    _ingest(wh, grown)  # the longer copy first
    short = tmp_path / "a" / src.name
    short.parent.mkdir()
    short.write_bytes(b"".join(lines[:3]))
    s = _ingest(wh, short)  # then an older, shorter copy
    eps = _rows(wh, "SELECT n_steps FROM episodes")
    assert eps == [{"n_steps": max(e["n_steps"] for e in eps)}] and s.superseded == 1
    assert eps[0]["n_steps"] > 3


def test_same_file_name_with_other_content_is_another_session(wh, cases, tmp_path):
    src = cases / "claude" / "5b1f0c2e-7a41-4c55-9d0e-1a2b3c4d5e6f.jsonl"
    other = tmp_path / "x" / src.name
    other.parent.mkdir()
    lines = src.read_bytes().splitlines(keepends=True)
    other.write_bytes(lines[0].replace(b"parse_header", b"parse_footer") + b"".join(lines[1:]))
    _ingest(wh, src)
    s = _ingest(wh, other)
    assert s.superseded == 0
    assert _rows(wh, "SELECT count(*) AS n FROM episodes")[0]["n"] == 2  # not a prefix: both stay


def test_openhands_event_array_grows_by_events():
    short = json.dumps([{"id": 1}, {"id": 2}], indent=1).encode()
    longer = json.dumps([{"id": 1}, {"id": 2}, {"id": 3}], indent=1).encode()
    assert longer.startswith(growth_prefix(short)) and not short.startswith(growth_prefix(longer))
