"""What the tool wrote out of the warehouse, so a deletion can reach it (docs/forget.md).

Every export the tool writes (`trajwh export` JSONL and Hugging Face Parquet, `export-packs`,
`card --out`, `sql --out`) runs through ``run_export``, which records it in the catalog table
``exports``: where it went (absolute path; a later export to the same path replaces the record),
the parameters that made it (enough to make it again), when, and which episodes it holds
(``trajectory_keys``; none recorded for a data card or a query result, which may hold any).

A forget then lists the exports that hold a forgotten episode (``affected``) and writes each one
again from the warehouse without it (``refresh``): the same parameters, the same path. An export
that is no longer where it was written is listed as ``missing`` (the tool cannot reach its bytes);
one that cannot be written again (its filter no longer matches, its pack set is gone) is listed
as ``stale``. The proof scans every recorded export that still exists (``paths``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson
from trajwh.lineage.catalog import Warehouse, json_text, now_utc
from trajwh.lineage.storage import data_root, is_uri, location_exists, publish
from trajwh.schemas import ids
from trajwh.schemas.errors import ConfigError

KINDS = ("episodes", "hf", "packs", "card", "sql")


def run_export(wh: Warehouse, kind: str, params: dict[str, Any], *,
               progress: Callable[[int], None] | None = None, status: str = "current") -> Any:
    """Write one export (``params`` as the exporter takes them, ``out`` among them) and record
    it; returns the exporter's own summary."""
    if kind not in _RUNNERS:
        raise ConfigError(f"unknown export kind {kind!r}", valid=", ".join(KINDS))
    params = dict(params)  # a runner may pin what it resolved (the pack set), so the export is made again the same way
    if is_uri(params["out"]):
        result, members = _to_object_storage(wh, kind, params, progress)
        path = str(data_root(params["out"]))
    else:
        result, members = _RUNNERS[kind](wh, params, progress)
        path = os.path.abspath(params["out"])
    now = now_utc()
    row = {"export_id": "exp-" + ids.digest([path, now.isoformat()])[:16], "kind": kind, "path": path,
           "params": json_text(params), "created_at": now, "status": status, "note": None,
           "n_episodes": None if members is None else len(members),
           "trajectory_keys": None if members is None else sorted(members)}
    with wh.write_session("export") as session:
        session.upsert_rows("exports", [row])
    return result


#: exports written as a folder (the others are one file)
_FOLDERS = ("hf", "packs", "card")


def _to_object_storage(wh: Warehouse, kind: str, params: dict[str, Any],
                       progress: Callable[[int], None] | None) -> tuple[Any, set[str] | None]:
    """An export to ``s3://bucket/prefix``: written by its exporter into a private local folder,
    then uploaded (``lineage.storage.publish``: the manifest last, what an earlier export left
    under the prefix removed after). A folder export to a prefix that holds objects needs
    ``overwrite``, as a local folder that is not empty does."""
    import tempfile

    target = data_root(params["out"])
    folder = kind in _FOLDERS
    if folder and kind != "card" and not params.get("overwrite") and location_exists(str(target)):
        raise ConfigError(f"{target} holds objects already", valid="an empty or new prefix, or --overwrite")
    with tempfile.TemporaryDirectory(prefix="trajwh-export-") as tmp:
        staged = os.path.join(tmp, target.name or "export")
        result, members = _RUNNERS[kind](wh, {**params, "out": staged}, progress)
        publish(Path(staged), target, folder=folder)
    return result, members


def recorded(wh: Warehouse) -> list[dict[str, Any]]:
    if not wh.exists() or not wh.query("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'exports'").column(0)[0].as_py():
        return []  # no warehouse, or a catalog from before the registry (no writer has opened it since)
    return wh.query("SELECT * FROM exports ORDER BY created_at").to_pylist()


def affected(wh: Warehouse, keys: Iterable[str]) -> list[dict[str, Any]]:
    """The recorded exports that hold one of ``keys`` (or may: a card, a query result), with
    whether their files are still where they were written."""
    keys = set(keys)
    out = []
    for r in recorded(wh):
        holds = r["trajectory_keys"] is None or bool(keys.intersection(r["trajectory_keys"]))
        if holds and r["status"] != "missing":
            out.append({"export_id": r["export_id"], "kind": r["kind"], "path": r["path"],
                        "episodes": None if r["trajectory_keys"] is None else len(keys.intersection(r["trajectory_keys"])),
                        "exists": location_exists(r["path"])})
    return out


