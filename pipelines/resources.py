"""Dagster resources: where the warehouse is. Nothing else in the pipeline holds state."""

# no `from __future__ import annotations`: Dagster reads these annotations at runtime

import dagster as dg
from trajwh.lineage.catalog import Warehouse
from trajwh.schemas.config import Settings, load_settings


class WarehouseResource(dg.ConfigurableResource):
    """The warehouse directory (``--warehouse``, else ``$TRAJWH_WAREHOUSE``, else ``./warehouse``)."""

    path: str = ""
    lock_timeout: float = 600.0
    config: str = ""  # trajwh.toml; else $TRAJWH_CONFIG, <warehouse>/trajwh.toml, ./trajwh.toml

    def get(self) -> Warehouse:
        return Warehouse(self.path or None)  # (a URI stays one: its warehouse is read only here)

    def settings(self) -> Settings:
        return load_settings(self.config or None, self.get().root)
