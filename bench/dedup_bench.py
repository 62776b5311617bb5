"""MinHash speed against datasketch on the same shingles, and curation at 100,000 episodes.

1. Signatures: ours (``dedup.minhash.signatures``, vectorized) vs ``datasketch.MinHash.update_batch``
   (its default sha1 hash, one MinHash per document) over the same action shingles; the ratio is
   the figure. Identical signatures for one hash family are checked by the tests.
2. Curation at scale: synthetic episode features (action sequences, model text, task keys, times)
   for 100,000 episodes in memory, then near-duplicate clusters + groups + splits, timed, with the
   process's peak RSS. Run in a subprocess so the peak is its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import peak_rss_mb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _synthetic_features(n: int):
    from trajwh.dedup.features import EpisodeFeatures, normalize_object
    from trajwh.ingest.actions import annotate_step
    from trajwh.synth.generator import SynthConfig, _Generator

    gen = _Generator(SynthConfig(episodes=n, seed=9))
    out = []
    for i in range(n):
        ep, _ = gen.episode(i)
        actions, text = [], []
        for s in ep["steps"]:
            if s["author"] != "model":
                continue
            row = {"author": "model", "text": s.get("text"), "tool_calls": [
                {"name": c["name"], "arguments": json.dumps(c["arguments"])} for c in s.get("tool_calls") or []]}
            annotate_step(row)
            if row.get("action_kind"):
                actions.append(f"{row['action_kind']}:{normalize_object(row.get('action_object'))}")
            if s.get("text"):
                text.append(s["text"])
        t = ep["task"]
        out.append(EpisodeFeatures(f"ep{i:06d}", actions=actions, text="\n".join(text), repository=t["repository"],
                                   base_commit=t["base_commit"], task_id=t["task_id"], instance_id=t["instance_id"],
                                   issue_created_at=t["issue_created_at"], fix_merged_at=t["fix_merged_at"],
                                   started_at=ep["started_at"], resolved=ep["outcome"].get("resolved"),
                                   n_steps=len(ep["steps"])))
    return out


def minhash_vs_datasketch(n_docs: int = 3000) -> dict:
    from datasketch import MinHash
    from trajwh.dedup.features import action_shingles, text_shingles
    from trajwh.dedup.minhash import MinHashParams, load_kernels, signatures

    feats = _synthetic_features(n_docs)
    docs = [action_shingles(f.actions) + text_shingles(f.text) for f in feats]
    n_shingles = sum(len(d) for d in docs)
    params = MinHashParams()
    # the compiled kernels (what a big batch's features use), loaded outside the timing: a call of
    # fewer than minhash.SMALL_SHINGLES shingles in a process without them runs on numpy, about 10x slower
    load_kernels()
    signatures(docs[:2], params)
    t0 = time.perf_counter()
    signatures(docs, params)
    ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    for d in docs:
        m = MinHash(num_perm=params.num_perm, seed=params.seed)
        m.update_batch([s.encode("utf-8") for s in d])
    theirs = time.perf_counter() - t0
    return {"documents": n_docs, "shingles": n_shingles, "ours_s": round(ours, 3), "datasketch_s": round(theirs, 3),
            "ours_shingles_per_s": round(n_shingles / ours), "datasketch_shingles_per_s": round(n_shingles / theirs),
            "speedup": round(theirs / ours, 1)}


def _scale_child(n: int) -> None:
    from trajwh.dedup.groups import assign_groups
    from trajwh.dedup.layer import CurateConfig, near_duplicates
    from trajwh.dedup.splits import assign_splits

    t0 = time.perf_counter()
    feats = _synthetic_features(n)
    t_feat = time.perf_counter() - t0
    t0 = time.perf_counter()
    clusters = near_duplicates(feats, CurateConfig())
    t_dup = time.perf_counter() - t0
    t0 = time.perf_counter()
    cfg = CurateConfig()
    groups = assign_groups(feats, cfg.groups, clusters.cluster_of, cutoff=cfg.splits.cutoff)
    splits = assign_splits(feats, groups.group_of, cfg.splits, repository_of=groups.repository_of,
                           keys_of=groups.keys_of, cut_keys=groups.cut_keys)
    t_grp = time.perf_counter() - t0
    print(json.dumps({"episodes": n, "features_s": round(t_feat, 1), "near_dup_s": round(t_dup, 1),
                      "groups_and_splits_s": round(t_grp, 1), "clusters": len(set(clusters.cluster_of.values())),
                      "groups": len(set(groups.group_of.values())),
                      "largest_group": max(Counter(groups.group_of.values()).values()),
                      "splits": {s: sum(r.split == s for r in splits) for s in ("train", "valid", "test", "held_out")},
                      "peak_rss_mb": round(peak_rss_mb())}))


def at_scale(n: int = 100_000) -> dict:
    r = subprocess.run([sys.executable, __file__, "--scale", str(n)], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--scale":
        _scale_child(int(sys.argv[2]))
    else:
        print(json.dumps({"minhash": minhash_vs_datasketch(), "scale": at_scale(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)}, indent=2))
