"""Outcome taxonomy, task statistics and fragment selection."""

from __future__ import annotations

import itertools
from collections import Counter
from math import comb

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import trajwh.fragments.layer as layer
from conftest import SHARED_CORPUS
from test_incremental import rows
from trajwh.dedup.layer import curate_warehouse
from trajwh.fragments import select as select_mod
from trajwh.fragments.layer import build_fragments
from trajwh.fragments.outcomes import classify_outcome
from trajwh.fragments.rates import interaction
from trajwh.fragments.task_stats import pass_at_k, pass_hat_k, task_statistics
from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse
from trajwh.redaction.layer import redact_warehouse


def _build(wh, paths, source):
    ingest_paths(wh, paths, IngestOptions(source=source))
    normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="r")
    curate_warehouse(wh, run_id="c")
    build_fragments(wh, run_id="f")
    return wh


@pytest.fixture(scope="module")
def synth_wh(tmp_path_factory, small_corpus):
    return _build(Warehouse(tmp_path_factory.mktemp("frag") / "wh"), [small_corpus], "synthetic")


def _truth(small_corpus):
    return [orjson.loads(x) for x in (small_corpus / ".truth" / "labels.jsonl").read_bytes().splitlines()]


def _keys(wh):
    return {r["source_episode_id"]: r["trajectory_key"] for r in
            wh.query("SELECT source_episode_id, trajectory_key FROM episodes").to_pylist()}


def test_every_episode_gets_the_planted_cause(synth_wh, small_corpus):
    key = _keys(synth_wh)
    got = {r["trajectory_key"]: r for r in synth_wh.query("SELECT * FROM outcomes").to_pylist()}
    truth = _truth(small_corpus)
    assert len(got) == len(truth)
    wrong = [(t["cause"], got[key[t["episode_id"]]]["cause"]) for t in truth if got[key[t["episode_id"]]]["cause"] != t["cause"]]
    assert wrong == []
    for r in got.values():
        assert r["policy_failure"] == (r["cause"] in ("model_gave_up", "budget_exhausted", "tests_failed"))
        assert r["quarantined"] == (r["cause"] in ("harness_crash", "environment_failure", "resource_exhausted",
                                                   "verifier_unavailable", "unknown"))
        assert r["cause"] == "resolved" or r["evidence"]


def test_planted_segments_are_selected_and_nothing_else(synth_wh, small_corpus):
    key = _keys(synth_wh)
    outcomes = {r["trajectory_key"]: r for r in synth_wh.query("SELECT * FROM outcomes").to_pylist()}
    frags = synth_wh.query("SELECT * FROM fragments").to_pylist()
    by_key: dict[str, list] = {}
    for f in frags:
        by_key.setdefault(f["trajectory_key"], []).append(f)
    split = {r["trajectory_key"]: r["split"] for r in synth_wh.query("SELECT trajectory_key, split FROM splits").to_pylist()}
    leaked = {r["trajectory_key"] for r in synth_wh.query(
        "SELECT DISTINCT trajectory_key FROM leak_flags WHERE kind <> 'fix_after_cutoff'").to_pylist()}
    planted, withheld = set(), Counter()
    for t in _truth(small_corpus):
        k = key[t["episode_id"]]
        o = outcomes[k]
        if split[k] != "train" or k in leaked:  # evaluation, held-out and leak-flagged episodes never train
            assert k not in by_key
            withheld["leak" if k in leaked else split[k]] += 1
            continue
        if o["cause"] == "resolved":
            assert [f["kind"] for f in by_key[k]] == ["full_episode"]
            continue
        if o["quarantined"]:
            assert k not in by_key  # infrastructure failures never feed training
            continue
        for seg in t["segments"]:
            planted.add((k, seg["kind"], seg["end_step"]))
            assert any(f["kind"] == seg["kind"] and f["end_step"] == seg["end_step"] and f["start_step"] <= seg["start_step"]
                       for f in by_key.get(k, [])), (t["episode_id"], seg)
            if seg["kind"] == "recovery":  # the span starts at the diagnosis: the mistake is context, never loss
                f = next(f for f in by_key[k] if f["kind"] == "recovery" and f["end_step"] == seg["end_step"])
                assert f["start_step"] == seg["start_step"] > seg["anomaly_step"] > seg["mistake_step"]
                phases = orjson.loads(f["phases"])
                assert set(phases) == {"mistake", "anomaly", "diagnosis", "recovery", "reverification"}
                assert set(phases["mistake"] + phases["anomaly"]) <= set(f["context_step_ids"])
                assert not set(phases["mistake"] + phases["anomaly"]) & set(f["span_step_ids"])
    extra = [(f["trajectory_key"], f["kind"], f["end_step"]) for f in frags if f["kind"] != "full_episode"]
    assert set(extra) <= planted and Counter(k for _, k, _ in extra)["recovery"] > 0
    assert withheld["leak"] > 0 and withheld["valid"] + withheld["test"] > 0  # the corpus plants both
    for f in frags:
        assert f["step_ids"] and f["split"] == "train" and f["leak_kinds"] == [] and 0 < f["dedup_weight"] <= 1
        assert f["context_start"] <= f["start_step"] <= f["end_step"]
        assert f["step_ids"] == f["context_step_ids"] + f["span_step_ids"]
        assert f["evidence_source"] in ("verifier", "agent_visible_tests") and 0 < f["confidence"] <= 0.95


