"""The curation step's global graph work as one relational plan with interchangeable engines.

A global step (here: the LSH banding of the near-duplicate search, and connected components of
the near-duplicate and grouping graphs) is written once, as SQL in the subset that DuckDB and Daft both run (no ``least``/``greatest``: ``CASE``;
every joined column named apart, since Daft reads ``s.v`` as a struct field), and an engine runs
it. ``duckdb`` (the default) runs it in-process; ``daft`` runs the same text on Daft's local
runner here and on Ray across machines (docs/scale.md), where the edge tables outgrow one machine.

Connected components use the large-star / small-star loop (Kiveris et al., "Connected Components
in MapReduce and Beyond", SoCC 2014): a few rounds of joins and group-bys, not as many rounds as
the longest chain (min-label propagation). The loop stops when the edge table is a forest of
stars whose centres are never leaves and whose leaves have one centre: every edge then points a
node at its component's smallest node (an edge is stored smaller end first, so a centre is the
smallest of its star). That test is exact, not a checksum.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import pyarrow as pa
from trajwh.schemas.config import ENGINES

DEFAULT_ENGINE = ENGINES[0]
MAX_ROUNDS = 64
#: a bucket of more documents is linked as a star on its smallest document, not pair by pair
BIG_BUCKET = 64

# each edge once, smaller end first; self-loops dropped
_NORMALIZE = """SELECT DISTINCT CASE WHEN a < b THEN a ELSE b END AS a, CASE WHEN a < b THEN b ELSE a END AS b
FROM e WHERE a <> b"""

# large star: every node's larger neighbours are linked to the smallest node of its closed
# neighbourhood (``lo`` <= u < v, so the edge is already smaller end first)
_LARGE_STAR = """WITH sym AS (SELECT a AS u, b AS v FROM e UNION ALL SELECT b AS u, a AS v FROM e),
m AS (SELECT u AS mu, min(v) AS mv FROM sym GROUP BY u)
SELECT DISTINCT CASE WHEN mv < u THEN mv ELSE u END AS a, v AS b FROM sym JOIN m ON u = mu WHERE v > u"""

# small star: a node and its smaller neighbours are linked to the smallest of them (``mv``)
_SMALL_STAR = """WITH small AS (SELECT b AS u, a AS v FROM e),
m AS (SELECT u AS mu, min(v) AS mv FROM small GROUP BY u),
x AS (SELECT u AS xu, v AS x FROM small UNION ALL SELECT DISTINCT u AS xu, u AS x FROM small)
SELECT DISTINCT mv AS a, x AS b FROM x JOIN m ON xu = mu WHERE x <> mv"""

# LSH band table (doc, band, key) -> buckets of two or more documents and their members; candidate
# pairs (a < b) as ``minhash.lsh_pairs`` makes them: every pair of a bucket of at most 64 documents,
# a star on the smallest document (``hub``) of a bigger one; ``band_components`` links every bucket
# as a star
_BUCKETS = """SELECT band AS sb, key AS sk, count(*) AS m, min(doc) AS hub FROM bands GROUP BY band, key HAVING count(*) > 1"""
_MEMBERS = """SELECT doc, m, hub, band AS mb, key AS mk FROM bands JOIN buckets ON band = sb AND key = sk"""
_SMALL_BUCKET_PAIRS = f"""SELECT d1 AS a, d2 AS b
FROM (SELECT doc AS d1, mb AS b1, mk AS k1 FROM members WHERE m <= {BIG_BUCKET})
JOIN (SELECT doc AS d2, mb AS b2, mk AS k2 FROM members WHERE m <= {BIG_BUCKET}) ON b1 = b2 AND k1 = k2 WHERE d1 < d2"""
_HUB_EDGES = """SELECT hub AS a, doc AS b FROM members WHERE m > {min_size} AND doc <> hub"""
_CANDIDATES = """SELECT DISTINCT a, b FROM (SELECT a, b FROM small UNION ALL SELECT a, b FROM stars)"""

# converged: no node is both a centre and a leaf, and no leaf has two centres
_NOT_STARS = """SELECT (SELECT count(*) FROM e JOIN (SELECT DISTINCT b AS leaf FROM e) ON a = leaf)
 + (SELECT count(*) FROM e) - (SELECT count(DISTINCT b) FROM e) AS n"""


class Engine(Protocol):
    name: str

    def sql(self, query: str, **tables: Any) -> Any:
        """The result of ``query`` over the named tables (Arrow tables or earlier results), computed."""

    def arrow(self, result: Any) -> pa.Table:
        ...

    def drop(self, result: Any) -> None:
        """Forget a result no later query reads (each round of a loop makes a new edge table)."""

    def close(self) -> None:
        ...


class DuckDBEngine:
    """In-process DuckDB: each result a temporary table of one connection."""

    name = "duckdb"

    def __init__(self, threads: int | None = None, memory_limit: str | None = None):
        import duckdb

        self.con = duckdb.connect()
        if threads:
            self.con.execute(f"SET threads = {int(threads)}")
        if memory_limit:
            self.con.execute(f"SET memory_limit = '{memory_limit}'")
        self._n = 0

    def sql(self, query: str, **tables: Any) -> str:
        for name, t in tables.items():
            if isinstance(t, pa.Table):
                self.con.register(f"_in_{name}", t)
                t = f"_in_{name}"
            self.con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT * FROM {t}")
        self._n += 1
        out = f"_r{self._n}"
        self.con.execute(f"CREATE TEMP TABLE {out} AS {query}")
        return out

    def arrow(self, result: str) -> pa.Table:
        return self.con.sql(f"SELECT * FROM {result}").to_arrow_table()

    def drop(self, result: str) -> None:
        self.con.execute(f"DROP TABLE IF EXISTS {result}")

    def close(self) -> None:
        self.con.close()


class DaftEngine:
    """Daft: the same SQL on its local runner (or on Ray, when ``daft.context`` is set to it); each
    result collected before the next round, as a distributed job would checkpoint it."""

    name = "daft"

    def __init__(self) -> None:
        import os

        # no usage reports from the warehouse's build (Daft reports its import and runs to Scarf
        # unless told not to; Dagster's telemetry is off too): an explicit setting wins
        os.environ.setdefault("DAFT_ANALYTICS_ENABLED", "0")
        import daft

        self.daft = daft

    def sql(self, query: str, **tables: Any) -> Any:
        frames = {k: self.daft.from_arrow(t) if isinstance(t, pa.Table) else t for k, t in tables.items()}
        return self.daft.sql(query, **frames).collect()

    def arrow(self, result: Any) -> pa.Table:
        return result.to_arrow()

    def drop(self, result: Any) -> None:
        pass  # a collected frame is freed when no name holds it

    def close(self) -> None:
        pass


def engine(name: str | None = None, **kwargs: Any) -> Engine:
    """The engine called ``name`` (``duckdb`` or ``daft``); a clear error otherwise."""
    name = name or DEFAULT_ENGINE
    if name == "duckdb":
        return DuckDBEngine(**kwargs)
    if name == "daft":
        try:
            return DaftEngine()
        except ImportError as exc:
            from trajwh.schemas.errors import ConfigError

            raise ConfigError("engine 'daft' needs the daft package (pip install daft)", valid="duckdb") from exc
    from trajwh.schemas.errors import ConfigError

    raise ConfigError(f"unknown engine {name!r}", valid=", ".join(ENGINES))


def _scalar(eng: Engine, result: Any) -> int:
    return int(eng.arrow(result).column(0)[0].as_py() or 0)


def star_components(eng: Engine, n: int, a: np.ndarray, b: np.ndarray, *, max_rounds: int = MAX_ROUNDS
                    ) -> tuple[np.ndarray, int]:
    """Components of nodes ``0..n-1`` joined by the edges ``a[i]``-``b[i]``, each node labelled by
    the smallest node of its component, by the large-star / small-star loop on ``eng``; with the
    rounds it took."""
    if not len(a):
        return np.arange(n, dtype=np.int64), 0
    edges = pa.table({"a": np.asarray(a, dtype=np.int64), "b": np.asarray(b, dtype=np.int64)})
    return _star_loop(eng, n, edges, max_rounds)


def band_components(eng: Engine, n: int, bands: pa.Table, *, max_rounds: int = MAX_ROUNDS) -> tuple[np.ndarray, int]:
    """Candidate clusters of documents ``0..n-1`` from an LSH band table (``doc``, ``band``,
    ``key``): documents sharing a bucket are linked (a star on the bucket's smallest document,
    linear in the bucket), then the components found, all on ``eng``; with the rounds."""
    buckets = eng.sql(_BUCKETS, bands=bands)
    members = eng.sql(_MEMBERS, bands=bands, buckets=buckets)
    edges = eng.sql(_HUB_EDGES.format(min_size=1), members=members)
    for done in (buckets, members):
        eng.drop(done)
    try:
        return _star_loop(eng, n, edges, max_rounds)
    finally:
        eng.drop(edges)


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """Each document's bands of ``rows`` MinHash values as 64-bit keys, an ``int64`` matrix (documents x
    bands): a multiply-and-mix chain of the values with murmur3's fmix64 finalizer, fixed by this code,
    not by a library. Two different bands share a key with probability 2**-64, and a candidate pair is
    verified on the signatures anyway. (An integer key, not the band's bytes: Daft 0.6 neither sorts
    nor reliably joins on binary columns; measured, it paired documents of different keys.) Computed
    once per batch with the signatures and stored (``episode_features``)."""
    n = len(sigs)
    # every band at once, a value of each per step (rows steps over n x bands, not bands x rows
    # over n: 108,000 documents, 9 x 13: 0.30 -> 0.17 s; the same keys)
    values = sigs[:, :bands * rows].reshape(n, bands, rows).astype(np.uint64)
    with np.errstate(over="ignore"):
        keys = np.broadcast_to(np.arange(1, bands + 1, dtype=np.uint64), (n, bands)).copy()
        for j in range(rows):
            keys = _fmix64(keys * np.uint64(0x9E3779B97F4A7C15) + values[:, :, j])
    return keys.view(np.int64)


def band_rows(keys: np.ndarray) -> pa.Table:
    """The band table (doc, band, key) of a band-key matrix (``band_keys``), documents numbered by row."""
    n, bands = keys.shape
    return pa.table({"doc": np.repeat(np.arange(n, dtype=np.int64), bands),
                     "band": np.tile(np.arange(bands, dtype=np.int64), n), "key": keys.ravel()})


def band_table(sigs: np.ndarray, bands: int, rows: int) -> pa.Table:
    """(doc, band, key): each document's bands as keys (``band_keys``), one row per band."""
    return band_rows(band_keys(sigs, bands, rows))


