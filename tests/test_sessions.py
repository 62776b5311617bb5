"""Sessions that grow: a session file ingested part-way, then again complete, is one episode
(the longer), the shorter copy kept in raw and linked by lineage (ingest/sessions.py)."""

from __future__ import annotations

import json
import shutil

from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.ingest.sessions import growth_prefix


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


def _oh_events(start: int, end: int) -> list[dict]:
    out = []
    for i in range(start, end):
        if i == 0:
            out.append({"id": 0, "timestamp": "2025-11-06T10:00:00", "source": "user", "action": "message",
                        "args": {"content": "Fix the header parser"}, "message": "Fix the header parser"})
        elif i % 2:
            out.append({"id": i, "timestamp": f"2025-11-06T10:00:{i:02d}", "source": "agent", "action": "run",
                        "args": {"command": f"cat src/f{i}.py", "thought": ""}, "message": f"Running cat src/f{i}.py"})
        else:
            out.append({"id": i, "timestamp": f"2025-11-06T10:00:{i:02d}", "source": "agent", "observation": "run",
                        "content": f"contents {i}", "extras": {"command": "cat", "metadata": {"exit_code": 0}},
                        "cause": i - 1, "message": "Command finished"})
    return out


def test_openhands_file_store_conversation_is_one_episode_as_it_grows(wh, tmp_path):
    conv = tmp_path / "file_store" / "sessions" / "abc123"
    (conv / "events").mkdir(parents=True)
    (conv / "event_cache").mkdir()
    for e in _oh_events(0, 6):
        (conv / "events" / f"{e['id']}.json").write_text(json.dumps(e))
    (conv / "event_cache" / "0-4.json").write_text(json.dumps(_oh_events(0, 4)))  # a page that repeats events
    s1 = _ingest(wh, tmp_path / "file_store")
    eps = _rows(wh, "SELECT source_episode_id, n_steps, format FROM episodes")
    assert eps == [{"source_episode_id": "abc123", "n_steps": 6, "format": "openhands-file-store"}]
    assert s1.superseded == 6  # 7 part files, one episode (owned by one of them)
    for e in _oh_events(6, 9):  # the agent goes on: three more event files
        (conv / "events" / f"{e['id']}.json").write_text(json.dumps(e))
    _ingest(wh, conv / "events")
    eps = _rows(wh, "SELECT source_episode_id, n_steps, trajectory_key FROM episodes")
    assert [(e["source_episode_id"], e["n_steps"]) for e in eps] == [("abc123", 9)]
    assert _rows(wh, "SELECT count(*) AS n FROM quarantine")[0]["n"] == 0
    parts = _rows(wh, "SELECT count(*) AS n FROM lineage_edges WHERE child_id = ? AND transform = 'assembles'",
                  [eps[0]["trajectory_key"]])[0]["n"]
    assert parts == 9  # 9 event files + 1 cache page, one of which owns the episode
    authors = [r["author"] for r in _rows(wh, "SELECT author FROM steps ORDER BY step_index")]
    assert authors[:3] == ["human", "model", "environment"]
