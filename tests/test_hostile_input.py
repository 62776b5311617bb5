"""Hostile input: one record, one file or one odd file-system entry never stops the warehouse.

Every case is built at test time in a temporary folder (symlink loops, FIFOs, file names that
are not UTF-8 cannot live in git); the native-format fuzz draws episodes from the format's own
JSON Schema (docs/native-format.schema.json) and the mutation fuzz damages real corpus files.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, SHARED_CORPUS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse
from trajwh.redaction.layer import redact_warehouse

EPISODE = {"format": "trajwh.native", "episode_id": "e", "task": {"task_id": "t", "text": "fix it"},
           "policy": {"name": "p"}, "harness": {"name": "h"}, "attempt": 1,
           "steps": [{"index": 0, "role": "user", "author": "harness", "text": "go"}]}


def _episode(eid: str, **changes) -> dict:
    ep = json.loads(json.dumps(EPISODE))
    ep["episode_id"] = eid
    for path, value in changes.items():
        node = ep
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
        node[int(leaf) if leaf.isdigit() else leaf] = value
    return ep


def _reasons(wh: Warehouse, stage: str | None = None) -> dict[str, int]:
    where = f"WHERE stage = '{stage}'" if stage else ""
    return {r["reason_code"]: r["n"] for r in wh.query(
        f"SELECT reason_code, count(*) AS n FROM quarantine {where} GROUP BY 1").to_pylist()}


def test_values_no_table_can_hold_are_quarantined_and_every_later_build_works(wh, tmp_path, monkeypatch):
    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    monkeypatch.delenv("TRAJWH_VAULT_KEY_FILE", raising=False)
    lines = [orjson.dumps(_episode("ok")),
             orjson.dumps(_episode("old", started_at="0001-01-01T00:00:00+14:00")),
             orjson.dumps(_episode("future", **{"steps.0.started_at": "9999-12-31T23:59:59-12:00"})),
             json.dumps(_episode("huge", **{"usage.tokens_in": 2**70})).encode(),
             json.dumps(_episode("surrogate", **{"steps.0.text": "\ud800 lone"})).encode()]
    # a Claude Code session whose usage does not fit 64 bits (another adapter, same guard)
    claude = tmp_path / "session.jsonl"
    claude.write_text("\n".join(json.dumps(x) for x in [
        {"type": "user", "sessionId": "s1", "uuid": "u1", "timestamp": "2025-05-01T10:00:00Z",
         "message": {"role": "user", "content": "hello"}, "cwd": "/repo", "version": "1.0.0"},
        {"type": "assistant", "sessionId": "s1", "uuid": "u2", "parentUuid": "u1", "timestamp": "2025-05-01T10:00:01Z",
         "message": {"id": "m1", "role": "assistant", "model": "claude-x", "content": [{"type": "text", "text": "hi"}],
                     "usage": {"input_tokens": 2**65, "output_tokens": 3}}}]) + "\n")
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    ingest_paths(wh, [src, claude], IngestOptions(source="hostile"))
    s = normalize_warehouse(wh, run_id="n1")
    assert s.episodes == 1  # only "ok"
    normalize_warehouse(wh, run_id="n2")  # and again: nothing left to fail
    redact_warehouse(wh, run_id="r")
    rows = wh.query("SELECT stage, reason_code, reason FROM quarantine").to_pylist()
    text = " ".join(r["reason"] for r in rows)
    assert "out of range" in text and "64 bits" in text or "integer" in text
    assert {r["stage"] for r in rows} <= {"ingest", "normalize"} and len(rows) == 5
    assert wh.query("SELECT count(*) FROM redacted_episodes").column(0)[0].as_py() == 1
    # every stored time can be read back into Python
    wh.query("SELECT * FROM episodes").to_pylist()
    wh.query("SELECT * FROM steps").to_pylist()


def test_odd_file_system_entries_are_per_file_errors_and_the_rest_lands(wh, tmp_path, cases):
    d = tmp_path / "in"
    d.mkdir()
    good = (cases / "two_episodes.jsonl").read_bytes()
    (d / "good.jsonl").write_bytes(good)
    (d / "dangling.jsonl").symlink_to(d / "nowhere.jsonl")
    (d / "loop_a").symlink_to(d / "loop_b")
    (d / "loop_b").symlink_to(d / "loop_a")
    os.mkfifo(d / "pipe.jsonl")  # ingest used to hang here forever, holding the writer lock
    (d / os.fsdecode(b"name-\xff\xfe.jsonl")).write_bytes(good.replace(b'"episode_id"', b'"x": 0, "episode_id"'))
    (d / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + orjson.dumps(_episode("bom")) + b"\n")
    (d / "blank.jsonl").write_bytes(b"\n" * 5000 + b"   \r\n\t\n" * 2000 + orjson.dumps(_episode("after-blanks")) + b"\n")
    (d / "dup.jsonl").write_bytes(orjson.dumps(_episode("dup"))[:-1] + b', "attempt": 9}\n')
    s = ingest_paths(wh, [d], IngestOptions(source="fs"))
    errors = {Path(f.path).name: f.error for f in s.files if f.error}
    assert "pipe.jsonl" in errors and "FIFO" in errors["pipe.jsonl"]
    assert any("loop" in e.lower() for e in errors.values())
    assert any("No such file" in e for e in errors.values())
    files = wh.query("SELECT file_path, line_no, byte_offset FROM raw_records").to_pylist()
    names = {Path(f["file_path"]).name for f in files}
    assert {"good.jsonl", "bom.jsonl", "blank.jsonl", "name-\\xff\\xfe.jsonl"} <= names
    blank = next(f for f in files if f["file_path"].endswith("blank.jsonl"))
    assert blank["line_no"] == 5000 + 2 * 2000 + 1  # line numbers stay right when blank lines are skipped in bulk
    assert next(f for f in files if f["file_path"].endswith("bom.jsonl"))["byte_offset"] == 3
    assert _reasons(wh)["duplicate_keys"] == 1
    got = wh.query("SELECT file_path, error FROM ingested_files WHERE error IS NOT NULL").to_pylist()
    assert len(got) == len(errors)
    normalize_warehouse(wh, run_id="n")
    eps = set(wh.query("SELECT source_episode_id FROM episodes").column(0).to_pylist())
    assert {"bom", "after-blanks"} <= eps


def test_quarantine_is_written_in_bounded_batches(wh, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(b'{"format": "trajwh.native", "broken": ' + str(i).encode() + b"\n" for i in range(3000)))
    s = ingest_paths(wh, [bad], IngestOptions(source="bad", flush_bytes=256 * 1024))
    assert s.n_quarantined == 3000
    n_files = wh.query("SELECT count(*) FROM table_files WHERE table_name = 'quarantine'").column(0)[0].as_py()
    assert n_files >= 3, "quarantine rows must be flushed as they come, not held until the end"


NATIVE_SCHEMA = json.loads((ROOT / "docs" / "native-format.schema.json").read_text())
_EXTREME_TIMES = ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "1970-01-01T00:00:00Z",
                  "2025-02-29T10:00:00Z", "2025-06-01T10:00:00.123456789+05:30", "2025-06-01", "not a time"]
_WILD = st.one_of(st.integers(-(2**80), 2**80), st.floats(allow_nan=False), st.text(max_size=12), st.none(),
                  st.booleans(), st.sampled_from(_EXTREME_TIMES))


def from_schema(schema: dict, root: dict | None = None, depth: int = 0) -> st.SearchStrategy:
    """Values shaped by a JSON Schema (the subset pydantic writes: $ref/$defs, anyOf, type, enum,
    properties, items, format), with hostile leaves: huge integers, extreme and invalid times,
    any Unicode; and now and then a wild value where the schema wants another type."""
    root = root or schema
    if "$ref" in schema:
        return from_schema(root["$defs"][schema["$ref"].rsplit("/", 1)[-1]], root, depth)
    if "anyOf" in schema:
        return st.one_of(*[from_schema(s, root, depth) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        if depth > 3 or not props:
            return st.dictionaries(st.text(max_size=6), _WILD, max_size=3)
        fields = {k: from_schema(v, root, depth + 1) for k, v in props.items()}
        return st.fixed_dictionaries({k: v for k, v in fields.items() if k in required},
                                     optional={k: v for k, v in fields.items() if k not in required})
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), root, depth + 1), max_size=4)
    if kind == "integer":
        return st.integers(-(2**70), 2**70) | st.integers(0, 50)
    if kind == "number":
        return st.floats(allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "string":
        if schema.get("format") == "date-time":
            return st.sampled_from(_EXTREME_TIMES)
        return st.text(max_size=30)
    return _WILD


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(from_schema(NATIVE_SCHEMA), min_size=1, max_size=6))
def test_no_episode_the_schema_allows_raises_out_of_a_build(tmp_path_factory, episodes):
    for i, e in enumerate(episodes):  # numbered steps, so that some episodes get past validation
        e["format"] = "trajwh.native"
        for j, step in enumerate(e.get("steps") or []):
            step["index"] = j
        e["episode_id"] = f"fz-{i}"
    tmp = tmp_path_factory.mktemp("fuzz")
    src = tmp / "fuzz.jsonl"
    src.write_bytes(b"".join(json.dumps(e, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n" for e in episodes))
    wh = Warehouse(tmp / "wh")
    s = ingest_paths(wh, [src], IngestOptions(source="fuzz"))
    n = normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="r")
    built = wh.query("SELECT count(*) FROM episodes").column(0)[0].as_py()
    quarantined = sum(_reasons(wh).values())
    assert built == n.episodes and built + quarantined >= 1 and s.n_records == len(episodes)
    wh.query("SELECT * FROM redacted_steps").to_pylist()


def _mutations(data: bytes, rng: random.Random) -> list[bytes]:
    cut = rng.randrange(1, max(2, len(data)))
    flip = bytearray(data)
    for _ in range(5):
        i = rng.randrange(len(flip))
        flip[i] = rng.randrange(256)
    return [data[:cut], bytes(flip), data.replace(b'"', b"'", 3), data.replace(b"1", b"99999999999999999999999", 5),
            data.replace(b'"2', b'"0001-', 3), data.replace(b": [", b": {", 2), data.replace(b"null", b'"\\ud800"', 5)]


@pytest.mark.skipif(not SHARED_CORPUS.is_dir(), reason=f"real corpus not found at {SHARED_CORPUS}")
def test_damaged_corpus_files_never_raise_out_of_a_build(tmp_path, monkeypatch):
    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    monkeypatch.delenv("TRAJWH_VAULT_KEY_FILE", raising=False)
    rng = random.Random(13)
    picked = sorted(p for p in SHARED_CORPUS.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".traj")
                    and p.stat().st_size < 400_000)
    d = tmp_path / "damaged"
    d.mkdir()
    for p in rng.sample(picked, min(8, len(picked))):
        for i, blob in enumerate(_mutations(p.read_bytes(), rng)):
            (d / f"{i}-{p.name}").write_bytes(blob)
    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [d], IngestOptions(source="damaged"))
    normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="r")
    wh.query("SELECT * FROM redacted_episodes").to_pylist()
    wh.query("SELECT * FROM redacted_steps").to_pylist()


# --- trajwh sql is read-only, really ---------------------------------------------------------------

@pytest.fixture
def built_wh(redaction_case_wh):
    wh = redaction_case_wh
    redact_warehouse(wh, run_id="r")
    assert (wh.root / "vault" / "salt").exists()
    return wh


@pytest.mark.parametrize("attack", [
    "COPY (SELECT * FROM steps) TO 'redacted/redacted_steps/evil.parquet' (FORMAT parquet)",
    "COPY redacted_steps TO '/tmp/trajwh-evil.csv'",
    "EXPORT DATABASE '/tmp/trajwh-evil-db'",
    "SELECT * FROM read_blob('vault/salt')",
    "SELECT * FROM read_blob('{root}/vault/salt')",
    "SELECT * FROM read_blob('normalized/../vault/salt')",
    "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM glob('/etc/*')",
    "SELECT * FROM read_blob('catalog.duckdb')",
    "SELECT 1; COPY (SELECT 1) TO '/tmp/trajwh-evil2.csv'",
    "ATTACH '/tmp/trajwh-evil.db' AS x",
    "SET enable_external_access = true",
    "INSTALL httpfs",
    "LOAD httpfs",
    "PRAGMA database_list",
    "CREATE TABLE t AS SELECT 1",
    "DELETE FROM batches",
    "CALL pragma_version()",
])
def test_sql_attacks_are_refused(built_wh, attack):
    import duckdb
    from trajwh.schemas.errors import ConfigError

    before = {p: p.read_bytes() for p in (built_wh.root / "redacted").rglob("*.parquet")}
    with pytest.raises((ConfigError, duckdb.Error)):
        built_wh.user_query(attack.format(root=built_wh.root))
    after = {p: p.read_bytes() for p in (built_wh.root / "redacted").rglob("*.parquet")}
    assert before == after
    assert not Path("/tmp/trajwh-evil.csv").exists() and not Path("/tmp/trajwh-evil-db").exists()


def test_sql_still_answers_queries(built_wh):
    assert built_wh.user_query("SELECT count(*) AS n FROM redacted_steps").column(0)[0].as_py() > 0
    assert built_wh.user_query("WITH x AS (SELECT * FROM batches) SELECT count(*) FROM x").column(0)[0].as_py() == 1
    assert built_wh.user_query("DESCRIBE steps").num_rows > 5
    assert built_wh.user_query("SELECT count(*) FROM read_parquet('redacted/redacted_steps/*.parquet')").num_rows == 1


def test_a_long_reader_does_not_block_a_writer(built_wh, cases, cli_env):
    """`trajwh sql` runs on an in-memory snapshot of the catalog: the catalog file is released at
    once, so a writer in another process does not wait for a long query (it used to fail with exit 2)."""
    import subprocess
    import time

    from conftest import trajwh_cmd

    env = {**cli_env, "TRAJWH_WAREHOUSE": str(built_wh.root)}
    reader = subprocess.Popen([*trajwh_cmd(), "sql", "SELECT count(*) FROM range(100000) a, range(1000000) b WHERE (a.range * b.range) % 7 = 3"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(3)  # the query is running
        assert reader.poll() is None
        t0 = time.monotonic()
        s = ingest_paths(built_wh, [cases / "two_episodes.jsonl"], IngestOptions(source="more", lock_timeout=5))
        assert s.n_new == 2 and time.monotonic() - t0 < 5
    finally:
        reader.kill()
        reader.wait()


def test_data_is_never_markup_nor_terminal_control(tmp_path):
    import pyarrow as pa
    from rich.console import Console
    from trajwh.pipelines import render

    table = pa.table({"t": ["[/INST] [bold]x\x1b[31mred\u202e"]})
    console = Console(record=True, width=200, file=open(os.devnull, "w"))
    console.print(render.arrow_table(table))
    out = console.export_text()
    assert "[/INST] [bold]x\\x1b[31mred\\u202e" in out and "\x1b" not in out


def test_damaged_message_rows_and_the_newer_formats_never_raise_out_of_a_build(tmp_path, cases, monkeypatch):
    """The generic message-row, Gemini CLI, Inspect AI, Trae Agent, headless Claude Code and Codex formats,
    Cline's task files, browser-use histories, OSWorld's run files, AgentBench's samples and Goose sessions take the same damage as the corpus above, and
    shapes no dataset should have (ids as numbers, calls that are not lists, tokens as text): each
    record lands or is quarantined with its reason; nothing raises."""
    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    monkeypatch.delenv("TRAJWH_VAULT_KEY_FILE", raising=False)
    rng = random.Random(17)
    d = tmp_path / "damaged"
    d.mkdir()
    for p in sorted([*(cases / "chat_messages").iterdir(), *(cases / "gemini").iterdir(),
                     *(cases / "inspect_ai").iterdir(), *(cases / "trae_agent").iterdir(),
                     *(cases / "claude_headless").iterdir(), *(cases / "codex_exec").iterdir(),
                     *(cases / "cline_task").iterdir(), *(cases / "browser_use").rglob("*.json"),
                     *(cases / "osworld").rglob("*.*"), *(cases / "agentbench").rglob("*.jsonl"),
                     *(cases / "goose").iterdir(), *(cases / "harbor").rglob("*.json"),
                     *(cases / "tau_bench").rglob("*.json"), *(cases / "qwen_code").iterdir()]):
        for i, blob in enumerate(_mutations(p.read_bytes(), rng)):
            (d / f"{i}-{p.name}").write_bytes(blob)
    odd = [{"id": 7, "messages": [{"role": "user", "content": {"text": "hi"}},
                                  {"role": "assistant", "content": None, "tool_calls": 5},
                                  {"role": "assistant", "tool_calls": [{"id": 3, "function": "bash"}]},
                                  {"role": "tool", "tool_call_id": 3, "content": [1, {"type": "image_url"}]},
                                  {"role": "assistant", "content": [{"type": "tool_use", "id": 9, "input": "x"}]}],
            "reward": "1", "resolved": "yes", "tools": "not json"}]
    (d / "odd_rows.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in odd) + b"\n")
    (d / "session-odd.json").write_bytes(orjson.dumps({"sessionId": 1, "projectHash": "x", "messages": [
        {"type": "gemini", "content": ["a", {"text": "b"}], "toolCalls": {"id": 1}, "tokens": {"input": "5"}},
        {"type": "gemini", "toolCalls": [{"id": 2, "name": None, "args": "ls", "result": "plain text"}]},
        {"type": "something-new", "content": 3}, "not a message"]}))
    (d / "odd_inspect.json").write_bytes(orjson.dumps({"version": 2, "eval": {"run_id": 5, "task_id": None, "task": 3,
                                                                              "packages": "x", "dataset": [1]},
        "samples": [{"id": None, "epoch": "1", "messages": [
            {"role": "assistant", "content": [{"type": "reasoning", "redacted": True}, {"type": "image", "image": 7}],
             "tool_calls": [{"id": 1, "function": None, "arguments": "{"}, "x"]},
            {"role": "tool", "tool_call_id": 1, "error": "no", "content": {"text": 3}},
            {"role": "narrator", "content": 1}, 2],
            "scores": {"s": {"value": {"a": 1}}}, "limit": {"type": None}, "error": {"message": None},
            "attachments": ["not", "a", "dict"], "input": [{"role": "user", "content": "attachment://zz"}],
            "model_usage": {"m": {"input_tokens": "5"}}, "events": [{"event": "model", "tools": "bad"}]}, "not a sample"]}))
    wh = Warehouse(tmp_path / "wh")
    s = ingest_paths(wh, [d], IngestOptions(source="damaged"))
    normalized = normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="r")
    wh.query("SELECT * FROM redacted_episodes").to_pylist()
    steps = wh.query("SELECT * FROM redacted_steps").to_pylist()
    # every record is an episode, is quarantined with a reason, or is a companion (Cline's task files)
    recorded = wh.query("SELECT count(*) FROM raw_records").column(0)[0].as_py()
    landed = wh.query("SELECT count(DISTINCT _record_id) FROM episodes").column(0)[0].as_py()
    later = wh.query("SELECT count(*) FROM quarantine WHERE stage = 'normalize'").column(0)[0].as_py()
    assert recorded == s.n_new and landed + later + normalized.companions >= recorded and landed > 0
    assert all(r["reason"] for r in wh.query("SELECT reason FROM quarantine").to_pylist())
    ids = {c["id"] for x in steps for c in x["tool_calls"] or []}
    assert {"3", "9", "2"} <= ids  # numbered calls kept as text


def test_a_build_after_an_ingest_whose_every_record_was_quarantined(wh, tmp_path, monkeypatch):
    """A batch of quarantined records only (a file that is not UTF-8) leaves the layers without a
    file: the build's checks pass on nothing instead of failing with a KeyError (found by `make stress`)."""
    from trajwh.pipelines.definitions import build

    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    monkeypatch.delenv("TRAJWH_VAULT_KEY_FILE", raising=False)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / ".aider.chat.history.md").write_bytes(b"# aider chat started at 2025-01-01 00:00:00\n\xff\xfe\n")
    s = ingest_paths(wh, [tmp_path / "in"], IngestOptions(source="hostile"))
    assert (s.n_new, s.quarantine_reasons) == (0, {"invalid_utf8": 1})
    result = build(str(wh.root))
    assert result.success
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["redacted_layer_has_no_secrets"] and checks["normalized_reconciles_with_raw"]


