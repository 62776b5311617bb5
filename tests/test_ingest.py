"""Ingest: idempotent, streaming, and every kind of bad input quarantined with its place."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.schemas.errors import ConfigError


def q(wh, sql):
    return wh.query(sql).to_pylist()


def test_reingesting_the_same_files_adds_nothing(wh, cases):
    files = [cases / "two_episodes.jsonl", cases / "gzipped.jsonl.gz", cases / "crlf_blank_lines.jsonl"]
    first = ingest_paths(wh, files, IngestOptions(source="cases"))
    assert (first.n_new, first.n_duplicate, first.n_quarantined) == (6, 0, 0)
    again = ingest_paths(wh, files, IngestOptions(source="cases"))
    assert (again.n_new, again.n_duplicate) == (0, 6)
    assert q(wh, "SELECT count(*) AS n, count(DISTINCT record_id) AS d FROM raw_records") == [{"n": 6, "d": 6}]
    # the same bytes from another source are another record (record_id includes the source)
    other = ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="mirror"))
    assert other.n_new == 2


def test_raw_records_keep_exact_bytes_and_place(wh, cases):
    path = cases / "crlf_blank_lines.jsonl"
    ingest_paths(wh, [path], IngestOptions(source="cases"))
    data = path.read_bytes()
    rows = q(wh, "SELECT line_no, byte_offset, byte_length, payload, compression FROM raw_records ORDER BY line_no")
    assert [r["line_no"] for r in rows] == [2, 4]
    for r in rows:
        assert data[r["byte_offset"]:r["byte_offset"] + r["byte_length"]] == r["payload"]
        assert r["compression"] is None
    gz = ingest_paths(wh, [cases / "gzipped.jsonl.gz"], IngestOptions(source="cases"))
    assert gz.files[0].compression == "gzip" and gz.n_new == 2


@pytest.mark.parametrize("name, new, quarantined, reason, lines", [
    ("malformed_and_truncated.jsonl", 2, 2, "malformed_json", [2, 4]),
    ("invalid_utf8.jsonl", 1, 1, "invalid_utf8", [2]),
    ("not_a_record.jsonl", 1, 2, "not_a_record", [2, 3]),
    ("not_a_trajectory.txt", 0, 1, "unknown_format", [None]),
])
def test_bad_records_are_quarantined_with_place_and_reason(wh, cases, name, new, quarantined, reason, lines):
    s = ingest_paths(wh, [cases / "two_episodes.jsonl", cases / name], IngestOptions(source="cases"))
    assert s.n_new == 2 + new
    assert s.n_quarantined == quarantined
    rows = q(wh, "SELECT file_path, line_no, reason_code, reason, payload_size, stage FROM quarantine ORDER BY line_no")
    assert [r["line_no"] for r in rows] == lines
    assert {r["reason_code"] for r in rows} == {reason}
    assert all(r["file_path"].endswith(name) and r["stage"] == "ingest" and r["reason"] for r in rows)
    if reason == "unknown_format":
        assert "known formats: native" in rows[0]["reason"]
    # quarantining again is idempotent too
    ingest_paths(wh, [cases / name], IngestOptions(source="cases"))
    assert len(q(wh, "SELECT * FROM quarantine")) == quarantined


def test_a_50_mb_field_is_quarantined_and_the_rest_lands(wh, cases, tmp_path):
    good = (cases / "two_episodes.jsonl").read_bytes()
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.write(good.splitlines()[0] + b"\n")
        f.write(b'{"format":"trajwh.native","steps":[],"blob":"' + b"A" * (50 << 20) + b'"}\n')
        f.write(good.splitlines()[1] + b"\n")
    s = ingest_paths(wh, [big], IngestOptions(source="cases"))
    assert (s.n_new, s.n_quarantined) == (2, 1)
    row = q(wh, "SELECT line_no, reason_code, payload_size, payload_truncated, octet_length(payload) AS kept "
                "FROM quarantine")[0]
    assert row["line_no"] == 2 and row["reason_code"] == "record_too_large"
    assert row["payload_size"] > 50 << 20 and row["payload_truncated"] and row["kept"] == 1 << 20


def test_schema_invalid_records_are_quarantined_at_normalize(wh, cases):
    ingest_paths(wh, [cases / "schema_invalid.jsonl"], IngestOptions(source="cases"))
    s = normalize_warehouse(wh, run_id="t")
    assert (s.records, s.episodes, s.quarantined) == (3, 1, 2)
    rows = q(wh, "SELECT line_no, reason FROM quarantine WHERE stage = 'normalize' ORDER BY line_no")
    assert rows[0]["line_no"] == 1 and "steps.2.role" in rows[0]["reason"]
    assert rows[1]["line_no"] == 2 and "index" in rows[1]["reason"]


def test_bad_options_are_rejected_before_anything_is_written(wh, cases):
    with pytest.raises(ConfigError, match="SPDX"):
        ingest_paths(wh, [cases], IngestOptions(license="not a license!"))
    with pytest.raises(ConfigError, match="unknown format"):
        ingest_paths(wh, [cases], IngestOptions(format="nope"))
    with pytest.raises(ConfigError, match="does not exist"):
        ingest_paths(wh, [cases / "missing.jsonl"])
    assert not wh.exists()


def test_restricted_layers_are_owner_only(wh, cases):
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    for table in ("raw_records", "episodes", "steps"):
        files = wh.files(table)
        assert files
        for f in files:
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(wh.table_dir(table)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(wh.catalog_path).st_mode) == 0o600


def test_synthetic_corpus_ingests_completely(wh, small_corpus):
    s = ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic", flush_bytes=1 << 20))
    assert (s.n_new, s.n_quarantined) == (150, 0)
    assert len(wh.files("raw_records")) > 1  # streamed out in several files
    assert {f.compression for f in s.files} == {None, "gzip"}
    n = normalize_warehouse(wh, run_id="t")
    assert n.episodes == 150 and n.quarantined == 0


def test_json_documents_are_one_record_each(wh, cases):
    s = ingest_paths(wh, [cases / "one_episode_pretty.json", cases / "episode_array.json"],
                     IngestOptions(source="cases"))
    assert (s.n_new, s.n_quarantined) == (2, 0)
    rows = q(wh, "SELECT line_no, byte_offset, byte_length FROM raw_records ORDER BY byte_length")
    assert all(r["line_no"] is None and r["byte_offset"] == 0 for r in rows)
    n = normalize_warehouse(wh, run_id="t")
    assert n.episodes == 3
    idx = q(wh, "SELECT source_episode_id, _record_index FROM episodes ORDER BY source_episode_id")
    assert [(r["source_episode_id"], r["_record_index"]) for r in idx] == [
        ("case-ep-1", 0), ("case-ep-1-array", 0), ("case-ep-2-array", 1)]


def test_a_warehouse_inside_the_input_folder_is_not_ingested(tmp_path, cases):
    import shutil

    from trajwh.lineage.catalog import Warehouse

    shutil.copy(cases / "two_episodes.jsonl", tmp_path / "a.jsonl")
    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [tmp_path], IngestOptions(source="x"))
    again = ingest_paths(wh, [tmp_path], IngestOptions(source="x"))  # the folder now holds the warehouse too
    assert [f.path for f in again.files] == [str(tmp_path / "a.jsonl")] and again.n_quarantined == 0


def _normalized_alone_and_in_workers(one, tmp_path, monkeypatch, **settings):
    """``one`` (ingested) copied, then normalized in one process and the copy in two workers with
    the normalize module's ``settings``: (one's summary, the copy's, the copy)."""
    import shutil

    import trajwh.ingest.normalize as normalize
    from trajwh.lineage.catalog import Warehouse

    shutil.copytree(one.root, tmp_path / "many")
    many = Warehouse(tmp_path / "many")
    monkeypatch.setenv("TRAJWH_WORKERS", "1")
    a = normalize.normalize_warehouse(one, run_id="n")
    monkeypatch.setenv("TRAJWH_WORKERS", "2")
    monkeypatch.setattr(normalize, "PARALLEL_MIN_ITEMS", 1)
    for name, value in settings.items():
        monkeypatch.setattr(normalize, name, value)
    return a, normalize.normalize_warehouse(many, run_id="n"), many


