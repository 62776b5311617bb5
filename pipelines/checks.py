"""Asset checks: every normalized row has lineage; normalized counts reconcile with raw."""

# no `from __future__ import annotations`: Dagster reads these annotations at runtime

import dagster as dg

from ingest.adapters.base import adapters
from lineage.checks import lineage_gaps, passed, reconcile_normalized
from pipelines.resources import WarehouseResource


def _result(counts: dict) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=passed(counts), metadata={k: int(v) for k, v in counts.items()})


@dg.asset_check(asset="episodes", description="Every episode has lineage columns, a raw parent and an edge.")
def episodes_have_lineage(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    return _result(lineage_gaps(warehouse.get(), "episodes"))


@dg.asset_check(asset="steps", description="Every step has lineage columns, a raw parent and an edge.")
def steps_have_lineage(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    return _result(lineage_gaps(warehouse.get(), "steps"))


@dg.asset_check(asset="episodes", description="Each raw record became episodes or was quarantined; "
                "step counts match; ids are unique.")
def normalized_reconciles_with_raw(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    companions = [a.name for a in adapters() if a.companion]
    return _result(reconcile_normalized(warehouse.get(), companions))


ALL_CHECKS = [episodes_have_lineage, steps_have_lineage, normalized_reconciles_with_raw]
