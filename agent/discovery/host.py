"""The host facts every inventory carries, whatever found the GPUs: CPUs and memory."""

from __future__ import annotations

import os
from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def cpu_count() -> int:
    """CPUs this process may run on.

    The affinity mask rather than ``os.cpu_count()``: an agent in a container pinned to a cpuset sees
    every CPU of the host in ``os.cpu_count()``, but can only schedule engines on its own.
    """
    sched_getaffinity = getattr(os, "sched_getaffinity", None)
    if sched_getaffinity is not None:
        try:
            return len(sched_getaffinity(0))
        except OSError:
            pass
    return os.cpu_count() or 0


def parse_meminfo(text: str) -> int:
    """MemTotal from ``/proc/meminfo`` text, in MiB (the kernel reports kB); 0 when absent."""
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key.strip() == "MemTotal":
            fields = rest.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) // 1024
    return 0


def memory_total_mib(path: Path = MEMINFO) -> int:
    """Total memory of the host in MiB; 0 where there is no /proc (a node still registers)."""
    try:
        return parse_meminfo(path.read_text())
    except OSError:
        return 0
