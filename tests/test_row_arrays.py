"""A JSON array of rows too large to be one record (a dataset exported as one array, a benchmark's
results file) is read as a record per row, streaming, instead of being refused whole."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse

LIMIT = 16 << 10


def _rows(cases: Path, n: int, prefix: str = "run") -> list[dict]:
    lines = [x for x in (cases / "chat_messages" / "openai_tool_calls.jsonl").read_text().splitlines() if x]
    return [dict(json.loads(lines[i % 2]), trajectory_id=f"{prefix}-{i}") for i in range(n)]


def _ingest(wh: Warehouse, path: Path):
    return ingest_paths(wh, [path], IngestOptions(source="cases", max_record_bytes=LIMIT))


def test_an_array_of_rows_over_the_record_limit_lands_a_record_per_row(tmp_path, cases):
    rows = _rows(cases, 40)
    data = json.dumps(rows, indent=1).encode()
    assert len(data) > 4 * LIMIT
    (tmp_path / "results.json").write_bytes(data)
    wh = Warehouse(tmp_path / "wh")
    s = _ingest(wh, tmp_path / "results.json")
    assert (s.n_new, s.n_quarantined) == (40, 0)
    raw = wh.query("SELECT line_no, byte_offset, byte_length, payload FROM raw_records ORDER BY byte_offset").to_pylist()
    # each record is the row's bytes exactly as received, at its offset and line
    assert all(data[r["byte_offset"]:r["byte_offset"] + r["byte_length"]] == r["payload"] for r in raw)
    assert [json.loads(r["payload"])["trajectory_id"] for r in raw] == [f"run-{i}" for i in range(40)]
    assert all(data[:r["byte_offset"]].count(b"\n") + 1 == r["line_no"] for r in raw)
    normalize_warehouse(wh, run_id="t")
    ids = wh.query("SELECT source_episode_id FROM episodes").column(0).to_pylist()
    assert sorted(ids) == sorted(f"run-{i}" for i in range(40))
    # the same rows as JSON lines give the same steps
    (tmp_path / "lines").mkdir()
    (tmp_path / "lines" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    other = Warehouse(tmp_path / "other")
    ingest_paths(other, [tmp_path / "lines"], IngestOptions(source="cases"))
    normalize_warehouse(other, run_id="t")
    q = ("SELECT e.source_episode_id, s.step_index, s.author, s.action_kind, s.text, s.observation FROM steps s "
         "JOIN episodes e USING (trajectory_key) ORDER BY 1, 2")
    assert wh.query(q).to_pylist() == other.query(q).to_pylist()


def test_an_oversize_row_a_cut_array_and_a_long_conversation(tmp_path, cases):
    rows = _rows(cases, 12)
    rows[5]["trajectory"][1]["content"] = "x" * (2 * LIMIT)  # one row over the limit on its own
    data = json.dumps(rows).encode()
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(data))  # gzip: offsets in the decompressed bytes
    whole = json.dumps(_rows(cases, 9, "cut"))[:-1]  # nine rows whole, the tenth cut short
    (tmp_path / "b.json").write_text(whole + ', {"trajectory_id": "cut-9", "trajectory": [{"role": "us')
    conversation = [{"role": "user", "content": "fix it"}, *({"role": "assistant", "content": "y" * 4000},) * 8]
    (tmp_path / "c.json").write_text(json.dumps(conversation))  # one conversation (not rows): refused whole
    wh = Warehouse(tmp_path / "wh")
    for name in ("a.json.gz", "b.json", "c.json"):
        _ingest(wh, tmp_path / name)
    got = wh.query("SELECT file_path, count(*) n FROM raw_records GROUP BY 1 ORDER BY 1").to_pylist()
    assert [(Path(r["file_path"]).name, r["n"]) for r in got] == [("a.json.gz", 11), ("b.json", 9)]
    q = wh.query("SELECT file_path, reason_code, reason, byte_offset, payload_size, payload_sha256 FROM quarantine "
                 "ORDER BY file_path").to_pylist()
    assert [(Path(r["file_path"]).name, r["reason_code"]) for r in q] == [
        ("a.json.gz", "record_too_large"), ("b.json", "truncated_file"), ("c.json", "record_too_large")]
    import hashlib

    row5 = json.dumps(rows[5]).encode()
    assert data[q[0]["byte_offset"]:q[0]["byte_offset"] + q[0]["payload_size"]] == row5
    assert q[0]["payload_sha256"] == hashlib.sha256(row5).hexdigest()
    assert "cut short" in q[1]["reason"] and "the 9 records before it were kept" in q[1]["reason"]


def test_elements_are_cut_alike_whatever_the_read_size(monkeypatch):
    """Strings holding brackets, commas and escaped quotes, bare values, a byte-order mark and elements
    over the limit give the same records whether the stream comes a byte at a time or all at once."""
    import hashlib
    import io

    import pytest
    import trajwh.ingest.reader as reader
    from trajwh.ingest.reader import TruncatedInput, iter_array_elements

    rows = [{"id": i, "text": 'a "quoted" ], [ {x}, \\ ' * (i % 7), "n": [i, {"k": None}]} for i in range(60)]
    data = b"\xef\xbb\xbf [\n" + b" ,\n".join(json.dumps(r).encode() for r in rows) + b', "s,]", 12, true ]'

    def cut(chunk: int, limit: int) -> list:
        monkeypatch.setattr(reader, "CHUNK", chunk)
        return list(iter_array_elements(io.BufferedReader(io.BytesIO(data), buffer_size=chunk), limit, 8))

    want = [json.dumps(r).encode() for r in rows] + [b'"s,]"', b"12", b"true"]
    for chunk in (1, 7, 4096, 1 << 20):
        for limit in (150, 1 << 20):
            recs = cut(chunk, limit)
            assert [data[r.offset:r.offset + r.size] for r in recs] == want, (chunk, limit)
            assert [r.line_no for r in recs] == [data[:r.offset].count(b"\n") + 1 for r in recs]
            for r, w in zip(recs, want, strict=True):
                assert r.oversize == (len(w) > limit)
                assert (r.data, r.sha256) == ((w[:8], hashlib.sha256(w).hexdigest()) if r.oversize else (w, None))
    monkeypatch.setattr(reader, "CHUNK", 5)
    with pytest.raises(TruncatedInput, match="cut short"):
        list(iter_array_elements(io.BufferedReader(io.BytesIO(data[:-30])), 1 << 20, 8))
