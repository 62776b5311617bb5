"""Issue 9's split and grouping rules, each on a small hand-made case built from the rule itself.

Episodes are EpisodeFeatures (the pure functions' input) except for the ssh-remote case, which
goes through ingest, normalize and redaction from tests/cases/curation/ssh_remotes.jsonl.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from trajwh.dedup.features import EpisodeFeatures
from trajwh.dedup.groups import GroupConfig, assign_groups
from trajwh.dedup.leaks import _COMMAND_RULES
from trajwh.dedup.splits import SplitConfig, assign_splits, fix_time, state_time
from trajwh.schemas.repository import normalize_repository

REPO = "github.com/acme/widgetlib"
CUTOFF = datetime(2025, 6, 1, tzinfo=UTC)


def d(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def ep(key: str, task: str, issue: str, *, fix: str | None = None, started: str | None = None,
       base_at: str | None = None, repo: str = REPO, tests: list[str] | None = None,
       files: list[str] | None = None) -> EpisodeFeatures:
    return EpisodeFeatures(key, repository=repo, task_id=task, issue_created_at=d(issue),
                           fix_merged_at=d(fix) if fix else None, started_at=d(started or issue),
                           base_commit_at=d(base_at) if base_at else None, failing_tests=tests or [],
                           touched_files=files or [])


def split_of(features, cfg=None, leaks=None):
    cfg = cfg or SplitConfig(cutoff=CUTOFF)
    groups = assign_groups(features, GroupConfig())
    rows = assign_splits(features, groups.group_of, cfg, repository_of=groups.repository_of, leaks=leaks)
    return {r.trajectory_key: r for r in rows}, groups


def train_after_eval_fix(features, rows) -> list[tuple[str, str]]:
    """The audit's rule 1 on features: (train, eval) pairs of one repository where the train
    episode's repository state is later than the evaluation task's fix."""
    by = {f.key: f for f in features}
    evals = [by[k] for k, r in rows.items() if r.split in ("valid", "test")]
    return [(k, v.key) for k, r in rows.items() if r.split == "train" for v in evals
            if by[k].repository == v.repository and state_time(by[k]) and fix_time(v)
            and state_time(by[k]) > fix_time(v)]


def test_mixed_group_post_cutoff_member_is_held_out_not_trained():
    """The issue's case: an evaluation task fixed in October; a train task of the same repository
    opened in November sits in a group that also holds 2024 tasks."""
    features = [
        ep("old", "acme__widgetlib-1", "2024-03-01", fix="2024-03-10", tests=["tests/test_io.py::test_read"]),
        ep("nov", "acme__widgetlib-9", "2025-11-02", fix="2025-11-20", tests=["tests/test_io.py::test_read"]),
        ep("eval", "acme__widgetlib-7", "2025-09-01", fix="2025-10-15", started="2025-10-20"),
        ep("spring", "acme__widgetlib-3", "2025-04-01", fix="2025-04-05"),
    ]
    rows, groups = split_of(features)
    assert groups.group_of["old"] == groups.group_of["nov"]  # the shared failing test joins them
    assert rows["eval"].split in ("valid", "test")
    assert rows["old"].split == "train" and rows["spring"].split == "train"
    assert rows["nov"].split == "held_out" and "mixed group" in rows["nov"].reason
    assert "mixed_group_post_cutoff" in rows["nov"].flags
    assert train_after_eval_fix(features, rows) == []


def test_train_state_after_an_evaluation_fix_is_held_out():
    """Issue before the cutoff, but the repository state the agent worked on (base commit time)
    is later than an evaluation task's fix: that state may contain the fix."""
    features = [
        ep("eval", "acme__widgetlib-7", "2025-09-01", fix="2025-10-15", started="2025-10-20"),
        ep("late-base", "acme__widgetlib-4", "2025-05-01", base_at="2025-11-01"),
        ep("early-base", "acme__widgetlib-5", "2025-05-02", base_at="2025-05-01"),
        ep("other-repo", "zeta__core-2", "2025-05-03", base_at="2025-12-01", repo="github.com/zeta/core"),
    ]
    rows, _ = split_of(features)
    assert rows["eval"].split in ("valid", "test")
    assert rows["late-base"].split == "held_out" and "acme__widgetlib-7" in rows["late-base"].reason
    assert rows["early-base"].split == "train" and rows["other-repo"].split == "train"
    assert train_after_eval_fix(features, rows) == []
    # without the rule the pair would exist: the check is not vacuous
    rows["late-base"].split = "train"
    assert train_after_eval_fix(features, rows) == [("late-base", "eval")]


