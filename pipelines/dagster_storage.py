"""The warehouse's Dagster event log (``<warehouse>/_dagster``) with its sqlite connections kept open.

Dagster's ``SqliteEventLogStorage`` makes a new engine and opens and closes a connection to the
run's or the index's database file for every event it stores or reads. Closing the last connection
to a WAL-mode file checkpoints it, so each event paid two or three opens, checkpoints and closes:
about 6 ms an asset event, and a build stores about 200 events and reads more. Measured on an
incremental build at 108,070 episodes (`/tmp` A/B, two runs each): 25.2-26.1 s with Dagster's
storage, 23.6-24.9 s with this one.

``PooledSqliteEventLogStorage`` is that storage with one engine and one open connection per
database file and process (the connection is used under the storage's own lock, one thread at a
time; a forked child opens its own). The files, their schema and their contents are Dagster's, so
``trajwh ui`` (Dagster's own storage, another process) reads them as before: sqlite's locking and
WAL let several processes share them. ``pooled`` puts it under an instance the build made.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dagster._core.storage.event_log.sqlite.sqlite_event_log import (
    SQLITE_BUSY_TIMEOUT_SECONDS,
    SqliteEventLogStorage,
)
from dagster._core.storage.sql import create_engine
from sqlalchemy.pool import StaticPool

_OPEN: weakref.WeakSet[PooledSqliteEventLogStorage] = weakref.WeakSet()


class PooledSqliteEventLogStorage(SqliteEventLogStorage):
    """``SqliteEventLogStorage`` with its connections kept open (module docstring)."""

    @contextmanager
    def _connect(self, shard: str) -> Iterator[Any]:
        with self._db_lock:
            engine = self._engine(shard)
            with engine.connect() as conn, conn.begin():
                yield conn

    def _engine(self, shard: str) -> Any:
        pid, engines = self.__dict__.get("_trajwh_engines") or (None, {})
        if pid != os.getpid():  # none yet, or inherited by a fork: this process opens its own
            pid, engines = os.getpid(), {}
            self.__dict__["_trajwh_engines"] = (pid, engines)
            _OPEN.add(self)
        engine = engines.get(shard)
        if engine is None:
            engine = create_engine(self.conn_string_for_shard(shard), poolclass=StaticPool,
                                   connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS, "check_same_thread": False})
            if shard not in self._initialized_dbs:
                self._initdb(engine)
                self._initialized_dbs.add(shard)
            engines[shard] = engine
        return engine

    def close_connections(self) -> None:
        """Close this process's connections (each file checkpointed by its last close)."""
        pid, engines = self.__dict__.pop("_trajwh_engines", None) or (None, {})
        if pid == os.getpid():
            for engine in engines.values():
                engine.dispose()

    def wipe(self) -> None:  # removes shard files: nothing may stay open on them
        with self._db_lock:
            self.close_connections()
        super().wipe()

    def dispose(self) -> None:
        self.close_connections()
        super().dispose()


def pooled(instance: Any) -> Any:
    """``instance`` with its event log storage kept open (``PooledSqliteEventLogStorage``) when it
    is Dagster's sqlite event log storage; any other storage is left as it is."""
    storage = getattr(instance, "_event_storage", None)
    if type(storage) is SqliteEventLogStorage:
        storage.__class__ = PooledSqliteEventLogStorage
    return instance


@atexit.register
def _close_all() -> None:
    for storage in list(_OPEN):
        storage.close_connections()
