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


def test_run_parts_gives_the_other_tasks_to_a_pool_already_started_and_leaves_it_open():
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    here = os.getpid()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        worker = pool.submit(os.getpid).result()
        out = run_parts(_whose, [1, 2, 3], pool=pool)
        assert out == [(1, here), (2, worker), (3, worker)]  # the pool's one worker took both others
        assert pool.submit(_whose, 4).result() == (4, worker)  # still open, the same process


_ORPHAN = """
import os, signal, sys, multiprocessing
from concurrent.futures import ProcessPoolExecutor
sys.path.insert(0, sys.argv[1])
from trajwh.lineage.parallel import die_with_parent

if __name__ == "__main__":
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=die_with_parent, initargs=(os.getpid(),))
    print(pool.submit(os.getpid).result(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # killed with its worker idle: no shutdown
"""


def test_a_worker_set_to_die_with_its_parent_ends_when_the_parent_is_killed(tmp_path: Path):
    import subprocess
    import sys
    import time

    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    # output to a file, not a pipe: an orphan that lived on would hold a pipe open
    out = tmp_path / "out.txt"
    with out.open("w") as f:
        proc = subprocess.run([sys.executable, str(script), str(Path(__file__).resolve().parents[1])], stdout=f,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    worker = int(out.read_text().split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(worker).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        psutil.Process(worker).kill()
        raise AssertionError(f"worker {worker} outlived its killed parent")
