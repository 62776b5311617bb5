"""The `trajwh` command end to end, as a user runs it (subprocesses on a fresh warehouse)."""

from __future__ import annotations

import base64
import csv as csv_module
import gzip
import json
import re
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import ROOT, trajwh_cmd
from trajwh.lineage.catalog import Warehouse


def run(env, *args, ok=True):
    r = subprocess.run([*trajwh_cmd(), *args], env=env, capture_output=True, text=True, timeout=300)
    if ok:
        assert r.returncode == 0, f"{args}: {r.stdout}\n{r.stderr}"
    return r


def test_ingest_reads_standard_input(cli_env, cases):
    """`trajwh ingest -` takes records from a pipe (gzip too), recorded as the file <stdin>, with
    offsets into the bytes that came through the pipe; '-' twice is refused."""
    data = (cases / "two_episodes.jsonl").read_bytes()
    r = subprocess.run([*trajwh_cmd(), "ingest", "-", "--source", "piped"], input=gzip.compress(data), env=cli_env,
                       capture_output=True, timeout=300)
    assert r.returncode == 0 and b"2 new" in r.stdout, r.stderr
    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])
    rows = wh.query("SELECT file_path, byte_offset, byte_length, compression, payload FROM raw_records "
                    "ORDER BY byte_offset").to_pylist()
    assert {x["file_path"] for x in rows} == {"<stdin>"} and {x["compression"] for x in rows} == {"gzip"}
    assert [data[x["byte_offset"]:x["byte_offset"] + x["byte_length"]] for x in rows] == [x["payload"] for x in rows]
    assert wh.query("SELECT paths FROM batches").column(0)[0].as_py() == '["<stdin>"]'
    twice = subprocess.run([*trajwh_cmd(), "ingest", "-", "-"], input=data, env=cli_env, capture_output=True, timeout=300)
    assert twice.returncode == 2 and b"more than once" in twice.stderr


@pytest.fixture
def built(cli_env, small_corpus, cases):
    run(cli_env, "ingest", str(small_corpus), "--source", "synthetic", "--license", "CC-BY-4.0")
    run(cli_env, "ingest", str(cases), "--source", "cases")
    run(cli_env, "build")
    return cli_env


def test_ingest_reports_new_then_already_present(cli_env, cases):
    first = run(cli_env, "ingest", str(cases / "two_episodes.jsonl"))
    assert "2 new, 0 already present" in first.stdout
    again = run(cli_env, "ingest", str(cases / "two_episodes.jsonl"))
    assert "0 new, 2 already present" in again.stdout and "no batch recorded" in again.stdout
    wh = Warehouse(cli_env["TRAJWH_WAREHOUSE"])  # a no-op ingest records its run, not an empty batch
    assert wh.query("SELECT count(*) FROM batches").column(0)[0].as_py() == 1
    assert wh.query("SELECT count(*) FROM runs WHERE job = 'ingest'").column(0)[0].as_py() == 2


