"""Near-duplicate clusters updated from the last curation's state equal a full computation
(issue 14: "clusters are updated, not recomputed"), through additions, removals, episodes whose
features changed, and buckets that grow past and fall below the big-bucket size."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from trajwh.dedup.clusters import ClusterState, cluster_frame
from trajwh.dedup.engines import BIG_BUCKET, band_keys
from trajwh.dedup.frame import SCHEMA, sig_bytes
from trajwh.dedup.layer import CurateConfig

CFG = CurateConfig()
PERM = CFG.minhash.num_perm
BANDS, ROWS = CFG.minhash.bands


def _signature(rng: np.random.Generator, family: int | None, noise: float) -> np.ndarray:
    """A random signature, or a member of a family: the family's base with a share ``noise`` of its
    values replaced (so members are near duplicates of each other when ``noise`` is small)."""
    if family is None:
        return rng.integers(0, 2**32, PERM, dtype=np.uint64).astype(np.uint32)
    base = np.random.default_rng(10_000 + family).integers(0, 2**32, PERM, dtype=np.uint64).astype(np.uint32)
    out = base.copy()
    hit = rng.random(PERM) < noise
    out[hit] = rng.integers(0, 2**32, int(hit.sum()), dtype=np.uint64).astype(np.uint32)
    return out


def _bucket_signature(rng: np.random.Generator, bucket: int) -> np.ndarray:
    """Same first band as every other member of ``bucket``, the rest random: a bucket whose members
    are mostly not near duplicates (a big bucket's star decides what is a candidate)."""
    out = rng.integers(0, 2**32, PERM, dtype=np.uint64).astype(np.uint32)
    out[:ROWS] = np.random.default_rng(20_000 + bucket).integers(0, 2**32, ROWS, dtype=np.uint64).astype(np.uint32)
    if rng.random() < 0.4:  # some members close to the bucket's first values elsewhere too
        base = np.random.default_rng(30_000 + bucket).integers(0, 2**32, PERM, dtype=np.uint64).astype(np.uint32)
        keep = rng.random(PERM) < 0.9
        out[keep] = base[keep]
        out[:ROWS] = np.random.default_rng(20_000 + bucket).integers(0, 2**32, ROWS, dtype=np.uint64).astype(np.uint32)
    return out


def _episode(rng: np.random.Generator, key: str, force: int | None = None) -> dict:
    kind, bucket = (0.5 if force is not None else rng.random()), None
    if kind < 0.3:
        sig = _signature(rng, int(rng.integers(0, 12)), 0.15)
    elif kind < 0.75:  # a bucket about the big-bucket size, and one about half of it
        bucket = force if force is not None else 0 if rng.random() < 0.75 else 1
        sig = _bucket_signature(rng, bucket)
    else:
        sig = _signature(rng, None, 0)
    text = _signature(rng, int(rng.integers(0, 6)), 0.1) if rng.random() < 0.5 else None
    exact = f"x{int(rng.integers(0, 8))}" if rng.random() < 0.1 else None
    return {"trajectory_key": key, "action_signature": sig, "text_signature": text, "exact_digest": exact,
            "resolved": bool(rng.random() < 0.5), "n_steps": int(rng.integers(1, 30)), "bucket": bucket}


def _frame(episodes: dict[str, dict]) -> pl.DataFrame:
    rows = []
    for key in sorted(episodes):
        e = episodes[key]
        bands = {c: (None if e[s] is None else band_keys(e[s][None, :], BANDS, ROWS)[0].astype("<i8").tobytes())
                 for s, c in (("action_signature", "action_bands"), ("text_signature", "text_bands"))}
        rows.append({c: None for c in SCHEMA} | {
            "failing_tests": [], "touched_files": [], "patch_symbols": [], "trajectory_key": key,
            "exact_digest": e["exact_digest"], "resolved": e["resolved"], "n_steps": e["n_steps"],
            "action_signature": sig_bytes(e["action_signature"]), "text_signature": sig_bytes(e["text_signature"]),
            **bands})
    return pl.DataFrame(rows, schema=SCHEMA)


@pytest.mark.parametrize("engine", ["duckdb", "daft"])
def test_an_update_of_the_clusters_equals_a_full_computation(engine: str):
    if engine == "daft":
        pytest.importorskip("daft")
    cfg = CurateConfig(engine=engine)
    rng = np.random.default_rng(7)
    episodes = {f"k{i:04d}": _episode(rng, f"k{i:04d}") for i in range(220)}
    df = _frame(episodes)
    frame, info = cluster_frame(df, cfg)
    assert not info.incremental and info.big["actions"], "the population has a big bucket to start with"
    saw = {"kept": 0, "verified_less": 0, "big_changed": 0, "big_sizes": [info.big["actions"][0][2]]}
    for step in range(5):
        removed = sorted(rng.choice(sorted(episodes), size=int(rng.integers(5, 90)), replace=False))
        if step == 1:  # the big bucket falls below the size (all its pairs are candidates), then grows past it
            in_big = sorted(k for k, e in episodes.items() if e["bucket"] == 0)
            removed = sorted(set(removed) | set(in_big[: 2 * (len(in_big) - BIG_BUCKET + 8)]))
        for key in removed[: len(removed) // 2]:
            del episodes[key]
        changed = set(removed[len(removed) // 2:])  # the same key, new features (a batch featurized again)
        for key in sorted(changed):
            episodes[key] = _episode(rng, key)
        added = {f"n{step}-{i:03d}" for i in range(int(rng.integers(1, 60)))}
        for key in sorted(added):
            episodes[key] = _episode(rng, key)
        if step == 3:  # and grows past it again
            in_big = sum(e["bucket"] == 0 for e in episodes.values())
            for i in range(max(0, BIG_BUCKET + 6 - in_big)):
                added.add(f"n{step}-big{i:03d}")
                episodes[f"n{step}-big{i:03d}"] = _episode(rng, f"n{step}-big{i:03d}", force=0)
        df = _frame(episodes)
        state = ClusterState(links=frame.select("trajectory_key", "links"), big=info.big,
                             changed=df["trajectory_key"].is_in(sorted(changed | added)).to_numpy())
        updated, up = cluster_frame(df, cfg, state)
        full, full_info = cluster_frame(df, cfg)
        assert up.incremental and up.big == full_info.big
        assert updated.to_dicts() == full.to_dicts(), f"step {step}"
        saw["kept"] += up.kept
        saw["verified_less"] += up.verified < full_info.verified
        before = {tuple(b[:2]): b[2:] for b in info.big["actions"]}
        saw["big_changed"] += any(before.get(tuple(b[:2])) != b[2:] for b in up.big["actions"]) or len(before) != len(
            up.big["actions"])
        saw["big_sizes"].append(max([b[2] for b in up.big["actions"]], default=0))
        frame, info = updated, up
    # the update did the work it claims: earlier links were kept, fewer pairs verified, big buckets moved
    assert saw["kept"] > 0 and saw["verified_less"] >= 3 and saw["big_changed"] > 0, saw
    assert 0 in saw["big_sizes"] and saw["big_sizes"][-1] > BIG_BUCKET, saw  # below the size and back
    assert any(len(v) for v in frame["links"].to_list())
    assert max(frame["cluster_size"]) > 1


def test_a_big_bucket_links_as_a_star_and_its_update_follows_its_smallest_member():
    """Over ``BIG_BUCKET`` members a bucket makes only its star; when its smallest member goes, the
    star moves to the next, and links only the old star made go with it."""
    rng = np.random.default_rng(3)
    episodes = {f"b{i:03d}": {"trajectory_key": f"b{i:03d}", "action_signature": _bucket_signature(rng, 0),
                              "text_signature": None, "exact_digest": None, "resolved": False, "n_steps": 3}
                for i in range(BIG_BUCKET + 5)}
    df = _frame(episodes)
    frame, info = cluster_frame(df, CFG)
    assert [b[2] for b in info.big["actions"]] == [BIG_BUCKET + 5]
    del episodes["b000"]
    df = _frame(episodes)
    state = ClusterState(links=frame.select("trajectory_key", "links"), big=info.big,
                         changed=np.zeros(df.height, dtype=bool))
    updated, up = cluster_frame(df, CFG, state)
    assert up.verified > 0  # the new star's pairs were verified
    assert updated.to_dicts() == cluster_frame(df, CFG)[0].to_dicts()


def test_a_recorded_state_that_does_not_fit_gives_the_full_computation():
    """The state a curate run records is read back only in the shape it was written with, made with
    the same settings; anything else (an older run, a row edited by hand) means a full computation."""
    from trajwh.dedup.layer import _state_fits, cluster_version

    version = cluster_version(CFG)
    good = {"version": version, "basis": {"b1": "features@1.2.0;inputs=x"},
            "big": {"actions": [[0, -5, 70, "d" * 16]], "text": []}}
    assert _state_fits(good, version)
    assert not _state_fits(good, cluster_version(CurateConfig(action_k=4)))  # other settings
    for bad in (None, [], {**good, "version": None}, {**good, "basis": ["b1"]}, {**good, "basis": {"b1": 3}},
                {**good, "big": []}, {**good, "big": {"actions": [[0, -5, 70]]}},
                {**good, "big": {"actions": [[0, "k", 70, "d"]]}}, {**good, "big": {"actions": "x"}}):
        assert not _state_fits(bad, version), bad
