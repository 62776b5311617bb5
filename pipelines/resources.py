"""Dagster resources: where the warehouse is. Nothing else in the pipeline holds state."""

# no `from __future__ import annotations`: Dagster reads these annotations at runtime

import dagster as dg

from lineage.catalog import Warehouse, resolve_warehouse


class WarehouseResource(dg.ConfigurableResource):
    """The warehouse directory (``--warehouse``, else ``$TRAJWH_WAREHOUSE``, else ``./warehouse``)."""

    path: str = ""
    lock_timeout: float = 600.0

    def get(self) -> Warehouse:
        return Warehouse(resolve_warehouse(self.path or None))
