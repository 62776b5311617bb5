"""``trajwh forget``: deletion propagation with a tombstone and a proof (docs/forget.md).

A request runs in recorded stages, each idempotent, so a crash part-way is finished by
``trajwh forget --resume`` (or the next forget):

1. ``planned``: the impact of the selector (``lineage.impact``) is written as a request row in the
   catalog's ``deletions`` table: the record ids and trajectory keys (ids only), the sha256 of each
   raw payload (re-ingest is refused by it), salted fingerprints of candidate probe strings drawn
   from the payloads and their redacted text, and the counts per layer.
2. ``sources_removed``: every Parquet file holding an affected row is rewritten without it (a new
   content-named file that keeps the old one's manifest attributes), all swapped in one catalog
   transaction, the old files deleted; vault entries scoped to the episodes removed; packs holding
   a segment of them dropped.
3. ``rebuilt``: the derived layers are brought up to date in this process, by the stages a build
   runs after the per-batch ones (curation re-elects representatives and re-assigns groups and
   splits, task statistics and fragments of the touched tasks are redone, the windows that held a
   forgotten unit re-packed); episodes whose split changed are recorded. Meanwhile the probes are
   chosen among the candidates (those no surviving payload holds); the request keeps their fingerprints
   (for a later ``verify-forget``).
4. ``exports_refreshed``: every export the tool recorded that holds a forgotten episode (or may:
   a data card or query result written elsewhere) is written again, same parameters and path,
   from the repaired layers; one no longer where it was written is listed as missing, one that
   cannot be made again as stale (lineage/exports.py); the warehouse's own data card is withdrawn
   (written again by the next build).
5. ``compacted``: check caches and spill files deleted, the catalog checkpointed.
6. ``verified`` (or ``verify_failed``): no row with a forgotten id is left in any table, vault or
   pack, and no probe string occurs in any byte the warehouse holds, nor in any recorded export
   that still exists, except where the surviving raw data holds it too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import threading
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ahocorasick_rs
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

try:  # Hyperscan's literal matcher where its wheels exist (x86-64), else the Aho-Corasick automaton
    import hyperscan
except ImportError:  # pragma: no cover (the platforms CI runs on have it)
    hyperscan = None
from trajwh.lineage.catalog import Warehouse, _parquet_source, now_utc
from trajwh.lineage.impact import Impact, Selector, impact
from trajwh.lineage.storage import (
    content_digest,
    data_root,
    is_uri,
    location_files,
    recorded_digest,
)
from trajwh.schemas import ids
from trajwh.schemas.arrow import PARQUET_TABLES, arrow_schema
from trajwh.schemas.errors import ConfigError
from trajwh.schemas.tables import VaultRow

STAGES = ("planned", "sources_removed", "rebuilt", "exports_refreshed", "compacted", "verified")
#: tables whose rows belong to one episode (column ``trajectory_key``)
_BY_EPISODE = ("episodes", "steps", "redacted_episodes", "redacted_steps", "redaction_events", "episode_features",
               "near_dup_clusters", "task_groups", "splits", "leak_flags", "outcomes", "fragments", "license_facts",
               "eligibility", "pack_tokens", "pack_tokens_staged")
#: every table a forget rewrites (task_stats are aggregates: the repair recomputes them): the columns
#: its rows are matched on (``_drop_mask``, ``_files_with_rows``) and the key set (``_key_sets``) they
#: are matched against
_KEY_COLUMNS = {"raw_records": (("record_id",), "records"), "quarantine": (("quarantine_id",), "quarantine"),
                "tool_schemas": (("tool_schema_digest",), "digests"),
                "redacted_tool_schemas": (("tool_schema_digest",), "digests"),
                "lineage_edges": (("child_id", "parent_id"), "any"), "packs": (("segments",), "keys"),
                **{t: (("trajectory_key",), "keys") for t in _BY_EPISODE}}
_PROBE_LEN = 32
_PROBES_PER_TEXT = 4
#: candidate windows drawn per record and per episode's redacted text (those that surviving raw data
#: also holds are dropped; up to 4 and 2 kept): every candidate is sought in every surviving payload
_CANDIDATES_PER_RECORD, _CANDIDATES_PER_EPISODE = 16, 8
#: a probe: 32 characters that JSON escaping leaves as they are, starting a word (every start, overlapping)
#: the punctuation a probe may hold besides letters and digits (JSON escaping leaves it as it is)
_PROBE_PUNCT = " ,.:;_()/=+-"
_SAFE = re.compile(rf"(?<![A-Za-z0-9])(?=([A-Za-z0-9][A-Za-z0-9{re.escape(_PROBE_PUNCT)}]{{{_PROBE_LEN - 1}}}))")
#: deletes a probe's punctuation (what is left: its letters and digits)
_NOT_ALNUM = str.maketrans("", "", _PROBE_PUNCT)
#: a test hook: the process dies right after this stage is recorded (crash-safety tests)
CRASH_ENV = "TRAJWH_FORGET_CRASH_AFTER"


@dataclass
class ForgetResult:
    request_id: str
    selector: str
    status: str
    counts: dict[str, int]
    moved: list[dict[str, Any]] = field(default_factory=list)
    verify: dict[str, Any] = field(default_factory=dict)
    resumed: bool = False
    sources: dict[str, Any] = field(default_factory=dict)  # files and bytes the rewrite replaced
    exports: list[dict[str, Any]] = field(default_factory=list)  # recorded exports written again, missing or stale


# --- probes ----------------------------------------------------------------------------------


def _strings(payload: bytes) -> list[str]:
    """The text a raw record carries: its JSON string leaves (what the layers below hold), else
    the bytes as text."""
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return [payload.decode("utf-8", "replace")]
    out, stack = [], [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return out


def probe_windows(text: str, seed: str, n: int = _PROBES_PER_TEXT) -> list[str]:
    """Up to ``n`` distinct distinctive-looking windows of ``text`` (32 characters that survive JSON
    escaping unchanged, starting at a word, at least 20 letters or digits and 10 distinct
    characters), spread over its distinct windows (text a record repeats counts once, so its own
    text is favoured over boilerplate it repeats): from each of ``n`` evenly spaced places in the
    list of distinct windows, the first distinctive one; the first place chosen by ``seed``
    (deterministic). Only the windows walked are tested, not every one."""
    distinct = _distinct_windows(text)
    size = len(distinct)
    if not size:
        return []
    first = int(hashlib.sha256(seed.encode()).hexdigest()[:8], 16) % size
    out: dict[str, None] = {}
    for k in range(n):
        at = first + k * max(1, size // n)
        for j in range(min(size, _WINDOWS_PER_PLACE)):
            start = int(distinct[(at + j) % size])
            w = text[start:start + _PROBE_LEN]
            if len(w.translate(_NOT_ALNUM)) >= 20 and len(set(w)) >= 10:
                out.setdefault(w)
                break
    return list(out)


def _codes(chars: str) -> np.ndarray:
    table = np.zeros(128, bool)
    table[[ord(c) for c in chars]] = True
    return table


_ALNUM_CODES = _codes("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_SAFE_CODES = _ALNUM_CODES | _codes(_PROBE_PUNCT)
#: a polynomial hash of every window at once (uint64 arithmetic wraps: modulo 2**64), odd so it has
#: an inverse modulo 2**64; its powers and its inverse's, grown as longer blocks come
_BASE = 0x9E3779B97F4A7C15
_POWERS: list[np.ndarray] = [np.ones(1, np.uint64), np.ones(1, np.uint64)]
#: code points of a text handled at once (its arrays about 45 bytes each: a payload may hold 32 MB)
_BLOCK = 1 << 20


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """_BASE ** i and its inverse ** i modulo 2**64, for i < n (at least; kept for the next block)."""
    if len(_POWERS[0]) < n:
        size = max(n, min(2 * len(_POWERS[0]), _BLOCK + _PROBE_LEN + 1))
        with np.errstate(over="ignore"):
            for k, base in enumerate((_BASE, pow(_BASE, -1, 2**64))):
                steps = np.full(size, base, np.uint64)
                steps[0] = 1
                _POWERS[k] = np.cumprod(steps, dtype=np.uint64)
    return _POWERS[0], _POWERS[1]


def _distinct_windows(text: str) -> np.ndarray:
    """The start (code point offset) of each distinct window ``_SAFE`` finds in ``text``, at its
    first occurrence, in order: the same windows as ``dict.fromkeys(_SAFE.findall(text))``, found
    with array operations over the code points, a block at a time (a regular expression tried at
    every position took 1.6 s of the plan's 2.1 for the candidates of 1,070 records and episodes).
    Windows are told apart by a 64-bit polynomial hash of their code points."""
    n = len(text) - _PROBE_LEN + 1  # (a lone surrogate is one code point, in the text and encoded)
    starts, hashes = [np.empty(0, np.int64)], [np.empty(0, np.uint64)]
    for b in range(0, max(n, 0), _BLOCK):
        lo = max(0, b - 1)  # the character before the block tells whether its first one starts a word
        seg = np.frombuffer(text[lo:b + _BLOCK + _PROBE_LEN - 1].encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        off, m = b - lo, min(_BLOCK, n - b)  # the block's positions are seg[off:off + m]
        low = np.where(seg < 128, seg, 0)  # (code 0 is neither safe nor a letter or digit)
        alnum, unsafe = _ALNUM_CODES[low], ~_SAFE_CODES[low]
        word = alnum.copy()
        word[1:] &= ~alnum[:-1]
        before = np.zeros(len(seg) + 1, np.int64)  # unsafe characters before each position
        np.cumsum(unsafe, out=before[1:])
        at = np.flatnonzero(word[off:off + m] & (before[off + _PROBE_LEN:off + _PROBE_LEN + m] == before[off:off + m])) + off
        power, inverse = _powers(len(seg) + 1)
        with np.errstate(over="ignore"):
            prefix = np.zeros(len(seg) + 1, np.uint64)
            np.cumsum(seg.astype(np.uint64) * power[:len(seg)], out=prefix[1:])
            # sum of seg[i + k] * BASE ** (i + k), shifted back to i = 0: the same for the same window anywhere
            hashes.append((prefix[at + _PROBE_LEN] - prefix[at]) * inverse[at])
        starts.append(at + lo)
    every, digest = np.concatenate(starts), np.concatenate(hashes)
    return every[np.sort(np.unique(digest, return_index=True)[1])]


#: distinct windows walked from one place before giving up on it (text with no distinctive window for long)
_WINDOWS_PER_PLACE = 2_000


def fingerprint(probe: str, salt: bytes) -> str:
    return hashlib.blake2b(probe.encode(), key=salt[:64], digest_size=16).hexdigest()


def _salt(wh: Warehouse) -> bytes:
    from trajwh.redaction.vault import Vault

    return Vault(wh, None).salt()


# --- plan ------------------------------------------------------------------------------------


#: candidate probe windows by what they were drawn from (a record id or a trajectory key): (the
#: windows, how many distinctive ones to keep)
Candidates = dict[str, tuple[list[str], int]]


def _plan_candidates(wh: Warehouse, records: list[str], episodes: list[str], skip: frozenset[str] = frozenset()
                     ) -> tuple[list[str], Candidates]:
    """(payload sha256 per record, candidate probe windows) of the records and episodes to forget.
    ``skip``: data files that cannot hold them (``_older_files``, bytes unchanged), not read."""
    digests, candidates = [], {}
    if records:
        for rb in wh.stream(f"SELECT record_id, payload FROM {_rows_sql(wh, 'raw_records', skip)} "
                            "WHERE record_id IN (SELECT unnest(?::VARCHAR[]))", [records], batch_rows=500, arrow=True):
            for rid, payload in zip(rb.column(0).to_pylist(), rb.column(1).to_pylist(), strict=True):
                digests.append(hashlib.sha256(payload).hexdigest())
                candidates[rid] = (probe_windows("\n".join(_strings(payload)), rid, _CANDIDATES_PER_RECORD), _PROBES_PER_TEXT)
    if episodes:
        for rb in wh.stream("SELECT trajectory_key, string_agg(coalesce(text, '') || chr(10) || coalesce(observation, ''), "
                            f"chr(10) ORDER BY step_index) FROM {_rows_sql(wh, 'redacted_steps', skip)} "
                            "WHERE trajectory_key IN (SELECT unnest(?::VARCHAR[])) GROUP BY 1", [episodes],
                            batch_rows=200, arrow=True):
            for key, text in zip(rb.column(0).to_pylist(), rb.column(1).to_pylist(), strict=True):
                candidates[key] = (probe_windows(text or "", key, _CANDIDATES_PER_EPISODE), 2)
    return sorted(set(digests)), candidates


def _candidates_part(task: tuple[str, list[str], list[str], frozenset[str]]) -> tuple[list[str], Candidates]:
    """``_plan_candidates`` in the forget's worker (``_worker``): (warehouse root, records,
    episodes, the files to skip)."""
    root, records, episodes, skip = task
    return _plan_candidates(Warehouse(root), records, episodes, skip)


def _windows(candidates: Candidates) -> list[str]:
    return sorted({w for ws, _ in candidates.values() for w in ws})


def _start_search(candidates: Candidates | None, paths: list[str], pool: ProcessPoolExecutor
                  ) -> tuple[_Matcher, Any] | None:
    """The worker of ``pool`` (``_worker``) set to search the raw records' files ``paths`` (the
    surviving payloads: files stage 1 left or wrote, which hold no forgotten record) for the
    candidate windows; (its matcher, the future of the fingerprints found), None without a candidate."""
    every = _windows(candidates) if candidates else []
    if not every:
        return None
    matcher = _Matcher(every, set(), b"plan")
    return matcher, pool.submit(_shared_part, (paths, matcher))


def _with_probes(candidates: Candidates | None, search: tuple[_Matcher, Any] | None, work: Callable[[], Any]
                 ) -> tuple[list[str] | None, Any]:
    """(the probes, ``work()``): ``work`` runs here while the worker searches every surviving payload
    for the candidates (``_start_search``; in this process the search took the repair's interpreter
    lock). The probes: candidate windows that no raw record outside the forgotten ones holds (a
    shared system prompt, another attempt's file prove nothing), up to 4 per record and 2 per
    episode's redacted text. None without candidates (a request resumed after a crash)."""
    if search is None:
        return ([] if candidates else None), work()
    matcher, found = search
    try:
        done = work()
    except BaseException:
        found.cancel()
        raise
    shared_keys = found.result()
    shared = {w for w in _windows(candidates or {}) if matcher.key(w) in shared_keys}
    return sorted({w for ws, n in (candidates or {}).values() for w in [w for w in ws if w not in shared][:n]}), done


def _surviving_raw(wh: Warehouse, removal: _Removal) -> list[str]:
    """The raw records' files as stage 1's swap will leave them: the copies it rewrote (those with
    rows) instead of the files they replace (readable before the swap, and after it)."""
    copies = {wh_path: new for table, wh_path, _, new in removal.files if table == "raw_records" and new is not None}
    return ([p for p in _table_paths(wh, "raw_records") if p not in copies]
            + sorted({str(new.path) for new in copies.values() if new.rows}))


def _ingested_since(wh: Warehouse, records: list[str], episodes: list[str], quarantined: list[str]) -> str | None:
    """When the first ingest that brought any of the forgotten rows started (ISO time), or None
    when one of them names no committed batch. A data file the manifest listed before then was
    written before they existed: it cannot hold anything made from them (the proof then checks
    that its bytes are still the ones recorded, instead of searching them)."""
    row = wh.query("""
        WITH b AS (SELECT batch_id FROM raw_records WHERE record_id IN (SELECT unnest(?::VARCHAR[]))
                   UNION ALL SELECT _batch_id FROM episodes WHERE trajectory_key IN (SELECT unnest(?::VARCHAR[]))
                   UNION ALL SELECT batch_id FROM quarantine WHERE quarantine_id IN (SELECT unnest(?::VARCHAR[])))
        SELECT count(*) FILTER (WHERE x.started_at IS NULL) AS unknown, min(x.started_at) AS since
        FROM b LEFT JOIN batches x USING (batch_id)""", [records, episodes, quarantined]).to_pylist()[0]
    return None if row["unknown"] or row["since"] is None else row["since"].isoformat()


def _request_row(req: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**req, **changes, "updated_at": now_utc()}


def pending_requests(wh: Warehouse) -> list[dict[str, Any]]:
    if not wh.exists():
        return []
    return wh.query("SELECT * FROM deletions WHERE status NOT IN ('verified', 'verify_failed') "
                    "ORDER BY requested_at").to_pylist()


def forgotten_digests(wh: Warehouse) -> set[str]:
    """sha256 of every raw payload a deletion request removed (ingest refuses them)."""
    if not wh.exists():
        return set()
    return set(wh.query("SELECT DISTINCT unnest(record_digests) FROM deletions").column(0).to_pylist())


# --- stage 2: rewrite ------------------------------------------------------------------------


def _key_sets(wh: Warehouse, req: dict[str, Any], skip: frozenset[str] = frozenset()) -> dict[str, pa.Array]:
    """The ids a request removes, by kind; ``skip``: data files that cannot hold a row of the
    forgotten data (``_older_files``), not read for its steps. The tool schemas only the forgotten
    episodes used are decided over every episode: an older one may use the same."""
    keys = req["trajectory_keys"]
    steps = wh.query(f"SELECT step_id FROM {_rows_sql(wh, 'steps', skip)} WHERE trajectory_key IN "
                     f"(SELECT unnest(?::VARCHAR[])) UNION SELECT step_id FROM {_rows_sql(wh, 'redacted_steps', skip)} "
                     "WHERE trajectory_key IN (SELECT unnest(?::VARCHAR[]))", [keys, keys]).column(0).to_pylist() if keys else []
    digests = wh.query("SELECT tool_schema_digest FROM redacted_episodes WHERE tool_schema_digest IS NOT NULL "
                       "GROUP BY 1 HAVING bool_and(trajectory_key IN (SELECT unnest(?::VARCHAR[])))",
                       [keys]).column(0).to_pylist() if keys else []
    quarantined = wh.query("SELECT quarantine_id FROM quarantine WHERE record_id IN (SELECT unnest(?::VARCHAR[]))",
                           [req["record_ids"]]).column(0).to_pylist() if req["record_ids"] else []
    extra_q = orjson.loads(req["counts"]).get("_quarantine_ids", [])
    every = sorted(set(req["record_ids"]) | set(keys) | set(steps))
    return {"records": pa.array(req["record_ids"], pa.string()), "keys": pa.array(keys, pa.string()),
            "any": pa.array(every, pa.string()), "digests": pa.array(digests, pa.string()),
            "quarantine": pa.array(sorted(set(quarantined) | set(extra_q)), pa.string())}


def _rows_sql(wh: Warehouse, table: str, skip: frozenset[str]) -> str:
    """A FROM source for ``table``'s rows outside the data files ``skip`` names (paths as
    ``_table_paths`` gives them): the table's view when none is skipped."""
    if not skip:
        return table
    paths = [p for p in _table_paths(wh, table) if p not in skip]
    if not paths:
        return f"(SELECT * FROM {table} WHERE false)"
    return _parquet_source(paths)


def _drop_mask(table: str, t: pa.Table, s: dict[str, pa.Array]) -> pa.Array | None:
    if table not in _KEY_COLUMNS:
        return None  # task_stats: aggregates, recomputed by the repair
    columns, ids_ = _KEY_COLUMNS[table]
    if table == "packs":
        segments = t["segments"].combine_chunks()
        hit = pc.is_in(pc.struct_field(pc.list_flatten(segments), "trajectory_key"), s["keys"])
        parents = pc.list_parent_indices(segments)
        rows = set(pc.filter(parents, hit).to_pylist())
        return pa.array([i in rows for i in range(t.num_rows)])
    masks = [pc.is_in(t[c], s[ids_]) for c in columns]  # (an edge goes with its parent or its child)
    return functools.reduce(pc.or_, masks)


def _files_with_rows(wh: Warehouse, table: str, s: dict[str, pa.Array], skip: frozenset[str] = frozenset(),
                     con: Any = None) -> list[str]:
    """The manifest paths of ``table`` that hold an affected row (only their key columns are read),
    among those not in ``skip``; ``con``: a catalog connection to use (else one is opened)."""
    return sorted(_affected_files(wh, table, s, skip, con))


def _affected_files(wh: Warehouse, table: str, s: dict[str, pa.Array], skip: frozenset[str] = frozenset(),
                    con: Any = None) -> dict[str, tuple[int, int]]:
    """``_files_with_rows`` with (the affected rows, all the rows) of each file, as one read of its
    key columns counted them."""
    if table not in _KEY_COLUMNS:
        return {}
    paths = [p for p in _table_paths(wh, table) if p not in skip]
    if not paths:
        return {}
    (column, *_), ids_ = _KEY_COLUMNS[table]
    ids_in = "IN (SELECT unnest(?::VARCHAR[]))"  # a hash join: list_contains walks the list per row
    if table == "lineage_edges":
        cond, wanted = f"child_id {ids_in} OR parent_id {ids_in}", [s["any"].to_pylist()] * 2
    elif table == "packs":
        cond, wanted = ("list_has_any(list_transform(segments, lambda x: x.trajectory_key), ?)", [s["keys"].to_pylist()])
    else:
        cond, wanted = f"{column} {ids_in}", [s[ids_].to_pylist()]
    if not any(wanted[0]):
        return {}
    listing = ", ".join("'" + p.replace("'", "''") + "'" for p in paths)
    own = con is None
    con = wh.connect(read_only=True) if own else con
    try:
        rows = con.execute(f"SELECT filename, count(*) FILTER (WHERE {cond}) AS n, count(*) FROM read_parquet([{listing}], "
                           "filename = true) GROUP BY filename HAVING n > 0", wanted).fetchall()
    finally:
        if own:
            con.close()
    return {str(wh.data_path(path)): (n, total) for path, n, total in rows}


def _older_files(wh: Warehouse, since: str | None) -> dict[str, tuple[str, str]]:
    """The data files (paths as ``_table_paths`` gives them) the manifest listed before ``since``
    (``_ingested_since``: when the first ingest of the forgotten data began), with the digest it
    recorded (``recorded_digest``: BLAKE3, else sha256): written before that data existed, so they
    hold nothing made from it while their bytes are still those."""
    if not since:
        return {}
    return {str(wh.data_path(r["path"])): recorded_digest(r) for r in wh.manifest_query(
        "SELECT * FROM table_files WHERE added_at < ?::TIMESTAMPTZ", [since]).to_pylist()}


def _same_bytes(path: str, recorded: tuple[str, str]) -> bool:
    """Whether the file's bytes still have the digest recorded (``_older_files``)."""
    return content_digest(data_root(path), recorded) == recorded[1]


def _unchanged(recorded: dict[str, tuple[str, str]], stamps: dict[str, tuple[int, ...]] | None = None
               ) -> frozenset[str]:
    """The files of ``recorded`` whose bytes still have the digest recorded (read on two threads:
    hashing releases the interpreter's lock). ``stamps`` gains each such local file's stamp
    (``_stamp``) when it was the same before and after the read."""
    paths = sorted(recorded)

    def same(path: str) -> bool:
        before = _stamp(path)
        ok = _same_bytes(path, recorded[path])
        if ok and stamps is not None and before is not None and _stamp(path) == before:
            stamps[path] = before
        return ok

    with ThreadPoolExecutor(2) as pool:
        found = list(pool.map(same, paths))
    return frozenset(p for p, ok in zip(paths, found, strict=True) if ok)


def _stamp(path: str) -> tuple[int, ...] | None:
    """A local file's (inode, size, modification and change times in ns), None for an object in a
    store or a file that is gone. The change time cannot be set back: any write to the file, or
    to its times, moves it."""
    if is_uri(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remove_sources(wh: Warehouse, req: dict[str, Any], progress: Callable[[str], None],
                    older: frozenset[str] | None = None) -> dict[str, int]:
    """Stage 1 of a stored request: the forgotten rows out of the source layers and the vault
    (``_prepare_removal``, then ``_apply_removal``)."""
    # files from before the forgotten data, byte for byte, are not read for its rows (the proof
    # reads them the same way); one whose bytes changed is read like any other. ``older``: that
    # set as the plan found it (data files are content-named and never change in place, so a
    # path found clean stays clean); found again when not given (a resumed request)
    if older is None:
        older = _unchanged(_older_files(wh, orjson.loads(req["counts"] or "{}").get("_since")))
    with wh.write_session("forget") as session:
        return _apply_removal(wh, req, session, _prepare_removal(wh, req, session, older), progress)


@dataclass
class _Removal:
    """What stage 1 writes before it deletes anything (``_prepare_removal``): the ids by kind
    (``_key_sets``), and per affected data file (table, path, the rows it drops, its rewritten copy:
    content-named, listed by no manifest until ``_apply_removal`` swaps it in; None when no row goes)."""

    keys: dict[str, pa.Array]
    files: list[tuple[str, str, int, Any]]


@dataclass
class _CurationAhead:
    """The curated tables made without the forgotten episodes while stage 1 prepares the rest
    (``_curate_ahead``), swapped in with it: ``tables`` (``dedup.layer.CuratedTables``), the batches
    whose every episode goes (``batches``), when it began, and the rows each curated table loses
    (the plan's counts, set once they are known)."""

    tables: Any
    batches: list[str]
    started: Any
    rows: dict[str, int] = field(default_factory=dict)


def _curate_ahead(wh: Warehouse, plan: Impact, pool: ThreadPoolExecutor) -> Any:
    """A future of the curated tables as the repair's curation would make them (``_CurationAhead``),
    made in a thread of ``pool`` while this one prepares stage 1 (108,070 episodes + 1 %: the
    curation's 4.5 s beside the plan's 2 s), or None where a curation must run after the rewrite:
    no episode goes, a batch would lose only some of its episodes (its features would be computed
    again), or the stored features are not current."""
    from trajwh.dedup.layer import CurateConfig, curated_without, features_current
    from trajwh.pipelines import settings as settings_mod
    from trajwh.schemas.config import load_settings

    if not plan.episodes:
        return None
    batches = wh.query("SELECT _batch_id AS b, count(*) FILTER (WHERE trajectory_key IN (SELECT unnest(?::VARCHAR[]))) "
                       "AS n, count(*) AS total FROM episode_features GROUP BY 1 HAVING n > 0", [plan.episodes]).to_pylist()
    if sum(r["n"] for r in batches) != len(set(plan.episodes)) or any(r["n"] != r["total"] for r in batches):
        return None
    cfg: CurateConfig = settings_mod.curate_config(load_settings(None, wh.root))
    if not features_current(wh, cfg):
        return None
    import uuid

    started = now_utc()
    return pool.submit(lambda: _CurationAhead(curated_without(wh, cfg, str(uuid.uuid4()), plan.episodes),
                                              sorted(r["b"] for r in batches), started))


def _prepare_removal(wh: Warehouse, req: dict[str, Any], session: Any, older: frozenset[str],
                     tables: Collection[str] = PARQUET_TABLES.keys(), keys: dict[str, pa.Array] | None = None
                     ) -> _Removal:
    """The affected data files of ``tables`` rewritten as copies, written in ``session`` (the
    forget's write session): nothing is deleted and nothing listed, so it may run before the
    request is stored (a crash then leaves unlisted files, which the next exclusive writer
    removes). ``keys``: the ids by kind (``_key_sets``), when known."""
    s = keys if keys is not None else _key_sets(wh, req, older)
    con = wh.connect(read_only=True)
    try:  # the files to rewrite, found over one connection (one per table: 0.4 s of 25 connects)
        todo = [(table, path, counts) for table in PARQUET_TABLES if table in tables
                for path, counts in sorted(_affected_files(wh, table, s, older, con).items())]
    finally:
        con.close()

    def rewrite(item: tuple[str, str, tuple[int, int]]) -> tuple[str, str, int, Any]:
        table, path, (affected, total) = item
        schema = arrow_schema(PARQUET_TABLES[table])
        if affected == total:  # every row goes (a forgotten batch's own files): the file is not read
            return table, path, total, session.write(table, schema.empty_table())
        t = pq.read_table(path, schema=schema)
        mask = _drop_mask(table, t, s)
        n = (pc.sum(mask).as_py() or 0) if mask is not None else 0
        return table, path, n, session.write(table, t.filter(pc.invert(mask))) if n else None

    # two files at a time (reads, filters and zstd writes release the interpreter's lock)
    with ThreadPoolExecutor(2) as pool:
        return _Removal(s, list(pool.map(rewrite, todo)))


def _apply_removal(wh: Warehouse, req: dict[str, Any], session: Any, removal: _Removal,
                   progress: Callable[[str], None], ahead: _CurationAhead | None = None) -> dict[str, int]:
    """The stored request carried out at the sources: the vault entries removed, then the rewritten
    copies swapped in with the request's new status in one catalog transaction (the old files
    deleted after it), the opt-out matches of the forgotten records dropped. With ``ahead`` (the
    curated tables made without the forgotten episodes), those tables' files are swapped for its
    in the same transaction. Returns the rows removed per table (``req["moved"]`` gains them)."""
    removed: dict[str, int] = {}
    _forget_vault(wh, removal.keys, removed)
    pairs = []
    for table, path, n, written in removal.files:
        if written is not None:
            pairs.append((wh.data_path(path), written))
            removed[table] = removed.get(table, 0) + n
    if ahead is not None:
        for table, n in ahead.rows.items():
            removed[table] = removed.get(table, 0) + n
    for table, n in removed.items():
        progress(f"forget: {table}: {n:,} rows")
    sources = {"files_rewritten": len(pairs), "bytes_replaced": sum(old.stat().st_size for old, _ in pairs),
               "bytes_written": sum(new.size for _, new in pairs), "rows_removed": removed}
    if ahead is not None:  # the curated tables' files, swapped whole for those made without the episodes
        from trajwh.dedup.layer import CURATED_TABLES

        curated_old = [wh.data_path(p) for p in wh.query("SELECT path FROM table_files WHERE list_contains(?, table_name)",
                                                         [list(CURATED_TABLES)]).column(0).to_pylist()]
        sources["files_rewritten"] += len(curated_old)
        sources["bytes_replaced"] += sum(p.stat().st_size for p in curated_old)
        sources["bytes_written"] += sum(f.size for files in ahead.tables.files.values() for f in files)
    req["moved"] = orjson.dumps({**orjson.loads(req["moved"] or "{}"), "sources": sources}).decode()
    then = None
    if ahead is not None:
        from trajwh.dedup.layer import swap_curated

        then = functools.partial(swap_curated, session, curated=ahead.tables, emptied=ahead.batches,
                                 started=ahead.started)
    session.replace_files(pairs, rows={"deletions": [_request_row(req, status="sources_removed")]}, then=then)
    con = wh.connect(read_only=False)
    try:  # what opt-outs matched among the forgotten records (ids only) goes with them
        con.execute("DELETE FROM opt_out_matches WHERE record_id IN (SELECT unnest(?::VARCHAR[]))",
                    [removal.keys["records"].to_pylist()])
    finally:
        con.close()
    return removed


def _forget_vault(wh: Warehouse, s: dict[str, pa.Array], removed: dict[str, int]) -> None:
    """The vault entries of the forgotten data go: those scoped to a forgotten episode, those of the
    tool definitions only forgotten episodes used (scope ``tool_schema:<digest>``), and, when the
    redaction scope is a repository or the dataset (one placeholder for a value across episodes),
    the entries of the forgotten episodes' batches that no episode of that batch which stays uses
    (a batch's vault folder holds the entries its episodes made; read before the rewrite, while
    the redaction events of the forgotten episodes are still listed)."""
    from trajwh.redaction.vault import Vault

    keys = s["keys"]
    vault = Vault(wh, None)
    if not vault.root.exists() or not len(keys):
        return
    scoped = pa.concat_arrays([keys, pc.binary_join_element_wise("tool_schema:", s["digests"], "")]) \
        if len(s["digests"]) else keys
    batches: set[str] | None = None  # of the forgotten episodes, read once a shared scope is met
    in_use: dict[str, set[tuple[str, str]]] = {}
    for folder in sorted(p for p in vault.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        parts = sorted(folder.glob("part-*.parquet"))
        if not parts:
            continue
        t = pa.concat_tables([pq.read_table(p, schema=arrow_schema(VaultRow)) for p in parts])
        mask = pc.is_in(t["scope_id"], scoped)
        shared = pc.and_(pc.is_in(t["scope_kind"], pa.array(["repository", "dataset"])),
                         pc.invert(pc.starts_with(t["scope_id"], "tool_schema:")))
        if pc.any(shared).as_py() and batches is None:
            batches = set(wh.query("SELECT DISTINCT _batch_id FROM episodes WHERE trajectory_key IN "
                                   "(SELECT unnest(?::VARCHAR[]))", [keys.to_pylist()]).column(0).to_pylist())
            in_use = _shared_scopes_in_use(wh, keys, sorted(batches))
        if batches and folder.name in batches and pc.any(shared).as_py():
            used = in_use.get(folder.name, set())
            unused = pa.array([(sid, ph) not in used for sid, ph in zip(t["scope_id"].to_pylist(),
                                                                      t["placeholder"].to_pylist(), strict=True)])
            mask = pc.or_(mask, pc.and_(shared, unused))
        n = pc.sum(mask).as_py() or 0
        if n:
            vault._swap(folder.name, t.filter(pc.invert(mask)).to_pylist())
            removed["vault"] = removed.get("vault", 0) + n


def _shared_scopes_in_use(wh: Warehouse, keys: pa.Array, batches: list[str]) -> dict[str, set[tuple[str, str]]]:
    """(scope id, placeholder) of the repository- or dataset-scoped replacements the episodes that
    stay in these batches made, by batch (scope ids as the redaction stage names them)."""
    from trajwh.redaction.engine import SCOPE_KINDS

    repo, ds = SCOPE_KINDS["repository"], SCOPE_KINDS["dataset"]  # the events name a scope kind by its short name
    rows = wh.query("""
        SELECT DISTINCT e._batch_id AS batch, r.placeholder,
               CASE r.scope_kind WHEN ? THEN coalesce(e.repository, 'no-repository:' || e.trajectory_key)
                                 ELSE coalesce(e.source, 'dataset') END AS scope_id
        FROM redaction_events r JOIN episodes e USING (trajectory_key)
        WHERE r.scope_kind IN (?, ?) AND e._batch_id IN (SELECT unnest(?::VARCHAR[]))
          AND r.trajectory_key NOT IN (SELECT unnest(?::VARCHAR[]))""", [repo, repo, ds, batches, keys.to_pylist()]).to_pylist()
    out: dict[str, set[tuple[str, str]]] = {}
    for r in rows:
        out.setdefault(r["batch"], set()).add((r["scope_id"], r["placeholder"]))
    return out


# --- stages 3 and 4 --------------------------------------------------------------------------


def _repair(wh: Warehouse, before: dict[str, str], keys: set[str],
            progress: Callable[[str], None] = lambda m: None, *, curated: bool = False) -> list[dict[str, Any]]:
    """The derived layers brought up to date without the forgotten rows, in this process: the
    stages a build runs after the per-batch ones (curation, eligibility, outcomes and fragments,
    packs), each incremental as in a build (the clusters updated for the buckets the forgotten
    episodes left, the fragments redone for the episodes whose inputs changed, the windows that
    held a forgotten unit packed again), called directly: no Dagster run and no process to start
    (at 108,070 episodes a Dagster run in a process of its own took 24 s, these stages 15). The
    per-batch stages have nothing to redo: the rewrite took the forgotten rows out of their files
    and kept each file's manifest attributes. The stages' checks run at the next build (the
    compaction drops the record that the warehouse is up to date, and the cached check results are
    keyed by the files they read). The warehouse's own data card is withdrawn by the next stage
    (``datacards.card.withdraw_cards``). ``curated``: stage 1 swapped in the curated tables made
    without the forgotten episodes (``_curate_ahead``), so the curation is not run again. Returns
    the staying episodes whose split changed."""
    import uuid

    from trajwh.dedup.layer import curate_warehouse
    from trajwh.fragments.layer import build_fragments
    from trajwh.licenses.eligibility import build_eligibility
    from trajwh.lineage.rebuild import mark_running, run_row
    from trajwh.packing.layer import build_packs
    from trajwh.pipelines import settings as settings_mod
    from trajwh.schemas.config import load_settings

    settings = load_settings(None, wh.root)
    run_id, started = str(uuid.uuid4()), now_utc()
    row = functools.partial(run_row, run_id, "forget", started, code_version="", counts={},
                            params={"stages": ["eligibility", "fragments", "packs"] if curated else
                                    ["curate", "eligibility", "fragments", "packs"]})
    with wh.write_session("forget") as session:
        mark_running(session, run_id, "forget", started)
    try:
        if not curated:
            progress("forget: repair: clusters, groups and splits")
            curate_warehouse(wh, run_id=run_id, cfg=settings_mod.curate_config(settings))
        progress("forget: repair: license eligibility")
        build_eligibility(wh, run_id=run_id, policy=settings_mod.license_policy(settings))
        progress("forget: repair: outcomes and fragments")
        build_fragments(wh, run_id=run_id, cfg=settings_mod.stats_config(settings),
                        select=settings_mod.select_config(settings))
        progress("forget: repair: packs")
        build_packs(wh, run_id=run_id, cfg=settings_mod.pack_config(settings), engine=settings.engine.name)
    except Exception as exc:  # each stage commits whole or not at all: what it left is consistent
        error = f"{type(exc).__name__}: {exc}"
        with wh.write_session("forget") as session:
            session.upsert_rows("runs", [{**row(), "status": "failed", "error": error[:2000]}])
        raise ConfigError(f"the repair of the derived layers after the deletion failed ({error[:300]}); the request "
                          "stays open", valid="fix the cause, then run `trajwh forget --resume`") from exc
    with wh.write_session("forget") as session:
        session.upsert_rows("runs", [row()])
    after = {r["trajectory_key"]: r["split"] for r in wh.query("SELECT trajectory_key, split FROM splits").to_pylist()}
    return [{"trajectory_key": k, "from": v, "to": after.get(k)} for k, v in sorted(before.items())
            if k not in keys and after.get(k) != v]


def _compact(wh: Warehouse) -> None:
    """Caches and spill files go; the packs check's ledgers (ids and token digests of the units
    a passing check verified) stay, pruned to the units the packs still hold, so the next check
    does not render the whole set again; so do the pack builds' lists of the units they dropped as
    too long (ids and token keys), and the sets' token meta (ids, token keys, lengths), pruned to
    the token files the sets still list."""
    from trajwh.packing.verify import LEDGER_DIR, prune_ledgers
    from trajwh.packing.windows import DROPS_DIR, META_DIR, prune_token_meta

    prune_ledgers(wh)
    prune_token_meta(wh)
    cache = wh.root / "_cache"
    for path in sorted(cache.iterdir()) if cache.is_dir() else []:
        if path.name not in (LEDGER_DIR, DROPS_DIR, META_DIR):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    shutil.rmtree(wh.root / ".tmp", ignore_errors=True)
    con = wh.connect(read_only=False)
    try:
        con.execute("FORCE CHECKPOINT")
    finally:
        con.close()


# --- stage 5: proof --------------------------------------------------------------------------


def _leftover_rows(wh: Warehouse, unchanged: frozenset[str], rows: _RowCheck) -> dict[str, int]:
    """Rows that still carry a forgotten id, per table (must all be 0). ``unchanged``: data files
    the proof found byte for byte as the manifest recorded them before the forgotten data was
    ingested (``_scan``). They cannot hold a row made from it, nor a lineage edge to one of its
    steps or episodes (an edge is written with what it points at), so they are not read.
    ``rows``: the counts the scan took (``_RowCheck``); only the data files it did not count are read here."""
    s, left = rows.keys, dict(rows.left)
    skip = unchanged | frozenset(rows.counted)
    todo = {t for p, t in rows.tables.items() if p not in skip}
    for table in [t for t in PARQUET_TABLES if t in todo]:
        n = sum(int(pc.sum(m).as_py() or 0) for path in _files_with_rows(wh, table, s, skip)
                if (m := _drop_mask(table, pq.read_table(path, schema=arrow_schema(PARQUET_TABLES[table])), s)) is not None)
        if n:
            left[table] = left.get(table, 0) + n
    # a near-duplicate link of a staying episode to a forgotten one (the repair's clusters drop them)
    clusters = _rows_sql(wh, "near_dup_clusters", unchanged)
    # (the links unnested and joined: a list_has_any of each row's keys took 0.2 s at 108,070 episodes, this 0.03 s)
    linked = wh.query(f"SELECT count(DISTINCT trajectory_key) FROM (SELECT trajectory_key, unnest(links).trajectory_key "
                      f"AS linked FROM {clusters}) WHERE linked IN (SELECT unnest(?::VARCHAR[]))",
                      [s["keys"].to_pylist()]).column(0)[0].as_py() if len(s["keys"]) else 0
    if linked:
        left["near_dup_clusters (links)"] = linked
    if dangling := _dangling_edges(wh, unchanged):
        left["lineage_edges (dangling)"] = dangling
    from trajwh.fragments.layer import TASK_OF

    # statistics of a task no episode is left of (its id is the task's own text, e.g. a repository's)
    orphan = wh.query(f"SELECT count(*) FROM task_stats WHERE task_id NOT IN "
                      f"(SELECT {TASK_OF.format(e='')} FROM redacted_episodes)").column(0)[0].as_py()
    if orphan:
        left["task_stats (no episode left)"] = orphan
    vault_left: dict[str, int] = {}
    _count_vault(wh, s["keys"], vault_left)
    return {**left, **vault_left}


def _dangling_edges(wh: Warehouse, unchanged: frozenset[str]) -> int:
    """Lineage edges (outside the ``unchanged`` files) whose child row is no longer there, as outer
    joins from the edges read (``NOT IN`` subqueries built a lookup of every step first: 0.7 s at
    108,070 episodes with one file of edges to check, 0.24 s now; over every edge 1.8 and 1.9 s)."""
    return wh.query(f"""
        SELECT count(*) FROM (SELECT child_table, child_id FROM {_rows_sql(wh, "lineage_edges", unchanged)}
                              WHERE child_table IN ('steps', 'redacted_steps', 'episodes')) e
        LEFT JOIN (SELECT step_id FROM steps) s ON e.child_table = 'steps' AND s.step_id = e.child_id
        LEFT JOIN (SELECT step_id FROM redacted_steps) r ON e.child_table = 'redacted_steps' AND r.step_id = e.child_id
        LEFT JOIN (SELECT trajectory_key FROM episodes) p ON e.child_table = 'episodes' AND p.trajectory_key = e.child_id
        WHERE s.step_id IS NULL AND r.step_id IS NULL AND p.trajectory_key IS NULL""").column(0)[0].as_py()


def _count_vault(wh: Warehouse, keys: pa.Array, out: dict[str, int]) -> None:
    for path in sorted((wh.root / "vault").glob("*/part-*.parquet")):
        n = pc.sum(pc.is_in(pq.read_table(path, columns=["scope_id"])["scope_id"], keys)).as_py() or 0
        if n:
            out["vault"] = out.get("vault", 0) + n


class _Matcher:
    """Finds probes: the plain strings when this process still has them (during a forget), else
    their salted fingerprints (every 32-character window that starts a word is hashed: a later
    ``verify-forget`` from the tombstone alone)."""

    def __init__(self, probes: list[str] | None, fingerprints: set[str], salt: bytes):
        self.salt, self.fingerprints = salt, fingerprints
        self.probes = sorted(set(probes or ()))

    @property
    def plain(self) -> bool:
        return bool(self.probes)

    def only(self, fingerprints: set[str]) -> _Matcher:
        """The same matcher restricted to these fingerprints."""
        return _Matcher([p for p in self.probes if fingerprint(p, self.salt) in fingerprints], fingerprints, self.salt)

    def key(self, probe: str) -> str:
        return fingerprint(probe, self.salt)

    def find_text(self, text: str) -> set[str]:
        """Fingerprints of the probes in one text (the slow path: fingerprint mode)."""
        if self.plain:
            return {self.key(p) for p in _Search(self.probes).text(text)}
        return {fp for m in _SAFE.finditer(text) if (fp := fingerprint(m.group(1), self.salt)) in self.fingerprints}


#: text is searched in slices of this many bytes (a probe found in one is not sought in the next:
#: text that repeats one costs one slice's matches), overlapping by more than a pattern's length
_SLICE, _OVERLAP = 4 * 2**20, 2 * _PROBE_LEN
#: a slice with more matches than this rebuilds the automaton without the probes it found, and so
#: does a found share of the patterns above one half (or, with Hyperscan, which reports a pattern
#: once a slice, more than ``_HyperscanSet.stale_limit`` found ones). Choosing the probes of 1,070
#: forgotten records at 108,070 episodes (2.1 GB of surviving payloads, 9,058 of 9,787 candidates
#: shared) took 8.7-8.9 s of CPU with these and Aho-Corasick, 10.1-11.7 s with 2,000 matches and one
#: twentieth (each rebuild of the DFA costs up to 60 ms), 31-33 s with no rebuild (every shared one
#: matched again)
_REBUILD_MATCHES = 50_000
_REBUILD_FOUND = 2


class _HyperscanSet:
    """Every pattern of a set that occurs in a buffer, overlapping occurrences too: Hyperscan's
    literal matcher (Intel's SIMD multi-literal engine, ``hyperscan``), each pattern reported once a
    buffer. The search of surviving payloads above: 6.6 s of CPU where the Aho-Corasick DFA took
    8.7 (where nothing matches it reads about 670 MB/s here, the DFA's overlapping walk 470)."""

    #: found patterns left in the set before it is built again without them (building 13,000
    #: patterns costs 0.3 s, 2,000 30 ms): the search above took 7.6 s of CPU with 500 (15
    #: builds), 6.6 s with 2,000 (6), 7.3 s with 4,000 (5: found ones reported again and again)
    stale_limit = 2_000

    def __init__(self, patterns: tuple[bytes, ...]):
        self._db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
        self._db.compile(expressions=list(patterns), ids=list(range(len(patterns))),
                         flags=hyperscan.HS_FLAG_SINGLEMATCH, literal=True)
        self._scratch = threading.local()  # (a scratch space serves one scan at a time)

    def find(self, view: Any) -> list[int]:
        scratch = getattr(self._scratch, "space", None)
        if scratch is None:
            scratch = self._scratch.space = hyperscan.Scratch(self._db)
        out: list[int] = []
        self._db.scan(view, match_event_handler=lambda i, *_: out.append(i), scratch=scratch)
        return out


class _AhoCorasickSet:
    """The same as ``_HyperscanSet`` where Hyperscan is not installed (a platform without its
    wheels): a Rust Aho-Corasick automaton (``ahocorasick_rs``: about 10x pyahocorasick, reads
    Arrow buffers without a copy), every occurrence reported; a DFA (twice the NFA's speed) up to
    20,000 patterns, else the library's choice. A DFA of 30,000 patterns holds about 100 MB."""

    stale_limit = None

    def __init__(self, patterns: tuple[bytes, ...]):
        dfa = ahocorasick_rs.Implementation.DFA if len(patterns) <= _DFA_PATTERNS else None
        self._ac = ahocorasick_rs.BytesAhoCorasick(list(patterns), implementation=dfa)

    def find(self, view: Any) -> list[int]:
        return [i for i, _, _ in self._ac.find_matches_as_indexes(view, overlapping=True)]


class _Search:
    """Plain probes sought over many buffers (``_automaton``: Hyperscan, else Aho-Corasick; both
    read Arrow buffers without a copy). ``found`` grows as buffers are fed. Matches overlap, so one
    pass is exact; once found probes make up many patterns or many matches, the matcher is built
    again without them, so text that repeats one (a shared system prompt) is not matched over and
    over. A probe with "/" is also sought as JSON may write it, "\\/".

    ``confirm``: a hit in an array's values buffer counts only if it is in one value (the values
    joined by line breaks, which no probe holds), not made by two adjacent ones. The proof's files
    confirm; the search of surviving raw payloads (JSON objects: a probe cannot span "}{") does not."""

    def __init__(self, probes: list[str], *, confirm: bool = True):
        self.probes, self.confirm, self.found = probes, confirm, set()
        patterns, owner = _patterns(tuple(probes))
        self._patterns, self._owner, self._stale = patterns, list(owner), 0
        self._ac = _automaton(self._patterns)

    @property
    def done(self) -> bool:
        return self._ac is None

    def _drop_found(self) -> None:
        left = [(pat, o) for pat, o in zip(self._patterns, self._owner, strict=True) if o not in self.found]
        self._patterns, self._owner = tuple(pat for pat, _ in left), [o for _, o in left]
        # (not cached: a rebuilt automaton is not used again, and the cache's would stay in memory)
        self._ac, self._stale = _automaton.__wrapped__(self._patterns), 0

    def _matches(self, data: Any) -> set[str]:
        """The probes (not found before) in ``data``, searched slice by slice; with ``keep`` they
        count as found as soon as they are seen (no confirmation)."""
        seen: set[str] = set()
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        for at in range(0, max(1, len(view)), _SLICE):  # slices overlap by more than a pattern
            if self._ac is None:
                break
            matches = self._ac.find(view[at:at + _SLICE + _OVERLAP])
            new = {self._owner[i] for i in matches} - seen - self.found
            seen |= new
            if not self.confirm and new:
                self._count(new, many=len(matches) > _REBUILD_MATCHES)
        return seen

    def _count(self, new: set[str], *, many: bool = False) -> set[str]:
        new = new - self.found
        if new:
            self.found |= new
            self._stale += sum(o in new for o in self._owner)
            limit = self._ac.stale_limit
            if many or self._stale > len(self._owner) // _REBUILD_FOUND or (limit and self._stale > limit):
                self._drop_found()
        return new

    def text(self, text: str | bytes) -> set[str]:
        """Probes newly found in one text."""
        confirm, self.confirm = self.confirm, False  # one text: nothing to confirm
        try:
            before = set(self.found)
            self._matches(text.encode() if isinstance(text, str) else text)
            return self.found - before
        finally:
            self.confirm = confirm

    def leaf(self, arr: pa.Array) -> set[str]:
        """Probes newly found in one string or binary array (its values buffer searched as it is)."""
        if not self.confirm:
            before = set(self.found)
            self._matches(_values_buffer(arr))
            return self.found - before
        maybe = self._matches(_values_buffer(arr))
        if not maybe:
            return set()
        joined = _joined(arr, "\n" if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type) else b"\n")
        return self._count(_Search(sorted(maybe)).text(joined))


@functools.lru_cache(maxsize=4)
def _patterns(probes: tuple[str, ...]) -> tuple[tuple[bytes, ...], tuple[str, ...]]:
    """The byte patterns of these probes and the probe each stands for (made once per probe set:
    the proof starts a search per file, 600 at 108,070 episodes: 0.5 s made each time)."""
    patterns, owner = [], []
    for p in probes:
        for variant in dict.fromkeys((p, p.replace("/", "\\/"))):
            patterns.append(variant.encode())
            owner.append(p)
    return tuple(patterns), tuple(owner)


@functools.lru_cache(maxsize=4)
def _automaton(patterns: tuple[bytes, ...]) -> _HyperscanSet | _AhoCorasickSet | None:
    """A matcher of these patterns (built once per probe set: the proof's files share it), None for
    none. Only the last few are kept (a cache of 64 Aho-Corasick DFAs held 1.6 GB after a plan)."""
    if not patterns:
        return None
    if hyperscan is not None:
        try:
            return _HyperscanSet(patterns)
        except hyperscan.error:  # (a database it cannot build, or no memory for it: the automaton finds the same)
            pass
    return _AhoCorasickSet(patterns)


_DFA_PATTERNS = 20_000


def _values_buffer(arr: pa.Array) -> memoryview:
    buf = arr.buffers()[2]
    return memoryview(buf).cast("B") if buf is not None else memoryview(b"")


def _leaves(arr: pa.Array | pa.ChunkedArray):
    """The string and binary leaf arrays in ``arr`` (lists, structs and dictionaries descended;
    string views cast to plain strings)."""
    if isinstance(arr, pa.ChunkedArray):
        for chunk in arr.chunks:
            yield from _leaves(chunk)
        return
    t = arr.type
    if not len(arr):
        return
    if pa.types.is_dictionary(t):
        yield from _leaves(arr.dictionary)
    elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        yield arr
    elif pa.types.is_string_view(t):
        yield arr.cast(pa.large_string())
    elif pa.types.is_binary_view(t):
        yield arr.cast(pa.large_binary())
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        yield from _leaves(arr.flatten())
    elif pa.types.is_struct(t):
        for child in arr.flatten():
            yield from _leaves(child)


def _leaf_text(arr: pa.Array) -> str:
    """A leaf's values as one text (line breaks between them); binary as UTF-8 with JSON's "\\/"
    read as "/" (the fingerprint path hashes decoded windows)."""
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        return _joined(arr, b"\n").replace(b"\\/", b"/").decode("utf-8", "replace")
    return _joined(arr, "\n")


def _find_in_table(t: pa.Table, names: list[str], matcher: _Matcher, search: _Search | None) -> set[str]:
    """Fingerprints of the probes in these columns of ``t``."""
    hits: set[str] = set()
    for name in names:
        for leaf in _leaves(t[name]):
            if search is not None:
                hits |= {matcher.key(p) for p in search.leaf(leaf)}
            else:
                hits |= matcher.find_text(_leaf_text(leaf))
    return hits


def _joined(arr: pa.Array, sep: str | bytes) -> Any:
    large = pa.large_binary() if isinstance(sep, bytes) else pa.large_string()
    filled = pc.fill_null(arr.cast(large), pa.scalar(sep[:0], large))
    whole = pa.LargeListArray.from_arrays(pa.array([0, len(filled)], pa.int64()), filled)
    return pc.binary_join(whole, pa.scalar(sep, large))[0].as_py()


def _has_text(t: pa.DataType) -> bool:
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _has_text(t.value_type)
    if pa.types.is_struct(t):
        return any(_has_text(t.field(i).type) for i in range(t.num_fields))
    return False


def _scan_parquet(path: str, matcher: _Matcher, rows: _RowCheck | None = None) -> set[str]:
    """Probe hits in a Parquet file's text columns; with ``rows`` (the file is one of its table's,
    ``_RowCheck``), its rows that carry a forgotten id are counted in the same read."""
    hits: set[str] = set()
    pf = pq.ParquetFile(path)
    names = [f.name for f in pf.schema_arrow if _has_text(f.type)]
    keys = _KEY_COLUMNS.get(rows.tables[path], ((), ""))[0] if rows is not None else ()
    if any(k not in pf.schema_arrow.names for k in keys):
        rows = None  # (a file without its table's key columns is counted the old way, read with the table's schema)
    search = _Search(matcher.probes) if matcher.plain else None
    left = 0
    for i in range(pf.num_row_groups):
        t = pf.read_row_group(i, columns=names + [k for k in keys if k not in names] if rows is not None else names)
        if search is None or not search.done:
            hits |= _find_in_table(t, names, matcher, search)
        if rows is not None:
            left += rows.count(path, t)
        elif search is not None and search.done:
            break
    if rows is not None:  # (a file that failed part-way is not counted: it is read again the old way)
        rows.record(path, left)
    return hits


class _RowCheck:
    """The proof's count of rows that still carry a forgotten id, taken while the scan reads each
    data file (``_leftover_rows`` read them again, one query per table: 1.9 s at 108,070 episodes).
    ``tables``: a data file's path -> its table; ``keys``: ``_key_sets``. ``left``: rows per table;
    ``counted``: the files counted (one the scan could not read as Parquet is not: it is read the
    old way, which fails loudly)."""

    def __init__(self, tables: dict[str, str], keys: dict[str, pa.Array]):
        self.tables, self.keys = tables, keys
        self.left: dict[str, int] = {}
        self.counted: set[str] = set()

    def part(self, paths: list[str]) -> _RowCheck:
        return _RowCheck({p: self.tables[p] for p in paths if p in self.tables}, self.keys)

    def count(self, path: str, t: pa.Table) -> int:
        """The rows of ``t`` (part of the file ``path``) that carry a forgotten id."""
        mask = _drop_mask(self.tables[path], t, self.keys)
        return int(pc.sum(mask).as_py() or 0) if mask is not None else 0

    def record(self, path: str, n: int) -> None:
        """The file ``path`` read whole: ``n`` such rows in it."""
        if n:
            table = self.tables[path]
            self.left[table] = self.left.get(table, 0) + n
        self.counted.add(path)

    def add(self, other: _RowCheck) -> None:
        for table, n in other.left.items():
            self.left[table] = self.left.get(table, 0) + n
        self.counted |= other.counted


def _scan_bytes(path: str, matcher: _Matcher) -> set[str]:
    """A file's bytes; a gzip file (a `.jsonl.gz` export) decompressed."""
    with data_root(path).open("rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        import gzip

        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            pass
    if matcher.plain:
        return {matcher.key(p) for p in _Search(matcher.probes).text(data)}
    return matcher.find_text(data.replace(b"\\/", b"/").decode("latin-1"))


def _scan_file(path: str, matcher: _Matcher, rows: _RowCheck | None = None) -> set[str]:
    """One file: Parquet decoded (as bytes when it is not readable as Parquet), anything else as
    bytes; a data file's rows counted with ``rows`` (``_RowCheck``)."""
    try:
        if path.endswith(".parquet"):
            return _scan_parquet(path, matcher, rows if rows is not None and path in rows.tables else None)
        return _scan_bytes(path, matcher)
    except (OSError, pa.ArrowInvalid):
        return _scan_bytes(path, matcher)


#: a part's working set: the proof's scan of the 108,070-episode warehouse in one process peaked
#: at 497 MB, 400 over its libraries (reading a column at a time instead was no smaller)
_PART_MB = 400
#: below this many bytes of files the proof reads them in this process (a worker costs a second)
_PARALLEL_SCAN_BYTES = 64 * 2**20


def _scan_files(task: tuple[list[str], _Matcher, dict[str, tuple[str, str]], _RowCheck | None,
                            dict[str, tuple[int, ...]]]) -> tuple[dict[str, set[str]], list[str], _RowCheck | None]:
    """(probe hits by file, the files read by digest alone, the rows counted) of a part's files. A
    file in ``recorded`` (path -> the digest the manifest recorded before the forgotten data was
    ingested: ``_older_files``) whose bytes still have that digest is not searched; any other file,
    one whose bytes changed included, is. A file of ``stamps`` (path -> its stamp when the plan of
    the same forget found its bytes with that digest: ``_unchanged``) whose stamp is still that
    one is not read again."""
    paths, matcher, recorded, rows, stamps = task
    found, unchanged = {}, []
    for path in paths:
        if path in recorded and ((path in stamps and _stamp(path) == stamps[path]) or _same_bytes(path, recorded[path])):
            unchanged.append(path)
        elif hits := _scan_file(path, matcher, rows):
            found[path] = hits
    return found, unchanged, rows


#: reading a file's digest costs about this share of searching it (decoding and searching against
#: BLAKE3 at about 4.6 GB/s, sha256 at 0.9 for a file an earlier version listed), for sharing the
#: files out over the cores
_DIGEST_WEIGHT = {"blake3": 0.01, "sha256": 0.05}


def _scan(wh: Warehouse, matcher: _Matcher, since: str | None = None, rows: _RowCheck | None = None,
          pool: ProcessPoolExecutor | None = None, stamps: dict[str, tuple[int, ...]] | None = None
          ) -> tuple[dict[str, set[str]], frozenset[str]]:
    """Fingerprints of the probes found, by file, over every file under the warehouse: Parquet
    decoded, anything else (the catalog and its WAL, vault salt, caches, logs) as bytes; the
    catalog's own tables are read through DuckDB too (its strings may be compressed on disk).
    ``since`` (``_ingested_since``): the data files the manifest listed before then are read for
    their digest, and searched only if it is not the one recorded. The files are shared out by
    size over the cores (``lineage.parallel``). Returns (hits by file, the files read by digest);
    ``rows`` (``_RowCheck``) gains the counts of the data files read."""
    from trajwh.lineage.exports import paths as export_paths
    from trajwh.lineage.parallel import run_parts

    paths = [os.path.join(d, n) for d, _, names in os.walk(wh.root) for n in names]
    sizes = {p: os.path.getsize(p) if os.path.isfile(p) else 0 for p in paths}
    for top in export_paths(wh):  # what the tool wrote elsewhere (a file or a folder, local or in a bucket)
        sizes.update(location_files(top))
    if wh.remote:  # the data files in the object store: every object under its prefix
        sizes.update(location_files(str(wh.data)))
    recorded = _older_files(wh, since)
    weights = {p: n * _DIGEST_WEIGHT[recorded[p][0]] if p in recorded else n for p, n in sizes.items()}
    found: dict[str, set[str]] = {}
    unchanged: set[str] = set()
    stamps = stamps or {}
    for part, same, counted in run_parts(_scan_files, [(part, matcher, {p: recorded[p] for p in part if p in recorded},
                                                         rows.part(part) if rows is not None else None,
                                                         {p: stamps[p] for p in part if p in stamps})
                                                        for part in _by_size(weights)], pool=pool):
        unchanged.update(same)
        if rows is not None and counted is not None:
            rows.add(counted)
        for path, hits in part.items():
            inside = not is_uri(path) and os.path.abspath(path).startswith(os.path.abspath(wh.root) + os.sep)
            found[os.path.relpath(path, wh.root) if inside else path] = hits
    con = wh.connect(read_only=True)
    try:
        for table in ("table_files", "meta", "batches", "ingested_files", "runs"):
            # one search per table: its values joined by line breaks, which no probe (nor any
            # window a fingerprint is taken of) holds, so no match spans two values
            text = "\n".join(v if isinstance(v, str) else v.decode("utf-8", "replace")
                              for row in con.execute(f"SELECT * FROM {table}").fetchall()
                              for v in row if isinstance(v, str | bytes))
            if hits := matcher.find_text(text):
                found.setdefault(f"catalog:{table}", set()).update(hits)
    finally:
        con.close()
    return found, frozenset(unchanged)


def _shared(wh: Warehouse, matcher: _Matcher) -> set[str]:
    """The probes (fingerprints) the surviving raw records hold too (shared text, e.g. a system
    prompt): not evidence. The raw layer's files (after stage 1: no forgotten record is left in
    them) are read by their payload column, not through a query, shared out by size over the
    cores; a probe found once is not sought again."""
    from trajwh.lineage.parallel import run_parts

    paths = _table_paths(wh, "raw_records")
    sizes = {p: wh.data_path(p).stat().st_size for p in paths}
    return set().union(*run_parts(_shared_part, [(part, matcher) for part in _by_size(sizes)]))


def _shared_part(task: tuple[list[str], _Matcher]) -> set[str]:
    paths, matcher = task
    shared: set[str] = set()
    search = _Search(matcher.probes, confirm=False) if matcher.plain else None
    for path in paths:
        # in batches of rows, not whole row groups (64 MB of payloads each): the search of 108,070
        # episodes' payloads alone peaked at 839 MB, 639 MB now, and a forget's processes together
        # at 1.94-1.98 GB, 1.56-1.62 GB now
        for rb in pq.ParquetFile(path).iter_batches(batch_size=_SEARCH_ROWS, columns=["payload"]):
            shared |= _find_in_table(pa.Table.from_batches([rb]), ["payload"], matcher, search)
            if search is not None and search.done:
                return shared
    return shared


#: raw records read at a time by the search of surviving payloads
_SEARCH_ROWS = 1_000
#: the search's worker's niceness (added to the forget's): it runs beside the repair, which waits for nothing else
_SEARCH_NICE = 10


def _worker_setup(parent: int) -> None:
    """The forget's worker: it ends with the forget's process (one killed part-way leaves no worker
    behind) and yields the cores to it."""
    from trajwh.lineage.parallel import die_with_parent

    die_with_parent(parent)
    if hasattr(os, "nice"):  # (POSIX)
        os.nice(_SEARCH_NICE)


def _started() -> None:
    """Nothing: a task whose unpickling makes a worker import this module and its libraries."""


@contextlib.contextmanager
def _worker() -> Iterator[ProcessPoolExecutor]:
    """The forget's worker process, spawned when first given a task: the candidate probes drawn
    during the plan, the probes' search beside the repair, then a part of the proof's scan,
    without a second start (a spawned process imports its libraries for about a second). It
    yields the cores to this process: the repair beside the search is the forget's critical
    path, and the search still ends before it (107,000 + 1 %: forget 22.6 and 22.6 -> 21.7 and
    22.2 s). On an error the error is not kept waiting for the worker's task (a search runs to
    its end, then the worker leaves; it ends with this process in any case)."""
    import multiprocessing

    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_setup,
                               initargs=(os.getpid(),))
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True, cancel_futures=True)


def _by_size(sizes: dict[str, int]) -> list[list[str]]:
    """The paths in parts of about equal bytes (the biggest file to the lightest part), one per core
    the memory budget allows (one below ``_PARALLEL_SCAN_BYTES`` in all); no empty part."""
    from trajwh.lineage.parallel import parts_within, workers_wanted

    n = parts_within(workers_wanted(), part_mb=_PART_MB) if sum(sizes.values()) >= _PARALLEL_SCAN_BYTES else 1
    parts: list[list[str]] = [[] for _ in range(max(1, n))]
    load = [0] * len(parts)
    for p in sorted(sizes, key=lambda p: (-sizes[p], p)):
        i = load.index(min(load))
        parts[i].append(p)
        load[i] += sizes[p]
    return [part for part in parts if part]


def _table_paths(wh: Warehouse, table: str) -> list[str]:
    rows = wh.query("SELECT path FROM table_files WHERE table_name = ? ORDER BY path", [table]).column(0).to_pylist()
    return [str(wh.data_path(p)) for p in rows]


def verify_request(wh: Warehouse, req: dict[str, Any], probes: list[str] | None = None, *,
                   pool: ProcessPoolExecutor | None = None, stamps: dict[str, tuple[int, ...]] | None = None,
                   keys: dict[str, pa.Array] | None = None) -> dict[str, Any]:
    """The proof: forgotten ids left per table, and probe hits per file outside shared text. Only
    the probes some file holds are sought in the surviving raw records (read again: data ingested
    since the forget may share one). ``pool``: the forget's worker (``_worker``), which takes a
    part of the scan instead of a process started for it. ``keys``: the ids stage 1 of the same
    forget removed (``_key_sets`` before the rewrite: its forgotten steps' ids and the tool schemas
    only its episodes used, which the warehouse no longer shows afterwards), else found now."""
    salt = _salt(wh)
    fingerprints = set(req["probe_fingerprints"])
    matcher = _Matcher(probes, fingerprints, salt)
    since = orjson.loads(req["counts"] or "{}").get("_since")
    # the forgotten ids' rows are counted as the scan reads the data files (the files the manifest
    # listed before the data came are passed over for its steps' ids: the scan searches any of them
    # whose bytes changed, and a forgotten step's own row is counted there by its episode's key)
    tables = {str(wh.data_path(r["path"])): r["table_name"] for r in wh.manifest_query(
        "SELECT path, table_name FROM table_files").to_pylist() if r["table_name"] in PARQUET_TABLES}
    rows = _RowCheck(tables, keys if keys is not None else _key_sets(wh, req, frozenset(_older_files(wh, since))))
    found, unchanged = _scan(wh, matcher, since, rows, pool, stamps)
    left = _leftover_rows(wh, unchanged, rows)
    hit = set().union(*found.values()) if found else set()
    shared = _shared(wh, matcher.only(hit)) if hit else set()
    leaks = {f: sorted(h - shared) for f, h in found.items() if h - shared}
    return {"ok": not left and not leaks, "rows_left": left, "files_with_probes": leaks,
            "probes": len(fingerprints), "probes_found": len(hit), "probes_shared": len(shared & fingerprints),
            "files_unchanged": len(unchanged)}


# --- the request -----------------------------------------------------------------------------


def _lean(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with the collector less often and huge pages off (``lineage.parallel``): a
    forget's work is many middling reads and short-lived rows, bound by the two cores."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        from trajwh.lineage.parallel import fewer_collections, no_huge_pages

        with fewer_collections(), no_huge_pages():
            return fn(*args, **kwargs)
    return run


@_lean
def forget(wh: Warehouse, selector: str | None, reason: str, *, dry_run: bool = False,
           progress: Callable[[str], None] = lambda m: None) -> ForgetResult | Impact:
    """Plan (``dry_run``: only the plan) and carry out one deletion request; see the module doc."""
    if not reason or not reason.strip():
        raise ConfigError("a deletion request needs a reason", valid="--reason TEXT (kept in the tombstone)")
    sel = Selector.parse(selector)
    wh.require()
    if dry_run:
        return impact(wh, sel)
    with wh.write_session("forget"):  # a catalog from before deletions existed gains the table
        pass
    for open_req in pending_requests(wh):  # finish an interrupted request first: one at a time
        resume(wh, open_req, progress=progress)
    with _worker() as pool:
        pool.submit(_started)  # the worker imports its libraries while the plan is made
        return _plan_and_run(wh, sel, reason, progress, pool)


def _plan_and_run(wh: Warehouse, sel: Selector, reason: str, progress: Callable[[str], None],
                  pool: ProcessPoolExecutor) -> ForgetResult:
    with ThreadPoolExecutor(1) as curating:
        # the curation beside the plan starts once the episodes are known, before the layers are counted
        started: list[Any] = []
        plan = impact(wh, sel, lambda selected: started.append(_curate_ahead(wh, selected, curating)))
        return _plan_more(wh, sel, reason, progress, pool, plan, started[0] if started else None)


def _plan_more(wh: Warehouse, sel: Selector, reason: str, progress: Callable[[str], None], pool: ProcessPoolExecutor,
               plan: Impact, ahead: Any) -> ForgetResult:
    """``_plan_and_run`` once the plan is made (``ahead``: the future of ``_curate_ahead``, or None)."""
    # (polars and the engines: the repair imports them in any case)
    from trajwh.dedup.layer import CURATED_TABLES

    if plan.empty:
        raise ConfigError(f"{sel} matches nothing in {wh.root}", valid="a selector `trajwh impact` finds rows for")
    counts = {k: v["rows"] for k, v in plan.layers.items()}
    counts["_quarantine_ids"] = plan.layers.get("quarantine", {}).get("ids", [])
    counts["_since"] = _ingested_since(wh, plan.records, plan.episodes, counts["_quarantine_ids"])
    # the files from before the forgotten data (bytes unchanged) are read neither here nor by the
    # rewrite; the worker draws the candidate probes (1 s of regular expressions at 1 % of 108,070
    # episodes) while this process reads those files' digests, passing over the files the manifest
    # lists from before then: read again here, trusting only the files whose digest is unchanged,
    # should one not be
    recorded = _older_files(wh, counts["_since"])
    drawn = pool.submit(_candidates_part, (str(wh.root), plan.records, plan.episodes, frozenset(recorded)))
    stamps: dict[str, tuple[int, ...]] = {}  # the files found unchanged, for the proof (``_scan_files``)
    older = _unchanged(recorded, stamps)
    now = now_utc()
    req = {"request_id": "del-" + ids.digest([str(sel), reason, now.isoformat()])[:16], "requested_at": now,
           "selector": str(sel), "reason": reason.strip(), "status": "planned", "record_ids": plan.records,
           "trajectory_keys": plan.episodes, "record_digests": [], "probe_fingerprints": [],
           "counts": orjson.dumps(counts).decode(), "moved": None, "verify_result": None}
    splits_before = {r["trajectory_key"]: r["split"] for r in wh.query("SELECT trajectory_key, split FROM splits").to_pylist()}
    req["moved"] = orjson.dumps({"splits_before": splits_before}).decode()
    with wh.write_session("forget") as session:
        # stage 1's copies are written while the worker draws the candidates (108,070 episodes + 1 %:
        # the plan waited 0.9 s for them) and a thread curates without the forgotten episodes;
        # nothing is deleted before the request is stored with them
        keys = _key_sets(wh, req, older)
        removal = _prepare_removal(wh, req, session, older, [t for t in PARQUET_TABLES
                                                             if ahead is None or t not in CURATED_TABLES], keys)
        digests, candidates = drawn.result()
        if older != frozenset(recorded):
            digests, candidates = _plan_candidates(wh, plan.records, plan.episodes, older)
        # the worker searches the surviving payloads from here (the files the swap will leave)
        search = _start_search(candidates, _surviving_raw(wh, removal), pool)
        salt = _salt(wh)
        # every candidate's fingerprint, until the repair stage has chosen the probes among them
        req.update(record_digests=digests, probe_fingerprints=sorted({fingerprint(p, salt) for p in _windows(candidates)}))
        session.upsert_rows("deletions", [_request_row(req)])
        progress(f"forget {req['request_id']}: planned ({len(plan.records)} raw records, {len(plan.episodes)} episodes)")
        _maybe_crash("planned")
        curated = None
        if ahead is not None:
            try:
                curated = ahead.result()
                curated.rows = {t: plan.layers.get(t, {}).get("rows", 0) for t in CURATED_TABLES}
            except Exception as exc:  # noqa: BLE001 - the curation runs after the rewrite instead
                progress(f"forget: the curation beside the plan failed ({type(exc).__name__}: {str(exc)[:200]}); "
                         "the curated tables are rewritten and curated again after the rewrite")
                more = _prepare_removal(wh, req, session, older, CURATED_TABLES, keys)
                removal.files.extend(more.files)
        _apply_removal(wh, req, session, removal, progress, curated)
    req = _request_row(req, status="sources_removed")
    _maybe_crash("sources_removed")
    return _resume(wh, req, candidates, older, progress, pool, curated=curated is not None, search=search,
                   stamps=stamps, keys=keys)


def resume(wh: Warehouse, req: dict[str, Any], *, candidates: Candidates | None = None,
           older: frozenset[str] | None = None, progress: Callable[[str], None] = lambda m: None) -> ForgetResult:
    """Carry a request on from the stage it reached (each stage is idempotent). ``candidates``:
    the plan's candidate probe windows, which only the process that planned holds (never stored:
    they are the forgotten text). With them the probes are chosen beside the repair and the
    proof seeks them as strings; without them (a request resumed after a crash) the proof seeks
    the fingerprints stored: every candidate's when the crash came before the probes were chosen."""
    with _worker() as pool:
        return _resume(wh, req, candidates, older, progress, pool)


def _resume(wh: Warehouse, req: dict[str, Any], candidates: Candidates | None, older: frozenset[str] | None,
            progress: Callable[[str], None], pool: ProcessPoolExecutor, *, curated: bool = False,
            search: tuple[_Matcher, Any] | None = None, stamps: dict[str, tuple[int, ...]] | None = None,
            keys: dict[str, pa.Array] | None = None) -> ForgetResult:
    status = req["status"]
    resumed = candidates is None
    probes: list[str] | None = None
    moved_doc = orjson.loads(req["moved"] or "{}")
    if status == "planned":  # (a request stored before a crash: its plan made anew)
        _remove_sources(wh, req, progress, older)
        req = _request_row(req, status="sources_removed")
        _maybe_crash("sources_removed")
        status = req["status"]
    if status == "sources_removed":
        progress("forget: repairing the derived layers (the probes chosen beside it) ...")
        if search is None:  # (not started in the plan: a request resumed)
            search = _start_search(candidates, _table_paths(wh, "raw_records"), pool)
        probes, moved = _with_probes(candidates, search, lambda: _repair(
            wh, moved_doc.get("splits_before", {}), set(req["trajectory_keys"]), progress, curated=curated))
        kept = {k: v for k, v in orjson.loads(req["moved"] or "{}").items() if k != "splits_before"}
        salt = _salt(wh)
        chosen_fps = {"probe_fingerprints": sorted({fingerprint(p, salt) for p in probes})} if probes is not None else {}
        req = _save(wh, req, status="rebuilt", moved=orjson.dumps({**kept, "moved": moved}).decode(), **chosen_fps)
        _maybe_crash("rebuilt")
        status = req["status"]
    if status == "rebuilt":
        from trajwh.datacards.card import withdraw_card_copies, withdraw_cards
        from trajwh.lineage.exports import recorded, refresh

        refreshed = refresh(wh, req["trajectory_keys"], progress)
        refreshed += withdraw_cards(wh, keep={r["path"] for r in recorded(wh)})
        refreshed += withdraw_card_copies(wh.root)  # (in the Dagster runs' metadata, by earlier builds)
        kept = orjson.loads(req["moved"] or "{}")
        req = _save(wh, req, status="exports_refreshed", moved=orjson.dumps({**kept, "exports": refreshed}).decode())
        _maybe_crash("exports_refreshed")
        status = req["status"]
    if status == "exports_refreshed":
        progress("forget: caches removed, the catalog checkpointed")
        _compact(wh)
        req = _save(wh, req, status="compacted")
        _maybe_crash("compacted")
        status = req["status"]
    progress("forget: the proof: every file the warehouse holds searched for the probes ...")
    result = verify_request(wh, req, probes, pool=pool, stamps=stamps, keys=keys)
    req = _save(wh, req, status="verified" if result["ok"] else "verify_failed",
                verify_result=orjson.dumps(result).decode())
    doc = orjson.loads(req["moved"] or "{}")
    counts = {k: v for k, v in orjson.loads(req["counts"]).items() if not k.startswith("_")}
    return ForgetResult(req["request_id"], req["selector"], req["status"], counts, doc.get("moved", []), result,
                        resumed, doc.get("sources", {}), doc.get("exports", []))


def _save(wh: Warehouse, req: dict[str, Any], **changes: Any) -> dict[str, Any]:
    row = _request_row(req, **changes)
    with wh.write_session("forget") as session:
        session.upsert_rows("deletions", [row])
    return row


def _maybe_crash(stage: str) -> None:
    if os.environ.get(CRASH_ENV) == stage:
        os._exit(137)


@_lean
def verify_forget(wh: Warehouse, request_id: str) -> dict[str, Any]:
    """``trajwh verify-forget``: the proof again, later, from the tombstone alone (fingerprints)."""
    rows = wh.query("SELECT * FROM deletions WHERE starts_with(request_id, ?)", [request_id]).to_pylist()
    if len(rows) != 1:
        known = wh.query("SELECT request_id FROM deletions ORDER BY requested_at").column(0).to_pylist()
        raise ConfigError(f"{'no' if not rows else len(rows)} deletion request(s) match {request_id!r}",
                          valid=", ".join(known) or "no request has been made in this warehouse")
    return verify_request(wh, rows[0])
