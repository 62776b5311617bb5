"""Near duplicates, repository groups, time-aware splits, leak flags, and the task-level CI."""

from __future__ import annotations

import json
import random
import subprocess
from dataclasses import replace
from datetime import UTC, datetime

import numpy as np
import orjson
import pytest
from conftest import trajwh_cmd
from hypothesis import given, settings
from hypothesis import strategies as st
from trajwh.dedup.audit import audit
from trajwh.dedup.components import components_array, components_uf
from trajwh.dedup.engines import ENGINES, components, engine, star_components
from trajwh.dedup.features import EpisodeFeatures, load_features
from trajwh.dedup.groups import GroupConfig, assign_groups, normalize_repository, patch_symbols
from trajwh.dedup.layer import CurateConfig, curate, curate_warehouse
from trajwh.dedup.leaks import find_leaks
from trajwh.dedup.minhash import MinHashParams, lsh_pairs, optimal_bands, shingle_hash32, signatures
from trajwh.dedup.splits import SplitConfig, assign_splits
from trajwh.dedup.stats import binomial_ci, task_clustered_ci
from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.redaction.layer import redact_warehouse
from trajwh.schemas.errors import ConfigError


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("num_perm", [64, 128])
def test_signatures_are_identical_to_datasketch(num_perm, compiled, monkeypatch):
    """Both ways signatures are computed (numba's kernels; mmh3 and numpy for few shingles)."""
    from datasketch import MinHash
    from trajwh.dedup import minhash

    monkeypatch.setattr(minhash, "_compiled", lambda n: compiled)

    rng = random.Random(num_perm)
    docs = [[f"w{rng.randint(0, 400)} w{rng.randint(0, 400)}" for _ in range(rng.randint(1, 60))] for _ in range(20)]
    ours = signatures(docs, MinHashParams(num_perm=num_perm, seed=3))
    for doc, sig in zip(docs, ours, strict=True):
        m = MinHash(num_perm=num_perm, seed=3, hashfunc=shingle_hash32)
        m.update_batch([s.encode() for s in doc])
        assert np.array_equal(m.hashvalues, sig)


def test_compiled_kernel_equals_the_numpy_reference(monkeypatch):
    from trajwh.dedup import minhash

    rng = random.Random(1)
    docs = [[f"s{rng.randint(0, 10**6)}" for _ in range(rng.randint(0, 300))] for _ in range(50)]
    docs[3] = ["héllo wörld", "x" * 1001, ""]  # several blocks, a tail, no bytes
    monkeypatch.setattr(minhash, "_compiled", lambda n: False)  # few shingles: mmh3 hashes, numpy the minima
    few = minhash.signatures(docs)
    monkeypatch.setattr(minhash, "_compiled", lambda n: True)  # the compiled kernels
    assert np.array_equal(few, signatures(docs))
    assert np.array_equal(few, minhash.signatures_numpy(docs))


@pytest.mark.parametrize("threshold", [0.5, 0.8, 0.9])
def test_band_choice_matches_datasketch(threshold):
    from datasketch.lsh import _optimal_param

    assert optimal_bands(threshold, 128) == _optimal_param(threshold, 128, 0.5, 0.5)


@pytest.mark.parametrize("engine_name", ENGINES)
@settings(max_examples=25, deadline=None)
@given(edges=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=80))
def test_star_loop_components_equal_union_find(engine_name, edges):
    """The relational plan on each engine, scipy's numbered form and a union-find agree: each node
    labelled by its component's smallest node."""
    if engine_name == "daft":
        pytest.importorskip("daft")
    nodes = [f"n{i:02d}" for i in range(41)]
    e = [(f"n{a:02d}", f"n{b:02d}") for a, b in edges]
    want = [components_uf(nodes, e)[v] for v in nodes]
    a = np.array([x for x, _ in edges], dtype=np.int64)
    b = np.array([y for _, y in edges], dtype=np.int64)
    assert [nodes[i] for i in components_array(41, a, b)] == want
    assert [nodes[i] for i in components(41, a, b, engine_name)] == want