def _fmix64(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


def lsh_candidates(eng: Engine, sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """Candidate pairs ``(i, j)``, i < j, of documents sharing a band bucket, sorted: the banding
    of ``minhash.lsh_pairs`` run on ``eng`` (verification is the caller's, on the signatures)."""
    if len(sigs) < 2:
        return np.empty((0, 2), dtype=np.int64)
    return bucket_candidates(eng, band_table(sigs, bands, rows))


def bucket_candidates(eng: Engine, table: Any) -> np.ndarray:
    """The candidate pairs a band table's buckets make (every pair of a bucket of at most 64
    documents, a star on the smallest document of a bigger one), sorted. ``table``: an Arrow table
    or an earlier result of ``eng``. The pairs of a bucket depend on its members alone, so the
    rows of some buckets give exactly those buckets' pairs (``touched_rows``)."""
    buckets = eng.sql(_BUCKETS, bands=table)
    members = eng.sql(_MEMBERS, bands=table, buckets=buckets)
    small = eng.sql(_SMALL_BUCKET_PAIRS, members=members)
    stars = eng.sql(_HUB_EDGES.format(min_size=BIG_BUCKET), members=members)
    result = eng.sql(_CANDIDATES, small=small, stars=stars)
    pairs = eng.arrow(result)
    for done in (buckets, members, small, stars, result):
        eng.drop(done)
    out = np.stack([pairs.column("a").to_numpy(), pairs.column("b").to_numpy()], axis=1).astype(np.int64)
    return out[np.lexsort((out[:, 1], out[:, 0]))]


# the buckets of the documents that changed, and of the big buckets named; their every row
_TOUCHED = """SELECT DISTINCT tb, tk FROM (SELECT band AS tb, key AS tk FROM bands JOIN changed ON doc = cd
UNION ALL SELECT bb AS tb, bk AS tk FROM big)"""
_TOUCHED_ROWS = """SELECT doc, band, key FROM bands JOIN touched ON band = tb AND key = tk"""
_BIG_BUCKETS = """SELECT sb AS band, sk AS key, m, hub FROM buckets WHERE m > {min_size}"""


def big_buckets(eng: Engine, table: Any) -> pa.Table:
    """The buckets of more than ``BIG_BUCKET`` documents of a band table or an engine result (band,
    key, members, smallest document): their pairs are a star on that document, so they change when it
    or their size does."""
    buckets = eng.sql(_BUCKETS, bands=table)
    big = eng.sql(_BIG_BUCKETS.format(min_size=BIG_BUCKET), buckets=buckets)
    out = eng.arrow(big)
    for done in (buckets, big):
        eng.drop(done)
    return out


def touched_rows(eng: Engine, table: Any, changed: np.ndarray, big: tuple[np.ndarray, np.ndarray]) -> Any:
    """The band rows (an engine result) of the buckets that hold a ``changed`` document or are named in
    ``big`` (band, key arrays), every member of each: the rows from which an update counts the big
    buckets of now (a bucket becomes big only by gaining a document) and makes its candidate pairs."""
    changed_t = pa.table({"cd": np.asarray(changed, dtype=np.int64)})
    big_t = pa.table({"bb": np.asarray(big[0], dtype=np.int64), "bk": np.asarray(big[1], dtype=np.int64)})
    touched = eng.sql(_TOUCHED, bands=table, changed=changed_t, big=big_t)
    rows = eng.sql(_TOUCHED_ROWS, bands=table, touched=touched)
    eng.drop(touched)
    return rows


def _star_loop(eng: Engine, n: int, edges: Any, max_rounds: int) -> tuple[np.ndarray, int]:
    e = eng.sql(_NORMALIZE, e=edges)
    rounds = 0
    while True:
        check = eng.sql(_NOT_STARS, e=e)
        done = _scalar(eng, check) == 0  # edges that are stars already need no round
        eng.drop(check)
        if done:
            break
        if rounds == max_rounds:
            raise RuntimeError(f"connected components did not converge in {max_rounds} rounds on {eng.name}")
        rounds += 1
        large = eng.sql(_LARGE_STAR, e=e)
        eng.drop(e)
        e = eng.sql(_SMALL_STAR, e=large)
        eng.drop(large)  # only the newest edge table is kept
    stars = eng.arrow(e)
    eng.drop(e)
    label = np.arange(n, dtype=np.int64)
    label[stars.column("b").to_numpy()] = stars.column("a").to_numpy()
    return label, rounds


def components(n: int, a: np.ndarray, b: np.ndarray, engine_name: str | None = None) -> np.ndarray:
    """``star_components`` on a fresh engine called ``engine_name``."""
    eng = engine(engine_name)
    try:
        return star_components(eng, n, a, b)[0]
    finally:
        eng.close()
