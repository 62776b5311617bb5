"""Vectorized MinHash signatures and LSH banding.

The signature scheme is datasketch's ``affine32`` (datasketch >= 2.0): each 32-bit shingle hash
goes through the MurmurHash3 32-bit finalizer and then ``num_perm`` affine maps
``h -> a*h + b mod 2^32`` (``a`` odd), with ``a, b`` drawn exactly as datasketch draws them from
``np.random.RandomState(seed)``; a document's signature is the column-wise minimum. With the same
shingle hash function both give identical signatures (a test checks it against
``datasketch.MinHash.update_batch``).

Speed comes from doing everything as array operations over many documents at once: shingles
are hashed in bulk by a compiled MurmurHash3 x86 32-bit over the UTF-8 bytes Arrow holds
contiguously (instead of one ``sha1`` call per shingle in Python; a hash with a fixed
specification, so signatures do not change with a library release), the ``shingles x num_perm`` products are computed in chunks, and
``np.minimum.reduceat`` takes each document's minimum.

Banding: ``b`` bands of ``r`` rows, chosen like datasketch's ``MinHashLSH`` by minimizing the
weighted false-positive and false-negative areas of the S-curve ``1 - (1 - s^r)^b`` around the
threshold (Leskovec, Rajaraman, Ullman: *Mining of Massive Datasets*, ch. 3.4). For a threshold
of 0.8 with 128 permutations that is 9 bands of 13 rows; candidates are then verified by the
estimated Jaccard similarity (share of equal signature positions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, wraps
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

_FMIX = (np.uint32(16), np.uint32(0x85EBCA6B), np.uint32(13), np.uint32(0xC2B2AE35), np.uint32(16))
_HASH_SEED = 20261129
_CHUNK = 1 << 16


@dataclass(frozen=True)
class MinHashParams:
    num_perm: int = 128
    seed: int = 1
    threshold: float = 0.8

    @property
    def bands(self) -> tuple[int, int]:
        return optimal_bands(self.threshold, self.num_perm)

    def describe(self) -> str:
        b, r = self.bands
        return (f"minhash(affine32,num_perm={self.num_perm},seed={self.seed},threshold={self.threshold},b={b},r={r},"
                f"shingle_hash={SHINGLE_HASH})")


@cache
def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)`` as datasketch's affine32 scheme draws them."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    return a, b


def fmix32(hv: np.ndarray) -> np.ndarray:
    s1, m1, s2, m2, s3 = _FMIX
    hv = hv ^ (hv >> s1)
    hv = hv * m1
    hv = hv ^ (hv >> s2)
    hv = hv * m2
    return hv ^ (hv >> s3)


#: the shingle hash, by its specification (recorded in the layer's version): MurmurHash3 x86 32-bit
#: of the shingle's UTF-8 bytes with this seed. Its output is fixed by the algorithm, not by a
#: library's release (polars' ``Series.hash`` was used before and promises no stability).
SHINGLE_HASH = f"murmur3_x86_32(utf8,seed={_HASH_SEED})"


numba: Any = None  # imported on the first compiled call (_jit)


def _jit(func: Callable[..., None]) -> Callable[..., None]:
    """``numba.njit(parallel=True, cache=True, nogil=True)``, compiled on the first call: importing
    numba takes about half a second, which every command that computes no signature would pay."""
    compiled: list[Any] = []

    @wraps(func)
    def call(*args: Any) -> None:
        if not compiled:
            import numba as nb

            globals()["numba"] = nb  # the kernels' bodies name numba.prange
            compiled.append(nb.njit(parallel=True, cache=True, nogil=True)(func))
        return compiled[0](*args)

    call.compiled = compiled  # type: ignore[attr-defined]
    return call


#: below this many shingles, in a process that has not loaded numba, the shingles are hashed by
#: ``mmh3`` (the same MurmurHash3, in C, a call per shingle) and the minima taken by numpy: importing
#: numba and loading its cached kernels takes about 0.85 s, which is most of an incremental
#: build's features (a batch of 1,000 episodes); numpy takes about 0.07 s per 100,000 shingles.
#: Same signatures either way (tests); a process that has loaded the kernels keeps using them.
SMALL_SHINGLES = 500_000


def load_kernels() -> None:
    """Compile (or load from numba's cache) the hashing and MinHash kernels now, so that every later
    ``signatures`` call of this process uses them whatever its size (3,000 documents of 308,014
    shingles: 0.05 s against numpy's 0.84 s). The MinHash benchmark does; a build's features parts do
    not: loading them in both parts of a 107,000-episode batch took its features 20.5 -> 19.8 s, within
    the noise, for 190 MB more per worker (signing is a small part of the features step)."""
    params = MinHashParams()
    a, b = permutations(params.num_perm, params.seed)
    data = np.frombuffer(b"ab", dtype=np.uint8)
    hv = np.zeros(1, dtype=np.uint32)
    _murmur3_32(data, np.array([0, 2], dtype=np.int64), np.uint32(0), hv)
    _minhash_kernel(hv, np.array([0, 1], dtype=np.int64), a, b, np.zeros((1, params.num_perm), dtype=np.uint32))


def _compiled(n: int) -> bool:
    """Whether ``n`` shingles are worth the compiled kernels (``SMALL_SHINGLES``)."""
    return n >= SMALL_SHINGLES or bool(_minhash_kernel.compiled or _murmur3_32.compiled)  # type: ignore[attr-defined]


@_jit
def _murmur3_32(data: np.ndarray, offsets: np.ndarray, seed: np.uint32, out: np.ndarray) -> None:
    # numba widens 32-bit arithmetic: every step is masked back to 32 bits
    m = np.uint64(0xFFFFFFFF)
    c1, c2 = np.uint64(0xCC9E2D51), np.uint64(0x1B873593)
    for i in numba.prange(offsets.shape[0] - 1):
        start, end = offsets[i], offsets[i + 1]
        n = end - start
        h = np.uint64(seed)
        nblocks = n // 4
        for j in range(nblocks):
            p = start + 4 * j
            k = (np.uint64(data[p]) | (np.uint64(data[p + 1]) << np.uint64(8)) | (np.uint64(data[p + 2]) << np.uint64(16))
                 | (np.uint64(data[p + 3]) << np.uint64(24)))
            k = (k * c1) & m
            k = ((k << np.uint64(15)) | (k >> np.uint64(17))) & m
            k = (k * c2) & m
            h = h ^ k
            h = ((h << np.uint64(13)) | (h >> np.uint64(19))) & m
            h = (h * np.uint64(5) + np.uint64(0xE6546B64)) & m
        tail = start + 4 * nblocks
        rest = n & 3
        k = np.uint64(0)
        if rest == 3:
            k = k ^ (np.uint64(data[tail + 2]) << np.uint64(16))
        if rest >= 2:
            k = k ^ (np.uint64(data[tail + 1]) << np.uint64(8))
        if rest >= 1:
            k = k ^ np.uint64(data[tail])
            k = (k * c1) & m
            k = ((k << np.uint64(15)) | (k >> np.uint64(17))) & m
            k = (k * c2) & m
            h = h ^ k
        h = h ^ np.uint64(n)
        h = h ^ (h >> np.uint64(16))
        h = (h * np.uint64(0x85EBCA6B)) & m
        h = h ^ (h >> np.uint64(13))
        h = (h * np.uint64(0xC2B2AE35)) & m
        h = h ^ (h >> np.uint64(16))
        out[i] = np.uint32(h)


def hash_shingles(shingles: list[str] | pl.Series) -> np.ndarray:
    """32-bit hashes of shingles, in bulk: ``SHINGLE_HASH`` over the UTF-8 bytes that Arrow already
    holds contiguously (no per-shingle Python call)."""
    series = shingles if isinstance(shingles, pl.Series) else pl.Series(shingles, dtype=pl.Utf8)
    arr = series.to_arrow()
    arr = pa.concat_arrays(arr.chunks) if isinstance(arr, pa.ChunkedArray) else arr
    arr = arr.cast(pa.large_string())
    if len(arr) and not _compiled(len(arr)):
        import mmh3

        return np.fromiter((mmh3.hash(t, _HASH_SEED, signed=False) for t in arr.to_pylist()), dtype=np.uint32,
                           count=len(arr))
    out = np.empty(len(arr), dtype=np.uint32)
    if len(arr):
        buffers = arr.buffers()
        offsets = np.frombuffer(buffers[1], dtype=np.int64)[arr.offset:arr.offset + len(arr) + 1]
        data = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.empty(0, np.uint8)
        _murmur3_32(data, offsets, np.uint32(_HASH_SEED), out)
    return out


def shingle_hash32(shingle: bytes) -> int:
    """The same hash for one shingle: what to give datasketch as ``hashfunc`` to compare."""
    return int(hash_shingles([shingle.decode("utf-8")])[0])


@_jit
def _minhash_kernel(hv: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out[d, p] = min over the document's shingles of (a[p] * h + b[p]) mod 2^32, in parallel over documents."""
    n_perm = a.shape[0]
    for d in numba.prange(offsets.shape[0] - 1):
        row = out[d]
        for i in range(offsets[d], offsets[d + 1]):
            h = hv[i]
            for p in range(n_perm):
                v = np.uint32(a[p] * h + b[p])
                if v < row[p]:
                    row[p] = v


def signatures(docs: list[list[str]], params: MinHashParams = MinHashParams()) -> np.ndarray:
    """One ``num_perm`` signature per document (``uint32``); an empty document gets all 2^32-1.

    Shingles are hashed in bulk, then a compiled kernel (numba, parallel over documents) applies
    the permutations and takes the minima without materializing the shingles x permutations
    matrix; ``signatures_numpy`` is the same computation in plain numpy (the tests compare them),
    what few shingles take (``SMALL_SHINGLES``)."""
    a, b = permutations(params.num_perm, params.seed)
    out = np.full((len(docs), params.num_perm), np.uint32(0xFFFFFFFF), dtype=np.uint32)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    if lengths.sum() == 0:
        return out
    if not _compiled(int(lengths.sum())):
        return signatures_numpy(docs, params)
    hv = fmix32(hash_shingles(pl.Series([s for d in docs for s in d], dtype=pl.Utf8)))
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    _minhash_kernel(hv, offsets, a, b, out)
    return out


def signatures_numpy(docs: list[list[str]], params: MinHashParams = MinHashParams()) -> np.ndarray:
    """The reference array implementation (chunks of shingles x permutations, ``minimum.reduceat``)."""
    a, b = permutations(params.num_perm, params.seed)
    out = np.full((len(docs), params.num_perm), np.uint32(0xFFFFFFFF), dtype=np.uint32)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    if lengths.sum() == 0:
        return out
    flat = pl.Series([s for d in docs for s in d], dtype=pl.Utf8)
    hv = fmix32(hash_shingles(flat))
    doc_of = np.repeat(np.arange(len(docs)), lengths)
    for start in range(0, len(hv), _CHUNK):
        chunk = hv[start:start + _CHUNK, None] * a[None, :] + b[None, :]  # uint32 wrap-around = mod 2^32
        owners = doc_of[start:start + _CHUNK]
        cut = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
        mins = np.minimum.reduceat(chunk, cut, axis=0)
        rows = owners[cut]
        out[rows] = np.minimum(out[rows], mins)
    return out


@cache
def optimal_bands(threshold: float, num_perm: int, fp_weight: float = 0.5, fn_weight: float = 0.5) -> tuple[int, int]:
    """(bands, rows) minimizing the weighted false-positive + false-negative probability areas."""
    def area(f, lo: float, hi: float, n: int = 200) -> float:
        xs = np.linspace(lo, hi, n)
        return float(np.trapezoid(f(xs), xs))

    best, best_err = (1, num_perm), float("inf")
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            fp = area(lambda s, r=rows, b=bands: 1 - (1 - s ** r) ** b, 0.0, threshold)
            fn = area(lambda s, r=rows, b=bands: 1 - (1 - (1 - s ** r) ** b), threshold, 1.0)
            err = fp_weight * fp + fn_weight * fn
            if err < best_err:
                best, best_err = (bands, rows), err
    return best


def lsh_pairs(sigs: np.ndarray, params: MinHashParams = MinHashParams()) -> np.ndarray:
    """Candidate pairs (i < j) sharing a band bucket, verified by estimated Jaccard >= threshold;
    sorted. A bucket of more than 64 documents is a star around its smallest member (linear)."""
    bands, rows = params.bands
    n = len(sigs)
    if n < 2:
        return np.empty((0, 2), dtype=np.int64)
    codes = []
    for band in range(bands):
        block = np.ascontiguousarray(sigs[:, band * rows:(band + 1) * rows])
        keys = block.view(np.dtype((np.void, block.dtype.itemsize * rows))).ravel()
        order = np.argsort(keys, kind="stable")  # members of a bucket come in index order
        sorted_keys = keys[order]
        starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
        sizes = np.diff(np.r_[starts, n])
        for m in np.unique(sizes[sizes > 1]).tolist():
            first = starts[sizes == m]
            if m > 64:  # a huge bucket: a star around its smallest member keeps it linear
                members = np.concatenate([order[s:s + m] for s in first.tolist()])
                hub = np.repeat(order[first], m)
                keep = members != hub
                codes.append(hub[keep] * n + members[keep])
                continue
            members = order[first[:, None] + np.arange(m)[None, :]]  # buckets x m, each row ascending
            i, j = np.triu_indices(m, 1)
            codes.append((members[:, i] * n + members[:, j]).ravel())
    if not codes:
        return np.empty((0, 2), dtype=np.int64)
    code = np.unique(np.concatenate(codes).astype(np.int64))
    arr = np.stack([code // n, code % n], axis=1)
    return arr[pair_similarity(sigs, arr) >= params.threshold]


def pair_similarity(sigs: np.ndarray, pairs: np.ndarray, chunk: int = 65_536) -> np.ndarray:
    """Estimated Jaccard (share of equal MinHash values) of each pair, a chunk of pairs at a time."""
    return np.concatenate([(sigs[pairs[s:s + chunk, 0]] == sigs[pairs[s:s + chunk, 1]]).mean(axis=1)
                           for s in range(0, len(pairs), chunk)] or [np.empty(0)])
