"""`make bench`: every benchmark, one summary table, results in bench/out/results.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ingest_bench  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="5000,20000", help="corpus sizes in episodes (ingest benchmark)")
    args = ap.parse_args()
    console = Console()
    results = {"ingest": ingest_bench.run([int(x) for x in args.sizes.split(",")],
                                          progress=lambda m: console.log(m))}
    table = Table(title="ingest: ours vs DuckDB read_json (same files, same run)")
    rows = results["ingest"]["sizes"]
    table.add_column("metric")
    for r in rows:
        table.add_column(f"{r['episodes']:,} episodes", justify="right")
    for key in rows[0]:
        table.add_row(key.replace("_", " "), *(f"{r[key]:,}" for r in rows))
    console.print(table)
    peaks = [r["ingest_peak_mb"] for r in rows]
    console.print(f"ingest peak memory: {peaks} MB across sizes {[r['episodes'] for r in rows]} "
                  f"(limit 1,500 MB; growth {max(peaks) / min(peaks):.2f}x for "
                  f"{rows[-1]['episodes'] / rows[0]['episodes']:.0f}x the data)")
    OUT.mkdir(exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=2))
    console.print(f"results: {OUT / 'results.json'}")


if __name__ == "__main__":
    main()