@pytest.mark.parametrize("engine_name", ENGINES)
def test_star_loop_takes_few_rounds_on_a_long_chain(engine_name):
    """A path of 3,000 nodes numbered at random, plus stars and isolated nodes: the loop takes a
    handful of rounds (min-label propagation would take thousands) and gives scipy's labels."""
    if engine_name == "daft":
        pytest.importorskip("daft")
    rng = np.random.default_rng(7)
    n = 5_000
    perm = rng.permutation(n)
    a, b = perm[:2_999], perm[1:3_000]  # the chain
    hubs = rng.integers(3_000, n, 200)
    leaves = rng.integers(3_000, n, 200)
    a, b = np.r_[a, hubs, 17], np.r_[b, leaves, 17]  # and a self-loop
    eng = engine(engine_name)
    try:
        label, rounds = star_components(eng, n, a, b)
    finally:
        eng.close()
    assert np.array_equal(label, components_array(n, a, b))
    assert label[perm[:3_000]].tolist() == [perm[:3_000].min()] * 3_000
    assert 1 <= rounds <= 20


def test_the_daft_engine_sends_no_usage_reports(monkeypatch):
    pytest.importorskip("daft")
    monkeypatch.delenv("DAFT_ANALYTICS_ENABLED", raising=False)
    monkeypatch.delenv("SCARF_NO_ANALYTICS", raising=False)
    monkeypatch.delenv("DO_NOT_TRACK", raising=False)
    from daft.scarf_telemetry import opted_out

    assert not opted_out()
    engine("daft").close()
    assert opted_out()  # Daft's own test of its opt-out


def test_unknown_engine_is_a_clear_error():
    from trajwh.schemas.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown engine 'spark'.*duckdb, daft"):
        engine("spark")


@pytest.mark.parametrize("engine_name", ENGINES)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), threshold=st.sampled_from([0.5, 0.8]))
def test_banding_on_an_engine_equals_lsh_pairs(engine_name, seed, threshold):
    """The relational banding (band keys, buckets, their pairs or stars) verified on the signatures
    gives ``lsh_pairs``'s pairs, with buckets of more than 64 documents among them."""
    if engine_name == "daft":
        pytest.importorskip("daft")
    from trajwh.dedup.engines import lsh_candidates
    from trajwh.dedup.minhash import pair_similarity

    rng = np.random.default_rng(seed)
    params = MinHashParams(threshold=threshold)
    base = rng.integers(0, 2**32, size=(30, params.num_perm), dtype=np.uint32)
    sigs = base[rng.integers(0, 30, 300)].copy()  # copies of 30 documents ...
    noise = rng.random(sigs.shape) < rng.choice([0.0, 0.1, 0.4], size=(300, 1))
    sigs[noise] = rng.integers(0, 2**32, size=int(noise.sum()), dtype=np.uint32)  # ... each edited a little or a lot
    sigs[:70] = base[0]  # one bucket of 70 identical documents in every band: a star
    eng = engine(engine_name)
    try:
        cand = lsh_candidates(eng, sigs, *params.bands)
    finally:
        eng.close()
    got = cand[pair_similarity(sigs, cand) >= params.threshold]
    assert got.tolist() == lsh_pairs(sigs, params).tolist()


