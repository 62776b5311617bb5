"""Per-file summary of the real corpus as the warehouse sees it (used by the golden tests)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from trajwh.lineage.catalog import Warehouse


def corpus_summary(wh: Warehouse, corpus: Path) -> dict[str, list[dict]]:
    episodes = wh.query("""
        SELECT r.file_path, e.format, e._record_index AS idx, e.trajectory_key, e.n_steps, e.resolved,
               e.exit_status, e.instance_id, e.policy_name, e.harness_name
        FROM episodes e JOIN raw_records r ON r.record_id = e._record_id
        ORDER BY r.file_path, r.byte_offset, e._record_index""").to_pylist()
    steps = wh.query("""SELECT trajectory_key, step_index, author, action_kind FROM steps
                        ORDER BY trajectory_key, step_index""").to_pylist()
    by_key: dict[str, list[dict]] = {}
    for s in steps:
        by_key.setdefault(s["trajectory_key"], []).append(s)
    out: dict[str, list[dict]] = {}
    for e in episodes:
        st = by_key.get(e["trajectory_key"], [])
        actions = [s["action_kind"] for s in st if s["action_kind"]]
        rel = str(Path(e["file_path"]).relative_to(corpus))
        out.setdefault(rel, []).append({
            "format": e["format"], "steps": e["n_steps"],
            "authors": dict(sorted(Counter(s["author"] for s in st).items())),
            "first_action": actions[0] if actions else None, "last_action": actions[-1] if actions else None,
            "resolved": e["resolved"], "exit_status": e["exit_status"], "instance_id": e["instance_id"],
            "policy": e["policy_name"], "harness": e["harness_name"],
        })
    return out


def main() -> None:
    """Regenerate the golden file after a deliberate change: ``python tests/corpus_summary.py``.

    Review the diff (``git diff tests/golden``) before committing: each changed entry must be
    explained by the change to the adapters or by new files in the corpus.
    """
    import json
    import sys
    import tempfile

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from trajwh.ingest.normalize import normalize_warehouse
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths

    corpus = (root.parent / "shared" / "corpus").resolve()
    if not corpus.is_dir():
        sys.exit(f"real corpus not found at {corpus}")
    with tempfile.TemporaryDirectory() as tmp:
        wh = Warehouse(Path(tmp) / "wh")
        ingest_paths(wh, [corpus], IngestOptions(source="corpus"))
        normalize_warehouse(wh, run_id="corpus")
        summary = corpus_summary(wh, corpus)
    out = root / "tests" / "golden" / "corpus.json"
    out.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}: {len(summary)} files, {sum(len(v) for v in summary.values())} episodes")


if __name__ == "__main__":
    main()
