"""Immutable, content-named Parquet files written atomically.

A file is serialized in memory, named after the sha256 of its bytes, written to a temporary
name in the same folder, fsynced, renamed into place and the folder fsynced (the classic
write-rename protocol): a crash leaves either no file or a whole one, never a torn one. A file
only becomes part of a table when the catalog's manifest says so (``lineage.catalog``), so a
whole file from an uncommitted batch is invisible and is removed by the next writer.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import pyarrow as pa
import pyarrow.parquet as pq

TMP_PREFIX = ".tmp-"
#: rows per Parquet row group: small enough for selective reads, large enough for zstd
ROW_GROUP_ROWS = 8192


@dataclass(frozen=True)
class WrittenFile:
    table: str
    path: DataPath
    sha256: str
    rows: int
    size: int
    #: the BLAKE3 of the same bytes (``content_blake3``), when known: what a forget's plan and proof
    #: check an unchanged file by (a file listed again from the manifest carries the one it has)
    blake3: str | None = None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: DataPath, *, restricted: bool) -> None:
    if isinstance(path, ObjectPath):  # a prefix: nothing to make (access is the bucket's policy)
        return
    path.mkdir(parents=True, exist_ok=True)
    if restricted:
        os.chmod(path, 0o700)


def write_bytes_atomic(data: bytes, final: DataPath, *, restricted: bool) -> None:
    if isinstance(final, ObjectPath):  # one PUT: an object is visible whole or not at all
        final.write_bytes(data)
        return
    tmp = final.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fd = os.open(tmp, flags, 0o600 if restricted else 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def content_sha256(path: DataPath) -> str:
    """The sha256 of a file's bytes as they are now (a local file or an object), read in 4 MB
    pieces: what the manifest recorded when the file was written (``table_files.sha256``)."""
    return _content_digest(path, hashlib.sha256())


def content_blake3(path: DataPath) -> str:
    """The BLAKE3 of a file's bytes as they are now (``table_files.blake3``): a cryptographic hash
    about five times as fast as sha256 here (4.6 against 0.9 GB/s), for checking that files are
    still the bytes recorded (a forget reads about 1 GB of them twice at 108,070 episodes)."""
    if not isinstance(path, ObjectPath) and path.stat().st_size:  # a local file mapped, not copied into a
        return blake3.blake3().update_mmap(os.fspath(path)).hexdigest()  # buffer (2,242 files, about 1 GB:
    return _content_digest(path, blake3.blake3())                        # 0.25 -> 0.06 s of system time)


def content_digest(path: DataPath, recorded: tuple[str, str]) -> str:
    """The digest of a file's bytes now by the algorithm of ``recorded`` (``("blake3"|"sha256",
    digest)``, as ``recorded_digest`` gives it)."""
    return content_blake3(path) if recorded[0] == "blake3" else content_sha256(path)


def recorded_digest(row: dict[str, Any]) -> tuple[str, str]:
    """The digest a manifest row recorded to check its file by: its BLAKE3 when it has one (a file
    listed by an earlier version has only its sha256)."""
    b3 = row.get("blake3")
    return ("blake3", b3) if b3 else ("sha256", row["sha256"])


def _content_digest(path: DataPath, h: Any) -> str:
    buf = bytearray(1 << 22)  # one buffer read into: a new 4 MB object per read cost a page fault a page
    view = memoryview(buf)
    with path.open("rb") as fh:
        while n := fh.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def write_parquet(table_name: str, table: pa.Table, folder: DataPath, *, restricted: bool,
                  plain: frozenset[str] = frozenset()) -> WrittenFile:
    """Write ``table`` as one content-named Parquet file under ``folder``; the columns named in
    ``plain`` without a dictionary (``schemas.arrow.PLAIN_COLUMNS``)."""
    ensure_dir(folder, restricted=restricted)
    sink = pa.BufferOutputStream()
    dictionary = [c for c in table.column_names if c not in plain] if plain else True
    pq.write_table(table, sink, compression="zstd", row_group_size=ROW_GROUP_ROWS, use_dictionary=dictionary)
    data = sink.getvalue().to_pybytes()
    sha = hashlib.sha256(data).hexdigest()
    final = folder / f"part-{sha[:32]}.parquet"
    if not final.exists():
        write_bytes_atomic(data, final, restricted=restricted)
    return WrittenFile(table_name, final, sha, table.num_rows, len(data), blake3.blake3(data).hexdigest())


# --- object storage ----------------------------------------------------------------------------
#
# A warehouse's data files (every layer's Parquet files) may live in an S3-compatible object store
# rather than under its folder (docs/scale.md, "object storage"). ``ObjectPath`` is the one
# filesystem layer for them: the subset of ``pathlib.Path`` the warehouse uses on data files, over
# pyarrow's S3 filesystem (Arrow's C++ client: the same one ``pyarrow.parquet`` reads with). Its
# ``os.fspath`` is its ``s3://`` URI, so ``pyarrow.parquet`` opens it as it opens a local path, and
# DuckDB reads the URI through the filesystem registered on each connection (``duckdb_filesystem``).
# Objects are written once under their content's name (one PUT, visible whole or not at all) and
# become part of a table only when the catalog's manifest lists them: nothing relies on a rename.

#: what configures the object store: the standard AWS variables (never stored by the warehouse)
S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION")


def _s3_filesystem() -> Any:
    """pyarrow's S3 filesystem from the environment (``S3_ENV``): credentials, an endpoint for an
    S3-compatible store (``http://`` for a store on loopback), a region."""
    from pyarrow import fs as pafs
    from trajwh.schemas.errors import ConfigError

    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        raise ConfigError("the warehouse's data is in object storage, but AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                          "are not set", valid="the store's credentials in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                          "(and AWS_ENDPOINT_URL for a store other than AWS)")
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or None
    scheme = "https"
    if endpoint and "://" in endpoint:
        scheme, endpoint = endpoint.split("://", 1)
    return pafs.S3FileSystem(access_key=key, secret_key=secret, endpoint_override=endpoint, scheme=scheme,
                             region=os.environ.get("AWS_REGION") or "us-east-1")


_FILESYSTEMS: dict[tuple, Any] = {}


def s3_filesystem() -> Any:
    """One S3 filesystem per process and configuration (a client is costly to make)."""
    key = (os.getpid(), *(os.environ.get(k) for k in S3_ENV))
    if key not in _FILESYSTEMS:
        _FILESYSTEMS[key] = _s3_filesystem()
    return _FILESYSTEMS[key]


@dataclass(frozen=True)
class _Stat:
    st_size: int


class ObjectPath:
    """A path in an S3 bucket: ``ObjectPath("s3://bucket/prefix") / "raw" / "x.parquet"``."""

    __slots__ = ("key",)

    def __init__(self, uri: str):
        if not uri.startswith("s3://") or len(uri) <= 5:
            from trajwh.schemas.errors import ConfigError

            raise ConfigError(f"not an object storage URI: {uri!r}", valid="s3://bucket/prefix")
        object.__setattr__(self, "key", uri[5:].strip("/"))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ObjectPath is immutable")

    def __reduce__(self) -> tuple:  # pickled by its URI (a worker process hands written files back)
        return ObjectPath, (str(self),)

    # naming
    def __str__(self) -> str:
        return f"s3://{self.key}"

    def __fspath__(self) -> str:  # what pyarrow resolves (its S3 filesystem, configured like ours)
        return str(self)

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.key == self.key

    def __hash__(self) -> int:
        return hash(("s3", self.key))

    def __lt__(self, other: ObjectPath) -> bool:
        return self.key < other.key

    def __truediv__(self, part: str | os.PathLike[str]) -> ObjectPath:
        return ObjectPath(f"s3://{self.key}/{str(part).strip('/')}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        return name[name.rfind("."):] if "." in name.lstrip(".") else ""

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(f"s3://{self.key.rsplit('/', 1)[0]}") if "/" in self.key else self

    def relative_to(self, other: ObjectPath) -> str:
        prefix = other.key + "/"
        if not self.key.startswith(prefix):
            raise ValueError(f"{self} is not under {other}")
        return self.key[len(prefix):]

    # contents
    def stat(self) -> _Stat:
        from pyarrow import fs as pafs

        info = s3_filesystem().get_file_info(self.key)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(str(self))
        return _Stat(info.size)

    def exists(self) -> bool:
        from pyarrow import fs as pafs

        return s3_filesystem().get_file_info(self.key).type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return True  # a prefix: "folders" exist as soon as named

    def iterdir(self) -> Iterator[ObjectPath]:
        from pyarrow import fs as pafs

        selector = pafs.FileSelector(self.key, allow_not_found=True, recursive=False)
        for info in s3_filesystem().get_file_info(selector):
            yield ObjectPath(f"s3://{info.path}")

    def walk(self) -> Iterator[tuple[ObjectPath, int]]:
        """Every object under this prefix, with its size."""
        from pyarrow import fs as pafs

        selector = pafs.FileSelector(self.key, allow_not_found=True, recursive=True)
        for info in s3_filesystem().get_file_info(selector):
            if info.type == pafs.FileType.File:
                yield ObjectPath(f"s3://{info.path}"), info.size

    def open(self, mode: str = "rb") -> Any:
        if mode != "rb":
            raise ValueError("objects are opened for reading only; write_bytes_atomic writes one")
        return s3_filesystem().open_input_file(self.key)

    def read_bytes(self) -> bytes:
        with self.open("rb") as fh:
            return fh.read()

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            s3_filesystem().delete_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def write_bytes(self, data: bytes) -> None:
        """One PUT (visible whole or not at all)."""
        with s3_filesystem().open_output_stream(self.key) as out:
            out.write(data)

    def upload(self, local: Path) -> None:
        """A local file's bytes as this object, read a block at a time (an export's big files)."""
        with open(local, "rb") as fh, s3_filesystem().open_output_stream(self.key) as out:
            while chunk := fh.read(1 << 22):
                out.write(chunk)


#: a place for a data file: a local path, or an object in a store
DataPath = Path | ObjectPath


def data_root(location: str | os.PathLike[str]) -> DataPath:
    """Where a warehouse's data files live: ``s3://bucket/prefix`` or a local folder."""
    text = os.fspath(location)
    return ObjectPath(text) if text.startswith("s3://") else Path(text)


def duckdb_filesystem() -> Any:
    """An fsspec view of the process's S3 filesystem for DuckDB (which reads ``s3://`` URIs through
    it: no extension is downloaded or loaded)."""
    key = ("duckdb", *(os.environ.get(k) for k in S3_ENV), os.getpid())
    if key not in _FILESYSTEMS:
        from fsspec.implementations.arrow import ArrowFile, ArrowFSWrapper

        class _WholeReads(ArrowFile):  # type: ignore[misc]
            """An object read for DuckDB: positional and whole. DuckDB reads a file's row groups on
            several threads through one Python file object, each read a ``seek`` then a ``read``;
            pyarrow lets go of the GIL while it reads, so another thread's ``seek`` landed between
            them and reads came back from the wrong place or short ("don't know what type",
            "Out of buffer", "Failed to read 54521 bytes ...: only 16996 bytes returned", seen on
            the loopback SeaweedFS). Here each thread has its own position and reads with
            ``read_at``; a read that returns fewer bytes than asked before the object's end reads
            the rest, a few times, before the short read stands."""

            def _positions(self) -> dict[int, int]:
                held = self.__dict__.get("_at")
                if held is None:
                    held = self.__dict__.setdefault("_at", {})
                return held

            def tell(self) -> int:
                return self._positions().get(threading.get_ident(), 0)

            def seek(self, loc: int, whence: int = 0) -> int:
                base = {0: 0, 1: self.tell(), 2: self.size or 0}[whence]
                self._positions()[threading.get_ident()] = base + loc
                return base + loc

            def read(self, n: int = -1) -> bytes:
                at, size = self.tell(), self.size or 0
                if n is None or n < 0:
                    n = max(0, size - at)
                parts, got, tries = [], 0, 0
                while got < n:
                    chunk = self.stream.read_at(n - got, at + got)
                    if chunk:
                        parts.append(chunk)
                        got += len(chunk)
                        continue
                    if at + got >= size or tries >= _SHORT_READ_TRIES:
                        break  # the end of the object (or a store that gives no more): a short read
                    tries += 1
                    time.sleep(0.05 * 2 ** tries)
                self._positions()[threading.get_ident()] = at + got
                return b"".join(parts)

            def readinto(self, buffer: Any) -> int:
                view = memoryview(buffer).cast("B")
                data = self.read(len(view))
                view[:len(data)] = data
                return len(data)

        class _S3(ArrowFSWrapper):  # type: ignore[misc]
            protocol = "s3"

            def _open(self, path: str, mode: str = "rb", block_size: Any = None, seekable: bool = True,
                      **kwargs: Any) -> Any:
                f = super()._open(path, mode, block_size, seekable, **kwargs)
                if mode == "rb" and hasattr(f.stream, "read_at"):  # the same file (a second wrapper would close it)
                    f.__class__ = _WholeReads
                return f

        _FILESYSTEMS[key] = _S3(s3_filesystem())
    return _FILESYSTEMS[key]


#: empty reads before the end of an object that are retried (after 0.1, 0.2, 0.4 s)
_SHORT_READ_TRIES = 3


def is_uri(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` names a place in object storage rather than a local path."""
    return os.fspath(location).startswith("s3://")


def location_exists(location: str) -> bool:
    """A local file or folder, or an object or a prefix holding objects."""
    return data_root(location).exists() if is_uri(location) else os.path.exists(location)


def location_files(location: str) -> dict[str, int]:
    """Every file under ``location`` (itself, when it is a file) with its size: local paths, or
    the URIs of the objects under a prefix."""
    if is_uri(location):
        top = ObjectPath(location)
        try:
            return {str(top): top.stat().st_size}
        except FileNotFoundError:
            return {str(obj): size for obj, size in top.walk()}
    if os.path.isfile(location):
        return {location: os.path.getsize(location)}
    return {os.path.join(d, n): os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(location) for n in names}


def publish(staged: Path, target: ObjectPath, *, folder: bool) -> None:
    """Upload what an exporter wrote locally to object storage: one object, or a folder's files
    under ``target``'s prefix, ``manifest.json`` last (a reader that finds the manifest finds the
    files it lists); objects of an earlier export under the prefix that this one did not write
    are deleted after."""
    if not folder:
        target.upload(staged)
        return
    files = sorted((p for p in staged.rglob("*") if p.is_file()), key=lambda p: (p.name == "manifest.json", str(p)))
    written = set()
    for p in files:
        obj = target / p.relative_to(staged).as_posix()
        obj.upload(p)
        written.add(obj)
    for obj, _ in list(target.walk()):
        if obj not in written:
            obj.unlink(missing_ok=True)