def test_fragments_carry_the_task_and_the_localization_of_what_they_edit(synth_wh):
    """Figure: every productive and recovery fragment has the task statement and the searches /
    reads of the files its span edits as masked context (the synthetic agents localize first)."""
    frags = synth_wh.query("SELECT * FROM fragments WHERE kind IN ('productive', 'recovery')").to_pylist()
    assert frags
    for f in frags:
        reasons = list(orjson.loads(f["context_reasons"]).values())
        assert "task statement" in reasons and "system prompt" in reasons, f["fragment_id"]
        assert any(r.startswith("localization: read of") for r in reasons), (f["fragment_id"], reasons)
        assert f["context_chars"] <= 48_000 or f["context_dropped"]


def test_vectors_not_counts_decide_productive():
    def run(i, passing, failing):
        return {"step_index": i, "author": "environment", "test_results":
                [{"name": n, "status": "passed"} for n in passing] + [{"name": n, "status": "failed"} for n in failing]}

    model = [{"step_index": i, "author": "model"} for i in (1, 3)]
    steps = sorted(model + [run(0, ["fragile"], ["k1", "k2", "k3"]), run(2, ["k1", "k2", "k3"], ["fragile"])],
                   key=lambda s: s["step_index"])
    frags = select_mod.select_fragments({"trajectory_key": "x"}, steps, "tests_failed", False)
    assert [(f.kind, f.context_start, f.start, f.end) for f in frags] == [("productive", 0, 1, 2)]
    steps = sorted(model + [run(0, ["k1", "k2"], ["k3"]), run(2, ["k3"], ["k1", "k2"])], key=lambda s: s["step_index"])
    assert [f for f in select_mod.select_fragments({"trajectory_key": "x"}, steps, "tests_failed", False)
            if f.kind == "productive"] == []


def test_fragment_ids_change_with_the_rules(monkeypatch):
    f = select_mod.Fragment("k", "productive", 0, 1, 2, "agent_visible_tests", 0.5, "r")
    before = f.fragment_id
    monkeypatch.setattr(select_mod, "RULES_VERSION", "9.9.9")
    assert f.fragment_id != before


def test_pass_at_k_and_pass_hat_k_are_unbiased_estimators():
    for n, c, k in itertools.product(range(1, 8), range(0, 8), (1, 3, 5)):
        if c > n or k > n:
            continue
        subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
        assert pass_hat_k(n, c, k) == pytest.approx(sum(all(s) for s in subsets) / len(subsets))
    assert pass_at_k(2, 1, 3) is None and pass_hat_k(2, 2, 5) is None
    assert comb(5, 3) == 10  # sanity of the combinatorics the estimators rest on


