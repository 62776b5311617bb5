"""The Dagster graph in-process: materialization, checks, replay on an adapter bump, the sensor."""

from __future__ import annotations

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from trajwh.ingest.adapters.native import NativeAdapter
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.checks import cached, lineage_gaps, passed, stored_result
from trajwh.pipelines.checks import ALL_CHECKS
from trajwh.pipelines.definitions import (
    ASSETS,
    build,
    daily_build,
    defs,
    ingest_landing_job,
    landing_sensor,
    warehouse_instance,
)
from trajwh.pipelines.resources import WarehouseResource


def checks_of(result) -> dict[str, bool]:
    return {e.check_name: e.passed for e in result.get_asset_check_evaluations()}


def test_a_check_with_a_long_name_is_cached_in_a_file_the_file_system_takes(wh, cases):
    """A check's cache file is named after the check; a name longer than a file name may be (the
    reconcile check lists every companion format, and the list grows) is cut and digested, still
    found by its prefix. (A build failed with "File name too long" once the formats grew.)"""
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    name = "reconcile:" + ",".join(f"companion-format-{i}" for i in range(40))
    calls = []
    first = cached(wh, name, ["raw_records"], lambda: calls.append(1) or {"x_violations": 0, "n": 3})
    again = cached(wh, name, ["raw_records"], lambda: calls.append(1) or {"x_violations": 0, "n": 3})
    assert (first["cached"], again["cached"], len(calls)) == (False, True, 1)
    assert stored_result(wh, "reconcile:companion-format-0") == {"x_violations": 0, "n": 3}
    assert max(len(p.name) for p in (wh.root / "_cache" / "checks").iterdir()) < 255
    other = cached(wh, name + ",one-more", ["raw_records"], lambda: calls.append(1) or {"n": 4})
    assert (other["cached"], other["n"], len(calls)) == (False, 4, 2)  # another long name: another file


def test_definitions_load():
    repo = defs.get_repository_def()
    assert {k.to_user_string() for k in repo.asset_graph.get_all_asset_keys()} == {"raw_records", "episodes", "steps",
                                                                                       "redacted_episodes", "redacted_steps",
                                                                                       "redaction_events", "near_dup_clusters",
                                                                                       "task_groups", "splits", "leak_flags",
                                                                                       "outcomes", "task_stats", "fragments",
                                                                                       "packs", "pack_tokens", "license_facts", "eligibility",
                                                                                       "data_card", "episode_features"}
    assert defs.resolve_job_def("build") is not None
    assert defs.resolve_schedule_def("daily_build").cron_schedule == "0 3 * * *"


def test_graph_ingests_builds_and_passes_checks(wh, small_corpus):
    result = build(str(wh.root), include_ingest=True,
                   ingest_config={"paths": [str(small_corpus)], "source": "synthetic"})
    assert result.success
    # every check ran (raw_records is selected this time) and passed
    assert checks_of(result) == {c.name: True for d in [*ALL_CHECKS, *ASSETS] for c in d.check_specs}
    assert len(checks_of(result)) == 21 and checks_of(result)["raw_records_are_whole"]
    assert checks_of(result)["token_rows_whole"]  # (run in the packing step)
    mats = {m.asset_key.to_user_string(): m.materialization.metadata for m in result.get_asset_materialization_events()}
    for table in ("episodes", "redacted_steps", "splits", "fragments", "eligibility", "packs"):  # the table as it is
        md = mats[table]
        assert md["dagster/row_count"].value == wh.query(f"SELECT count(*) FROM {table}").column(0)[0].as_py()
        assert md["dagster/table_name"].value == f"catalog.{table}" and md["dagster/column_schema"].value.columns
    counts = wh.query("SELECT (SELECT count(*) FROM episodes) AS e, (SELECT count(*) FROM steps) AS s, "
                      "(SELECT sum(n_steps) FROM episodes) AS n").to_pylist()[0]
    assert counts["e"] == 150 and counts["s"] == counts["n"] > 150 * 5
    # a second build has nothing to do
    again = build(str(wh.root))
    md = again.get_asset_materialization_events()[0].materialization.metadata
    assert md["batches_built"].value == 0 and md["batches_unchanged"].value == 1


