"""Issue 9's taxonomy and statistics rules on hand-made cases: infrastructure is never a policy
failure, verdicts beat text heuristics, unknown is never a failure, statistics per population."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from trajwh.fragments.outcomes import INFRASTRUCTURE, POLICY_FAILURES, classify_outcome
from trajwh.fragments.rates import (
    compare_harnesses,
    effective_rates,
    interaction,
    policy_harness_matrix,
)
from trajwh.fragments.task_stats import StatsConfig, task_statistics

BASE = {"resolved": False, "verifier_status": None}


@pytest.mark.parametrize("status, cause, names", [
    ("verifier timeout after submit", "verifier_unavailable", None),
    ("evaluation timed out after 1800 s", "verifier_unavailable", None),
    ("sandbox start timeout", "environment_failure", None),
    ("TimeoutError: Sandbox failed to start within 300s", "environment_failure", None),
    ("OOMKilled", "resource_exhausted", "memory"),
    ("pod preempted by the scheduler", "resource_exhausted", "preemption"),
    ("resource_exhausted", "resource_exhausted", "quota"),
    ("No space left on device while writing the image", "resource_exhausted", "disk"),
    ("exit_cost", "budget_exhausted", None),
    ("max_steps reached (100)", "budget_exhausted", None),
    ("RuntimeError: Agent reached maximum iteration in headless mode", "budget_exhausted", None),
])
def test_infrastructure_is_never_a_policy_failure(status, cause, names):
    o = classify_outcome({**BASE, "exit_status": status}, [])
    assert o.cause == cause
    assert (cause in INFRASTRUCTURE) == o.quarantined and (cause in POLICY_FAILURES) == o.policy_failure
    if names:
        assert f"resource={names}" in o.evidence


def _obs(text: str, code: int | None) -> list[dict]:
    return [{"step_index": 0, "author": "model", "action_kind": "test"},
            {"step_index": 1, "author": "environment", "observation": text, "exit_code": code}]


def test_the_verifiers_verdict_wins_over_text_in_command_output():
    """The real case: report.json says tests failed; one pip retry line must not make it an
    environment failure. A test failing with 'Read timed out' is a failed test."""
    verdict = {"resolved": False, "verifier_status": "ok", "exit_status": "submitted",
               "test_results": [{"name": "t", "status": "failed"}]}
    pip = "WARNING: Retrying (Retry(total=4)) after connection broken by 'ReadTimeoutError(\"Read timed out.\")'"
    assert classify_outcome(verdict, _obs(pip, 0)).cause == "tests_failed"
    assert classify_outcome(verdict, _obs("E   requests.exceptions.ReadTimeout: Read timed out", 1)).cause == "tests_failed"
    # a pip retry warning in a command that exited 0 is noise even without a verdict
    assert classify_outcome({**BASE, "exit_status": "submitted"}, _obs(pip, 0)).cause == "tests_failed"
    # without a verdict, a failed command reporting an infrastructure error still is one
    no_verdict = {"resolved": None, "exit_status": "submitted"}
    assert classify_outcome(no_verdict, _obs("OSError: [Errno 28] No space left on device", 1)).cause \
        == "environment_failure"


def _rows(spec: list[tuple[str, str, str, str, int]]) -> list[dict]:
    """(task, policy, harness, cause, count) -> episode rows."""
    return [{"task_id": t, "policy_name": p, "harness_name": h, "cause": c} for t, p, h, c, n in spec for _ in range(n)]


def test_unknown_outcomes_are_never_failed_attempts():
    rows = _rows([("chat", "p", "cli", "unknown", 35), ("t", "p", "cli", "resolved", 1), ("t", "p", "cli", "unknown", 3)])
    stats = {r["task_id"]: r for r in task_statistics(rows) if r["level"] == "task_policy"}
    assert stats["chat"]["attempts"] == 0 and stats["chat"]["pass_at_1"] is None
    assert stats["chat"]["all_fail"] == "no_attempts" and stats["chat"]["unknown_outcomes"] == 35
    assert stats["t"]["attempts"] == 1 and stats["t"]["pass_at_1"] == 1.0
    assert policy_harness_matrix(rows) == {("p", "cli"): 1.0}
    eta = effective_rates(rows, "harness_name")[0]
    assert (eta["known"], eta["unknown"], eta["eta"]) == (1, 38, 1.0)


def test_statistics_per_task_and_policy_and_harness_pooled_only_on_request():
    rows = _rows([("t", "weak", "A", "tests_failed", 4), ("t", "strong", "A", "resolved", 3),
                  ("t", "strong", "B", "tests_failed", 1)])
    out = task_statistics(rows)
    levels = {(r["level"], r["policy_name"], r["harness_name"]) for r in out}
    assert levels == {("task_policy", "strong", None), ("task_policy", "weak", None),
                      ("task_policy_harness", "strong", "A"), ("task_policy_harness", "strong", "B"),
                      ("task_policy_harness", "weak", "A")}
    by = {(r["level"], r["policy_name"], r["harness_name"]): r for r in out}
    assert by[("task_policy", "strong", None)]["successes"] == 3 and by[("task_policy", "strong", None)]["attempts"] == 4
    assert by[("task_policy", "weak", None)]["all_fail"] == "usable_hard"  # the strong policy solves it
    pooled = [r for r in task_statistics(rows, StatsConfig(pooled=True)) if r["level"] == "task"]
    assert len(pooled) == 1 and pooled[0]["attempts"] == 8 and pooled[0]["all_fail"] is None


def test_recency_window_follows_a_changing_policy():
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    rows = [{"task_id": "t", "policy_name": "p", "harness_name": "A", "cause": "tests_failed",
             "started_at": t0 + timedelta(days=i)} for i in range(10)]
    rows += [{"task_id": "t", "policy_name": "p", "harness_name": "A", "cause": "resolved",
              "started_at": t0 + timedelta(days=100 + i)} for i in range(5)]
    flat = [r for r in task_statistics(rows) if r["level"] == "task_policy"][0]
    recent = [r for r in task_statistics(rows, StatsConfig(recency_half_life_days=7)) if r["level"] == "task_policy"][0]
    assert flat["posterior_mean"] == pytest.approx(6 / 17)
    assert recent["posterior_mean"] > 0.8 and recent["weighted_attempts"] < 6  # old failures barely count
    assert recent["pass_at_1"] == flat["pass_at_1"]  # pass@k stays on raw counts


def test_harness_crash_counts_against_its_harness_and_infrastructure_for_neither():
    """The issue's case: a harness that crashes on hard tasks looked twice as good. Pairs by task."""
    rows = []
    for i in range(10):
        hard = i >= 5
        rows += _rows([(f"t{i}", "p", "A", "tests_failed" if hard else "resolved", 1),
                       (f"t{i}", "p", "B", "harness_crash" if hard else "resolved", 1),
                       (f"t{i}", "p", "B", "environment_failure", 1)])
    m = policy_harness_matrix(rows)
    assert m[("p", "A")] == m[("p", "B")] == 0.5  # B's crashes count; its environment failures do not
    c = compare_harnesses(rows, "A", "B", policy="p")
    assert (c["pairs"], c["delta"], c["improved"], c["regressed"], c["unchanged"]) == (10, 0.0, 0, 0, 10)
    better = rows + _rows([(f"t{i}", "p", "B", "resolved", 3) for i in range(5, 8)])
    c = compare_harnesses(better, "A", "B", policy="p")
    assert c["improved"] == 3 and c["regressed"] == 0 and c["delta"] > 0 and c["delta_low"] <= c["delta"] <= c["delta_high"]


