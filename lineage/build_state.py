"""Is the warehouse already what a build would make of it? ("up to date", as ``make`` says.)

A build is a function of its inputs: the warehouse's files and catalog tables, the settings
file (and the files it names), the overrides given, the environment's ``TRAJWH_*`` variables
(the vault key among them), the tokenizer files, and the code and libraries that run. Every
stage already skips when its own inputs are unchanged, but a no-op build still pays for the
Dagster run around those skips: 27 steps, their events and the checks' cache look-ups, about
5-10 s at 107,000 episodes (bench/README.md). So after a whole-graph build whose checks all
pass, the digest of all those inputs (as the build left them) is kept in
``<warehouse>/_cache/build_state.json``; a later ``trajwh build`` whose digest is the same has
nothing to do and says so without starting Dagster.

What the digest covers, and why each part:

- ``table_files``: every data file's path, content hash and transform version (ingest, forget,
  compaction and every stage change it);
- every catalog table but ``runs`` (which each build writes): batches, ingested files,
  deletions (a forget part-way), opt-outs and their scans and matches, exports;
- the settings file's bytes and the files it names (``[licenses] repository_file``), the build's
  overrides (scope, cutoff, fractions, ...);
- ``TRAJWH_*`` environment variables and the vault key file's bytes (a key that appears makes
  the next build write the vault);
- a ``hf:`` tokenizer folder's files (size and time);
- the source of every ``trajwh`` package and the installed distributions (names and versions):
  a code or library change may change a transform version, so it rebuilds through the graph,
  which then decides stage by stage;
- the data card's files (a deleted card is made again).

Nothing here holds content: the file keeps one digest, a run id and a time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

from trajwh.lineage.catalog import Warehouse, now_utc
from trajwh.lineage.storage import ensure_dir, write_bytes_atomic
from trajwh.schemas.arrow import CATALOG_TABLES

STATE_FILE = "build_state.json"
#: the folders of the distribution's packages (pyproject.toml [tool.setuptools.package-dir])
PACKAGES = ("schemas", "ingest", "redaction", "dedup", "fragments", "packing", "lineage", "datacards",
            "pipelines", "licenses")
_CODE: list[str] = []  # this process's code digest, computed once


def code_digest() -> str:
    """The source of every trajwh package (all files, ``__pycache__`` aside) and the names and
    versions of the installed distributions (the ``*.dist-info`` folder names: one listing, no
    metadata read), with the Python version."""
    if _CODE:
        return _CODE[0]
    h = hashlib.sha256(sys.version.encode())
    for name in PACKAGES:
        spec = importlib.util.find_spec(f"trajwh.{name}")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(folder).rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts:
                    h.update(f"\0{name}/{path.relative_to(folder)}\0".encode())
                    h.update(path.read_bytes())
    for key in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}):
        try:
            h.update("\0".join(sorted(n for n in os.listdir(key) if n.endswith(".dist-info"))).encode())
        except OSError:
            continue
    _CODE.append(h.hexdigest())
    return _CODE[0]


def _catalog_digest(wh: Warehouse) -> str:
    """The manifest and every catalog table but ``runs``, in one read-only connection."""
    tables = sorted(t for t in CATALOG_TABLES if t != "runs")
    con = wh.connect(read_only=True)
    try:
        parts = [con.execute("SELECT coalesce(md5(string_agg(concat_ws(':', table_name, path, sha256, rows, "
                         "coalesce(transform_version, '')), chr(10) ORDER BY path)), '') FROM table_files").fetchone()[0],
                 con.execute("SELECT coalesce(md5(string_agg(CAST(m AS VARCHAR), chr(10) ORDER BY key)), '') "
                         "FROM meta m").fetchone()[0]]
        for t in tables:
            parts.append(con.execute(f"SELECT '{t}:' || count(*) || ':' || coalesce(md5(string_agg(CAST(x AS VARCHAR), "
                                 f"chr(10) ORDER BY CAST(x AS VARCHAR))), '') FROM {t} x").fetchone()[0])
    finally:
        con.close()
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _file_digest(h: Any, path: Path | None, *, contents: bool = True) -> None:
    if path is None:
        return
    try:
        if contents:
            h.update(f"\0{path}\0".encode() + path.read_bytes())
        else:
            st = path.stat()
            h.update(f"\0{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError:
        h.update(f"\0{path}: missing".encode())


def build_params(scope: str = "episode", curate: dict[str, Any] | None = None,
                 pack: dict[str, Any] | None = None) -> dict[str, Any]:
    """The overrides of a build that its result depends on (the rest of its inputs are found by
    ``build_inputs_digest``): what tells one build's up-to-date state from another's."""
    # the engine that runs the global steps is left out: engines give the same tables
    return {"scope": scope, "curate": {k: v for k, v in (curate or {}).items() if v is not None and k != "engine"},
            "pack": pack or {}}


def build_inputs_digest(wh: Warehouse, params: dict[str, Any], config: str | None = None) -> str:
    """The digest of everything a build reads (module docstring); ``params``: the build's
    overrides, as ``trajwh build`` passes them."""
    from trajwh.schemas.config import find_config, load_settings

    h = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    h.update(code_digest().encode())
    h.update(_catalog_digest(wh).encode())
    config_path = find_config(config, wh.root)
    _file_digest(h, config_path)
    settings = load_settings(config, wh.root)
    if settings.licenses.repository_file:
        named = Path(settings.licenses.repository_file).expanduser()
        _file_digest(h, named if named.is_absolute() or config_path is None else config_path.parent / named)
    if settings.packing.tokenizer.startswith("hf:"):
        folder = Path(settings.packing.tokenizer.removeprefix("hf:")).expanduser()
        for p in sorted(folder.iterdir()) if folder.is_dir() else []:
            _file_digest(h, p, contents=False)
    for name in sorted(k for k in os.environ if k.startswith("TRAJWH_")):
        h.update(f"\0{name}={os.environ[name]}".encode())
    key_file = os.environ.get("TRAJWH_VAULT_KEY_FILE")
    _file_digest(h, Path(key_file).expanduser() if key_file else None)
    card = wh.root / "card"
    for p in sorted(card.iterdir()) if card.is_dir() else []:
        _file_digest(h, p, contents=False)
    return h.hexdigest()


def _state_path(wh: Warehouse) -> Path:
    return wh.root / "_cache" / STATE_FILE


def record_built(wh: Warehouse, digest: str, run_id: str) -> None:
    """Keep the digest of the inputs a successful whole-graph build left (atomically)."""
    folder = wh.root / "_cache"
    ensure_dir(folder, restricted=True)
    state = {"inputs": digest, "run_id": run_id, "finished_at": now_utc().isoformat()}
    write_bytes_atomic(json.dumps(state).encode(), folder / STATE_FILE, restricted=True)


def forget_built(wh: Warehouse) -> None:
    """No longer claim the warehouse is up to date (a build that failed or changed nothing whole)."""
    try:
        _state_path(wh).unlink()
    except FileNotFoundError:
        pass


def up_to_date(wh: Warehouse, digest: str) -> dict[str, Any] | None:
    """The last whole-graph build's record (its run id and time) when ``digest`` is the one it
    left, else None. A lost or unreadable state file only means building."""
    try:
        state = json.loads(_state_path(wh).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("inputs") == digest else None
