"""Dagster ``Definitions``: assets, checks, jobs, the landing sensor and the daily schedule.

``dagster dev -m trajwh.pipelines.definitions`` (or ``trajwh ui``) serves them.
"""

# no `from __future__ import annotations`: Dagster reads these annotations at runtime

import hashlib
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

import dagster as dg
from trajwh.lineage.catalog import DAGSTER_DIR
from trajwh.pipelines.assets import (
    BATCHES,
    curated,
    data_card,
    featurized,
    fragment_layer,
    licensed,
    new_batch,
    normalized,
    packed,
    range_tags,
    raw_records,
    redacted,
)
from trajwh.pipelines.checks import ALL_CHECKS
from trajwh.pipelines.resources import WarehouseResource

ASSETS = [raw_records, normalized, redacted, featurized, curated, licensed, fragment_layer, packed, data_card]
#: the per-batch assets (partitioned by ``batches``), and those of them a ``--batch`` run builds: all but
#: ``pack_tokens``, which needs the global curation first (``trajwh pack --batch`` stages a batch's tokens)
PER_BATCH_KEYS = sorted(k.to_user_string() for a in ASSETS for k, spec in a.specs_by_key.items()
                        if spec.partitions_def is not None)
BATCH_RUN_KEYS = [k for k in PER_BATCH_KEYS if k != "pack_tokens"]
#: the derived layers (everything but the ingest itself): what `trajwh build` materializes
BUILD_SELECTION = dg.AssetSelection.all() - dg.AssetSelection.assets(raw_records)

build_job = dg.define_asset_job("build", selection=BUILD_SELECTION,
                                description="Rebuild the derived layers from raw.")
#: the per-batch assets before curation, of the batches a run names, each step in its own process
#: (Dagster's multiprocess executor): what a backfill of batches runs from the UI or the daemon, one
#: run per batch or range beside the others (their writers share the lock)
per_batch_job = dg.define_asset_job("per_batch", selection=dg.AssetSelection.assets(*BATCH_RUN_KEYS),
                                    partitions_def=BATCHES, executor_def=dg.multiprocess_executor,
                                    description="Normalize, redact and featurize the chosen batches, "
                                                "each step in its own process.")
ingest_landing_job = dg.define_asset_job("ingest_landing", selection=dg.AssetSelection.all(),
                                         description="Ingest the landing folder, then build.")
@dg.schedule(job=build_job, cron_schedule="0 3 * * *", name="daily_build",
             description="Builds every committed batch and the global layers, daily.")
def daily_build(context: dg.ScheduleEvaluationContext, warehouse: WarehouseResource):
    wh = warehouse.get()
    committed = sync_partitions(wh, context.instance) if wh.exists() else []
    if not committed:
        return dg.SkipReason(f"nothing ingested in {wh.root}")
    return dg.RunRequest(tags=range_tags(committed[0], committed[-1]))


def _landing_fingerprint(landing: Path) -> str:
    entries = []
    if landing.is_dir():
        for p in sorted(landing.rglob("*")):
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(landing).parts):
                st = p.stat()
                entries.append(f"{p}:{st.st_size}:{st.st_mtime_ns}")
    # a digest, not hash(): Python salts str hashes per process, so a restarted daemon would see
    # every landing folder as new and ingest it again
    return hashlib.sha256("\n".join(entries).encode()).hexdigest() if entries else ""


@dg.sensor(job=ingest_landing_job, minimum_interval_seconds=30,
           description="Ingests new or changed files in <warehouse>/landing.")
def landing_sensor(context: dg.SensorEvaluationContext, warehouse: WarehouseResource):
    landing = warehouse.get().root / "landing"
    fingerprint = _landing_fingerprint(landing)
    if not fingerprint or fingerprint == context.cursor:
        return dg.SkipReason(f"no new files in {landing}")
    # the batch it ingests is a partition before its run starts (the run names every partition)
    batch_id = uuid.uuid4().hex
    known = context.instance.get_dynamic_partitions(BATCHES.name)
    request = dg.RunRequest(run_key=fingerprint, tags=range_tags((known or [batch_id])[0], batch_id),
                            run_config={"ops": {"raw_records": {"config": {"batch_id": batch_id}}}})
    return dg.SensorResult(run_requests=[request], cursor=fingerprint,
                           dynamic_partitions_requests=[BATCHES.build_add_request([batch_id])])