def test_normalize_in_worker_processes_equals_one_process(tmp_path, small_corpus, cases, monkeypatch):
    """Big batches are parsed and annotated in worker processes: same rows, same quarantine (bad
    records, duplicates kept-first in input order) as one process."""

    from test_crash_and_concurrency import _fingerprint
    from trajwh.lineage.catalog import Warehouse

    one = Warehouse(tmp_path / "one")
    ingest_paths(one, [small_corpus, cases / "two_episodes.jsonl", cases / "schema_invalid.jsonl",
                       cases / "malformed_and_truncated.jsonl", cases / "swe_agent"], IngestOptions(source="mixed"))
    ingest_paths(one, [small_corpus / sorted(p.name for p in small_corpus.iterdir() if p.is_file())[0]],
                 IngestOptions(source="again"))  # the same episodes from another source: duplicates
    a, b, many = _normalized_alone_and_in_workers(one, tmp_path, monkeypatch, _CHUNK_RECORDS=7)
    assert a.episodes == b.episodes > 100 and a.quarantine_reasons == b.quarantine_reasons and a.quarantined > 0
    assert _fingerprint(one) == _fingerprint(many)


def test_normalize_workers_write_rows_and_a_key_two_tasks_hold_is_kept_first(tmp_path, cases, monkeypatch):
    """Workers read their ranges of the raw files and write the rows of clean records themselves;
    a trajectory key that two workers' ranges both hold (neither knew of the other) is kept by the
    first record in input order, the later one quarantined, exactly as one process does, and a
    rejected record in between goes to the batch's process as rows."""

    import orjson
    import trajwh.ingest.normalize as normalize
    from test_crash_and_concurrency import _fingerprint
    from trajwh.lineage.catalog import Warehouse

    base = orjson.loads((cases / "two_episodes.jsonl").read_bytes().splitlines()[0])
    lines = [orjson.dumps({**base, "episode_id": f"case-ep-{i}"}) for i in range(40)]
    lines.insert(20, (cases / "schema_invalid.jsonl").read_bytes().splitlines()[0])  # the adapter rejects it
    # the first episode again under its key, other bytes: a duplicate in the last worker's range
    twin = orjson.loads(lines[0])
    twin["steps"][0]["text"] = "another rendering of the same attempt"
    lines.append(orjson.dumps(twin))
    src = tmp_path / "src"
    src.mkdir()
    (src / "eps.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    one = Warehouse(tmp_path / "one")
    ingest_paths(one, [src], IngestOptions(source="x"))
    redone = []
    real = normalize._raw_slice
    monkeypatch.setattr(normalize, "_raw_slice", lambda *a: redone.append(a) or real(*a))  # (this process only)
    # the one raw file in four ranges, one task each
    a, b, many = _normalized_alone_and_in_workers(one, tmp_path, monkeypatch, _TASK_RECORDS_MIN=1, _CHUNK_RECORDS=4)
    assert len(normalize._raw_tasks(many.files("raw_records"), 2)) == 4
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"  # a raw file with no record left gives no task
    pq.write_table(pq.read_table(many.files("raw_records")[0]).slice(0, 0), empty)
    assert normalize._raw_tasks([empty, *many.files("raw_records")], 2) == normalize._raw_tasks(many.files("raw_records"), 2)
    assert redone, "no worker's written records were built again here: the cross-task duplicate was not exercised"
    assert a.episodes == b.episodes == 40
    assert a.quarantine_reasons == b.quarantine_reasons == {"duplicate_episode": 1, "invalid_record": 1}
    assert _fingerprint(one) == _fingerprint(many)
    kept = many.query("SELECT _record_id FROM episodes e JOIN raw_records r ON r.record_id = e._record_id "
                      "WHERE r.line_no = 1").num_rows
    assert kept == 1  # the first line's record holds the key


def test_documentation_and_media_files_are_skipped_not_quarantined(wh, cases, tmp_path):
    folder = tmp_path / "release"
    folder.mkdir()
    (folder / "README.md").write_text("# My dataset\n\nTrajectories of an agent.\n")
    (folder / "LICENSE").write_text("MIT License\n")
    (folder / "notes.txt").write_text("meeting notes, not a trajectory\n")
    (folder / "eps.jsonl").write_bytes((cases / "two_episodes.jsonl").read_bytes())
    # a computer-use run's screenshots and its recording: images and video, not trajectories
    (folder / "step_1_20250312@141502.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(40))
    (folder / "step_2.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF" + bytes(40))
    (folder / "recording.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(40))
    (folder / "fake.png").write_bytes(b"not an image at all\n")  # its name says image, its bytes do not
    s = ingest_paths(wh, [folder], IngestOptions(source="release"))
    assert s.n_new == 2 and sorted(Path(p).name for p in s.skipped) == [
        "LICENSE", "README.md", "recording.mp4", "step_1_20250312@141502.png", "step_2.jpg"]
    # an unknown file that is not documentation or media still is quarantined
    assert s.quarantine_reasons == {"unknown_format": 2}