def test_ingest_exits_nonzero_only_when_nothing_could_be_ingested(cli_env, cases):
    partial = run(cli_env, "ingest", str(cases / "malformed_and_truncated.jsonl"))
    assert "2 new" in partial.stdout and "malformed_json (2)" in partial.stdout
    nothing = run(cli_env, "ingest", str(cases / "not_a_trajectory.txt"), ok=False)
    assert nothing.returncode == 1
    assert "nothing ingested" in nothing.stderr and "unknown_format" in nothing.stderr
    missing = run(cli_env, "ingest", str(cases / "nope.jsonl"), ok=False)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_build_status_and_trace(built):
    status = run(built, "status", "--json")
    st = json.loads(status.stdout)
    rows = {t["table"]: t["rows"] for t in st["tables"]}
    # 150 synthetic + cases: 2+2+2+2+1+3+1 JSONL records (2 schema-invalid) + 2 JSON documents with
    # 3 episodes, one of which is the same episode as a JSONL line (same trajectory key): kept once;
    # + harness/: one Claude Code and one Codex session; + redaction/: one episode;
    # + openhands_v1/: 3 output lines (one quarantined at normalize: empty history) and one event array;
    # + curation/: 8 episodes of one repository; + swe_agent/: one .traj; + codex/: one rollout;
    # + claude/: a session and its subagent transcript; + aider/: one session; + licenses/: 5 + 2 episodes;
    # + trae_agent/: one trajectory; + claude_headless/, codex_exec/: one headless run each
    # + cline_task/: a UI log and a task's metadata, companions (2 records, no episode)
    # + chat_messages/: 26 records (and a row quarantined at ingest), one quarantined at normalize (a role
    # nobody knows), one an array of two rows: 26 episodes; + gemini/: two sessions; + inspect_ai/: one
    # JSON log of two samples; + browser_use/: two histories; + osworld/: two runs' traj.jsonl, with two
    # result.txt, one instruction.txt and one runtime.log (companions: 4 records, no episode); + agentbench/: three samples;
    # + goose/: two sessions; + harbor/: two trials (an ATIF trajectory and its result.json, a companion),
    # and a model call's log, its prompt and response, a verifier's reward file, logs and configs (kept, no episode);
    # + tau_bench/: two τ-bench runs (3 and 1 results), a τ²-bench run of two simulations, and a τ² run saved as a
    # folder (its results.json, a companion, and one simulation file): 7 episodes from 5 records; + qwen_code/: one session
    assert rows["episodes"] == 150 + 11 + 2 + 2 + 1 + 3 + 8 + 1 + 1 + 2 + 1 + 7 + 26 + 2 + 2 + 1 + 1 + 1 + 2 + 2 + 3 + 2 + 2 + 7 + 1
    assert rows["raw_records"] == (150 + 13 + 2 + 2 + 1 + 4 + 8 + 1 + 1 + 2 + 1 + 7 + 26 + 2 + 1 + 2 + 1 + 1 + 1 + 2 + 6 + 3
                                   + 2 + 12 + 5 + 1)
    assert rows["redacted_episodes"] == rows["episodes"] and rows["redacted_steps"] == rows["steps"]
    reasons = {(q["stage"], q["reason_code"]): q["n"] for q in st["quarantine"]}
    assert reasons[("normalize", "invalid_record")] == 4
    assert reasons[("normalize", "duplicate_episode")] == 1
    # not_a_trajectory.txt, actions/shell_commands.tsv, redaction_eval/heldout.jsonl, chat_templates/qwen2.5.jinja
    # (README.md is skipped as a documentation file, not quarantined)
    assert reasons[("ingest", "unknown_format")] == 4
    human = run(built, "status")
    assert "raw_records" in human.stdout and "quarantine by reason" in human.stdout

    sid = run(built, "sql", "SELECT step_id FROM steps WHERE step_index = 3 ORDER BY step_id LIMIT 1",
              "--format", "csv").stdout.splitlines()[1]
    t = run(built, "trace", sid[:12])
    assert sid in t.stdout and "raw record" in t.stdout and re.search(r"line \d+, byte offset \d+", t.stdout)
    assert "episodes-" in t.stdout or "cases" in t.stdout
    bad = run(built, "trace", "ffffffffffff", ok=False)
    assert bad.returncode == 2 and "no step, episode or raw record" in bad.stderr


