"""Peak memory and time of one build stage, rebuilt in full on a copy of a built warehouse.

    python bench/stage_memory.py WAREHOUSE STAGE [--copy DIR]

STAGE: normalize | redact | curate | fragments. The stage runs alone in this process (the
warehouse is copied first, so the original is untouched); the line printed holds its wall time
and this process's peak RSS (``ru_maxrss``), which includes the interpreter and libraries.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import peak_rss_mb  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajwh.lineage.catalog import Warehouse  # noqa: E402


def run_stage(wh: Warehouse, stage: str) -> dict:
    if stage == "normalize":
        from trajwh.ingest.normalize import normalize_warehouse

        s = normalize_warehouse(wh, run_id="mem", full=True)
        return {"episodes": s.episodes, "steps": s.steps}
    if stage == "redact":
        from trajwh.redaction.layer import redact_warehouse

        s = redact_warehouse(wh, run_id="mem", full=True)
        return {"episodes": s.episodes, "steps": s.steps}
    if stage == "curate":
        from trajwh.dedup.layer import curate_warehouse

        s = curate_warehouse(wh, run_id="mem", full=True)
        return {"episodes": s.episodes, "groups": s.groups}
    if stage == "fragments":
        from trajwh.fragments.layer import build_fragments

        s = build_fragments(wh, run_id="mem", full=True)
        return {"episodes": s.episodes, "fragments": sum(s.fragments.values())}
    raise SystemExit(f"unknown stage {stage!r}: normalize, redact, curate or fragments")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("warehouse")
    ap.add_argument("stage")
    ap.add_argument("--copy", default=None, help="where to copy the warehouse (default: a temporary folder)")
    args = ap.parse_args()
    copy = Path(args.copy or tempfile.mkdtemp(prefix="trajwh-stage-")) / "wh"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(args.warehouse, copy)
    t0 = time.perf_counter()
    try:
        out = run_stage(Warehouse(copy), args.stage)
    finally:
        if not args.copy:
            shutil.rmtree(copy.parent, ignore_errors=True)
    out.update(stage=args.stage, seconds=round(time.perf_counter() - t0, 1),
               peak_rss_mb=round(peak_rss_mb()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
