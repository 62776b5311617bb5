"""Per-batch work on every core: chunks of items mapped in worker processes, results in input order.

Used by the per-batch stages (normalize, redact) for big batches. Workers are spawned, not
forked (DuckDB and numba threads live in the parent), each set up once by ``initializer``; at
most ``2 x workers`` chunks are in flight, so memory stays flat whatever the batch size.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

#: a batch with at least this many items is worth the workers' start-up (about a second each)
PARALLEL_MIN_ITEMS = 2_000


def workers_wanted() -> int:
    """``$TRAJWH_WORKERS`` or the machine's cores (at most 8); 1 turns worker processes off."""
    env = os.environ.get("TRAJWH_WORKERS")
    if env:
        return max(1, int(env))
    return max(1, min(8, os.cpu_count() or 1))


def memory_budget_mb() -> int:
    """What a build may hold in memory, all its processes together: ``$TRAJWH_MEMORY_MB``, else
    2,048 (ARCHITECTURE.md: the whole build within 2 GB at the design's scale)."""
    env = os.environ.get("TRAJWH_MEMORY_MB")
    return max(256, int(env)) if env else DEFAULT_BUDGET_MB


#: the default memory budget, and the one every fixed buffer size in the code was measured at
DEFAULT_BUDGET_MB = 2_048


