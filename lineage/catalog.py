"""The warehouse: a directory of Parquet datasets plus a DuckDB catalog (ARCHITECTURE.md s. 2).

Layout::

    <root>/catalog.duckdb              views over every table + metadata tables
    <root>/<layer>/<table>/part-*.parquet   immutable, content-named data files
    <root>/_schemas/<table>.parquet    zero-row file per table (so an empty table has a view)
    <root>/.lock                       writers' lock (flock)
    <root>/storage.json                where the data files are, when not in the folder:
                                       ``{"data": "s3://bucket/prefix"}`` (the layer folders and
                                       ``_schemas`` are then under that prefix; docs/scale.md)

A data file belongs to a table only once the manifest table ``table_files`` lists it. A writer
holds the warehouse lock for its whole operation, writes its files, then commits the manifest
rows, its metadata rows (batches, runs, ...) and the refreshed views in one DuckDB
transaction. A crash before that commit leaves only unlisted files, which the next writer
removes: no partial batch is ever visible. The DuckDB connection itself is held only for
reads and the final commit, so ``trajwh sql`` keeps working during a long ingest.

Views use paths relative to the root and every connection sets ``file_search_path`` to the
root, so a warehouse folder can be moved or copied as a whole.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from trajwh.lineage.parallel import duckdb_memory
from trajwh.lineage.storage import (
    TMP_PREFIX,
    DataPath,
    ObjectPath,
    WrittenFile,
    data_root,
    duckdb_filesystem,
    ensure_dir,
    is_uri,
    write_bytes_atomic,
    write_parquet,
)
from trajwh.schemas.arrow import (
    CATALOG_TABLES,
    PARQUET_TABLES,
    PLAIN_COLUMNS,
    RESTRICTED_LAYERS,
    TABLE_LAYERS,
    arrow_schema,
    empty_table,
)
from trajwh.schemas.errors import CatalogError, ConfigError, WarehouseBusyError
from trajwh.schemas.tables import SCHEMA_VERSION

DEFAULT_WAREHOUSE = "./warehouse"
ENV_WAREHOUSE = "TRAJWH_WAREHOUSE"
CATALOG_FILE = "catalog.duckdb"
#: where a warehouse keeps its data files when they are not under its folder (``{"data": URI}``)
STORAGE_FILE = "storage.json"
#: the data location of a new warehouse (``s3://bucket/prefix``); ``trajwh --data URI`` sets it
ENV_DATA = "TRAJWH_DATA"
#: under a warehouse's data in object storage: the copy of its catalog its writer host publishes
#: after each write, which a warehouse named by its URI reads (``Warehouse("s3://bucket/prefix")``)
REPLICA_DIR = "_catalog"
#: the warehouse's own Dagster instance (runs, materializations, check results: pipelines.definitions)
DAGSTER_DIR = "_dagster"
#: where this host keeps the catalogs of warehouses named by their URI (default ~/.cache/trajwh/replicas)
ENV_REPLICAS = "TRAJWH_REPLICAS"

_MANIFEST_DDL = """
CREATE TABLE IF NOT EXISTS table_files (
    table_name VARCHAR NOT NULL,
    path VARCHAR NOT NULL PRIMARY KEY,
    sha256 VARCHAR NOT NULL,
    rows BIGINT NOT NULL,
    bytes BIGINT NOT NULL,
    batch_id VARCHAR,
    run_id VARCHAR,
    transform_version VARCHAR,
    added_at TIMESTAMPTZ NOT NULL,
    blake3 VARCHAR
);
CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR);
-- (a catalog made before the column: its files' rows have none, and are checked by their sha256)
ALTER TABLE table_files ADD COLUMN IF NOT EXISTS blake3 VARCHAR;
"""


def resolve_warehouse(path: str | os.PathLike[str] | None = None) -> Path:
    """``--warehouse DIR``, else ``$TRAJWH_WAREHOUSE``, else ``./warehouse``. A warehouse named by
    the URI of its data (``s3://bucket/prefix``) resolves to this host's folder for its published
    catalog (``replica_folder``)."""
    chosen = _chosen(path)
    if is_uri(chosen):
        return replica_folder(chosen)
    if "://" in chosen:  # another scheme would silently become a local folder named "gs:"
        raise ConfigError(f"the warehouse is a folder or an s3:// URI, not {chosen!r}",
                          valid="--warehouse DIR (it keeps the catalog), with --data s3://bucket/prefix for the data "
                                "files in object storage; or --warehouse s3://bucket/prefix to read one (docs/scale.md)")
    return Path(chosen).expanduser().resolve()


def _chosen(path: str | os.PathLike[str] | None) -> str:
    return os.fspath(path or os.environ.get(ENV_WAREHOUSE) or DEFAULT_WAREHOUSE)


def replica_folder(uri: str) -> Path:
    """This host's folder for the catalog a warehouse in object storage publishes (read only)."""
    base = os.environ.get(ENV_REPLICAS) or os.path.join(os.path.expanduser("~"), ".cache", "trajwh", "replicas")
    canonical = str(data_root(uri))
    return Path(base).expanduser().resolve() / hashlib.sha256(canonical.encode()).hexdigest()[:16]


def now_utc() -> datetime:
    return datetime.now(UTC)


class Warehouse:
    """Handle on one warehouse directory. Cheap to create; opens nothing until asked."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *, data: str | None = None):
        chosen = _chosen(root)
        self.root = resolve_warehouse(chosen)
        self.catalog_path = self.root / CATALOG_FILE
        #: the data's URI when the warehouse is named by it: read through the catalog its writer
        #: host publishes there (fetched on first use), never written from here
        self.replica_of = str(data_root(chosen)) if is_uri(chosen) else None
        self._fetched = False
        self._copy_of: str | None = None  # the same, for a copy's folder named as a folder (``data``)
        self._data_asked = data if self.replica_of is None else self.replica_of
        self._data: DataPath | None = None

    @property
    def data(self) -> DataPath:
        """Where the data files live: the warehouse folder, or the object store its
        ``storage.json`` names (written when the warehouse is made with ``--data`` /
        ``$TRAJWH_DATA``). The catalog, its lock, the vault and the caches stay in the folder."""
        if self._data is None:
            asked = self._data_asked or os.environ.get(ENV_DATA) or None
            try:
                doc = json.loads((self.root / STORAGE_FILE).read_text())
                stored = doc["data"]
                self._copy_of = stored if doc.get("replica") else None
            except FileNotFoundError:
                stored = None
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CatalogError(f"{self.root / STORAGE_FILE} is unreadable: {exc}",
                                   valid='{"data": "s3://bucket/prefix"}') from None
            if stored is None and asked and self.catalog_path.exists():
                raise ConfigError(f"the warehouse {self.root} keeps its data in its folder; it cannot be moved to "
                                  f"{asked} by naming it", valid=f"no --data / ${ENV_DATA} for this warehouse")
            if stored is not None and asked and str(data_root(asked)) != stored:
                raise ConfigError(f"the warehouse {self.root} keeps its data in {stored}, not {asked}",
                                  valid=f"{stored}, or no --data / ${ENV_DATA}")
            self._data = data_root(stored or asked) if (stored or asked) else self.root
        return self._data

    @property
    def remote(self) -> bool:
        """Whether the data files are in an object store."""
        return isinstance(self.data, ObjectPath)

    def data_path(self, name: str) -> DataPath:
        """A data file named by the manifest (relative to the data's place) or by a reader (an
        absolute path, or a URI as DuckDB's ``filename`` gives it)."""
        if name.startswith("s3://") or os.path.isabs(name):
            return data_root(name)
        return self.data / name

    def _view_prefix(self) -> str:
        """What a view puts before a manifest path: nothing for a local warehouse (the paths are
        relative to its folder, the connection's ``file_search_path``), the store's URI otherwise."""
        return f"{self.data}/" if self.remote else ""

    def _attach_storage(self, con: duckdb.DuckDBPyConnection) -> None:
        con.execute(f"SET file_search_path = '{_sql_str(str(self.root))}'").fetchall()
        if self.remote and not con.filesystem_is_registered("s3"):  # once per database instance
            con.register_filesystem(duckdb_filesystem())

    # --- layout --------------------------------------------------------------------------

    def table_dir(self, table: str) -> DataPath:
        if table not in TABLE_LAYERS:
            raise ConfigError(f"unknown table {table!r}", valid=", ".join(sorted(TABLE_LAYERS)))
        return self.data / TABLE_LAYERS[table] / table

    def is_restricted(self, table: str) -> bool:
        return TABLE_LAYERS[table] in RESTRICTED_LAYERS

    def exists(self) -> bool:
        if self.replica_of is not None and not self._fetched:
            self._fetch_replica()
        return self.catalog_path.exists()

    def _fetch_replica(self) -> None:
        """The catalog published under the data's URI, copied to this host's replica folder when
        its digest (a small object the writer publishes after it) is not the copy's."""
        remote = data_root(self.replica_of) / REPLICA_DIR / CATALOG_FILE
        try:
            digest = (remote.parent / (CATALOG_FILE + ".sha256")).read_bytes().decode().strip()
        except FileNotFoundError:
            raise CatalogError(f"no published catalog at {remote}",
                               valid="a warehouse whose writer host keeps its data there (made with --data "
                                     f"{self.replica_of}; each write publishes its catalog), or its folder") from None
        except OSError as exc:
            raise ConfigError(f"the object store did not serve {remote}: {exc}",
                              valid="AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY of a store "
                                    "that holds it") from None
        stamp = self.root / (CATALOG_FILE + ".sha256")
        if not self.catalog_path.exists() or not stamp.exists() or stamp.read_text() != digest:
            data = remote.read_bytes()
            ensure_dir(self.root, restricted=True)
            write_bytes_atomic(data, self.catalog_path, restricted=True)
            write_bytes_atomic(json.dumps({"data": self.replica_of, "replica": True}).encode(), self.root / STORAGE_FILE,
                               restricted=True)
            # the copy's own digest (a writer that published meanwhile: the next reader fetches again)
            write_bytes_atomic(hashlib.sha256(data).hexdigest().encode(), stamp, restricted=True)
        self._fetched = True

    def publish_replica(self) -> None:
        """A warehouse whose data is in object storage: its catalog, checkpointed (the WAL folded
        in), copied under the data's URI as one object, for readers on other hosts that name the
        warehouse by that URI. Called by each exclusive write session as it ends (the lock held)."""
        con = self.connect(read_only=False, manifest=False)
        try:
            con.execute("FORCE CHECKPOINT")
        finally:
            con.close()
        data = self.catalog_path.read_bytes()  # (small: no data rows; 2.9 MB at 108,070 episodes)
        target = self.data / REPLICA_DIR / CATALOG_FILE
        target.write_bytes(data)
        (target.parent / (CATALOG_FILE + ".sha256")).write_bytes(hashlib.sha256(data).hexdigest().encode())

    def require(self) -> None:
        if not self.exists():
            raise CatalogError(
                f"no warehouse at {self.root}",
                valid="a folder made by `trajwh ingest` (choose it with --warehouse DIR or $TRAJWH_WAREHOUSE)",
            )

    # --- connections ---------------------------------------------------------------------

    def connect(self, *, read_only: bool = True, timeout: float = 30.0,
                manifest: bool = True) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection to the catalog (``_Attached``: it behaves as one, and ``close`` lets
        the file go); retries while another process commits. ``manifest=False``: a writer that
        leaves ``table_files`` alone (run rows, schema setup)."""
        if read_only:
            self.require()
        else:
            self._refuse_replica("a write")
            if manifest:  # what this process may change: a manifest cached before is not used after it
                _COMMITS[0] += 1
        con = _attach(self, read_only, timeout)
        try:
            self._attach_storage(con)
            if read_only:
                self._check_version(con)
        except BaseException:
            con.close()
            raise
        return con

    def _check_version(self, con: duckdb.DuckDBPyConnection) -> None:
        """The catalog's schema version is one this code reads (else a clear error); asked once
        while the catalog file and its WAL keep their size, time and inode (a forget attached the
        catalog 140 times: 0.2 s of these questions)."""
        key, stamp = str(self.catalog_path), self._catalog_stamp()  # (taken first: a change after it is checked next time)
        if _VERSIONS_READ.get(key) == stamp:
            return
        rows = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()
        found = rows[0][0] if rows else None
        if found is None or found.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise CatalogError(
                f"catalog {self.catalog_path} has schema version {found}",
                valid=f"a catalog of schema version {SCHEMA_VERSION.split('.')[0]}.x",
            )
        _VERSIONS_READ[key] = stamp

    def manifest(self) -> pa.Table:
        """The manifest (``table_files``) as an Arrow table, read once and kept while the catalog
        file and its WAL are unchanged and this process has committed nothing since: a build asks
        the manifest dozens of times (fingerprints, versions, row counts), each a catalog open."""
        stamp = (self._catalog_stamp(), _COMMITS[0])
        hit = _MANIFESTS.get(str(self.catalog_path))
        if hit is not None and hit[0] == stamp:
            return hit[1]
        table = self.query("SELECT * FROM table_files")
        _MANIFESTS[str(self.catalog_path)] = (stamp, table)
        return table

    def manifest_query(self, sql: str, params: Sequence[Any] | None = None) -> pa.Table:
        """Run SQL that reads only ``table_files`` against the cached manifest (``manifest``)."""
        if not _MEMORY or _MEMORY[0] != os.getpid():  # one in-memory database per process (not inherited
            _MEMORY[:] = [os.getpid(), duckdb.connect(":memory:")]  # by a fork): opening one costs as much as a file
        con = _MEMORY[1].cursor()
        try:
            con.register("table_files", self.manifest())
            return con.sql(sql, params=list(params or [])).to_arrow_table()
        finally:
            con.close()

    @contextmanager
    def keeping_manifest(self) -> Iterator[None]:
        """A write by this process (holding the write lock) that leaves ``table_files`` alone: a
        cached manifest that was current before it stays current after it."""
        key = str(self.catalog_path)
        hit = _MANIFESTS.get(key)
        current = hit is not None and hit[0] == (self._catalog_stamp(), _COMMITS[0])
        yield
        if current and _MANIFESTS.get(key) is hit:
            _MANIFESTS[key] = ((self._catalog_stamp(), _COMMITS[0]), hit[1])

    def _catalog_stamp(self) -> tuple:
        out = []
        for path in (self.catalog_path, self.catalog_path.with_name(self.catalog_path.name + ".wal")):
            try:
                st = os.stat(path)
                out.append((st.st_size, st.st_mtime_ns, st.st_ino))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    def query(self, sql: str, params: Sequence[Any] | None = None) -> pa.Table:
        """Run read-only SQL against the catalog; returns an Arrow table."""
        with self._reading() as con:
            return con.sql(sql, params=list(params or [])).to_arrow_table()

    @contextmanager
    def _reading(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only cursor on the catalog, cheaper than ``connect``: opening a DuckDB database
        starts an instance (about 15 ms, most of it the instance's own set-up, whatever the file),
        and a build asks short questions of the catalog 150 times and more (2.4 s of a 38 s
        incremental build at 107,000 episodes). This process keeps one in-memory instance per
        warehouse and attaches the catalog file read-only to it while any of its cursors is open
        (about 3 ms), detaching it after the last: between two questions the file is not held, so
        a writer in another process is never kept waiting and the next question sees its commit.
        Settings are per cursor (``file_search_path``) or the instance's own (the spill folder and
        memory limit a file instance of the catalog has), so nothing one question sets leaks into
        the next. While this process holds the exclusive write lock (no other process can change
        the catalog) the file stays attached between questions, and is attached anew when its
        stamp changed (this process's own commits) or a write connection is opened here: a forget
        at 108,070 episodes asked 105 questions, each attachment and detachment about 7 ms."""
        self.require()
        me, key = threading.get_ident(), self._holder_key()
        _enter(_READING, _WRITERS, key, me)  # (waits while another thread has a write connection open)
        try:
            with _READERS_LOCK:
                reader = _reader(self)
                reader.users += 1  # (a reader in use is never closed)
        except BaseException:
            _leave(_READING, key, me)
            raise
        cur = None
        try:
            with reader.lock:
                if reader.attached and reader.users == 1 and reader.stamp != self._reader_stamp():
                    reader.detach()  # kept (``_keeps_reader``) while the file changed: attached anew
                if not reader.attached:
                    stamp = self._reader_stamp()  # (before: a change after it is seen at the next question)
                    _attach_with_retry(self, reader)
                    reader.attached, reader.stamp = True, stamp
                if self.remote:  # the store as the environment names it now (a changed key, a new filesystem)
                    fs = duckdb_filesystem()
                    if reader.fs is not fs:
                        if reader.fs is not None:
                            reader.db.unregister_filesystem("s3")
                        reader.db.register_filesystem(fs)
                        reader.fs = fs
            cur = reader.db.cursor()
            cur.execute(f"USE {reader.alias}")
            cur.execute(f"SET file_search_path = '{_sql_str(str(self.root))}'")
            yield cur
        finally:
            if cur is not None:
                cur.close()
            with _READERS_LOCK:
                reader.users -= 1
            _leave(_READING, key, me)
            with reader.lock:  # the last one out lets the file go (unless another came in meanwhile, or
                if reader.users == 0 and reader.attached and not _keeps_reader(self):  # this process writes)
                    reader.detach()

    def stream(self, sql: str, params: Sequence[Any] | None = None, *, batch_rows: int = 10_000,
               memory_limit: str | None = None, arrow: bool = False, threads: int | None = None) -> Iterator[Any]:
        """Rows of a read-only query in batches of dicts (Arrow record batches with ``arrow``), never
        the whole result in memory: DuckDB streams the result (sorting and joining within
        ``memory_limit``, default 384 MB at the default memory budget and scaled to the build's
        (``lineage.parallel.duckdb_memory``), spilling the rest to a temporary folder under the
        warehouse)."""
        con = self.connect(read_only=True)
        try:
            spill = self.root / ".tmp"
            ensure_dir(spill, restricted=True)  # spilled rows are warehouse data: owner-only
            con.execute(f"SET memory_limit = '{memory_limit or duckdb_memory(384)}'")
            # the instance is shared by this process's connections to the file: a stream that asked
            # for one thread would otherwise leave every later stream on one
            con.execute(f"SET threads = {int(threads)}" if threads else "RESET threads")
            current = con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0]
            if current != str(spill):  # connections to one file share an instance: set it once
                con.execute(f"SET temp_directory = '{_sql_str(str(spill))}'")
            reader = con.sql(sql, params=list(params or [])).fetch_record_batch(batch_rows)
            for rb in reader:
                yield rb if arrow else rb.to_pylist()
        finally:
            con.close()

    def user_query(self, sql: str, *, restricted: bool = False, out: str | os.PathLike[str] | None = None,
                   fmt: str = "parquet") -> Any:
        """Run one user statement, read-only for real (``trajwh sql``; docs/sql.md). Returns an Arrow
        table, or with ``out`` writes the result to that file with DuckDB's own ``COPY`` (``fmt``:
        csv, json lines or parquet; see ``copy_result``) and returns the number of rows written.

        The statement:

        - exactly one statement, and it must be a query (SELECT / WITH / FROM / DESCRIBE / SHOW /
          SUMMARIZE): no COPY, EXPORT, ATTACH, SET, PRAGMA, CALL, LOAD or INSTALL, no second
          statement after a semicolon;
        - the connection reads only the layer folders of this warehouse (``allowed_directories``
          with external access off and the configuration locked): not the vault or its salt, not
          the catalog file, not the host's files; no extension is installed or loaded.
        """
        statements = self._parse_user_sql(sql)
        con = self._snapshot(user_names=True, restricted=restricted, text=statements[0])
        try:
            layers = sorted((set(TABLE_LAYERS.values()) | {"_schemas"}) - (set() if restricted else RESTRICTED_LAYERS))
            allowed = [f"{d}/" for d in layers] + [f"{self.root / d}/" for d in layers]
            if self.remote:
                allowed += [f"{self.data / d}/" for d in layers]
            con.execute("SET autoinstall_known_extensions = false")
            con.execute("SET autoload_known_extensions = false")
            con.execute("SET allowed_directories = ?", [allowed])
            if out is not None:  # the one file the result may be written to: a new name beside it, then renamed
                out = os.path.abspath(out)
                partial = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.partial-{os.getpid()}")
                con.execute("SET allowed_paths = ?", [[partial]])
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
            if out is None:
                return con.sql(statements[0]).to_arrow_table()
            try:
                rows = copy_result(con, con.sql(statements[0]), partial, fmt)
                os.replace(partial, out)
                return rows
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
        finally:
            con.close()

    def _snapshot(self, *, user_names: bool = False, restricted: bool = False,
                  text: str = "") -> duckdb.DuckDBPyConnection:
        """An in-memory database holding a copy of the catalog's tables and views over the same
        (immutable, content-named) Parquet files: a long user query never holds the catalog file,
        so writers are not kept waiting by readers.

        ``user_names`` (``trajwh sql``): safe by default, as ARCHITECTURE.md asks. The plain names
        ``episodes``, ``steps`` and ``tool_schemas`` mean the redacted tables; ``raw_records`` and
        ``quarantine`` show where records came from but not their bytes (no ``payload``, and no
        quarantine ``reason``, which can quote them); the secret-bearing tables themselves are in
        a ``restricted`` schema only with ``restricted``."""
        con = self.connect(read_only=True)
        try:
            have = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
            # a table added by a later version is empty until a writer creates it in the file
            tables = {t: con.sql(f"SELECT * FROM {t}").to_arrow_table() if t in have else empty_table(t)
                      for t in ("table_files", "meta", *CATALOG_TABLES)}
        finally:
            con.close()
        mem = duckdb.connect(":memory:")
        self._attach_storage(mem)
        for name, data in tables.items():
            mem.register("_t", data)
            mem.execute(f"CREATE TABLE {name} AS SELECT * FROM _t")
            mem.unregister("_t")
        _refresh_views(mem, PARQUET_TABLES, self._view_prefix())
        if user_names:
            _user_views(mem, restricted, text)
        return mem

    @staticmethod
    def _parse_user_sql(sql: str) -> list[str]:
        try:
            statements = duckdb.extract_statements(sql)
        except duckdb.Error as exc:
            raise ConfigError(f"the SQL does not parse: {exc}", valid="one SELECT query") from None
        if len(statements) != 1:
            raise ConfigError(f"{len(statements)} statements given; trajwh sql runs exactly one",
                              valid="one SELECT / WITH / DESCRIBE / SHOW query, without a second statement")
        kind = statements[0].type
        if kind != duckdb.StatementType.SELECT:
            raise ConfigError(f"{kind.name} statements are not allowed: the catalog is read-only",
                              valid="a query: SELECT, WITH ... SELECT, FROM, DESCRIBE, SHOW, SUMMARIZE")
        return [statements[0].query]

    def files(self, table: str, *, batch_id: str | None = None) -> list[DataPath]:
        sql = "SELECT path FROM table_files WHERE table_name = ?"
        params: list[Any] = [table]
        if batch_id is not None:
            sql += " AND batch_id = ?"
            params.append(batch_id)
        return [self.data / r["path"] for r in self.query(sql + " ORDER BY added_at, path", params).to_pylist()]

    def rows_of(self, table: str, keys: Sequence[str], batches: Collection[str | None] | None = None) -> str:
        """A FROM source for the rows of a per-batch table (written by batch: ``redacted_steps``, ...)
        that belong to the episodes ``keys``, the caller still filtering by key. At most
        ``LOCATE_KEYS`` of them: only the row groups that hold their rows (``_located``), else the
        files of their batches (``batches``, when the caller knows them; else found by a query),
        and of none, should a file have no batch; the table's view when that is every batch. An
        incremental build's few episodes are mostly of the new batch, a forget's anywhere (108,070
        + 1 %, the steps of the 77 episodes a forget's fragments redo, in one batch of 2.3 M steps:
        its files 0.57 s, their row groups 0.27 s)."""
        if batches is None:
            batches = self.query("SELECT DISTINCT _batch_id FROM redacted_episodes WHERE trajectory_key IN "
                                 "(SELECT unnest(?::VARCHAR[]))", [list(keys)]).column(0).to_pylist() if keys else []
        paths, every = self._batch_paths(table, batches)
        if keys and len(keys) <= LOCATE_KEYS:
            return self._located(paths, keys)
        return table if every else _parquet_source(paths)

    def rows_in(self, table: str, batches: Collection[str | None]) -> str:
        """A FROM source for the rows of a per-batch table in the files of ``batches`` (and of none,
        should a file have no batch); the table's view when they are every batch (``rows_of``)."""
        paths, every = self._batch_paths(table, batches)
        return table if every else _parquet_source(paths)

    def _batch_paths(self, table: str, batches: Collection[str | None]) -> tuple[list[str], bool]:
        """The table's empty schema file and its files of ``batches`` (and of none), as DuckDB reads
        them; and whether those are every file (``None`` among ``batches`` says so too)."""
        rows = self.manifest_query("SELECT path, batch_id FROM table_files WHERE table_name = ? ORDER BY added_at, path",
                                   [table]).to_pylist()
        every = None in batches or {r["batch_id"] for r in rows} <= set(batches)
        prefix = self._view_prefix()
        return [f"{prefix}_schemas/{table}.parquet"] + [
            prefix + r["path"] for r in rows if every or r["batch_id"] is None or r["batch_id"] in batches], every

    def _located(self, paths: list[str], keys: Sequence[str]) -> str:
        """A FROM source for the rows of ``keys`` among the files ``paths`` (the first: the table's
        empty schema file): a scan of the key column alone finds the files and row numbers that hold
        them, and the source reads those ranges of rows only, each file on its own (DuckDB skips a
        row group no range of its file touches: a filter on the key decodes every column of every
        row group; 2.3 M steps, the key column alone 0.08 s, every column 0.5 s)."""
        found = self.query(
            "SELECT filename, min(file_row_number) AS lo, max(file_row_number) AS hi FROM read_parquet([{}], "
            "union_by_name = true, filename = true, file_row_number = true) WHERE trajectory_key IN "
            "(SELECT unnest(?::VARCHAR[])) GROUP BY filename, trajectory_key ORDER BY filename, lo".format(
                ", ".join(f"'{_sql_str(p)}'" for p in paths)), [list(keys)]).to_pylist()
        ranges: dict[str, list[tuple[int, int]]] = {}
        for r in found:  # (an episode's rows lie together in a file: one range each, adjacent ones joined)
            spans = ranges.setdefault(r["filename"], [])
            if spans and r["lo"] <= spans[-1][1] + 1:
                spans[-1] = (spans[-1][0], max(spans[-1][1], r["hi"]))
            else:
                spans.append((r["lo"], r["hi"]))
        parts = [f"SELECT * FROM {_parquet_source(paths[:1])}"] + [  # the schema file: every column, no row
            "SELECT * EXCLUDE (file_row_number) FROM read_parquet('{}', file_row_number = true) WHERE {}".format(
                _sql_str(name), " OR ".join(f"file_row_number BETWEEN {lo} AND {hi}" for lo, hi in spans))
            for name, spans in ranges.items()]
        return "(" + " UNION ALL BY NAME ".join(parts) + ")"

    # --- writing -------------------------------------------------------------------------

    @contextmanager
    def write_session(self, op: str, *, timeout: float = 60.0, shared: bool = False) -> Iterator[WriteSession]:
        """Hold the warehouse's write lock for one operation (ingest, build, ...).

        ``shared``: a per-batch writer (a run of chosen batches' partitions: normalize, redact, the
        episode features). Several
        hold the lock at once; each writes content-named files that no manifest lists yet and
        commits them in the catalog's own write transaction (one process at a time), deciding there
        against what the others committed (``WriteSession.commit``'s guard). Every other writer
        holds it exclusively: it waits for the shared holders and they for it, and only it removes
        unlisted files (a shared holder's files are unlisted until it commits).

        When the data is in object storage, an exclusive session that ends without an error
        publishes the catalog there (``publish_replica``) for readers on other hosts."""
        self._refuse_replica(op)
        ensure_dir(self.root, restricted=True)
        lock_path = self.root / ".lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _acquire(fd, lock_path, op, timeout, shared=shared)
            if shared and not self.catalog_path.exists():
                raise CatalogError(f"no catalog at {self.catalog_path}: a per-batch writer needs an ingested warehouse")
            session = WriteSession(self, op)
            session.init_catalog()
            if not shared:
                session.collect_garbage()
                holder = self._holder_key()
                _HOLDERS[holder] = _HOLDERS.get(holder, 0) + 1
            try:
                yield session
            finally:
                if not shared:
                    _release_holder(self)
            if not shared and self.remote:
                self.publish_replica()
        finally:
            os.close(fd)  # releases the flock

    def _reader_stamp(self) -> tuple:
        """What a kept reader's attachment is checked against: the catalog files' stamps, and the
        write connections this process closed (a file's time may not change within a clock tick)."""
        return self._catalog_stamp(), _WRITES[0]

    def _holder_key(self) -> tuple[int, str]:
        return (os.getpid(), str(self.catalog_path))

    def _refuse_replica(self, op: str) -> None:
        """No write through a published catalog's copy: named by its URI, or its folder named (its
        ``storage.json``, which ``data`` reads once, says so)."""
        replica = self.replica_of
        if replica is None:
            _ = self.data  # (sets _copy_of)
            replica = self._copy_of
        if replica is not None:
            raise ConfigError(f"{op}: the warehouse {replica} is named by its URI, so this host reads the "
                              "catalog its writer host publishes there and writes nothing",
                              valid="run writes where its folder is (--warehouse DIR; the folder holds the catalog, "
                                    "the lock and the vault), or read here (sql, status, trace, export)")


def _acquire(fd: int, lock_path: Path, op: str, timeout: float, *, shared: bool = False) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown"
                raise WarehouseBusyError(
                    f"warehouse {lock_path.parent} is busy: another writer holds its lock ({holder}); "
                    f"waited {timeout:.0f} s",
                    valid="wait for it to finish, or pass a longer --wait",
                ) from None
            time.sleep(0.2)
    info = f"pid {os.getpid()} on {socket.gethostname()}, {op} since {now_utc().isoformat(timespec='seconds')}"
    if shared:  # beside others: the last one's line (a whole line, padded over a longer one)
        info = f"{info} (shared: per-batch writers)"
        os.pwrite(fd, info.encode().ljust(512), 0)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode(), 0)


def _init_schema(con: duckdb.DuckDBPyConnection, *, fresh: bool, prefix: str) -> None:
    """Manifest, metadata tables (with columns added by later versions) and views, idempotently."""
    con.execute("BEGIN")
    con.execute(_MANIFEST_DDL)
    for table, model in CATALOG_TABLES.items():
        con.register("_empty", arrow_schema(model).empty_table())
        con.execute(f"CREATE TABLE IF NOT EXISTS {table} AS SELECT * FROM _empty")
        have = {r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()}
        for name, type_, *_ in con.execute("DESCRIBE _empty").fetchall():
            if name not in have:  # a column added by a later schema version (nullable)
                con.execute(f'ALTER TABLE {table} ADD COLUMN "{name}" {type_}')
        con.unregister("_empty")
    row = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchall()
    if not row:
        con.execute("INSERT INTO meta VALUES ('schema_version', ?), ('created_at', ?)",
                    [SCHEMA_VERSION, now_utc().isoformat()])
    views = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    if fresh or not row:
        _refresh_views(con, PARQUET_TABLES, prefix)
    elif set(PARQUET_TABLES) - views:  # a table added by a later version: its (empty) view
        _refresh_views(con, set(PARQUET_TABLES) - views, prefix)
    con.execute("COMMIT")


COPY_FORMATS = ("csv", "json", "parquet")


def copy_result(con: duckdb.DuckDBPyConnection, rel: duckdb.DuckDBPyRelation, out: str, fmt: str) -> int:
    """Write a query's result to ``out`` with DuckDB's ``COPY`` (streamed, never an Arrow or
    Python copy of the result) and return the rows written. ``csv``: a header line; lists and
    structs as JSON text, bytes as base64, times in ISO 8601 (with a space), null as an empty cell. ``json``:
    one object per line, bytes as base64. ``parquet``: zstd, types kept. The user's text is
    never pasted into SQL here: the result is a view of the parsed relation."""
    if fmt not in COPY_FORMATS:
        raise ConfigError(f"unknown output format {fmt!r}", valid=", ".join(COPY_FORMATS))
    cols = []
    for name, dtype in zip(rel.columns, rel.dtypes, strict=True):
        ident, kind = '"' + name.replace('"', '""') + '"', str(dtype)
        if fmt != "parquet" and kind == "BLOB":
            cols.append(f"base64({ident}) AS {ident}")
        elif fmt == "csv" and (kind.endswith("]") or kind.startswith(("STRUCT(", "MAP(", "UNION("))):
            cols.append(f"to_json({ident}) AS {ident}")
        else:
            cols.append(ident)
    options = {"csv": "FORMAT csv, HEADER true", "json": "FORMAT json",
               "parquet": "FORMAT parquet, COMPRESSION zstd"}[fmt]
    rel.create_view("_trajwh_result")
    select = f"SELECT {', '.join(cols)} FROM _trajwh_result" if cols else "SELECT * FROM _trajwh_result"
    return int(con.execute(f"COPY ({select}) TO '{_sql_str(out)}' ({options})").fetchone()[0])


#: at most this many keys are found in their row groups by ``Warehouse.rows_of`` (more read their batches' files)
LOCATE_KEYS = 2_000

_MEMORY: list[Any] = []  # [pid, in-memory connection]


class _Reader:
    """This process's in-memory DuckDB instance for reading one warehouse's catalog
    (``Warehouse._reading``): the catalog is attached while ``users`` > 0."""

    def __init__(self, wh: Warehouse):
        self.spill = f"{wh.catalog_path}.tmp"
        self.db = self._instance()
        self.alias = "wh_" + hashlib.sha256(str(wh.catalog_path).encode()).hexdigest()[:16]
        self.lock = threading.Lock()  # attach, detach, filesystem
        self.users = 0  # cursors open (changed under ``_READERS_LOCK``)
        self.attached = False
        self.stamp: tuple = ()  # the catalog's file stamps when it was attached
        self.fs: Any = None  # the S3 filesystem registered on the instance, if any

    def _instance(self) -> duckdb.DuckDBPyConnection:
        # where a file instance of the catalog spills (made only if a query spills: a reader writes nothing)
        return _new_instance(self.spill)

    def detach(self) -> None:
        """Let the catalog file go (under ``lock``, no cursor open). A detach that fails (a signal
        interrupts DuckDB's statements: Ctrl-C during a question) closes the instance, which lets
        the file go as surely, and starts a new one: a reader never keeps the file held."""
        try:
            self.db.execute(f"DETACH {self.alias}")
        except BaseException:
            self.db.close()
            self.db, self.fs = self._instance(), None
            raise
        finally:
            self.attached = False


#: (pid, catalog path) -> its reader; a few warehouses at most (the tests open hundreds in turn)
_READERS: dict[tuple[int, str], _Reader] = {}
_READERS_LOCK = threading.Lock()
_MAX_READERS = 4
#: readers a forked child inherited: never used, never closed there (their instance is the parent's)
_INHERITED: list[_Reader] = []


#: per catalog (``Warehouse._holder_key``), the threads of this process with questions or read-only
#: connections open on it, and with write connections open, and how many. Within one process
#: DuckDB attaches a file to one instance at a time when one of them writes, so a thread that
#: reads waits while another thread has a write connection open, and a write connection waits for
#: the reads other threads have open (``_GATE``: a forget curates in a thread while it stores its
#: request). A thread's own read beside its own write connection is refused as before (the
#: attach fails): it would wait for itself.
_READING: dict[tuple[int, str], dict[int, int]] = {}
_WRITERS: dict[tuple[int, str], dict[int, int]] = {}
_GATE = threading.Condition()


def _enter(mine: dict[tuple[int, str], dict[int, int]], others: dict[tuple[int, str], dict[int, int]],
           key: tuple[int, str], me: int) -> None:
    """Thread ``me`` opens a read (``mine`` is ``_READING``) or a write (``_WRITERS``) on the
    catalog ``key``: it waits while another thread holds the other kind open."""
    with _GATE:
        while any(t != me for t in others.get(key, {})):
            _GATE.wait()
        held = mine.setdefault(key, {})
        held[me] = held.get(me, 0) + 1


def _leave(mine: dict[tuple[int, str], dict[int, int]], key: tuple[int, str], me: int | None = None) -> None:
    """One read or write (``_enter``) of thread ``me`` closed (the caller's; any thread's, if it
    holds none: a connection collected in another thread)."""
    me = threading.get_ident() if me is None else me
    with _GATE:
        held = mine.get(key, {})
        holder = me if me in held else next(iter(held), None)
        if holder is not None:
            held[holder] -= 1
            if not held[holder]:
                del held[holder]
        if not held:
            mine.pop(key, None)
        _GATE.notify_all()


#: write connections to a catalog this process closed (``Warehouse._reader_stamp``; a reader attached
#: while one was open sees the count change when it closes)
_WRITES = [0]
#: (pid, catalog path) -> the exclusive write sessions this process holds on it (``_keeps_reader``)
_HOLDERS: dict[tuple[int, str], int] = {}


def _keeps_reader(wh: Warehouse) -> bool:
    """Whether this process's reader keeps ``wh``'s catalog attached between questions: while it
    holds the exclusive write lock (``Warehouse._reading``)."""
    return _HOLDERS.get(wh._holder_key(), 0) > 0


def _release_holder(wh: Warehouse) -> None:
    """One exclusive write session of this process ended: after the last, its reader lets the
    file go."""
    key = wh._holder_key()
    _HOLDERS[key] -= 1
    if not _HOLDERS[key]:
        del _HOLDERS[key]
        _let_reader_go(wh)


def _let_reader_go(wh: Warehouse) -> None:
    """Detach the catalog from this process's reader if no question is open on it."""
    with _READERS_LOCK:
        reader = _READERS.get((os.getpid(), str(wh.catalog_path)))
    if reader is not None:
        with reader.lock:
            if reader.users == 0 and reader.attached:
                reader.detach()


def _reader(wh: Warehouse) -> _Reader:
    """This process's reader of ``wh``'s catalog (under ``_READERS_LOCK``), the least recently used
    idle ones closed beyond ``_MAX_READERS``."""
    pid = os.getpid()
    for key in [k for k in _READERS if k[0] != pid]:  # an instance is not inherited across a fork
        _INHERITED.append(_READERS.pop(key))
    key = (pid, str(wh.catalog_path))
    hit = _READERS.pop(key, None)
    if hit is None:
        idle = [k for k, r in _READERS.items() if r.users == 0]
        for old in idle[:max(0, len(_READERS) + 1 - _MAX_READERS)]:
            stale = _READERS.pop(old)
            with stale.lock:
                stale.db.close()
        hit = _Reader(wh)
    _READERS[key] = hit  # most recently used last
    return hit


class _Attached:
    """A connection to the catalog as ``Warehouse.connect`` hands it out: a cursor of an in-memory
    DuckDB instance that this process keeps, with the catalog file attached to it (read-only or for
    writing) while any such cursor is open, and detached after the last one closes (a detach after
    writes checkpoints, as closing a file instance did). Opening the file as a database of its own
    started a DuckDB instance each time: about 20 ms, 43 times in a forget at 108,070 episodes;
    attaching it to a kept one takes 3 ms read-only, 11 ms for writing. It behaves as the
    connection it wraps (``execute``, ``sql``, ``register``, ...). ``close`` (or the end of a
    ``with`` block) lets the file go; a connection dropped without one lets it go when nothing
    uses its cursor any more (a relation or result made from it keeps it, as DuckDB's own did).

    As with DuckDB's own cache of instances, the connections open at once in one process share one
    attachment (the same database, so a write is seen by the reads beside it), and one opened
    read-only while another is open for writing (or the reverse) is refused. Settings such as
    ``memory_limit`` and ``threads`` are the instance's: shared by the connections open at once, and
    reset when the file is next attached."""

    def __init__(self, cur: duckdb.DuckDBPyConnection, slot: _Slot):
        self._cur, self._slot = cur, slot
        self._done = weakref.finalize(cur, _release_quietly, slot)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)

    def close(self) -> None:
        try:
            self._cur.close()
        finally:
            if self._done.detach() is not None:  # (once: a second close does nothing)
                _release(self._slot)

    def __enter__(self) -> _Attached:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Slot:
    """One catalog file attached in this process (``_Attached``): the instance, how, and how many
    connections use it."""

    def __init__(self, key: tuple[int, str], db: duckdb.DuckDBPyConnection, alias: str, read_only: bool):
        self.key, self.db, self.alias, self.read_only, self.users = key, db, alias, read_only, 0