def test_an_episode_whose_model_steps_read_empty_is_quarantined_not_kept(wh, tmp_path):
    """An adapter that reads every model turn of an episode as empty (a format version it does not
    know, another harness's look-alike lines) lost the content: the episode is quarantined as
    no_content with the count, the record stays in raw, and the batch's other episodes land."""
    rows = [{"id": "ok", "messages": [{"role": "user", "content": "fix it"}, {"role": "assistant", "content": "done"}]},
            {"id": "lost", "messages": [{"role": "user", "content": "fix it"},
                                        {"role": "assistant", "content": [{"type": "future_block", "value": "x"}]},
                                        {"role": "assistant", "content": None}]}]
    (tmp_path / "rows.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    s = ingest_paths(wh, [tmp_path / "rows.jsonl"], IngestOptions(source="hostile"))
    assert s.n_new == 2
    summary = normalize_warehouse(wh, run_id="t")
    assert (summary.episodes, summary.quarantine_reasons) == (1, {"no_content": 1})
    [q] = wh.query("SELECT reason FROM quarantine WHERE stage = 'normalize'").to_pylist()
    assert "2 model step(s) are all empty" in q["reason"]
    assert wh.query("SELECT source_episode_id FROM episodes").column(0).to_pylist() == ["ok"]
    assert wh.query("SELECT count(*) FROM raw_records").column(0)[0].as_py() == 2
