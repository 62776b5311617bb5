"""The synthetic corpus plants what later layers must find, and the ground truth agrees with it."""

from __future__ import annotations

import gzip
from collections import Counter

import orjson
from trajwh.schemas.native import NativeEpisode
from trajwh.synth.generator import ALL_CAUSES


def load(corpus):
    episodes = []
    for path in sorted(corpus.iterdir()):
        if path.is_file():
            data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            episodes += [orjson.loads(line) for line in data.splitlines() if line.strip()]
    truth = [orjson.loads(line) for line in (corpus / ".truth" / "labels.jsonl").read_bytes().splitlines()]
    return episodes, truth


def test_every_episode_is_valid_native_and_every_cause_is_planted(small_corpus):
    episodes, truth = load(small_corpus)
    assert len(episodes) == len(truth) == 150
    for ep in episodes:
        NativeEpisode.model_validate(ep)
    assert set(Counter(t["cause"] for t in truth)) == set(ALL_CAUSES)
    tasks = Counter(ep["task"]["task_id"] for ep in episodes)
    assert max(tasks.values()) >= 3  # several attempts per task
    assert len({ep["harness"]["name"] for ep in episodes}) == 3 and len({ep["policy"]["name"] for ep in episodes}) == 4


def test_authors_and_tool_links(small_corpus):
    episodes, _ = load(small_corpus)
    authors = Counter(s["author"] for ep in episodes for s in ep["steps"])
    assert set(authors) == {"model", "harness", "environment", "human"}
    for ep in episodes:
        calls = {c["id"] for s in ep["steps"] for c in (s.get("tool_calls") or [])}
        for s in ep["steps"]:
            if s.get("tool_call_id"):
                assert s["tool_call_id"] in calls


def test_planted_secrets_leaks_big_observations_and_near_duplicates(small_corpus):
    episodes, truth = load(small_corpus)
    by_id = {ep["episode_id"]: ep for ep in episodes}
    n_secrets = 0
    for t in truth:
        ep = by_id[t["episode_id"]]
        for s in t["secrets"]:
            step = ep["steps"][s["step"]]
            text = step.get("observation") or ""
            if s["field"] == "tool_call":
                text = orjson.dumps(step.get("tool_calls")).decode() + (step.get("text") or "")
            assert s["value"] in text, (t["episode_id"], s)
            n_secrets += 1
        for i in t["leak_steps"]:
            assert "origin/main" in ep["steps"][i]["observation"]
    assert n_secrets >= 20
    assert any(t["leak_steps"] for t in truth)
    assert max(len(s.get("observation") or "") for ep in episodes for s in ep["steps"]) > 100_000
    dups = [t for t in truth if t["near_dup_of"]]
    assert dups
    for t in dups:
        orig = next(x for x in truth if x["episode_id"] == t["near_dup_of"])
        assert t["action_signature"] == orig["action_signature"]
        a, b = by_id[t["episode_id"]], by_id[t["near_dup_of"]]
        assert [s.get("text") for s in a["steps"]] != [s.get("text") for s in b["steps"]]


def test_per_test_vectors_improve_in_productive_segments(small_corpus):
    episodes, truth = load(small_corpus)
    by_id = {ep["episode_id"]: ep for ep in episodes}
    seen = Counter()
    for t in truth:
        for seg in t["segments"]:
            seen[seg["kind"]] += 1
            end = by_id[t["episode_id"]]["steps"][seg["end_step"]]
            assert end.get("test_results"), seg
    assert seen["productive"] and seen["recovery"]