#: (pid, catalog path) -> its attachment while a connection is open; a lock per catalog path
_SLOTS: dict[tuple[int, str], _Slot] = {}
_SLOT_LOCKS: dict[tuple[int, str], threading.RLock] = {}
_SLOTS_LOCK = threading.RLock()  # (re-entered should a collection run a dropped connection's release inside)
#: (pid, instance) kept with nothing attached; one of another pid was inherited by a fork: never
#: used or closed there (the instance is the parent's)
_IDLE: list[tuple[int, duckdb.DuckDBPyConnection]] = []
_MAX_IDLE = 4


def _slot_lock(key: tuple[int, str]) -> threading.RLock:
    with _SLOTS_LOCK:
        return _SLOT_LOCKS.setdefault(key, threading.RLock())


def _instance(spill: str) -> duckdb.DuckDBPyConnection:
    """A kept in-memory instance (an idle one, else a new one) whose queries spill to ``spill``
    (an instance that spilled elsewhere cannot change it: it is closed, and a new one made)."""
    pid = os.getpid()
    with _SLOTS_LOCK:
        db = next((d for p, d in _IDLE if p == pid), None)
        if db is not None:
            _IDLE.remove((pid, db))
    if db is not None:
        try:
            if db.execute("SELECT current_setting('temp_directory')").fetchall()[0][0] != spill:
                db.execute(f"SET temp_directory = '{_sql_str(spill)}'")
            db.execute("RESET memory_limit")
            db.execute("RESET threads")
            return db
        except duckdb.Error:
            db.close()
    return _new_instance(spill)