def test_unknown_fix_time_errs_on_the_side_of_holding_out():
    features = [ep("eval", "acme__widgetlib-7", "2025-09-01", started="2025-10-20"),  # fix time unknown
                ep("t", "acme__widgetlib-4", "2025-05-01", base_at="2025-09-02")]
    rows, _ = split_of(features)
    assert rows["t"].split == "held_out"


def test_leak_flags_act_on_evaluation_splits():
    features = [ep("a", "acme__widgetlib-7", "2025-09-01", fix="2025-10-15", started="2025-10-20"),
                ep("b", "acme__widgetlib-7", "2025-09-01", fix="2025-10-15", started="2025-10-21")]
    leaks = {"b": ["future_git_history@6"]}
    rows, _ = split_of(features, leaks=leaks)
    assert rows["a"].split in ("valid", "test")
    assert rows["b"].split == "held_out" and "future_git_history" in rows["b"].reason
    kept, _ = split_of(features, cfg=SplitConfig(cutoff=CUTOFF, hold_out_leaks=False), leaks=leaks)
    assert kept["b"].split == rows["a"].split


@pytest.mark.parametrize("command, leak", [
    ("git diff > model.patch", False), ("git diff HEAD > /tmp/fix.diff && cat /tmp/fix.diff", False),
    ("git apply /tmp/test.patch", False), ("curl -sL https://github.com/acme/widgetlib/pull/88.diff", True),
    ("wget https://example.org/fix-88.patch", True), ("git log --all --oneline", True),
    ("git log --oneline -5", False), ("git fetch origin", True),
])
def test_leak_rules_tell_the_agents_own_diff_from_the_upstream_fix(command, leak):
    assert any(rule.search(command) for _, rule in _COMMAND_RULES) == leak


def test_weak_keys_do_not_chain_unrelated_tasks_into_one_group():
    """Twenty tasks of one repository each touch README.md and conftest.py and share one test
    name; each also has its own file. With the cap they are twenty groups, without it one."""
    features = [ep(f"e{i}", f"acme__widgetlib-{i}", "2025-01-01", files=["README.md", "conftest.py", f"src/m{i}.py"],
                   tests=["tests/test_smoke.py::test_import", f"tests/test_m{i}.py::test_x"]) for i in range(20)]
    features += [ep("e0-retry", "acme__widgetlib-0", "2025-01-02", files=["src/m0.py"])]  # same task: same group
    capped = assign_groups(features, GroupConfig())
    assert len(set(capped.group_of.values())) == 20
    assert capped.group_of["e0"] == capped.group_of["e0-retry"]
    assert all("weak_key_dropped" in capped.flags_of[f"e{i}"] for i in range(20))
    assert capped.dropped_keys == {"file": 2, "test": 1}
    uncapped = assign_groups(features, GroupConfig(max_key_share=1.0, max_merge_share=1.0))
    assert len(set(uncapped.group_of.values())) == 1
    merge_capped = assign_groups(features, GroupConfig(max_key_share=1.0))  # keys kept, merges bounded
    sizes = Counter(merge_capped.group_of.values())
    assert max(sizes.values()) <= 8 + 1 and len(sizes) > 1  # at most 8 tasks (+ the retry) per group
    assert "file:github.com/acme/widgetlib:README.md" in merge_capped.cut_keys


