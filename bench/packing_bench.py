"""The packed token layer (issue 15): throughput, packing efficiency, peak memory.

    python bench/packing_bench.py [--episodes 2000] [--fragments 20000] [--big 100000]

1. builds the demo corpus (``--episodes``, seed 0: what `make demo` builds) into a warehouse;
2. efficiency at 8,192 tokens of the demo corpus's packable units (trainable fragments and
   evaluation episodes, representatives), per split, for min-slack (the default), best-fit
   decreasing and first fit, all in this process on the same segments;
3. throughput: ``--fragments`` units (the demo units, cycled) through render + tokenize + pack,
   as a ratio against bare ``tiktoken`` ``encode_ordinary_batch`` of the same rendered text in the
   same run (the issue's goal: >= 0.5);
4. peak memory at ``--big`` units streamed through ``packing.layer.pack_stream`` into Parquet, in
   a child process of its own (its own ``VmHWM``, ``bench/peak.py``, is the figure).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajwh.lineage.catalog import Warehouse  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import peak_rss_mb  # noqa: E402


def build_demo(root: Path, episodes: int) -> Warehouse:
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.pipelines.definitions import build
    from trajwh.synth.generator import SynthConfig, generate_corpus

    corpus = root / "corpus"
    generate_corpus(SynthConfig(episodes=episodes, seed=0), corpus)
    wh = Warehouse(root / "wh")
    ingest_paths(wh, [corpus], IngestOptions(source="synthetic"))
    build(str(wh.root))
    return wh


def _units(wh: Warehouse) -> list:
    from trajwh.packing.layer import units_with_steps

    return list(units_with_steps(wh))


def _cycled(units: list, n: int):
    """``n`` units: the demo's, cycled, each copy its own id."""
    for i, (u, steps) in zip(range(n), itertools.cycle(units), strict=False):
        yield {**u, "unit_id": f"{u['unit_id']}~{i // len(units)}"}, steps


def efficiency(units: list, seq_len: int = 8192) -> dict:
    from trajwh.packing.pack import PACKERS, Segment
    from trajwh.packing.render import render
    from trajwh.packing.tokenizers import get_tokenizer

    tok = get_tokenizer()
    by_split: dict[str, list] = {}
    for u, steps in units:
        r = render(steps, u["span"], tok, tools=u.get("tools"))
        by_split.setdefault(u["split"], []).append(Segment(u["unit_id"], tuple(r.ids), tuple(r.mask)))
    out = {}
    for name, packer in PACKERS.items():
        seqs = tokens = 0
        per = {}
        t0 = time.perf_counter()
        for split, segs in sorted(by_split.items()):
            res = packer(segs, seq_len)
            per[split] = round(res.efficiency, 4)
            seqs += len(res.sequences)
            tokens += res.tokens
        out[name] = {"sequences": seqs, "efficiency": round(tokens / (seqs * seq_len), 4), "per_split": per,
                     "seconds": round(time.perf_counter() - t0, 2)}
    out["units"] = sum(len(v) for v in by_split.values())
    return out


def throughput(units: list, n: int) -> dict:
    from trajwh.packing.layer import PackConfig, PackSummary, pack_stream
    from trajwh.packing.render import render
    from trajwh.packing.tokenizers import get_tokenizer

    tok = get_tokenizer()
    work = list(_cycled(units, n))
    texts = [render(steps, u["span"], tok, tools=u.get("tools")).text for u, steps in work]
    t0 = time.perf_counter()
    tok.encoding.encode_ordinary_batch(texts)
    bare = time.perf_counter() - t0
    summary = PackSummary("bench", seq_len=8192)
    t0 = time.perf_counter()
    pack_stream(work, PackConfig(), tok, summary, lambda rows: None, {})
    ours = time.perf_counter() - t0
    chars = sum(len(t) for t in texts)
    return {"units": n, "characters": chars, "tokens": sum(summary.tokens.values()),
            "encode_ordinary_batch_s": round(bare, 2), "render_tokenize_pack_s": round(ours, 2),
            "ratio": round(bare / ours, 3), "ours_tokens_per_s": round(sum(summary.tokens.values()) / ours)}


