"""The packs check (issue 14): every unit encoded again against the build's check by layout.

    python bench/packs_check_bench.py WAREHOUSE [--workers N] [--sample 20]

On a built warehouse (e.g. the one `make bench-scale` leaves), its pack set verified twice in this
process, without the ledger (every segment rendered): first as `trajwh verify-packs` does (every
unit encoded again and compared token for token: the baseline), then as the build's check does (one
unit in ``--sample`` encoded, every other one checked by its layout: packing/verify.py). Prints both
wall times, their ratio, the segments and tokens, and the peak RSS of this process and of the largest
worker part.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajwh.lineage.catalog import Warehouse  # noqa: E402
from trajwh.packing.verify import verify_packs, violations  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("warehouse")
    ap.add_argument("--workers", type=int, default=1, help="parts (1: all in this process)")
    ap.add_argument("--sample", type=int, default=20, help="one unit in this many encoded again by the check")
    args = ap.parse_args()
    wh = Warehouse(args.warehouse)
    sets = wh.query("SELECT DISTINCT pack_set FROM packs ORDER BY 1").column(0).to_pylist()
    if not sets:
        sys.exit(f"{args.warehouse} holds no packs: build it first (make bench-scale)")
    times = {}
    for name, sample in (("every unit encoded", 1), (f"by layout, 1 in {args.sample} encoded", args.sample)):
        t = time.perf_counter()
        r = verify_packs(wh, sets[0], secret_sample=20, token_sample=sample, workers=args.workers)
        times[name] = time.perf_counter() - t
        print(f"{name}: {times[name]:.1f} s, {r['segments']:,} segments, {r['tokens']:,} tokens, "
              f"{r['encoded']:,} encoded, violations {violations(r)}")
    base, layout = times.values()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    print(f"ratio {layout / base:.3f} ({args.workers} part(s)); peak RSS {peak} MB here, {child} MB largest worker")


if __name__ == "__main__":
    main()
