"""Issue 10's span, context, evidence and control rules on a hand-made episode built from the
design's recovery loop: run -> bad edit -> failing run -> diagnosis -> fix -> passing run."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trajwh.fragments.context import choose_context
from trajwh.fragments.select import SelectConfig, confidence, episode_evidence, select_fragments


def run(i, passing, failing, author="environment"):
    return {"step_index": i, "author": author, "role": "tool", "observation": "pytest output",
            "test_results": [{"name": n, "status": "passed"} for n in passing] +
                            [{"name": n, "status": "failed"} for n in failing]}


def model(i, kind=None, obj=None, text="", command=None):
    return {"step_index": i, "author": "model", "role": "assistant", "action_kind": kind, "action_object": obj,
            "action_command": command, "text": text}


def obs(i, text):
    return {"step_index": i, "author": "environment", "role": "tool", "observation": text}


EPISODE = [
    {"step_index": 0, "author": "harness", "role": "system", "text": "You are a coding agent."},
    {"step_index": 1, "author": "harness", "role": "user", "text": "parse_header() drops the last field"},
    model(2, "search", "parse_header", command='grep -rn "def parse_header" src/'),
    obs(3, "src/pkg/header.py:12:def parse_header(raw):"),
    model(4, "read", "src/pkg/header.py", command="cat src/pkg/header.py"),
    obs(5, "def parse_header(raw):\n    return raw.split(',')[:-1]\n"),
    model(6, "read", "README.md", command="cat README.md"),
    obs(7, "# pkg\n" + "x" * 5000),
    model(8, "test", "tests", command="pytest -q"),
    run(9, ["t_other", "t_io"], ["t_key"]),
    model(10, "edit", "src/pkg/io.py", text="Change io too."),  # the mistake
    obs(11, "Edited src/pkg/io.py"),
    model(12, "test", "tests", command="pytest -q"),
    run(13, ["t_other"], ["t_key", "t_io"]),  # the anomaly: t_io broke
    model(14, "read", "src/pkg/io.py", text="My edit broke t_io; look at it."),  # diagnosis
    obs(15, "def write(...): ..."),
    model(16, "edit", "src/pkg/io.py", text="Revert."),  # recovery
    obs(17, "Edited src/pkg/io.py"),
    model(18, "edit", "src/pkg/header.py", text="Fix the header."),
    obs(19, "Edited src/pkg/header.py"),
    model(20, "test", "tests", command="pytest -q"),
    run(21, ["t_other", "t_io", "t_key"], []),  # re-verification (and the key test passes)
]
EP = {"trajectory_key": "k", "resolved": False, "verifier_status": "ok", "test_results": [{"name": "t_key", "status": "failed"}]}


def fragments(cfg=None):
    return select_fragments(EP, EPISODE, "tests_failed", False, cfg or SelectConfig())


def test_recovery_span_starts_after_the_anomaly_and_records_its_phases():
    rec = [f for f in fragments() if f.kind == "recovery"]
    assert len(rec) == 1
    f = rec[0]
    assert (f.start, f.end) == (14, 21)
    assert f.phases == {"mistake": [10, 11], "anomaly": [12, 13], "diagnosis": [14, 15], "recovery": [16, 17, 18, 19],
                        "reverification": [20, 21]}
    ctx = choose_context(f, EPISODE, 48_000)
    assert {10: "recovery mistake", 13: "recovery anomaly"}.items() <= ctx.included.items()
    assert not [i for i in ctx.included if f.start <= i <= f.end]  # context is never in the trained span


def test_context_is_task_plus_localization_of_the_edited_files_within_budget():
    prod = [f for f in fragments() if f.kind == "productive"]
    assert [(f.start, f.end) for f in prod] == [(14, 21)]
    ctx = choose_context(prod[0], EPISODE, 48_000)
    assert ctx.included[0] == "system prompt" and ctx.included[1] == "task statement"
    assert ctx.included[2].startswith("localization: search") and ctx.included[3].startswith("localization: output")
    assert ctx.included[4] == "localization: read of src/pkg/header.py"
    assert 6 not in ctx.included and 7 not in ctx.included  # README.md is not what the span edits
    tight = choose_context(prod[0], EPISODE, 80)
    assert 0 in tight.included and 1 in tight.included  # the task statement is always kept
    assert tight.dropped and all("budget" in r for r in tight.dropped.values())


def test_rewards_keep_one_scale_per_column():
    for f in fragments():
        assert f.verdict_reward == 0.0  # the episode's verdict
        assert f.progress_score is not None and 0 < f.progress_score <= 1
        assert f.evidence_source == "agent_visible_tests"


@pytest.mark.parametrize("episode, source", [
    ({"resolved": True, "verifier_status": "ok", "test_results": [{"name": "a", "status": "passed"}] * 3}, "verifier"),
    ({"resolved": True, "verifier_name": "openhands-resolver-judge", "verifier_status": "ok"}, "llm_judge"),
    ({"resolved": True}, "agent_self_report"),
])
def test_evidence_is_named_for_what_it_is(episode, source):
    f = select_fragments({"trajectory_key": "k", **episode}, EPISODE[:2], "resolved", False)[0]
    assert f.evidence_source == source and f.verdict_reward == 1.0
    if source != "verifier":
        assert f.confidence < confidence("verifier", None)  # a judge never reaches a verifier's confidence


def test_confidence_follows_the_evidence():
    assert confidence("verifier", 3) > confidence("verifier", 1) > confidence("agent_visible_tests", 1)
    assert confidence("agent_visible_tests", 2, consistency=0.5) == pytest.approx(confidence("agent_visible_tests", 2) / 2, abs=1e-3)
    assert episode_evidence({"resolved": False, "verifier_status": "ok"}) == ("verifier", None)


def test_controls_have_the_same_length_and_are_never_trained():
    plain = fragments()
    with_controls = fragments(SelectConfig(controls=True))
    controls = [f for f in with_controls if f.kind.startswith("control_")]
    assert len(with_controls) == len(plain) + len(controls) and controls
    assert {f.kind for f in controls} <= {"control_adjacent", "control_random"}
    span = plain[0].end - plain[0].start
    assert all(f.end - f.start == span and not f.trainable for f in controls)
    assert fragments(SelectConfig(controls=True)) == with_controls  # seeded: the same every time


@st.composite
def episodes(draw):
    steps = []
    for i in range(draw(st.integers(1, 25))):
        author = draw(st.sampled_from(["model", "environment", "harness", "human"]))
        s = {"step_index": i, "author": author, "role": "assistant" if author == "model" else "tool",
             "text": draw(st.text(max_size=20)), "action_kind": draw(st.sampled_from([None, "edit", "read", "test"])),
             "action_object": draw(st.sampled_from([None, "a.py", "b.py"]))}
        if author == "environment" and draw(st.booleans()):
            s["test_results"] = [{"name": n, "status": draw(st.sampled_from(["passed", "failed"]))}
                                 for n in draw(st.lists(st.sampled_from(["t1", "t2", "t3"]), max_size=3, unique=True))]
        steps.append(s)
    return steps


@settings(max_examples=200, deadline=None)
@given(episodes(), st.sampled_from(["tests_failed", "resolved", "budget_exhausted"]), st.booleans())
def test_spans_and_context_are_well_formed_on_any_episode(steps, cause, controls):
    ep = {"trajectory_key": "k", "resolved": cause == "resolved"}
    for f in select_fragments(ep, steps, cause, False, SelectConfig(controls=controls)):
        assert 0 <= f.start <= f.end <= steps[-1]["step_index"] and 0 <= f.confidence <= 0.95
        ctx = choose_context(f, steps, 1_000)
        assert not [i for i in ctx.included if f.start <= i <= f.end]  # context never overlaps the span
        if f.kind == "recovery":
            assert not set(f.phases["mistake"] + f.phases["anomaly"]) & set(range(f.start, f.end + 1))