def _lsh_pairs_reference(sigs, params):
    """Every pair sharing a band bucket (a bucket of more than 64: a star around its smallest
    member), then verified by estimated Jaccard: the rule, pair by pair."""
    bands, rows = params.bands
    pairs = set()
    for band in range(bands):
        buckets = {}
        for i, sig in enumerate(sigs):
            buckets.setdefault(sig[band * rows:(band + 1) * rows].tobytes(), []).append(i)
        for members in buckets.values():
            if len(members) > 64:
                pairs.update((members[0], m) for m in members[1:])
            else:
                pairs.update((x, y) for k, x in enumerate(members) for y in members[k + 1:])
    return sorted(p for p in pairs if (sigs[p[0]] == sigs[p[1]]).mean() >= params.threshold)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lsh_pairs_equal_the_pairwise_rule(seed):
    """Buckets of every size, a bucket of 70 (a star), near copies above and below the threshold."""
    params = MinHashParams()
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**32, size=(40, 128), dtype=np.uint32)
    copies = []
    for i in range(120):
        sig = base[i % 40].copy()
        changed = rng.choice(128, size=int(rng.integers(0, 60)), replace=False)
        sig[changed] = rng.integers(0, 2**32, size=len(changed), dtype=np.uint32)
        copies.append(sig)
    star = np.tile(base[0], (70, 1))
    star[:, 116:] = rng.integers(0, 2**32, size=(70, 12), dtype=np.uint32)  # similar, sharing the first bands
    sigs = np.concatenate([base, np.array(copies), star])[rng.permutation(230)]
    got = [tuple(p) for p in lsh_pairs(sigs, params).tolist()]
    assert got == _lsh_pairs_reference(sigs, params)
    assert len(got) > 100
    hub = int(np.flatnonzero((sigs[:, :116] == base[0][:116]).all(axis=1)).min())
    assert sum(hub in p for p in got) >= 69  # the star's pairs are its hub's


def test_repository_spellings_and_forks_collapse():
    spellings = ["https://github.com/Acme/WidgetLib.git", "git@github.com:acme/widgetlib.git", "github.com/acme/widgetlib",
                 "acme/widgetlib", "https://x-access-token:<GITHUB_TOKEN:ab12cd:ep>@github.com/acme/widgetlib"]
    assert {normalize_repository(s) for s in spellings} == {"github.com/acme/widgetlib"}
    assert normalize_repository("github.com/jdoe/widgetlib", "acme__widgetlib-105") == "github.com/acme/widgetlib"
    assert normalize_repository("github.com/jdoe/other", "acme__widgetlib-105") == "github.com/jdoe/other"
    a = EpisodeFeatures("a", repository="github.com/jdoe/widgetlib", instance_id="acme__widgetlib-1", task_id="acme__widgetlib-1")
    b = EpisodeFeatures("b", repository="https://github.com/acme/widgetlib.git", instance_id="acme__widgetlib-1")
    g = assign_groups([a, b])
    assert g.group_of["a"] == g.group_of["b"] and g.repository_of["a"] == g.repository_of["b"]


def test_patch_symbols_from_python_ast_and_hunk_headers():
    patch = ("diff --git a/src/pkg/core.py b/src/pkg/core.py\n--- a/src/pkg/core.py\n+++ b/src/pkg/core.py\n"
             "@@ -10,6 +10,8 @@ class Parser:\n     def parse(self, x):\n-        return x\n+        return x or {}\n"
             "+    def reset(self):\n+        pass\n"
             "diff --git a/src/lib.c b/src/lib.c\n@@ -5,3 +5,3 @@ int parse_header(char *s)\n-  return 0;\n+  return 1;\n")
    assert patch_symbols(patch) == ["src/lib.c::int parse_header(char *s)", "src/pkg/core.py::Parser",
                                    "src/pkg/core.py::parse", "src/pkg/core.py::reset"]


def test_missing_fields_are_handled_conservatively():
    t = datetime(2026, 1, 1, tzinfo=UTC)
    eps = [EpisodeFeatures("norepo1", task_id="t-1", issue_created_at=t, started_at=t),
           EpisodeFeatures("norepo2", task_id="t-1", issue_created_at=t, started_at=t),
           EpisodeFeatures("nothing"),
           EpisodeFeatures("repo-only-1", repository="github.com/o/r"),
           EpisodeFeatures("repo-only-2", repository="github.com/o/r")]
    g = assign_groups(eps)
    assert g.group_of["norepo1"] == g.group_of["norepo2"]  # grouped by task id
    assert "no_grouping_key" in g.flags_of["nothing"] and len({g.group_of["nothing"]} & set(g.group_of.values())) == 1
    assert g.group_of["repo-only-1"] == g.group_of["repo-only-2"]  # cannot be told apart: whole repository
    splits = {s.trajectory_key: s for s in assign_splits(eps, g.group_of)}
    assert splits["nothing"].split == "train" and "no_usable_times" in splits["nothing"].flags
    assert not splits["nothing"].eligible_for_eval


