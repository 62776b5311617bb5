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
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.rebuild import joined_by_key
from trajwh.lineage.storage import ensure_dir, write_bytes_atomic
from trajwh.packing.layer import _STEPS_SQL, _UNITS, tools_by_digest
from trajwh.packing.render import render, trained_text
from trajwh.packing.tokenizers import tokenizer_of

# one row per segment (its table entry, not its tokens), in trajectory-key order
_SEGMENTS_SQL = """
    SELECT p.pack_id, p.split AS pack_split, p.tokenizer_id, p.seq_len, t.s.fragment_id, t.s.start, t.s."end",
           t.s.trajectory_key, t.s.split, t.s.piece, t.s.removed_step_ids, t.s.token_key, u.step_ids, u.span_step_ids,
           u.kind AS unit_kind, u.split AS unit_split, sp.split AS episode_split, e.tool_schema_digest
    FROM packs p, unnest(p.segments) AS t(s)
    LEFT JOIN ({units}) u ON u.unit_id = split_part(t.s.fragment_id, '#', 1)
    LEFT JOIN splits sp ON sp.trajectory_key = t.s.trajectory_key
    LEFT JOIN redacted_episodes e ON e.trajectory_key = t.s.trajectory_key
    WHERE {where}
    ORDER BY t.s.trajectory_key, p.pack_id, t.s.start"""


def _digest(ids: Any, mask: Any) -> bytes:
    return hashlib.blake2b(np.asarray(ids, dtype="<i8").tobytes() + np.asarray(mask, dtype="<i1").tobytes(),
                           digest_size=16).digest()


def _structure(wh: Warehouse, where: str, params: list[str], files: list[str] | None = None) -> dict[str, int]:
    """Per pack: segments tile [0, n_tokens), lengths agree, one split (of the packs in ``files``
    when given: the others' bytes passed before); no segment of an episode the license policy or
    an opt-out keeps out of training (licenses.eligibility); counted violations."""
    if files is not None and not files:
        out = {"length_violations": 0, "mixed_split_violations": 0}
    else:
        out = _lengths(wh, where, params, files)
    (row,) = _bounded(wh, f"""
        SELECT count(*) AS n FROM (SELECT segments FROM packs p WHERE {where}) p, unnest(p.segments) AS t(s)
        JOIN eligibility g ON g.trajectory_key = t.s.trajectory_key WHERE g.train <> 'allow'""", params)
    out["not_eligible_violations"] = row["n"]
    return out


def _lengths(wh: Warehouse, where: str, params: list[str], files: list[str] | None) -> dict[str, int]:
    source, params = ("packs", params) if files is None else (_READ_FILES, [files, *params])
    # the token lists are measured per pack before the segments are unnested, and the queries run
    # within a bounded memory limit: grouped with the lists, the first took 12.8 GB at 107,000 episodes
    (out,) = _bounded(wh, f"""
        WITH pk AS (
            SELECT p.pack_id, p.split, p.n_tokens AS n, len(p.input_ids) AS n_ids, len(p.loss_mask) AS n_mask,
                   len(p.position_ids) AS n_pos, p.seq_len, p.segments FROM {source} p WHERE {where}),
        per AS (
            SELECT pk.pack_id, any_value(n) AS n, any_value(n_ids) AS n_ids, any_value(n_mask) AS n_mask,
                   any_value(n_pos) AS n_pos, any_value(seq_len) AS seq_len, sum(t.s."end" - t.s.start) AS covered,
                   count(DISTINCT t.s.split) + count(*) FILTER (WHERE t.s.split <> pk.split) AS seg_splits
            FROM pk, unnest(pk.segments) AS t(s) GROUP BY pk.pack_id)
        SELECT count(*) FILTER (WHERE n <> n_ids OR n <> n_mask OR n <> n_pos OR n > seq_len OR covered <> n)
                   AS length_violations,
               count(*) FILTER (WHERE seg_splits > 1) AS mixed_split_violations
        FROM per""", params)
    return out


#: some of a pack set's files, read directly (the ``packs`` view reads them all)
_READ_FILES = "read_parquet(?, union_by_name = true, filename = true)"