def test_cli_builds_show_in_the_warehouses_dagster_instance(built):
    """`trajwh build` records its run in <warehouse>/_dagster, the instance `trajwh ui` serves."""
    import dagster as dg

    home = Path(built["TRAJWH_WAREHOUSE"]) / "_dagster"
    assert "enabled: false" in (home / "dagster.yaml").read_text()  # telemetry off
    instance = dg.DagsterInstance.from_config(str(home))
    runs = instance.get_runs()
    assert runs and runs[0].status == dg.DagsterRunStatus.SUCCESS
    event = instance.get_latest_materialization_event(dg.AssetKey("fragments"))
    assert event is not None and event.asset_materialization.metadata["dagster/row_count"].value > 0
    checks = instance.all_logs(runs[0].run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
    assert len(checks) >= 9


def test_sql_output_formats(built, tmp_path):
    q = "SELECT task_id, count(*) AS n FROM episodes GROUP BY 1 ORDER BY n DESC, task_id LIMIT 5"
    table = run(built, "sql", q)
    assert "task_id" in table.stdout and "5 rows" in table.stdout
    csv = run(built, "sql", q, "--format", "csv").stdout.splitlines()
    assert csv[0] == "task_id,n" and len(csv) == 6
    js = [json.loads(line) for line in run(built, "sql", q, "--format", "json").stdout.splitlines()]
    assert len(js) == 5 and set(js[0]) == {"task_id", "n"}
    out = tmp_path / "r.parquet"
    run(built, "sql", q, "--format", "parquet", "--out", str(out))
    assert pq.read_table(out).num_rows == 5
    nested = run(built, "sql", "SELECT tool_calls, payload FROM restricted.steps JOIN restricted.raw_records "
                 "ON record_id = _record_id WHERE tool_calls IS NOT NULL LIMIT 2", "--format", "csv", "--restricted")
    assert len(nested.stdout.splitlines()) == 3


def test_sql_out_writes_with_copy_and_tables_stay_one_line_per_row(built, tmp_path):
    """--out streams the result with DuckDB's COPY: nested values as JSON text and bytes as base64
    in CSV, the same rows in every format; the table keeps one line per row, cells truncated."""
    q = ("SELECT step_id, tool_calls, text FROM steps WHERE tool_calls IS NOT NULL AND length(text) > 60 "
         "ORDER BY step_id LIMIT 7")
    for fmt in ("csv", "json", "parquet"):
        r = run(built, "sql", q, "--format", fmt, "--out", str(tmp_path / f"r.{fmt}"))
        assert "wrote 7 rows" in r.stderr
    rows = list(csv_module.DictReader((tmp_path / "r.csv").open(encoding="utf-8")))
    lines = [json.loads(x) for x in (tmp_path / "r.json").read_text().splitlines()]
    table = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert [r["step_id"] for r in rows] == [r["step_id"] for r in lines] == [r["step_id"] for r in table]
    assert [json.loads(r["tool_calls"]) for r in rows] == [r["tool_calls"] for r in lines] == [r["tool_calls"] for r in table]
    assert [r["text"] for r in rows] == [r["text"] for r in table]
    blob = run(built, "sql", "SELECT record_id, payload FROM restricted.raw_records ORDER BY record_id LIMIT 1",
               "--format", "csv", "--restricted").stdout.splitlines()[1].split(",")
    raw = Warehouse(built["TRAJWH_WAREHOUSE"]).query("SELECT payload FROM raw_records ORDER BY record_id LIMIT 1").column(0)[0].as_py()
    assert base64.b64decode(blob[1]) == raw
    shown = run(built, "sql", q, "--max-width", "24").stdout
    body = [line for line in shown.splitlines() if line.startswith("│")]
    assert len(body) == 7 and all("…" in line for line in body)
    assert len(run(built, "sql", q, "--max-width", "0").stdout.splitlines()) > len(shown.splitlines())


def test_sql_is_safe_by_default(built):
    """Plain names mean the redacted data; the restricted zone opens only with --restricted."""
    same = "SELECT count(*) FROM steps s JOIN redacted_steps r USING (step_id) WHERE s.text IS DISTINCT FROM r.text"
    assert run(built, "sql", same, "--format", "csv").stdout.split()[1] == "0"
    differs = ("SELECT count(*) FROM restricted.steps s JOIN steps r USING (step_id) "
               "WHERE s.text IS DISTINCT FROM r.text OR s.observation IS DISTINCT FROM r.observation")
    assert int(run(built, "sql", differs, "--format", "csv", "--restricted").stdout.split()[1]) > 0  # secrets there
    for q in ("SELECT payload FROM raw_records", "SELECT * FROM restricted.steps",
              "SELECT * FROM read_parquet('normalized/steps/*.parquet')",
              "SELECT * FROM read_parquet('raw/raw_records/*.parquet')", "SELECT reason FROM quarantine"):
        r = run(built, "sql", q, ok=False)
        assert r.returncode == 2, q
    assert "--restricted" in run(built, "sql", "SELECT * FROM restricted.steps", ok=False).stderr
    places = run(built, "sql", "SELECT count(*) FROM raw_records WHERE file_path IS NOT NULL", "--format", "csv")
    assert int(places.stdout.split()[1]) > 150  # where records came from, without their bytes


def test_sql_is_read_only_and_errors_are_clear(built):
    bad = run(built, "sql", "SELEC nothing", ok=False)
    assert bad.returncode == 2 and "does not parse" in bad.stderr and "LINE 1" in bad.stderr
    write = run(built, "sql", "DROP VIEW episodes", ok=False)
    assert write.returncode == 2 and "read-only" in write.stderr.lower()


def test_every_query_in_docs_sql_md_runs(built):
    text = (ROOT / "docs" / "sql.md").read_text()
    queries = re.findall(r"```sql\n(.*?)```", text, re.S)
    assert len(queries) == 10
    for q in queries:
        out = run(built, "sql", q, "--format", "json").stdout.splitlines()
        assert out, f"query returned no rows:\n{q}"


def test_synth_is_deterministic(tmp_path, cli_env):
    run(cli_env, "synth", "--episodes", "60", "--out", str(tmp_path / "a"), "--seed", "5")
    run(cli_env, "synth", "--episodes", "60", "--out", str(tmp_path / "b"), "--seed", "5")
    run(cli_env, "synth", "--episodes", "60", "--out", str(tmp_path / "c"), "--seed", "6")
    files = sorted(p.name for p in Path(tmp_path / "a").iterdir() if p.is_file())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / files[0]).read_bytes() != (tmp_path / "c" / files[0]).read_bytes()


