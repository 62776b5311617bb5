"""Dagster ``Definitions``: assets, checks, jobs, the landing sensor and the daily schedule.

``dagster dev -m pipelines.definitions`` (or ``trajwh ui``) serves them.
"""

# no `from __future__ import annotations`: Dagster reads these annotations at runtime

import hashlib
import os
import warnings
from pathlib import Path

import dagster as dg

from pipelines.assets import (
    curated,
    data_card,
    fragment_layer,
    licensed,
    normalized,
    packs,
    raw_records,
    redacted,
)
from pipelines.checks import ALL_CHECKS
from pipelines.resources import WarehouseResource

ASSETS = [raw_records, normalized, redacted, curated, licensed, fragment_layer, packs, data_card]
#: the derived layers (everything but the ingest itself): what `trajwh build` materializes
BUILD_SELECTION = dg.AssetSelection.all() - dg.AssetSelection.assets(raw_records)

build_job = dg.define_asset_job("build", selection=BUILD_SELECTION,
                                description="Rebuild the derived layers from raw.")
ingest_landing_job = dg.define_asset_job("ingest_landing", selection=dg.AssetSelection.all(),
                                         description="Ingest the landing folder, then build.")
daily_build = dg.ScheduleDefinition(job=build_job, cron_schedule="0 3 * * *", name="daily_build")


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
    context.update_cursor(fingerprint)
    return dg.RunRequest(run_key=fingerprint)


defs = dg.Definitions(
    assets=ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=[build_job, ingest_landing_job],
    schedules=[daily_build],
    sensors=[landing_sensor],
    resources={"warehouse": WarehouseResource(path=os.environ.get("TRAJWH_WAREHOUSE", ""),
                                              config=os.environ.get("TRAJWH_CONFIG", ""))},
)


DAGSTER_DIR = "_dagster"
_DAGSTER_YAML = """# written by trajwh: this warehouse's own Dagster instance (runs, materializations, check results)
telemetry:
  enabled: false
"""


def warehouse_instance(warehouse: str | os.PathLike) -> dg.DagsterInstance:
    """The warehouse's persistent Dagster instance (``<warehouse>/_dagster``: sqlite storage,
    telemetry off). `trajwh build`, `demo` and `pack` record their runs there and `trajwh ui`
    serves it, so a build from the command line shows in the UI with its materializations,
    check results and metadata. Costs about 1 s per build over an ephemeral instance (measured on
    the demo warehouse's no-op build: 3.45-4.38 s against 2.60-3.46 s)."""
    home = Path(warehouse).resolve() / DAGSTER_DIR
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(_DAGSTER_YAML)
    return dg.DagsterInstance.from_config(str(home))


def resolve_selection(text: str) -> tuple[list[str], list[str]]:
    """A Dagster asset selection (``splits``, ``group:curated``, ``key:packs+``, ``+fragments``) as
    the asset names to build, each multi-asset step taken whole (its outputs are built together),
    and the names added that way. Bad or empty selections are errors that list what is valid."""
    from schemas.errors import ConfigError

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


def build(warehouse: str, *, full: bool = False, include_ingest: bool = False,
          ingest_config: dict | None = None, instance: dg.DagsterInstance | None = None,
          log_level: str = "WARNING", scope: str = "episode", curate: dict | None = None,
          config: str | None = None, pack: dict | None = None,
          only: list[str] | None = None) -> dg.ExecuteInProcessResult:
    """Materialize the graph in-process (``trajwh build`` and the tests use this); ``only``: just
    these assets (their inputs must exist), e.g. ``["packs"]`` for ``trajwh pack``."""
    selection = dg.AssetSelection.all() if include_ingest else BUILD_SELECTION
    if only:
        selection = dg.AssetSelection.assets(*only)
    ops: dict = {"normalized": {"config": {"full": full}}, "redacted": {"config": {"full": full, "scope": scope}},
                 "curated": {"config": {"full": full, **{k: v for k, v in (curate or {}).items() if v is not None}}},
                 "licensed": {"config": {"full": full}}, "fragment_layer": {"config": {"full": full}}, "packs": {"config": {"full": full, **(pack or {})}}}
    if include_ingest:
        ops["raw_records"] = {"config": ingest_config or {}}
    if only:  # config only for the ops that run
        keep = {n for a in ASSETS for n in [a.op.name] if set(only) & {k.to_user_string() for k in a.keys}}
        ops = {k: v for k, v in ops.items() if k in keep}
    return dg.materialize(
        [*ASSETS, *ALL_CHECKS],
        selection=selection,
        resources={"warehouse": WarehouseResource(path=str(warehouse), config=config or "")},
        run_config={"ops": ops, "loggers": {"console": {"config": {"log_level": log_level}}}},
        instance=instance,
        raise_on_error=True,
    )