def _bounded(wh: Warehouse, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    """A small result of a query over the whole pack set, computed within 512 MB (spilling)."""
    return [r for batch in wh.stream(sql, params, memory_limit="512MB", threads=1) for r in batch]


def _sampled(unit_id: str, n: int) -> bool:
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


def _files_ledger_path(wh: Warehouse, pack_set: str) -> Path:
    return wh.root / "_cache" / LEDGER_DIR / f"{pack_set}{FILES_SUFFIX}"


def read_files_ledger(wh: Warehouse, pack_set: str) -> set[str]:
    """The sha256 of each pack file whose every pack a passing check verified (tokens, masks,
    positions, lengths, one split per pack); a lost or unreadable one only means reading again."""
    try:
        data = json.loads(_files_ledger_path(wh, pack_set).read_text())
        return set(data) if isinstance(data, list) else set()
    except (OSError, ValueError):
        return set()


def _write_files_ledger(wh: Warehouse, pack_set: str, shas: set[str]) -> None:
    path = _files_ledger_path(wh, pack_set)
    ensure_dir(path.parent, restricted=True)
    write_bytes_atomic(json.dumps(sorted(shas)).encode(), path, restricted=True)


def set_files(wh: Warehouse, pack_set: str) -> list[tuple[Path, str]]:
    """A pack set's files with the sha256 the manifest recorded for each (the packs build writes a
    set's files apart from every other set's)."""
    rows = wh.query("SELECT path, sha256 FROM table_files WHERE table_name = 'packs' AND contains(transform_version, ?) "
                    "ORDER BY path", [f"set={pack_set};"]).to_pylist()
    return [(wh.root / r["path"], r["sha256"]) for r in rows]


def _content_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def trusted_files(wh: Warehouse, pack_set: str) -> tuple[list[str], list[str]]:
    """(files a passing check verified whose bytes are still the bytes it verified, the others):
    a file is trusted by the sha256 of what it holds now, so a file changed in place is read again."""
    known = read_files_ledger(wh, pack_set)
    trusted, other = [], []
    for path, sha in set_files(wh, pack_set):
        (trusted if sha in known and _content_sha(path) == sha else other).append(str(path))
    return trusted, other


def read_ledger(wh: Warehouse, pack_set: str) -> dict[str, list[str]]:
    """Unit (or piece) -> [token key, digest of its stored tokens] that a passing check verified
    against its rendering; a lost or unreadable ledger only means rendering again."""
    try:
        data = json.loads(_ledger_path(wh, pack_set).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_ledger(wh: Warehouse, pack_set: str, entries: dict[str, list[str]]) -> None:
    path = _ledger_path(wh, pack_set)
    ensure_dir(path.parent, restricted=True)
    write_bytes_atomic(json.dumps(entries, sort_keys=True).encode(), path, restricted=True)


#: a pack set with at least this many sequences is verified in parts, one in this process and each
#: other one in a worker process (spawning one costs about 1.5 s; 1,000 sequences: about 8 M tokens)
PARALLEL_MIN_PACKS = 1_000
#: the DuckDB memory limit of each part's queries (two parts at once stay within the build's bound)
_PART_MEMORY = {1: "512MB"}
#: what a part holds beyond its process's libraries, at most (measured at 107,000 episodes with
#: every unit rendered: 667 MB for a part's process, 124 of them libraries)
PART_MB = 550


def verify_packs(wh: Warehouse, pack_set: str | None = None, *, scan_secrets: bool = True,
                 progress: Callable[[int], None] | None = None, examples: int = 5,
                 secret_sample: int = 1, ledger: bool = False, workers: int | None = None) -> dict[str, Any]:
    """Counts of segments checked and of each violation (all 0 when the set is sound), with examples.

    Every segment's tokens are checked against its rendering. ``secret_sample`` = N scans the
    decoded text of one unit in N for secret shapes (chosen by the unit id's digest, so the same
    units every time): the build's check samples, since the decoded text is proved equal to the
    rendering of the redacted layer, which its own check rescans; ``trajwh verify-packs`` scans all.

    ``ledger`` (the build's check, one pack set): a segment whose stored tokens are exactly those
    a passing check already verified for the same token key (what the rendering is made from,
    packing.windows) is not rendered again: an incremental build re-renders only what changed,
    and its check does too. Splits, structure and positions are still checked for every segment.
    After a passing check the ledger holds every segment of the set.

    The packs are verified in ``workers`` parts (by pack id; default: the machine's cores for a
    set of ``PARALLEL_MIN_PACKS`` sequences or more, else one part), the first in this process and
    each other one in a worker process reading the warehouse itself: the same counts as one part,
    on every core."""
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
    trusted, unread = trusted_files(wh, pack_set) if use_ledger else ([], None)
    out: dict[str, Any] = {"segments": 0, "tokens": 0, "packs": n_packs,
                           **_structure(wh, where, params, unread),
                           "round_trip_violations": 0, "trained_text_violations": 0, "position_violations": 0,
                           "split_violations": 0, "unknown_unit_violations": 0, "secret_violations": 0, "secret_scanned": 0,
                           "rendered": 0, "examples": []}
    n = workers if workers is not None else (
        parts_within(workers_wanted(), PART_MB) if n_packs >= PARALLEL_MIN_PACKS else 1)
    n = max(1, min(n, n_packs or 1))
    task = {"root": str(wh.root), "pack_set": pack_set, "scan_secrets": scan_secrets, "examples": examples,
            "secret_sample": secret_sample, "ledger": use_ledger, "parts": n, "trusted": trusted, "unread": unread}
    if n == 1:
        parts = [_verify_part({**task, "part": 0}, progress)]
    else:
        parts = run_parts(_verify_in_worker, [{**task, "part": i} for i in range(n)])
    verified: dict[str, list[str]] = {}
    for part in parts:
        verified.update(part.pop("verified"))
        out["examples"] += part.pop("examples")
        for k, v in part.items():
            out[k] += v
    out["examples"] = out["examples"][:examples]
    if progress and n > 1:
        progress(out["segments"])
    out["files_trusted"] = len(trusted)
    if use_ledger and violations(out) == 0:
        _write_ledger(wh, pack_set, verified)
        _write_files_ledger(wh, pack_set, {sha for _, sha in set_files(wh, pack_set)})
    return out


def _verify_in_worker(task: dict[str, Any]) -> dict[str, Any]:
    """One part verified (``verify_packs``), without progress (in a worker, or beside one)."""
    return _verify_part(task, None)


def _verify_part(task: dict[str, Any], progress: Callable[[int], None] | None) -> dict[str, Any]:
    """One part of a pack set (the packs whose id hashes to it) verified segment by segment: the
    counts, the first examples and the segments verified (for the ledger)."""
    from trajwh.redaction.engine import Detector

    wh, pack_set, n = Warehouse(task["root"]), task["pack_set"], task["parts"]
    where = ("p.pack_set = ?" if pack_set else "true") + (f" AND hash(p.pack_id) % {n} = {task['part']}" if n > 1 else "")
    params = [pack_set] if pack_set else []
    memory = _PART_MEMORY.get(n, "256MB")
    trusted = read_ledger(wh, pack_set) if task["ledger"] else {}
    out: dict[str, Any] = {"segments": 0, "tokens": 0, "round_trip_violations": 0, "trained_text_violations": 0,
                           "position_violations": 0, "split_violations": 0, "unknown_unit_violations": 0,
                           "secret_violations": 0, "secret_scanned": 0, "rendered": 0, "examples": []}

    def bad(kind: str, seg: dict[str, Any], why: str) -> None:
        out[kind] += 1
        if len(out["examples"]) < task["examples"]:
            out["examples"].append({"check": kind, "pack_id": seg["pack_id"], "fragment_id": seg["fragment_id"],
                                    "why": why})

    # 1. the packs as stored: each segment's tokens digested, positions checked; a segment whose
    # (token key, digest) the ledger holds needs no rendering
    stored: dict[tuple[str, int], bytes] = {}
    verified: dict[str, list[str]] = {}
    render_keys: set[str] = set()
    unread = task.get("unread")
    if task.get("trusted"):  # files verified before, bytes unchanged: their segments, not their tokens
        again = _trusted_segments(wh, task["trusted"], where, params, memory, trusted, verified, out)
        unread = [*(unread or []), *again]
    source, read_params = ("packs", params) if unread is None else (_READ_FILES, [unread, *params])
    batches = wh.stream(f"SELECT pack_id, input_ids, loss_mask, position_ids, segments FROM {source} p WHERE {where}",
                        read_params, batch_rows=64, memory_limit=memory, threads=1, arrow=True) if unread != [] else ()
    for rb in batches:
        lists = [rb.column(c) for c in ("input_ids", "loss_mask", "position_ids")]
        for i, (pack_id, segs) in enumerate(zip(rb.column("pack_id").to_pylist(), rb.column("segments").to_pylist(),
                                                strict=True)):
            tokens, mask, positions = (c[i].values.to_numpy(zero_copy_only=False) for c in lists)
            for seg in segs:
                a, b = seg["start"], seg["end"]
                out["tokens"] += b - a
                digest = stored[(pack_id, a)] = _digest(tokens[a:b], mask[a:b])
                entry = [seg.get("token_key") or "", digest.hex()]
                if seg.get("token_key") and trusted.get(seg["fragment_id"]) == entry:
                    verified[seg["fragment_id"]] = entry
                else:
                    render_keys.add(seg["trajectory_key"])
                if not np.array_equal(positions[a:b], np.arange(b - a)):
                    bad("position_violations", {**seg, "pack_id": pack_id}, "positions do not restart at 0 and count up")
    # 2. every segment's unit and split; the segments to render rendered again from the redacted
    # steps and compared with what is stored
    # no memo: each rendering is scanned once (a memo of them would only hold up to 64 M characters)
    detector = Detector(memo_chars=0) if task["scan_secrets"] else None
    secret_sample = task["secret_sample"]
    toks: dict[str, Any] = {}
    units = _UNITS.format(evaluation="true")
    tools_of = tools_by_digest(wh)
    seg_stream = wh.stream(_SEGMENTS_SQL.format(where=where, units=units), params, memory_limit=memory, threads=1)
    step_stream = wh.stream(_STEPS_SQL.format(units=units, dedup="list_contains(?, trajectory_key)"),
                            [sorted(render_keys)], memory_limit=memory, threads=1, batch_rows=1_000)
    try:
        for seg, steps in joined_by_key(seg_stream, step_stream):
            out["segments"] += 1
            if progress:
                progress(1)
            if not (seg["split"] == seg["pack_split"] == seg["episode_split"] == seg["unit_split"]):
                bad("split_violations", seg, f"segment {seg['split']}, pack {seg['pack_split']}, "
                    f"episode {seg['episode_split']}, unit {seg['unit_split']}")
            if seg["unit_kind"] is None:
                bad("unknown_unit_violations", seg, "no trainable fragment or evaluation episode of that id")
                continue
            if seg["fragment_id"] in verified:
                continue
            out["rendered"] += 1
            tok = toks.get(seg["tokenizer_id"]) or toks.setdefault(seg["tokenizer_id"], tokenizer_of(seg["tokenizer_id"]))
            if tok.id != seg["tokenizer_id"]:
                bad("round_trip_violations", seg, f"tokenizer {seg['tokenizer_id']} is not the installed {tok.id}")
                continue
            by_id = {s["step_id"]: s for s in steps}
            order = seg["step_ids"] if seg["step_ids"] is not None else [s["step_id"] for s in steps]
            removed = set(seg["removed_step_ids"] or [])
            kept = [by_id[i] for i in order if i in by_id and i not in removed]
            span = set(seg["span_step_ids"]) if seg["span_step_ids"] is not None else set(order)
            tools = tools_of.get(seg["tool_schema_digest"])
            r = render(kept, span, tok, tools=tools)
            have = stored.get((seg["pack_id"], seg["start"]))
            if seg["piece"] is not None:
                a = seg["piece"] * seg["seq_len"]
                want = _digest(r.ids[a:a + seg["seq_len"]], r.mask[a:a + seg["seq_len"]])
            else:
                want = _digest(r.ids, r.mask)
            if want != have:
                bad("round_trip_violations", seg, "tokens or mask differ from the unit's rendering")
            elif seg["token_key"]:
                verified[seg["fragment_id"]] = [seg["token_key"], have.hex()]
            if seg["piece"] is not None:  # a piece may end inside a character: not decoded alone
                continue
            if tok.decode(r.ids) != r.text:
                bad("round_trip_violations", seg, "decoded tokens differ from the rendered text")
            if tok.decode([t for t, m in zip(r.ids, r.mask, strict=True) if m]) != trained_text(kept, span, tok, tools):
                bad("trained_text_violations", seg, "trained tokens do not decode to the span's model text")
            if detector is not None and (secret_sample <= 1 or _sampled(seg["fragment_id"], secret_sample)):
                out["secret_scanned"] += 1
                found = detector.find(r.text)
                if found:
                    bad("secret_violations", seg, ", ".join(sorted({f"{f.entity} ({f.detector})" for f in found})))
    finally:
        seg_stream.close()
        step_stream.close()
    out["verified"] = verified
    return out


def _trusted_segments(wh: Warehouse, files: list[str], where: str, params: list[Any], memory: str,
                      trusted: dict[str, list[str]], verified: dict[str, list[str]], out: dict[str, Any]) -> list[str]:
    """The segments of trusted files (bytes a passing check verified): each one whose unit ledger
    entry has its token key is verified as it was; returns the files holding one that has not (read
    again token by token)."""
    found: dict[str, list[tuple[str, list[str], int]]] = {}
    again: set[str] = set()
    for rb in wh.stream(f"SELECT filename, segments FROM {_READ_FILES} p WHERE {where}", [files, *params],
                        batch_rows=1_000, memory_limit=memory, threads=1):
        for r in rb:
            mine = found.setdefault(r["filename"], [])
            for seg in r["segments"]:
                entry = trusted.get(seg["fragment_id"])
                if seg.get("token_key") and entry is not None and entry[0] == seg["token_key"]:
                    mine.append((seg["fragment_id"], entry, seg["end"] - seg["start"]))
                else:
                    again.add(r["filename"])
    for filename, segments in found.items():
        if filename not in again:
            for fragment_id, entry, n in segments:
                verified[fragment_id] = entry
                out["tokens"] += n
    return sorted(again)


def violations(result: dict[str, Any]) -> int:
    return sum(v for k, v in result.items() if k.endswith("_violations"))
