"""The per-batch assets as Dagster dynamic partitions (one per committed ingest batch): a whole
build records each batch's materialization; a run of one partition builds that batch alone,
holding the writers' lock shared so runs of other batches go on beside it; runs in any order,
then a whole build, give the tables one whole build gives (docs/scale.md, "Per-batch work")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from conftest import SHARED_CORPUS, trajwh_cmd
from test_incremental import DERIVED, rows
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines.assets import BATCHES
from trajwh.pipelines.definitions import build, sync_partitions
from trajwh.redaction.vault import Vault
from trajwh.schemas.errors import ConfigError

PER_BATCH_TABLES = ("episodes", "steps", "redacted_episodes", "redacted_steps", "redaction_events", "episode_features")


def _shards(corpus: Path) -> list[Path]:
    shards = sorted(p for p in corpus.iterdir() if p.name.startswith("episodes-"))
    assert len(shards) >= 3
    return shards


def _ingested(root: Path, shards: list[Path]) -> tuple[Warehouse, list[str]]:
    wh = Warehouse(root)
    return wh, [ingest_paths(wh, [p], IngestOptions(source="synthetic")).batch_id for p in shards]


def _materialized(instance: dg.DagsterInstance, asset: str) -> set[str]:
    return set(instance.get_materialized_partitions(dg.AssetKey(asset)))


def _twins(tmp_path: Path, paths: list[Path]) -> tuple[Warehouse, Warehouse, list[str]]:
    """Two warehouses holding the same batches (one ingest each of ``paths``) and one placeholder
    salt, so that their redacted text can be compared."""
    whole = Warehouse(tmp_path / "whole")
    batches = [ingest_paths(whole, [p], IngestOptions(source="cases")).batch_id for p in paths]
    parts = Warehouse(tmp_path / "parts")
    shutil.copytree(whole.root, parts.root)
    salt = Vault(whole, None).salt()
    (parts.root / "vault").mkdir(exist_ok=True)
    (parts.root / "vault" / "salt").write_bytes(salt)
    return whole, parts, batches


def _same_tables(parts: Warehouse, whole: Warehouse, tables: tuple[str, ...] = (*PER_BATCH_TABLES, *DERIVED)) -> None:
    for table in tables:
        extra = ("quarantine_id", "quarantined_at") if table == "quarantine" else ()  # (named by the run, timed)
        assert rows(parts, table, extra) == rows(whole, table, extra), f"{table}: partition runs differ from one whole build"


def test_partition_runs_in_any_order_then_a_build_equal_one_whole_build(tmp_path: Path, small_corpus: Path):
    whole, parts, batches = _twins(tmp_path, _shards(small_corpus))
    one = dg.DagsterInstance.ephemeral()
    build(str(whole.root), instance=one)
    assert one.get_dynamic_partitions(BATCHES.name) == batches  # in commit order
    for asset in PER_BATCH_TABLES:  # the whole build's range run recorded every batch
        assert _materialized(one, asset) == set(batches)

    many = dg.DagsterInstance.ephemeral()
    for i, batch in enumerate(reversed(batches)):  # the latest first: each keeps what no earlier batch holds
        result = build(str(parts.root), instance=many, batch=batch)
        done = {m.asset_key.to_user_string() for m in result.get_asset_materialization_events()}
        assert done == set(PER_BATCH_TABLES)  # the per-batch assets alone, not the global ones
        assert {m.partition for m in result.get_asset_materialization_events()} == {batch}
        assert _materialized(many, "redacted_steps") == set(batches[-i - 1:])
        built = parts.query("SELECT DISTINCT batch_id FROM table_files WHERE table_name = 'redacted_steps'")
        assert sorted(built.column(0).to_pylist()) == sorted(batches[-i - 1:])  # that batch, nothing else
    assert parts.query("SELECT count(*) FROM table_files WHERE table_name = 'fragments'").column(0)[0].as_py() == 0
    last = build(str(parts.root), instance=many)
    meta = {m.asset_key.to_user_string(): m.materialization.metadata for m in last.get_asset_materialization_events()}
    assert meta["episodes"]["batches_built"].value == 0  # the partition runs left nothing to do
    assert meta["redacted_steps"]["batches_built"].value == 0
    _same_tables(parts, whole)


def _summary(wh: Warehouse, run: int = -1) -> dict:
    import orjson

    counts = wh.query("SELECT counts FROM runs WHERE job = 'normalize' AND status = 'succeeded' ORDER BY finished_at"
                      ).column(0).to_pylist()
    return orjson.loads(counts[run])


def _held(wh: Warehouse, key_of: str) -> list[str]:
    return wh.query("SELECT _batch_id FROM episodes WHERE source_episode_id = ? ORDER BY 1", [key_of]).column(0).to_pylist()


def test_a_later_batch_built_first_is_marked_when_an_earlier_one_keeps_its_key(tmp_path: Path, cases: Path):
    """The same episode (one trajectory key) in two batches: the earlier one keeps it. Built in
    the other order, the earlier batch's commit marks the later one to build again."""
    whole, parts, (early, late) = _twins(tmp_path, [cases / "two_episodes.jsonl", cases / "one_episode_pretty.json"])
    build(str(whole.root))
    assert _held(whole, "case-ep-1") == [early]
    instance = dg.DagsterInstance.ephemeral()
    build(str(parts.root), instance=instance, batch=late)
    assert _held(parts, "case-ep-1") == [late]  # no earlier batch holds it yet
    build(str(parts.root), instance=instance, batch=early)
    assert _summary(parts)["marked_stale"] == [late]
    assert _held(parts, "case-ep-1") == [early]  # never twice: the later batch left the manifest to build again
    for table in ("episodes", "redacted_episodes", "redacted_steps"):
        assert parts.query(f"SELECT count(*) FROM {table} WHERE _batch_id = ?", [late]).column(0)[0].as_py() == 0
    build(str(parts.root), instance=instance, batch=late)  # built again: the key is the earlier batch's now
    assert _held(parts, "case-ep-1") == [early]
    assert _summary(parts)["quarantine_reasons"] == {"duplicate_episode": 1}
    build(str(parts.root), instance=instance)
    _same_tables(parts, whole, (*PER_BATCH_TABLES, "quarantine"))


