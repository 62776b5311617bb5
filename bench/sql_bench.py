"""`trajwh sql --out` (issue 18): DuckDB's own COPY against the Arrow-then-Python writer it replaced.

    python bench/sql_bench.py WAREHOUSE [--query SQL]

On a built warehouse (`make demo` leaves one in ./warehouse), the same query (default: every
column of the redacted `steps` table) written as CSV, JSON lines and Parquet, each two ways in
this process, each in a child process of its own so its peak RSS is its own:

- ours: `Warehouse.user_query(out=...)`, DuckDB's `COPY` streaming the result to the file;
- baseline: the result as an Arrow table, then the writer `trajwh sql` used before (Python's
  `csv` module row by row, `orjson` per row, `pyarrow.parquet.write_table`).

Prints rows, bytes written, wall seconds, the ratio (baseline time / ours) and peak RSS.
"""

from __future__ import annotations

import argparse
import base64
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peak import peak_rss_mb  # noqa: E402


def _baseline(data, fmt: str, out: str) -> None:
    """The writer `trajwh sql` had before COPY (kept here as the baseline only)."""
    import orjson
    import pyarrow as pa
    import pyarrow.parquet as pq

    def cell(v):
        if v is None:
            return ""
        if isinstance(v, bytes):
            return base64.b64encode(v).decode()
        if isinstance(v, list | dict):
            return orjson.dumps(v, default=str).decode()
        return v.isoformat() if hasattr(v, "isoformat") else v

    if fmt == "parquet":
        pq.write_table(data, out, compression="zstd")
    elif fmt == "json":
        with open(out, "wb") as f:
            for batch in data.to_batches(max_chunksize=4096):
                f.write(b"".join(orjson.dumps(r, default=cell, option=orjson.OPT_NAIVE_UTC) + b"\n"
                                 for r in batch.to_pylist()))
    else:
        with open(out, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(data.column_names)
            for batch in data.to_batches(max_chunksize=4096):
                for row in batch.to_pylist():
                    w.writerow([cell(v) for v in row.values()])
    assert isinstance(data, pa.Table)


def _child(warehouse: str, query: str, fmt: str, way: str, out: str) -> None:
    from trajwh.lineage.catalog import Warehouse

    wh = Warehouse(warehouse)
    t = time.perf_counter()
    if way == "copy":
        rows = wh.user_query(query, out=out, fmt=fmt)
    else:
        data = wh.user_query(query)
        _baseline(data, fmt, out)
        rows = data.num_rows
    print(json.dumps({"rows": rows, "seconds": round(time.perf_counter() - t, 3), "peak_mb": round(peak_rss_mb()),
                      "bytes": os.path.getsize(out)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("warehouse")
    ap.add_argument("--query", default="SELECT * FROM steps")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.warehouse, args.query, *args.child)
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="trajwh-sql-bench-") as tmp:
        for fmt in ("csv", "json", "parquet"):
            for way in ("copy", "baseline"):
                out = os.path.join(tmp, f"{way}.{fmt}")
                proc = subprocess.run([sys.executable, __file__, args.warehouse, "--query", args.query,
                                       "--child", fmt, way, out], capture_output=True, text=True, check=True)
                results[(fmt, way)] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"query: {args.query}")
    print(f"{'format':8} {'rows':>9} {'COPY s':>8} {'baseline s':>10} {'ratio':>6} {'COPY MB':>8} "
          f"{'base MB':>8} {'COPY peak':>9} {'base peak':>9}")
    for fmt in ("csv", "json", "parquet"):
        c, b = results[(fmt, "copy")], results[(fmt, "baseline")]
        print(f"{fmt:8} {c['rows']:>9,} {c['seconds']:>8.2f} {b['seconds']:>10.2f} "
              f"{b['seconds'] / max(c['seconds'], 1e-9):>6.1f} {c['bytes'] / 1e6:>8.1f} {b['bytes'] / 1e6:>8.1f} "
              f"{c['peak_mb']:>7} MB {b['peak_mb']:>7} MB")


if __name__ == "__main__":
    main()
