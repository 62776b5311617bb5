"""Ingest throughput and peak memory, next to DuckDB's own read_json over the same files.

Each measured step runs in its own subprocess so its peak RSS (ru_maxrss) is its own. The
figures: our ingest's MB/s and episodes/s, the ratio to DuckDB ``read_json`` materializing the
same JSONL into a table, the same ratio for building the normalized layer, and our peak memory at two corpus sizes (it must not grow with size:
records stream through a bounded buffer).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import peak_rss_mb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _child(mode: str, corpus: str, warehouse: str) -> None:
    sys.path.insert(0, str(ROOT))
    import duckdb  # imports are not part of the timed work
    from trajwh.ingest.normalize import normalize_warehouse
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.lineage.catalog import Warehouse

    t0 = time.perf_counter()
    out: dict = {}
    if mode == "ingest":
        s = ingest_paths(Warehouse(warehouse), [corpus], IngestOptions(source="bench"))
        out = {"records": s.n_new, "quarantined": s.n_quarantined}
    elif mode == "build":
        s = normalize_warehouse(Warehouse(warehouse), run_id="bench")
        out = {"episodes": s.episodes, "steps": s.steps}
    elif mode == "duckdb":
        con = duckdb.connect()
        con.execute(f"SET threads = 2; CREATE TABLE t AS SELECT * FROM read_json('{corpus}/*.jsonl', "
                    "format = 'newline_delimited', maximum_object_size = 268435456)")
        out = {"records": con.execute("SELECT count(*) FROM t").fetchall()[0][0]}
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(out))


def _measure(mode: str, corpus: Path, warehouse: Path) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", mode, str(corpus), str(warehouse)],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(sizes: list[int], progress=print) -> dict:
    sys.path.insert(0, str(ROOT))
    from trajwh.synth.generator import SynthConfig, generate_corpus

    results = {"sizes": []}
    with tempfile.TemporaryDirectory(prefix="trajwh-bench-") as tmp:
        for n in sizes:
            corpus = Path(tmp) / f"corpus-{n}"
            progress(f"generating {n} episodes ...")
            s = generate_corpus(SynthConfig(episodes=n, seed=1, gzip_every=0), corpus)
            mb = s.bytes / 1e6
            wh = Path(tmp) / f"wh-{n}"
            progress(f"ingesting {n} episodes ({mb:.0f} MB) ...")
            ours = _measure("ingest", corpus, wh)
            progress("building the normalized layer ...")
            build = _measure("build", corpus, wh)
            progress("DuckDB read_json over the same files ...")
            duck = _measure("duckdb", corpus, wh)
            results["sizes"].append({
                "episodes": n, "steps": s.steps, "corpus_mb": round(mb, 1),
                "ingest_s": round(ours["seconds"], 2), "ingest_mb_s": round(mb / ours["seconds"], 1),
                "ingest_episodes_s": round(n / ours["seconds"]), "ingest_peak_mb": round(ours["peak_rss_mb"]),
                "duckdb_read_json_s": round(duck["seconds"], 2), "duckdb_mb_s": round(mb / duck["seconds"], 1),
                "duckdb_peak_mb": round(duck["peak_rss_mb"]),
                "throughput_ratio_vs_duckdb": round(duck["seconds"] / ours["seconds"], 2),
                "build_s": round(build["seconds"], 2), "build_steps_s": round(build["steps"] / build["seconds"]),
                "build_peak_mb": round(build["peak_rss_mb"]),
                # normalize (raw Parquet -> episodes + steps, every adapter rule) against DuckDB
                # only parsing the same JSONL into a table: the speed of a plain JSON reader
                "build_mb_s": round(mb / build["seconds"], 1),
                "normalize_ratio_vs_duckdb": round(duck["seconds"] / build["seconds"], 2),
            })
            shutil.rmtree(corpus)
            shutil.rmtree(wh)
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:5])
        sys.exit(0)
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="5000,20000")
    args = ap.parse_args()
    print(json.dumps(run([int(x) for x in args.sizes.split(",")]), indent=2))