def test_a_batch_overtaken_by_an_earlier_commit_is_built_again(tmp_path: Path, cases: Path, monkeypatch):
    """An earlier batch commits a key of this batch while this batch is being built (a run of
    the earlier batch's partition beside it): its commit is refused in the transaction and it is
    built again against what is committed, keeping nothing twice."""
    from trajwh.ingest import normalize

    whole, parts, (early, late) = _twins(tmp_path, [cases / "two_episodes.jsonl", cases / "one_episode_pretty.json"])
    build(str(whole.root))
    run = normalize._BatchNormalizer.run
    beside = []

    def run_then_let_the_earlier_batch_commit(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        if self.batch_id == late and not beside:  # once: the earlier batch's run finishes meanwhile
            beside.append(normalize.normalize_warehouse(parts, run_id="beside", batches=[early]))
        return out

    monkeypatch.setattr(normalize._BatchNormalizer, "run", run_then_let_the_earlier_batch_commit)
    summary = normalize.normalize_warehouse(parts, run_id="late", batches=[late])
    assert beside and beside[0].batches_done == 1 and beside[0].marked_stale == []  # nothing of the late one yet
    assert summary.batches_done == 1 and summary.quarantine_reasons == {"duplicate_episode": 1}  # once, not twice
    assert _held(parts, "case-ep-1") == [early]
    monkeypatch.undo()
    build(str(parts.root))
    _same_tables(parts, whole, (*PER_BATCH_TABLES, "quarantine"))


def test_per_batch_writers_share_the_lock_and_whole_stages_wait(tmp_path: Path, small_corpus: Path):
    from trajwh.schemas.errors import WarehouseBusyError

    wh, batches = _ingested(tmp_path / "wh", _shards(small_corpus)[:2])
    with wh.write_session("another batch's run", shared=True):
        build(str(wh.root), batch=batches[0])  # goes on beside it
        with pytest.raises(WarehouseBusyError, match="another writer holds its lock"):
            with wh.write_session("curate", timeout=0.5):
                pass
    with pytest.raises(ConfigError, match="batch nope is not a committed batch"):
        build(str(wh.root), batch="nope")


def test_two_batch_runs_at_once_then_a_build_equal_one_whole_build(tmp_path: Path, small_corpus: Path):
    whole, parts, batches = _twins(tmp_path, _shards(small_corpus)[:3])
    build(str(whole.root))
    cli = [sys.executable, "-m", "trajwh.pipelines.cli", "build", "--warehouse", str(parts.root)]
    runs = [subprocess.Popen([*cli, "--batch", b], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for b in batches[1:]]
    for p in runs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert sorted(parts.query("SELECT DISTINCT batch_id FROM table_files WHERE table_name = 'redacted_steps'")
                  .column(0).to_pylist()) == sorted(batches[1:])
    build(str(parts.root))
    _same_tables(parts, whole)


def test_partitions_follow_the_committed_batches(tmp_path: Path, small_corpus: Path):
    wh, batches = _ingested(tmp_path / "wh", _shards(small_corpus)[:2])
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(BATCHES.name, ["gone", batches[1]])  # a forgotten batch; one out of order
    assert sync_partitions(wh, instance) == batches
    assert instance.get_dynamic_partitions(BATCHES.name) == batches
    assert sync_partitions(Warehouse(tmp_path / "empty"), dg.DagsterInstance.ephemeral()) == []


def test_the_cli_builds_one_batch(tmp_path: Path, small_corpus: Path):
    wh, batches = _ingested(tmp_path / "wh", _shards(small_corpus)[:2])
    cli = [sys.executable, "-m", "trajwh.pipelines.cli", "build", "--warehouse", str(wh.root)]
    bad = subprocess.run([*cli, "--batch", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "nope is not a committed batch" in bad.stderr, bad.stderr
    both = subprocess.run([*cli, "--batch", batches[0], "--select", "packs"], capture_output=True, text=True)
    assert both.returncode == 2 and "cannot be combined" in both.stderr
    ok = subprocess.run([*cli, "--batch", batches[1]], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert wh.query("SELECT DISTINCT batch_id FROM table_files WHERE table_name = 'episodes'").column(0).to_pylist() \
        == [batches[1]]


#: every asset up to the fragments: what the packs' tokens need built first
_BEFORE_PACKS = [*PER_BATCH_TABLES, "near_dup_clusters", "task_groups", "splits", "leak_flags", "license_facts",
                 "eligibility", "outcomes", "task_stats", "fragments"]


def _files(wh: Warehouse, table: str) -> list[dict]:
    return wh.query("SELECT path, batch_id FROM table_files WHERE table_name = ? ORDER BY path", [table]).to_pylist()


def _meta(result, asset: str) -> dict:
    return {k: v.value for m in result.get_asset_materialization_events() if m.asset_key.to_user_string() == asset
            for k, v in m.materialization.metadata.items()}


def _token_check(result) -> dg.AssetCheckEvaluation:
    (check,) = [c for c in result.get_asset_check_evaluations() if c.check_name == "token_rows_whole"]
    return check


def test_pack_tokens_partitions_render_their_batches_ahead_and_the_build_takes_them(tmp_path: Path,
                                                                                    small_corpus: Path):
    """Tokenization is a per-batch partition too: a run of one batch's pack_tokens renders that batch's
    token chunks into pack_tokens_staged (pack_tokens and packs untouched: readers see one consistent
    set), and the next build takes the staged files as they are (nothing rendered again); the tables
    equal one whole build's."""
    whole, parts, batches = _twins(tmp_path, _shards(small_corpus))
    build(str(whole.root))
    instance = dg.DagsterInstance.ephemeral()
    build(str(parts.root), instance=instance, only=_BEFORE_PACKS)
    for i, batch in enumerate(batches):
        result = build(str(parts.root), instance=instance, only=["pack_tokens"], batch=batch)
        assert {(m.asset_key.to_user_string(), m.partition) for m in result.get_asset_materialization_events()} \
            == {("pack_tokens", batch)}
        assert _token_check(result).passed
        staged = _files(parts, "pack_tokens_staged")
        assert sorted({f["batch_id"] for f in staged}) == sorted(batches[:i + 1])  # its batch's files, under its id
        assert _files(parts, "pack_tokens") == [] and _files(parts, "packs") == []  # what readers see: untouched
        chunks = parts.query("SELECT DISTINCT chunk_id FROM pack_tokens_staged WHERE starts_with(chunk_id, ?)",
                             [batch]).column(0).to_pylist()
        assert chunks and _meta(result, "pack_tokens")["chunks:staged"] == len(chunks)
    assert _materialized(instance, "pack_tokens") == set(batches)
    again = build(str(parts.root), instance=instance, only=["pack_tokens"], batch=batches[0])  # nothing new
    assert _meta(again, "pack_tokens")["chunks:staged"] == 0 and _meta(again, "pack_tokens")["units_rendered"] == 0
    staged = {f["path"] for f in _files(parts, "pack_tokens_staged")}

    last = build(str(parts.root), instance=instance)
    tokens = _meta(last, "pack_tokens")
    assert tokens["units_rendered"] == 0 and tokens["chunks:staged_taken"] == len(staged)
    assert {f["path"] for f in _files(parts, "pack_tokens")} == staged  # the staged files, as they are
    assert _files(parts, "pack_tokens_staged") == []
    assert _token_check(last).passed
    _same_tables(parts, whole, DERIVED)


def test_staged_tokens_of_changed_units_then_a_build_equal_a_full_build(tmp_path: Path, small_corpus: Path):
    """Staged over a built set after the splits moved (an earlier cutoff): the changed chunks are
    staged, the build takes those still current and replaces the stored files of those chunks
    (never both), and the set equals a full build's with the same cutoff."""
    whole, parts, batches = _twins(tmp_path, _shards(small_corpus))
    earlier_cutoff = {"cutoff": "2024-09-01"}
    build(str(whole.root), full=True, curate=earlier_cutoff)
    instance = dg.DagsterInstance.ephemeral()
    build(str(parts.root), instance=instance)
    before = {f["path"] for f in _files(parts, "pack_tokens")}
    build(str(parts.root), instance=instance, only=_BEFORE_PACKS, curate=earlier_cutoff)
    staged = build(str(parts.root), instance=instance, only=["pack_tokens"])  # every batch, as a backfill would
    assert {m.partition for m in staged.get_asset_materialization_events()} == set(batches)
    n = _meta(staged, "pack_tokens")["chunks:staged"]
    assert n > 0 and _meta(staged, "pack_tokens")["units_rendered"] > 0  # chunks whose units moved
    assert {f["path"] for f in _files(parts, "pack_tokens")} == before  # untouched until the packs build
    last = build(str(parts.root), instance=instance, curate=earlier_cutoff)
    assert _meta(last, "pack_tokens")["chunks:staged_taken"] == n
    assert parts.query("SELECT count(*) - count(DISTINCT unit_id) FROM pack_tokens").column(0)[0].as_py() == 0
    _same_tables(parts, whole, DERIVED)


_REAL = ("mini-swe-agent-2x", "mini-swe-agent-traj-json", "openhands-v1", "swe-agent-traj")


@pytest.mark.skipif(not SHARED_CORPUS.is_dir(), reason=f"real corpus not found at {SHARED_CORPUS}")
def test_real_harness_batches_staged_then_a_build_equal_a_whole_build(tmp_path: Path, small_corpus: Path):
    """Staging on real files: a synthetic batch and one batch per real harness folder; each real
    batch's pack_tokens partition run alone stages its chunks (their real renderings: tool calls,
    observations, system prompts), and the build takes those files as they are: every table
    equals one whole build's."""
    real = [SHARED_CORPUS / d for d in _REAL if (SHARED_CORPUS / d).is_dir()]
    assert real, f"none of {_REAL} in {SHARED_CORPUS}"
    whole, parts, batches = _twins(tmp_path, [_shards(small_corpus)[0], *real])
    build(str(whole.root))
    instance = dg.DagsterInstance.ephemeral()
    build(str(parts.root), instance=instance, only=_BEFORE_PACKS)
    for batch in batches[1:]:
        result = build(str(parts.root), instance=instance, only=["pack_tokens"], batch=batch)
        assert _token_check(result).passed
    staged = _files(parts, "pack_tokens_staged")
    assert {f["batch_id"] for f in staged} >= {b for b in batches[1:] if whole.query(
        "SELECT count(*) FROM pack_tokens t JOIN redacted_episodes e USING (trajectory_key) WHERE e._batch_id = ?",
        [b]).column(0)[0].as_py()}  # every real batch that gives units staged them
    assert {f["batch_id"] for f in staged} & set(batches[1:]), "no real batch gave a unit to stage"
    last = build(str(parts.root), instance=instance)
    assert _meta(last, "pack_tokens")["chunks:staged_taken"] == len(staged) and _token_check(last).passed
    assert {f["path"] for f in staged} <= {f["path"] for f in _files(parts, "pack_tokens")}  # taken as they are
    _same_tables(parts, whole, DERIVED)


def test_a_token_file_that_is_not_whole_fails_the_check(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from trajwh.packing.verify import check_token_files, token_file_violations

    wh = Warehouse(tmp_path / "wh")
    with wh.write_session("test"):
        pass
    good = {"pack_set": "ps-1", "unit_id": "u1", "chunk_id": "b1/0000000000", "n_tokens": 3, "n_trainable": 1,
            "input_ids": [1, 2, 3], "loss_mask": [0, 0, 1], "piece_trainable": [1]}
    rows = [good, {**good, "unit_id": "u2", "n_tokens": 4},  # a length that is not its list's
            {**good, "unit_id": "u3", "n_trainable": 2},  # a trained count that is not its mask's
            {**good, "unit_id": "u4", "chunk_id": "b2/0000000000"}]  # another chunk, of another batch
    path = tmp_path / "tokens.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    r = check_token_files(wh, "ps-1", [str(path)], batches=["b1"])
    assert (r["bad_length"], r["bad_trainable"], r["files_with_chunks"], r["other_batch"]) == (1, 1, 1, 1)
    assert token_file_violations(r) == 4
    pq.write_table(pa.Table.from_pylist([good]), path)
    assert token_file_violations(check_token_files(wh, "ps-1", [str(path)], batches=["b1"])) == 0
    assert check_token_files(wh, "ps-2", [str(path)])["other_set"] == 1


def test_the_cli_stages_one_batch_of_tokens(tmp_path: Path, small_corpus: Path):
    wh, batches = _ingested(tmp_path / "wh", _shards(small_corpus)[:2])
    whole = subprocess.run([*trajwh_cmd(), "build", "--warehouse", str(wh.root)], capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    # its summary: one line per asset, a per-batch asset with its batches (never a line per batch)
    lines = [line.strip() for line in whole.stdout.splitlines() if line.strip().startswith("✓ ") and ": rows=" in line]
    assert len(lines) == len({line.split(":")[0] for line in lines}), whole.stdout
    assert any(line.startswith("✓ pack_tokens (2 batches):") for line in lines), whole.stdout
    assert any(line.startswith("✓ packs:") for line in lines), whole.stdout
    cli = [*trajwh_cmd(), "pack", "--warehouse", str(wh.root)]
    bad = subprocess.run([*cli, "--batch", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "nope is not a committed batch" in bad.stderr, bad.stderr
    both = subprocess.run([*cli, "--batch", batches[0], "--full"], capture_output=True, text=True)
    assert both.returncode == 2 and "not both" in both.stderr
    ok = subprocess.run([*cli, "--batch", batches[1], "--seq-len", "4096"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "token chunks staged" in ok.stdout
    # another length is another set: its chunks of that batch are staged, nothing else
    assert {f["batch_id"] for f in _files(wh, "pack_tokens_staged")} == {batches[1]}
    assert wh.query("SELECT DISTINCT seq_len FROM pack_tokens_staged").column(0).to_pylist() == [4096]
    # a --full build of that set renders everything itself: the staged files go, none taken
    from trajwh.packing.layer import PackConfig, build_packs

    s = build_packs(wh, run_id="full", cfg=PackConfig(seq_len=4096), full=True)
    assert s.chunks["staged_taken"] == 0 and s.units_rendered == s.fragments > 0
    assert _files(wh, "pack_tokens_staged") == []


def test_two_token_partition_runs_at_once_then_a_build_equal_one_whole_build(tmp_path: Path, small_corpus: Path):
    """Two batches' pack_tokens partitions staged by two processes at once (the write lock shared),
    then a build: it takes both batches' chunks and equals one whole build."""
    whole, parts, batches = _twins(tmp_path, _shards(small_corpus)[:3])
    build(str(whole.root))
    build(str(parts.root), only=_BEFORE_PACKS)
    cli = [*trajwh_cmd(), "pack", "--warehouse", str(parts.root)]
    runs = [subprocess.Popen([*cli, "--batch", b], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for b in batches[1:]]
    for p in runs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert sorted({f["batch_id"] for f in _files(parts, "pack_tokens_staged")}) == sorted(batches[1:])
    last = build(str(parts.root))
    taken = _meta(last, "pack_tokens")["chunks:staged_taken"]
    assert taken == parts.query("SELECT count(DISTINCT chunk_id) FROM pack_tokens WHERE NOT starts_with(chunk_id, ?)",
                                [batches[0]]).column(0)[0].as_py()
    _same_tables(parts, whole, DERIVED)


_PER_BATCH_RUN = """
import json, sys
import dagster as dg
from trajwh.pipelines.definitions import per_batch_job_def, warehouse_instance
instance = warehouse_instance(sys.argv[1])
with dg.execute_job(dg.reconstructable(per_batch_job_def), instance, tags={"dagster/partition": sys.argv[2]}) as r:
    print(json.dumps({"success": r.success,
                      "pids": sorted({e.pid for e in r.all_events if e.event_type_value == "STEP_START"}),
                      "assets": sorted({m.asset_key.to_user_string() for m in r.get_asset_materialization_events()})}))
"""


def test_two_partitions_at_once_with_the_multiprocess_executor(tmp_path: Path, small_corpus: Path):
    """The per_batch job (Dagster's multiprocess executor: each step in its own process) run for two
    batches at once, as a backfill's launched runs are: both succeed, each step ran in a process of
    its own, and a build after them equals one whole build."""
    import json

    from trajwh.pipelines.definitions import warehouse_instance

    whole, parts, batches = _twins(tmp_path, _shards(small_corpus)[:3])
    build(str(whole.root))
    instance = warehouse_instance(parts.root)  # persistent: the runs' step processes report to it
    sync_partitions(parts, instance)
    env = {**os.environ, "TRAJWH_WAREHOUSE": str(parts.root)}  # (the steps' warehouse resource)
    runs = [subprocess.Popen([sys.executable, "-c", _PER_BATCH_RUN, str(parts.root), b], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for b in batches[1:]]
    for p in runs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        r = json.loads(out.strip().splitlines()[-1])
        assert r["success"] and p.pid not in r["pids"] and len(r["pids"]) >= 3, r  # a process per step
        assert r["assets"] == sorted(PER_BATCH_TABLES)
    assert sorted(parts.query("SELECT DISTINCT batch_id FROM table_files WHERE table_name = 'episode_features'")
                  .column(0).to_pylist()) == sorted(batches[1:])
    build(str(parts.root), instance=instance)
    _same_tables(parts, whole)
