"""`make bench`: every benchmark, one summary table, results in bench/out/results.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dedup_bench  # noqa: E402
import ingest_bench  # noqa: E402
import packing_bench  # noqa: E402
import redaction_bench  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="5000,20000", help="corpus sizes in episodes (ingest benchmark)")
    ap.add_argument("--dedup-episodes", type=int, default=100_000, help="episodes for the curation benchmark")
    ap.add_argument("--pack-episodes", type=int, default=2000, help="demo corpus for packing efficiency")
    ap.add_argument("--pack-fragments", type=int, default=20_000, help="units for the packing throughput ratio")
    ap.add_argument("--pack-big", type=int, default=100_000, help="units streamed for the packing peak memory")
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
    console.log("redaction: labelled set, ours vs presidio vs detect-secrets ...")
    red = redaction_bench.run()
    console.log("redaction: realistic trajectory text, ours vs presidio ...")
    red["trajectory_text"] = redaction_bench.trajectory_throughput()
    results["redaction"] = red
    t = Table(title=f"redaction on the labelled set ({red['cases']} texts, {red['secrets']} secrets, {red['decoys']} decoys)")
    for col in ("type", "n", "ours", "presidio", "detect-secrets"):
        t.add_column(col, justify="right" if col != "type" else "left")
    for typ, v in red["per_type"].items():
        t.add_row(typ, str(v["n"]), f"{v['ours']:.3f}", f"{v['presidio']:.3f}", f"{v['detect_secrets']:.3f}")
    t.add_row("overall", str(red["secrets"]), f"{red['recall']['ours']:.3f}", f"{red['recall']['presidio']:.3f}",
              f"{red['recall']['detect_secrets']:.3f}")
    console.print(t)
    tt = red["trajectory_text"]
    console.print(f"decoys intact (ours): {red['decoys_intact_ours']:.3f}; throughput on the set: ours "
                  f"{red['chars_per_s']['ours']:,} chars/s, presidio {red['chars_per_s']['presidio']:,}, detect-secrets "
                  f"{red['chars_per_s']['detect_secrets']:,} -> {red['speedup_vs_presidio']}x presidio\n"
                  f"on trajectory text ({tt['characters']:,} chars): ours {tt['ours_chars_per_s']:,} chars/s, presidio "
                  f"{tt['presidio_chars_per_s']:,} -> {tt['speedup_vs_presidio']}x; peak RSS {red['peak_rss_mb']} MB")
    ho = red["heldout"] = redaction_bench.heldout()
    t = Table(title=f"redaction on the held-out set ({ho['cases']} texts, {ho['secrets']} secrets, {ho['decoys']} kept values)")
    t.add_column("type")
    t.add_column("n", justify="right")
    t.add_column("recall", justify="right")
    for typ, v in ho["per_type"].items():
        t.add_row(typ, str(v["n"]), f"{v['recall']:.3f}")
    t.add_row("overall", str(ho["secrets"]), f"{ho['recall']:.3f}")
    console.print(t)
    console.print(f"held-out: decoys and surrounding text kept {ho['decoys_kept']:.3f}; missed {ho['missed']}; "
                  f"destroyed {ho['destroyed']}")
    console.log("dedup: MinHash vs datasketch, then curation at 100,000 episodes (a few minutes) ...")
    mh = dedup_bench.minhash_vs_datasketch()
    scale = dedup_bench.at_scale(args.dedup_episodes)
    results["dedup"] = {"minhash": mh, "scale": scale}
    console.print(f"MinHash signatures on {mh['shingles']:,} shingles ({mh['documents']} episodes): ours "
                  f"{mh['ours_shingles_per_s']:,}/s, datasketch update_batch {mh['datasketch_shingles_per_s']:,}/s "
                  f"-> {mh['speedup']}x\ncuration at {scale['episodes']:,} episodes: features {scale['features_s']} s, "
                  f"near duplicates {scale['near_dup_s']} s, groups + splits {scale['groups_and_splits_s']} s, "
                  f"peak RSS {scale['peak_rss_mb']} MB; {scale['clusters']:,} clusters, {scale['groups']:,} groups, "
                  f"splits {scale['splits']}")
    pk = results["packing"] = packing_bench.run(args.pack_episodes, args.pack_fragments, args.pack_big,
                                                progress=lambda m: console.log(m))
    packing_bench.report(pk, console)
    OUT.mkdir(exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=2))
    console.print(f"results: {OUT / 'results.json'}")


if __name__ == "__main__":
    main()