def test_weak_links_past_the_merge_cap_never_join_train_to_evaluation():
    """A weak key the merge cap left spanning groups must not join a train episode to an
    evaluation episode whose task it could have seen: the train episodes that share it and whose
    repository state is not before the evaluation task's issue are held out; a shared
    near-duplicate cluster always is."""
    core, cluster = "file:github.com/acme/widgetlib:src/core.py", "cluster:c-1"
    features = [ep("before", "acme__widgetlib-1", "2025-01-01"),  # state long before the eval issue
                ep("late", "acme__widgetlib-2", "2025-01-02", base_at="2025-09-05"),  # state after it
                ep("dup", "acme__widgetlib-3", "2025-01-03"),  # a near-duplicate of the eval episode
                ep("other", "acme__widgetlib-4", "2025-01-04"),
                ep("new", "acme__widgetlib-99", "2025-09-01", fix="2025-09-10", started="2025-09-11")]
    group_of = {"before": "g-a", "late": "g-b", "dup": "g-c", "other": "g-a", "new": "g-e"}
    keys_of = {"before": [core], "late": [core], "dup": [cluster], "other": ["file:x"], "new": [core, cluster]}
    rows = {r.trajectory_key: r for r in assign_splits(features, group_of, SplitConfig(cutoff=CUTOFF),
                                                       keys_of=keys_of, cut_keys={core, cluster})}
    assert rows["new"].split in ("valid", "test")
    assert rows["late"].split == "held_out" and "src/core.py" in rows["late"].reason
    assert rows["late"].reason.endswith("with evaluation episode new")  # its key, not a (time, key) pair
    assert rows["dup"].split == "held_out" and "weak_link_to_eval" in rows["dup"].flags
    assert rows["before"].split == rows["other"].split == "train"


def test_no_train_and_evaluation_episode_share_a_grouping_key():
    """The invariant behind groups, on a random repository where tasks share files at random
    (enough to percolate into one group without the merge cap)."""
    import random

    rng = random.Random(5)
    features, issued = [], [f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}" for _ in range(60)]
    for i in range(120):
        issue = issued[i % 60]
        files = [f"src/m{rng.randint(0, 40)}.py" for _ in range(2)]
        features.append(ep(f"e{i}", f"acme__widgetlib-{i % 60}", issue, fix=None, started="2025-12-30", files=files))
    groups = assign_groups(features, GroupConfig(max_key_share=1.0))
    assert max(Counter(groups.group_of.values()).values()) < 60  # not one giant group
    chained = assign_groups(features, GroupConfig(max_key_share=1.0, max_merge_share=1.0))
    assert max(Counter(chained.group_of.values()).values()) > 100  # without the merge cap: percolation
    rows = assign_splits(features, groups.group_of, SplitConfig(cutoff=CUTOFF), repository_of=groups.repository_of,
                         keys_of=groups.keys_of, cut_keys=groups.cut_keys)
    split = {r.trajectory_key: r.split for r in rows}
    evals = [k for k, v in split.items() if v in ("valid", "test")]
    assert evals
    by = {f.key: f for f in features}
    for t in (k for k, v in split.items() if v == "train"):
        for e in evals:
            if set(groups.keys_of[t]) & set(groups.keys_of[e]):  # only a task it could not have seen
                assert state_time(by[t]) < by[e].issue_created_at, (t, e)


def test_a_key_shared_by_a_few_tasks_still_groups_them():
    """Two tasks that edit the same uncommon file stay together (that is what groups are for)."""
    features = [ep(f"e{i}", f"acme__widgetlib-{i}", "2025-01-01", files=[f"src/m{i}.py"]) for i in range(10)]
    features[1].touched_files.append("src/m0.py")
    g = assign_groups(features, GroupConfig())
    assert g.group_of["e0"] == g.group_of["e1"] and len(set(g.group_of.values())) == 9


