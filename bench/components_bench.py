"""The global step on a distributed engine: an LSH band table's components, DuckDB vs Daft.

    python bench/components_bench.py [--docs 1000000] [--bands 16] [--seed 5]

A synthetic band table (``doc``, ``band``, ``key``) of N documents: near-duplicate clusters of
heavy-tailed sizes (most documents alone, a few clusters of hundreds; a clustered document shares
each band with its cluster's first member with probability 0.35, else its own key) and chains
(each link shares one band with the next), so the components need several rounds. The relational
plan (``dedup.engines.band_components``: every bucket a star on its smallest document, then the
large-star / small-star loop) runs on each engine in a process of its own (its peak RSS is its
own: ``VmHWM``). The baseline, in the same process as each engine, is the same result from numpy
(buckets by sorting) and scipy's connected components; each engine's labels must equal it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import peak_rss_mb  # noqa: E402


def band_table(n: int, bands: int, seed: int):
    """(doc, band, key) for ``n`` documents, and how many were planted in clusters and chains."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    # cluster of each document: Zipf-like sizes, about 30 % of documents clustered
    owner = np.arange(n, dtype=np.int64)
    clustered = rng.random(n) < 0.30
    heads = np.flatnonzero(clustered)[:: 4]  # cluster heads among the clustered documents
    members = np.flatnonzero(clustered)
    owner[members] = rng.choice(heads, size=len(members), p=_zipf(len(heads), rng))
    key = np.empty((n, bands), dtype=np.int64)
    own = rng.integers(2**31, 2**62, size=(n, bands), dtype=np.int64)
    shared = owner[:, None] * bands + np.arange(bands)[None, :]  # < 2**31; own keys are random 62-bit
    use = (rng.random((n, bands)) < 0.35) & clustered[:, None]
    key[:] = own
    key[use] = shared[use]
    # chains of 50 unclustered documents (up to 1,000 of them), each sharing a band with the next
    chain_docs = rng.choice(np.flatnonzero(~clustered), size=min(50_000, int((~clustered).sum()) // 2), replace=False)
    links = chain_docs[: len(chain_docs) // 50 * 50].reshape(-1, 50)
    for j in range(links.shape[1] - 1):  # link j in band j % 2: a document's two links never share a band
        ids = -(j * len(links) + np.arange(len(links), dtype=np.int64) + 1)
        key[links[:, j], j % 2] = ids
        key[links[:, j + 1], j % 2] = ids
    doc = np.repeat(np.arange(n, dtype=np.int64), bands)
    band = np.tile(np.arange(bands, dtype=np.int64), n)
    return pa.table({"doc": doc, "band": band, "key": key.ravel()}), {"clustered": int(clustered.sum()),
                                                                      "chains": len(links)}


def _zipf(m: int, rng: np.random.Generator) -> np.ndarray:
    w = 1.0 / np.arange(1, m + 1) ** 1.1
    rng.shuffle(w)
    return w / w.sum()


def baseline(n: int, table) -> np.ndarray:
    """Numpy buckets (sort by band and key, link each member to its bucket's first) + scipy."""
    from trajwh.dedup.components import components_array

    doc = table.column("doc").to_numpy()
    band = table.column("band").to_numpy()
    key = table.column("key").to_numpy()
    order = np.lexsort((doc, key, band))
    b, k, d = band[order], key[order], doc[order]
    start = np.r_[True, (b[1:] != b[:-1]) | (k[1:] != k[:-1])]
    hub = d[np.flatnonzero(start)[np.cumsum(start) - 1]]
    keep = hub != d
    return components_array(n, hub[keep], d[keep])


def child(engine_name: str, n: int, bands: int, seed: int) -> None:
    from trajwh.dedup.engines import band_components, engine

    table, planted = band_table(n, bands, seed)
    t = time.perf_counter()
    want = baseline(n, table)
    t_base = time.perf_counter() - t
    eng = engine(engine_name)
    t = time.perf_counter()
    label, rounds = band_components(eng, n, table)
    t_eng = time.perf_counter() - t
    eng.close()
    sizes = np.bincount(np.unique(label, return_inverse=True)[1])
    print(json.dumps({"engine": engine_name, "docs": n, "band_rows": table.num_rows, "seconds": round(t_eng, 2),
                      "rounds": rounds, "baseline_numpy_scipy_s": round(t_base, 2),
                      "ratio_to_baseline": round(t_eng / t_base, 1), "equal_to_baseline": bool((label == want).all()),
                      "components": int(len(sizes)), "largest": int(sizes.max()), **planted,
                      "peak_rss_mb": round(peak_rss_mb())}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--bands", type=int, default=16)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--engines", default="duckdb,daft")
    args = ap.parse_args()
    results = []
    for name in args.engines.split(","):
        print(f"{name}: {args.docs:,} documents x {args.bands} bands ...", file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, __file__, "--child", name, str(args.docs), str(args.bands), str(args.seed)],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    keys = list(results[0])
    width = max(len(k) for k in keys)
    for k in keys:
        print(f"{k:<{width}}  " + "  ".join(f"{str(r[k]):>14}" for r in results))
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / "components.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
