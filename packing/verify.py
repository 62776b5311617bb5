"""Verify a pack set against the layers it came from (asset checks, ``trajwh verify-packs``).

For every segment of every pack, streamed in trajectory-key order beside the redacted steps:

- round trip: the segment's tokens are the unit's rendering (its kept steps, through the
  template), token for token and mask for mask, and decoding them gives the rendered text
  exactly; decoding the trained tokens gives exactly the model-authored text of the span;
- splits: the segment's split is its pack's split and the episode's split now (``splits``), and
  a segment of the train split comes from a trainable fragment; no pack mixes splits;
- secrets: the redaction detector finds nothing in the decoded text of any segment;
- structure: positions restart at 0 per segment, segments tile the sequence, lengths agree.

Pieces of a split fragment (policy ``split``) are checked token for token against their slice
of the rendering (a piece may end inside a character, so it is not decoded alone).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash
from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.parallel import duckdb_memory, release_memory
from trajwh.lineage.rebuild import joined_by_key
from trajwh.lineage.storage import (
    content_sha256,
    data_root,
    ensure_dir,
    write_bytes_atomic,
)
from trajwh.packing.layer import _STEPS_SQL, _UNITS, tools_by_digest
from trajwh.packing.render import Layout, layout_digest, render, rendered_layout, trained_text
from trajwh.packing.tokenizers import Tokenizer, tokenizer_of

# the segments to render again as the token pass found them (their pack, place, unit, piece, cut
# steps, token key, tokenizer and length, as parallel lists), each with its unit's steps and span
# and its episode's tool definitions, in the order the steps stream comes: what rendering takes
# beside the steps
_RENDER_SQL = """
    SELECT r.*, u.step_ids, u.span_step_ids, u.kind AS unit_kind, e.tool_schema_digest
    FROM (SELECT unnest(?::VARCHAR[]) AS pack_id, unnest(?::VARCHAR[]) AS tokenizer_id, unnest(?::BIGINT[]) AS seq_len,
                 unnest(?::VARCHAR[]) AS fragment_id, unnest(?::BIGINT[]) AS start,
                 unnest(?::VARCHAR[]) AS trajectory_key, unnest(?::BIGINT[]) AS piece,
                 unnest(?::VARCHAR[][]) AS removed_step_ids, unnest(?::VARCHAR[]) AS token_key) r
    LEFT JOIN ({units}) u ON u.unit_id = split_part(r.fragment_id, '#', 1)
    LEFT JOIN redacted_episodes e ON e.trajectory_key = r.trajectory_key
    ORDER BY r.trajectory_key, r.pack_id, r.start"""
#: what the token pass keeps of a segment to render again (with its pack's tokenizer and length)
_RENDER_FIELDS = ("fragment_id", "start", "trajectory_key", "piece", "removed_step_ids", "token_key")
# every segment of the set beside its unit and its episode's split now: the split and unit checks
# as one aggregate (a join of table entries, never the tokens)
_SEGMENT_CHECKS_SQL = """
    WITH j AS (
        SELECT p.pack_id, p.split AS pack_split, t.s.fragment_id, t.s.split, u.kind AS unit_kind,
               u.split AS unit_split, sp.split AS episode_split, g.train AS eligible
        FROM (SELECT pack_id, split, segments FROM packs p WHERE {where}) p, unnest(p.segments) AS t(s)
        LEFT JOIN ({units}) u ON u.unit_id = split_part(t.s.fragment_id, '#', 1)
        LEFT JOIN splits sp ON sp.trajectory_key = t.s.trajectory_key
        LEFT JOIN eligibility g ON g.trajectory_key = t.s.trajectory_key),
    k AS (
        SELECT *, unit_kind IS NULL AS unknown,
               (split = pack_split AND split = episode_split AND split = unit_split) IS NOT TRUE AS mixed FROM j)
    SELECT count(*) AS segments, count(*) FILTER (WHERE unknown) AS unknown_unit_violations,
           count(*) FILTER (WHERE mixed) AS split_violations,
           count(*) FILTER (WHERE eligible <> 'allow') AS not_eligible_violations,
           (coalesce(list(struct_pack("check" := 'split_violations', pack_id, fragment_id,
                                      why := 'segment ' || coalesce(split, 'NULL') || ', pack ' || coalesce(pack_split, 'NULL')
                                             || ', episode ' || coalesce(episode_split, 'NULL') || ', unit '
                                             || coalesce(unit_split, 'NULL')) ORDER BY pack_id, fragment_id)
                          FILTER (WHERE mixed), [])
            || coalesce(list(struct_pack("check" := 'unknown_unit_violations', pack_id, fragment_id,
                                         why := 'no trainable fragment or evaluation episode of that id')
                             ORDER BY pack_id, fragment_id) FILTER (WHERE unknown), []))[1:{examples}] AS examples
    FROM k"""


def _digest(ids: Any, mask: Any) -> bytes:
    """A segment's tokens and loss mask (as little-endian int64 and int8) in 16 bytes (XXH3-128, a
    hash fixed by its specification: 14x blake2b's speed here, and a check digests every segment
    of the files it reads; the ledger only remembers what a passing check verified, so a digest
    never has to resist forgery); contiguous numpy arrays of those types are hashed where they lie."""
    h = xxhash.xxh3_128(np.ascontiguousarray(ids, dtype="<i8"))
    h.update(np.ascontiguousarray(mask, dtype="<i1"))
    return h.digest()


def _segment_checks(wh: Warehouse, where: str, params: list[str], examples: int) -> dict[str, Any]:
    """Every segment's split (its own, its pack's, its episode's now and its unit's agree), unit
    (a trainable fragment or an evaluation episode) and eligibility (no episode the license policy
    or an opt-out keeps out of training: licenses.eligibility), counted over the whole set in one
    query within a bounded memory."""
    units = _UNITS.format(evaluation="true")
    (row,) = _bounded(wh, _SEGMENT_CHECKS_SQL.format(where=where, units=units, examples=int(examples)), params)
    row["examples"] = [dict(e) for e in row["examples"] or []]
    return row


def _bounded(wh: Warehouse, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    """A small result of a query over the whole pack set, computed within 512 MB (spilling)."""
    return [r for batch in wh.stream(sql, params, memory_limit=duckdb_memory(512), threads=1) for r in batch]


def _sampled(unit_id: str, n: int) -> bool:
    """Whether the unit is one of the one in ``n`` sampled (every unit when ``n`` <= 1)."""
    if n <= 1:
        return True
    return int(hashlib.sha256(unit_id.encode()).hexdigest()[:8], 16) % n == 0


LEDGER_DIR = "verified_packs"
#: beside a set's unit ledger, the files its last passing check verified (``<set>.files.json``)
FILES_SUFFIX = ".files.json"


def _ledger_path(wh: Warehouse, pack_set: str) -> Path:
    return wh.root / "_cache" / LEDGER_DIR / f"{pack_set}.json"


def prune_ledgers(wh: Warehouse) -> int:
    """Keep in each ledger only the units its pack set still holds (a forget: the rebuild's
    passing check already left the forgotten units out; a failed or interrupted one may not have);
    a ledger of a set that is gone goes. Returns the entries removed."""
    folder = wh.root / "_cache" / LEDGER_DIR
    removed = 0
    for path in sorted(folder.glob(f"*{FILES_SUFFIX}")) if folder.is_dir() else []:
        pack_set = path.name.removesuffix(FILES_SUFFIX)
        held = {sha for _, sha in set_files(wh, pack_set)} if wh.files("packs") else set()
        kept_files = read_files_ledger(wh, pack_set) & held
        if kept_files:
            _write_files_ledger(wh, pack_set, kept_files)
        else:
            path.unlink(missing_ok=True)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if path.name.endswith(FILES_SUFFIX):
            continue
        entries = read_ledger(wh, path.stem)
        held = set(wh.query("SELECT DISTINCT t.s.fragment_id FROM packs p, unnest(p.segments) AS t(s) "
                            "WHERE p.pack_set = ?", [path.stem]).column(0).to_pylist()) if wh.files("packs") else set()
        kept = {k: v for k, v in entries.items() if k in held}
        removed += len(entries) - len(kept)
        if kept:
            _write_ledger(wh, path.stem, kept)
        else:
            path.unlink(missing_ok=True)
    return removed


def remove_ledgers(wh: Warehouse, pack_set: str) -> None:
    """Forget what the check verified of a set that is gone (its unit and file ledgers)."""
    _ledger_path(wh, pack_set).unlink(missing_ok=True)
    _files_ledger_path(wh, pack_set).unlink(missing_ok=True)


def _files_ledger_path(wh: Warehouse, pack_set: str) -> Path:
    return wh.root / "_cache" / LEDGER_DIR / f"{pack_set}{FILES_SUFFIX}"


def read_files_ledger(wh: Warehouse, pack_set: str) -> set[str]:
    """The sha256 of each pack file whose every pack a passing check verified (tokens, masks,
    positions, lengths, one split per pack); a lost or unreadable one only means reading again."""
    try:
        data = orjson.loads(_files_ledger_path(wh, pack_set).read_bytes())
        return set(data) if isinstance(data, list) else set()
    except (OSError, ValueError):
        return set()


def _write_files_ledger(wh: Warehouse, pack_set: str, shas: set[str]) -> None:
    path = _files_ledger_path(wh, pack_set)
    ensure_dir(path.parent, restricted=True)
    write_bytes_atomic(orjson.dumps(sorted(shas)), path, restricted=True)


def set_files(wh: Warehouse, pack_set: str) -> list[tuple[Path, str]]:
    """A pack set's files with the sha256 the manifest recorded for each (the packs build writes a
    set's files apart from every other set's)."""
    rows = wh.query("SELECT path, sha256 FROM table_files WHERE table_name = 'packs' AND contains(transform_version, ?) "
                    "ORDER BY path", [f"set={pack_set};"]).to_pylist()
    return [(wh.data / r["path"], r["sha256"]) for r in rows]


def trusted_files(wh: Warehouse, pack_set: str) -> tuple[list[str], list[str]]:
    """(files a passing check verified whose bytes are still the bytes it verified, the others):
    a file is trusted by the sha256 of what it holds now, so a file changed in place is read again."""
    known = read_files_ledger(wh, pack_set)
    trusted, other = [], []
    for path, sha in set_files(wh, pack_set):
        (trusted if sha in known and content_sha256(path) == sha else other).append(str(path))
    return trusted, other


def read_ledger(wh: Warehouse, pack_set: str) -> dict[str, list[str]]:
    """Unit (or piece) -> [token key, digest of its stored tokens] that a passing check verified
    against its rendering; a lost or unreadable ledger only means rendering again."""
    try:
        data = orjson.loads(_ledger_path(wh, pack_set).read_bytes())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_ledger(wh: Warehouse, pack_set: str, entries: dict[str, list[str]]) -> None:
    path = _ledger_path(wh, pack_set)
    ensure_dir(path.parent, restricted=True)
    # orjson: the ledger of a set at 107,000 episodes took 0.4 s with the json module
    write_bytes_atomic(orjson.dumps(entries, option=orjson.OPT_SORT_KEYS), path, restricted=True)


#: a pack set with at least this many sequences is verified in parts, one in this process and each
#: other one in a worker process (spawning one costs about 1.5 s; 1,000 sequences: about 8 M tokens)
PARALLEL_MIN_PACKS = 1_000
#: with the ledger (the build's check), parts only when this many segments are to be rendered again
#: (not in the ledger) or this many packs read token by token: at 107,000 + 1 % episodes an
#: incremental build's check rendered 498 segments and read 88 of 133 files (about 9,000 packs),
#: 4.2-4.6 s in one part and 5.1-5.5 s in two (the worker's start is most of the work then)
PARALLEL_MIN_RENDERS = 2_000
PARALLEL_MIN_READ = 20_000
#: the DuckDB memory of each part's queries by the number of parts, in MB at the default memory
#: budget (``duckdb_memory``): two parts at once stay within the build's bound
_PART_MEMORY = {1: 512}
#: at most this many segments to render: the check's queries run on two threads in one part
FEW_RENDERS = 5_000
#: what a part holds beyond its process's libraries, at most. Measured at 107,000 episodes with
#: every unit rendered, two parts: 797 MB for the build's process (about 157 of them libraries and
#: the catalog) and 775 for the worker, more than the 550 reckoned, so a full build's check went
#: past the memory bound (2,061 MB); with the render segments streamed and the files' read memory
#: given back before the renders, 709 and 708 MB
PART_MB = 560


def verify_packs(wh: Warehouse, pack_set: str | None = None, *, scan_secrets: bool = True,
                 progress: Callable[[int], None] | None = None, examples: int = 5,
                 secret_sample: int = 1, token_sample: int = 1, ledger: bool = False,
                 workers: int | None = None) -> dict[str, Any]:
    """Counts of segments checked and of each violation (all 0 when the set is sound), with examples.

    Every segment's tokens are checked against its rendering. ``token_sample`` = N encodes one unit
    in N again and compares token for token (by the unit id's digest); every other unit of a
    built-in tokenizer is checked by its layout (``render.Layout``): its tokens decode to exactly
    the rendering's bytes, hold the template's special tokens at the template's byte offsets and
    nowhere else, and set the mask on exactly the trained pieces' bytes. That is every property of
    the round trip but the merges the encoder chose inside a piece, at the cost of the template
    alone (encoding was 40 % of a whole check); the build's check samples, ``trajwh verify-packs``
    encodes every unit. ``secret_sample`` = N scans the
    decoded text of one unit in N for secret shapes (chosen by the unit id's digest, so the same
    units every time): the build's check samples, since the decoded text is proved equal to the
    rendering of the redacted layer, which its own check rescans; ``trajwh verify-packs`` scans all.

    ``ledger`` (the build's check, one pack set): a segment whose stored tokens are exactly those
    a passing check already verified for the same token key (what the rendering is made from,
    packing.windows) is not rendered again, and a file whose bytes a passing check verified is not
    read token by token again: an incremental build's check renders and reads only what changed.
    Splits, units and eligibility are checked for every segment (one query over the table
    entries). After a passing check the ledger holds every segment of the set.

    The files are read in ``workers`` parts (default: the machine's cores for a set of
    ``PARALLEL_MIN_PACKS`` sequences or more, else one part), the first in this process and each
    other one in a worker process reading the warehouse itself: the same counts as one part."""
    from trajwh.lineage.parallel import parts_within, run_parts, workers_wanted

    where = "p.pack_set = ?" if pack_set else "true"
    params = [pack_set] if pack_set else []
    n_packs = wh.query(f"SELECT count(*) FROM packs p WHERE {where}", params).column(0)[0].as_py()
    if pack_set and not n_packs:
        from trajwh.schemas.errors import ConfigError

        sets = wh.query("SELECT DISTINCT pack_set FROM packs ORDER BY 1").column(0).to_pylist()
        raise ConfigError(f"no pack set {pack_set!r} in {wh.root}", valid=", ".join(sets) or "none: run trajwh pack")
    use_ledger = ledger and pack_set is not None
    # files a passing check verified and that still hold the same bytes: their tokens are not read
    # again (only their segments' splits, units and eligibility, which other tables decide)
    if use_ledger:
        trusted, unread = trusted_files(wh, pack_set)
    else:
        trusted = []
        unread = [str(p) for p, _ in set_files(wh, pack_set)] if pack_set else [str(p) for p in wh.files("packs")]
    checks = _segment_checks(wh, where, params, examples)
    out: dict[str, Any] = {"segments": checks.pop("segments"), "tokens": 0, "packs": n_packs,
                           "length_violations": 0, "mixed_split_violations": 0, "round_trip_violations": 0,
                           "trained_text_violations": 0, "position_violations": 0, "secret_violations": 0,
                           "secret_scanned": 0, "rendered": 0, "encoded": 0, **checks}
    n = workers if workers is not None else (
        parts_within(workers_wanted(), PART_MB) if _parallel_work(wh, pack_set, n_packs, out["segments"], unread,
                                                                 use_ledger) else 1)
    n = max(1, min(n, len(trusted) + len(unread)))
    task = {"root": str(wh.root), "pack_set": pack_set, "scan_secrets": scan_secrets, "examples": examples,
            "secret_sample": secret_sample, "token_sample": token_sample, "ledger": use_ledger, "parts": n}
    shares = _deal(trusted, unread, n)
    if n == 1:
        parts = [_verify_part({**task, **shares[0]}, progress)]
    else:
        parts = run_parts(_verify_in_worker, [{**task, **share} for share in shares])
        if progress:
            progress(out["segments"])
    verified: dict[str, list[str]] = {}
    for part in parts:
        verified.update(part.pop("verified"))
        out["examples"] += part.pop("examples")
        for k, v in part.items():
            out[k] += v
    out["examples"] = out["examples"][:examples]
    out["files_trusted"] = len(trusted)
    if use_ledger and violations(out) == 0:
        _write_ledger(wh, pack_set, verified)
        _write_files_ledger(wh, pack_set, {sha for _, sha in set_files(wh, pack_set)})
    return out


def _parallel_work(wh: Warehouse, pack_set: str | None, n_packs: int, n_segments: int, unread: list[str],
                   use_ledger: bool) -> bool:
    """Whether a check is worth parts: ``PARALLEL_MIN_PACKS`` packs or more and, with the ledger,
    enough segments to render again or packs to read token by token."""
    if n_packs < PARALLEL_MIN_PACKS:
        return False
    if not use_ledger or pack_set is None:
        return True
    renders = n_segments - len(read_ledger(wh, pack_set))
    rows = {str(wh.data / r["path"]): r["rows"] for r in wh.query(
        "SELECT path, rows FROM table_files WHERE table_name = 'packs' AND contains(transform_version, ?)",
        [f"set={pack_set};"]).to_pylist()}
    return renders >= PARALLEL_MIN_RENDERS or sum(rows.get(p, 0) for p in unread) >= PARALLEL_MIN_READ


def _deal(trusted: list[str], unread: list[str], n: int) -> list[dict[str, list[str]]]:
    """The files dealt out to ``n`` parts, the largest first to the part holding the fewest bytes
    to read token by token (a trusted file's segment table is a small read)."""
    shares: list[dict[str, list[str]]] = [{"trusted": [], "unread": []} for _ in range(n)]
    for i, path in enumerate(sorted(trusted)):
        shares[i % n]["trusted"].append(path)
    load = [0] * n
    for size, path in sorted(((data_root(p).stat().st_size, p) for p in unread), reverse=True):
        i = load.index(min(load))
        shares[i]["unread"].append(path)
        load[i] += size
    return shares


def _verify_in_worker(task: dict[str, Any]) -> dict[str, Any]:
    """One part verified (``verify_packs``), without progress (in a worker, or beside one)."""
    return _verify_part(task, None)


#: what the token pass reads of a pack file
_TOKEN_COLUMNS = ["pack_id", "pack_set", "split", "seq_len", "n_tokens", "input_ids", "loss_mask", "position_ids",
                  "segments", "tokenizer_id"]


def _verify_part(task: dict[str, Any], progress: Callable[[int], None] | None) -> dict[str, Any]:
    """One part of a pack set (its share of the files) verified: the counts, the first examples and
    the segments verified (for the ledger)."""
    from trajwh.redaction.engine import Detector

    wh, pack_set = Warehouse(task["root"]), task["pack_set"]
    memory = duckdb_memory(_PART_MEMORY.get(task["parts"], 256))
    ledger = read_ledger(wh, pack_set) if task["ledger"] else {}
    out: dict[str, Any] = {"tokens": 0, "length_violations": 0, "mixed_split_violations": 0,
                           "round_trip_violations": 0, "trained_text_violations": 0, "position_violations": 0,
                           "secret_violations": 0, "secret_scanned": 0, "rendered": 0, "encoded": 0, "examples": []}

    def bad(kind: str, seg: dict[str, Any], why: str) -> None:
        out[kind] += 1
        if len(out["examples"]) < task["examples"]:
            out["examples"].append({"check": kind, "pack_id": seg["pack_id"], "fragment_id": seg["fragment_id"],
                                    "why": why})

    # 1. the packs as stored, file by file: lengths, tiling, one split per pack, positions; each
    # segment's tokens digested, and a segment whose (token key, digest) the ledger holds needs no
    # rendering
    verified: dict[str, list[str]] = {}
    unread = list(task["unread"])
    if task["trusted"]:  # files verified before, bytes unchanged: their segments, not their tokens
        unread += _trusted_segments(task["trusted"], pack_set, ledger, verified, out)
    stored: dict[tuple[str, int], bytes] = {}
    layouts_of: dict[tuple[str, int], bytes] = {}
    render_segs: list[dict[str, Any]] = []  # the segments to render, as the files hold them
    toks: dict[str, Any] = {}
    for path in unread:
        for rb in _set_batches(path, pack_set, _TOKEN_COLUMNS, 64):
            n = _token_pass(rb, ledger, stored, verified, out, bad, toks, layouts_of, render_segs)
            if progress and n:
                progress(n)
    release_memory()  # what reading the files took (Arrow's pool, freed batches) goes back before the renders
    # 2. the segments to render rendered again from the redacted steps and compared with what is stored
    # no memo: each rendering is scanned once (a memo of them would only hold up to 64 M characters)
    detector = Detector(memo_chars=0) if task["scan_secrets"] else None
    secret_sample, token_sample = task["secret_sample"], task["token_sample"]
    units = _UNITS.format(evaluation="true")
    render_keys = sorted({seg["trajectory_key"] for seg in render_segs})
    tools_of = tools_by_digest(wh) if render_segs else {}
    # a check in one part with few segments to render (an incremental build's) has the cores to itself
    # and a small sort: its queries scan on two threads (the steps of 498 segments after a scan of all
    # 2.3 M steps at 107,000 episodes: 1.0 -> 0.55 s); a whole set's sort keeps one thread's memory
    threads = 2 if task["parts"] == 1 and len(render_segs) <= FEW_RENDERS else 1
    step_stream = wh.stream(_STEPS_SQL.format(units=units, dedup="list_contains(?, trajectory_key)"),
                            [render_keys], memory_limit=memory, threads=threads,
                            batch_rows=1_000) if render_segs else iter(())
    seg_stream = (_render_segments(wh, render_segs, units, memory=memory, threads=threads) if render_segs
                  else iter(()))
    try:
        for seg, steps in joined_by_key(seg_stream, step_stream):
            if seg["unit_kind"] is None:  # counted by the segment checks
                continue
            out["rendered"] += 1
            tok = _tokenizer(toks, seg["tokenizer_id"]) or tokenizer_of(seg["tokenizer_id"])  # (raises: not installed)
            if tok.id != seg["tokenizer_id"]:
                bad("round_trip_violations", seg, f"tokenizer {seg['tokenizer_id']} is not the installed {tok.id}")
                continue
            by_id = {s["step_id"]: s for s in steps}
            order = seg["step_ids"] if seg["step_ids"] is not None else [s["step_id"] for s in steps]
            removed = set(seg["removed_step_ids"] or [])
            kept = [by_id[i] for i in order if i in by_id and i not in removed]
            span = set(seg["span_step_ids"]) if seg["span_step_ids"] is not None else set(order)
            tools = tools_of.get(seg["tool_schema_digest"])
            key = (seg["pack_id"], seg["start"])
            have, layout = stored.get(key), layouts_of.get(key)
            if layout is not None and seg["piece"] is None and not _sampled(seg["fragment_id"], token_sample):
                # the layout only: the stored tokens decode to the rendering's bytes with its
                # control tokens at its places and its mask (the merges inside a piece are the
                # encoder's, checked by the token sample)
                r = render(kept, span, Layout(tok), tools=tools)
                if rendered_layout(r, tok) != layout:
                    bad("round_trip_violations", seg,
                        "decoded text, special tokens or loss mask differ from the unit's rendering")
                elif seg["token_key"]:
                    verified[seg["fragment_id"]] = [seg["token_key"], have.hex()]
                if "".join(p for p, t in zip(r.pieces, r.trained_pieces, strict=True) if t) != trained_text(
                        kept, span, tok, tools):
                    bad("trained_text_violations", seg, "trained tokens do not decode to the span's model text")
            else:
                out["encoded"] += 1
                r = render(kept, span, tok, tools=tools)
                ids = np.fromiter(r.ids, dtype=np.int64, count=len(r.ids))
                mask = np.fromiter(r.mask, dtype=np.int8, count=len(r.mask))
                if seg["piece"] is not None:
                    a = seg["piece"] * seg["seq_len"]
                    want = _digest(ids[a:a + seg["seq_len"]], mask[a:a + seg["seq_len"]])
                else:
                    want = _digest(ids, mask)
                if want != have:
                    bad("round_trip_violations", seg, "tokens or mask differ from the unit's rendering")
                elif seg["token_key"]:
                    verified[seg["fragment_id"]] = [seg["token_key"], have.hex()]
                if seg["piece"] is not None:  # a piece may end inside a character: not decoded alone
                    continue
                if tok.decode(r.ids) != r.text:
                    bad("round_trip_violations", seg, "decoded tokens differ from the rendered text")
                if tok.decode(_trained(r.ids, mask)) != trained_text(kept, span, tok, tools):
                    bad("trained_text_violations", seg, "trained tokens do not decode to the span's model text")
            if detector is not None and _sampled(seg["fragment_id"], secret_sample):
                out["secret_scanned"] += 1
                found = detector.find(r.text)
                if found:
                    bad("secret_violations", seg, ", ".join(sorted({f"{f.entity} ({f.detector})" for f in found})))
    finally:
        for stream in (seg_stream, step_stream):
            if hasattr(stream, "close"):
                stream.close()
    out["verified"] = verified
    return out


#: the columns of ``_RENDER_SQL``'s parallel lists, in its order
_RENDER_COLUMNS = ("pack_id", "tokenizer_id", "seq_len", *_RENDER_FIELDS)


def _render_segments(wh: Warehouse, segs: list[dict[str, Any]], units: str, *, memory: str,
                     threads: int) -> Iterator[list[dict[str, Any]]]:
    """The segments the token pass found to render again, streamed in batches with their units'
    steps and spans and their episodes' tool definitions (None where the segment names no unit: the
    segment checks count it), in trajectory-key order: as the steps stream comes. The segments come
    from the token pass, not a second read of the files' segment tables (0.6 s of an incremental
    build's check at 107,000 + 1 %); ``segs`` is emptied, since the stream holds them. Streamed, not
    fetched whole: a whole set's 49,520 segments with their step lists took 353 MB at 107,000
    episodes, in each part at once."""
    params = [[s[c] for s in segs] for c in _RENDER_COLUMNS]
    segs.clear()
    return wh.stream(_RENDER_SQL.format(units=units), params, batch_rows=1_000, memory_limit=memory,
                     threads=threads)


def _trained(ids: list[int], mask: np.ndarray) -> list[int]:
    """The tokens whose mask is set, in order: the runs of the mask sliced out of ``ids`` (a
    filter token by token took 13 of the 185 s of a whole check at 107,000 episodes)."""
    if len(ids) != len(mask):
        raise ValueError(f"{len(ids)} tokens but {len(mask)} mask values")
    edges = np.flatnonzero(np.diff(mask != 0, prepend=False, append=False)).tolist()
    out: list[int] = []
    for a, b in zip(edges[::2], edges[1::2], strict=True):
        out += ids[a:b]
    return out


def _set_batches(path: str, pack_set: str | None, columns: list[str], size: int) -> Iterator[pa.RecordBatch]:
    """A pack file's record batches (``columns``, which hold ``pack_set``), only the set's packs."""
    for rb in pq.ParquetFile(path).iter_batches(batch_size=size, columns=columns):
        if pack_set and not pc.all(pc.equal(rb.column("pack_set"), pack_set)).as_py():  # a set's files are its own
            rb = rb.filter(pc.equal(rb.column("pack_set"), pack_set))
        yield rb


def _token_keys(flat: pa.StructArray) -> list[str | None]:
    """Each segment's token key (none in files written before segments carried one)."""
    names = {f.name for f in flat.type}
    return flat.field("token_key").to_pylist() if "token_key" in names else [None] * len(flat)


def _ints(array: pa.Array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _token_pass(rb: pa.RecordBatch, ledger: dict[str, list[str]], stored: dict[tuple[str, int], bytes],
                verified: dict[str, list[str]], out: dict[str, Any],
                bad: Callable[[str, dict[str, Any], str], None], toks: dict[str, Any],
                layouts_of: dict[tuple[str, int], bytes], render_segs: list[dict[str, Any]]) -> int:
    """One batch of packs as stored, checked with array operations: per pack, the lengths agree
    (tokens, mask, positions, ``n_tokens`` <= ``seq_len``) and the segments tile [0, n_tokens)
    (the first starts at 0, each next where the previous ended, together covering every token) and
    share the pack's split; per segment, positions restart at 0 and count up. Each segment's
    tokens and mask are digested into ``stored``; one whose (token key, digest) the ledger holds is
    ``verified``, the others go to ``render_segs`` (as stored), with their layout in ``layouts_of`` when their
    tokenizer is a built-in one (``toks``: the tokenizers by id, loaded once). Returns the segments
    seen."""
    n = rb.num_rows
    if not n:
        return 0
    segs = rb.column("segments")
    flat = segs.flatten()
    parent = pc.list_parent_indices(segs).to_numpy(zero_copy_only=False).astype(np.int64)
    start, end = _ints(flat.field("start")), _ints(flat.field("end"))
    fragment_ids = flat.field("fragment_id").to_pylist()
    token_keys = _token_keys(flat)
    pack_ids = rb.column("pack_id").to_pylist()
    lists = {c: rb.column(c) for c in ("input_ids", "loss_mask", "position_ids")}
    lens = {c: _ints(pc.list_value_length(a)) for c, a in lists.items()}
    n_tokens, seq_len = _ints(rb.column("n_tokens")), _ints(rb.column("seq_len"))
    # per pack: lengths and tiling
    covered = np.bincount(parent, weights=end - start, minlength=n).astype(np.int64)
    first = np.ones(len(parent), dtype=bool)
    first[1:] = parent[1:] != parent[:-1]
    prev_end = np.zeros_like(end)
    prev_end[1:] = end[:-1]
    prev_end[first] = 0
    gaps = np.bincount(parent[start != prev_end], minlength=n)
    wrong = ((n_tokens != lens["input_ids"]) | (n_tokens != lens["loss_mask"]) | (n_tokens != lens["position_ids"])
             | (n_tokens > seq_len) | (covered != n_tokens) | (gaps > 0))
    for i in np.flatnonzero(wrong):
        bad("length_violations", {"pack_id": pack_ids[i], "fragment_id": ""},
            f"{n_tokens[i]} tokens of at most {seq_len[i]}; ids, mask, positions {lens['input_ids'][i]}, "
            f"{lens['loss_mask'][i]}, {lens['position_ids'][i]}; segments cover {covered[i]}, "
            f"{'with' if gaps[i] else 'without'} a gap or overlap")
    other = pc.fill_null(pc.not_equal(flat.field("split"), pc.take(rb.column("split"), pa.array(parent))), True)
    other = other.to_numpy(zero_copy_only=False).astype(bool)
    out["mixed_split_violations"] += int(np.unique(parent[other]).size)
    # per segment: positions (a slice outside its pack's list is a violation), then digests
    values = {c: a.flatten().to_numpy(zero_copy_only=False) for c, a in lists.items()}
    base = {c: np.concatenate([[0], np.cumsum(lens[c])]) for c in lists}
    size = lens["position_ids"][parent]
    a = np.clip(start, 0, size)
    b = np.clip(end, a, size)
    span = b - a
    rel = np.arange(span.sum()) - np.repeat(np.cumsum(span) - span, span)
    got = values["position_ids"][np.repeat(base["position_ids"][parent] + a, span) + rel]
    off = np.bincount(np.repeat(np.arange(len(parent)), span)[got != rel], minlength=len(parent))
    moved = (off > 0) | (a != start) | (b != end)
    ids = np.ascontiguousarray(values["input_ids"], dtype="<i8")
    mask = np.ascontiguousarray(values["loss_mask"], dtype="<i1")
    tokenizer_ids = rb.column("tokenizer_id").to_pylist()
    aligned = bool((lens["input_ids"] == lens["loss_mask"]).all())  # else every digest differs anyway
    layouts: dict[str, _TokenLayouts | None] = {}
    rendering: list[int] = []
    for k, i in enumerate(parent.tolist()):
        s, e = int(start[k]), int(end[k])
        pack = pack_ids[i]
        out["tokens"] += e - s
        if moved[k]:
            bad("position_violations", {"pack_id": pack, "fragment_id": fragment_ids[k]},
                "positions do not restart at 0 and count up")
        lo, hi = max(s, 0), max(e, 0)
        i0, m0 = base["input_ids"][i], base["loss_mask"][i]
        digest = stored[(pack, s)] = _digest(ids[i0 + min(lo, lens["input_ids"][i]):i0 + min(hi, lens["input_ids"][i])],
                                             mask[m0 + min(lo, lens["loss_mask"][i]):m0 + min(hi, lens["loss_mask"][i])])
        entry = [token_keys[k] or "", digest.hex()]
        if token_keys[k] and ledger.get(fragment_ids[k]) == entry:
            verified[fragment_ids[k]] = entry
            continue
        rendering.append(k)
        tid = tokenizer_ids[i]
        if aligned and tid not in layouts:
            tok = _tokenizer(toks, tid)
            layouts[tid] = (_TokenLayouts(ids, mask, tok) if isinstance(tok, Tokenizer) and tok.id == tid
                            and tok.chat_template is None else None)
        layout = layouts.get(tid)
        if layout is not None:
            g0 = i0 + min(lo, lens["input_ids"][i])
            layouts_of[(pack, s)] = layout.digest(g0, max(g0, i0 + min(hi, lens["input_ids"][i])))
    if rendering:
        names = {f.name for f in flat.type}
        picked = flat.take(pa.array(rendering))
        fields = {f: (picked.field(f).to_pylist() if f in names else [None] * len(rendering)) for f in _RENDER_FIELDS}
        for j, k in enumerate(rendering):
            i = int(parent[k])
            render_segs.append({"pack_id": pack_ids[i], "tokenizer_id": tokenizer_ids[i], "seq_len": int(seq_len[i]),
                                **{f: fields[f][j] for f in _RENDER_FIELDS}})
    return len(parent)


def _tokenizer(toks: dict[str, Any], tokenizer_id: str) -> Any:
    """The installed tokenizer of that name, loaded once per part (None where there is none: the
    rendering step reports it)."""
    from trajwh.schemas.errors import ConfigError

    if tokenizer_id not in toks:
        try:
            toks[tokenizer_id] = tokenizer_of(tokenizer_id)
        except ConfigError:
            return None
    return toks[tokenizer_id]


class _TokenLayouts:
    """The layouts (``render.layout_digest``) of runs of the stored tokens of one record batch: the
    byte offsets of its tokens, its special tokens and the places its loss mask changes, computed
    once for the batch; a run's layout slices them."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray, tok: Tokenizer) -> None:
        lengths = tok.token_lengths
        valid = (ids >= 0) & (ids < len(lengths))
        known = np.where(valid, ids, 0)
        size = lengths[known]
        self.invalid = np.flatnonzero(~valid | (size <= 0))
        self.at = np.concatenate([[0], np.cumsum(size)])
        self.special = np.flatnonzero(tok.special_ids[known] & valid)
        self.change = np.flatnonzero(mask[1:] != mask[:-1]) + 1
        self.ids, self.mask, self.tok = ids, mask, tok

    def digest(self, g0: int, g1: int) -> bytes:
        """The layout of tokens ``[g0, g1)`` (of ids no tokenizer holds: a digest no rendering has)."""
        if np.searchsorted(self.invalid, g0) != np.searchsorted(self.invalid, g1):
            return b"invalid token ids"
        text = self.tok.encoding.decode_bytes(self.ids[g0:g1].tolist())
        sp = self.special[np.searchsorted(self.special, g0):np.searchsorted(self.special, g1)]
        inner = self.change[np.searchsorted(self.change, g0, side="right"):np.searchsorted(self.change, g1)]
        runs = np.concatenate([[g0], inner]) if g1 > g0 else inner
        base = self.at[g0]
        return layout_digest(text, self.ids[sp], self.at[sp] - base, self.at[runs] - base, self.mask[runs])


def _trusted_segments(files: list[str], pack_set: str | None, trusted: dict[str, list[str]],
                      verified: dict[str, list[str]], out: dict[str, Any]) -> list[str]:
    """The segments of trusted files (bytes a passing check verified), read with the same pyarrow
    reader as the token pass but without the tokens: each one whose unit ledger entry has its token
    key is verified as it was; returns the files holding one that has not (read again token by
    token)."""
    again: list[str] = []
    for path in files:
        mine: list[tuple[str, list[str], int]] = []
        for rb in _set_batches(path, pack_set, ["pack_set", "segments"], 1_000):
            flat = rb.column("segments").flatten()
            token_keys = _token_keys(flat)
            lengths = (_ints(flat.field("end")) - _ints(flat.field("start"))).tolist()
            for fragment_id, token_key, n in zip(flat.field("fragment_id").to_pylist(), token_keys, lengths, strict=True):
                entry = trusted.get(fragment_id)
                if not token_key or entry is None or entry[0] != token_key:
                    break
                mine.append((fragment_id, entry, n))
            else:
                continue
            again.append(path)
            break
        else:
            for fragment_id, entry, n in mine:
                verified[fragment_id] = entry
                out["tokens"] += n
    return sorted(again)


def violations(result: dict[str, Any]) -> int:
    return sum(v for k, v in result.items() if k.endswith("_violations"))
