"""This process's own peak RSS, for the benchmarks that measure a step in a child process."""

from __future__ import annotations

import resource


def peak_rss_mb() -> float:
    """``VmHWM`` (per address space, reset by ``exec``). Not ``ru_maxrss``: Linux carries a forked
    parent's high-water mark over ``exec`` into it, so a child started from a big parent reports the
    parent's size (measured: a child of a 1.5 GB parent reported 1,511 MB, its own VmHWM 11 MB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