def scaled_mb(mb_at_default: int, floor: int = 32) -> int:
    """A buffer measured at the default budget, scaled to the budget this build has (at least
    ``floor``): DuckDB's memory limit for a stream's sorts and joins, the redaction memo. At the
    default the sizes are the measured ones; a smaller budget spills sooner instead of holding more."""
    return max(floor, mb_at_default * memory_budget_mb() // DEFAULT_BUDGET_MB)


def duckdb_memory(mb_at_default: int) -> str:
    """``scaled_mb`` as a DuckDB ``memory_limit`` value, at least 128 MB: below that a sort of long
    step texts runs out of memory instead of spilling (measured: 96 MB failed to pin a block at
    20,000 episodes)."""
    return f"{scaled_mb(mb_at_default, floor=128)}MB"


def parts_within(wanted: int, part_mb: int, worker_base_mb: int = 150) -> int:
    """How many parts (``run_parts``: one in this process, each other one in a worker of about
    ``worker_base_mb`` of libraries) fit the memory budget beside what this process holds now,
    each part's working set ``part_mb``; at least one. A build's process can hold much by the time
    its last stages run (Dagster, the heaps of earlier stages): parts that fit on their own can
    then overrun the budget together, and fewer parts is slower but stays within it."""
    return _fitting(wanted, lambda n: part_mb + (n - 1) * (worker_base_mb + part_mb))


def workers_within(wanted: int, worker_mb: int) -> int:
    """How many worker processes of about ``worker_mb`` each (libraries and work) fit the memory
    budget beside what this process holds now, for a pool that does all the work in its workers
    (``ordered_chunks``); at least one."""
    return _fitting(wanted, lambda n: n * worker_mb)


def _fitting(wanted: int, needs_mb: Callable[[int], float]) -> int:
    """The most processes, up to ``wanted`` and at least one, whose ``needs_mb(n)`` fits the budget
    beside what this process holds once it has given back what it freed."""
    import psutil

    if wanted <= 1:
        return 1
    release_memory()
    held = psutil.Process().memory_info().rss / 2**20
    n = wanted
    while n > 1 and held + needs_mb(n) > memory_budget_mb():
        n -= 1
    return n


@contextlib.contextmanager
def fewer_collections(young: int = 50_000) -> Iterator[None]:
    """Python's cycle collector run less often inside (its young generation collected after
    ``young`` new container objects instead of 700; the older ones less often too), thresholds
    restored after. Work that makes many short-lived rows as dicts and lists (a forget at 108,070
    episodes: 2,301 collections took 1.0 s) makes few cycles; they wait a little longer."""
    import gc

    before = gc.get_threshold()
    gc.set_threshold(young, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _linux_libc() -> Any:
    """The C library, for ``prctl``; None off Linux (or when it cannot be loaded)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


#: prctl(2) options: whether transparent huge pages are off for this process (and its children)
_PR_SET_THP_DISABLE, _PR_GET_THP_DISABLE = 41, 42


@contextlib.contextmanager
def no_huge_pages() -> Iterator[None]:
    """Transparent huge pages off for this process inside (and for the worker processes it starts
    meanwhile: the setting is inherited), as it was after; Linux only, a no-op elsewhere. Arrow's
    allocator (mimalloc) asks for huge pages on its arenas and gives freed memory back soon after,
    so memory it takes again is faulted in 2 MB at a time, each zeroed by the kernel: work made of
    many reads of middling files (a forget) then spends much of its time in the kernel (reading the
    9 MB task groups file of a 108,070-episode warehouse: 1.7 s of system time with them, 0.3 s
    without). A full build, whose large DuckDB joins may gain from huge pages, keeps them."""
    libc = _linux_libc()
    # changed only when they were on and the switch took (it stays as it was otherwise)
    changed = (libc is not None and libc.prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0) == 0
               and libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0)
    try:
        yield
    finally:
        if changed:
            libc.prctl(_PR_SET_THP_DISABLE, 0, 0, 0, 0)


#: prctl(2) option: the signal this process gets when the thread that started it ends
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In a worker process (an ``initializer``): end it when ``parent`` (the process that started
    it) dies. A pool's worker whose parent was killed would otherwise wait for tasks for ever (it
    holds its own end of the task queue) and keep the parent's output pipes open. Linux: the
    kernel sends it SIGKILL when the parent's thread that started it ends (a spawned pool starts
    its workers in the thread that first gives it tasks: keep that thread for the pool's life);
    elsewhere a thread looks for the parent every second."""
    import signal
    import threading
    import time

    libc = _linux_libc()
    if libc is None or libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    if os.getppid() != parent:  # died before the signal was asked for
        os._exit(1)


def release_memory() -> None:
    """Give freed memory back to the system before worker processes start beside this one: a
    build's process keeps the heap of its earlier stages (Python's objects, Arrow's pool) after
    they are freed, and its resident size counts with the workers' against the memory bound."""
    import ctypes
    import gc

    gc.collect()
    try:
        import pyarrow as pa

        pa.default_memory_pool().release_unused()
    except Exception:  # noqa: BLE001 - an optimization only
        pass
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def ordered_chunks(fn: Callable[[list[Any]], Any], items: Iterable[Any], *, chunk: int, workers: int,
                   initializer: Callable[..., None] | None = None,
                   initargs: tuple[Any, ...] = ()) -> Iterator[tuple[list[Any], Any]]:
    """``(chunk, fn(chunk))`` for consecutive chunks of ``items``, in input order."""
    release_memory()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=initializer, initargs=initargs) as pool:
        pending: collections.deque = collections.deque()
        part: list[Any] = []
        for item in items:
            part.append(item)
            if len(part) >= chunk:
                pending.append((part, pool.submit(fn, part)))
                part = []
                while len(pending) > 2 * workers:
                    done, fut = pending.popleft()
                    yield done, fut.result()
        if part:
            pending.append((part, pool.submit(fn, part)))
        while pending:
            done, fut = pending.popleft()
            yield done, fut.result()


def run_parts(fn: Callable[[Any], Any], tasks: list[Any], *, here: bool = True,
              pool: ProcessPoolExecutor | None = None) -> list[Any]:
    """``[fn(t) for t in tasks]``, at the same time: the first task in this process, each other one
    in a worker process of its own (spawned). One process fewer than a pool of ``len(tasks)``
    workers: the parent's libraries are loaded already, and memory holds one process's base less
    (about 150 MB of libraries and a part's working set). ``fn`` is a module-level function.

    ``here=False``: every task in a worker, this process waiting; for work that loads what would
    stay in this process for the rest of a build (numba's compiler: about 190 MB). ``pool``: the
    other tasks go to its workers, already started (a spawned process imports its libraries for
    about a second), instead of new ones; it stays open."""
    if len(tasks) <= 1 and here:
        return [fn(t) for t in tasks]
    ctx = multiprocessing.get_context("spawn")
    with (contextlib.nullcontext(pool) if pool is not None else
          ProcessPoolExecutor(len(tasks) - (1 if here else 0), mp_context=ctx)) as pool:
        others = [pool.submit(fn, t) for t in tasks[(1 if here else 0):]]
        # while the workers start (a spawned process imports its libraries for about a second before
        # its working set grows), not before: the release's collection (0.3-0.6 s in a build's
        # process) no longer delays them
        release_memory()
        if not here:
            return [f.result() for f in others]
        try:
            first = fn(tasks[0])
        except BaseException:
            for f in others:
                f.cancel()
            raise
        return [first, *(f.result() for f in others)]