def test_bumping_the_adapter_version_replays_the_normalized_layer(wh, small_corpus, monkeypatch):
    ingest_paths(wh, [small_corpus], IngestOptions(source="synthetic"))
    build(str(wh.root))
    before = wh.query("SELECT step_id, _transform_version, _run_id FROM steps ORDER BY step_id").to_pylist()
    files_before = set(wh.files("steps"))
    assert {r["_transform_version"] for r in before} == {NativeAdapter.version}

    monkeypatch.setattr(NativeAdapter, "version", "1.0.1-test")
    result = build(str(wh.root))
    assert all(checks_of(result).values())
    after = wh.query("SELECT step_id, _transform_version, _run_id FROM steps ORDER BY step_id").to_pylist()
    assert [r["step_id"] for r in after] == [r["step_id"] for r in before]  # same ids: replay, not new data
    assert {r["_transform_version"] for r in after} == {"1.0.1-test"}
    assert {r["_run_id"] for r in after} == {result.run_id}
    assert not files_before & set(wh.files("steps"))  # old files replaced...
    assert all(not p.exists() for p in files_before)  # ...and removed from disk
    edges = wh.query("SELECT DISTINCT transform_version FROM lineage_edges WHERE transform LIKE 'adapter:%'").column(0).to_pylist()
    assert edges == ["1.0.1-test"]


def test_lineage_check_fails_when_a_raw_parent_is_missing(wh, cases):
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    build(str(wh.root))
    assert passed(lineage_gaps(wh, "steps"))
    with wh.write_session("test") as s:  # drop the raw file from the manifest behind the build's back
        s.commit(removed=wh.files("raw_records"))
    gaps = lineage_gaps(wh, "steps")
    assert gaps["missing_raw_parent_violations"] == 12 and not passed(gaps)
    from trajwh.pipelines.checks import _lineage_by_batch

    by_batch = _lineage_by_batch(wh, "steps")  # what the build's check computes, batch by batch
    assert {k: by_batch[k] for k in gaps} == gaps and not by_batch["cached"]
    assert _lineage_by_batch(wh, "steps")["cached"]  # nothing changed: the batch's result is reused


def test_the_lineage_check_by_batch_adds_up_to_the_whole_check(wh, cases):
    """Checked batch by batch, lineage gives the counts of the whole-table query, and a new batch
    is checked alone; an edge lost in one batch is found there."""
    from trajwh.pipelines.checks import _lineage_by_batch

    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    build(str(wh.root))
    ingest_paths(wh, [cases / "crlf_blank_lines.jsonl"], IngestOptions(source="cases"))
    build(str(wh.root))
    batches = wh.query("SELECT DISTINCT batch_id FROM table_files WHERE table_name = 'steps'").column(0).to_pylist()
    assert len(batches) == 2
    for table in ("episodes", "steps", "redacted_steps"):
        whole, parts = lineage_gaps(wh, table), _lineage_by_batch(wh, table)
        assert passed(whole) and {k: parts[k] for k in whole} == whole and parts["rows"] > 0, table
    rel = wh.query("SELECT path FROM table_files WHERE table_name = 'lineage_edges' AND batch_id = ? "
                   "AND transform_version NOT LIKE 'redact@%' ORDER BY path LIMIT 1", [batches[0]]).column(0)[0].as_py()
    t = pq.read_table(wh.root / rel)
    keep = pc.invert(pc.equal(t.column("child_table"), "steps"))
    with wh.write_session("test") as s:  # the batch's step edges lost behind the build's back
        s.commit([s.write("lineage_edges", t.filter(keep))], removed=[wh.root / rel], batch_id=batches[0])
    whole, parts = lineage_gaps(wh, "steps"), _lineage_by_batch(wh, "steps")
    assert whole["missing_edge_violations"] > 0 and {k: parts[k] for k in whole} == whole
    assert parts["batches_cached"] == 1  # the other batch's result reused


