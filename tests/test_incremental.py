"""Incremental builds (issue 14): a build after a new batch redoes only what the batch touches,
and its tables equal a full rebuild's, row for row."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import SHARED_CORPUS
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines.definitions import build

DERIVED = ("episode_features", "near_dup_clusters", "task_groups", "splits", "leak_flags", "outcomes", "task_stats",
           "fragments", "packs", "pack_tokens")
# which run made a row, and the digest of the files it read: differ by construction (a full
# rebuild rewrites the redacted files too)
RUN_COLUMNS = ("_run_id", "_transform_version", "inputs_digest")


def rows(wh: Warehouse, table: str, extra: tuple[str, ...] = ()) -> list[str]:
    """A table's rows as sorted text, without the columns that name the run that made them
    (``RUN_COLUMNS``, and ``extra``)."""
    skip = (*RUN_COLUMNS, *extra)
    data = [{k: v for k, v in r.items() if k not in skip} for r in wh.query(f"SELECT * FROM {table}").to_pylist()]
    return sorted(repr(sorted(r.items())) for r in data)


def counts(result, asset: str) -> dict:
    for mat in result.get_asset_materialization_events():
        if mat.asset_key.to_user_string() == asset:
            return {k: v.value for k, v in mat.materialization.metadata.items()}
    raise AssertionError(f"no materialization of {asset}")


def run_counts(wh: Warehouse, job: str) -> dict:
    import orjson

    c = wh.query("SELECT counts FROM runs WHERE job = ? AND status = 'succeeded' ORDER BY finished_at DESC LIMIT 1",
                 [job]).column(0)[0].as_py()
    return orjson.loads(c)


def test_incremental_build_redoes_only_the_new_batch_and_equals_a_full_rebuild(tmp_path: Path, small_corpus: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    shards = sorted(p for p in small_corpus.iterdir() if p.name.startswith("episodes-"))
    assert len(shards) >= 2
    first, later = tmp_path / "first", tmp_path / "later"
    first.mkdir()
    later.mkdir()
    for p in shards[:-1]:
        (first / p.name).symlink_to(p)
    (later / shards[-1].name).symlink_to(shards[-1])
    extra = [later]
    if SHARED_CORPUS.is_dir():  # real harness formats in the new batch too, when the corpus is there
        extra.append(SHARED_CORPUS / "mini-swe-agent-traj-json")
    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [first], IngestOptions(source="synthetic"))
    build(str(wh.root))
    before = wh.query("SELECT count(*) FROM outcomes").column(0)[0].as_py()
    ingest_paths(wh, [p for p in extra if p.exists()], IngestOptions(source="later"))
    second = build(str(wh.root))
    after = wh.query("SELECT count(*) FROM outcomes").column(0)[0].as_py()
    new = after - before
    assert new > 0
    features = run_counts(wh, "features")
    assert features["batches_featurized"] == 1 and features["episodes_featurized"] == new  # only the new batch
    curate = run_counts(wh, "curate")
    assert curate["batches_featurized"] == 0  # (the features step did them: a partitioned asset)
    # the clusters were updated from the first build's links, not found again (dedup.clusters)
    assert curate["clusters_incremental"] and curate["links_kept"] > 0, curate
    frag = run_counts(wh, "fragments")
    assert frag["rebuilt"] is not None and new <= frag["rebuilt"] < after  # not every episode again
    assert frag["episodes"] == after  # the summary still counts the whole table
    packs = run_counts(wh, "packs")  # units of unchanged windows keep their tokens
    assert packs["units_reused"] > 0 and packs["units_rendered"] < packs["fragments"], packs
    check = {e.check_name: e for e in second.get_asset_check_evaluations()}["packs_round_trip"]
    assert check.passed and 0 < check.metadata["rendered"].value < check.metadata["segments"].value
    # a few episodes' steps are read from the files and row groups that hold them alone (what the
    # fragments, the packs and their check read in an incremental build or a forget), and they are
    # all of those episodes' steps; more keys than LOCATE_KEYS read their batches' files
    by_batch = wh.query("SELECT _batch_id AS batch, list(trajectory_key ORDER BY trajectory_key) AS keys "
                        "FROM redacted_episodes GROUP BY 1").to_pylist()
    assert len(by_batch) == 2
    step_ids = "SELECT step_id FROM {} WHERE list_contains(?, trajectory_key) ORDER BY 1"
    holding = ("SELECT DISTINCT parse_filename(filename) FROM read_parquet([{}], filename = true) "
               "WHERE list_contains(?, trajectory_key)")
    both = [k for b in by_batch for k in b["keys"][:3]]
    for keys in [b["keys"][:5] for b in by_batch] + [both]:
        source = wh.rows_of("redacted_steps", keys)
        every = [p.name for p in wh.files("redacted_steps")]
        files = ", ".join(f"'{p}'" for p in wh.files("redacted_steps"))
        held = set(wh.query(holding.format(files), [keys]).column(0).to_pylist())
        assert held and {n for n in every if n in source} == held, source  # the files that hold them, no other
        got = wh.query(step_ids.format(source), [keys]).column(0).to_pylist()
        assert got and got == wh.query(step_ids.format("redacted_steps"), [keys]).column(0).to_pylist()
    import trajwh.lineage.catalog as catalog

    monkeypatch.setattr(catalog, "LOCATE_KEYS", 1)
    for b in by_batch:
        source = wh.rows_of("redacted_steps", b["keys"][:5])
        for other in by_batch:
            names = [p.name for p in wh.files("redacted_steps", batch_id=other["batch"])]
            assert names and all((n in source) == (other is b) for n in names), source
    assert wh.rows_of("redacted_steps", both) == "redacted_steps"  # every batch: the view

    full = Warehouse(tmp_path / "full")
    shutil.copytree(wh.root, full.root)
    build(str(full.root), full=True)
    rebuilt = run_counts(full, "curate")
    assert not rebuilt["clusters_incremental"] and rebuilt["pairs_verified"] > curate["pairs_verified"], rebuilt
    for table in DERIVED:
        assert rows(wh, table) == rows(full, table), f"{table}: incremental build differs from a full rebuild"

    # a no-op build changes nothing and redoes nothing
    files = wh.query("SELECT path FROM table_files ORDER BY path").column(0).to_pylist()
    noop = build(str(wh.root))
    assert wh.query("SELECT path FROM table_files ORDER BY path").column(0).to_pylist() == files
    # and its checks reuse the results of unchanged inputs instead of re-scanning the layers
    evaluations = noop.get_asset_check_evaluations()
    assert evaluations and all(e.passed for e in evaluations)
    assert {e.check_name: e.metadata["cached"].value for e in evaluations} == {e.check_name: 1 for e in evaluations}
    assert run_counts(wh, "fragments")["skipped"] and run_counts(wh, "curate")["skipped"]


def test_split_moves_are_reported(tmp_path: Path, cases: Path):
    """A later batch whose episode joins two tasks' groups into one can move episodes across
    train / evaluation: the curate run counts them by direction (never silently)."""
    from trajwh.dedup.features import EpisodeFeatures
    from trajwh.dedup.layer import CurateConfig, curate
    from trajwh.dedup.splits import SplitConfig

    cfg = CurateConfig(splits=SplitConfig(train=0.5, valid=0.25, test=0.25, cutoff=None))
    feats = [EpisodeFeatures(f"k{i:03d}", repository="github.com/o/r", task_id=f"t{i}", failing_tests=[f"tests/t{i}.py::x"])
             for i in range(40)]
    one = {r["trajectory_key"]: r["split"] for r in curate(feats, [], cfg, "r1")["splits"]}
    # one new episode shares a failing test with two tasks that landed on different sides
    sides = {}
    for i in range(40):
        sides.setdefault(one[f"k{i:03d}"] == "train", i)
    a, b = sides[True], sides[False]
    bridge = EpisodeFeatures("k999", repository="github.com/o/r", task_id="t999",
                             failing_tests=[f"tests/t{a}.py::x", f"tests/t{b}.py::x"])
    two = {r["trajectory_key"]: r["split"] for r in curate([*feats, bridge], [], cfg, "r2")["splits"]}
    from trajwh.dedup.layer import count_moves

    moved = count_moves(one, two)
    side = {"train": "train", "valid": "eval", "test": "eval", "held_out": "held_out"}
    expected: dict[str, int] = {}
    for k, was in one.items():
        if side[was] != side[two[k]]:
            expected[f"{was}->{two[k]}"] = expected.get(f"{was}->{two[k]}", 0) + 1
    assert moved == expected and sum(moved.values()) >= 1


@pytest.mark.parametrize("table", ["episode_features"])
def test_episode_features_are_per_batch_and_signed(tmp_path: Path, small_corpus: Path, table: str):
    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    build(str(wh.root))
    n = wh.query("SELECT count(*) FROM redacted_episodes").column(0)[0].as_py()
    stats = wh.query(f"""SELECT count(*) AS n, count(DISTINCT trajectory_key) AS keys,
                               count(text_signature) AS text_signed, min(octet_length(text_signature)) AS bytes
                        FROM {table}""").to_pylist()[0]
    assert stats["n"] == stats["keys"] == n
    assert stats["text_signed"] > 0.9 * n and stats["bytes"] == 128 * 4


@pytest.mark.parametrize("policy", ["drop", "split", "drop-short"])
def test_pack_windows_copied_repacked_or_new_equal_a_full_pack_build(tmp_path: Path, small_corpus: Path, policy: str):
    """Small windows, so that a later batch leaves some windows as they were (copied), changes
    others (packed again with stored tokens) and adds its own: the set equals a full pack build's,
    and a check that trusts only what it verified still catches a changed token."""
    import pyarrow.parquet as pq
    from trajwh.packing.layer import PackConfig, build_packs
    from trajwh.packing.verify import verify_packs, violations

    shards = sorted(p for p in small_corpus.iterdir() if p.name.startswith("episodes-"))
    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, shards[:-1], IngestOptions(source="synthetic"))
    build(str(wh.root))
    cfg = {"drop": PackConfig(window=4), "split": PackConfig(window=4, policy="split", seq_len=2048),
           "drop-short": PackConfig(window=4, seq_len=2048)}[policy]
    first = build_packs(wh, run_id="w1", cfg=cfg)
    assert first.windows["new"] > 4 and first.units_rendered == first.fragments
    assert violations(verify_packs(wh, first.pack_set, scan_secrets=False, ledger=True)) == 0
    def set_files() -> dict[str, str]:
        return {r["path"]: r["transform_version"] for r in wh.query(
            "SELECT path, transform_version FROM table_files WHERE table_name = 'packs' AND "
            "contains(transform_version, ?)", [first.pack_set]).to_pylist()}

    before = set_files()
    real = [SHARED_CORPUS / d for d in ("openhands-v1", "mini-swe-agent-2x", "swe-agent-traj")]
    ingest_paths(wh, [*shards[-1:], *(d for d in real if d.is_dir())], IngestOptions(source="later"))
    build(str(wh.root))
    if policy == "drop-short":  # the same build without the memory of dropped units renders them again
        from trajwh.packing.windows import _drops_path, read_drops

        assert sum(first.dropped.values()) > 0 and len(read_drops(wh, first.pack_set)) == sum(first.dropped.values())
        forgetful = Warehouse(tmp_path / "forgetful")
        shutil.copytree(wh.root, forgetful.root)
        _drops_path(forgetful, first.pack_set).unlink()
        without = build_packs(forgetful, run_id="w2", cfg=cfg)
    inc = build_packs(wh, run_id="w2", cfg=cfg)
    if policy == "drop-short":
        assert rows(wh, "packs") == rows(forgetful, "packs") and inc.dropped == without.dropped
        assert rows(wh, "pack_tokens") == rows(forgetful, "pack_tokens")
        assert inc.units_rendered < without.units_rendered, (inc.units_rendered, without.units_rendered)
        assert len(read_drops(wh, inc.pack_set)) == sum(inc.dropped.values())
    assert inc.windows["copied"] > 0 and inc.windows["new"] > 0 and inc.units_reused > 0, inc
    # files of copied windows that need no update stay as they are (the check trusts their bytes),
    # recorded with this build's version, so the next build finds the set up to date
    after = set_files()
    assert set(before) & set(after) and set(after) - set(before), (len(before), len(after))
    assert len(set(after.values())) == 1 and build_packs(wh, run_id="w2b", cfg=cfg).skipped
    full = Warehouse(tmp_path / "full")
    shutil.copytree(wh.root, full.root)
    again = build_packs(full, run_id="w3", cfg=cfg, full=True)
    assert rows(wh, "packs") == rows(full, "packs") and rows(wh, "pack_tokens") == rows(full, "pack_tokens")
    for k in ("sequences", "tokens", "trainable", "dropped", "truncated", "split_fragments"):
        assert getattr(inc, k) == getattr(again, k), k
    assert inc.fragments == again.fragments
    if policy == "split":  # pieces are rendered again (never put together from stored packs), or copied
        assert sum(inc.split_fragments.values()) > 0

    r = verify_packs(wh, inc.pack_set, scan_secrets=False, ledger=True)
    assert violations(r) == 0 and 0 < r["rendered"] < r["segments"], r
    assert verify_packs(wh, inc.pack_set, scan_secrets=False, ledger=True)["rendered"] == 0  # all verified now
    # a token changed in a kept chunk's row: its unit is no longer the verified one
    rel = wh.query("SELECT path FROM table_files WHERE table_name = 'pack_tokens' AND contains(transform_version, ?) "
                   "ORDER BY path", [inc.pack_set]).column(0).to_pylist()[0]
    t = pq.read_table(wh.root / rel)
    data = t.to_pylist()
    data[0]["input_ids"][0] += 1
    pq.write_table(type(t).from_pylist(data, schema=t.schema), wh.root / rel)
    tampered = verify_packs(wh, inc.pack_set, scan_secrets=False, ledger=True)
    assert tampered["round_trip_violations"] == 1 and tampered["rendered"] >= 1, tampered


def test_a_copied_window_whose_weights_changed_is_rewritten_as_a_full_build_writes_it(tmp_path: Path, small_corpus: Path):
    """A later batch holds a copy of an old train episode (another id, a later start): the old one
    stays its cluster's representative, so its window is copied (its units and tokens unchanged),
    but its segment's dedup weight and cluster change: the copied packs are rewritten with them,
    and the set equals a full pack build's."""
    import json
    from datetime import datetime, timedelta

    from trajwh.packing.layer import PackConfig, build_packs

    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    build(str(wh.root))
    cfg = PackConfig(window=4)
    first = build_packs(wh, run_id="w1", cfg=cfg)
    segment_sql = """SELECT t.s.trajectory_key AS key, t.s.dedup_weight AS weight, t.s.cluster_id AS cluster, p.window_id
                     FROM packs p, unnest(p.segments) AS t(s) WHERE p.pack_set = ? AND t.s.trajectory_key = ?"""
    key = wh.query("""SELECT t.s.trajectory_key FROM packs p, unnest(p.segments) AS t(s)
                      JOIN near_dup_clusters c ON c.trajectory_key = t.s.trajectory_key
                      WHERE p.pack_set = ? AND p.split = 'train' AND c.cluster_size = 1 AND t.s.piece IS NULL
                      ORDER BY 1 LIMIT 1""", [first.pack_set]).column(0)[0].as_py()
    before = wh.query(segment_sql, [first.pack_set, key]).to_pylist()
    payload = wh.query("""SELECT r.payload FROM raw_records r JOIN lineage_edges e ON e.parent_id = r.record_id
                          AND e.child_table = 'episodes' WHERE e.child_id = ?""", [key]).column(0)[0].as_py()
    episode = json.loads(payload)
    episode["episode_id"] += "-again"
    for field in ("started_at", "ended_at"):  # later: the old episode stays the representative
        t = datetime.fromisoformat(episode[field].replace("Z", "+00:00")) + timedelta(days=1)
        episode[field] = t.isoformat().replace("+00:00", "Z")
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "episodes-again.jsonl").write_text(json.dumps(episode) + "\n")
    ingest_paths(wh, [tmp_path / "again"], IngestOptions(source="again"))
    build(str(wh.root))
    assert wh.query("SELECT cluster_size, is_representative FROM near_dup_clusters WHERE trajectory_key = ?",
                    [key]).to_pylist() == [{"cluster_size": 2, "is_representative": True}]
    inc = build_packs(wh, run_id="w2", cfg=cfg)
    after = wh.query(segment_sql, [inc.pack_set, key]).to_pylist()
    assert [r["window_id"] for r in after] == [r["window_id"] for r in before] and inc.windows["copied"] > 0
    assert (after[0]["weight"], after[0]["cluster"]) != (before[0]["weight"], before[0]["cluster"])
    full = Warehouse(tmp_path / "full")
    shutil.copytree(wh.root, full.root)
    build_packs(full, run_id="w3", cfg=cfg, full=True)
    assert rows(wh, "packs") == rows(full, "packs") and rows(wh, "pack_tokens") == rows(full, "pack_tokens")