def test_task_statistics_posterior_and_all_fail_classes():
    rows = ([{"task_id": "easy", "cause": "resolved", "policy_name": "p"}] * 8 +
            [{"task_id": "easy", "cause": "tests_failed", "policy_name": "p"}] * 2 +
            [{"task_id": "hard", "cause": "tests_failed", "policy_name": "p"}] * 5 +
            [{"task_id": "broken", "cause": "environment_failure", "policy_name": "p"}] * 4 +
            [{"task_id": "broken", "cause": "tests_failed", "policy_name": "p"}] +
            [{"task_id": "ref", "cause": "tests_failed", "policy_name": "p"}] * 2 +
            [{"task_id": "ref", "cause": "tests_failed", "policy_name": "reference-solution"}] +
            [{"task_id": "teach", "cause": "tests_failed", "policy_name": "p"}] * 2 +
            [{"task_id": "teach", "cause": "tests_failed", "policy_name": "teacher-omega"}] * 2 +
            [{"task_id": "solvable", "cause": "tests_failed", "policy_name": "p"}] * 3 +
            [{"task_id": "solvable", "cause": "resolved", "policy_name": "strong"}])
    stats = {(r["task_id"], r["policy_name"]): r for r in task_statistics(rows) if r["level"] == "task_policy"}
    easy = stats[("easy", "p")]
    assert (easy["attempts"], easy["successes"]) == (10, 8)
    assert easy["posterior_mean"] == pytest.approx(9 / 12) and easy["posterior_low"] < 0.75 < easy["posterior_high"]
    assert stats[("hard", "p")]["all_fail"] == "too_hard"
    assert stats[("broken", "p")]["all_fail"] == "likely_broken" and stats[("broken", "p")]["attempts"] == 1
    assert stats[("ref", "p")]["all_fail"] == "likely_broken"  # the reference solution fails too
    assert stats[("teach", "p")]["all_fail"] == "too_hard"  # a teacher's failed rollout is not a reference solution
    assert stats[("solvable", "p")]["all_fail"] == "usable_hard" and "strong" in stats[("solvable", "p")]["all_fail_evidence"]
    assert stats[("solvable", "strong")]["all_fail"] is None
    assert easy["all_fail"] is None and easy["pass_at_1"] == pytest.approx(0.8)


def test_interaction_term_is_paired_by_task():
    rows = []
    for t in ("t1", "t2"):
        for policy, harness, ok in (("p0", "A", 0), ("p1", "A", 1), ("p0", "B", 0), ("p1", "B", 0)):
            rows.append({"task_id": t, "policy_name": policy, "harness_name": harness,
                         "cause": "resolved" if ok else "tests_failed"})
    rows.append({"task_id": "t3", "policy_name": "p1", "harness_name": "B", "cause": "resolved"})  # unpaired
    r = interaction(rows, "p0", "p1", "A", "B")
    assert r["tasks"] == 2 and r["delta"] == pytest.approx((0 - 0) - (1 - 0))


@pytest.mark.skipif(not SHARED_CORPUS.is_dir(), reason=f"real corpus not found at {SHARED_CORPUS}")
def test_outcome_rules_per_real_harness_format(tmp_path):
    wh = _build(Warehouse(tmp_path / "wh"), [SHARED_CORPUS], "corpus")
    rows = wh.query("SELECT e.format, e.instance_id, o.cause FROM outcomes o JOIN episodes e USING (trajectory_key)").to_pylist()
    by = {(r["format"], r["instance_id"]): r["cause"] for r in rows}
    assert by[("openhands-output", "ponylang__ponyc-4588")] == "budget_exhausted"  # hit its iteration limit
    assert by[("mini-swe-agent", "django__django-16255")] == "resolved"
    assert by[("mini-swe-agent", "django__django-10999")] == "tests_failed"
    assert by[("swe-agent", "pydicom__pydicom-1458")] == "verifier_unavailable"  # submitted, no verdict
    # aider logs report no outcome; the one session that ends in Aider's own Python traceback is a crash; the
    # sessions that end with an error of the model's API after the model's last answer (a model id the provider
    # does not know, a wrong key, missing credentials; a 429 quota) are the infrastructure's, not the policy's
    assert Counter(r["cause"] for r in rows if r["format"] == "aider") == {
        "unknown": 23, "environment_failure": 5, "resource_exhausted": 2, "harness_crash": 1}
    # no unknown outcome is counted as a failed attempt (chat sessions have no verdict)
    stats = wh.query("SELECT * FROM task_stats WHERE level = 'task_policy'").to_pylist()
    counted = wh.query("SELECT count(*) AS n FROM outcomes WHERE cause NOT IN ('unknown', 'harness_crash', "
                       "'environment_failure', 'resource_exhausted', 'verifier_unavailable')").to_pylist()[0]["n"]
    assert sum(r["attempts"] for r in stats) == counted
    assert sum(r["unknown_outcomes"] for r in stats) == Counter(r["cause"] for r in rows)["unknown"] > 0
    assert not [r for r in stats if r["all_fail"] == "too_hard" and r["attempts"] == 0]


