"""The build's memory budget (issue 14: <= 2 GB at 107,000 episodes, <= 1 GB at 20,000):
``$TRAJWH_MEMORY_MB`` sizes every buffer measured at the default budget and decides how many
worker processes run; whatever it is, the tables are the same."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
from test_incremental import DERIVED, rows
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.parallel import (
    DEFAULT_BUDGET_MB,
    duckdb_memory,
    memory_budget_mb,
    run_parts,
    scaled_mb,
    workers_within,
)
from trajwh.pipelines.definitions import build
from trajwh.redaction.engine import MEMO_CHARS, Detector, default_memo_chars
from trajwh.redaction.vault import Vault


def test_buffers_scale_with_the_budget(monkeypatch):
    monkeypatch.delenv("TRAJWH_MEMORY_MB", raising=False)
    assert memory_budget_mb() == DEFAULT_BUDGET_MB
    # at the default budget the measured sizes themselves
    assert scaled_mb(512) == 512 and duckdb_memory(384) == "384MB" and default_memo_chars() == MEMO_CHARS
    monkeypatch.setenv("TRAJWH_MEMORY_MB", "1024")
    assert scaled_mb(512) == 256 and duckdb_memory(384) == "192MB" and default_memo_chars() == MEMO_CHARS // 2
    assert Detector()._memo_budget == MEMO_CHARS // 2 and Detector(memo_chars=0)._memo_budget == 0
    monkeypatch.setenv("TRAJWH_MEMORY_MB", "100")  # below the least budget: 256
    assert memory_budget_mb() == 256
    assert duckdb_memory(192) == "128MB"  # DuckDB's floor: below it a sort of long texts cannot spill
    assert scaled_mb(10, floor=32) == 32


def test_workers_fit_the_budget_beside_this_process(monkeypatch):
    held = psutil.Process().memory_info().rss / 2**20
    monkeypatch.setenv("TRAJWH_MEMORY_MB", str(int(held + 2 * 300 + 100)))
    assert workers_within(4, 300) == 2
    assert workers_within(1, 300) == 1
    monkeypatch.setenv("TRAJWH_MEMORY_MB", str(int(held)))  # not even one fits: still one (a pool needs one)
    assert workers_within(4, 300) == 1


def _whose(task: int) -> tuple[int, int]:
    return task, os.getpid()


def test_run_parts_elsewhere_runs_every_task_in_a_worker():
    here = os.getpid()
    out = run_parts(_whose, [1, 2, 3], here=False)
    assert [t for t, _ in out] == [1, 2, 3] and all(pid != here for _, pid in out)
    out = run_parts(_whose, [4], here=False)  # one task too: in a worker, not here
    assert out[0][0] == 4 and out[0][1] != here
    out = run_parts(_whose, [5, 6])
    assert out[0] == (5, here) and out[1][1] != here


def test_a_build_within_a_small_budget_equals_one_within_the_default(tmp_path: Path, small_corpus: Path, monkeypatch):
    """The least budget (DuckDB's streams at their floor, the redaction memo at a sixth) with the
    batch's redaction and signatures in worker processes (as many as the budget holds: one),
    against the default budget with no workers at all: the same rows in every derived table."""
    import trajwh.dedup.layer as curate_layer
    import trajwh.redaction.layer as redact_layer

    seed = Warehouse(tmp_path / "seed")
    ingest_paths(seed, [small_corpus], IngestOptions(source="synthetic"))
    Vault(seed, None).salt()  # one placeholder salt for both copies
    small, default = Warehouse(tmp_path / "small"), Warehouse(tmp_path / "default")
    shutil.copytree(seed.root, small.root)
    shutil.copytree(seed.root, default.root)

    monkeypatch.setenv("TRAJWH_WORKERS", "1")
    build(str(default.root))

    monkeypatch.setenv("TRAJWH_WORKERS", "2")
    monkeypatch.setenv("TRAJWH_MEMORY_MB", "256")
    monkeypatch.setattr(redact_layer, "PARALLEL_MIN_EPISODES", 1)
    monkeypatch.setattr(curate_layer, "PARALLEL_MIN_ITEMS", 1)
    build(str(small.root))
    for table in ("episodes", "redacted_episodes", "redacted_steps", "redaction_events", *DERIVED):
        assert rows(small, table) == rows(default, table), f"{table}: a small budget changed the rows"


def test_fewer_collections_raises_the_thresholds_inside_and_restores_them():
    import gc

    import pytest
    from trajwh.lineage.parallel import fewer_collections

    before = gc.get_threshold()
    with fewer_collections(young=12_345):
        assert gc.get_threshold()[0] == 12_345
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), fewer_collections():
        raise RuntimeError("an error inside")
    assert gc.get_threshold() == before


def test_no_huge_pages_turns_them_off_inside_for_workers_too_and_back_after():
    import multiprocessing
    import sys
    from concurrent.futures import ProcessPoolExecutor

    import pytest
    from trajwh.lineage.parallel import no_huge_pages

    if not sys.platform.startswith("linux"):
        pytest.skip("prctl's huge-page switch is Linux's")
    if _thp_disabled() != 0:
        pytest.skip("huge pages are already off for this process")
    with no_huge_pages():
        assert _thp_disabled() == 1
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            assert pool.submit(_thp_disabled).result() == 1  # a worker started inside inherits it
    assert _thp_disabled() == 0


def _thp_disabled() -> int:
    import ctypes

    from trajwh.lineage.parallel import _PR_GET_THP_DISABLE

    return ctypes.CDLL(None).prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0)