def test_stats_and_audit_commands(built):
    st = json.loads(run(built, "stats", "--json", "--by", "policy_name", "--interaction", "policy-alpha",
                        "teacher-omega", "swe-loop", "shell-agent").stdout)
    rates = {r["policy_name"]: r for r in st["effective_rate"]}
    assert "teacher-omega" in rates and all(0 <= r["eta"] <= 1 for r in rates.values() if r["known"])
    assert all(r["eta"] is None for r in rates.values() if not r["known"])  # only unknown outcomes: no rate
    assert st["matrix"] and "delta" in st["interaction"]
    for bad in (["--interaction", "policy-alpha", "no-such-policy", "swe-loop", "shell-agent"],
                ["--compare", "swe-loop", "no-such-harness"]):
        r = run(built, "stats", *bad, ok=False)
        assert r.returncode == 2 and "no-such-" in r.stderr and "Valid:" in r.stderr and "Traceback" not in r.stderr
    r = run(built, "export", "--out", "/dev/null", "--where", "no_such_column = 1", ok=False)
    assert r.returncode == 2 and "no_such_column" in r.stderr and "Traceback" not in r.stderr
    audit = json.loads(run(built, "audit", "--json").stdout)
    assert audit["groups_across_splits"] == 0 and audit["clusters_across_splits"] == 0 and audit["violations"] == 0


def test_trace_walks_back_from_a_fragment(built):
    fid = run(built, "sql", "SELECT fragment_id FROM fragments WHERE kind <> 'full_episode' ORDER BY 1 LIMIT 1",
              "--format", "csv").stdout.splitlines()[1]
    out = run(built, "trace", fid[:12]).stdout
    assert f"fragment {fid}" in out and "raw record" in out and re.search(r"line \d+, byte offset \d+", out)
    assert "[adapter:native@" in out  # lineage edges print their transform and version