def _child_big(warehouse: str, n: int, out: str) -> None:
    import pyarrow.parquet as pq
    from trajwh.packing.layer import (
        PackConfig,
        PackSummary,
        pack_stream,
        pack_table,
        units_with_steps,
    )
    from trajwh.packing.tokenizers import get_tokenizer
    from trajwh.schemas.arrow import arrow_schema
    from trajwh.schemas.tables import PackRow

    wh = Warehouse(warehouse)
    tok = get_tokenizer()
    schema = arrow_schema(PackRow)
    writer = pq.ParquetWriter(out, schema)

    def stream():  # the warehouse streamed again and again (never held), each copy its own ids
        i = 0
        while True:
            for u, steps in units_with_steps(wh):
                if i >= n:
                    return
                yield {**u, "unit_id": f"{u['unit_id']}~{i}"}, steps
                i += 1

    summary = PackSummary("bench", seq_len=8192)
    t0 = time.perf_counter()
    pack_stream(stream(), PackConfig(), tok, summary,
                lambda rows: writer.write_table(pack_table(rows, schema)),
                {"_run_id": "bench", "_transform": "packs", "_transform_version": "bench"})
    writer.close()
    print(json.dumps({"units": summary.fragments, "sequences": sum(summary.sequences.values()),
                      "tokens": sum(summary.tokens.values()), "seconds": round(time.perf_counter() - t0, 1),
                      "efficiency": round(summary.efficiency, 4),
                      "peak_rss_mb": round(peak_rss_mb())}))



def big(wh: Warehouse, n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, __file__, "--child", str(wh.root), str(n), f"{tmp}/packs.parquet"],
                             capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(episodes: int = 2000, fragments: int = 20_000, big_n: int = 100_000, progress=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="trajwh-pack-bench-") as tmp:
        progress(f"packing: building the demo corpus ({episodes} episodes) ...")
        wh = build_demo(Path(tmp), episodes)
        units = _units(wh)
        progress(f"packing: efficiency of {len(units)} units at 8192 ...")
        eff = efficiency(units)
        progress(f"packing: throughput over {fragments:,} units ...")
        thr = throughput(units, fragments)
        progress(f"packing: peak memory at {big_n:,} units (child process, a few minutes) ...")
        mem = big(wh, big_n)
    return {"efficiency": eff, "throughput": thr, "big": mem}


def report(r: dict, console=None) -> None:
    """The figures as tables (``make bench`` prints them next to the others)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    eff = r["efficiency"]
    t = Table(title=f"packing efficiency at 8,192 tokens ({eff['units']:,} demo units, same segments)")
    t.add_column("packer")
    splits = sorted(next(v for k, v in eff.items() if k != "units")["per_split"])
    for col in ("sequences", "overall", *splits, "seconds"):
        t.add_column(col, justify="right")
    for name, v in eff.items():
        if name == "units":
            continue
        t.add_row(name, f"{v['sequences']:,}", f"{v['efficiency']:.4f}", *(f"{v['per_split'][s]:.4f}" for s in splits),
                  f"{v['seconds']}")
    console.print(t)
    th, big = r["throughput"], r["big"]
    console.print(f"render + tokenize + pack: {th['units']:,} units, {th['tokens']:,} tokens in {th['render_tokenize_pack_s']} s "
                  f"vs encode_ordinary_batch {th['encode_ordinary_batch_s']} s -> ratio {th['ratio']} (goal >= 0.5)\n"
                  f"streamed {big['units']:,} units into {big['sequences']:,} sequences ({big['tokens']:,} tokens, "
                  f"efficiency {big['efficiency']}) in {big['seconds']} s, peak RSS {big['peak_rss_mb']} MB")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child_big(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--fragments", type=int, default=20_000)
    ap.add_argument("--big", type=int, default=100_000)
    args = ap.parse_args()
    r = run(args.episodes, args.fragments, args.big)
    print(json.dumps(r, indent=2))
    report(r)


if __name__ == "__main__":
    main()
