"""Deletion propagation (issue 16): forgetting 1 % of a warehouse against a full rebuild of it.

    python bench/forget_bench.py WAREHOUSE [--selector batch:ID] [--repeat N]

On copies of a built warehouse (e.g. the one `make bench-scale` leaves, whose last batch is the +1 %
increment), one after the other: a full rebuild of the derived layers (`trajwh build --full`) on
one, `trajwh forget SELECTOR` (default: the last ingest batch) on another (``--repeat N``: on N
fresh copies, one after the other; the ratio takes their median). Prints the wall times, their
ratio (the issue's goal: <= 0.05), the forget's CPU time (its process and its worker: the two cores'
share it used), the bytes the forget rewrote as a share of the warehouse's data files, the proof's
result, and (not timed) the packs check's violations in the packs the last forget left (any: the
benchmark fails).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajwh.lineage.catalog import Warehouse  # noqa: E402


def _full_build(root: str) -> bool:
    from trajwh.pipelines.definitions import build

    return build(root, full=True).success


def _cpu() -> float:
    """CPU seconds of this process and its reaped children (the forget's worker)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("warehouse")
    ap.add_argument("--selector", default=None, help="what to forget (default: batch:<the last ingest batch>)")
    ap.add_argument("--repeat", type=int, default=1, help="forgets on fresh copies (the ratio takes their median)")
    args = ap.parse_args()
    if args.repeat < 1:
        sys.exit(f"--repeat {args.repeat}: give 1 or more forgets")
    from trajwh.lineage.forget import forget

    src = Warehouse(args.warehouse)
    selector = args.selector or "batch:" + src.query(
        "SELECT batch_id FROM batches ORDER BY committed_at DESC LIMIT 1").column(0)[0].as_py()
    with tempfile.TemporaryDirectory(prefix="trajwh-forget-bench-") as tmp:
        a = Warehouse(Path(tmp) / "rebuild")
        shutil.copytree(src.root, a.root)
        data_bytes = int(a.query("SELECT sum(bytes) FROM table_files").column(0)[0].as_py())
        episodes = a.query("SELECT count(*) FROM episodes").column(0)[0].as_py()
        t0 = time.perf_counter()  # in a process of its own, as `trajwh build --full` runs: the forget
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:  # starts lean
            assert pool.submit(_full_build, str(a.root)).result()
        rebuild = time.perf_counter() - t0
        shutil.rmtree(a.root)
        runs, cpu = [], []
        for i in range(args.repeat):
            b = Warehouse(Path(tmp) / f"forget-{i}")
            shutil.rmtree(Path(tmp) / f"forget-{i - 1}", ignore_errors=True)
            shutil.copytree(src.root, b.root)
            before = _cpu()
            t0 = time.perf_counter()
            r = forget(b, selector, "benchmark", progress=lambda m, t0=t0: print(
                f"[{time.perf_counter() - t0:7.1f} s] {m}", file=sys.stderr))
            runs.append(time.perf_counter() - t0)
            cpu.append(_cpu() - before)  # (the worker is a child, reaped when the forget ends)
        took = statistics.median(runs)
        # (not timed) the packs the forget left are whole: every layout against its token rows
        from trajwh.packing.verify import verify_packs, violations

        packs_violations = sum(violations(verify_packs(b, ps, scan_secrets=False)) for ps in
                               b.query("SELECT DISTINCT pack_set FROM packs").column(0).to_pylist())
    out = {"episodes": episodes, "selector": selector, "forgotten_episodes": r.counts.get("episodes"),
           "full_rebuild_s": round(rebuild, 1), "forget_s": round(took, 1), "ratio": round(took / rebuild, 3),
           "forget_runs_s": [round(x, 1) for x in runs], "forget_cpu_s": [round(x, 1) for x in cpu],
           "bytes_written": r.sources.get("bytes_written"), "bytes_replaced": r.sources.get("bytes_replaced"),
           "data_bytes": data_bytes, "rewritten_share": round((r.sources.get("bytes_written") or 0) / data_bytes, 4),
           "status": r.status, "probes": r.verify.get("probes"), "probes_shared": r.verify.get("probes_shared"),
           "files_unchanged": r.verify.get("files_unchanged"), "packs_violations": packs_violations}
    print(json.dumps(out, indent=2))
    if packs_violations:
        sys.exit(f"the packs the forget left fail their check: {packs_violations} violations")


if __name__ == "__main__":
    main()