def _new_instance(spill: str) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB instance to keep (``_Reader``, ``_Attached``) whose queries spill to ``spill``."""
    db = duckdb.connect(":memory:")
    db.execute(f"SET temp_directory = '{_sql_str(spill)}'")
    db.execute("SET enable_progress_bar = false")  # a worker's long query would print one into the output
    # a kept instance must not keep what its questions read: DuckDB's external file cache holds
    # blocks of the files it reads (object storage's) for as long as the instance lives
    db.execute("SET enable_external_file_cache = false")
    # nor hold what its queries freed: DuckDB's allocator (jemalloc, one arena per thread) gives
    # freed memory back only when a later query allocates again, so an instance kept between two
    # questions held up to 400 MB through the Python work after a big sort (a forget's curation);
    # background threads purge it within about a second (the setting is the process's)
    db.execute("SET allocator_background_threads = true")
    return db


def _attach(wh: Warehouse, read_only: bool, timeout: float) -> _Attached:
    key = (os.getpid(), str(wh.catalog_path))
    gate = _READING if read_only else _WRITERS
    _enter(gate, _WRITERS if read_only else _READING, key, threading.get_ident())  # (``_GATE``)
    try:
        if not read_only and _keeps_reader(wh):  # (a reader kept attached never reads beside this process's writes)
            _let_reader_go(wh)
        return _attach_slot(wh, key, read_only, timeout)
    except BaseException:
        _leave(gate, key)
        raise


def _attach_slot(wh: Warehouse, key: tuple[int, str], read_only: bool, timeout: float) -> _Attached:
    with _slot_lock(key):
        slot = _SLOTS.get(key)
        if slot is not None and slot.read_only != read_only:
            raise CatalogError(f"catalog {wh.catalog_path} is open {'read-only' if slot.read_only else 'for writing'} "
                               f"in this process: it cannot also be opened {'read-only' if read_only else 'for writing'}",
                               valid="close the other connection first")
        if slot is None:
            db = _instance(str(wh.root / ".tmp"))
            alias = '"' + wh.catalog_path.stem.replace('"', '""') + '"'
            mode = " (READ_ONLY)" if read_only else ""
            try:
                _retrying(wh, lambda: db.execute(f"ATTACH '{_sql_str(str(wh.catalog_path))}' AS {alias}{mode}"), timeout)
            except BaseException:
                _keep_idle(db)
                raise
            slot = _SLOTS[key] = _Slot(key, db, alias, read_only)
        slot.users += 1
        cur = None
        try:
            cur = slot.db.cursor()
            cur.execute(f"USE {slot.alias}")
        except BaseException:
            if cur is not None:
                cur.close()
            _release(slot, leave=False)  # (``_attach`` leaves the gate)
            raise
    return _Attached(cur, slot)


def _release(slot: _Slot, *, leave: bool = True) -> None:
    """One connection of ``slot`` closed: after the last, the file is detached (a detach that fails
    closes the instance, which lets the file go as surely) and the instance kept for the next; then
    the connection leaves the gate (``_GATE``)."""
    try:
        _release_slot(slot)
    finally:
        if leave:
            _leave(_READING if slot.read_only else _WRITERS, slot.key)


def _release_slot(slot: _Slot) -> None:
    with _slot_lock(slot.key):
        slot.users -= 1
        if slot.users:
            return
        if _SLOTS.get(slot.key) is slot:
            del _SLOTS[slot.key]
        try:
            if slot.db.filesystem_is_registered("s3"):  # (registered for this warehouse's store)
                slot.db.unregister_filesystem("s3")
            slot.db.execute(f"DETACH {slot.alias}")
        except BaseException:
            slot.db.close()
            raise
        finally:
            if not slot.read_only:
                _WRITES[0] += 1
        _keep_idle(slot.db)


def _release_quietly(slot: _Slot) -> None:
    """``_release`` for a connection collected without a close (an error there has no caller)."""
    try:
        _release(slot)
    except BaseException:  # noqa: BLE001 (the instance is closed: the file is let go)
        pass


def _keep_idle(db: duckdb.DuckDBPyConnection) -> None:
    with _SLOTS_LOCK:
        if sum(p == os.getpid() for p, _ in _IDLE) < _MAX_IDLE:
            _IDLE.append((os.getpid(), db))
            return
    db.close()


def _retrying(wh: Warehouse, open_catalog: Callable[[], Any], timeout: float) -> Any:
    """``open_catalog()`` (a connect or an attach of the catalog file), retried while another
    process holds the file to commit, for up to ``timeout`` seconds."""
    deadline, delay = time.monotonic() + timeout, 0.05
    while True:
        try:
            return open_catalog()
        except duckdb.IOException as exc:
            if "lock" not in str(exc).lower():
                raise CatalogError(f"cannot open catalog {wh.catalog_path}: {exc}") from exc
            if time.monotonic() > deadline:  # another process keeps the catalog file open
                raise WarehouseBusyError(
                    f"catalog {wh.catalog_path} is busy: another process holds it open ({exc})",
                    valid="wait for it to finish, or pass a longer --wait") from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _attach_with_retry(wh: Warehouse, reader: _Reader, timeout: float = 30.0) -> None:
    """Attach the catalog read-only to ``reader`` (retrying as ``Warehouse.connect`` does) and
    check its schema version."""
    _retrying(wh, lambda: reader.db.execute(
        f"ATTACH '{_sql_str(str(wh.catalog_path))}' AS {reader.alias} (READ_ONLY)"), timeout)
    cur = reader.db.cursor()
    try:
        cur.execute(f"USE {reader.alias}")
        wh._check_version(cur)
    except BaseException:
        cur.close()
        reader.detach()
        raise
    cur.close()


#: catalog files (path, inode) this process has initialized (a replaced file has a new inode)
_INITIALIZED: set[tuple[str, int]] = set()
#: manifests read by this process, by catalog path: ((file stamps, commits), table)
_MANIFESTS: dict[str, tuple[tuple, pa.Table]] = {}
#: catalog path -> the file stamps (``Warehouse._catalog_stamp``) whose schema version was last found readable
_VERSIONS_READ: dict[str, tuple] = {}
#: commits made by this process (any catalog): a cached manifest older than the last is not used
_COMMITS = [0]


def _sql_str(value: str) -> str:
    return value.replace("'", "''")


@cache
def _schema_stamp() -> str:
    """The code that makes the empty schema files: their bytes change only when it does."""
    import trajwh.schemas.arrow as arrow_module
    import trajwh.schemas.tables as tables_module

    h = hashlib.sha256(SCHEMA_VERSION.encode())
    for module in (tables_module, arrow_module):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()


@cache
def _empty_parquet(table: str) -> bytes:
    """The bytes of a table's empty schema file (made once per process: every write session
    compares them with the stored ones, and making them 19 times cost 0.13 s a session)."""
    sink = pa.BufferOutputStream()
    pq.write_table(empty_table(table), sink)
    return sink.getvalue().to_pybytes()


def write_table_file(wh: Warehouse, table: str, data: pa.Table) -> WrittenFile:
    """One content-named file of ``table``, not yet visible: a ``WriteSession`` commits it. A
    worker process of a stage writes its files with this and hands them to the session's holder."""
    expected = arrow_schema(PARQUET_TABLES[table])
    if not data.schema.equals(expected, check_metadata=False):
        data = data.cast(expected)
    data = data.replace_schema_metadata(expected.metadata)
    return write_parquet(table, data, wh.table_dir(table), restricted=wh.is_restricted(table),
                         plain=PLAIN_COLUMNS.get(table, frozenset()))