def test_episodes_that_leave_train_keep_their_outcome_and_need_no_steps(tmp_path: Path, small_corpus: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """An old episode whose split moves out of train gives no fragments and its outcome stands: an
    incremental build copies the outcome without reading its steps, and equals a full rebuild."""
    import trajwh.fragments.layer as layer

    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    build(str(wh.root))
    read: list[str] = []
    episodes_with_steps = layer._episodes_with_steps

    def recording(wh_, keys=None, memory_mb=512, batches=None):
        read.extend(keys or [])
        return episodes_with_steps(wh_, keys, memory_mb, batches)

    monkeypatch.setattr(layer, "_episodes_with_steps", recording)
    def splits() -> dict[str, str]:
        return {r["trajectory_key"]: r["split"] for r in wh.query("SELECT trajectory_key, split FROM splits").to_pylist()}

    before = splits()
    earlier_cutoff = {"cutoff": "2024-09-01"}  # more episodes after the cutoff: some go to evaluation
    build(str(wh.root), curate=earlier_cutoff)
    after = splits()
    left = {k for k, s in before.items() if s == "train" and after[k] != "train"}
    frag = run_counts(wh, "fragments")
    assert left and frag["outcomes_standing"] >= len(left) and frag["rebuilt"] >= frag["outcomes_standing"], frag
    assert not left & set(read), "the steps of episodes that left train were read again"
    monkeypatch.undo()

    full = Warehouse(tmp_path / "full")
    shutil.copytree(wh.root, full.root)
    build(str(full.root), full=True, curate=earlier_cutoff)
    for table in ("outcomes", "fragments", "task_stats"):
        assert rows(wh, table) == rows(full, table), f"{table}: incremental build differs from a full rebuild"
    # the stored inputs digests are those of the inputs now (what the next build compares: nothing to redo)
    stored = {r["trajectory_key"]: r["inputs_digest"]
              for r in wh.query("SELECT trajectory_key, inputs_digest FROM outcomes").to_pylist()}
    assert stored == {k: d for k, (d, _) in layer.episode_inputs(wh).items()}


def test_an_outcome_stands_only_when_made_from_the_batch_as_it_is():
    """The stored digest must be one the batch's current fingerprint makes: an episode whose batch was
    redacted again (another fingerprint), that is new, or that gives fragments now is redone."""
    from trajwh.fragments.layer import Inputs, _inputs_digest, _outcomes_standing

    seen = Inputs(batch_of={"a": "b1", "b": "b1", "c": "b2", "d": "b1"}, giving={"d"},
                  values=({"train", "valid"}, {(), ("future_fix",)}, {"allow"}), sources={"b1": "f1", "b2": "f2-now"})
    previous = {"a": (_inputs_digest("f1", "train", [], "allow"), "t"),  # moved out of train: stands
                "c": (_inputs_digest("f2-before", "train", [], "allow"), "t"),  # its batch changed: redone
                "d": (_inputs_digest("f1", "valid", [], "allow"), "t")}  # gives fragments now: redone
    assert _outcomes_standing(["a", "b", "c", "d"], previous, seen) == ["a"]  # b is new
