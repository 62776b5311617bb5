"""Real harness formats in: detection, authorship, tool calls, actions, verdicts, golden summaries.

Uses ../shared/corpus (skipped with a reason when absent) and hand-made sessions in
tests/cases/harness/.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import orjson
import pytest
from conftest import SHARED_CORPUS, trajwh_cmd
from corpus_summary import corpus_summary
from hypothesis import given, settings
from hypothesis import strategies as st
from trajwh.ingest.actions import classify_command, classify_tool
from trajwh.ingest.adapters.common import rewritten
from trajwh.ingest.adapters.registry import detect
from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.ingest.reader import find_input_files, read_head
from trajwh.lineage.catalog import Warehouse

GOLDEN = Path(__file__).parent / "golden" / "corpus.json"
needs_corpus = pytest.mark.skipif(not SHARED_CORPUS.is_dir(), reason=f"real corpus not found at {SHARED_CORPUS}")


@pytest.fixture(scope="module")
def corpus_wh(tmp_path_factory):
    if not SHARED_CORPUS.is_dir():
        pytest.skip(f"real corpus not found at {SHARED_CORPUS}")
    wh = Warehouse(tmp_path_factory.mktemp("corpus") / "wh")
    ingest_paths(wh, [SHARED_CORPUS], IngestOptions(source="corpus"))
    normalize_warehouse(wh, run_id="corpus")
    return wh


def rows(wh, sql, params=None):
    return wh.query(sql, params).to_pylist()


@needs_corpus
def test_every_corpus_file_is_detected_and_nothing_valid_is_quarantined(corpus_wh):
    q = rows(corpus_wh, "SELECT file_path, stage, reason_code FROM quarantine")
    assert q == []  # SOURCES.md, the corpus's provenance notes, is skipped as documentation, not quarantined
    assert not rows(corpus_wh, "SELECT 1 FROM raw_records WHERE file_path LIKE '%SOURCES.md'")
    formats = {r["format"] for r in rows(corpus_wh, "SELECT DISTINCT format FROM raw_records")}
    assert formats == {"swe-agent", "mini-swe-agent", "openhands-output", "openhands-events", "atif", "atif-metrics",
                       "claude-code", "codex", "aider", "swebench-report", "swebench-summary", "swebench-predictions"}


@needs_corpus
def test_golden_summary_per_file(corpus_wh):
    """Episode count, steps, authors, first and last action, verdict: pinned per corpus file."""
    assert corpus_summary(corpus_wh, SHARED_CORPUS.resolve()) == json.loads(GOLDEN.read_text())


@needs_corpus
def test_detection_needs_no_flag(corpus_wh):
    by_dir = {"swe-agent-traj": "swe-agent", "mini-swe-agent-traj-json": "mini-swe-agent",
              "mini-swe-agent-2x": "mini-swe-agent", "openhands-v1": "openhands-output",
              "openhands-eval-output-jsonl": "openhands-output", "openhands-event-stream-json": "openhands-events",
              "atif-like-trajectory-json": "atif", "claude-code-session-jsonl": "claude-code",
              "codex-cli-rollout-jsonl": "codex", "aider-chat-history-md": "aider"}
    companions = {".report.json": "swebench-report", "results_summary.json": "swebench-summary",
                  ".all_preds.jsonl": "swebench-predictions", "__metrics.json": "atif-metrics"}
    seen = 0
    for r in rows(corpus_wh, "SELECT DISTINCT file_path, format FROM raw_records"):
        path = Path(r["file_path"])
        want = next((f for suffix, f in companions.items() if path.name.endswith(suffix)), by_dir[path.parent.name])
        assert r["format"] == want, path
        assert detect(str(path), read_head(path)).name == want
        seen += 1
    assert seen == len(find_input_files([SHARED_CORPUS])) - 1  # all but SOURCES.md


@needs_corpus
def test_swe_agent_authorship_demos_and_tool_calls(corpus_wh):
    demo = rows(corpus_wh, """SELECT s.author, s.role FROM steps s JOIN episodes e USING (trajectory_key)
                             WHERE e.instance_id = 'pydicom__pydicom-1458' AND s.metadata LIKE '%is_demo%'""")
    assert demo == [{"author": "harness", "role": "user"}]
    steps = rows(corpus_wh, """SELECT s.step_index, s.author, s.role, s.tool_calls, s.tool_call_id
                              FROM steps s JOIN episodes e USING (trajectory_key)
                              WHERE e.instance_id = 'SWE-agent__test-repo-i1' ORDER BY step_index""")
    assert [s["author"] for s in steps[:4]] == ["harness", "harness", "model", "environment"]
    call = steps[2]["tool_calls"][0]
    assert call["name"] == "find_file" and orjson.loads(call["arguments"]) == {"file_name": "missing_colon.py"}
    assert steps[3]["tool_call_id"] == call["id"]  # the observation links to its call by id


@needs_corpus
def test_mini_swe_agent_verdict_comes_from_the_report(corpus_wh):
    eps = {r["instance_id"]: r for r in rows(corpus_wh, "SELECT instance_id, resolved, verifier_status, test_results "
                                                        "FROM episodes WHERE format = 'mini-swe-agent'")}
    assert eps["django__django-16255"]["resolved"] is True
    assert eps["django__django-10999"]["resolved"] is False
    tests = eps["django__django-16255"]["test_results"]
    assert tests and all(t["status"] == "passed" for t in tests) and eps["django__django-16255"]["verifier_status"] == "ok"
    # results_summary.json agrees with every report.json
    summary = json.loads((SHARED_CORPUS / "mini-swe-agent-traj-json" / "results_summary.json").read_text())
    flags = {i["instance_id"]: i["resolved"] for i in summary["instances"]}
    assert all(flags[iid] == ep["resolved"] for iid, ep in eps.items() if iid in flags)
    assert eps["astropy__astropy-12907"]["resolved"] is True and eps["django__django-11019"]["resolved"] is False  # 2.x


@needs_corpus
def test_openhands_authorship_and_iteration_limit(corpus_wh):
    authors = rows(corpus_wh, """SELECT json_extract_string(s.metadata, '$.action') AS action,
                                        json_extract_string(s.metadata, '$.observation') AS obs, s.author
                                 FROM steps s JOIN episodes e USING (trajectory_key) WHERE e.format = 'openhands-output'""")
    by = {}
    for r in authors:
        by.setdefault(r["action"] or f"obs:{r['obs']}", set()).add(r["author"])
    assert by["system"] == {"harness"} and by["recall"] == {"harness"} and by["obs:recall"] == {"harness"}
    assert by["run"] == {"model"} and by["obs:run"] == {"environment"}
    limit = rows(corpus_wh, "SELECT termination_reason FROM episodes WHERE instance_id = 'ponylang__ponyc-4588'")[0]
    assert "maximum iteration" in limit["termination_reason"]
    ui = rows(corpus_wh, "SELECT DISTINCT s.author FROM steps s JOIN episodes e USING (trajectory_key) "
                         "WHERE e.format = 'openhands-events' AND s.role = 'user' AND s.text IS NOT NULL "
                         "AND s.metadata LIKE '%\"message\"%'")
    assert ui == [{"author": "human"}]


@needs_corpus
def test_atif_results_before_calls_are_linked_and_flagged(corpus_wh):
    steps = rows(corpus_wh, """SELECT s.author, s.tool_call_id, s.metadata FROM steps s JOIN episodes e USING (trajectory_key)
                              WHERE e.format = 'atif' ORDER BY s.step_index""")
    early = [s for s in steps if s["metadata"] and "result_before_call" in s["metadata"]]
    assert early and all(s["author"] == "environment" for s in early)
    assert steps[0]["author"] == "harness"  # the benchmark's instruction
    meta = orjson.loads(rows(corpus_wh, "SELECT metadata FROM episodes WHERE format = 'atif'")[0]["metadata"])
    assert meta["results_before_call"] >= 1 and meta["turns"] == 6  # turns come from metrics.json beside it


@needs_corpus
def test_aider_one_episode_per_session(corpus_wh):
    counts = {Path(r["file_path"]).name.split("__")[0]: r["n"] for r in rows(
        corpus_wh, "SELECT r.file_path, count(*) AS n FROM episodes e JOIN raw_records r ON r.record_id = e._record_id "
                   "WHERE e.format = 'aider' GROUP BY 1")}
    assert counts == {"AFI-Protocol": 9, "AlexShchuka": 3, "Aquaticat": 19}
    authors = {r["author"] for r in rows(corpus_wh, "SELECT DISTINCT author FROM steps s JOIN episodes e "
                                                    "USING (trajectory_key) WHERE e.format = 'aider'")}
    assert authors == {"human", "harness", "model"}


def test_hand_made_claude_and_codex_sessions(wh, cases):
    ingest_paths(wh, [cases / "harness"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    steps = rows(wh, """SELECT e.format, s.step_index, s.author, s.action_kind, s.action_object, s.tool_call_id, s.exit_code
                       FROM steps s JOIN episodes e USING (trajectory_key) ORDER BY e.format, s.step_index""")
    claude = [(s["author"], s["action_kind"]) for s in steps if s["format"] == "claude-code"]
    assert claude == [("human", None), ("harness", None), ("model", "read"), ("environment", None),
                      ("model", "test"), ("environment", None), ("model", "edit"), ("environment", None),
                      ("harness", None), ("model", None)]
    codex = [s for s in steps if s["format"] == "codex"]
    assert [s["author"] for s in codex] == ["harness", "human", "model", "model", "environment", "model",
                                            "environment", "model"]  # the event_msg copies are not steps
    assert (codex[3]["action_kind"], codex[3]["action_object"]) == ("search", "-n error build.log")
    assert (codex[5]["action_kind"], codex[5]["action_object"]) == ("edit", "src/main.c")
    assert codex[4]["tool_call_id"] == "call_1" and codex[4]["exit_code"] == 0
    ep = rows(wh, "SELECT policy_name, tokens_in, tokens_out, source_episode_id FROM episodes WHERE format = 'codex'")[0]
    assert ep == {"policy_name": "gpt-test-codex", "tokens_in": 900, "tokens_out": 80, "source_episode_id": "sess-codex-1"}


def test_format_flag_overrides_and_unknown_formats_are_named(wh, cases, cli_env):
    s = ingest_paths(wh, [cases / "harness" / "codex_rollout.jsonl"], IngestOptions(source="cases", format="native"))
    assert s.n_new == 0 and s.quarantine_reasons == {"not_a_record": 13}
    r = subprocess.run([*trajwh_cmd(), "ingest", str(cases / "two_episodes.jsonl"), "--format", "nope"],
                       env=cli_env, capture_output=True, text=True)
    assert r.returncode == 2 and "unknown format 'nope'" in r.stderr and "swe-agent" in r.stderr


@pytest.mark.parametrize("cmd, kind", [
    ("cat src/a.py", "read"), ("sed -n '1,20p' a.py", "read"), ("head -n 5 a.py", "read"),
    ("grep -rn foo src", "search"), ("rg foo", "search"), ("find . -name '*.py'", "search"),
    ("sed -i 's/a/b/' a.py", "edit"), ("cat > a.py <<'EOF'\nx\nEOF", "edit"), ("git apply fix.patch", "edit"),
    ("pytest -x tests/test_a.py", "test"), ("tox -e py311", "test"), ("npm test", "test"),
    ("cd /repo && python -m pytest -q", "test"), ("python reproduce.py", "run"), ("submit", "submit"),
    ("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached", "submit"),
    ("curl -s https://example.org/x", "browse"), ("open /repo/a.py", "read"), ("find_file x.py", "search"),
])
def test_shell_commands_get_canonical_kinds(cmd, kind):
    assert classify_command(cmd)[0] == kind


@pytest.mark.parametrize("name, args, kind, obj", [
    ("Read", {"file_path": "/a.py"}, "read", "/a.py"), ("Grep", {"pattern": "foo"}, "search", "foo"),
    ("Edit", {"file_path": "/a.py"}, "edit", "/a.py"), ("Bash", {"command": "pytest"}, "test", "pytest"),
    ("str_replace_editor", '{"command": "view", "path": "/x"}', "read", "/x"),
    ("str_replace_editor", '{"command": "create", "path": "/x"}', "edit", "/x"),
    ("execute_bash", {"command": "grep -r x ."}, "search", "-r x ."),
    ("shell", {"command": ["bash", "-lc", "cat a.py"]}, "read", "a.py"),
    ("apply_patch", {"input": "*** Update File: src/m.c\n"}, "edit", "src/m.c"),
    ("finish", {}, "submit", None), ("WebFetch", {"url": "https://x.org"}, "browse", "https://x.org"),
    # Gemini CLI's tools
    ("run_shell_command", {"command": "pytest -q"}, "test", "pytest -q"),
    ("read_file", {"absolute_path": "/r/a.py"}, "read", "/r/a.py"),
    ("search_file_content", {"pattern": "TODO"}, "search", "TODO"),
    ("read_many_files", {"paths": ["a.py", "b.py"]}, "read", "a.py, b.py"),
    ("google_web_search", {"query": "ruff F401"}, "browse", "ruff F401"),
])
def test_harness_tools_get_canonical_kinds(name, args, kind, obj):
    assert classify_tool(name, args) == (kind, obj)


def test_openhands_v1_events_are_read_with_their_tool_calls(wh, cases):
    """V1 (software-agent-sdk): `action` is an object; nothing is dropped silently, a record
    that says nothing is quarantined, a failed start stays an error (never 'finished')."""
    ingest_paths(wh, [cases / "openhands_v1"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    eps = {r["instance_id"]: r for r in rows(wh, "SELECT instance_id, format, n_steps, exit_status, policy_name, "
                                                 "harness_name, metadata FROM episodes")}
    good = eps["calc-1"]
    assert (good["format"], good["n_steps"], good["exit_status"]) == ("openhands-output", 8, "finished")
    assert good["policy_name"] == "litellm_proxy/test-model" and good["harness_name"] == "openhands-sdk"
    assert orjson.loads(good["metadata"])["internal_events"] == 1
    assert "calc-2" not in eps and eps["calc-3"]["n_steps"] == 0 and eps["calc-3"]["exit_status"] == "error"
    q = rows(wh, "SELECT stage, reason FROM quarantine WHERE file_path LIKE '%output.jsonl'")
    assert len(q) == 1 and q[0]["stage"] == "normalize" and "empty history" in q[0]["reason"]
    steps = rows(wh, """SELECT s.author, s.role, s.action_kind, s.tool_calls, s.tool_call_id, s.exit_code, s.text
                       FROM steps s JOIN episodes e USING (trajectory_key) WHERE e.instance_id = 'calc-1'
                       ORDER BY s.step_index""")
    assert [s["author"] for s in steps] == ["harness", "harness", "model", "environment", "model", "harness", "model",
                                            "environment"]
    assert [s["action_kind"] for s in steps if s["author"] == "model"] == ["search", "test", "submit"]
    call = steps[2]["tool_calls"][0]
    assert call["name"] == "execute_bash" and orjson.loads(call["arguments"]) == {"command": "grep -rn divide calc.py"}
    assert steps[3]["tool_call_id"] == call["id"] and steps[3]["exit_code"] == 0
    assert steps[2]["text"] == "Let me look." and "timed out" in steps[5]["text"]
    ui = rows(wh, "SELECT e.n_steps, e.metadata FROM episodes e WHERE e.format = 'openhands-events'")
    assert len(ui) == 1 and ui[0]["n_steps"] == 5
    meta = orjson.loads(ui[0]["metadata"])
    assert meta["internal_events"] == 2 and meta["unknown_events"] == 1
    authors = [r["author"] for r in rows(wh, "SELECT s.author FROM steps s JOIN episodes e USING (trajectory_key) "
                                             "WHERE e.format = 'openhands-events' ORDER BY s.step_index")]
    assert authors == ["harness", "human", "model", "environment", "harness"]


def test_tool_schemas_once_per_digest_and_rewritten_calls_keep_both_requests(wh, cases):
    """What the model saw: the tools of the system event are stored once per digest, episodes
    name them by ``tool_schema_digest``; a call the harness changed before running it keeps the
    model's arguments and the executed request; a call run as emitted has no ``executed``."""
    ingest_paths(wh, [cases / "openhands_v1"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    schemas = rows(wh, "SELECT tool_schema_digest, origin, schema_kind, tool_names, schema_text FROM tool_schemas")
    assert len(schemas) == 1, "two episodes shown the same tools share one row"
    assert schemas[0]["tool_names"] == ["execute_bash"] and schemas[0]["schema_kind"] == "function_schemas"
    assert schemas[0]["origin"] == "openhands:SystemPromptEvent.tools"
    assert orjson.loads(schemas[0]["schema_text"]) == [{"name": "execute_bash"}]
    digests = {r["tool_schema_digest"] for r in rows(wh, "SELECT tool_schema_digest FROM episodes WHERE n_steps > 0")}
    assert digests == {schemas[0]["tool_schema_digest"]}
    calls = [c for r in rows(wh, "SELECT s.tool_calls FROM steps s JOIN episodes e USING (trajectory_key) "
                                 "WHERE e.instance_id = 'calc-1' AND s.tool_calls IS NOT NULL ORDER BY s.step_index")
             for c in r["tool_calls"]]
    assert [c["executed"] is not None for c in calls] == [False, True, False]
    assert orjson.loads(calls[1]["arguments"])["command"] == "python -m pytest -q"
    assert orjson.loads(calls[1]["executed"])["command"] == "cd /workspace && python -m pytest -q"
    normalize_warehouse(wh, run_id="t2", full=True)  # a rebuild keeps exactly one row per digest
    assert wh.query("SELECT count(*) FROM tool_schemas").column(0)[0].as_py() == 1


@pytest.mark.parametrize(("emitted", "executed", "changed"), [
    ({"command": "ls"}, {"command": "ls ", "blocking": False, "is_input": False}, False),  # defaults added
    ({"command": "ls", "is_input": "false"}, {"command": "ls", "is_input": False}, False),  # parsed, same value
    ({"command": "ls"}, {"command": "ls -la"}, True),
    ({"command": "view", "path": "/a"}, {"path": "/a", "start": 0}, True),  # a different action kind
    ({"command": "pytest -q"}, "pytest -q", False),
    ({"file_name": "x.py"}, "find_file x.py", True),  # a call turned into a command line
    ("pytest", "pytest\n", False),
])
def test_rewritten_rule(emitted, executed, changed):
    assert rewritten(emitted, executed) is changed


@needs_corpus
def test_real_tool_schemas_and_executed_requests(corpus_wh):
    schemas = {r["origin"]: r for r in rows(corpus_wh, "SELECT origin, n_tools, tool_names FROM tool_schemas")}
    assert schemas["openhands:system.args.tools"]["tool_names"] == ["execute_bash", "think", "finish", "str_replace_editor"]
    assert schemas["swe-agent:replay_config.agent.tools"]["n_tools"] >= 4
    n = rows(corpus_wh, """SELECT count(*) AS n FROM (SELECT unnest(tool_calls) AS c FROM steps s JOIN episodes e
                            USING (trajectory_key) WHERE e.format = 'swe-agent') WHERE c.executed LIKE 'find_file %'""")
    assert n[0]["n"] >= 1, "SWE-agent's command line for a function call is kept beside the call"


@needs_corpus
def test_current_harness_versions_give_action_kinds(corpus_wh):
    """mini-swe-agent 2.x tool calls and OpenHands V1 events: >= 95 % of model steps that act
    carry an action kind, and tool results link to their calls."""
    per = rows(corpus_wh, """SELECT e.harness_name, e.harness_version,
                                    count(*) FILTER (WHERE s.author = 'model' AND s.action_kind IS NOT NULL) AS acted,
                                    count(*) FILTER (WHERE s.author = 'model') AS model,
                                    count(*) FILTER (WHERE s.author = 'environment' AND s.tool_call_id IS NULL) AS unlinked
                             FROM steps s JOIN episodes e USING (trajectory_key)
                             WHERE (e.harness_name = 'mini-swe-agent' AND e.harness_version LIKE '2.%')
                                   OR e.harness_name = 'openhands-sdk'
                             GROUP BY ALL""")
    assert {r["harness_name"] for r in per} == {"mini-swe-agent", "openhands-sdk"}
    for r in per:
        assert r["acted"] / r["model"] >= 0.95, r
        assert r["unlinked"] == 0, r


def test_swe_agent_1x_replay_config_as_json_text_and_harness_exits(wh, cases):
    ingest_paths(wh, [cases / "swe_agent"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    ep = rows(wh, "SELECT policy_name, repository, base_commit, instance_id, sampling, exit_status FROM episodes")[0]
    assert ep["policy_name"] == "claude-sonnet-4" and ep["repository"] == "github.com/acme/widgetlib"
    assert ep["base_commit"] == "4b825dc642cb6eb9a060e54bf8d69288fbee4904" and ep["instance_id"] == "acme__widgetlib-42"
    assert orjson.loads(ep["sampling"])["temperature"] == 0.0 and ep["exit_status"] == "exit_cost"
    authors = [r["author"] for r in rows(wh, "SELECT author FROM steps ORDER BY step_index")]
    assert authors == ["harness", "harness", "model", "environment", "harness"]  # "Exit due to ..." is the harness's


def test_crlf_patches_give_the_same_symbols():
    from trajwh.dedup.groups import patch_symbols

    lf = ("diff --git a/src/w/h.py b/src/w/h.py\n--- a/src/w/h.py\n+++ b/src/w/h.py\n"
          "@@ -10,3 +10,3 @@ def parse_header(raw):\n-    return raw[:-1]\n+    return raw\n")
    crlf = lf.replace("\n", "\r\n")
    assert patch_symbols(crlf) == patch_symbols(lf) == ["src/w/h.py::parse_header"]
    assert not any("\r" in s for s in patch_symbols(crlf))


def _command_table() -> list[tuple[str, str, str | None]]:
    rows_ = []
    for line in (Path(__file__).parent / "cases" / "actions" / "shell_commands.tsv").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        cmd, kind, obj = line.split("\t")
        cmd = cmd.replace("\\n", "\n")
        rows_.append((cmd, kind, None if obj == "-" else cmd.splitlines()[0].strip() if obj == "*" else obj))
    return rows_


COMMANDS = _command_table()


def test_command_table_has_at_least_a_hundred_real_world_commands():
    assert len(COMMANDS) >= 100 and {k for _, k, _ in COMMANDS} >= {"read", "search", "edit", "run", "test", "submit",
                                                                     "browse"}


@pytest.mark.parametrize("cmd, kind, obj", COMMANDS, ids=[c[:40] for c, _, _ in COMMANDS])
def test_real_world_shell_commands(cmd, kind, obj):
    assert classify_command(cmd) == (kind, obj)


@pytest.mark.parametrize("text, command", [
    ("Here:\n```python\nprint(1)\n```\n\nNow run:\n```bash\nls -la\n```\n", "ls -la"),
    ("```python\nx = 1\n```\nprose between two blocks\n```python\ny\n```", None),  # prose is not a command
    ("THOUGHT: read it\n\n```bash\ncat a.py\n```", "cat a.py"),
    ("````\n```bash\nnot closed here\n```\n````", "```bash\nnot closed here\n```"),
])
def test_a_closing_fence_never_opens_the_next_block(text, command):
    from trajwh.ingest.actions import command_in_text

    assert command_in_text(text) == command


def test_codex_current_cli_exit_codes_git_event_only_turns_and_stdin(wh, cases):
    ingest_paths(wh, [cases / "codex"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    ep = rows(wh, "SELECT repository, base_commit, task_text FROM episodes")[0]
    assert ep == {"repository": "github.com/acme/widgetlib", "base_commit": "4b825dc642cb6eb9a060e54bf8d69288fbee4904",
                  "task_text": "Run the parser tests and fix what fails."}
    steps = rows(wh, "SELECT author, action_kind, exit_code, text, test_results FROM steps ORDER BY step_index")
    assert [s["text"] for s in steps if s["author"] == "human"] == ["Run the parser tests and fix what fails.",
                                                                    "Also add a changelog entry."]
    assert [s["action_kind"] for s in steps if s["author"] == "model" and s["action_kind"]] == ["test", "run", "run"]
    assert [s["exit_code"] for s in steps if s["author"] == "environment"] == [1, None, 0]
    failed = [t for s in steps for t in s["test_results"] or [] if t["status"] == "failed"]
    assert failed == [{"name": "tests/test_header.py::test_last_field", "status": "failed"}]
    summary = rows(wh, "SELECT json_extract(metadata, '$.tests_summary') AS s FROM steps WHERE exit_code = 1")[0]["s"]
    assert orjson.loads(summary) == {"complete": False, "errors": 0, "failed": 1, "passed": 1}


def test_claude_code_subagents_compaction_notifications_and_usage(wh, cases):
    ingest_paths(wh, [cases / "claude"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    eps = {r["source_episode_id"]: r for r in rows(wh, "SELECT source_episode_id, tokens_in, tokens_out, metadata, "
                                                       "trajectory_key, policy_name FROM episodes")}
    main_id = "5b1f0c2e-7a41-4c55-9d0e-1a2b3c4d5e6f"
    assert set(eps) == {main_id, f"{main_id}/agent-a7f3"}  # two episodes, not a quarantined duplicate
    main, sub = eps[main_id], eps[f"{main_id}/agent-a7f3"]
    assert (main["tokens_in"], main["tokens_out"]) == (10 + 200 + 3000 + 5, 40 + 9)  # the streamed message once
    assert orjson.loads(sub["metadata"])["parent_session_id"] == main_id and sub["policy_name"] == "claude-haiku-4-5"

    def authors(key):
        return [(r["author"], (r["text"] or "")[:20]) for r in rows(
            wh, "SELECT author, text FROM steps WHERE trajectory_key = ? AND role = 'user' ORDER BY step_index", [key])]

    assert [a for a, _ in authors(main["trajectory_key"])] == ["human", "harness", "harness"]
    assert authors(sub["trajectory_key"])[0] == ("harness", "Find parse_header an")


def test_aider_architect_relay_whole_file_edits_and_failure_feedback(wh, cases):
    ingest_paths(wh, [cases / "aider"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    steps = rows(wh, "SELECT author, action_kind, action_object, text, metadata FROM steps ORDER BY step_index")
    humans = [s["text"] for s in steps if s["author"] == "human"]
    assert humans == ["/architect make parse_header keep the last field", "also update the changelog"]
    relayed = [s for s in steps if s["metadata"] and "architect_plan_relayed" in s["metadata"]]
    assert len(relayed) == 1 and relayed[0]["author"] == "model"
    edits = [(s["author"], s["action_object"]) for s in steps if s["action_kind"] == "edit"]
    assert edits == [("model", "src/widgetlib/header.py"), ("model", "CHANGELOG.md"), ("model", "CHANGELOG.md")]
    feedback = [s for s in steps if "SearchReplaceNoExactMatch" in (s["text"] or "")]
    assert len(feedback) == 1 and feedback[0]["author"] == "harness" and "I see" not in feedback[0]["text"]
    assert any(s["author"] == "model" and (s["text"] or "").startswith("I see") for s in steps)


_AIDER_SESSIONS = """
# aider chat started at 2026-03-02 09:14:05

> aider --model openrouter/qwen/qwen3-coder  \n> Aider v0.86.1  \n> Model: openrouter/qwen/qwen3-coder with diff edit format  \n
#### Add a --verbose flag to cli.py  \n
I'll add the flag to the argument parser.

> Tokens: 3.1k sent, 210 received.  \n> litellm.RateLimitError: RateLimitError: OpenrouterException - Rate limit exceeded: free-models-per-day  \n> Retrying in 0.2 seconds...  \n
# aider chat started at 2026-03-02 10:02:44

> aider --model openrouter/qwen/qwen3-coder  \n
#### Now write the changelog entry  \n> litellm.APIConnectionError: OpenrouterException - Server disconnected without sending a response.  \n> Retrying in 0.2 seconds...  \n
Added an entry under Unreleased.

> Tokens: 2.2k sent, 90 received.  \n
# aider chat started at 2026-03-02 11:40:19

> aider  \n
#### explain main.py  \n
It parses the arguments and dispatches to the subcommands.

>  \n>  \n> ^C KeyboardInterrupt  \n"""


def test_aider_history_in_a_repository_and_how_its_sessions_ended(wh, tmp_path):
    """Aider writes its history to a hidden file in the repository's root: a folder walk reads it (and
    still skips other hidden files and folders). How a session ended, when it says: an error of the
    model's API after the model's last answer (a rate limit in the words of a provider's quota), one the
    model recovered from is not an ending; a ^C is an interrupt."""
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "notes.jsonl").write_text('{"role": "user", "content": "not a trajectory"}\n')
    (repo / ".aider.chat.history.md").write_text(_AIDER_SESSIONS.replace("\\n", "\n"))
    (repo / ".aider.input.history").write_text("+explain main.py\n")
    found = find_input_files([tmp_path])
    assert [p.name for p in found] == [".aider.chat.history.md"]
    ingest_paths(wh, [tmp_path], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    eps = rows(wh, "SELECT task_text, exit_status, termination_reason FROM episodes ORDER BY task_text")
    assert [(e["task_text"], e["exit_status"]) for e in eps] == [
        ("Add a --verbose flag to cli.py", "error"), ("Now write the changelog entry", None),
        ("explain main.py", "interrupted")]
    assert eps[0]["termination_reason"].startswith("rate limit of the model provider API: litellm.RateLimitError")
    assert eps[1]["termination_reason"] is None and "KeyboardInterrupt" in eps[2]["termination_reason"]
    from trajwh.fragments.outcomes import classify_outcome

    assert classify_outcome(eps[0], []).cause == "resource_exhausted"


@pytest.mark.parametrize("pretty", [False, True])
def test_preds_json_keyed_by_instance_id_is_a_companion(wh, tmp_path, pretty):
    preds = {"acme__widgetlib-42": {"model_name_or_path": "deepseek-chat", "instance_id": "acme__widgetlib-42",
                                    "model_patch": "diff --git a/x b/x\n"},
             "acme__widgetlib-43": {"model_name_or_path": "deepseek-chat", "model_patch": ""}}
    f = tmp_path / "preds.json"
    f.write_text(json.dumps(preds, indent=2 if pretty else None))
    s = ingest_paths(wh, [f], IngestOptions(source="cases"))
    assert s.n_quarantined == 0 and s.n_new == 1
    assert rows(wh, "SELECT format FROM raw_records") == [{"format": "swebench-predictions"}]
    from trajwh.ingest.adapters.base import RecordContext
    from trajwh.ingest.adapters.swebench import SwebenchPredictionsAdapter

    facts = SwebenchPredictionsAdapter().facts(preds, RecordContext("r", "cases", str(f), None))
    assert {k for kind, k, _ in facts if kind == "instance_id"} == {"acme__widgetlib-42", "acme__widgetlib-43"}


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_command_classifier_never_raises(cmd):
    kind, _ = classify_command(cmd)
    assert kind in ("read", "search", "edit", "run", "test", "submit", "browse", "other")


@pytest.mark.parametrize("text, expected", [
    ("head\n<elided_chars>\n12345 characters elided\n</elided_chars>\ntail",
     {"observation_truncated": True, "elided_chars": 12345, "original_length": 12355}),
    ("   627\t// (NOT | AMP |<response clipped><NOTE>Due to the max output limit", {"observation_truncated": True}),
    ("a\n[... omitted 120 of 300 lines ...]\nb", {"observation_truncated": True, "omitted_lines": 120, "original_lines": 300}),
    ("1 passed in 0.01s", None), ("", None),
])
def test_truncated_observations_are_flagged(text, expected):
    from trajwh.ingest.truncation import truncation

    assert truncation(text) == expected


@needs_corpus
def test_real_truncated_observations_and_what_the_model_saw(corpus_wh):
    cut = rows(corpus_wh, """SELECT e.format, count(*) AS n,
                                    count(json_extract(s.metadata, '$.elided_chars')) AS with_length
                             FROM steps s JOIN episodes e USING (trajectory_key)
                             WHERE json_extract(s.metadata, '$.observation_truncated') = 'true'
                             GROUP BY 1 ORDER BY 1""")
    by = {r["format"]: r for r in cut}
    assert by["mini-swe-agent"]["n"] > 0 and by["mini-swe-agent"]["with_length"] == by["mini-swe-agent"]["n"]
    assert by["openhands-output"]["n"] > 0  # <response clipped>: cut, original length not told
    assert not rows(corpus_wh, """SELECT 1 FROM steps WHERE author <> 'environment'
                                  AND json_extract(metadata, '$.observation_truncated') = 'true'""")


def test_chat_message_rows_of_public_sft_datasets(wh, cases):
    """Rows of a message list (OpenAI tool calls, a text-acting SWE-agent export, ShareGPT, the
    list kept as JSON text): one episode per row, attempts of one instance kept apart, calls
    linked to their results, the first user turn the harness's prompt; a row with no message list
    is quarantined at ingest, a role nobody knows at normalize, each with its reason."""
    folder = cases / "chat_messages"
    for f in sorted(folder.iterdir()):
        assert detect(str(f), read_head(f)).name == "chat-messages", f.name
    ingest_paths(wh, [folder], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    q = rows(wh, "SELECT file_path, line_no, stage, reason_code, reason FROM quarantine ORDER BY stage")
    assert [(Path(r["file_path"]).name, r["stage"], r["reason_code"]) for r in q] == [
        ("bad_rows.jsonl", "ingest", "not_a_record"), ("bad_rows.jsonl", "normalize", "invalid_record")]
    assert "no message list" in q[0]["reason"] and "prompt and completion" in q[0]["reason"] and q[0]["line_no"] == 2
    assert "'narrator'" in q[1]["reason"] and "assistant" in q[1]["reason"]
    eps = {r["source_episode_id"] or r["instance_id"] or r["task_text"][:12]: r for r in rows(
        wh, "SELECT source_episode_id, instance_id, format, n_steps, resolved, exit_status, policy_name, repository, "
            "tool_schema_digest, task_text, metadata, _record_index, trajectory_key FROM episodes")}
    assert {r["format"] for r in eps.values()} == {"chat-messages"} and len(eps) == 26

    def steps(key):
        return rows(wh, "SELECT s.author, s.role, s.action_kind, s.action_object, s.tool_calls, s.tool_call_id, s.exit_code, s.text, "
                        "s.observation, s.metadata FROM steps s WHERE trajectory_key = ? ORDER BY step_index",
                    [eps[key]["trajectory_key"]])

    # OpenAI tool calls: two attempts of one instance, two episodes
    t0, t1 = eps["pallets__click-2271.qwen3.t0"], eps["pallets__click-2271.qwen3.t1"]
    assert t0["trajectory_key"] != t1["trajectory_key"] and (t0["resolved"], t1["resolved"]) == (True, False)
    assert t0["repository"] == "github.com/pallets/click" and t0["task_text"].startswith("<uploaded_files>")
    meta = orjson.loads(t0["metadata"])
    assert meta["submission"].startswith("diff --git") and meta["row_license"] == "BSD-3-Clause"
    s0 = steps("pallets__click-2271.qwen3.t0")
    assert [s["author"] for s in s0] == ["harness", "harness", "model", "environment", "model", "environment",
                                         "harness", "model", "environment", "model"]
    assert [s["action_kind"] for s in s0 if s["author"] == "model"] == ["search", "read", "test", "submit"]
    assert s0[3]["tool_call_id"] == s0[2]["tool_calls"][0]["id"] == "toolu_01" and s0[3]["exit_code"] == 0
    assert orjson.loads(s0[4]["tool_calls"][0]["arguments"])["view_range"] == [214, 260]
    assert [s["exit_code"] for s in steps("pallets__click-2271.qwen3.t1")][8] == 1
    # a model acting in text: its commands' output comes back as user turns
    sa = eps["marshmallow-code__marshmallow-1343"]
    assert (sa["resolved"], sa["exit_status"], sa["policy_name"]) == (False, "submitted", "swe-agent-llama-70b")
    assert sa["repository"] == "github.com/marshmallow-code/marshmallow"
    s1 = steps("marshmallow-code__marshmallow-1343")
    assert [s["author"] for s in s1] == ["harness", "harness", "model", "environment", "model", "environment", "model"]
    assert [s["action_kind"] for s in s1 if s["author"] == "model"] == ["search", "read", "submit"]
    assert s1[3]["observation"].startswith("Found 1 matches") and s1[3]["text"] is None
    assert [orjson.loads(s["metadata"])["trained_in_source"] for s in s1] == [False, False, True, False, True, False, True]
    # ShareGPT: two rows of one JSON array, a call as its own turn, the tools stored once
    sg, hello = eps["sg-0001"], eps["sg-0002"]
    assert (sg["_record_index"], hello["_record_index"]) == (0, 1) and sg["tool_schema_digest"]
    s2 = steps("sg-0001")
    assert [s["author"] for s in s2] == ["harness", "harness", "model", "environment", "model"]
    assert s2[2]["tool_calls"][0]["name"] == "get_weather"
    assert orjson.loads(s2[2]["tool_calls"][0]["arguments"]) == {"city": "Lisbon"}
    assert s2[3]["observation"] == '{"forecast": "sunny", "high_c": 24}'
    # the list kept as JSON text, content as parts, reasoning kept
    sm = eps["tokenlib.a1b2c3d4.ft_claude.1"]
    assert (sm["resolved"], sm["policy_name"]) == (True, "claude-3-7-sonnet-20250219")
    tools = rows(wh, "SELECT tool_names, origin FROM tool_schemas WHERE tool_schema_digest = ?", [sm["tool_schema_digest"]])
    assert tools == [{"tool_names": ["bash", "submit"], "origin": "chat-messages:tools"}]
    s3 = steps("tokenlib.a1b2c3d4.ft_claude.1")
    assert s3[2]["text"] == "Reproducing first." and "skips initialisation" in orjson.loads(s3[2]["metadata"])["reasoning"]
    assert s3[3]["observation"].startswith("Traceback") and s3[3]["tool_call_id"] == "call_a1"
    # a file that is one conversation (an array of messages), arguments as an object
    s4 = steps("Find the fai")
    assert [s["author"] for s in s4] == ["harness", "model", "environment", "model"]
    assert orjson.loads(s4[1]["tool_calls"][0]["arguments"]) == {"command": "pytest -x services/payments"}
    assert s4[1]["action_kind"] == "test" and s4[2]["tool_call_id"] == "1"
    # Anthropic content blocks: calls, results inside user messages (one an error), thinking; the system beside
    s5 = steps("msg-run-17")
    assert [(s["author"], s["role"]) for s in s5] == [
        ("harness", "system"), ("harness", "user"), ("model", "assistant"), ("environment", "tool"),
        ("model", "assistant"), ("environment", "tool"), ("harness", "user"), ("model", "assistant"),
        ("environment", "tool"), ("model", "assistant")]
    assert [s["action_kind"] for s in s5 if s["author"] == "model"] == ["run", "edit", "test", None]
    assert [s["tool_call_id"] for s in s5 if s["role"] == "tool"] == ["toolu_01A", "toolu_01B", "toolu_01C"]
    assert s5[3]["observation"].startswith("src/app.py:3:1: F401") and orjson.loads(s5[8]["metadata"]) == {"is_error": True}
    assert orjson.loads(s5[2]["metadata"])["reasoning"].startswith("Start from") and s5[2]["text"] == "Running the linter."
    assert s5[6]["text"] == "Also run the tests before you finish."
    # SWE-agent's history as a row (SWE-smith): demonstrations are the harness's, whatever their role;
    # command output it sends as a user turn is the environment's; results name their call in a list
    s6 = steps("marshmallow.9716fc62.lm_rewrite__a1b2.swesmith.0")
    assert [(s["author"], s["role"]) for s in s6] == [
        ("harness", "system"), ("harness", "user"), ("harness", "assistant"), ("harness", "user"), ("model", "assistant"),
        ("environment", "tool"), ("environment", "user"), ("model", "assistant"), ("environment", "tool")]
    assert orjson.loads(s6[2]["metadata"]) == {"demonstration": True}
    assert [s["tool_call_id"] for s in s6 if s["role"] == "tool"] == ["call_Q1", "call_Q2"]
    assert [s["action_kind"] for s in s6 if s["author"] == "model"] == ["search", "submit"]
    # OpenAI Responses API items (an Agents SDK input list): calls and their outputs by call id
    s7 = steps("Tag the curr")
    assert [(s["author"], s["role"]) for s in s7] == [
        ("harness", "system"), ("harness", "user"), ("model", "assistant"), ("environment", "tool"),
        ("model", "assistant"), ("environment", "tool"), ("model", "assistant")]
    assert [(s["action_kind"], s["action_object"]) for s in s7 if s["author"] == "model"] == [
        ("read", "git status --porcelain"), ("edit", "CHANGELOG.md"), (None, None)]
    assert s7[3]["exit_code"] == 0 and s7[3]["observation"] == ""
    # Cline task histories: results come back as user text blocks headed "[tool for 'x'] Result:", each tool
    # output linked to its call; the environment details beside them stay the harness's; the task is what a
    # person typed (human), the editor's state sent with it the harness's
    s8 = steps("<task>\nFix t")
    assert [(s["author"], s["role"]) for s in s8] == [
        ("human", "user"), ("harness", "user"), ("model", "assistant"), ("environment", "tool"), ("harness", "user"),
        ("model", "assistant"), ("environment", "tool"), ("model", "assistant"), ("environment", "tool"),
        ("model", "assistant")]
    assert s8[0]["text"].endswith("</task>") and s8[1]["text"].startswith("<environment_details>")
    assert [s["action_kind"] for s in s8 if s["author"] == "model"] == ["read", "edit", "test", "submit"]
    assert [s["tool_call_id"] for s in s8 if s["role"] == "tool"] == ["toolu_01A", "toolu_01B", "toolu_01C"]
    assert s8[3]["observation"].startswith("def total(items):") and s8[4]["text"].startswith("<environment_details>")
    assert orjson.loads(eps["<task>\nFix t"]["metadata"])["calls_without_result"] == 1  # attempt_completion
    # older Cline: tools called as XML in the model's text; a result's output in the blocks after its header
    s9 = steps("<task>\nAdd a")
    assert s9[0]["author"] == "human" and s9[1]["author"] == "harness"
    assert [(s["author"], s["action_kind"], s["action_object"]) for s in s9 if s["author"] not in ("harness", "human")] == [
        ("model", "read", "cli.py"), ("environment", None, None), ("model", "search", "def read_paths"),
        ("environment", None, None), ("model", "run", "python cli.py --verbose reader.py"), ("environment", None, None),
        ("model", "submit", None)]
    assert orjson.loads(s9[2]["tool_calls"][0]["arguments"]) == {"path": "cli.py"}
    assert s9[3]["observation"].startswith("import argparse") and "environment_details" not in s9[3]["observation"]
    assert orjson.loads(s9[8]["metadata"]) == {"is_error": True, "tool": "execute_command"}
    # Responses API built-in tools (a computer-use trace): screen actions browse, screenshots named with their page
    s10 = steps("Find the ope")
    assert [(s["author"], s["action_kind"], s["action_object"]) for s in s10 if s["author"] == "model"] == [
        ("model", "browse", "screenshot"), ("model", "browse", "Lisbon city library opening hours"),
        ("model", "browse", "click 412,96"), ("model", "browse", "type saturday"), ("model", "run", "date +%A"),
        ("model", None, None)]
    assert [(s["tool_call_id"], s["observation"]) for s in s10 if s["role"] == "tool"] == [
        ("call_c1", "[screenshot] about:blank"), ("call_c2", "[screenshot] https://library.example.org/hours"),
        ("call_c3", "[screenshot] https://library.example.org/hours#saturday"), ("call_s1", "Saturday\n")]
    assert "reasoning" in orjson.loads(s10[1]["metadata"]) and "base64" not in str(s10)
    # calls written in the text: OpenHands' non-function-calling format (results "EXECUTION RESULT of [tool]:"; the
    # in-context example inside the task prompt is not a call) and Hermes <tool_call> / <tool_response>
    s11 = steps("getmoto__moto-5752")
    assert [(s["author"], s["role"]) for s in s11] == [
        ("harness", "system"), ("harness", "user"), ("model", "assistant"), ("environment", "tool"), ("model", "assistant"),
        ("environment", "tool"), ("model", "assistant")]
    assert [(s["action_kind"], s["tool_calls"][0]["name"]) for s in s11 if s["author"] == "model"] == [
        ("read", "str_replace_editor"), ("test", "execute_bash"), ("submit", "finish")]
    assert orjson.loads(s11[2]["tool_calls"][0]["arguments"])["path"].endswith("moto/ssm/models.py")
    assert s11[3]["observation"].startswith("Here's the result") and s11[5]["exit_code"] == 1
    s12 = steps("hermes-fc-0031")
    assert [s["author"] for s in s12] == ["harness", "harness", "model", "environment", "model"]
    assert orjson.loads(s12[2]["tool_calls"][0]["arguments"]) == {"symbol": "AAPL"}
    assert s12[3]["observation"] == '{"symbol": "AAPL", "price": 232.14}'
    s13 = steps("oh-sharegpt-0007")  # ShareGPT as OpenHands' converter writes it: the call in a function_call turn's text
    assert [(s["author"], s["action_kind"], s["action_object"]) for s in s13] == [
        ("harness", None, None), ("harness", None, None), ("model", "search", "/workspace/pallets__flask__2.3"),
        ("environment", None, None), ("model", "submit", None)]
    assert s13[2]["text"].startswith("Let me see") and s13[3]["exit_code"] == 0
    # ReAct lines (WebShop): actions with their argument, "Observation:" turns the environment's
    s14 = steps("webshop_212")
    assert [(s["author"], s["action_kind"], s["action_object"]) for s in s14] == [
        ("harness", None, None), ("model", "search", "gluten free crackers"), ("environment", None, None),
        ("model", "browse", "B07ZJ9"), ("environment", None, None), ("model", "browse", "Buy Now")]
    assert s14[2]["observation"].startswith("[Back to Search] Page 1")
    # AgentInstruct OS: "Act: bash" and a fenced command, the OS's output as an unmarked user turn, "Act: answer(27)"
    s15 = steps("os_interaction_0031")
    assert [(s["author"], s["action_kind"]) for s in s15] == [
        ("harness", None), ("model", "search"), ("environment", None), ("model", "submit")]
    assert s15[1]["action_object"].startswith("/etc") and orjson.loads(s15[3]["tool_calls"][0]["arguments"]) == {"input": "27"}
    # an OpenCode export: the session's id and model, a message's steps, results from the tool parts' state
    oc = eps["ses_4f2a91c0d3ffe1a2b3c4d5e6"]
    assert (oc["policy_name"], oc["task_text"][:8]) == ("claude-sonnet-4-5", "The test")
    s16 = steps("ses_4f2a91c0d3ffe1a2b3c4d5e6")
    assert [(s["author"], s["action_kind"], s["tool_call_id"]) for s in s16] == [
        ("human", None, None), ("model", "read", None), ("environment", None, "call_a1"), ("model", "edit", None),
        ("environment", None, "call_a2"), ("environment", None, "call_a3"), ("model", None, None)]
    assert s16[1]["action_object"].endswith("notes/dates.py") and "reasoning" in orjson.loads(s16[1]["metadata"])
    assert [c["name"] for c in s16[3]["tool_calls"]] == ["edit", "bash"]
    assert orjson.loads(s16[5]["metadata"]) == {"is_error": True} and s16[5]["observation"].startswith("Error: pytest")
    # LangChain / LangGraph messages: roles from their type, calls with args, a tool's error status flagged
    assert eps["lg-thread-0042"]["policy_name"] == "gpt-4.1-2025-04-14"
    s17 = steps("lg-thread-0042")
    assert [(s["author"], s["action_kind"], s["tool_call_id"]) for s in s17] == [
        ("harness", None, None), ("harness", None, None), ("model", "read", None), ("environment", None, "call_Zk1"),
        ("model", "test", None), ("environment", None, "call_Zk2"), ("model", None, None)]
    assert orjson.loads(s17[5]["metadata"])["is_error"] is True and s17[2]["action_object"] == "reports/export.py"
    s18 = steps("lg-thread-0043")  # messages_to_dict's {"type", "data"}
    assert [(s["author"], s["action_kind"]) for s in s18] == [
        ("harness", None), ("model", "read"), ("environment", None), ("model", None)]
    assert orjson.loads(s7[2]["metadata"]) == {"reasoning": "Check the working tree is clean first."}
    assert [s["tool_call_id"] for s in s7 if s["role"] == "tool"] == ["call_git_1", "call_patch_1"]
    assert s7[5]["observation"].startswith("Success. Updated")
    # smolagents: a run's memory steps (the task the harness's, a plan and code actions the model's, observations and
    # an execution error as the results of the step's call, final_answer(...) in code a submit) ...
    gaia = eps["c61d22de-5f6c-4958-a7f6-5e9707bd3466"]
    assert gaia["policy_name"] == "Qwen/Qwen2.5-Coder-32B-Instruct" and gaia["task_text"].startswith("How many studio")
    s19 = steps("c61d22de-5f6c-4958-a7f6-5e9707bd3466")
    assert [(s["author"], s["action_kind"], s["tool_call_id"]) for s in s19] == [
        ("harness", None, None), ("harness", None, None), ("model", None, None), ("model", "run", None),
        ("environment", None, "call_1"), ("model", "run", None), ("environment", None, "call_2"),
        ("model", "submit", None), ("environment", None, "call_3")]
    assert s19[3]["action_object"].startswith("results = web_search(") and s19[4]["observation"].startswith("Execution logs:")
    assert orjson.loads(s19[6]["metadata"]) == {"is_error": True} and "ZeroDivisionError" in s19[6]["observation"]
    # ... and the messages its memory writes: "tool-call" (a Python repr of the calls) joins the assistant's message,
    # "tool-response" is the named call's result, an "Error:" one flagged
    s20 = steps("smol-tc-0007")
    assert [(s["author"], s["action_kind"], s["tool_call_id"]) for s in s20] == [
        ("harness", None, None), ("harness", None, None), ("model", "other", None), ("environment", None, "call_9a"),
        ("model", "submit", None), ("environment", None, "call_9b")]
    assert s20[2]["text"] == "I will look it up." and orjson.loads(s20[2]["tool_calls"][0]["arguments"]) == {
        "location": "Paris", "celsius": True}
    assert s20[3]["observation"] == "14 degrees, light rain" and orjson.loads(s20[5]["metadata"]) == {"is_error": True}
    # one conversation as JSON lines (a message per line): the file is one record and one episode; a line cut
    # short is counted, the conversation kept around it
    lines = eps["Which file d"]
    assert orjson.loads(lines["metadata"])["bad_lines"] == [6] and lines["n_steps"] == 6
    s21 = steps("Which file d")
    assert [(s["author"], s["action_kind"], s["tool_call_id"]) for s in s21] == [
        ("harness", None, None), ("harness", None, None), ("model", "search", None), ("environment", None, "call_1"),
        ("model", "test", None), ("model", None, None)]
    # TRL's prompt-completion rows: the prompt's messages, then the completion's
    s8 = steps("pc-1")
    assert [(s["author"], s["action_kind"]) for s in s8] == [("harness", None), ("harness", None), ("model", "search")]


def test_json_lines_that_quote_a_harness_are_not_its_document(tmp_path):
    """A row of JSON lines whose text names mini-swe-agent is a chat row, not a .traj.json."""
    row = {"id": "r1", "messages": [{"role": "system", "content": "You are mini-swe-agent."},
                                    {"role": "user", "content": "Fix it."}]}
    f = tmp_path / "rows.jsonl"
    f.write_bytes(orjson.dumps(row) + b"\n" + orjson.dumps({**row, "id": "r2"}) + b"\n")
    assert detect(str(f), read_head(f)).name == "chat-messages"
    doc = tmp_path / "run.json"
    doc.write_bytes(orjson.dumps({"messages": row["messages"], "info": {"mini_version": "1.15.0"}}, option=orjson.OPT_INDENT_2))
    assert detect(str(doc), read_head(doc)).name == "mini-swe-agent"


def test_gemini_cli_recordings_in_both_layouts(wh, cases):
    """A Gemini CLI chat recording as one JSON file and as JSON lines with ``$set`` snapshots (each
    message once, however many snapshots repeat it): calls on the model's step, each result an
    environment step linked by id (an error flagged), thoughts as reasoning, notices as harness."""
    folder = cases / "gemini"
    for f in sorted(folder.iterdir()):
        assert detect(str(f), read_head(f)).name == "gemini-cli", f.name
    ingest_paths(wh, [folder], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    assert rows(wh, "SELECT * FROM quarantine") == []
    eps = {r["source_episode_id"][:8]: r for r in rows(
        wh, "SELECT source_episode_id, trajectory_key, n_steps, policy_name, tokens_in, tokens_out, harness_name, "
            "task_text, ended_at, metadata FROM episodes")}
    one, lines = eps["5c1f0e2a"], eps["be07c9d1"]
    assert (one["n_steps"], one["policy_name"], one["tokens_in"], one["tokens_out"]) == (8, "gemini-2.5-pro", 28220, 123)
    assert one["harness_name"] == "gemini-cli" and one["task_text"].startswith("Why does `npm test` fail")
    meta = orjson.loads(one["metadata"])
    assert meta["models"] == ["gemini-2.5-flash", "gemini-2.5-pro"] and meta["cached_tokens"] == 18200

    def steps(ep):
        return rows(wh, "SELECT author, role, action_kind, action_object, tool_call_id, text, observation, metadata "
                        "FROM steps WHERE trajectory_key = ? ORDER BY step_index", [ep["trajectory_key"]])

    s = steps(one)
    assert [x["author"] for x in s] == ["human", "model", "environment", "model", "environment", "environment",
                                        "harness", "model"]
    assert [(x["action_kind"], x["action_object"]) for x in s if x["author"] == "model"] == [
        ("test", "cd packages/api && npm test"), ("read", "/home/dev/shop/packages/api/src/routes/users.ts"), (None, None)]
    assert s[2]["tool_call_id"] == "run_shell_command-1762247526400-1a2b3c" and "1 failed" in s[2]["observation"]
    assert orjson.loads(s[5]["metadata"]) == {"status": "error", "is_error": True}
    assert s[5]["observation"] == "File path is ignored by configured ignore patterns."
    assert orjson.loads(s[1]["metadata"])["reasoning"].startswith("Reproducing: Run the failing suite")
    assert orjson.loads(s[6]["metadata"]) == {"notice": "info"}
    # JSON lines: two snapshots repeat the first messages; each message is read once
    t = steps(lines)
    assert [x["author"] for x in t] == ["human", "model", "environment", "model"]
    assert (t[1]["action_kind"], t[1]["action_object"]) == ("search", "import cfg")
    assert lines["ended_at"].isoformat().startswith("2026-09-10T11:25:30")
    assert orjson.loads(lines["metadata"])["layout"] == "jsonl"


def test_a_cline_task_folder(wh, tmp_path, cases):
    """A Cline task folder: the history is the episode, named by its folder (the task id, the time it
    began in milliseconds), its model and tokens from the messages' modelInfo and metrics; the UI log
    and the task metadata beside it are kept as companions, neither quarantined nor episodes."""
    task = tmp_path / "tasks" / "1736180000000"
    task.mkdir(parents=True)
    (task / "api_conversation_history.json").write_bytes((cases / "chat_messages" / "cline_api_history.json").read_bytes())
    for name in ("ui_messages.json", "task_metadata.json"):
        (task / name).write_bytes((cases / "cline_task" / name).read_bytes())
    got = {Path(f).name: detect(str(f), read_head(f)).name for f in task.iterdir()}
    assert got == {"api_conversation_history.json": "chat-messages", "ui_messages.json": "cline-ui-messages",
                   "task_metadata.json": "cline-task-metadata"}
    s = ingest_paths(wh, [tmp_path / "tasks"], IngestOptions(source="cline"))
    summary = normalize_warehouse(wh, run_id="t")
    assert (s.n_new, s.n_quarantined, summary.companions) == (3, 0, 2)
    [ep] = rows(wh, "SELECT source_episode_id, started_at, policy_name, harness_name, tokens_in, tokens_out, cost_usd "
                    "FROM episodes")
    assert (ep["source_episode_id"], ep["harness_name"]) == ("1736180000000", "cline")
    assert ep["started_at"].isoformat().startswith("2025-01-06T16:13:20")
    assert ep["policy_name"] == "claude-sonnet-4-5-20250929" and ep["tokens_in"] and ep["tokens_out"]
    first_model = rows(wh, "SELECT tokens_in, tokens_out FROM steps WHERE author = 'model' ORDER BY step_index LIMIT 1")
    assert first_model == [{"tokens_in": 12, "tokens_out": 80}]
    assert rows(wh, "SELECT count(*) AS n FROM quarantine") == [{"n": 0}]


def test_trae_agent_trajectory(wh, tmp_path, cases):
    """A Trae Agent trajectory: each model call's new messages then its response make the conversation
    (the model keeps its own history); tool results linked to their calls, a failed one flagged, the
    agent's reflection the harness's; the last call's result from the last agent step; task_done is a
    submit and the agent's claim of success, not a verdict. Without llm_interactions (an older recorder)
    the agent steps are read; running out of steps is a budget."""
    src = cases / "trae_agent" / "trajectory_20250714_101500.json"
    assert detect(str(src), read_head(src)).name == "trae-agent"
    ingest_paths(wh, [src], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    [ep] = rows(wh, "SELECT source_episode_id, policy_name, harness_name, exit_status, resolved, tokens_in, tokens_out, "
                    "started_at, trajectory_key, metadata FROM episodes")
    assert (ep["source_episode_id"], ep["policy_name"], ep["harness_name"]) == (
        "trajectory_20250714_101500", "claude-sonnet-4-20250514", "trae-agent")
    assert (ep["exit_status"], ep["resolved"], ep["tokens_in"], ep["tokens_out"]) == ("submitted", None, 14140, 350)
    assert orjson.loads(ep["metadata"])["agent_reported_success"] is True
    steps = rows(wh, "SELECT author, action_kind, action_object, tool_call_id, text, observation, metadata FROM steps "
                     "WHERE trajectory_key = ? ORDER BY step_index", [ep["trajectory_key"]])
    assert [(s["author"], s["action_kind"], s["tool_call_id"]) for s in steps] == [
        ("harness", None, None), ("harness", None, None), ("model", "read", None), ("environment", None, "toolu_01X"),
        ("model", "edit", None), ("environment", None, "toolu_01Y"), ("model", "test", None),
        ("environment", None, "toolu_01Z"), ("harness", None, None), ("model", "submit", None),
        ("environment", None, "toolu_020")]
    assert steps[2]["action_object"] == "/repo/text/slug.py" and steps[10]["observation"] == "Task done."
    failed = orjson.loads(steps[7]["metadata"])
    assert failed["is_error"] and failed["error"] == "Error: exit code 1"
    assert steps[8]["text"].startswith("The tool execution failed")
    # an older recorder (agent steps only) that ran out of steps
    doc = json.loads(src.read_text())
    doc.pop("llm_interactions")
    doc["agent_steps"][0]["llm_messages"] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "the task"}]
    doc["agent_steps"][0]["llm_response"] = {"content": "Looking.", "model": "m", "tool_calls": doc["agent_steps"][0]["tool_calls"]}
    doc.update(success=False, final_result="Task execution exceeded maximum steps without completion.")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "trajectory_old.json").write_text(json.dumps(doc, indent=2))
    ingest_paths(wh, [tmp_path / "old"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t2")
    [old] = rows(wh, "SELECT exit_status, termination_reason, trajectory_key FROM episodes "
                     "WHERE source_episode_id = 'trajectory_old'")
    assert old["exit_status"] == "max_steps" and old["termination_reason"].startswith("max steps (20) reached")
    got = rows(wh, "SELECT author, tool_call_id FROM steps WHERE trajectory_key = ? ORDER BY step_index",
               [old["trajectory_key"]])
    assert [(s["author"], s["tool_call_id"]) for s in got] == [
        ("harness", None), ("harness", None), ("model", None), ("environment", "toolu_01X"), ("environment", "toolu_020")]
    from trajwh.fragments.outcomes import classify_outcome

    assert classify_outcome({"exit_status": "max_steps", "termination_reason": old["termination_reason"]}, []).cause \
        == "budget_exhausted"


def test_browser_use_histories(wh, tmp_path, cases):
    """browser-use histories, before 0.5 (thoughts under current_state, screenshots inline) and since
    (flat thoughts with thinking, screenshot paths, the judge): the page the model saw is the
    environment's, each action a call answered by its result, a step without a usable model output
    the harness's error; done is a submit and the agent's claim, the judge's verdict the episode's
    (an LLM judge), and a captcha the environment's failure. Screenshots are named, never kept."""
    from trajwh.fragments.outcomes import classify_outcome
    from trajwh.fragments.select import episode_evidence

    src = cases / "browser_use"
    assert {detect(str(f), read_head(f)).name for f in src.rglob("*.json")} == {"browser-use"}
    ingest_paths(wh, [src], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    eps = {e["source_episode_id"]: e for e in rows(
        wh, "SELECT source_episode_id, exit_status, termination_reason, resolved, verifier_name, tokens_in, tokens_out, "
            "cost_usd, policy_name, started_at, ended_at, trajectory_key, metadata FROM episodes")}
    assert set(eps) == {"agent_history_v01", "run-0042/history"}  # a generic file name takes its folder's
    old, new = eps["agent_history_v01"], eps["run-0042/history"]
    assert (old["exit_status"], old["resolved"], old["verifier_name"], old["tokens_in"]) == ("submitted", None, None, 18390)
    assert orjson.loads(old["metadata"])["agent_reported_success"] is True
    assert old["started_at"].isoformat().startswith("2025-01-09T10:53:20") and old["ended_at"] > old["started_at"]
    steps = rows(wh, "SELECT role, author, action_kind, action_object, tool_call_id, text, observation, metadata FROM steps "
                     "WHERE trajectory_key = ? ORDER BY step_index", [old["trajectory_key"]])
    assert [(s["author"], s["action_kind"], s["tool_call_id"]) for s in steps] == [
        ("environment", None, None), ("model", "browse", None), ("environment", None, "step-0.0"),
        ("environment", None, None), ("harness", None, None),
        ("environment", None, None), ("model", "browse", None), ("environment", None, "step-2.0"),
        ("environment", None, "step-2.1"),
        ("environment", None, None), ("model", "submit", None), ("environment", None, "step-3.0")]
    assert steps[1]["action_object"] == "https://shop.example.org/search?q=usb-c+hub"
    assert steps[1]["text"].startswith("Evaluation of the previous goal: Unknown") and "Next goal: Open" in steps[1]["text"]
    assert steps[6]["action_object"] == "click_element 17"
    assert steps[4]["text"].startswith("Invalid model output format") and orjson.loads(steps[4]["metadata"])["agent_error"]
    assert steps[5]["observation"].endswith("[screenshot]") and "iVBOR" not in json.dumps(steps, default=str)
    assert "HubMax 4-in-1, $18.99" in steps[8]["observation"]
    # since 0.5: thinking kept as reasoning, the judge's verdict, a captcha is not the policy's failure
    assert (new["resolved"], new["verifier_name"], new["exit_status"]) == (False, "browser-use-judge", "submitted")
    assert (new["tokens_in"], new["tokens_out"], new["cost_usd"], new["policy_name"]) == (21400, 610, 0.0616, "gpt-4.1-mini")
    judged = rows(wh, "SELECT author, action_kind, action_object, tool_call_id, observation, metadata FROM steps "
                      "WHERE trajectory_key = ? ORDER BY step_index", [new["trajectory_key"]])
    assert judged[1]["action_object"] == "city library opening hours"  # browser-use's search: a web search
    assert orjson.loads(judged[1]["metadata"])["reasoning"].startswith("I should search first")
    assert judged[0]["observation"] == "about:blank\n[screenshot] step_1.png"
    assert orjson.loads(judged[5]["metadata"])["is_error"] and judged[6]["observation"].count("tab: ") == 2
    ep = {"exit_status": new["exit_status"], "termination_reason": new["termination_reason"], "resolved": False,
          "verifier_name": new["verifier_name"]}
    assert episode_evidence(ep) == ("llm_judge", None)
    outcome = classify_outcome(ep, judged)
    assert (outcome.cause, outcome.policy_failure) == ("environment_failure", False)
    # the list of steps saved alone, each step's state first: the same run
    doc = json.loads((src / "agent_history_v01.json").read_text())
    alone = tmp_path / "alone" / "steps.json"
    alone.parent.mkdir()
    alone.write_text(json.dumps([{"state": h["state"], **h} for h in doc["history"]], indent=2))
    assert detect(str(alone), read_head(alone)).name == "browser-use"
    ingest_paths(wh, [alone], IngestOptions(source="alone"))
    normalize_warehouse(wh, run_id="t2")
    [same] = rows(wh, "SELECT n_steps, exit_status, tokens_in FROM episodes WHERE source_episode_id = 'steps'")
    assert (same["n_steps"], same["exit_status"], same["tokens_in"]) == (12, "submitted", 18390)


def test_osworld_run_folders(wh, tmp_path, cases):
    """OSWorld's run folders: traj.jsonl's lines grouped by the model's turn (one model step with one
    call per action, the screen after each action named), DONE a submit, result.txt's score the
    verdict of the evaluator, instruction.txt the task; the folders give the task, the model and the
    run; a runner's Error line (a time limit) ends the run as a budget."""
    from trajwh.fragments.outcomes import classify_outcome

    src = cases / "osworld"
    got = {f.name: detect(str(f), read_head(f)).name for f in src.rglob("*.*")}
    assert got == {"traj.jsonl": "osworld", "result.txt": "osworld-result", "instruction.txt": "osworld-instruction",
                   "runtime.log": "osworld-runtime-log"}
    s = ingest_paths(wh, [src], IngestOptions(source="osworld"))
    summary = normalize_warehouse(wh, run_id="t")
    assert (s.n_new, s.n_quarantined, summary.companions) == (6, 0, 4)
    eps = {e["policy_name"]: e for e in rows(
        wh, "SELECT source_episode_id, task_id, instance_id, task_text, policy_name, resolved, reward, verifier_name, "
            "exit_status, termination_reason, started_at, ended_at, trajectory_key, metadata FROM episodes")}
    done, timed_out = eps["gpt-4o"], eps["claude-3-7-sonnet"]
    assert done["source_episode_id"] == "pyautogui/screenshot/gpt-4o/chrome/bb5e4c0d-f964-439c-97b6-bdb9747de3f4"
    assert (done["task_id"], done["instance_id"]) == ("chrome/bb5e4c0d-f964-439c-97b6-bdb9747de3f4",
                                                      "bb5e4c0d-f964-439c-97b6-bdb9747de3f4")
    assert done["task_text"].startswith("Can you make Bing the main search engine")
    assert (done["resolved"], done["reward"], done["verifier_name"], done["exit_status"]) == (
        True, 1.0, "osworld-evaluator", "submitted")
    assert (done["ended_at"] - done["started_at"]).total_seconds() == 38
    steps = rows(wh, "SELECT author, action_kind, action_object, tool_calls, tool_call_id, observation FROM steps "
                     "WHERE trajectory_key = ? ORDER BY step_index", [done["trajectory_key"]])
    assert [(x["author"], x["action_kind"], x["tool_call_id"]) for x in steps] == [
        ("model", "browse", None), ("environment", None, "action-0"), ("model", "browse", None),
        ("environment", None, "action-1"), ("environment", None, "action-2"), ("model", "submit", None),
        ("environment", None, "action-3")]
    assert [c["id"] for c in steps[2]["tool_calls"]] == ["action-1", "action-2"]  # two actions of one turn
    assert steps[0]["action_object"] == "import pyautogui\npyautogui.click(960, 72)"
    assert steps[1]["observation"] == "[screenshot] step_1_20250312@141502.png"
    assert (timed_out["resolved"], timed_out["reward"], timed_out["exit_status"]) == (False, 0.0, "error")
    assert timed_out["task_text"] is None and timed_out["termination_reason"].startswith("Time limit exceeded")
    last = rows(wh, "SELECT author, text, action_object FROM steps WHERE trajectory_key = ? ORDER BY step_index",
                [timed_out["trajectory_key"]])
    assert last[0]["action_object"] == "CLICK 41,312" and last[-1]["author"] == "harness"
    assert classify_outcome(timed_out, last).cause == "budget_exhausted"
    # a runner that logs the reset as an __init__ action and the task on every line, in trajectory.jsonl
    run = tmp_path / "other" / "os" / "94d95f96-9699-4208-98ba-3c3119edf9c2"
    run.mkdir(parents=True)
    lines = [{"step_num": 0, "action_timestamp": "20251105@143022", "action": "__init__", "reward": 0.0, "done": False,
              "info": {}, "screenshot_file": "step_0_20251105@143022.png", "instruction": "Install the spotify app"},
             {"step_num": 1, "action_timestamp": "20251105@143035", "action": "pyautogui.click(100, 200)", "reward": 0.0,
              "done": False, "info": {}, "instruction": "Install the spotify app"},
             {"step_num": 2, "action_timestamp": "20251105@143048", "action": "DONE", "reward": 1.0, "done": True,
              "info": {}, "instruction": "Install the spotify app"}]
    (run / "trajectory.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / "result.txt").write_text("1.0")
    ingest_paths(wh, [tmp_path / "other"], IngestOptions(source="osworld"))
    normalize_warehouse(wh, run_id="t2")
    [ep] = rows(wh, "SELECT task_text, resolved, exit_status, trajectory_key FROM episodes WHERE instance_id = ?",
                [run.name])
    assert (ep["task_text"], ep["resolved"], ep["exit_status"]) == ("Install the spotify app", True, "submitted")
    got = rows(wh, "SELECT author, action_kind FROM steps WHERE trajectory_key = ? ORDER BY step_index",
               [ep["trajectory_key"]])
    assert [(x["author"], x["action_kind"]) for x in got] == [
        ("environment", None), ("model", "browse"), ("environment", None), ("model", "submit"), ("environment", None)]


def test_agentbench_runs(wh, tmp_path, cases):
    """AgentBench's runs.jsonl and error.jsonl: a sample per line, its user/agent history read as a
    model acting in text (the first user turn the task, later ones the environment's output), the
    task's result the verdict, the status the exit (a task limit: a budget), an error line's failure
    the infrastructure's (a rate limit: the provider's quota); the folders give the agent and the
    task. A line with no history (nothing ran) is quarantined at ingest with its error."""
    from trajwh.fragments.outcomes import classify_outcome

    src = cases / "agentbench"
    assert {detect(str(f), read_head(f)).name for f in src.rglob("*.jsonl")} == {"agentbench"}
    empty = tmp_path / "gpt-4-0613" / "kg-std"
    empty.mkdir(parents=True)
    (empty / "error.jsonl").write_text(json.dumps({"index": 2, "error": "START_FAILED", "info": "no container",
                                                   "output": None, "time": {"timestamp": 1, "str": "x"}}) + "\n")
    s = ingest_paths(wh, [src, empty], IngestOptions(source="agentbench"))
    assert (s.n_new, s.n_quarantined) == (3, 1)
    [q] = rows(wh, "SELECT reason FROM quarantine")
    assert "without a history" in q["reason"] and "START_FAILED" in q["reason"]
    normalize_warehouse(wh, run_id="t")
    eps = {e["source_episode_id"]: e for e in rows(
        wh, "SELECT source_episode_id, task_id, policy_name, harness_name, resolved, exit_status, termination_reason, "
            "verifier_name, task_text, ended_at, trajectory_key FROM episodes")}
    assert set(eps) == {"gpt-4-0613/os-std#17", "gpt-4-0613/dbbench-std#4", "gpt-4-0613/os-std#21"}
    ok, limit, failed = eps["gpt-4-0613/os-std#17"], eps["gpt-4-0613/dbbench-std#4"], eps["gpt-4-0613/os-std#21"]
    assert (ok["resolved"], ok["exit_status"], ok["verifier_name"], ok["policy_name"], ok["harness_name"], ok["task_id"]) == (
        True, "completed", "agentbench:os-std", "gpt-4-0613", "agentbench", "os-std#17")
    assert ok["task_text"].startswith("You are an assistant") and ok["ended_at"].isoformat().startswith("2023-09-29T15:08:43")
    steps = rows(wh, "SELECT author, action_kind, observation FROM steps WHERE trajectory_key = ? ORDER BY step_index",
                 [ok["trajectory_key"]])
    assert [(x["author"], x["action_kind"]) for x in steps] == [
        ("harness", None), ("model", "search"), ("environment", None), ("model", "submit")]
    assert steps[2]["observation"].startswith("The output of the OS:")
    assert (limit["resolved"], limit["exit_status"]) == (False, "task limit reached")
    assert classify_outcome(limit, []).cause == "budget_exhausted"
    assert (failed["resolved"], failed["exit_status"]) == (None, "error")
    assert failed["termination_reason"].startswith("provider quota (AGENT_FAILED)")
    assert classify_outcome(failed, []).cause == "resource_exhausted"


def test_tau_bench_runs(wh, tmp_path, cases):
    """τ-bench results (a JSON array per run, tool-calling and ReAct agents) and τ²-bench results
    (info, tasks, simulations): the simulated user's turns are the environment's and render as user
    turns; a ReAct agent's actions are calls read from its text (rendered once, as written) and the
    next "API output:" turn their result; the orchestrator's greeting is the harness's; the user's
    own device calls stay out of the agent's steps; the reward is the verdict; τ²'s max_steps a
    budget; the domain and the model come from the policy heading, the file name or the run's info."""
    from trajwh.fragments.outcomes import classify_outcome
    from trajwh.packing.render import model_content, role_of

    src = cases / "tau_bench"
    assert {f.name: detect(str(f), read_head(f)).name for f in src.rglob("*.json")
            if detect(str(f), read_head(f)).name != "tau-bench"} == {
        "results.json": "tau2-results", "0b7e2f6c-4a11-4f0e-9b9d-6d2c1a7e3333.json": "tau2-simulation"}
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tool-calling-x-0.0_range_0-1_user-y-llm_0101010101.json").write_text(json.dumps(
        [{"task_id": 1, "reward": 1.0, "info": {}, "traj": [{"role": "user", "content": "hi"}], "trial": 0},
         {"task_id": 2, "reward": 0.0, "info": {}, "trial": 0}]))
    s = ingest_paths(wh, [src, bad], IngestOptions(source="tau"))
    assert (s.n_new, s.n_quarantined) == (5, 1)
    [q] = rows(wh, "SELECT reason FROM quarantine")
    assert "row 1: expected a τ-bench result" in q["reason"]
    normalize_warehouse(wh, run_id="t")
    eps = {e["source_episode_id"]: e for e in rows(
        wh, "SELECT source_episode_id, task_id, task_text, policy_name, harness_name, resolved, reward, attempt, "
            "exit_status, termination_reason, verifier_name, tokens_in, tokens_out, cost_usd, trajectory_key, "
            "tool_schema_digest FROM episodes")}
    run = "tool-calling-gpt-4o-0.0_range_0-2_user-gpt-4o-llm_1205143010"
    ok, wrong = eps[f"{run}/3#0"], eps[f"{run}/3#1"]
    assert (ok["task_id"], ok["policy_name"], ok["harness_name"], ok["resolved"], ok["attempt"], ok["verifier_name"]) == (
        "retail/3", "gpt-4o", "tau-bench", True, 0, "tau-bench:retail")
    assert ok["task_text"].startswith("You are Yusuf Rossi")  # the user's hidden instruction, not their first words
    assert (wrong["resolved"], wrong["attempt"], classify_outcome(wrong, []).cause) == (False, 1, "tests_failed")
    # a run that raised (here the model's rate limit) recorded reward 0 and no conversation: no verdict, not the policy's
    raised = eps[f"{run}/4#0"]
    assert (raised["resolved"], raised["reward"], raised["exit_status"]) == (None, None, "error")
    assert raised["termination_reason"].startswith("provider quota") and classify_outcome(raised, []).cause == "resource_exhausted"

    def steps_of(ep):
        return rows(wh, "SELECT step_id, author, role, text, observation, tool_calls, tool_call_id, action_kind, metadata "
                        "FROM steps WHERE trajectory_key = ? ORDER BY step_index", [ep["trajectory_key"]])

    got = steps_of(ok)
    assert [(x["author"], x["role"]) for x in got] == [
        ("harness", "system"), ("environment", "user"), ("model", "assistant"), ("environment", "tool"),
        ("model", "assistant"), ("environment", "user")]
    assert got[3]["tool_call_id"] == got[2]["tool_calls"][0]["id"] == "call_kQ1"
    assert orjson.loads(got[1]["metadata"])["simulated_user"] and role_of(got[1]) == "user" and role_of(got[3]) == "tool"
    # a ReAct agent: actions in its text, results as "API output:" user turns, "respond" talks to the user
    react = eps["react-claude-3-5-sonnet-20240620-0.0_range_0--1_user-gpt-4o-llm_1207091500/12#0"]
    assert (react["task_id"], react["policy_name"], react["resolved"]) == ("airline/12", "claude-3-5-sonnet-20240620", False)
    got = steps_of(react)
    assert [(x["author"], x["role"]) for x in got] == [
        ("harness", "system"), ("environment", "user"), ("model", "assistant"), ("environment", "tool"),
        ("model", "assistant"), ("environment", "user"), ("model", "assistant"), ("environment", "tool")]
    assert [c["name"] for c in got[2]["tool_calls"]] == ["get_reservation_details"] and not got[4]["tool_calls"]
    assert got[3]["tool_call_id"] == got[2]["tool_calls"][0]["id"] and got[3]["observation"].startswith('{"reservation_id"')
    assert got[7]["observation"] == "Transfer successful"
    assert [special for _, special in model_content(got[2])] == [None]  # the action is written once: in the text
    assert [special for _, special in model_content(steps_of(ok)[2])] == ["<tool_call>"]  # a native call stays a call
    # τ²-bench: one run's results, two simulations
    done, cut = eps["5f0c2b9e-1d2a-4c51-9a07-3b8e51f0a111"], eps["9d41e7aa-7c0e-4f0b-8a55-0c2f6f9b2222"]
    assert (done["task_id"], done["policy_name"], done["harness_name"], done["resolved"], done["exit_status"]) == (
        "telecom/[roaming_disabled]airplane_mode_on", "gpt-4.1", "tau2-bench", True, "user_stop")
    assert (done["tokens_in"], done["tokens_out"], done["cost_usd"]) == (6800, 73, 0.0312)
    assert "reason_for_call: Your phone has no mobile data in France." in done["task_text"]
    [tools] = rows(wh, "SELECT tool_names FROM tool_schemas WHERE tool_schema_digest = ?", [done["tool_schema_digest"]])
    assert tools["tool_names"] == ["get_customer_by_phone", "enable_roaming"]
    got = steps_of(done)
    assert [(x["author"], x["role"]) for x in got] == [
        ("harness", "system"), ("harness", "assistant"), ("environment", "user"), ("model", "assistant"),
        ("environment", "tool"), ("model", "assistant"), ("environment", "tool"), ("model", "assistant"),
        ("environment", "user")]
    assert got[0]["text"].startswith("# Telecom Agent Policy") and got[1]["text"] == "Hi! How can I help you today?"
    assert orjson.loads(got[6]["metadata"])["is_error"] is True
    # the user's own tool call and its result, which the agent never saw: no step, kept with the user's next message
    [call, result] = orjson.loads(got[8]["metadata"])["user_device_actions"]
    assert call["call"]["name"] == "toggle_airplane_mode" and got[8]["text"].startswith("I turned airplane mode off")
    assert result["result"] == {"id": "call_U1", "content": "Airplane mode is now OFF.", "error": False}
    assert (cut["resolved"], cut["attempt"], cut["exit_status"]) == (False, 1, "max_steps")
    assert classify_outcome(cut, []).cause == "budget_exhausted"
    # a run saved as a folder: results.json (info and tasks, a companion) and a file per simulation
    alone = eps["0b7e2f6c-4a11-4f0e-9b9d-6d2c1a7e3333"]
    assert (alone["task_id"], alone["policy_name"], alone["verifier_name"], alone["exit_status"]) == (
        "retail/7", "claude-sonnet-4-20250514", "tau2-bench:retail", "agent_error")
    assert alone["task_text"].startswith("You are Noah Brown") and classify_outcome(alone, []).cause == "harness_crash"
    assert [(x["author"], x["role"]) for x in steps_of(alone)] == [
        ("harness", "system"), ("harness", "assistant"), ("environment", "user")]


def test_goose_sessions(wh, tmp_path, cases):
    """Goose sessions, as the JSON lines it kept (a metadata line, then messages) and as an export:
    the person's text is human (text written for the agent alone the harness's), tool requests are
    calls (classified by the tool's name without its extension), tool responses the environment's
    (what only the person saw left out, errors flagged), a call Goose could not read kept so its
    error answers it, thinking as reasoning, and running out of context a budget."""
    from trajwh.fragments.outcomes import classify_outcome

    src = cases / "goose"
    assert {detect(str(f), read_head(f)).name for f in src.iterdir()} == {"goose"}
    ingest_paths(wh, [src], IngestOptions(source="goose"))
    normalize_warehouse(wh, run_id="t")
    eps = {e["source_episode_id"]: e for e in rows(
        wh, "SELECT source_episode_id, task_text, exit_status, termination_reason, tokens_in, tokens_out, started_at, "
            "ended_at, trajectory_key, metadata FROM episodes")}
    lines, export = eps["20250110_143000"], eps["20250301_7"]
    assert (lines["tokens_in"], lines["tokens_out"], lines["exit_status"]) == (17400, 800, "context_length_exceeded")
    assert lines["task_text"].startswith("parse_header drops the last column")
    assert orjson.loads(lines["metadata"])["working_dir"] == "/home/dev/csvkit"
    assert classify_outcome(lines, []).cause == "budget_exhausted"
    steps = rows(wh, "SELECT author, action_kind, action_object, tool_calls, tool_call_id, observation, metadata FROM steps "
                     "WHERE trajectory_key = ? ORDER BY step_index", [lines["trajectory_key"]])
    assert [(x["author"], x["action_kind"], x["tool_call_id"]) for x in steps] == [
        ("human", None, None), ("model", "read", None), ("environment", None, "toolu_01"), ("model", "other", None),
        ("environment", None, "toolu_02"), ("model", "test", None), ("environment", None, "toolu_03"), ("harness", None, None)]
    assert steps[1]["action_object"] == "/home/dev/csvkit/csvkit/header.py"
    assert orjson.loads(steps[1]["metadata"])["reasoning"] == "Look at the parser first."
    assert "header.py shown" not in steps[2]["observation"]  # the person's text alone, not the model's
    assert steps[3]["tool_calls"][0]["name"] == "invalid_tool_call" and orjson.loads(steps[4]["metadata"])["is_error"]
    assert not any("call_missing" in (x["metadata"] or "") for x in steps)
    # the export: its own id and times, a message the agent alone saw is the harness's
    assert (export["started_at"].isoformat(), export["tokens_in"]) == ("2025-03-01T09:00:00+00:00", 1900)
    got = rows(wh, "SELECT author, action_kind, observation FROM steps WHERE trajectory_key = ? ORDER BY step_index",
               [export["trajectory_key"]])
    assert [(x["author"], x["action_kind"]) for x in got] == [
        ("human", None), ("harness", None), ("model", "edit"), ("environment", None), ("model", None)]
    assert got[3]["observation"] == "The file /home/dev/site/static/logo.svg has been edited"


def test_harbor_trial_results_give_atif_trajectories_their_verdict(wh, cases):
    """A Harbor job (Terminal-Bench 2): each trial's result.json is a companion of the ATIF
    trajectory in its agent/ folder: the verifier's reward is the verdict, the agent's tokens and
    cost and the trial's times fill what the trajectory lacks, and the exception that ended the
    trial (an agent timeout: a budget) is the termination. A model call's LiteLLM log beside them
    is kept, never read as an episode."""
    from trajwh.fragments.outcomes import classify_outcome

    src = cases / "harbor"
    trials = src / "2025-11-20__10-00-00"
    got = {str(f.relative_to(trials)): detect(str(f), read_head(f)).name for f in trials.rglob("*.*")}
    kept = {"hello-world__abc123/agent/episode-0/prompt.txt", "hello-world__abc123/agent/episode-0/response.txt",
            "hello-world__abc123/verifier/reward.txt", "hello-world__abc123/trial.log", "hello-world__abc123/config.json",
            "config.json", "result.json"}  # the job's config and its result (counts), the trial's config and log
    assert {k for k, v in got.items() if v == "harbor-trial-file"} == kept
    assert {v for k, v in got.items() if k not in kept} == {"harbor-trial-result", "atif", "litellm-call-log"}
    s = ingest_paths(wh, [src], IngestOptions(source="harbor"))
    summary = normalize_warehouse(wh, run_id="t")
    # a model call's log (Terminus' episode-0/debug.json), its prompt and response, the verifier's reward file,
    # the logs and configurations are kept, not read as partial conversations nor quarantined as unknown
    assert (s.n_new, s.n_quarantined, summary.companions) == (12, 0, 10)
    assert rows(wh, "SELECT count(*) AS n FROM episodes") == [{"n": 2}]
    eps = {e["task_id"]: e for e in rows(
        wh, "SELECT task_id, resolved, reward, verifier_name, exit_status, termination_reason, tokens_in, tokens_out, "
            "cost_usd, started_at, ended_at FROM episodes")}
    ok, timed_out = eps["hello-world"], eps["fix-permissions"]
    assert (ok["resolved"], ok["reward"], ok["verifier_name"], ok["exit_status"]) == (True, 1.0, "harbor:terminal-bench", None)
    assert (ok["tokens_in"], ok["tokens_out"], ok["cost_usd"]) == (5120, 410, 0.021)
    assert (ok["ended_at"] - ok["started_at"]).total_seconds() == 190
    assert (timed_out["resolved"], timed_out["reward"], timed_out["exit_status"]) == (False, 0.0, "error")
    assert timed_out["termination_reason"].startswith("AgentTimeoutError: Agent execution timed out")
    assert classify_outcome(timed_out, []).cause == "budget_exhausted"


def test_an_agents_own_logs_beside_harbors_trajectory_are_kept_not_read_again(wh, tmp_path, cases):
    """A Harbor trial's agent/ folder holds the run as Harbor's ATIF trajectory.json and again as the
    agent's own logs (Claude Code's stream-json claude-code.txt and its sessions/ files): with the
    trajectory beside them they are kept, so the trial is one episode, not three. A trial without
    trajectory.json (an agent Harbor does not convert) has its logs read."""
    import shutil

    src = tmp_path / "job"
    shutil.copytree(cases / "harbor" / "2025-11-20__10-00-00", src)
    stream = (cases / "claude_headless" / "stream.jsonl").read_bytes()
    session = (cases / "claude" / "5b1f0c2e-7a41-4c55-9d0e-1a2b3c4d5e6f.jsonl").read_bytes()
    agent = src / "fix-permissions__d41e07" / "agent"
    (agent / "claude-code.txt").write_bytes(stream)
    (agent / "sessions" / "projects" / "-app").mkdir(parents=True)
    (agent / "sessions" / "projects" / "-app" / "5b1f0c2e-7a41-4c55-9d0e-1a2b3c4d5e6f.jsonl").write_bytes(session)
    bare = src / "no-trajectory__e5f6a7" / "agent"  # Harbor did not convert this agent's run
    bare.mkdir(parents=True)
    (bare.parent / "result.json").write_bytes((src / "fix-permissions__d41e07" / "result.json").read_bytes().replace(
        b"fix-permissions__d41e07", b"no-trajectory__e5f6a7"))
    (bare / "claude-code.txt").write_bytes(stream.replace(b"9a1b2c3d-0000", b"9a1b2c3d-1111"))  # another run
    names = {str(f.relative_to(src)): detect(str(f), read_head(f)).name for f in src.rglob("*.*")}
    assert names["fix-permissions__d41e07/agent/claude-code.txt"] == "harbor-agent-log"
    assert names["fix-permissions__d41e07/agent/sessions/projects/-app/5b1f0c2e-7a41-4c55-9d0e-1a2b3c4d5e6f.jsonl"] \
        == "harbor-agent-log"
    assert names["no-trajectory__e5f6a7/agent/claude-code.txt"] == "claude-code"
    assert names["fix-permissions__d41e07/agent/trajectory.json"] == "atif"
    s = ingest_paths(wh, [src], IngestOptions(source="harbor"))
    normalize_warehouse(wh, run_id="t")
    assert (s.n_new, s.n_quarantined) == (16, 0)
    assert sorted(r["format"] for r in rows(wh, "SELECT format FROM episodes")) == ["atif", "atif", "claude-code"]


def test_qwen_code_sessions(wh, tmp_path, cases):
    """Qwen Code's session lines share Claude Code's keys (uuid, parentUuid, sessionId, type) but
    hold Gemini-style messages (role and parts): read as Claude Code they were empty messages. They
    are read as Qwen Code: the branch that ends at the last record (a rewound branch and a subagent's
    records left out, counted), calls and their results by id (a failed one flagged), thinking as
    reasoning, a chat compression as the harness's step, tokens summed. A file whose lines look like
    Claude Code's but hold no Claude message is quarantined, never read as empty steps."""
    src = cases / "qwen_code"
    [f] = src.iterdir()
    assert detect(str(f), read_head(f)).name == "qwen-code"
    odd = tmp_path / "odd" / "9e8d7c6b-0000-4000-8000-000000000000.jsonl"
    odd.parent.mkdir()
    odd.write_text(json.dumps({"uuid": "x", "parentUuid": None, "sessionId": "s", "type": "user",
                               "message": {"parts": [{"text": "hi"}]}}) + "\n")
    assert detect(str(odd), read_head(odd)).name == "claude-code"
    s = ingest_paths(wh, [src, odd.parent], IngestOptions(source="qwen"))
    assert (s.n_new, s.n_quarantined) == (1, 1)
    [q] = rows(wh, "SELECT reason FROM quarantine")
    assert "no user or assistant line holds a Claude message" in q["reason"]
    normalize_warehouse(wh, run_id="t")
    [ep] = rows(wh, "SELECT source_episode_id, harness_name, harness_version, policy_name, task_text, tokens_in, tokens_out, "
                    "trajectory_key, metadata FROM episodes")
    assert (ep["source_episode_id"], ep["harness_name"], ep["harness_version"], ep["policy_name"]) == (
        "3c2b1a09-5e4d-4f3a-9b2c-1d0e9f8a7b6c", "qwen-code", "0.0.11", "qwen3-coder-plus")
    assert ep["task_text"].startswith("csvcut drops the last column") and (ep["tokens_in"], ep["tokens_out"]) == (17500, 80)
    meta = orjson.loads(ep["metadata"])
    assert (meta["records_off_branch"], meta["sidechain_records"], meta["system_records"]) == (
        1, 1, {"rewind": 1, "chat_compression": 1})
    got = rows(wh, "SELECT author, action_kind, text, observation, tool_call_id, metadata FROM steps "
                   "WHERE trajectory_key = ? ORDER BY step_index", [ep["trajectory_key"]])
    assert [(x["author"], x["action_kind"], x["tool_call_id"]) for x in got] == [
        ("human", None, None), ("model", "search", None), ("environment", None, "call_a"), ("model", "read", None),
        ("environment", None, "call_c"), ("harness", None, None), ("model", None, None)]
    assert orjson.loads(got[1]["metadata"])["reasoning"] == "I should find where the header is split."
    assert got[1]["text"] == "Let me search for the header parser."  # the thought is not the model's text
    assert orjson.loads(got[4]["metadata"])["is_error"] and got[4]["observation"].startswith("File not found")
    assert not any("rm -rf" in (x["text"] or "") + (x["observation"] or "") for x in got)  # the rewound branch


def test_claude_code_headless_stream(wh, tmp_path, cases):
    """A headless Claude Code run (stream-json): the init line names the model and tools (not a step),
    a streamed message's tokens are counted once at their largest, a subagent's messages carry the Task
    call's id, and the result line ends the run (out of turns: a budget) with its cost. The same
    messages as one JSON array (claude-code-action's execution log) give the same episode."""
    src = cases / "claude_headless" / "stream.jsonl"
    assert detect(str(src), read_head(src)).name == "claude-code"
    lines = [json.loads(x) for x in src.read_text().splitlines() if x.strip()]
    (tmp_path / "array").mkdir()
    (tmp_path / "array" / "claude-execution-output.json").write_text(json.dumps(lines, indent=2))
    got = []
    for n, path in enumerate((src, tmp_path / "array" / "claude-execution-output.json")):
        w = Warehouse(tmp_path / f"wh{n}")
        ingest_paths(w, [path], IngestOptions(source="cases"))
        normalize_warehouse(w, run_id="t")
        [ep] = rows(w, "SELECT source_episode_id, policy_name, harness_version, exit_status, termination_reason, "
                       "cost_usd, tokens_in, tokens_out, metadata, trajectory_key FROM episodes")
        steps = rows(w, "SELECT author, action_kind, tool_call_id, tokens_out, metadata FROM steps "
                        "WHERE trajectory_key = ? ORDER BY step_index", [ep["trajectory_key"]])
        got.append((ep, steps))
    (ep, steps), (ep2, steps2) = got
    assert ep == ep2 and steps == steps2
    assert (ep["source_episode_id"], ep["policy_name"], ep["harness_version"]) == (
        "9a1b2c3d-0000-4e5f-8a9b-0c1d2e3f4a5b", "claude-sonnet-4-5-20250929", "2.0.14")
    assert ep["exit_status"] == "error_max_turns" and ep["termination_reason"].startswith("max turns reached (4 turns)")
    assert (ep["cost_usd"], ep["tokens_out"]) == (0.0412, 88 + 61 + 40)
    meta = orjson.loads(ep["metadata"])
    assert meta["headless"] and "Bash" in meta["tools"] and meta["num_turns"] == 4
    assert [(s["author"], s["action_kind"], s["tool_call_id"]) for s in steps] == [
        ("model", None, None), ("model", "test", None), ("environment", None, "toolu_01B"), ("model", "other", None),
        ("model", "search", None), ("environment", None, "toolu_01F"), ("environment", None, "toolu_01D")]
    assert steps[0]["tokens_out"] == 88 and orjson.loads(steps[4]["metadata"])["parent_tool_use_id"] == "toolu_01D"
    from trajwh.fragments.outcomes import classify_outcome

    assert classify_outcome({"exit_status": ep["exit_status"], "termination_reason": ep["termination_reason"]},
                            []).cause == "budget_exhausted"


def test_codex_exec_json_stream(wh, tmp_path, cases):
    """A headless Codex run (codex exec --json): each item read once in its completed state (a run cut
    short keeps an item's last state), commands as shell calls with their output and exit code (a
    command wrapped in bash -lc classified by what it runs), a file change an edit of its paths, an
    MCP tool's result, reasoning on the model's next step, tokens from the turns."""
    src = cases / "codex_exec" / "codex-exec.jsonl"
    assert detect(str(src), read_head(src)).name == "codex-exec"
    ingest_paths(wh, [src], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="t")
    [ep] = rows(wh, "SELECT source_episode_id, exit_status, tokens_in, tokens_out, metadata, trajectory_key FROM episodes")
    assert (ep["source_episode_id"], ep["exit_status"], ep["tokens_in"], ep["tokens_out"]) == (
        "0199a213-81c0-7800-8aa1-bbab2a035a53", "completed", 24763, 122)
    steps = rows(wh, "SELECT author, action_kind, action_object, tool_call_id, exit_code, observation, metadata FROM steps "
                     "WHERE trajectory_key = ? ORDER BY step_index", [ep["trajectory_key"]])
    assert [(s["author"], s["action_kind"], s["tool_call_id"], s["exit_code"]) for s in steps] == [
        ("model", "test", None, None), ("environment", None, "item_1", 1), ("model", None, None, None),
        ("model", "edit", None, None), ("environment", None, "item_3", None), ("model", "search", None, None),
        ("environment", None, "item_4", None), ("model", "test", None, None), ("environment", None, "item_5", 0),
        ("model", None, None, None)]
    assert steps[0]["action_object"] == "pytest -q tests/test_price.py" and steps[3]["action_object"] == "/work/price.py"
    assert orjson.loads(steps[0]["metadata"])["reasoning"].startswith("**Checking")
    assert orjson.loads(steps[1]["metadata"])["is_error"] and steps[6]["observation"] == "round() uses banker's rounding."
    # a run cut short: the command never completed, the turn failed
    cut = [x for x in src.read_text().splitlines() if x.strip()][:4]
    cut.append('{"type":"turn.failed","error":{"message":"stream disconnected before completion"}}')
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "run.jsonl").write_text("\n".join(cut) + "\n")
    w = Warehouse(tmp_path / "wh-cut")
    ingest_paths(w, [tmp_path / "cut"], IngestOptions(source="cases"))
    normalize_warehouse(w, run_id="t")
    [e2] = rows(w, "SELECT exit_status, termination_reason, trajectory_key FROM episodes")
    assert (e2["exit_status"], e2["termination_reason"]) == ("turn_failed", "stream disconnected before completion")
    got = rows(w, "SELECT author, tool_call_id FROM steps WHERE trajectory_key = ? ORDER BY step_index",
               [e2["trajectory_key"]])
    assert got == [{"author": "model", "tool_call_id": None}]  # the call made, no result (still in progress)