def record_daemon_run(context: dg.RunStatusSensorContext, warehouse: WarehouseResource, status: str,
                      error: str | None = None) -> None:
    """The job row of a run the Dagster daemon started (the landing sensor's ingest, the daily
    build), which no ``build()`` call recorded: its job, final status and what it materialized,
    beside the stage rows its steps wrote under the same run id."""
    from datetime import UTC, datetime

    from trajwh.lineage.rebuild import run_row

    wh, run = warehouse.get(), context.dagster_run
    if not wh.exists():
        return
    done = wh.query("SELECT count(*) FROM runs WHERE run_id = ? AND job = ? AND status <> 'running'",
                    [run.run_id, run.job_name]).column(0)[0].as_py()
    if done:  # recorded by build() (a CLI or API run), with its own parameters
        return
    stats = context.instance.get_run_stats(run.run_id)
    started = datetime.fromtimestamp(stats.start_time, UTC) if stats.start_time else None
    materialized = sorted({r.asset_key.to_user_string() for r in context.instance.get_records_for_run(
        run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION).records if r.asset_key})
    row = run_row(run.run_id, run.job_name, started or datetime.now(UTC),
                  params={"dagster_job": run.job_name, "started_by": "dagster daemon",
                          "tags": {k: v for k, v in run.tags.items() if not k.startswith(".")}},
                  counts={"materialized": materialized}, code_version="")
    with wh.write_session(run.job_name) as session:
        session.upsert_rows("runs", [{**row, "status": status, "error": error[:2000] if error else None}])


@dg.run_status_sensor(run_status=dg.DagsterRunStatus.SUCCESS, name="record_succeeded_runs",
                      default_status=dg.DefaultSensorStatus.RUNNING,
                      description="Records a daemon-started run's job row in the warehouse's runs table.")
def record_succeeded_runs(context: dg.RunStatusSensorContext, warehouse: WarehouseResource):
    record_daemon_run(context, warehouse, "succeeded")


@dg.run_failure_sensor(name="record_failed_runs", default_status=dg.DefaultSensorStatus.RUNNING,
                       description="Records a daemon-started run's failure in the warehouse's runs table.")
def record_failed_runs(context: dg.RunFailureSensorContext, warehouse: WarehouseResource):
    record_daemon_run(context, warehouse, "failed", context.failure_event.message or "failed")


defs = dg.Definitions(
    assets=ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=[build_job, ingest_landing_job, per_batch_job],
    schedules=[daily_build],
    sensors=[landing_sensor, record_succeeded_runs, record_failed_runs],
    resources={"warehouse": WarehouseResource(path=os.environ.get("TRAJWH_WAREHOUSE", ""),
                                              config=os.environ.get("TRAJWH_CONFIG", ""))},
)


def per_batch_job_def() -> dg.JobDefinition:
    """``per_batch_job`` resolved, for ``dagster.reconstructable`` (a multiprocess run's step
    processes load it by this function's module and name; the warehouse is ``TRAJWH_WAREHOUSE``)."""
    return defs.resolve_job_def("per_batch")


_DAGSTER_YAML = """# written by trajwh: this warehouse's own Dagster instance (runs, materializations, check results)
telemetry:
  enabled: false
# no per-step stdout/stderr capture: the steps log through Dagster's structured event log (what the
# UI shows); capturing would start two `tail` processes per step and copy output text into _dagster/
compute_logs:
  module: dagster._core.storage.noop_compute_log_manager
  class: NoOpComputeLogManager
"""
_OURS = "# written by trajwh"


