"""`make bench-scale`: the design's scale on this machine, full and incremental, stage by stage.

    python bench/scale.py [--episodes 107000] [--seed 21] [--dir DIR] [--increment 0.01]

Synthesizes N episodes plus an increment (1 % by default) in one corpus, then, each step a
separate ``trajwh`` process: ingest the first N, full build, ingest the increment, incremental
build, no-op build. Every process tree (the build's redaction workers included) is sampled
every 0.2 s for its total RSS and CPU time; a build's stages are told apart by the ``runs``
rows it wrote (start and finish of each stage). Prints one table, writes
``bench/out/scale.json``, and reports the realized groups and split shares.

The corpus is kept in DIR (reused when N and the seed match); the warehouse is rebuilt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
TRAJWH = str(Path(sys.executable).parent / "trajwh")
STAGES = ("normalize", "redact", "features", "curate", "eligibility", "fragments", "packs")


class TreeSampler:
    """Total RSS, total PSS and cumulative CPU seconds of a process and all its descendants,
    sampled. RSS counts a page shared by several processes (the libraries every worker maps) in
    each of them; PSS divides it among them, so the tree's PSS is what the machine gives the build
    (the kernel's ``smaps_rollup``). Both are reported; the goals are read against RSS, the
    stricter."""

    def __init__(self, pid: int, interval: float = 0.2):
        self.root = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, float, float, float]] = []  # (unix time, rss MB, cpu s, pss MB)
        self._dead_cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        rss, pss, cpu = 0, 0, 0.0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            try:
                with p.oneshot():
                    mem = p.memory_full_info()
                    rss += mem.rss
                    pss += getattr(mem, "pss", mem.rss)
                    t = p.cpu_times()
                    self._dead_cpu[p.pid] = t.user + t.system
            except psutil.Error:
                continue
        cpu = sum(self._dead_cpu.values())  # processes that ended keep their last reading
        self.samples.append((time.time(), rss / 2**20, cpu, pss / 2**20))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, start: float, end: float) -> dict[str, float]:
        inside = [s for s in self.samples if start <= s[0] <= end]
        before = [s for s in self.samples if s[0] <= start]
        if not inside:
            return {"peak_rss_mb": 0.0, "cpu_s": 0.0, "peak_pss_mb": 0.0}
        cpu0 = before[-1][2] if before else 0.0
        return {"peak_rss_mb": round(max(s[1] for s in inside)), "cpu_s": round(inside[-1][2] - cpu0, 1),
                "peak_pss_mb": round(max(s[3] for s in inside))}


def run_step(name: str, argv: list[str], console: Console, env: dict[str, str]) -> dict:
    console.log(f"{name}: {' '.join(argv[1:])}")
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    with TreeSampler(proc.pid) as sampler:
        output = proc.communicate()[0]
    t1 = time.time()
    if proc.returncode != 0:
        console.print(output[-4000:])
        raise SystemExit(f"{name} failed with exit status {proc.returncode}")
    res = {"step": name, "seconds": round(t1 - t0, 1), **sampler.window(t0, t1), "sampler": sampler,
           "t0": t0, "t1": t1, "output": output}
    console.log(f"{name}: {res['seconds']} s, CPU {res['cpu_s']} s, peak RSS {res['peak_rss_mb']} MB "
                f"(PSS {res['peak_pss_mb']} MB)")
    return res


def stage_windows(wh: Path, step: dict) -> list[dict]:
    """Per-stage figures of one build, from the runs rows the build wrote during its window."""
    con = duckdb.connect(str(wh / "catalog.duckdb"), read_only=True)
    try:
        rows = con.execute(
            "SELECT job, started_at, finished_at, counts FROM runs WHERE finished_at IS NOT NULL "
            "AND job IN ('normalize', 'redact', 'features', 'curate', 'eligibility', 'fragments', 'packs') ORDER BY started_at").fetchall()
    finally:
        con.close()
    out = []
    for job, started, finished, counts in rows:
        s = started.replace(tzinfo=UTC).timestamp() if started.tzinfo is None else started.timestamp()
        f = finished.replace(tzinfo=UTC).timestamp() if finished.tzinfo is None else finished.timestamp()
        if s < step["t0"] - 1 or f > step["t1"] + 1:
            continue
        c = json.loads(counts or "{}")
        out.append({"stage": job, "seconds": round(f - s, 1), **step["sampler"].window(s, f),
                    "skipped": bool(c.get("skipped")) or (c.get("batches_done") == 0 and c.get("batches_skipped", 0) > 0)})
    return out


def split_corpus(corpus: Path, n: int, base: Path, inc: Path) -> tuple[int, int]:
    """The first n episodes (in file order) are the base; the rest the increment (files linked, the
    one file that straddles n is cut in two)."""
    import gzip

    for d in (base, inc):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    seen = n_inc = 0
    files = sorted(p for p in corpus.iterdir() if p.is_file() and p.name.startswith("episodes-"))
    for p in files:
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt") as fh:
            lines = [ln for ln in fh if ln.strip()]
        take = max(0, min(len(lines), n - seen))
        stem = p.name.removesuffix(".gz")
        if take == len(lines):
            os.symlink(p, base / p.name)
        elif take == 0:
            os.symlink(p, inc / p.name)
        else:
            (base / stem).write_text("".join(lines[:take]))
            (inc / stem).write_text("".join(lines[take:]))
        seen += take
        n_inc += len(lines) - take
    return seen, n_inc


def realized(wh: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from trajwh.lineage.catalog import Warehouse

    w = Warehouse(wh)
    one = lambda sql: w.query(sql).to_pylist()[0]  # noqa: E731
    try:
        splits = {r["split"]: r["n"] for r in w.query("SELECT split, count(*) AS n FROM splits GROUP BY ALL").to_pylist()}
        g = one("SELECT count(DISTINCT group_id) AS groups, max(group_size) AS largest, "
                "count(DISTINCT repository) AS repositories FROM task_groups")
        c = one("SELECT count(DISTINCT cluster_id) AS clusters, count(*) FILTER (WHERE cluster_size > 1) AS dups "
                "FROM near_dup_clusters")
        fragments = one("SELECT count(*) AS n FROM fragments")["n"]
    except Exception as e:  # noqa: BLE001 - a report, not a check
        return {"error": str(e)}
    total = sum(splits.values()) or 1
    return {"splits": splits, "split_shares": {k: round(v / total, 4) for k, v in sorted(splits.items())},
            "groups": g["groups"], "largest_group": g["largest"], "repositories": g["repositories"],
            "clusters": c["clusters"], "episodes_in_clusters": c["dups"], "fragments": fragments}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=107_000)
    ap.add_argument("--increment", type=float, default=0.01, help="share of N ingested after the full build")
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--dir", default="/tmp/trajwh-scale", help="work folder (corpus kept, warehouse rebuilt)")
    ap.add_argument("--snapshot", action="store_true",
                    help="copy the warehouse after the full build to DIR/wh-full (outside the timings), to profile "
                         "the incremental build again on it")
    args = ap.parse_args()
    console = Console()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    n_inc = max(1, round(args.episodes * args.increment))
    corpus, wh = work / "corpus", work / "wh"
    stamp = work / "corpus.json"
    want = {"episodes": args.episodes + n_inc, "seed": args.seed}
    env = {**os.environ, "TRAJWH_NO_COLOR": "1"}
    steps = []
    if not (stamp.exists() and json.loads(stamp.read_text()) == want):
        shutil.rmtree(corpus, ignore_errors=True)
        steps.append(run_step("synthesize", [TRAJWH, "synth", "--episodes", str(want["episodes"]), "--seed",
                                             str(args.seed), "--out", str(corpus)], console, env))
        stamp.write_text(json.dumps(want))
    base_n, inc_n = split_corpus(corpus, args.episodes, work / "base", work / "increment")
    shutil.rmtree(wh, ignore_errors=True)
    w = ["--warehouse", str(wh)]
    steps.append(run_step("ingest", [TRAJWH, "ingest", str(work / "base"), *w], console, env))
    full = run_step("full build", [TRAJWH, "build", *w], console, env)
    steps.append(full)
    shape = realized(wh)
    if args.snapshot:
        shutil.rmtree(work / "wh-full", ignore_errors=True)
        shutil.copytree(wh, work / "wh-full", symlinks=True)
    steps.append(run_step("ingest +increment", [TRAJWH, "ingest", str(work / "increment"), *w], console, env))
    inc = run_step("incremental build", [TRAJWH, "build", *w], console, env)
    steps.append(inc)
    noop = run_step("no-op build", [TRAJWH, "build", *w], console, env)
    steps.append(noop)
    stages = {s["step"]: stage_windows(wh, s) for s in (full, inc, noop)}

    machine = f"{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"
    t = Table(title=f"scale: {base_n:,} episodes + {inc_n:,} ({machine}, {datetime.now(UTC):%Y-%m-%d})")
    for col in ("step", "stage", "wall s", "CPU s", "peak RSS MB", "peak PSS MB"):
        t.add_column(col, justify="left" if col in ("step", "stage") else "right")
    for s in steps:
        t.add_row(s["step"], "(whole process tree)", f"{s['seconds']:.1f}", f"{s['cpu_s']:.1f}", f"{s['peak_rss_mb']:,}",
                  f"{s['peak_pss_mb']:,}")
        for st in stages.get(s["step"], []):
            t.add_row("", st["stage"] + (" (unchanged)" if st["skipped"] else ""), f"{st['seconds']:.1f}",
                      f"{st['cpu_s']:.1f}", f"{st['peak_rss_mb']:,}", f"{st['peak_pss_mb']:,}")
    console.print(t)
    ratio = inc["seconds"] / full["seconds"]
    console.print(f"incremental / full build time: {ratio:.3f} (goal <= 0.10); no-op build {noop['seconds']:.1f} s "
                  f"(goal < 5 s); peak RSS of any build {max(s['peak_rss_mb'] for s in (full, inc, noop)):,} MB "
                  f"(goal <= 2,048; PSS {max(s['peak_pss_mb'] for s in (full, inc, noop)):,} MB)")
    after = realized(wh)
    console.print(f"after the full build: {shape}")
    console.print(f"after the incremental build: {after}")
    OUT.mkdir(exist_ok=True)
    # the builds' memory over time (seconds from the step's start, MB), to tell which Dagster step
    # made a peak (their times are in the run's event log under <warehouse>/_dagster)
    (OUT / "scale-memory.json").write_text(json.dumps({
        s["step"]: {"start": s["t0"], "samples": [(round(t - s["t0"], 1), round(m), round(q))
                                                   for t, m, _, q in s["sampler"].samples]}
        for s in (full, inc)}))
    keep = ("step", "seconds", "cpu_s", "peak_rss_mb", "peak_pss_mb")
    (OUT / "scale.json").write_text(json.dumps({
        "episodes": base_n, "increment": inc_n, "machine": machine, "date": datetime.now(UTC).isoformat(),
        "steps": [{k: s[k] for k in keep} for s in steps], "stages": stages and {
            k: [{kk: vv for kk, vv in st.items()} for st in v] for k, v in stages.items()},
        "incremental_ratio": round(ratio, 4), "realized_full": shape, "realized_incremental": after}, indent=2))


if __name__ == "__main__":
    main()
