"""Parquet input (Hugging Face's native format): a file's rows are records, read as the JSON lines
they render to, so every adapter that reads rows reads them, and a damaged file keeps the rows
before the damage."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from conftest import trajwh_cmd
from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse

STEP = "author, role, action_kind, action_object, tool_call_id, exit_code, text, observation"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read(wh: Warehouse, folder: Path) -> dict[str, list[dict]]:
    ingest_paths(wh, [folder], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    keys = wh.query("SELECT source_episode_id, trajectory_key FROM episodes").to_pylist()
    return {k["source_episode_id"]: wh.query(f"SELECT {STEP} FROM steps WHERE trajectory_key = ? ORDER BY step_index",
                                             [k["trajectory_key"]]).to_pylist() for k in keys}


def test_parquet_rows_give_the_episodes_their_json_lines_give(tmp_path, cases):
    """The same rows as JSON lines, as a Parquet file of nested columns (how `datasets` stores a
    message list) and as one with the list kept as JSON text give the same episodes and steps."""
    src = cases / "chat_messages" / "openai_tool_calls.jsonl"
    rows = _rows(src)
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / src.name).write_bytes(src.read_bytes())
    (tmp_path / "nested").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "nested" / "train-00000-of-00001.parquet")
    (tmp_path / "text").mkdir()
    as_text = [{**r, "trajectory": json.dumps(r["trajectory"])} for r in rows]
    pq.write_table(pa.Table.from_pylist(as_text), tmp_path / "text" / "data.parquet", row_group_size=1)

    want = _read(Warehouse(tmp_path / "a"), tmp_path / "jsonl")
    assert len(want) == 2 and all(len(s) == 10 for s in want.values())
    for kind in ("nested", "text"):
        wh = Warehouse(tmp_path / f"wh-{kind}")
        assert _read(wh, tmp_path / kind) == want, kind
        raw = wh.query("SELECT line_no, byte_offset, byte_length, compression, format, payload FROM raw_records "
                       "ORDER BY line_no").to_pylist()
        # a row is a record: line numbers are row numbers, offsets those of the rows rendered as JSON lines
        assert [r["line_no"] for r in raw] == [1, 2] and {r["compression"] for r in raw} == {"parquet"}
        assert raw[1]["byte_offset"] == raw[0]["byte_length"] + 1 and {r["format"] for r in raw} == {"chat-messages"}
        assert orjson.loads(raw[0]["payload"])["trajectory_id"] == rows[0]["trajectory_id"]
        path = next((tmp_path / kind).iterdir())
        files = wh.query("SELECT file_sha256, n_records FROM ingested_files").to_pylist()
        assert files == [{"file_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "n_records": 2}]
    # the same file again: nothing new
    again = ingest_paths(wh, [tmp_path / "text"], IngestOptions(source="cases"))
    assert (again.n_new, again.n_duplicate) == (0, 2)


def test_values_json_has_no_form_for_are_kept_as_text(tmp_path):
    """Bytes as text when they are UTF-8 (else base64, marked), decimals as text, times as ISO 8601."""
    from decimal import Decimal

    from trajwh.ingest.reader import ParquetRows

    t = pa.table({"blob": pa.array([b"ok", b"\xff\x00"]), "cost": pa.array([Decimal("1.25"), None], pa.decimal128(5, 2)),
                  "at": pa.array([0, 1_000_000], pa.timestamp("us", tz="UTC"))})
    pq.write_table(t, tmp_path / "v.parquet")
    lines = io.BufferedReader(ParquetRows(tmp_path / "v.parquet")).read().splitlines()
    assert [orjson.loads(x) for x in lines] == [
        {"blob": "ok", "cost": "1.25", "at": "1970-01-01T00:00:00+00:00"},
        {"blob": {"$base64": "/wA="}, "cost": None, "at": "1970-01-01T00:00:01+00:00"}]


def _quarantine(wh: Warehouse) -> list[dict]:
    return wh.query("SELECT file_path, line_no, byte_offset, reason_code, reason FROM quarantine "
                    "ORDER BY file_path").to_pylist()


def test_damaged_or_foreign_parquet_files_are_quarantined_with_the_rows_before_the_damage(tmp_path, cases):
    rows = _rows(cases / "chat_messages" / "openai_tool_calls.jsonl")
    rows = [dict(r, trajectory_id=f"{r['trajectory_id']}-{i}") for i in range(3) for r in rows]  # 6 rows
    table = pa.Table.from_pylist([{**r, "trajectory": json.dumps(r["trajectory"])} for r in rows])
    inp = tmp_path / "in"
    inp.mkdir()
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=2, write_page_checksum=True)
    whole = buf.getvalue()
    (inp / "a_cut.parquet").write_bytes(whole[: len(whole) // 2])  # no footer
    damaged = bytearray(whole)
    first = pq.read_metadata(io.BytesIO(whole)).row_group(1).column(0)
    start = first.dictionary_page_offset or first.data_page_offset
    damaged[start + 40: start + 2000] = b"\xab" * 1960  # the second row group's pages
    (inp / "b_damaged.parquet").write_bytes(bytes(damaged))
    pq.write_table(pa.table({"a": [1, 2], "b": ["x", "y"]}), inp / "c_other.parquet")
    wh = Warehouse(tmp_path / "wh")
    s = ingest_paths(wh, [inp], IngestOptions(source="cases"))
    assert s.n_new == 2  # the first row group of the damaged file
    q = _quarantine(wh)
    assert [(Path(r["file_path"]).name, r["reason_code"]) for r in q] == [
        ("a_cut.parquet", "truncated_file"), ("b_damaged.parquet", "truncated_file"), ("c_other.parquet", "unknown_format")]
    assert "cannot be read" in q[0]["reason"] and "whole Parquet file" in q[0]["reason"]
    assert "after row 2" in q[1]["reason"] and "the 2 records before it were kept" in q[1]["reason"]
    assert "columns a, b" in q[2]["reason"] and "chat-messages" in q[2]["reason"]
    kept = wh.query("SELECT line_no, file_path FROM raw_records ORDER BY line_no").to_pylist()
    assert [(r["line_no"], Path(r["file_path"]).name) for r in kept] == [(1, "b_damaged.parquet"), (2, "b_damaged.parquet")]


def test_trace_names_the_row(tmp_path, cases, cli_env):
    name = "nested"
    rows = _rows(cases / "chat_messages" / "openai_tool_calls.jsonl")
    (tmp_path / name).mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / name / "rows.parquet")
    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    ingest_paths(wh, [tmp_path / name], IngestOptions(source="cases"))
    rid = wh.query("SELECT record_id FROM raw_records WHERE line_no = 2").column(0)[0].as_py()
    out = subprocess.run([*trajwh_cmd(), "trace", rid], env=cli_env, capture_output=True, text=True, check=True).stdout
    assert "rows.parquet row 2" in out and "rows rendered as JSON lines" in out