def test_blank_ids_count_as_missing_and_bad_frames_are_refused():
    """An empty instance id is no id (the task id decides), as a blank repository is none; two
    rows of one trajectory key, or a signature of another MinHash width, are refused by name."""
    eps = [EpisodeFeatures("a", repository="", instance_id="", task_id="t-1"),
           EpisodeFeatures("b", repository="github.com/o/r", instance_id="", task_id="t-1", base_commit=""),
           EpisodeFeatures("c", instance_id="", task_id="")]
    g = assign_groups(eps)
    assert g.group_of["a"] == g.group_of["b"] != g.group_of["c"]
    assert g.keys_of["a"] == ["task:t-1"] and "no_repository" in g.flags_of["a"]
    assert g.keys_of["b"] == ["repo-task:github.com/o/r:t-1", "task:t-1"] and g.flags_of["b"] == []
    assert g.keys_of["c"] == [] and g.flags_of["c"] == ["no_repository", "no_grouping_key"]
    with pytest.raises(ValueError, match="trajectory key 'a' appears more than once"):
        curate([*eps, EpisodeFeatures("a", task_id="t-2")], [], CurateConfig(), "r")
    odd = EpisodeFeatures("d", task_id="t-3", actions=["run:a", "run:b", "run:c"], text="x", signed=True,
                          action_sig=np.zeros(64, dtype=np.uint32))
    with pytest.raises(ValueError, match="action_signature of 'd' holds 256 bytes, not 512"):
        curate([*eps, odd], [], CurateConfig(), "r")


def test_time_rule_and_flags():
    cut = datetime(2025, 6, 1, tzinfo=UTC)
    before, after = datetime(2025, 1, 1, tzinfo=UTC), datetime(2025, 9, 1, tzinfo=UTC)
    eps = [EpisodeFeatures(f"late{i}", task_id=f"late{i}", issue_created_at=after, started_at=after) for i in range(40)]
    eps += [EpisodeFeatures("early", task_id="early", issue_created_at=before, fix_merged_at=after, started_at=after)]
    groups = assign_groups(eps).group_of
    rows = {s.trajectory_key: s for s in assign_splits(eps, groups, SplitConfig(cutoff=cut))}
    assert rows["early"].split == "train" and "fix_after_cutoff" in rows["early"].flags
    assert {rows[f"late{i}"].split for i in range(40)} == {"valid", "test"}
    with pytest.raises(ConfigError, match="sum to 1"):
        assign_splits(eps, groups, SplitConfig(train=0.9, valid=0.2, test=0.1))


@pytest.fixture(scope="module")
def curated_wh(tmp_path_factory, small_corpus):
    from trajwh.lineage.catalog import Warehouse

    wh = Warehouse(tmp_path_factory.mktemp("cur") / "wh")
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="r")
    curate_warehouse(wh, run_id="c")
    return wh


def _truth(small_corpus):
    return [orjson.loads(x) for x in (small_corpus / ".truth" / "labels.jsonl").read_bytes().splitlines()]


def test_planted_near_duplicates_share_a_cluster(curated_wh, small_corpus):
    key = {r["source_episode_id"]: r["trajectory_key"] for r in
           curated_wh.query("SELECT source_episode_id, trajectory_key FROM episodes").to_pylist()}
    rows = curated_wh.query("SELECT * FROM near_dup_clusters").to_pylist()
    cluster = {r["trajectory_key"]: r for r in rows}
    dups = [t for t in _truth(small_corpus) if t["near_dup_of"]]
    assert dups
    for t in dups:
        a, b = cluster[key[t["episode_id"]]], cluster[key[t["near_dup_of"]]]
        assert a["cluster_id"] == b["cluster_id"] and "actions" in a["linked_by"]
    by_cluster: dict[str, list] = {}
    for r in rows:
        by_cluster.setdefault(r["cluster_id"], []).append(r)
    for members in by_cluster.values():
        assert sum(m["is_representative"] for m in members) == 1
        assert abs(sum(m["weight"] for m in members) - 1.0) < 1e-9