def test_whole_repository_puts_each_repository_in_one_group():
    features = [ep(f"e{i}", f"acme__widgetlib-{i}", "2025-01-01") for i in range(5)]
    features.append(ep("z", "zeta__core-1", "2025-01-01", repo="github.com/zeta/core"))
    g = assign_groups(features, GroupConfig(whole_repository=True))
    assert len({g.group_of[f"e{i}"] for i in range(5)}) == 1 and g.group_of["z"] != g.group_of["e0"]


def test_repository_key_survives_redaction(tmp_path, cases):
    """ssh, https, token-bearing and short spellings of one remote: one repository after
    redaction, one group (they carry no task id, so the repository is the grouping key)."""
    from trajwh.dedup.layer import curate_warehouse
    from trajwh.ingest.normalize import normalize_warehouse
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.lineage.catalog import Warehouse
    from trajwh.redaction.layer import redact_warehouse

    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [cases / "curation" / "ssh_remotes.jsonl"], IngestOptions(source="cases"))
    normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="r")
    curate_warehouse(wh, run_id="c")
    repos = wh.query("SELECT DISTINCT repository FROM redacted_episodes").to_pylist()
    assert repos == [{"repository": "github.com/acme/widgetlib"}]
    groups = wh.query("SELECT count(DISTINCT group_id) AS g, count(DISTINCT split) AS s FROM splits").to_pylist()[0]
    assert groups == {"g": 1, "s": 1}
    text = " ".join(r["t"] or "" for r in wh.query(
        "SELECT concat_ws(' ', e.metadata, s.text, list_transform(s.tool_calls, lambda c: c.arguments)::VARCHAR) AS t "
        "FROM redacted_episodes e JOIN redacted_steps s USING (trajectory_key)").to_pylist())
    assert "ghp_4f9Qx7LmN2pR8sT1vW3yZ5bC6dE9gH0jK2mN" not in text and "<GITHUB_TOKEN" in text
    assert "ops@acme-widgets.com" not in " ".join(r["task_text"] for r in wh.query(
        "SELECT task_text FROM redacted_episodes").to_pylist())  # e-mail in text is still redacted


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40), st.one_of(st.none(), st.text(max_size=20)))
@example("0//", None)  # found by the export round trip: a trailing empty segment
@example(" ", None)
@example("0@0@", None)
def test_repository_normalization_is_idempotent(url, instance_id):
    """The normalizer writes the normalized form and an export re-ingests it: it must not move."""
    once = normalize_repository(url, instance_id)
    assert normalize_repository(once, instance_id) == once