def test_the_reconcile_check_goes_batch_by_batch_and_finds_what_a_batch_lost(wh, cases):
    """Raw records against episodes, quarantine and steps, per batch: a new batch is reconciled
    alone; an episode, a step or a key tampered with in one batch is found; a key two batches
    share is found though each batch alone is sound."""
    from trajwh.ingest.adapters.registry import adapters
    from trajwh.lineage.checks import reconcile_normalized

    companions = [a.name for a in adapters() if a.companion]
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    build(str(wh.root))
    ingest_paths(wh, [cases / "crlf_blank_lines.jsonl"], IngestOptions(source="cases"))
    build(str(wh.root))
    first = reconcile_normalized(wh, companions)
    assert passed(first) and first["episodes"] == wh.query("SELECT count(*) FROM episodes").column(0)[0].as_py() > 2
    assert first["raw_records"] >= first["episodes"]
    batches = wh.query("SELECT batch_id, min(path) AS path FROM table_files WHERE table_name = 'episodes' "
                       "GROUP BY 1 ORDER BY 1").to_pylist()
    assert len(batches) == 2
    # the first batch loses an episode row: its raw record is unaccounted for, its steps are orphans
    episodes = pq.read_table(wh.root / batches[0]["path"])
    with wh.write_session("test") as s:
        s.commit([s.write("episodes", episodes.slice(1))], removed=[wh.root / batches[0]["path"]],
                 batch_id=batches[0]["batch_id"])
    lost = reconcile_normalized(wh, companions)
    assert lost["unaccounted_record_violations"] == 1 and lost["episodes"] == first["episodes"] - 1
    # the second batch also holds an episode of the first (its key and steps twice, across batches only)
    steps = pq.read_table(wh.files("steps", batch_id=batches[0]["batch_id"])[0])
    mine = steps.filter(pc.equal(steps.column("trajectory_key"), episodes.column("trajectory_key")[1]))
    assert len(mine) > 0
    again = episodes.slice(1, 1)  # (another run's copy: the same bytes would be the same content-named file)
    again = again.set_column(again.schema.get_field_index("_run_id"), "_run_id", pa.array(["again"]))
    mine = mine.set_column(mine.schema.get_field_index("_run_id"), "_run_id", pa.array(["again"] * len(mine)))
    with wh.write_session("test") as s:
        s.commit([s.write("episodes", again), s.write("steps", mine)], batch_id=batches[1]["batch_id"])
    twice = reconcile_normalized(wh, companions)
    assert twice["duplicate_key_violations"] == 1 and twice["unaccounted_record_violations"] == 1
    assert twice["step_count_violations"] == 0 and twice["duplicate_step_violations"] == 0
    # ... and a step whose id is not the one its (episode, index) names
    bad = mine.set_column(mine.schema.get_field_index("step_id"), "step_id",
                          pc.utf8_upper(mine.column("step_id")))
    with wh.write_session("test") as s:
        s.commit([s.write("steps", bad)], batch_id=batches[1]["batch_id"])
    wrong = reconcile_normalized(wh, companions)
    assert wrong["step_id_violations"] == len(mine) and wrong["step_count_violations"] >= 1
    assert not passed(wrong)