def test_planted_time_leaks_are_flagged_with_their_step(curated_wh, small_corpus):
    key = {r["source_episode_id"]: r["trajectory_key"] for r in
           curated_wh.query("SELECT source_episode_id, trajectory_key FROM episodes").to_pylist()}
    flags = curated_wh.query("SELECT trajectory_key, step_index, kind FROM leak_flags WHERE step_index IS NOT NULL").to_pylist()
    flagged = {(f["trajectory_key"], f["step_index"]) for f in flags}
    planted = [(key[t["episode_id"]], s) for t in _truth(small_corpus) for s in t["leak_steps"]]
    assert planted
    for k, step in planted:
        assert (k, step) in flagged or (k, step - 1) in flagged  # the command, or its output
    assert {f["trajectory_key"] for f in flags} == {k for k, _ in planted}  # no episode flagged without cause


def test_audit_finds_no_group_or_cluster_across_splits(curated_wh, cli_env):
    a = audit(curated_wh)
    assert a["groups_across_splits"] == 0 and a["clusters_across_splits"] == 0 and a["episodes"] == 150
    env = {**cli_env, "TRAJWH_WAREHOUSE": str(curated_wh.root)}
    r = subprocess.run([*trajwh_cmd(), "audit", "--json"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["groups_across_splits"] == 0


def test_results_do_not_depend_on_input_order(curated_wh):
    features = load_features(curated_wh)
    leaks = find_leaks(curated_wh)
    cfg = CurateConfig()

    def snapshot(rows):
        return {t: sorted((json.dumps({k: v for k, v in r.items() if not k.startswith("_")}, sort_keys=True, default=str))
                          for r in rows[t]) for t in rows}

    base = snapshot(curate(features, leaks, cfg, "a"))
    for seed in (1, 2):
        shuffled = [replace(f) for f in features]
        random.Random(seed).shuffle(shuffled)
        assert snapshot(curate(shuffled, list(reversed(leaks)), cfg, "b")) == base


def test_whole_repository_option_is_most_conservative(curated_wh):
    features = load_features(curated_wh)
    g = assign_groups(features, GroupConfig(whole_repository=True))
    per_repo: dict[str, set] = {}
    for f in features:
        per_repo.setdefault(g.repository_of[f.key], set()).add(g.group_of[f.key])
    assert all(len(v) == 1 for v in per_repo.values())


def test_task_clustered_interval_is_wider_than_the_rollout_binomial():
    rng = random.Random(5)
    rows = []
    for t in range(30):  # task difficulty dominates: rollouts of a task mostly agree
        p = rng.choice([0.05, 0.95])
        rows += [(f"t{t}", rng.random() < p) for _ in range(20)]
    ci = task_clustered_ci(rows, level=0.9)
    lo, hi = binomial_ci(sum(ok for _, ok in rows), len(rows), level=0.9)
    assert ci["tasks"] == 30 and ci["rollouts"] == 600
    assert ci["low"] <= ci["rate"] <= ci["high"]
    assert (ci["high"] - ci["low"]) > 2 * (hi - lo)


def test_the_shingle_hash_is_murmur3_by_its_specification(monkeypatch):
    """Signatures must not change with a library release: the shingle hash is MurmurHash3 x86
    32-bit, checked against the algorithm's published test vectors and a plain reference."""
    import numpy as np
    from trajwh.dedup import minhash
    from trajwh.dedup.minhash import (
        _HASH_SEED,
        SHINGLE_HASH,
        MinHashParams,
        _murmur3_32,
        hash_shingles,
    )

    def vector(text: bytes, seed: int) -> int:
        out = np.empty(1, np.uint32)
        _murmur3_32(np.frombuffer(text, dtype=np.uint8), np.array([0, len(text)], dtype=np.int64), np.uint32(seed), out)
        return int(out[0])

    assert vector(b"", 0) == 0 and vector(b"", 1) == 0x514E28B7 and vector(b"hello", 0) == 0x248BFA47
    assert vector(b"The quick brown fox jumps over the lazy dog", 0x9747B28C) == 0x2FA826CD
    assert vector(b"aaaa", 0x9747B28C) == 0x5A97808A and vector(b"abc", 0) == 0xB3DD93FA
    words = ["", "a", "ab", "abc", "abcd", "héllo wörld", "x" * 1001]
    for compiled in (False, True):  # mmh3 (few shingles), the compiled kernel
        monkeypatch.setattr(minhash, "_compiled", lambda n, c=compiled: c)
        got = hash_shingles(words)
        assert [vector(w.encode(), _HASH_SEED) for w in words] == [int(g) for g in got]
    assert SHINGLE_HASH in MinHashParams().describe()  # the layer's version names the hash


def test_features_in_worker_processes_equal_one_process(wh, small_corpus, monkeypatch, tmp_path):
    """A big batch's features are computed in parts by worker processes; the stored features and
    the curated layer do not depend on it."""
    import shutil

    import trajwh.dedup.layer as layer
    from trajwh.lineage.catalog import Warehouse

    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="r")
    other = Warehouse(tmp_path / "other")
    shutil.copytree(wh.root, other.root)
    monkeypatch.setenv("TRAJWH_WORKERS", "1")
    curate_warehouse(wh, run_id="c")
    monkeypatch.setenv("TRAJWH_WORKERS", "2")
    # parts as asked: the budget would take them back to one beside a test process that holds much
    # (tests/test_budget.py checks the budget)
    monkeypatch.setenv("TRAJWH_MEMORY_MB", "65536")
    monkeypatch.setattr(layer, "PARALLEL_MIN_ITEMS", 1)
    curate_warehouse(other, run_id="c")
    assert len(other.files("episode_features")) > len(wh.files("episode_features"))  # a file per part
    for table in ("episode_features", "near_dup_clusters", "task_groups", "splits", "leak_flags"):
        q = f"SELECT * EXCLUDE (_run_id) FROM {table} ORDER BY ALL"
        assert wh.query(q).to_pylist() == other.query(q).to_pylist(), table


def test_curated_layer_is_the_same_on_duckdb_and_daft(wh, tmp_path, small_corpus):
    """The global graph steps on Daft give the clusters, groups and splits DuckDB gives, row for
    row (the engine is not part of the layer's version: switching rebuilds nothing)."""
    pytest.importorskip("daft")
    import shutil

    from trajwh.lineage.catalog import Warehouse

    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="r")
    other = Warehouse(tmp_path / "other")
    shutil.copytree(wh.root, other.root)
    curate_warehouse(wh, run_id="c", cfg=CurateConfig(engine="duckdb"))
    curate_warehouse(other, run_id="c", cfg=CurateConfig(engine="daft"))
    sizes = wh.query("SELECT max(cluster_size) AS c FROM near_dup_clusters").to_pylist()[0]
    groups = wh.query("SELECT max(group_size) AS g FROM task_groups").to_pylist()[0]
    assert sizes["c"] > 1 and groups["g"] > 1  # components with more than one node on both graphs
    for table in ("near_dup_clusters", "task_groups", "splits", "leak_flags"):
        q = f"SELECT * EXCLUDE (_run_id) FROM {table} ORDER BY ALL"
        assert wh.query(q).to_pylist() == other.query(q).to_pylist(), table
    assert CurateConfig(engine="daft").version() == CurateConfig().version()