def warehouse_instance(warehouse: str | os.PathLike) -> dg.DagsterInstance:
    """The warehouse's persistent Dagster instance (``<warehouse>/_dagster``: sqlite storage,
    telemetry off). `trajwh build`, `demo` and `pack` record their runs there and `trajwh ui`
    serves it, so a build from the command line shows in the UI with its materializations,
    check results and metadata. Costs about 1 s per build over an ephemeral instance (measured on
    the demo warehouse's no-op build: 3.45-4.38 s against 2.60-3.46 s)."""
    home = Path(warehouse).resolve() / DAGSTER_DIR
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    current = config.read_text() if config.exists() else None
    # two processes opening a new instance at once (two `trajwh build --batch` runs) would both create
    # its sqlite tables ("table secondary_indexes already exists"): one at a time, storages touched
    import fcntl

    from trajwh.pipelines.dagster_storage import pooled

    fd = os.open(home / ".init.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if current is None or (current.startswith(_OURS) and current != _DAGSTER_YAML):  # ours, and older: updated
            config.write_text(_DAGSTER_YAML)
        # its event log's sqlite connections kept open while the process runs (pipelines/dagster_storage.py)
        instance = pooled(dg.DagsterInstance.from_config(str(home)))
        instance.get_runs(limit=1)  # run storage
        instance.get_dynamic_partitions("batches")  # event log storage (its index)
        instance.all_instigator_state()  # schedule storage
    finally:
        os.close(fd)
    return instance


def resolve_selection(text: str) -> tuple[list[str], list[str]]:
    """A Dagster asset selection (``splits``, ``group:curated``, ``key:packs+``, ``+fragments``) as
    the asset names to build, each multi-asset step taken whole (its outputs are built together),
    and the names added that way. Bad or empty selections are errors that list what is valid."""
    from trajwh.schemas.errors import ConfigError

    graph = defs.get_repository_def().asset_graph
    names = sorted(k.to_user_string() for k in graph.get_all_asset_keys())
    groups = sorted({spec.group_name for a in ASSETS for spec in a.specs if spec.group_name})
    valid = (f"asset names ({', '.join(names)}), group:NAME ({', '.join(groups)}), key:NAME, and Dagster's "
             "+ (upstream) / + suffix (downstream) and 'and' / 'or'")
    text = text.strip()
    if text in names:
        text = f"key:{text}"
    try:
        with warnings.catch_warnings():  # dagster warns about its own group selection internals
            warnings.simplefilter("ignore")
            chosen = {k.to_user_string() for k in dg.AssetSelection.from_string(text).resolve(graph)}
    except Exception as exc:  # dagster's parse errors have several types
        raise ConfigError(f"--select {text!r} is not an asset selection: {str(exc).splitlines()[0]}",
                          valid=valid) from None
    if not chosen:
        raise ConfigError(f"--select {text!r} selects no asset", valid=valid)
    whole = set(chosen)
    for a in ASSETS:
        keys = {k.to_user_string() for k in a.keys}
        if keys & chosen:
            whole |= keys
    return sorted(whole), sorted(whole - chosen)


def sync_partitions(wh, instance: dg.DagsterInstance) -> list[str]:
    """Make the instance's ``batches`` partitions the warehouse's committed batches, in commit
    order (new ones added, those no longer committed, e.g. forgotten, deleted); returns them.
    The partitions' order is the order they were added in, so a range names a run of batches."""
    from trajwh.lineage.rebuild import committed_batches

    committed = committed_batches(wh) if wh.exists() else []
    known = instance.get_dynamic_partitions(BATCHES.name)
    for gone in sorted(set(known) - set(committed)):
        instance.delete_dynamic_partition(BATCHES.name, gone)
    kept = [k for k in known if k in set(committed)]
    if kept != committed[:len(kept)]:  # out of commit order (batches added elsewhere): added again in order
        for k in kept:
            instance.delete_dynamic_partition(BATCHES.name, k)
        kept = []
    if committed[len(kept):]:
        instance.add_dynamic_partitions(BATCHES.name, committed[len(kept):])
    return committed


#: the per-batch layers before curation, in order, by the step that builds them and a table it writes
_BATCH_LAYERS = (("normalized", "episodes"), ("redacted", "redacted_episodes"), ("featurized", "episode_features"))


def unbuilt_upstream(wh: Any, only: list[str]) -> list[str]:
    """What a selection (``resolve_selection``) leaves out that the layers it builds need: for the
    first per-batch layer it does not build but reads through what it does build, the ingested
    batches that layer lacks (each message names them and how to build them). Those batches would
    be silently missing from the selected layers."""
    graph = defs.get_repository_def().asset_graph
    committed = [r["batch_id"] for r in wh.query(
        "SELECT batch_id FROM batches WHERE status = 'committed' AND n_new > 0 ORDER BY committed_at").to_pylist()]
    for step, table in _BATCH_LAYERS:
        if table in only or not committed:
            continue
        downstream = {k.to_user_string() for k in dg.AssetSelection.assets(table).downstream().resolve(graph)}
        if not downstream & set(only):
            continue
        have = set(wh.manifest_query("SELECT DISTINCT batch_id FROM table_files WHERE table_name = ?",
                                     [table]).column(0).to_pylist())
        missing = [b for b in committed if b not in have]
        if missing:
            return [f"{len(missing)} ingested batch(es) have no {step} layer yet ({', '.join(missing[:3])}"
                    f"{', ...' if len(missing) > 3 else ''}): the selection does not build it, so what it builds "
                    "leaves them out; select everything upstream too ('*' before an asset name, e.g. "
                    "'*fragments') or run `trajwh build`"]
    return []


def build(warehouse: str, *, full: bool = False, include_ingest: bool = False,
          ingest_config: dict | None = None, instance: dg.DagsterInstance | None = None,
          log_level: str = "WARNING", scope: str = "episode", curate: dict | None = None,
          config: str | None = None, pack: dict | None = None,
          only: list[str] | None = None, job: str = "build", batch: str | None = None) -> dg.ExecuteInProcessResult:
    """Materialize the graph in-process (``trajwh build`` and the tests use this); ``only``: just
    these assets (their inputs must exist), e.g. ``["packs"]`` for ``trajwh pack``; ``batch``: the
    per-batch assets (normalized, redacted, featurized) of that one ingest batch, as a run of its partition.

    Every committed batch is a partition of the per-batch assets (``sync_partitions``); a whole
    build runs the range of all of them, so the instance records each batch's materialization.

    ``job`` names the run: the Dagster job the UI lists it under, and the ``runs`` row that
    records it (status running, then succeeded or failed, with the selection and what it
    materialized), beside one row per stage under the same run id."""
    from trajwh.lineage.build_state import (
        build_inputs_digest,
        build_params,
        forget_built,
        record_built,
    )
    from trajwh.lineage.catalog import Warehouse, now_utc
    from trajwh.lineage.rebuild import mark_running, run_row

    selection = dg.AssetSelection.all() if include_ingest else BUILD_SELECTION
    if batch is not None:
        if include_ingest or not set(only or []) <= set(PER_BATCH_KEYS):
            raise ValueError(f"build(batch=...) runs per-batch assets alone ({', '.join(PER_BATCH_KEYS)}): "
                             "no include_ingest, no other only")
        only = only or BATCH_RUN_KEYS
    if only:
        selection = dg.AssetSelection.assets(*only)
    ops: dict = {"normalized": {"config": {"full": full}}, "redacted": {"config": {"full": full, "scope": scope}},
                 "curated": {"config": {"full": full, **{k: v for k, v in (curate or {}).items() if v is not None}}},
                 "featurized": {"config": {"full": full, **{k: v for k, v in (curate or {}).items() if v is not None}}},
                 "licensed": {"config": {"full": full}}, "fragment_layer": {"config": {"full": full}}, "packed": {"config": {"full": full, **(pack or {}),
                                                  **({"engine": curate["engine"]} if (curate or {}).get("engine") else {})}}}
    if only:  # config only for the ops that run
        keep = {n for a in ASSETS for n in [a.op.name] if set(only) & {k.to_user_string() for k in a.keys}}
        ops = {k: v for k, v in ops.items() if k in keep}
    defs = dg.Definitions(jobs=[dg.define_asset_job(name=job, selection=selection)], assets=[*ASSETS],
                          asset_checks=[*ALL_CHECKS],
                          resources={"warehouse": WarehouseResource(path=str(warehouse), config=config or "")})
    wh, run_id, started = Warehouse(warehouse), str(uuid.uuid4()), now_utc()
    instance = instance or dg.DagsterInstance.ephemeral()
    committed = sync_partitions(wh, instance)
    # a run holding the per-batch assets names partitions: Dagster reads a partitioned step's
    # partitioned inputs by the run's range
    partition: dict = {}
    if batch is not None:
        partition = {"partition_key": batch}
        if batch not in committed:  # refused by the stage too, but before a run starts is clearer
            from trajwh.lineage.rebuild import chosen_batches

            chosen_batches(wh, [], [batch])
    elif include_ingest:  # the batch it ingests is a partition before the run starts
        new_id, tags = new_batch(instance)
        ops["raw_records"] = {"config": {**(ingest_config or {}), "batch_id": new_id}}
        partition = {"tags": tags}
    elif committed:
        partition = {"tags": range_tags(committed[0], committed[-1])}
    else:  # nothing ingested yet: no batch, so no per-batch step; the others run on empty layers
        # (an op all of whose assets are per-batch gets no config; packed keeps its packs)
        names = {a.op.name for a in ASSETS if {k.to_user_string() for k in a.keys} <= set(PER_BATCH_KEYS)}
        selection = selection - dg.AssetSelection.assets(*PER_BATCH_KEYS)
        ops = {k: v for k, v in ops.items() if k not in names}
        defs = dg.Definitions(jobs=[dg.define_asset_job(name=job, selection=selection)], assets=[*ASSETS],
                              asset_checks=[*ALL_CHECKS],
                              resources={"warehouse": WarehouseResource(path=str(warehouse), config=config or "")})
    params = {"full": full, "selection": only or ("all" if include_ingest else "build"), "dagster_job": job,
              **({"batch": batch} if batch is not None else {})}
    with wh.write_session(job, shared=batch is not None) as session:  # (a batch's run goes on beside others)
        mark_running(session, run_id, job, started)
    try:
        result = defs.resolve_job_def(job).execute_in_process(
            run_config={"ops": ops, "loggers": {"console": {"config": {"log_level": log_level}}}},
            instance=instance, raise_on_error=True, run_id=run_id, **partition)
    except BaseException as exc:
        forget_built(wh)
        if include_ingest:  # a batch that was not committed leaves no partition
            sync_partitions(wh, instance)
        try:  # recorded when it can be; never in place of the error itself
            _record_job(wh, run_row(run_id, job, started, params=params, counts={}, code_version=""),
                        f"{type(exc).__name__}: {exc}", shared=batch is not None)
        except Exception:  # noqa: BLE001
            pass
        raise
    if include_ingest:
        sync_partitions(wh, instance)
    checks = result.get_asset_check_evaluations()
    failed = sorted(c.check_name for c in checks if not c.passed)
    if only is None and batch is None and not failed:  # the whole graph built and checked: what it left is up to date
        record_built(wh, build_inputs_digest(wh, build_params(scope, curate, pack), config), run_id)
    else:
        forget_built(wh)
    counts = {"materialized": sorted(m.asset_key.to_user_string() for m in result.get_asset_materialization_events()),
              "checks_passed": sum(c.passed for c in checks), "checks_failed": failed}
    _record_job(wh, run_row(run_id, job, started, params=params, counts=counts, code_version=""),
                f"checks failed: {', '.join(failed)}" if failed else None, shared=batch is not None)
    return result


def _record_job(wh, row: dict, error: str | None, *, shared: bool = False) -> None:
    with wh.write_session(row["job"], shared=shared) as session:
        session.upsert_rows("runs", [{**row, "status": "failed", "error": error[:2000]} if error else row])
