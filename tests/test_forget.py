"""`trajwh forget` / `verify-forget`: a withdrawn source leaves every layer, the rest stays as it was,
the tombstone refuses it at re-ingest, a crash after any stage is finished by `--resume`, and the
proof finds a planted leak."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pyarrow as pa
import pytest
from conftest import trajwh_cmd
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.forget import CRASH_ENV, STAGES, _strings, forget, verify_forget
from trajwh.lineage.impact import Selector, impact
from trajwh.pipelines.definitions import build

CASES = Path(__file__).resolve().parent / "cases"
#: lineage columns that say which run or inputs made a row (a rebuild changes them, not the values)
_LINEAGE = ("_run_id", "_transform_version", "inputs_digest")


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    from trajwh.pipelines.definitions import build
    from trajwh.synth.generator import SynthConfig, generate_corpus

    root = tmp_path_factory.mktemp("forget")
    generate_corpus(SynthConfig(episodes=40, seed=11), root / "synth")
    wh = Warehouse(root / "wh")
    ingest_paths(wh, [root / "synth"], IngestOptions(source="synth"))
    ingest_paths(wh, [CASES / "two_episodes.jsonl"], IngestOptions(source="cases"))
    ingest_paths(wh, [CASES / "curation"], IngestOptions(source="remotes"))
    assert build(str(wh.root)).success
    return wh.root


@pytest.fixture
def wh(template, tmp_path, monkeypatch) -> Warehouse:
    monkeypatch.delenv(CRASH_ENV, raising=False)
    shutil.copytree(template, tmp_path / "wh")
    return Warehouse(tmp_path / "wh")


def _hashes(wh: Warehouse, table: str, keys: list[str], exclude: tuple[str, ...] = ()) -> list[str]:
    con = wh.connect()
    try:
        con.register("_k", pa.table({"k": pa.array(keys, pa.string())}))
        have = {r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()}
        ex = [c for c in exclude if c in have]
        cols = f"* EXCLUDE ({', '.join(ex)})" if ex else "*"
        return sorted(r[0] for r in con.execute(
            f"SELECT md5(CAST(t AS VARCHAR)) FROM (SELECT {cols} FROM {table} WHERE trajectory_key NOT IN "
            f"(SELECT k FROM _k)) t").fetchall())
    finally:
        con.close()


def _count(wh: Warehouse, sql: str, params=None) -> int:
    return wh.query(sql, params or []).column(0)[0].as_py()


def test_forget_a_source_removes_it_everywhere_and_leaves_the_rest(wh):
    plan = impact(wh, "source:remotes")
    keys = plan.episodes
    assert keys and plan.records
    before = {t: _hashes(wh, t, keys) for t in ("episodes", "steps", "redacted_episodes", "redacted_steps")}
    curated_before = {t: _hashes(wh, t, keys, _LINEAGE) for t in ("splits", "task_groups", "near_dup_clusters", "outcomes")}
    result = forget(wh, "source:remotes", "license revoked")
    assert result.status == "verified", result.verify
    assert result.verify["rows_left"] == {} and result.verify["files_with_probes"] == {}
    assert result.sources["files_rewritten"] > 0 and result.sources["bytes_written"] > 0 < result.sources["bytes_replaced"]
    assert result.sources["rows_removed"]["raw_records"] == len(plan.records)
    for table in ("raw_records", "episodes", "steps", "redacted_episodes", "redacted_steps", "redaction_events",
                  "splits", "outcomes", "fragments", "near_dup_clusters", "task_groups", "episode_features"):
        col = "record_id" if table == "raw_records" else "trajectory_key"
        ids_ = plan.records if table == "raw_records" else keys
        assert _count(wh, f"SELECT count(*) FROM {table} WHERE list_contains(?, {col})", [ids_]) == 0, table
    assert _count(wh, "SELECT count(*) FROM raw_records WHERE source = 'remotes'") == 0
    # everything else: source layers byte for byte, curated values apart from lineage columns
    for t, h in before.items():
        assert _hashes(wh, t, keys) == h, t
    for t, h in curated_before.items():
        assert _hashes(wh, t, keys, _LINEAGE) == h, t
    # the tombstone holds ids, digests and fingerprints, never content
    row = wh.query("SELECT * FROM deletions").to_pylist()[0]
    assert row["selector"] == "source:remotes" and row["reason"] == "license revoked"
    assert len(row["record_digests"]) == len(plan.records) and row["probe_fingerprints"]
    text = str(row)
    assert "WidgetLib" not in text and "acme-widgets" not in text
    assert verify_forget(wh, row["request_id"][:10])["ok"]
    # the packs check's ledger stays, holding only units the packs still hold (none of the forgotten)
    from trajwh.packing.verify import read_ledger

    pack_set = wh.query("SELECT DISTINCT pack_set FROM packs").column(0).to_pylist()[0]
    ledger = read_ledger(wh, pack_set)
    held = set(wh.query("SELECT t.s.fragment_id FROM packs p, unnest(p.segments) AS t(s)").column(0).to_pylist())
    assert ledger and set(ledger) <= held  # and the packs hold no forgotten episode (rows_left above)
    assert sorted(p.name for p in (wh.root / "_cache").iterdir()) == ["pack_drops", "pack_token_meta", "verified_packs"]
    # the token meta: only rows of the files still listed
    from trajwh.packing.windows import _cached_meta

    meta = _cached_meta(wh, pack_set)
    assert meta is not None and set(meta.column("sha256").to_pylist()) <= set(wh.query(
        "SELECT sha256 FROM table_files WHERE table_name = 'pack_tokens'").column(0).to_pylist())
    assert set(meta.column("unit_id").to_pylist()) <= set(wh.query("SELECT unit_id FROM pack_tokens").column(0).to_pylist())
    from trajwh.packing.verify import _write_ledger, prune_ledgers

    _write_ledger(wh, pack_set, {**ledger, "fr-gone": ["key", "digest"]})  # a unit no pack holds
    assert prune_ledgers(wh) == 1 and read_ledger(wh, pack_set) == ledger
    # the units held are read from the files ledger's rows of the files still listed: a row of a
    # file that is gone holds nothing, and a listed file the files ledger lacks is read
    from trajwh.packing.verify import _write_files_ledger, read_files_ledger

    files = read_files_ledger(wh, pack_set)
    assert files
    dropped = sorted(files)[0]
    _write_files_ledger(wh, pack_set, {**{k: v for k, v in files.items() if k != dropped},
                                       "0" * 64: [["fr-gone2", "key", "digest"]]})
    _write_ledger(wh, pack_set, {**ledger, "fr-gone2": ["key", "digest"]})
    assert prune_ledgers(wh) == 1 and read_ledger(wh, pack_set) == ledger
    assert "0" * 64 not in read_files_ledger(wh, pack_set)


def test_staged_token_rows_of_the_episodes_go(wh):
    """Tokens rendered ahead (a pack_tokens partition run alone, here of another packer's set: the
    same units) are rows of the forgotten episode too: they go, the others stay, and the proof holds."""
    from trajwh.packing.layer import PackConfig, stage_pack_tokens

    assert stage_pack_tokens(wh, run_id="ahead", cfg=PackConfig(packer="first-fit")).chunks["staged"] > 0
    staged = wh.query("SELECT DISTINCT trajectory_key FROM pack_tokens_staged ORDER BY 1").column(0).to_pylist()
    key = staged[0]
    result = forget(wh, f"episode:{key}", "asked to be forgotten")
    assert result.status == "verified", result.verify
    assert _count(wh, "SELECT count(*) FROM pack_tokens_staged WHERE trajectory_key = ?", [key]) == 0
    assert wh.query("SELECT DISTINCT trajectory_key FROM pack_tokens_staged ORDER BY 1").column(0).to_pylist() \
        == staged[1:]


def test_reingest_of_forgotten_records_is_refused_and_counted(wh):
    forget(wh, "source:cases", "withdrawn")
    s = ingest_paths(wh, [CASES / "two_episodes.jsonl"], IngestOptions(source="another-name"))
    assert s.n_forgotten == 2 and s.n_new == 0
    assert _count(wh, "SELECT count(*) FROM quarantine WHERE batch_id = ?", [s.batch_id]) == 0  # not stored anywhere
    again = ingest_paths(wh, [CASES / "two_episodes.jsonl"], IngestOptions(source="cases", allow_forgotten=True))
    assert again.n_new == 2 and again.n_forgotten == 0


def test_the_proof_finds_a_planted_copy(wh):
    rec = wh.query("""SELECT r.record_id, r.payload, e.child_id AS key FROM raw_records r JOIN lineage_edges e
                      ON e.parent_id = r.record_id AND e.child_table = 'episodes' WHERE r.source = 'synth'
                      ORDER BY r.byte_length DESC LIMIT 1""").to_pylist()[0]
    redacted = wh.query("SELECT coalesce(text, '') || chr(10) || coalesce(observation, '') FROM redacted_steps "
                        "WHERE trajectory_key = ? ORDER BY step_index", [rec["key"]]).column(0).to_pylist()
    result = forget(wh, f"episode:{rec['key']}", "a person asked to be forgotten")
    assert result.status == "verified"
    request = wh.query("SELECT request_id FROM deletions").column(0)[0].as_py()
    clean = verify_forget(wh, request)
    assert clean["ok"] and clean["probes"] > clean["probes_shared"]  # some probes are its own text only
    (wh.root / "_cache").mkdir(exist_ok=True)
    (wh.root / "_cache" / "stale.json").write_text("\n".join(_strings(rec["payload"]) + redacted))
    found = verify_forget(wh, request)
    assert not found["ok"] and list(found["files_with_probes"]) == ["_cache/stale.json"]
    # the catalog's own tables are read through DuckDB too: a copy in a run's error is named there
    (wh.root / "_cache" / "stale.json").unlink()
    from trajwh.lineage.catalog import now_utc
    from trajwh.lineage.rebuild import run_row

    with wh.write_session("test") as session:
        row = run_row("run-planted", "test", now_utc(), params={}, counts={}, code_version="")
        session.upsert_rows("runs", [{**row, "status": "failed", "error": "\n".join(redacted)[:2000]}])
    found = verify_forget(wh, request)
    assert not found["ok"] and "catalog:runs" in found["files_with_probes"]


@pytest.mark.parametrize("digest", ["blake3", "sha256"])
def test_the_proof_reads_older_files_by_digest_and_searches_one_that_changed(wh, tmp_path, digest):
    """A data file the manifest listed before the forgotten batch was ingested cannot hold what was
    made from it: the proof checks its bytes against the recorded digest instead of searching it
    (its BLAKE3; its sha256 when the manifest has none, as for a file an earlier version listed).
    The same file with other bytes (a forgotten payload written into it) is searched and named."""
    import pyarrow.parquet as pq
    from trajwh.lineage.storage import content_blake3
    from trajwh.pipelines.definitions import build
    from trajwh.synth.generator import SynthConfig, generate_corpus

    built = wh.query("SELECT path FROM table_files WHERE table_name = 'steps' ORDER BY path").column(0).to_pylist()
    recorded = wh.query("SELECT path, blake3 FROM table_files").to_pylist()
    assert recorded and all(r["blake3"] == content_blake3(wh.data_path(r["path"])) for r in recorded)
    if digest == "sha256":
        con = wh.connect(read_only=False)
        con.execute("UPDATE table_files SET blake3 = NULL")
        con.close()
    generate_corpus(SynthConfig(episodes=6, seed=99), tmp_path / "late")
    ingest_paths(wh, [tmp_path / "late"], IngestOptions(source="late"))
    assert build(str(wh.root)).success
    listed = wh.query("SELECT count(*) FILTER (WHERE blake3 IS NULL) AS none, count(*) AS n FROM table_files").to_pylist()[0]
    assert 0 < listed["none"] < listed["n"] if digest == "sha256" else listed["none"] == 0
    payloads = wh.query("SELECT payload FROM raw_records WHERE source = 'late'").column(0).to_pylist()
    result = forget(wh, "source:late", "license revoked")
    assert result.status == "verified", result.verify
    assert result.verify["files_unchanged"] >= len(built) > 0
    request = wh.query("SELECT request_id FROM deletions").column(0)[0].as_py()
    target = wh.data_path(built[0])
    t = pq.read_table(target)
    text = "\n".join(s for p in payloads for s in _strings(p))
    t = t.set_column(t.schema.get_field_index("text"), "text",
                     pa.array([text] + t.column("text").to_pylist()[1:], pa.string()))
    gone = wh.query("SELECT trajectory_keys[1] FROM deletions").column(0)[0].as_py()
    t = t.set_column(t.schema.get_field_index("trajectory_key"), "trajectory_key",
                     pa.array([gone] + t.column("trajectory_key").to_pylist()[1:], pa.string()))
    pq.write_table(t, target)  # the same path, other bytes than the manifest recorded
    found = verify_forget(wh, request)
    assert not found["ok"] and list(found["files_with_probes"]) == [built[0]]
    assert found["rows_left"] == {"steps": 1}  # its rows are read for forgotten ids too
    assert found["files_unchanged"] == result.verify["files_unchanged"] - 1


def test_a_file_changed_during_the_forget_is_searched_by_its_proof(wh, tmp_path, monkeypatch):
    """The proof does not read again a file the plan of the same forget found with its recorded
    digest while its stamp (inode, size, modification and change times) is the one it had then;
    one whose bytes changed meanwhile (here: during the repair) is searched and named."""
    import pyarrow.parquet as pq
    from trajwh.lineage import forget as forget_mod
    from trajwh.pipelines.definitions import build
    from trajwh.synth.generator import SynthConfig, generate_corpus

    built = wh.query("SELECT path FROM table_files WHERE table_name = 'steps' ORDER BY path").column(0).to_pylist()
    generate_corpus(SynthConfig(episodes=6, seed=99), tmp_path / "late")
    ingest_paths(wh, [tmp_path / "late"], IngestOptions(source="late"))
    assert build(str(wh.root)).success
    payloads = wh.query("SELECT payload FROM raw_records WHERE source = 'late'").column(0).to_pylist()
    target, real, hashed = wh.data_path(built[0]), forget_mod._repair, []
    real_same = forget_mod._same_bytes
    monkeypatch.setattr(forget_mod, "_same_bytes", lambda path, rec: hashed.append(path) or real_same(path, rec))

    def repair_then_plant(*args, **kwargs):
        out = real(*args, **kwargs)
        hashed.clear()
        t = pq.read_table(target)
        text = "\n".join(s for p in payloads for s in _strings(p))
        pq.write_table(t.set_column(t.schema.get_field_index("text"), "text",
                                    pa.array([text] + t.column("text").to_pylist()[1:], pa.string())), target)
        return out

    monkeypatch.setattr(forget_mod, "_repair", repair_then_plant)
    result = forget(wh, "source:late", "license revoked")
    assert result.status == "verify_failed" and list(result.verify["files_with_probes"]) == [built[0]]
    # the proof hashed only the changed file again: the others' stamps were those the plan saw
    # (its parts in the worker process do not show here: the changed one is read in this one or there)
    assert set(hashed) <= {str(target)} and result.verify["files_unchanged"] > 0


def test_older_files_are_read_for_forgotten_rows_only_when_their_bytes_changed(wh, tmp_path):
    """The rewrite skips the files listed before the forgotten batch's ingest while their bytes are
    the recorded ones; an older file changed since (here given a row of a forgotten episode) is
    read and rewritten. Tool definitions that older episodes share with the forgotten ones stay."""
    import pyarrow.parquet as pq
    from trajwh.pipelines.definitions import build
    from trajwh.synth.generator import SynthConfig, generate_corpus

    older = wh.query("SELECT path FROM table_files WHERE table_name = 'steps' ORDER BY path").column(0).to_pylist()
    generate_corpus(SynthConfig(episodes=6, seed=99), tmp_path / "late")
    ingest_paths(wh, [tmp_path / "late"], IngestOptions(source="late"))
    assert build(str(wh.root)).success
    late = impact(wh, "source:late").episodes
    target = wh.data_path(older[0])
    t = pq.read_table(target)
    t = t.set_column(t.schema.get_field_index("trajectory_key"), "trajectory_key",
                     pa.array([late[0]] + t.column("trajectory_key").to_pylist()[1:], pa.string()))
    pq.write_table(t, target)  # not the bytes the manifest recorded
    result = forget(wh, "source:late", "license revoked")
    assert result.status == "verified", result.verify
    assert _count(wh, "SELECT count(*) FROM steps WHERE list_contains(?, trajectory_key)", [late]) == 0
    now = set(wh.query("SELECT path FROM table_files WHERE table_name = 'steps'").column(0).to_pylist())
    assert older[0] not in now and set(older[1:]) <= now  # rewritten; the others untouched


@pytest.mark.parametrize("changed", [False, True])
def test_the_candidates_are_drawn_again_here_only_when_an_older_file_changed(wh, tmp_path, monkeypatch, changed):
    """The forget's worker draws the candidate probes while this process reads the older files'
    digests, passing over every file the manifest lists from before the forgotten data came. When
    one of them has other bytes now (here the same rows written again), this process draws them
    again, reading that file."""
    import pyarrow.parquet as pq
    from trajwh.lineage import forget as forget_mod
    from trajwh.pipelines.definitions import build
    from trajwh.synth.generator import SynthConfig, generate_corpus

    older = wh.query("SELECT path FROM table_files WHERE table_name = 'raw_records' ORDER BY path").column(0).to_pylist()
    generate_corpus(SynthConfig(episodes=6, seed=99), tmp_path / "late")
    ingest_paths(wh, [tmp_path / "late"], IngestOptions(source="late"))
    assert build(str(wh.root)).success
    target = wh.data_path(older[0])
    if changed:
        pq.write_table(pq.read_table(target), target, compression="gzip")  # other bytes than the manifest recorded
    calls: list[frozenset[str]] = []
    drawn = forget_mod._plan_candidates

    def spy(wh_, records, episodes, skip=frozenset()):
        calls.append(skip)
        return drawn(wh_, records, episodes, skip)

    monkeypatch.setattr(forget_mod, "_plan_candidates", spy)  # (this process only: the worker's is its own)
    result = forget(wh, "source:late", "license revoked")
    assert result.status == "verified", result.verify
    assert result.verify["probes"] > 0
    if changed:
        assert len(calls) == 1 and calls[0] and str(target) not in calls[0]
    else:
        assert calls == []


def test_a_token_file_a_build_keeps_is_listed_as_when_it_was_written(wh, tmp_path):
    """An incremental build lists the pack token files it keeps again, as they are: they keep the
    time they were first listed, so a forget of the batch that build added reads them by their
    digest (written before that batch existed) instead of searching them."""
    from trajwh.synth.generator import SynthConfig, generate_corpus

    listed = {r["path"]: r["added_at"] for r in wh.query(
        "SELECT path, added_at FROM table_files WHERE table_name = 'pack_tokens'").to_pylist()}
    generate_corpus(SynthConfig(episodes=6, seed=99), tmp_path / "late")
    ingest_paths(wh, [tmp_path / "late"], IngestOptions(source="late"))
    assert build(str(wh.root)).success
    after = {r["path"]: (r["added_at"], r["run_id"]) for r in wh.query(
        "SELECT path, added_at, run_id FROM table_files WHERE table_name = 'pack_tokens'").to_pylist()}
    kept = set(listed) & set(after)
    assert kept and set(after) - kept  # some kept, some written by this build
    assert all(after[p][0] == listed[p] for p in kept)
    last_run = wh.query("SELECT run_id FROM table_files WHERE table_name = 'pack_tokens' "
                        "ORDER BY added_at DESC LIMIT 1").column(0)[0].as_py()
    assert all(after[p][1] == last_run for p in kept)  # listed by this build's run, as before
    result = forget(wh, "source:late", "license revoked")
    assert result.status == "verified", result.verify
    since = orjson.loads(wh.query("SELECT counts FROM deletions").column(0)[0].as_py())["_since"]
    before = {r["path"] for r in wh.query("SELECT path FROM table_files WHERE added_at < ?::TIMESTAMPTZ", [since]).to_pylist()}
    assert kept & before  # the kept token files the forget left listed count as older than the batch
    assert result.verify["files_unchanged"] == len(before)  # all of them read by their digest alone


def test_tool_definitions_an_older_episode_shares_stay(tmp_path):
    """The forgotten episode's tool definitions are those of an episode ingested before it (files
    the rewrite does not read): they stay, and so does that episode."""
    import orjson
    from trajwh.pipelines.definitions import build

    first = orjson.loads((CASES / "openhands_v1" / "output.jsonl").read_text().splitlines()[0])
    again = {**first, "instance_id": str(first.get("instance_id")) + "-again"}
    (tmp_path / "a.jsonl").write_bytes(orjson.dumps(first) + b"\n")
    (tmp_path / "b.jsonl").write_bytes(orjson.dumps(again) + b"\n")
    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [tmp_path / "a.jsonl"], IngestOptions(source="a"))
    assert build(str(wh.root)).success
    ingest_paths(wh, [tmp_path / "b.jsonl"], IngestOptions(source="b"))
    assert build(str(wh.root)).success
    digests = wh.query("SELECT source, tool_schema_digest FROM redacted_episodes ORDER BY 1").to_pylist()
    assert len(digests) == 2 and digests[0]["tool_schema_digest"] == digests[1]["tool_schema_digest"] is not None
    assert forget(wh, "source:b", "withdrawn").status == "verified"
    for table in ("tool_schemas", "redacted_tool_schemas"):
        assert wh.query(f"SELECT tool_schema_digest FROM {table}").column(0).to_pylist() == \
            [digests[0]["tool_schema_digest"]], table
    assert wh.query("SELECT source FROM redacted_episodes").column(0).to_pylist() == ["a"]


def _curate_state(wh: Warehouse) -> dict:
    params = orjson.loads(wh.query("SELECT params FROM runs WHERE job = 'curate' AND status = 'succeeded' "
                                   "ORDER BY finished_at DESC LIMIT 1").column(0)[0].as_py())
    features = sorted(tuple(r.values()) for r in wh.query(
        "SELECT batch_id, transform_version FROM table_files WHERE table_name = 'episode_features'").to_pylist())
    return {"version": params["version"], "near_dup": params["near_dup"], "features": features}


def test_the_curation_made_beside_the_plan_equals_the_one_after_the_rewrite(wh, tmp_path, monkeypatch):
    """A forget whose episodes make up whole batches curates without them while it prepares the
    rewrite, and swaps the curated tables in with it (``_curate_ahead``). The tables are those a
    curation after the rewrite makes (apart from the run that made them), with the same state for
    the next cluster update and the features marked current: the next curation has nothing to do.
    Should that curation fail, the tables are rewritten and curated after the rewrite instead."""
    import trajwh.dedup.layer as dedup_layer
    from trajwh.dedup.layer import curate_warehouse
    from trajwh.lineage import forget as forget_mod
    from trajwh.pipelines.settings import curate_config
    from trajwh.schemas.config import load_settings

    after, failed = (Warehouse(tmp_path / name) for name in ("after", "failed"))
    for other in (after, failed):
        shutil.copytree(wh.root, other.root)
    real, made = forget_mod._curate_ahead, []
    monkeypatch.setattr(forget_mod, "_curate_ahead", lambda *a: made.append(real(*a)) or made[-1])
    assert forget(wh, "source:cases", "withdrawn").status == "verified"
    assert made and made[0] is not None  # the batch goes whole: curated beside the plan
    monkeypatch.setattr(forget_mod, "_curate_ahead", lambda *a: None)
    assert forget(after, "source:cases", "withdrawn").status == "verified"
    monkeypatch.setattr(forget_mod, "_curate_ahead", real)

    def boom(*args, **kwargs):
        raise MemoryError("no room")

    monkeypatch.setattr(dedup_layer, "curated_without", boom)
    messages: list[str] = []
    assert forget(failed, "source:cases", "withdrawn", progress=messages.append).status == "verified"
    assert any("MemoryError: no room" in m for m in messages)
    for table in ("near_dup_clusters", "task_groups", "splits", "leak_flags", "fragments", "outcomes", "episode_features"):
        expected = _hashes_all(after, table, _LINEAGE)
        assert _hashes_all(wh, table, _LINEAGE) == expected == _hashes_all(failed, table, _LINEAGE), table
    state = _curate_state(after)
    assert _curate_state(wh) == state == _curate_state(failed)
    cfg = curate_config(load_settings(None, wh.root))
    summary = curate_warehouse(wh, run_id="next", cfg=cfg)
    assert summary.skipped and summary.batches_featurized == 0


def test_a_batch_that_loses_some_of_its_episodes_is_curated_after_the_rewrite(wh):
    """Its features would be computed again from its rewritten files, so the curation waits for
    them; so it does when the stored features are not current."""
    from trajwh.dedup.layer import CurateConfig, features_current
    from trajwh.lineage import forget as forget_mod

    key = wh.query("SELECT trajectory_key FROM episodes WHERE source = 'synth' ORDER BY 1 LIMIT 1").column(0)[0].as_py()
    with ThreadPoolExecutor(1) as pool:
        assert forget_mod._curate_ahead(wh, impact(wh, f"episode:{key}"), pool) is None
        ahead = forget_mod._curate_ahead(wh, impact(wh, "source:cases"), pool)
        assert ahead is not None and ahead.result().batches
    assert features_current(wh, CurateConfig())
    assert not features_current(wh, CurateConfig(min_actions=CurateConfig().min_actions + 1))
    assert forget(wh, f"episode:{key}", "withdrawn").status == "verified"
    assert _count(wh, "SELECT count(*) FROM splits WHERE trajectory_key = ?", [key]) == 0


def test_a_representative_that_goes_is_replaced(wh, tmp_path):
    import orjson
    from trajwh.pipelines.definitions import build

    rows = wh.query("""SELECT cluster_id, trajectory_key FROM near_dup_clusters
                       WHERE is_representative AND cluster_size > 1 AND len(links) > 0
                       ORDER BY cluster_id LIMIT 1""").to_pylist()
    if not rows:
        pytest.skip("no near-duplicate cluster linked by MinHash with more than one member in this corpus")
    gone = rows[0]["trajectory_key"]
    members = wh.query("SELECT trajectory_key FROM near_dup_clusters WHERE cluster_id = ?",
                       [rows[0]["cluster_id"]]).column(0).to_pylist()
    assert forget(wh, f"episode:{gone}", "test").status == "verified"
    left = wh.query("SELECT is_representative FROM near_dup_clusters WHERE list_contains(?, trajectory_key)",
                    [[m for m in members if m != gone]]).column(0).to_pylist()
    assert left and sum(left) == 1
    # the clusters were updated without the episode (its links gone), and equal a full rebuild's
    counts = orjson.loads(wh.query("SELECT counts FROM runs WHERE job = 'curate' AND status = 'succeeded' "
                                   "ORDER BY finished_at DESC LIMIT 1").column(0)[0].as_py())
    assert counts["clusters_incremental"] and counts["links_kept"] > 0, counts
    assert not wh.query("SELECT count(*) FROM near_dup_clusters WHERE list_contains(list_transform(links, lambda x: "
                        "x.trajectory_key), ?)", [gone]).column(0)[0].as_py()
    full = Warehouse(tmp_path / "full")
    shutil.copytree(wh.root, full.root)
    assert build(str(full.root), full=True).success
    assert _hashes(wh, "near_dup_clusters", [], _LINEAGE) == _hashes(full, "near_dup_clusters", [], _LINEAGE)


def test_vault_entries_of_the_episodes_go(wh, tmp_path, monkeypatch):
    from trajwh.pipelines.definitions import build
    from trajwh.redaction.vault import new_key_file

    key = new_key_file(tmp_path / "vault.key")
    monkeypatch.setenv("TRAJWH_VAULT_KEY_FILE", str(key))
    assert build(str(wh.root), full=True).success
    vault_rows = lambda keys: _count(wh, f"SELECT count(*) FROM read_parquet('{wh.root}/vault/*/part-*.parquet') "  # noqa: E731
                                         "WHERE list_contains(?, scope_id)", [keys])
    keys = wh.query("SELECT DISTINCT trajectory_key FROM redaction_events WHERE table_name <> 'tool_schemas' "
                    "LIMIT 3").column(0).to_pylist()
    assert vault_rows(keys) > 0
    total = _count(wh, f"SELECT count(*) FROM read_parquet('{wh.root}/vault/*/part-*.parquet')")
    r = forget(wh, f"episode:{keys[0]}", "test")
    assert r.status == "verified" and vault_rows(keys[:1]) == 0
    assert _count(wh, f"SELECT count(*) FROM read_parquet('{wh.root}/vault/*/part-*.parquet')") < total


def test_dry_run_changes_nothing(wh):
    files = sorted(p.name for p in wh.root.rglob("*.parquet"))
    plan = forget(wh, "source:cases", "x", dry_run=True)
    assert plan.records and sorted(p.name for p in wh.root.rglob("*.parquet")) == files
    assert _count(wh, "SELECT count(*) FROM deletions") == 0


@pytest.mark.parametrize("stage", STAGES[:-1])
def test_a_crash_after_any_stage_is_finished_by_resume(wh, stage, tmp_path):
    reference = Warehouse(tmp_path / "reference")
    shutil.copytree(wh.root, reference.root)
    assert forget(reference, "source:cases", "withdrawn").status == "verified"
    env = {**os.environ, CRASH_ENV: stage}
    died = subprocess.run([*trajwh_cmd(), "forget", "source:cases", "--reason", "withdrawn", "-w", str(wh.root)],
                          env=env, capture_output=True, text=True)
    assert died.returncode == 137, died.stderr[-2000:]
    assert wh.query("SELECT status FROM deletions").column(0).to_pylist() == [stage]
    env.pop(CRASH_ENV)
    done = subprocess.run([*trajwh_cmd(), "forget", "--resume", "-w", str(wh.root)], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert wh.query("SELECT status FROM deletions").column(0).to_pylist() == ["verified"]
    for table in ("raw_records", "episodes", "redacted_steps", "splits", "fragments"):
        exclude = _LINEAGE if table in ("splits", "fragments") else ()
        assert _hashes_all(wh, table, exclude) == _hashes_all(reference, table, exclude), table


def _hashes_all(wh: Warehouse, table: str, exclude: tuple[str, ...]) -> list[str]:
    con = wh.connect()
    try:
        have = {r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()}
        ex = [c for c in exclude if c in have] + (["ingested_at"] if table == "raw_records" else [])
        cols = f"* EXCLUDE ({', '.join(ex)})" if ex else "*"
        return sorted(r[0] for r in con.execute(f"SELECT md5(CAST(t AS VARCHAR)) FROM (SELECT {cols} FROM {table}) t").fetchall())
    finally:
        con.close()


def test_bad_requests_are_refused(wh):
    from trajwh.schemas.errors import ConfigError

    with pytest.raises(ConfigError, match="reason"):
        forget(wh, "source:cases", "  ")
    with pytest.raises(ConfigError, match="matches nothing"):
        forget(wh, "source:no-such-source", "x")
    with pytest.raises(ConfigError):
        verify_forget(wh, "del-0000")


def test_exports_that_hold_the_episodes_are_written_again(wh, tmp_path):
    """Exports the tool wrote (lineage/exports.py) are listed by impact; a forget writes those that
    hold a forgotten episode again without it (a card or a query result: always), lists one that
    is gone as missing, leaves the others untouched; the proof scans what it wrote outside."""
    from trajwh.lineage.exports import run_export

    gone = set(impact(wh, Selector.parse("source:cases")).episodes)
    other = wh.query("SELECT trajectory_key FROM episodes WHERE NOT list_contains(?, trajectory_key) ORDER BY 1 LIMIT 1",
                     [sorted(gone)]).column(0)[0].as_py()
    out = {name: str(tmp_path / name) for name in ("all.jsonl.gz", "q.csv", "card", "lost.jsonl", "other.jsonl")}
    run_export(wh, "episodes", {"fmt": "native", "out": out["all.jsonl.gz"], "layer": "normalized"})
    run_export(wh, "sql", {"query": "SELECT trajectory_key, text FROM steps ORDER BY step_id", "out": out["q.csv"], "fmt": "csv"})
    run_export(wh, "card", {"out": out["card"]})
    out["card-mine"] = str(wh.root / "card-mine")  # an export into the folder, named like its own cards
    run_export(wh, "card", {"out": out["card-mine"]})
    from trajwh.datacards.card import build_card

    build_card(wh, split="test")  # the warehouse's own card of one split: <warehouse>/card-test
    run_export(wh, "episodes", {"fmt": "native", "out": out["lost.jsonl"], "layer": "normalized"})
    run_export(wh, "episodes", {"fmt": "native", "out": out["other.jsonl"], "layer": "normalized",
                                "where": f"trajectory_key = '{other}'"})
    os.remove(out["lost.jsonl"])
    before = Path(out["other.jsonl"]).read_bytes(), os.stat(out["other.jsonl"]).st_mtime_ns
    assert any(k in Path(out["q.csv"]).read_text() for k in gone)

    plan = impact(wh, Selector.parse("source:cases"))
    assert sorted(plan.layers["exports"]["ids"]) == sorted(out[n] for n in ("all.jsonl.gz", "q.csv", "card", "card-mine",
                                                                            "lost.jsonl"))
    assert plan.layers["exports"]["missing"] == [out["lost.jsonl"]]

    own_card = wh.root / "card"
    assert (own_card / "card.json").exists()
    r = forget(wh, "source:cases", "withdrawn")
    assert r.status == "verified", r.verify
    assert {e["path"]: e["status"] for e in r.exports} == {out["all.jsonl.gz"]: "regenerated", out["q.csv"]: "regenerated",
                                                           out["card"]: "regenerated", out["lost.jsonl"]: "missing",
                                                           out["card-mine"]: "regenerated", str(own_card): "withdrawn",
                                                           str(wh.root / "card-test"): "withdrawn"}
    # the warehouse's own cards counted the episodes: the next build (or `trajwh card`) writes them
    assert not own_card.exists() and not (wh.root / "card-test").exists()
    assert (Path(out["card-mine"]) / "card.json").exists()
    import gzip

    text = gzip.decompress(Path(out["all.jsonl.gz"]).read_bytes()).decode() + Path(out["q.csv"]).read_text()
    assert not any(k in text for k in gone) and other in text
    assert (Path(out["other.jsonl"]).read_bytes(), os.stat(out["other.jsonl"]).st_mtime_ns) == before
    request = wh.query("SELECT request_id FROM deletions").column(0)[0].as_py()
    assert verify_forget(wh, request)["ok"]
    assert build(str(wh.root)).success
    card = orjson.loads((own_card / "card.json").read_bytes())
    exported = orjson.loads(Path(out["card"], "card.json").read_bytes())  # written again during the forget
    assert [d["status"] for d in card["sections"]["deletions"]["details"]] == ["verified"]
    for doc in (card, exported):
        doc.pop("generated_at"), doc["sections"].pop("deletions")
    assert card == exported


def test_the_proof_scans_exports_written_outside_the_warehouse(wh, tmp_path):
    from trajwh.lineage.exports import run_export

    rec = wh.query("""SELECT r.payload, e.child_id AS key FROM raw_records r JOIN lineage_edges e
                      ON e.parent_id = r.record_id AND e.child_table = 'episodes' WHERE r.source = 'synth'
                      ORDER BY r.byte_length DESC LIMIT 1""").to_pylist()[0]
    out = tmp_path / "kept.csv"
    run_export(wh, "sql", {"query": "SELECT 1 AS x", "out": str(out), "fmt": "csv"})
    assert forget(wh, f"episode:{rec['key']}", "asked").status == "verified"
    out.write_text("\n".join(_strings(rec["payload"])))  # someone put the forgotten text back in it
    request = wh.query("SELECT request_id FROM deletions").column(0)[0].as_py()
    found = verify_forget(wh, request)
    assert not found["ok"] and list(found["files_with_probes"]) == [str(out)]


def _stats(wh: Warehouse) -> list[tuple]:
    return sorted(tuple(r.values()) for r in wh.query(
        "SELECT * EXCLUDE (_run_id, _transform, _transform_version) FROM task_stats").to_pylist())


def test_task_statistics_follow_the_episodes_that_stay(wh, tmp_path):
    """Forgetting one attempt of a task makes its statistics again from the attempts that stay;
    forgetting every attempt of a task takes its rows away (its id is the task's own text). Both
    as a full rebuild of what is left makes them."""
    from trajwh.pipelines.definitions import build

    tasks = wh.query("SELECT coalesce(nullif(task_id, ''), nullif(instance_id, ''), 'episode:' || trajectory_key) AS t, "
                     "list(trajectory_key ORDER BY trajectory_key) AS keys FROM redacted_episodes GROUP BY 1 "
                     "ORDER BY len(keys) DESC, t").to_pylist()
    shared, single = tasks[0], next(t for t in tasks if len(t["keys"]) == 1 and not t["t"].startswith("episode:"))
    assert len(shared["keys"]) >= 2
    n_before = _count(wh, "SELECT sum(episodes) FROM task_stats WHERE level = 'task_policy' AND task_id = ?", [shared["t"]])
    assert forget(wh, f"episode:{shared['keys'][0]}", "one attempt withdrawn").status == "verified"
    assert forget(wh, f"task:{single['t']}", "task withdrawn").status == "verified"
    assert _count(wh, "SELECT sum(episodes) FROM task_stats WHERE level = 'task_policy' AND task_id = ?",
                  [shared["t"]]) == n_before - 1
    assert _count(wh, "SELECT count(*) FROM task_stats WHERE task_id = ?", [single["t"]]) == 0
    after = _stats(wh)
    full = tmp_path / "full"
    shutil.copytree(wh.root, full)
    assert build(str(full), full=True).success
    assert _stats(Warehouse(full)) == after


def test_vault_entries_of_a_repository_scope_go_with_the_episodes_that_made_them(wh, tmp_path, monkeypatch):
    """With one placeholder per value and repository (``--scope repository``), a vault entry is not
    scoped to an episode: it goes when no episode that stays in its batch uses it. (The synthetic
    episodes share the curation case's repository: their batch's entries for it stay.)"""
    from trajwh.pipelines.definitions import build
    from trajwh.redaction.vault import new_key_file

    monkeypatch.setenv("TRAJWH_VAULT_KEY_FILE", str(new_key_file(tmp_path / "vault.key")))
    ingest_paths(wh, [CASES / "redaction"], IngestOptions(source="other"))  # a token and an email that stay
    assert build(str(wh.root), full=True, scope="repository").success
    batch = wh.query("SELECT DISTINCT _batch_id FROM episodes WHERE source = 'remotes'").column(0).to_pylist()
    assert len(batch) == 1
    vault = f"read_parquet('{wh.root}/vault/*/part-*.parquet', filename = true)"
    mine = f"SELECT count(*) FROM {vault} WHERE contains(filename, ?)"
    assert _count(wh, mine + " AND scope_kind = 'repository'", [batch[0]]) > 0
    rest = lambda: _count(wh, f"SELECT count(*) FROM {vault} WHERE NOT contains(filename, ?)", batch)  # noqa: E731
    others = rest()
    assert others > 0
    assert forget(wh, "source:remotes", "repository went private").status == "verified"
    assert not list((wh.root / "vault" / batch[0]).glob("part-*.parquet"))  # the batch's entries all went
    assert rest() == others


def test_a_repair_that_fails_leaves_the_request_open_and_resume_finishes_it(wh, monkeypatch):
    """A stage of the repair that fails: the error names the way on, the request stays at
    ``sources_removed`` (the forgotten rows are gone already), the forget's run is recorded as
    failed with the cause, and ``resume`` finishes the request."""
    import trajwh.packing.layer as packing_layer
    from trajwh.lineage.forget import pending_requests, resume
    from trajwh.schemas.errors import ConfigError

    real = packing_layer.build_packs

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(packing_layer, "build_packs", broken)
    with pytest.raises(ConfigError, match="disk full") as err:
        forget(wh, "source:cases", "withdrawn")
    assert "forget --resume" in err.value.valid
    assert wh.query("SELECT status FROM deletions").column(0).to_pylist() == ["sources_removed"]
    run = wh.query("SELECT status, error FROM runs WHERE job = 'forget' ORDER BY started_at DESC LIMIT 1").to_pylist()[0]
    assert run["status"] == "failed" and "OSError: disk full" in run["error"]
    assert _count(wh, "SELECT count(*) FROM raw_records WHERE source = 'cases'") == 0
    monkeypatch.setattr(packing_layer, "build_packs", real)
    (request,) = pending_requests(wh)
    assert resume(wh, request).status == "verified"
    assert wh.query("SELECT status FROM runs WHERE job = 'forget' ORDER BY started_at DESC LIMIT 1").column(0)[0].as_py() == "succeeded"


def test_a_failure_before_the_request_is_stored_deletes_nothing(wh, monkeypatch):
    """Stage 1's rewritten copies are written while the worker draws the candidates, before the
    request is stored; a failure there (here: the warehouse salt unreadable) leaves no request, every
    listed file and row in place, and only unlisted copies, which the next exclusive writer removes.
    The same forget then goes through."""
    from trajwh.lineage import forget as forget_mod

    def data_files() -> set[str]:
        return {str(p.relative_to(wh.data)) for p in wh.data.rglob("part-*.parquet") if "vault" not in p.parts}

    listed = set(wh.query("SELECT path FROM table_files").column(0).to_pylist())
    assert data_files() == listed
    rows = _count(wh, "SELECT count(*) FROM raw_records WHERE source = 'cases'")
    assert rows > 0
    real = forget_mod._salt

    def unreadable(wh_):
        raise OSError("salt unreadable")

    monkeypatch.setattr(forget_mod, "_salt", unreadable)
    with pytest.raises(OSError, match="salt unreadable"):
        forget(wh, "source:cases", "withdrawn")
    assert _count(wh, "SELECT count(*) FROM deletions") == 0
    assert set(wh.query("SELECT path FROM table_files").column(0).to_pylist()) == listed
    assert _count(wh, "SELECT count(*) FROM raw_records WHERE source = 'cases'") == rows
    assert data_files() > listed  # the copies, listed by no manifest
    with wh.write_session("test"):
        pass
    assert data_files() == listed
    monkeypatch.setattr(forget_mod, "_salt", real)
    assert forget(wh, "source:cases", "withdrawn").status == "verified"
    assert _count(wh, "SELECT count(*) FROM raw_records WHERE source = 'cases'") == 0


def test_the_proof_names_a_lineage_edge_whose_step_is_gone(wh):
    result = forget(wh, "source:cases", "withdrawn")
    assert result.status == "verified" and "lineage_edges (dangling)" not in result.verify["rows_left"]
    request = wh.query("SELECT request_id FROM deletions").column(0)[0].as_py()
    edge = wh.query("SELECT * FROM lineage_edges WHERE child_table = 'steps' LIMIT 1")
    assert edge.num_rows == 1
    # an edge written later (a file the proof reads) to a step no table holds
    gone = edge.set_column(edge.schema.get_field_index("child_id"), "child_id", pa.array(["step-that-is-gone"]))
    with wh.write_session("test") as session:
        session.commit([session.write("lineage_edges", gone)])
    found = verify_forget(wh, request)
    assert not found["ok"] and found["rows_left"] == {"lineage_edges (dangling)": 1}


def test_the_proof_counts_forgotten_rows_in_the_files_its_scan_reads(wh, monkeypatch):
    """The proof counts the rows that carry a forgotten id while it searches each data file, not in
    a second read per table: a row planted after the forget (an episode row of a forgotten key, in
    a new file of the manifest) is named with the per-table query made to fail."""
    import trajwh.lineage.forget as F

    result = forget(wh, "source:cases", "withdrawn")
    assert result.status == "verified"
    request = wh.query("SELECT request_id FROM deletions").column(0)[0].as_py()
    gone = wh.query("SELECT trajectory_keys[1] FROM deletions").column(0)[0].as_py()
    row = wh.query("SELECT * FROM episodes LIMIT 1")
    planted = row.set_column(row.schema.get_field_index("trajectory_key"), "trajectory_key", pa.array([gone]))
    with wh.write_session("test") as session:
        session.commit([session.write("episodes", planted)])

    def second_read(*args, **kwargs):
        raise AssertionError("a data file the scan read was read again for its rows")

    monkeypatch.setattr(F, "_files_with_rows", second_read)
    found = verify_forget(wh, request)
    assert not found["ok"] and found["rows_left"] == {"episodes": 1}


def test_the_proof_names_a_near_duplicate_link_to_a_forgotten_episode(wh):
    """A staying episode's cluster row that still links to a forgotten one (the repair's clusters
    drop such links) is named by the proof, though the row's own key is not forgotten."""
    result = forget(wh, "source:cases", "withdrawn")
    assert result.status == "verified" and "near_dup_clusters (links)" not in result.verify["rows_left"]
    request = wh.query("SELECT request_id FROM deletions").column(0)[0].as_py()
    gone = wh.query("SELECT trajectory_keys[1] FROM deletions").column(0)[0].as_py()
    row = wh.query("SELECT * FROM near_dup_clusters LIMIT 1")
    assert row.num_rows == 1 and row.column("trajectory_key")[0].as_py() != gone
    field = row.schema.field("links")
    link = {"trajectory_key": gone, "signal": "text", "similarity": 1.0}
    planted = row.set_column(row.schema.get_field_index("links"), field, pa.array([[link]], type=field.type))
    with wh.write_session("test") as session:
        session.commit([session.write("near_dup_clusters", planted)])
    found = verify_forget(wh, request)
    assert not found["ok"] and found["rows_left"] == {"near_dup_clusters (links)": 1}