@pytest.mark.parametrize("cutoff", [CUTOFF, None], ids=["cutoff", "no-cutoff"])
def test_every_split_rule_gives_the_same_rows_on_both_engines(cutoff):
    """Issue 19: the split rules are one relational plan that DuckDB and Daft both run. A case where
    each rule acts (a mixed group's post-cutoff task, a leak-flagged evaluation episode, a file and
    a near-duplicate cluster left spanning train and evaluation, a train state later than an
    evaluation fix, unusable times, a fix after the cutoff) gives the same rows on both."""
    pytest.importorskip("daft")
    core, cluster = "file:github.com/acme/widgetlib:src/core.py", "cluster:c-1"
    features = [ep("before", "acme__widgetlib-1", "2025-01-01"),
                ep("late", "acme__widgetlib-2", "2025-01-02", base_at="2025-09-05"),
                ep("dup", "acme__widgetlib-3", "2025-01-03"),
                ep("new", "acme__widgetlib-99", "2025-09-01", fix="2025-09-10", started="2025-09-11"),
                ep("old", "acme__widgetlib-5", "2024-03-01", fix="2024-03-10"),
                ep("nov", "acme__widgetlib-6", "2025-11-02", fix="2025-11-20"),
                ep("leaky", "acme__widgetlib-7", "2025-10-01", started="2025-10-02"),
                ep("stale", "acme__widgetlib-8", "2025-01-05", base_at="2025-10-01"),
                ep("late-fix", "acme__widgetlib-10", "2025-05-01", fix="2025-07-01"),
                EpisodeFeatures("no-times", repository=REPO, task_id="acme__widgetlib-11")]
    group_of = {"before": "g-a", "late": "g-b", "dup": "g-c", "new": "g-e", "old": "g-m", "nov": "g-m",
                "leaky": "g-l", "stale": "g-s", "late-fix": "g-f", "no-times": "g-n"}
    keys_of = {"before": [core], "late": [core], "dup": [cluster], "new": [core, cluster]}
    args = {"repository_of": {f.key: f.repository for f in features}, "keys_of": keys_of,
            "cut_keys": {core, cluster}, "leaks": {"leaky": ["agent_saw_fix@3"]}}
    cfg = SplitConfig(cutoff=cutoff, valid=0.5, test=0.5, train=0.0) if cutoff is None else SplitConfig(cutoff=cutoff)
    on_duckdb = assign_splits(features, group_of, cfg, engine="duckdb", **args)
    on_daft = assign_splits(features, group_of, cfg, engine="daft", **args)
    assert on_duckdb == on_daft
    flags = {f for r in on_duckdb for f in r.flags}
    if cutoff is not None:  # every rule acted, so the comparison covers each of them
        assert {"mixed_group_post_cutoff", "leak_held_out", "weak_link_to_eval", "state_after_eval_fix",
                "no_usable_times", "fix_after_cutoff"} <= flags, flags
        by = {r.trajectory_key: r for r in on_duckdb}
        assert by["stale"].reason.startswith("held out of train: repository state 2025-10-01 is later than the fix "
                                             "of evaluation task acme__widgetlib-")
    else:  # no cutoff: every group drawn into evaluation, the leak held out
        assert "leak_held_out" in flags


@pytest.mark.parametrize("cfg", [GroupConfig(), GroupConfig(max_key_share=1.0), GroupConfig(whole_repository=True)],
                         ids=["default", "no-key-cap", "whole-repository"])
def test_groups_are_the_same_on_both_engines(cfg):
    """Issue 19: group assignment runs on the engine (weak keys dropped, strong components, the
    strong groups' tasks and eras, shared keys, names); only the capped merge walk is sequential.
    A repository whose tasks share files at random, with pre- and post-cutoff tasks and a second
    repository, gives the same groups, keys, flags, cut and dropped keys on DuckDB and Daft."""
    import random

    pytest.importorskip("daft")
    rng = random.Random(11)
    features = []
    for i in range(160):
        issue = f"{2024 + i % 2}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        repo = REPO if i % 5 else "github.com/other/thing"
        features.append(ep(f"e{i:03d}", f"acme__widgetlib-{i % 70}", issue, repo=repo,
                           files=[f"src/m{rng.randint(0, 30)}.py" for _ in range(3)],
                           tests=[f"tests/test_{rng.randint(0, 9)}.py::t"] if i % 3 == 0 else None))
    features.append(EpisodeFeatures("bare"))  # nothing to group by
    clusters = {f"e{i:03d}": f"c-{i % 7}" for i in range(0, 160, 9)}
    on = {name: assign_groups(features, cfg, clusters, cutoff=CUTOFF, engine=name) for name in ("duckdb", "daft")}
    duck, daft = on["duckdb"], on["daft"]
    assert (duck.group_of, duck.keys_of, duck.flags_of, duck.repository_of, duck.dropped_keys, duck.cut_keys) == (
        daft.group_of, daft.keys_of, daft.flags_of, daft.repository_of, daft.dropped_keys, daft.cut_keys)
    assert 1 < len(set(duck.group_of.values())) < len(features)  # groups formed, not one and not singletons
    assert "no_grouping_key" in duck.flags_of["bare"]
    if cfg == GroupConfig():  # the cases the plan's steps exist for happened
        assert duck.cut_keys and duck.dropped_keys, (duck.cut_keys, duck.dropped_keys)
