"""Inspect AI evaluation logs: a JSON log (one record, a sample per episode) and an .eval archive
(a zip: each sample member rendered with the header as one record) give the same episodes; the
verdict, limits, tool errors and attachments are read; damaged and foreign archives are
quarantined with what was read of them kept."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import orjson
import pytest
from conftest import trajwh_cmd
from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse

STEP = "step_index, author, role, text, observation, tool_call_id, action_kind, metadata"


@pytest.fixture
def log(cases) -> dict:
    return json.loads((cases / "inspect_ai" / "swe_bench_log.json").read_text())


def _archive(path: Path, log: dict, *, header: str = "header.json", samples: list[dict] | None = None) -> Path:
    """An .eval archive of ``log`` as Inspect writes one: the header, a member per sample, summaries."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("_journal/start.json", json.dumps({k: log[k] for k in ("version", "eval", "plan")}))
        for s in log["samples"] if samples is None else samples:
            z.writestr(f"samples/{s['id']}_epoch_{s['epoch']}.json", json.dumps(s))
        if header == "header.json":
            z.writestr("header.json", json.dumps({k: v for k, v in log.items() if k != "samples"}))
        z.writestr("summaries.json", "[]")
    return path


def _read(wh: Warehouse, path: Path) -> dict[str, dict]:
    ingest_paths(wh, [path], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    eps = wh.query("SELECT * EXCLUDE (trajectory_key, _record_id, _record_index, _batch_id, _run_id, _transform, "
                   "_transform_version, _schema_version) FROM episodes").to_pylist()
    out = {}
    for e in eps:
        key = wh.query("SELECT trajectory_key FROM episodes WHERE source_episode_id = ?",
                       [e["source_episode_id"]]).column(0)[0].as_py()
        e["steps"] = wh.query(f"SELECT {STEP} FROM steps WHERE trajectory_key = ? ORDER BY step_index", [key]).to_pylist()
        out[e["source_episode_id"]] = e
    return out


def test_a_json_log_gives_an_episode_per_sample(tmp_path, cases, log):
    eps = _read(Warehouse(tmp_path / "wh"), cases / "inspect_ai" / "swe_bench_log.json")
    assert set(eps) == {s["uuid"] for s in log["samples"]}
    solved, limited = eps["LrW4nJ8sQ2vX6cB9tY3mKd"], eps["Pz7cV2bN5mX8kL1qW4eRty"]
    assert {e["format"] for e in eps.values()} == {"inspect-ai"}
    # the verdict is the first scorer's value; the epoch is the attempt; the task is the dataset row
    assert (solved["resolved"], solved["reward"], solved["verifier_name"], solved["attempt"]) == (
        True, 1.0, "swe_bench_scorer", 1)
    assert (limited["resolved"], limited["reward"], limited["attempt"]) == (False, 0.0, 2)
    assert solved["task_id"] == limited["task_id"] == "swe_bench/astropy__astropy-12907"
    assert solved["instance_id"] == "astropy__astropy-12907"
    # SWE-bench metadata: repository, base commit and issue time; the model and Inspect's version
    assert solved["repository"] == "github.com/astropy/astropy"
    assert solved["base_commit"] == "d16bfe05a744909de4b27f5875fe0d4ed41ce607"
    assert solved["issue_created_at"].isoformat().startswith("2022-03-03T15:14:54")
    assert (solved["policy_name"], solved["harness_name"], solved["harness_version"]) == (
        "anthropic/claude-3-7-sonnet-20250219", "inspect_ai", "0.3.112")
    assert (solved["tokens_in"], solved["tokens_out"]) == (18250, 912)
    assert solved["tool_schema_digest"] is not None  # the tools of the first model call
    # a message limit ends the sample: the outcome rules read it as a budget
    assert limited["exit_status"] == "limit" and "max turns" in limited["termination_reason"]
    assert json.loads(limited["metadata"])["limit"] == {"type": "message", "limit": 30}
    # the conversation: the prompt (an attachment, resolved) and nudges are the harness's
    steps = solved["steps"]
    assert [s["author"] for s in steps] == ["harness", "harness"] + ["model", "environment"] * 4
    assert steps[1]["text"].startswith("Modeling's `separability_matrix`") and "attachment://" not in str(steps)
    assert json.loads(steps[2]["metadata"])["reasoning"].startswith("The separability matrix")
    assert steps[3]["tool_call_id"] == "toolu_01A" and steps[3]["observation"] == "219:def _cstack(left, right):\n"
    timeout = json.loads(steps[5]["metadata"])
    assert timeout["is_error"] and timeout["error_type"] == "timeout"
    assert steps[5]["observation"] == "Command timed out before completing."
    assert steps[8]["action_kind"] == "submit"
    nudge = limited["steps"][4]
    assert (nudge["author"], nudge["text"]) == ("harness", "Please proceed to the next step using your best judgement.")
    bad_call = json.loads(limited["steps"][5]["metadata"])
    assert bad_call["is_error"] and bad_call["parse_errors"]


def test_an_eval_archive_gives_the_json_logs_episodes(tmp_path, cases, log):
    want = _read(Warehouse(tmp_path / "a"), cases / "inspect_ai" / "swe_bench_log.json")
    for header in ("header.json", "_journal/start.json"):  # a finished run's archive, and an unfinished one's
        wh = Warehouse(tmp_path / f"wh-{header[0]}")
        path = _archive(tmp_path / f"in-{header[0]}" / "run.eval", log, header=header)
        got = _read(wh, path)
        if header == "header.json":
            assert got == want
        else:  # the start journal has no results or status: the same episodes and steps
            assert {k: v["steps"] for k, v in got.items()} == {k: v["steps"] for k, v in want.items()}
        raw = wh.query("SELECT record_id, line_no, byte_offset, byte_length, compression, format, payload FROM raw_records "
                       "ORDER BY line_no").to_pylist()
        assert [r["line_no"] for r in raw] == [1, 2] and {r["compression"] for r in raw} == {"zip"}
        assert raw[1]["byte_offset"] == raw[0]["byte_length"] + 1 and {r["format"] for r in raw} == {"inspect-ai"}
        first = orjson.loads(raw[0]["payload"])
        assert first["sample"] == log["samples"][0] and first["inspect_header"]["eval"] == log["eval"]
    again = ingest_paths(wh, [path], IngestOptions(source="cases"))
    assert (again.n_new, again.n_duplicate) == (0, 2)
    out = subprocess.run([*trajwh_cmd(), "trace", raw[1]["record_id"], "--warehouse", str(wh.root)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "sample 2" in out.stdout and ".eval archive" in out.stdout


def _quarantined(wh: Warehouse) -> list[dict]:
    return wh.query("SELECT reason_code, reason, line_no FROM quarantine ORDER BY reason_code").to_pylist()


def test_damaged_and_foreign_archives_are_quarantined_with_what_was_read_kept(tmp_path, log):
    # a zip that is not an Inspect log: refused, naming its members
    foreign = tmp_path / "foreign" / "data.zip"
    foreign.parent.mkdir()
    with zipfile.ZipFile(foreign, "w") as z:
        z.writestr("notes/readme.txt", "hello")
    wh = Warehouse(tmp_path / "wh-foreign")
    s = ingest_paths(wh, [foreign], IngestOptions(source="cases"))
    [q] = _quarantined(wh)
    assert s.n_new == 0 and q["reason_code"] == "unknown_format"
    assert "not an Inspect AI .eval log" in q["reason"] and "notes/readme.txt" in q["reason"]
    # an archive cut short (no central directory): nothing can be read, said so
    whole = _archive(tmp_path / "cut" / "run.eval", log).read_bytes()
    (tmp_path / "cut" / "run.eval").write_bytes(whole[: len(whole) // 2])
    wh = Warehouse(tmp_path / "wh-cut")
    s = ingest_paths(wh, [tmp_path / "cut"], IngestOptions(source="cases"))
    [q] = _quarantined(wh)
    assert s.n_new == 0 and q["reason_code"] == "truncated_file"
    assert "zip archive that cannot be read" in q["reason"] and "a whole zip archive" in q["reason"]
    # the second sample's bytes damaged (stored, so its CRC fails): the first sample is kept
    path = tmp_path / "crc" / "run.eval"
    path.parent.mkdir()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("header.json", json.dumps({k: v for k, v in log.items() if k != "samples"}))
        for smp in log["samples"]:
            z.writestr(f"samples/{smp['id']}_epoch_{smp['epoch']}.json", json.dumps(smp))
    data = bytearray(path.read_bytes())
    at = data.index(b'"Pz7cV2bN5mX8kL1qW4eRty"')
    data[at + 1: at + 4] = b"XXX"
    path.write_bytes(bytes(data))
    wh = Warehouse(tmp_path / "wh-crc")
    s = ingest_paths(wh, [path], IngestOptions(source="cases"))
    [q] = _quarantined(wh)
    assert s.n_new == 1 and q["reason_code"] == "truncated_file"
    assert "zip archive after row 1" in q["reason"] and "the 1 records before it were kept" in q["reason"]


def test_a_log_without_samples_is_quarantined_saying_so(tmp_path, log):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "header-only.json").write_text(json.dumps({k: v for k, v in log.items() if k != "samples"},
                                                                 indent=2))
    wh = Warehouse(tmp_path / "wh")
    s = ingest_paths(wh, [tmp_path / "in"], IngestOptions(source="cases"))
    [q] = _quarantined(wh)
    assert s.n_new == 0 and q["reason_code"] == "not_a_record"
    assert "without samples" in q["reason"] and "status 'success'" in q["reason"]


def test_a_sample_without_messages_is_read_from_its_last_model_call(tmp_path, log):
    """Log format 3 keeps each model call's input as ranges into the sample's message pool; a
    sample that kept no ``messages`` is read from its last model call: the input, then the output."""
    sample = {"id": 7, "epoch": 1, "input": "What is 2+2?", "target": "4", "messages": [],
              "message_pool": [{"role": "system", "content": "You are helpful."},
                               {"role": "user", "content": "What is 2+2?"}],
              "events": [{"event": "model", "input": [], "input_refs": [[0, 1]], "output": {"choices": []}},
                         {"event": "model", "input": [], "input_refs": [[0, 2]],
                          "output": {"choices": [{"message": {"role": "assistant", "content": "4"}}]}}],
              "scores": {"match": {"value": "C"}}}
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "v3.json").write_text(json.dumps({**{k: v for k, v in log.items() if k != "samples"},
                                                          "samples": [sample]}, indent=2))
    [ep] = _read(Warehouse(tmp_path / "wh"), tmp_path / "in").values()
    assert [(s["author"], s["text"]) for s in ep["steps"]] == [
        ("harness", "You are helpful."), ("harness", "What is 2+2?"), ("model", "4")]
    assert ep["resolved"] is True and json.loads(ep["metadata"])["messages_from"] == "the last model event"


def test_nan_as_inspect_writes_it_and_a_member_that_is_not_json(tmp_path, log):
    """Inspect writes NaN (a metric of one sample, a score it could not compute): such a log is read,
    a NaN score is no verdict. A sample member that is not JSON (its CRC held) is quarantined alone,
    naming the member; the other samples are read."""
    nan_log = json.dumps(log, indent=2).replace('"value": 0.0', '"value": NaN')
    assert "NaN" in nan_log
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "nan.json").write_text(nan_log)
    eps = _read(Warehouse(tmp_path / "wh"), tmp_path / "in")
    assert eps["LrW4nJ8sQ2vX6cB9tY3mKd"]["resolved"] is True
    limited = eps["Pz7cV2bN5mX8kL1qW4eRty"]
    assert limited["reward"] is None and limited["resolved"] is None and limited["verifier_status"] == "unreadable"
    path = tmp_path / "bad" / "run.eval"
    path.parent.mkdir()
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("header.json", json.dumps({k: v for k, v in log.items() if k != "samples"}))
        z.writestr("samples/a_epoch_1.json", "{not json")
        z.writestr("samples/b_epoch_1.json", json.dumps(log["samples"][0]).replace("1.0", "NaN", 1))
    wh = Warehouse(tmp_path / "wh-bad")
    s = ingest_paths(wh, [path], IngestOptions(source="cases"))
    [q] = _quarantined(wh)
    assert (s.n_new, q["reason_code"], q["line_no"]) == (1, "not_a_record", 1)
    assert "samples/a_epoch_1.json is not JSON" in q["reason"]