def test_classify_outcome_reads_the_harness_words():
    base = {"resolved": False, "verifier_status": None}
    assert classify_outcome({**base, "exit_status": "exit_cost"}, []).cause == "budget_exhausted"
    assert classify_outcome({**base, "exit_status": "LimitsExceeded"}, []).cause == "budget_exhausted"
    assert classify_outcome({**base, "exit_status": "exit_format"}, []).cause == "harness_crash"
    assert classify_outcome({**base, "exit_status": "exit_forfeit"}, []).cause == "model_gave_up"
    env = [{"step_index": 3, "author": "environment", "observation": "OSError: [Errno 28] No space left on device"}]
    assert classify_outcome(base, env).cause == "environment_failure"
    assert classify_outcome({"resolved": None, "exit_status": "submitted", "verifier_status": "unavailable"}, []).cause \
        == "verifier_unavailable"


def test_fragment_building_reports_its_progress(tmp_path, cases):
    """A long build is not silent: the plan's size, then one tick per episode redone."""
    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [cases / "curation"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="r")
    phases: list[str] = []
    curate_warehouse(wh, run_id="c", progress=phases.append)
    assert any("clustering" in p for p in phases)
    planned, ticks = [], []
    s = build_fragments(wh, run_id="f", progress=ticks.append, on_plan=planned.append)
    assert planned == [s.episodes] == [len(ticks)] and s.episodes == 8


def test_fragments_in_parts_equal_one_pass(tmp_path, small_corpus, monkeypatch):
    """A big rebuild deals its episodes out by key range to parts (this process and workers):
    the same rows in the three tables and the same counts as one pass, full and incremental."""
    wh = _build(Warehouse(tmp_path / "wh"), [small_corpus], "synthetic")
    tables = ("outcomes", "fragments", "task_stats")
    one = build_fragments(wh, run_id="one", full=True)
    assert len(wh.files("fragments")) == 1
    before = {t: rows(wh, t) for t in tables}
    monkeypatch.setenv("TRAJWH_WORKERS", "2")
    monkeypatch.setenv("TRAJWH_MEMORY_MB", "65536")
    monkeypatch.setattr(layer, "PARALLEL_MIN_EPISODES", 1)
    two = build_fragments(wh, run_id="two", full=True)
    assert len(wh.files("fragments")) >= 2  # one file per part at least: the parts ran
    assert {t: rows(wh, t) for t in tables} == before
    skip = ("run_id",)
    assert {k: v for k, v in two.__dict__.items() if k not in skip} == {k: v for k, v in one.__dict__.items() if k not in skip}
    # incremental: a changed split redoes some episodes, in parts, and equals a full pass
    moved_keys = wh.query("SELECT trajectory_key FROM splits WHERE split = 'train' ORDER BY 1 LIMIT 3").column(0).to_pylist()
    with wh.write_session("test") as session:
        data = wh.query("SELECT * FROM splits")
        moved = pc.if_else(pc.is_in(data.column("trajectory_key"), pa.array(moved_keys)), pa.scalar("test"),
                           data.column("split"))
        data = data.set_column(data.schema.get_field_index("split"), "split", moved)
        session.commit([session.write("splits", data)], removed=wh.files("splits"))
    part = build_fragments(wh, run_id="inc")
    assert part.rebuilt == 3
    incremental = {t: rows(wh, t) for t in tables}
    monkeypatch.setattr(layer, "PARALLEL_MIN_EPISODES", 10**9)
    build_fragments(wh, run_id="full", full=True)
    assert {t: rows(wh, t) for t in tables} == incremental
    assert incremental != before  # the moved episodes give no fragments now