def test_engine_setting_is_checked_and_leaves_the_settings_digest(tmp_path):
    from trajwh.pipelines.settings import curate_config, with_overrides
    from trajwh.schemas.config import load_settings
    from trajwh.schemas.errors import ConfigError

    bad = tmp_path / "trajwh.toml"
    bad.write_text('[engine]\nname = "spark"\n')
    with pytest.raises(ConfigError, match=r"engine.name: unknown engine 'spark'; valid: duckdb, daft"):
        load_settings(str(bad), tmp_path)
    base = load_settings(None, tmp_path / "none")
    daft = with_overrides(base, engine="daft")
    assert curate_config(daft).engine == "daft" and curate_config(base).engine == "duckdb"
    assert daft.digest() == base.digest()


def test_build_runs_the_curated_step_on_the_engine_asked(wh, small_corpus, monkeypatch):
    """`trajwh build --engine daft` reaches the curate step through Dagster's run config: the
    global steps' SQL runs on Daft, none on DuckDB."""
    pytest.importorskip("daft")
    import trajwh.dedup.engines as engines
    from trajwh.pipelines.definitions import build

    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    normalize_warehouse(wh, run_id="n")
    redact_warehouse(wh, run_id="r")
    calls = {"daft": 0, "duckdb": 0}
    for cls in (engines.DaftEngine, engines.DuckDBEngine):
        def counted(self, query, _orig=cls.sql, **tables):
            calls[self.name] += 1
            return _orig(self, query, **tables)
        monkeypatch.setattr(cls, "sql", counted)
    build(str(wh.root), curate={"engine": "daft"}, only=["near_dup_clusters", "task_groups", "splits", "leak_flags"])
    assert calls["daft"] > 0 and calls["duckdb"] == 0, calls
    assert wh.query("SELECT count(*) AS n FROM splits").to_pylist()[0]["n"] == 150