def test_interaction_has_a_task_level_bootstrap_interval():
    rows = []
    for i in range(6):
        rows += _rows([(f"t{i}", "p0", "A", "tests_failed", 1), (f"t{i}", "p1", "A", "resolved", 1),
                       (f"t{i}", "p0", "B", "tests_failed", 1), (f"t{i}", "p1", "B", "tests_failed", 1)])
    r = interaction(rows, "p0", "p1", "A", "B")
    assert r["tasks"] == 6 and r["delta"] == pytest.approx(-1.0) and r["delta_low"] == r["delta_high"] == pytest.approx(-1.0)


def test_effective_rate_counts_rebuild_failures_and_cost_per_effective_trajectory():
    rows = [{"harness_name": "h", "cause": "resolved", "evidence": "", "cost_usd": 1.0, "duration_s": 60.0},
            {"harness_name": "h", "cause": "tests_failed", "evidence": "", "cost_usd": 1.0, "duration_s": 60.0},
            {"harness_name": "h", "cause": "environment_failure", "evidence": "image build failed: rebuild error",
             "cost_usd": 0.5, "duration_s": 30.0},
            {"harness_name": "h", "cause": "environment_failure", "evidence": "container exited", "cost_usd": 0.5,
             "duration_s": 30.0},
            {"harness_name": "h", "cause": "unknown", "evidence": "", "cost_usd": 9.0, "duration_s": 1.0}]
    r = effective_rates(rows, "harness_name")[0]
    assert (r["rebuild_failures"], r["environment_errors"], r["eta"]) == (1, 1, 0.5)
    assert r["cost_per_effective"] == pytest.approx(3.0 / 2) and r["seconds_per_effective"] == pytest.approx(180 / 2)