def refresh(wh: Warehouse, keys: Iterable[str], progress: Callable[[str], None] = lambda m: None) -> list[dict[str, Any]]:
    """Write every affected export again from the warehouse as it is now (after a forget's
    rebuild); returns one entry per export: ``regenerated``, ``missing`` or ``stale`` (why)."""
    rows = {r["path"]: r for r in recorded(wh)}
    done = []
    for a in affected(wh, keys):
        r = rows[a["path"]]
        params = {**orjson.loads(r["params"]), "overwrite": True}
        entry = {"export_id": r["export_id"], "kind": r["kind"], "path": r["path"]}
        if not a["exists"]:
            entry.update(status="missing", note="not found where it was written: the tool cannot reach it")
            _mark(wh, r, "missing", entry["note"])
        else:
            progress(f"forget: writing {r['kind']} export {r['path']} again")
            try:
                run_export(wh, r["kind"], params, status="regenerated")
                entry["status"] = "regenerated"
            except Exception as exc:  # noqa: BLE001 (listed, and the proof then names its files)
                entry.update(status="stale", note=f"{type(exc).__name__}: {exc}"[:500])
                _mark(wh, r, "stale", entry["note"])
        done.append(entry)
    return done


def paths(wh: Warehouse) -> list[str]:
    """Recorded exports outside the warehouse folder that still exist (the proof scans them)."""
    root = str(wh.root.resolve())
    return [r["path"] for r in recorded(wh) if location_exists(r["path"])
            and (is_uri(r["path"]) or os.path.commonpath([root, os.path.realpath(r["path"])]) != root)]


def _mark(wh: Warehouse, row: dict[str, Any], status: str, note: str) -> None:
    with wh.write_session("export") as session:
        session.upsert_rows("exports", [{**row, "status": status, "note": note}])


# --- the exporters, as a recorded export runs them ------------------------------------------------


def _episodes(wh: Warehouse, p: dict[str, Any], progress: Any) -> tuple[Any, set[str] | None]:
    from trajwh.ingest.export import export_episodes

    members: set[str] = set()
    n = export_episodes(wh, p["fmt"], p["out"], layer=p.get("layer", "redacted"), where=p.get("where"),
                        progress=progress, eligible_only=p.get("eligible_only", False),
                        policy_digest=_policy_digest(wh, p), members=members)
    return n, members


def _hf(wh: Warehouse, p: dict[str, Any], progress: Any) -> tuple[Any, set[str] | None]:
    from trajwh.packing.hf_export import export_hf

    s = export_hf(wh, p["out"], unit=p.get("unit", "episodes"), splits=tuple(p.get("splits") or ("train", "valid", "test")),
                  where=p.get("where"), eligible_only=p.get("eligible_only", False), policy_digest=_policy_digest(wh, p),
                  overwrite=p.get("overwrite", False), progress=progress)
    return s, set(s.keys)


def _packs(wh: Warehouse, p: dict[str, Any], progress: Any) -> tuple[Any, set[str] | None]:
    from trajwh.packing.export import export_packs

    s = export_packs(wh, split=p["split"], fmt=p.get("fmt", "parquet"), out=p["out"], pack_set=p.get("pack_set"),
                     overwrite=p.get("overwrite", False), progress=progress)
    p["pack_set"] = s.pack_set
    keys = wh.query("""SELECT DISTINCT t.s.trajectory_key FROM packs p, unnest(p.segments) AS t(s)
                       WHERE p.pack_set = ? AND p.split = ?""", [s.pack_set, p["split"]]).column(0).to_pylist()
    return s, set(keys)


def _card(wh: Warehouse, p: dict[str, Any], progress: Any) -> tuple[Any, set[str] | None]:
    from trajwh.datacards.card import build_card

    return build_card(wh, p["out"], split=p.get("split"), force=True), None


def _sql(wh: Warehouse, p: dict[str, Any], progress: Any) -> tuple[Any, set[str] | None]:
    return wh.user_query(p["query"], restricted=p.get("restricted", False), out=p["out"], fmt=p["fmt"]), None


def _policy_digest(wh: Warehouse, p: dict[str, Any]) -> str:
    from trajwh.pipelines.settings import license_policy
    from trajwh.schemas.config import load_settings

    return license_policy(load_settings(p.get("config_path"), wh.root)).digest


_RUNNERS: dict[str, Callable[[Warehouse, dict[str, Any], Any], tuple[Any, set[str] | None]]] = {
    "episodes": _episodes, "hf": _hf, "packs": _packs, "card": _card, "sql": _sql}