def test_loaded_kernels_sign_a_small_call_compiled():
    """A process that signs many documents in small chunks can load the compiled kernels first
    (the MinHash benchmark does); every later call then uses them, however few its shingles (a fresh
    process: other tests load them too)."""
    import subprocess
    import sys

    code = ("from trajwh.dedup import minhash as m; before = m._compiled(10); m.load_kernels(); "
            "print(before, m._compiled(10))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]


def test_features_see_a_placeholder_as_its_type():
    """A placeholder's digest depends on the warehouse's salt and the scope: two copies of one
    trajectory redacted in two scopes (or two warehouses) must give the same features."""
    from trajwh.dedup.features import EpisodeFeatures, _add_steps, text_shingles

    def features(ip: str, phone: str) -> EpisodeFeatures:
        f = EpisodeFeatures("k")
        steps = [{"author": "model", "action_kind": "browse", "action_object": f"http://<IP_ADDRESS:{ip}:ep>:9200/_health",
                  "text": f"call <PHONE:{phone}:ep> then rerun the failing test", "observation": None, "args": []},
                 {"author": "model", "action_kind": "edit", "action_object": f"/home/<USER:{ip}:ep>/app/main.py",
                  "text": "", "observation": None, "args": []}]
        _add_steps(f, steps)
        return f

    a, b = features("449698", "7a4270"), features("3ed6b3", "8de8d1")
    assert (a.actions, a.touched_files, a.text) == (b.actions, b.touched_files, b.text)
    assert a.actions[0] == "browse:http://<IP_ADDRESS>:9200/_health" and "<USER>" in a.touched_files[0]
    assert "call phone then rerun the" in text_shingles(a.text)
    assert text_shingles("<notaplaceholder> words") == ["notaplaceholder words"]


def test_band_keys_are_the_chain_of_each_bands_values():
    """A band's key is the multiply-and-mix chain (murmur3's fmix64) of its rows' values, from the
    band's number: fixed by this code, whatever way it is computed (bands at once, here)."""
    from trajwh.dedup.engines import _fmix64, band_table

    rng = np.random.default_rng(5)
    sigs = rng.integers(0, 2**32, size=(300, 40), dtype=np.uint64).astype(np.uint32)
    bands, rows = 6, 6  # 36 of the 40 values: the rest are in no band
    table = band_table(sigs, bands, rows)
    want = []
    with np.errstate(over="ignore"):
        for doc in range(len(sigs)):
            for band in range(bands):
                h = np.uint64(band + 1)
                for v in sigs[doc, band * rows:(band + 1) * rows]:
                    h = _fmix64(np.array([h * np.uint64(0x9E3779B97F4A7C15) + np.uint64(v)]))[0]
                want.append((doc, band, int(np.array([h]).view(np.int64)[0])))
    assert list(zip(*(table.column(c).to_pylist() for c in ("doc", "band", "key")), strict=True)) == want