def test_dagster_finds_the_definitions_from_the_repository_root():
    """[tool.dagster] in pyproject.toml: `dagster dev` / `dagster definitions validate` need no -m."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("dagster")
    if not exe.exists():
        exe = shutil.which("dagster")
    r = subprocess.run([str(exe), "definitions", "validate"], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Validation successful for code location trajectory_warehouse" in r.stdout + r.stderr


def test_dg_finds_the_definitions_from_the_repository_root():
    """[tool.dg] in pyproject.toml: `dg check defs` (and `dg dev`) from the repository root."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("dg")
    if not exe.exists():
        pytest.skip("dg (dagster-dg-cli, in the dev extra) is not installed")
    env = {**os.environ, "VIRTUAL_ENV": str(Path(sys.executable).parents[1])}
    r = subprocess.run([str(exe), "check", "defs"], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "All definitions loaded successfully" in r.stdout + r.stderr, r.stderr[-2000:]


def test_every_asset_has_a_check():
    from trajwh.pipelines.definitions import ASSETS

    keys = {k.to_user_string() for a in ASSETS for k in a.keys}
    checked = {c.asset_key.to_user_string() for d in [*ALL_CHECKS, *ASSETS] for c in d.check_specs}
    assert keys - checked == set()


def test_integrity_checks_fail_on_a_broken_layer(wh, cases):
    """The checks added so every asset has one find what they look for: a near-duplicate cluster
    with two representatives, a card that disagrees with the warehouse."""
    import json

    from trajwh.pipelines.checks import card_agrees_with_warehouse, one_representative_per_cluster
    from trajwh.pipelines.resources import WarehouseResource

    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    result = build(str(wh.root), include_ingest=False)
    assert {e.check_name for e in result.get_asset_check_evaluations() if e.passed} >= {
        "one_representative_per_cluster", "card_agrees_with_warehouse", "one_group_per_episode"}
    res = WarehouseResource(path=str(wh.root))
    card = wh.root / "card" / "card.json"
    doc = json.loads(card.read_text())
    doc["sections"]["funnel"]["episodes"] += 1
    card.write_text(json.dumps(doc))
    assert not card_agrees_with_warehouse(res).passed
    rows = wh.query("SELECT * FROM near_dup_clusters").to_pylist()
    with wh.write_session("test") as s:  # every member a representative
        import pyarrow as pa
        from trajwh.schemas.arrow import PARQUET_TABLES, arrow_schema

        data = pa.Table.from_pylist([{**r, "is_representative": True, "cluster_id": "c", "cluster_size": len(rows)}
                                     for r in rows], schema=arrow_schema(PARQUET_TABLES["near_dup_clusters"]))
        s.commit([s.write("near_dup_clusters", data)], removed=wh.files("near_dup_clusters"))
    assert len(rows) > 1 and not one_representative_per_cluster(res).passed


def test_every_asset_that_must_stop_a_bad_build_has_a_blocking_check():
    blocking = {(c.asset_key.to_user_string(), c.name) for d in [*ALL_CHECKS, *ASSETS] for c in d.check_specs
                if c.blocking}
    for asset, check in [("episodes", "episodes_have_lineage"), ("steps", "steps_have_lineage"),
                         ("redacted_steps", "redacted_layer_has_no_secrets"),
                         ("redacted_steps", "redacted_steps_have_lineage"), ("splits", "no_group_crosses_splits"),
                         ("fragments", "fragments_only_from_train"), ("outcomes", "one_outcome_per_episode"),
                         ("eligibility", "every_episode_decided"), ("packs", "packs_round_trip"),
                         ("pack_tokens", "token_rows_whole")]:
        assert (asset, check) in blocking


def test_an_asset_selection_builds_whole_steps_or_says_what_is_valid(wh, cases):
    from trajwh.pipelines.definitions import resolve_selection
    from trajwh.schemas.errors import ConfigError

    assert resolve_selection("splits") == (["leak_flags", "near_dup_clusters", "splits", "task_groups"],
                                           ["leak_flags", "near_dup_clusters", "task_groups"])
    assert "fragments" in resolve_selection("group:curated")[0]  # outcomes are built with the fragments
    assert resolve_selection("+eligibility")[0] == [  # one level up, and the steps' other outputs
        "eligibility", "license_facts", "redacted_episodes", "redacted_steps", "redaction_events"]
    for bad, msg in (("nope:x", "is not an asset selection"), ("group:nope", "selects no asset")):
        with pytest.raises(ConfigError, match=msg) as err:
            resolve_selection(bad)
        assert "group:NAME (cards, curated" in str(err.value) and "splits" in str(err.value)
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    assert build(str(wh.root)).success
    result = build(str(wh.root), only=resolve_selection("splits")[0])
    assert {m.asset_key.to_user_string() for m in result.get_asset_materialization_events()} == {
        "leak_flags", "near_dup_clusters", "splits", "task_groups"}


def test_a_selection_that_leaves_out_an_unbuilt_batch_layer_says_so(wh, cases):
    """After an ingest, '+fragments' (direct parents only) would build the later layers without
    the new batch, whose normalized layer does not exist yet: the build says so before it runs."""
    from trajwh.pipelines.definitions import resolve_selection, unbuilt_upstream

    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    assert build(str(wh.root)).success
    assert unbuilt_upstream(wh, resolve_selection("+fragments")[0]) == []
    ingest_paths(wh, [cases / "curation"], IngestOptions(source="more"))
    new = wh.query("SELECT batch_id FROM batches ORDER BY committed_at DESC LIMIT 1").column(0)[0].as_py()
    [msg] = unbuilt_upstream(wh, resolve_selection("+fragments")[0])
    assert msg.startswith("1 ingested batch(es) have no normalized layer yet") and new in msg
    assert unbuilt_upstream(wh, resolve_selection("*fragments")[0]) == []  # everything upstream: nothing left out
    assert unbuilt_upstream(wh, resolve_selection("episodes")[0]) == []
    import subprocess

    from conftest import trajwh_cmd

    out = subprocess.run([*trajwh_cmd(), "build", "-w", str(wh.root), "--select", "+fragments"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "have no normalized layer yet" in " ".join(out.stdout.split())


def test_runs_table_records_the_job_beside_its_stages(wh, cases, monkeypatch):
    """One row for the job that ran (its name, selection, what it materialized, checks), one per
    stage under the same run id; a job that fails is recorded as failed, with the error."""
    import orjson
    from trajwh.pipelines import assets

    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    first = build(str(wh.root))
    narrow = build(str(wh.root), only=["packs"], job="pack")
    rows = {(r["run_id"], r["job"]): r for r in wh.query("SELECT * FROM runs").to_pylist()}
    job = rows[(first.run_id, "build")]
    assert job["status"] == "succeeded" and orjson.loads(job["params"])["selection"] == "build"
    assert {"splits", "fragments", "packs"} <= set(orjson.loads(job["counts"])["materialized"])
    assert {j for r, j in rows if r == first.run_id} >= {"build", "normalize", "redact", "curate", "fragments", "packs"}
    pack = rows[(narrow.run_id, "pack")]
    assert orjson.loads(pack["params"])["selection"] == ["packs"] and orjson.loads(pack["counts"])["checks_failed"] == []
    assert {j for r, j in rows if r == narrow.run_id} == {"pack", "packs"}

    def boom(*a, **k):
        raise RuntimeError("curation broke")

    monkeypatch.setattr(assets, "curate_warehouse", boom)
    with pytest.raises(Exception, match="curation broke"):
        build(str(wh.root), full=True)
    failed = wh.query("SELECT status, error FROM runs WHERE job = 'build' ORDER BY started_at DESC LIMIT 1").to_pylist()
    assert failed[0]["status"] == "failed" and "curation broke" in failed[0]["error"]


def test_runs_the_daemon_starts_get_their_job_row(wh, cases):
    """A run the Dagster daemon starts (sensor, schedule) has no build() around it: the run-status
    sensors write its job row (status, materialized assets) beside its stage rows."""
    import dagster as dg
    import orjson
    from trajwh.pipelines.definitions import defs, record_succeeded_runs

    assert {"record_succeeded_runs", "record_failed_runs"} <= {d.name for d in defs.sensors}
    from trajwh.pipelines.resources import WarehouseResource

    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    instance = dg.DagsterInstance.ephemeral()
    result = build(str(wh.root), instance=instance)
    with wh.write_session("test") as s:  # as if the daemon had started it: no job row yet
        s.wh.connect(read_only=False, manifest=False).execute(
            "DELETE FROM runs WHERE run_id = ? AND job = 'build'", [result.run_id]).close()
    assert not wh.query("SELECT * FROM runs WHERE run_id = ? AND job = 'build'", [result.run_id]).num_rows
    context = dg.build_run_status_sensor_context(
        sensor_name="record_succeeded_runs", dagster_event=result.get_run_success_event(), dagster_instance=instance,
        dagster_run=result.dagster_run, resources={"warehouse": WarehouseResource(path=str(wh.root))})
    record_succeeded_runs(context)
    row = wh.query("SELECT * FROM runs WHERE run_id = ? AND job = 'build'", [result.run_id]).to_pylist()
    assert len(row) == 1 and row[0]["status"] == "succeeded"
    assert orjson.loads(row[0]["params"])["started_by"] == "dagster daemon"
    assert {"splits", "packs"} <= set(orjson.loads(row[0]["counts"])["materialized"])
    record_succeeded_runs(context)  # a run build() recorded (or recorded already) is left as it is
    assert wh.query("SELECT count(*) FROM runs WHERE run_id = ? AND job = 'build'", [result.run_id]).column(0)[0].as_py() == 1


def test_landing_fingerprint_is_the_same_in_another_process(tmp_path, cases):
    """A digest, never Python's per-process salted hash(): a restarted daemon must not ingest again."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from trajwh.pipelines.definitions import _landing_fingerprint

    shutil.copy(cases / "two_episodes.jsonl", tmp_path / "a.jsonl")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
            "from trajwh.pipelines.definitions import _landing_fingerprint; print(_landing_fingerprint(Path(sys.argv[2])))")
    others = {subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[1]), str(tmp_path)],
                             capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": seed},
                             check=True).stdout.strip() for seed in ("1", "2")}
    assert others == {_landing_fingerprint(tmp_path)} and len(others.pop()) == 64


def test_landing_sensor_requests_a_run_only_for_new_files(wh, cases):
    resource = WarehouseResource(path=str(wh.root))
    landing = wh.root / "landing"
    instance = warehouse_instance(wh.root)  # persistent, as the daemon's (a schedule's context needs its ref)
    ctx = dg.build_sensor_context(resources={"warehouse": resource}, instance=instance)
    assert isinstance(landing_sensor(ctx), dg.SkipReason)
    landing.mkdir(parents=True)
    (landing / "a.jsonl").write_bytes((cases / "two_episodes.jsonl").read_bytes())
    result = landing_sensor(ctx)
    assert isinstance(result, dg.SensorResult) and len(result.run_requests) == 1
    # the batch it will ingest is a partition before the run starts, and the run names it
    (add,) = result.dynamic_partitions_requests
    (req,) = result.run_requests
    batch = req.run_config["ops"]["raw_records"]["config"]["batch_id"]
    assert add.partition_keys == [batch] and req.tags["dagster/asset_partition_range_end"] == batch
    ctx2 = dg.build_sensor_context(resources={"warehouse": resource}, cursor=result.cursor, instance=instance)
    assert isinstance(landing_sensor(ctx2), dg.SkipReason)
    # the run it asks for, as the daemon would start it: ingests and builds, recording the batch's partition
    instance.add_dynamic_partitions(add.partitions_def_name, add.partition_keys)
    job = dg.Definitions(assets=ASSETS, asset_checks=ALL_CHECKS, jobs=[ingest_landing_job],
                         resources={"warehouse": resource}).resolve_job_def("ingest_landing")
    run = job.execute_in_process(instance=instance, tags=req.tags, run_config=req.run_config)
    assert run.success
    assert wh.query("SELECT batch_id FROM batches").column(0).to_pylist() == [batch]
    assert instance.get_materialized_partitions(dg.AssetKey("redacted_steps")) == {batch}
    # and the daily schedule builds every committed batch, by their partitions
    tick = daily_build(dg.build_schedule_context(instance=instance, resources={"warehouse": resource}))
    assert (tick.tags["dagster/asset_partition_range_start"], tick.tags["dagster/asset_partition_range_end"]) == (batch, batch)


def test_full_rebuild_regenerates_every_batch(wh, cases):
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="a"))
    ingest_paths(wh, [cases / "gzipped.jsonl.gz"], IngestOptions(source="b"))
    build(str(wh.root))
    result = build(str(wh.root), full=True)
    md = result.get_asset_materialization_events()[0].materialization.metadata
    assert md["batches_built"].value == 2
    assert wh.query("SELECT count(*) FROM episodes").column(0)[0].as_py() == 4


def test_the_warehouse_instance_keeps_its_event_log_open_and_other_readers_see_it(wh, cases):
    """`trajwh build` records its run with the event log's sqlite connections kept open (one per
    file and process: pipelines/dagster_storage.py); what it stores is Dagster's own, so another
    process's stock storage (`trajwh ui`) reads it while they are open."""
    import os

    from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage
    from trajwh.pipelines.dagster_storage import PooledSqliteEventLogStorage, pooled
    from trajwh.pipelines.definitions import DAGSTER_DIR

    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    instance = warehouse_instance(wh.root)
    storage = instance._event_storage
    assert type(storage) is PooledSqliteEventLogStorage
    result = build(str(wh.root), instance=instance)
    assert result.success
    pid, engines = storage.__dict__["_trajwh_engines"]
    assert pid == os.getpid() and {"index", result.run_id} <= set(engines)  # the index and the run's file
    # Dagster's stock storage, as another process opens it, sees the run, its materializations and checks
    stock = dg.DagsterInstance.from_config(str(wh.root / DAGSTER_DIR))
    assert type(stock._event_storage) is SqliteEventLogStorage
    assert stock.get_run_by_id(result.run_id).is_success
    assert stock.get_latest_materialization_event(dg.AssetKey("splits")).run_id == result.run_id
    assert len(stock.all_logs(result.run_id)) == len(instance.all_logs(result.run_id)) > 50
    # a storage a fork inherited opens its own connections, never the parent's
    storage.__dict__["_trajwh_engines"] = (-1, engines)
    instance.get_latest_materialization_event(dg.AssetKey("splits"))
    assert storage.__dict__["_trajwh_engines"][0] == os.getpid()
    assert all(e is not engines.get(shard) for shard, e in storage.__dict__["_trajwh_engines"][1].items())
    instance.dispose()  # closes them
    assert "_trajwh_engines" not in storage.__dict__
    # an instance whose event log is not Dagster's sqlite one is left as it is
    assert type(pooled(dg.DagsterInstance.ephemeral())._event_storage) is not PooledSqliteEventLogStorage