def _listed_since(before: tuple[Any, str | None] | None, stamp: datetime, f: WrittenFile) -> tuple[Any, str | None]:
    """(added_at, blake3) of a file a commit lists: those of its row before when the commit lists it
    again as it is (``before``: that row's), else now and the file's own."""
    if before is None:
        return stamp, f.blake3
    return before[0], f.blake3 or before[1]


def _insert_files(con: duckdb.DuckDBPyConnection, rows: list[tuple]) -> None:
    """Manifest rows (``table_files``' columns in order) inserted in one statement, a path already
    listed kept as it is: a statement a row took 9 ms a file (a pack build commits ~160)."""
    if rows:
        con.execute("INSERT OR IGNORE INTO table_files SELECT unnest(?::VARCHAR[]), unnest(?::VARCHAR[]), "
                    "unnest(?::VARCHAR[]), unnest(?::BIGINT[]), unnest(?::BIGINT[]), unnest(?::VARCHAR[]), "
                    "unnest(?::VARCHAR[]), unnest(?::VARCHAR[]), unnest(?::TIMESTAMPTZ[]), unnest(?::VARCHAR[])",
                    [list(c) for c in zip(*rows, strict=True)])


class WriteSession:
    """What a writer may do while it holds the lock: write files, then commit them."""

    def __init__(self, warehouse: Warehouse, op: str):
        self.wh = warehouse
        self.op = op

    def init_catalog(self) -> None:
        """Create folders, metadata tables and views if missing (idempotent); once per catalog
        file per process (a build opens a dozen write sessions)."""
        wh = self.wh
        try:
            done = (str(wh.catalog_path), os.stat(wh.catalog_path).st_ino) in _INITIALIZED
        except FileNotFoundError:
            done = False
        # the empty schema files sit with the data (a reader elsewhere needs only the catalog file)
        schemas_dir = wh.data / "_schemas"
        if done and schemas_dir.is_dir():
            return
        ensure_dir(schemas_dir, restricted=False)
        stamp, stamp_path = _schema_stamp(), schemas_dir / ".stamp"
        written = stamp_path.exists() and stamp_path.read_bytes() == stamp.encode()
        for table in PARQUET_TABLES:
            ensure_dir(wh.table_dir(table), restricted=wh.is_restricted(table))
            empty = schemas_dir / f"{table}.parquet"
            if written and empty.exists():
                continue  # made by this code already (building the bytes costs 0.7 s a process)
            data = _empty_parquet(table)
            if not empty.exists() or empty.read_bytes() != data:
                write_bytes_atomic(data, empty, restricted=False)
        if not written:
            write_bytes_atomic(stamp.encode(), stamp_path, restricted=False)
        for stale in wh.root.glob(".catalog-*.tmp*"):  # a creation killed half-way (we hold the lock)
            stale.unlink(missing_ok=True)
        fresh = not wh.catalog_path.exists()
        if wh.remote and not (wh.root / STORAGE_FILE).exists():  # before the catalog: it names the data's place
            write_bytes_atomic(json.dumps({"data": str(wh.data)}).encode(), wh.root / STORAGE_FILE, restricted=False)
        if fresh:  # built under a temporary name, then renamed: readers see no catalog or a whole one
            tmp = wh.root / f".catalog-{os.getpid()}.tmp"
            con = duckdb.connect(str(tmp))
            try:
                wh._attach_storage(con)
                _init_schema(con, fresh=True, prefix=wh._view_prefix())
            finally:
                con.close()
            os.chmod(tmp, 0o600)
            os.replace(tmp, wh.catalog_path)
        with wh.keeping_manifest():
            con = wh.connect(read_only=False, manifest=False)
            try:
                _init_schema(con, fresh=False, prefix=wh._view_prefix())
                wh._check_version(con)
            finally:
                con.close()
        _INITIALIZED.add((str(wh.catalog_path), os.stat(wh.catalog_path).st_ino))

    def collect_garbage(self) -> list[Path]:
        """Remove data files no manifest lists (left by a crashed writer) and temp files."""
        listed = set(self.wh.manifest().column("path").to_pylist())
        removed = []
        for table in PARQUET_TABLES:
            folder = self.wh.table_dir(table)
            for name, rel in _names(folder, self.wh.data):
                if name.startswith(TMP_PREFIX) or (name.endswith(".parquet") and rel not in listed):
                    path = folder / name
                    path.unlink(missing_ok=True)
                    removed.append(path)
        return removed

    def write(self, table: str, data: pa.Table) -> WrittenFile:
        """Write one file of ``table`` (not yet visible: pass it to ``commit``)."""
        return write_table_file(self.wh, table, data)

    @contextmanager
    def _transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A write connection inside BEGIN ... COMMIT (ROLLBACK on any error), closed after."""
        con = self.wh.connect(read_only=False)
        try:
            con.execute("BEGIN")
            yield con
            con.execute("COMMIT")
        except BaseException:
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass
            raise
        finally:
            con.close()

    def commit(
        self,
        added: Sequence[WrittenFile] = (),
        *,
        removed: Sequence[DataPath] = (),
        rows: dict[str, list[dict[str, Any]]] | None = None,
        batch_id: str | None = None,
        run_id: str | None = None,
        transform_version: str | None = None,
        guard: Callable[[duckdb.DuckDBPyConnection], Sequence[DataPath]] | None = None,
    ) -> None:
        """Make ``added`` visible, ``removed`` invisible and insert metadata ``rows``, atomically.
        ``guard`` runs first in the same transaction (no other process can commit until it ends):
        it may raise to abort the commit, and returns more files to remove, read from the catalog
        as it is then (a writer that holds the lock shared decides there against what others
        committed meanwhile)."""
        with self._transaction() as con:
            if guard is not None:
                removed = [*removed, *guard(con)]
            touched = self.list_files(con, added, removed, batch_id=batch_id, run_id=run_id,
                                 transform_version=transform_version)
            for table, table_rows in (rows or {}).items():
                if not table_rows:
                    continue
                _replace_rows(con, table, table_rows)
            _refresh_views(con, touched, self.wh._view_prefix())
        self._delete_after(added, removed)

    def list_files(self, con: duckdb.DuckDBPyConnection, added: Sequence[WrittenFile], removed: Sequence[DataPath], *,
              batch_id: str | None = None, run_id: str | None = None, transform_version: str | None = None) -> set[str]:
        """``commit``'s manifest changes through ``con`` (an open transaction): ``removed`` unlisted,
        ``added`` listed with the attributes given. Returns the tables touched."""
        root = self.wh.data
        touched = {f.table for f in added}
        since: dict[tuple[str, str], Any] = {}
        if removed:
            rels = [str(p.relative_to(root)) for p in removed]
            found = con.execute(
                "SELECT table_name, path, sha256, added_at, blake3 FROM table_files WHERE list_contains(?, path)",
                [rels]).fetchall()
            touched |= {t for t, *_ in found}
            # a file listed again as it is (a stage keeps it) keeps when it was first listed: the
            # proof of a forget reads a file listed before the forgotten data came by its digest
            since = {(path, sha): (at, b3) for _, path, sha, at, b3 in found}
            con.execute("DELETE FROM table_files WHERE list_contains(?, path)", [rels])
        stamp = now_utc()
        if added:
            first: dict[str, WrittenFile] = {}
            for f in added:  # a path listed twice: its first (as the row-at-a-time inserts kept)
                first.setdefault(str(f.path.relative_to(root)), f)
            _insert_files(con, [(f.table, rel, f.sha256, f.rows, f.size, batch_id, run_id, transform_version,
                                 *_listed_since(since.get((rel, f.sha256)), stamp, f))
                                for rel, f in first.items()])
        return touched

    @staticmethod
    def _delete_after(added: Sequence[WrittenFile], removed: Sequence[DataPath]) -> None:
        """The files a commit unlisted deleted (not one it listed again)."""
        keep = {str(f.path) for f in added}
        for p in removed:
            if str(p) not in keep:
                p.unlink(missing_ok=True)

    def replace_files(self, pairs: Sequence[tuple[DataPath, WrittenFile]], *,
                      rows: dict[str, list[dict[str, Any]]] | None = None,
                      then: Callable[[duckdb.DuckDBPyConnection], tuple[set[str], Sequence[WrittenFile],
                                                                        Sequence[DataPath]]] | None = None) -> None:
        """Swap each listed file for its rewritten copy, keeping the manifest attributes of the
        old one (batch, run, transform version: what incremental builds compare), plus metadata
        ``rows``, in one transaction; the old files are then deleted (deletion propagation).
        ``then`` runs last in the same transaction, reading the catalog as the swap left it and
        changing more through the connection (``list_files``): it returns the tables it touched and
        the files it listed and unlisted (those deleted after, as the old files)."""
        root = self.wh.data
        listed: Sequence[WrittenFile] = ()
        unlisted: Sequence[DataPath] = ()
        with self._transaction() as con:
            rels = [str(old.relative_to(root)) for old, _ in pairs]
            attrs = {r[0]: r[1:] for r in con.execute(
                "SELECT path, table_name, batch_id, run_id, transform_version, added_at FROM table_files "
                "WHERE list_contains(?, path)", [rels]).fetchall()}
            missing = [rel for rel in rels if rel not in attrs]
            if missing:
                raise CatalogError(f"{missing[0]} is not in the manifest of {root}: it cannot be replaced")
            con.execute("DELETE FROM table_files WHERE list_contains(?, path)", [rels])
            rows_in: dict[str, tuple] = {}  # a new path listed twice: its first (as the row-at-a-time inserts kept)
            for rel, (_, new) in zip(rels, pairs, strict=True):
                rows_in.setdefault(str(new.path.relative_to(root)), (attrs[rel], new))
            _insert_files(con, [(a[0], path, new.sha256, new.rows, new.size, a[1], a[2], a[3], a[4], new.blake3)
                                for path, (a, new) in rows_in.items()])
            touched = {a[0] for a in attrs.values()}
            for table, table_rows in (rows or {}).items():
                if table_rows:
                    _replace_rows(con, table, table_rows)
            if then is not None:
                more, listed, unlisted = then(con)
                touched |= more
            _refresh_views(con, touched, self.wh._view_prefix())
        self._delete_after([*(new for _, new in pairs), *listed], [*(old for old, _ in pairs), *unlisted])

    @staticmethod
    def upsert_in(con: duckdb.DuckDBPyConnection, table: str, rows: list[dict[str, Any]]) -> None:
        """``upsert_rows`` through ``con`` (an open transaction: ``replace_files``' ``then``)."""
        if table == "table_files":
            raise ValueError("the manifest changes through commit() and replace_files() only")
        _replace_rows(con, table, rows)

    @staticmethod
    def relabel(con: duckdb.DuckDBPyConnection, table: str, batch_id: str, transform_version: str) -> None:
        """Through ``con`` (``replace_files``' ``then``): the transform version a batch's files of
        ``table`` are listed with (files whose rows a stage would write again as they are)."""
        con.execute("UPDATE table_files SET transform_version = ? WHERE table_name = ? AND batch_id = ?",
                    [transform_version, table, batch_id])

    def upsert_rows(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Replace metadata rows by ``key`` (used for run records that change state)."""
        if table == "table_files":
            raise ValueError("the manifest changes through commit() and replace_files() only")
        with self.wh.keeping_manifest():
            con = self.wh.connect(read_only=False, manifest=False)
            try:
                con.execute("BEGIN")
                _replace_rows(con, table, rows)
                con.execute("COMMIT")
            finally:
                con.close()


#: metadata tables whose rows are replaced by key rather than appended (one Dagster run writes a
#: row per job, so a run row's key is the run id and the job)
_ROW_KEYS = {"runs": ("run_id", "job"), "batches": ("batch_id",), "deletions": ("request_id",),
             "opt_outs": ("opt_out_id",), "opt_out_scans": ("opt_out_id", "batch_id"),
             "opt_out_matches": ("opt_out_id", "record_id"), "exports": ("path",)}


def _replace_rows(con: duckdb.DuckDBPyConnection, table: str, rows: list[dict[str, Any]]) -> None:
    schema = arrow_schema(CATALOG_TABLES[table])
    con.register("_rows", pa.Table.from_pylist(rows, schema=schema))
    key = _ROW_KEYS.get(table)
    if key:
        match = " AND ".join(f"{table}.{k} = _rows.{k}" for k in key)
        con.execute(f"DELETE FROM {table} USING _rows WHERE {match}")
    con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _rows")
    con.unregister("_rows")


def _names(folder: DataPath, data: DataPath) -> list[tuple[str, str]]:
    """A table folder's file names, each with its path under the data root (as the manifest lists
    it); a local folder's names are listed alone (a ``Path`` made for each file cost a write
    session 18 ms at 108,070 episodes, this 4)."""
    if isinstance(folder, Path):
        rel = os.path.relpath(folder, data)
        with os.scandir(folder) as entries:
            return [(e.name, f"{rel}/{e.name}") for e in entries]
    return [(p.name, str(p.relative_to(data))) for p in folder.iterdir()]


def _refresh_views(con: duckdb.DuckDBPyConnection, tables: Any, prefix: str) -> None:
    """Each table's view over its files: manifest paths after ``prefix`` (``Warehouse._view_prefix``)."""
    for table in sorted(tables):
        paths = [prefix + r[0] for r in con.execute(
            "SELECT path FROM table_files WHERE table_name = ? ORDER BY added_at, path", [table]
        ).fetchall()]
        if not paths:
            paths = [f"{prefix}_schemas/{table}.parquet"]
        con.execute(f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM {_parquet_source(paths)}")


def _parquet_source(paths: list[str]) -> str:
    """What a view (or ``Warehouse.rows_of``) reads: the files, their columns by name."""
    return "read_parquet([{}], union_by_name = true)".format(", ".join(f"'{_sql_str(p)}'" for p in paths))


#: what the plain names mean in `trajwh sql`: the redacted tables (views), and the raw zone's
#: places without its bytes (copied into the snapshot: the raw files stay out of reach)
_USER_VIEWS = {
    "episodes": "SELECT * FROM redacted_episodes",
    "steps": "SELECT * FROM redacted_steps",
    "tool_schemas": "SELECT * FROM redacted_tool_schemas",
}
_USER_COPIES = {
    "raw_records": "SELECT * EXCLUDE (payload) FROM restricted_raw_records",
    "quarantine": "SELECT * EXCLUDE (payload, reason) FROM restricted_quarantine",
}


def _user_views(con: duckdb.DuckDBPyConnection, restricted: bool, text: str) -> None:
    secret = [t for t in PARQUET_TABLES if TABLE_LAYERS[t] in RESTRICTED_LAYERS]
    for table in secret:
        con.execute(f"ALTER VIEW main.{table} RENAME TO restricted_{table}")
    for name, sql in _USER_VIEWS.items():
        con.execute(f"CREATE VIEW main.{name} AS {sql}")
    listing = re.search(r"\bSHOW\b|\bduckdb_(tables|views|columns)\b|information_schema", text, re.I)
    for name, sql in _USER_COPIES.items():  # copied only for a query that names them (1 s at 107,000 records)
        if listing or re.search(rf"\b{name}\b", text, re.I):
            con.execute(f"CREATE TABLE main.{name} AS {sql}")
    if restricted:
        con.execute("CREATE SCHEMA restricted")
        for table in secret:
            con.execute(f"CREATE VIEW restricted.{table} AS SELECT * FROM main.restricted_{table}")
    else:  # nothing left names the secret-bearing files (and their folders are not readable either)
        for table in secret:
            con.execute(f"DROP VIEW main.restricted_{table}")


def json_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