def test_a_forget_withdraws_the_card_copies_in_the_dagster_runs(wh):
    """Builds before 2026-12-07 recorded the data card's text as its materialization's metadata, a
    copy of the card in the warehouse's Dagster instance (found by the proof on real trajectories:
    a policy name only the forgotten episodes had). The forget deletes the runs that hold one, and
    no byte of it stays in the storage files; a run without one stays. The card asset now records
    the card's digest instead."""
    import dagster as dg
    from trajwh.lineage.forget import probe_windows
    from trajwh.pipelines.assets import data_card
    from trajwh.pipelines.definitions import DAGSTER_DIR, warehouse_instance
    from trajwh.pipelines.resources import WarehouseResource

    payload = wh.query("SELECT payload FROM raw_records WHERE record_id = ?",
                       [impact(wh, "source:remotes").records[0]]).column(0)[0].as_py()
    needle = probe_windows("\n".join(_strings(payload)), "card", 1)[0]  # text that JSON writes as it is

    @dg.asset(name="data_card")
    def old_card():
        return dg.MaterializeResult(metadata={"card": dg.MetadataValue.md(f"# Data card\n\n| policy | {needle} |")})

    @dg.asset(name="other_asset")
    def other():
        return dg.MaterializeResult(metadata={"rows": 1})

    instance = warehouse_instance(wh.root)
    try:
        card_run = dg.materialize([old_card], instance=instance).run_id
        other_run = dg.materialize([other], instance=instance).run_id
    finally:
        instance.dispose()
    home = wh.root / DAGSTER_DIR

    def holding() -> list[str]:
        return [str(p) for p in home.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]

    assert holding()
    result = forget(wh, "source:remotes", "license revoked")
    assert result.status == "verified", result.verify
    assert [e for e in result.exports if e["kind"] == "dagster_run"] == [
        {"kind": "dagster_run", "path": str(home / "history" / "runs" / f"{card_run}.db"), "status": "deleted",
         "note": "a copy of the data card in its event log; the catalog's runs table keeps the run"}]
    assert holding() == []
    instance = warehouse_instance(wh.root)
    try:
        assert instance.get_run_by_id(card_run) is None and instance.get_run_by_id(other_run) is not None
        assert instance.fetch_materializations(dg.AssetKey("data_card"), limit=10).records == []
        # the card asset records the card's digest, not its text
        run = dg.materialize([data_card], instance=instance, resources={"warehouse": WarehouseResource(path=str(wh.root))})
        (event,) = [e for e in run.get_asset_materialization_events()]
        meta = event.materialization.metadata
        assert "card" not in meta and len(meta["card_sha256"].value) == 64
    finally:
        instance.dispose()
    assert forget(wh, "source:cases", "again").status == "verified"  # nothing of the card left to withdraw
