"""Giving a large body's memory back to the system, at no cost per request.

glibc serves allocations above ``M_MMAP_THRESHOLD`` with mmap, but raises that threshold to the
largest block freed so far (up to 32 MiB): after a few 1 MiB request bodies, later ones come from
the heap, whose free space is seldom returned. Measured (tests/test_memory.py): 300 refused bodies
of 1 MiB, 20 at a time, left a process 24 MB larger.

Fixing the threshold at 128 KiB gave that memory back (+1 MB), but made every large allocation an
mmap, page faults and all: a 220 KB prompt's analysis cost ~2.5 ms more of CPU (~60% more). Instead,
``HeapTrim`` calls ``malloc_trim`` once the process has grown by some megabytes since it last did:
~2 ms now and then (the 24 MB came back to +0.5 MB), nothing on a request's path.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

log = logging.getLogger("llmgw.memory")
TRIM_SLACK_BYTES = 8 << 20  # growth since the last trim that is worth a trim
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident set size (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _malloc_trim() -> Callable[[int], int] | None:
    # The C library already loaded in this process, not ctypes.util.find_library("c"): that runs
    # ldconfig in a child process, and a fork beside gRPC's running event engine can abort the
    # worker (grpc/grpc#43055: its poller restarted in the child meets a closed epoll fd).
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS)
        return None


class HeapTrim:
    """Call it now and then (housekeeping, after a large job): it gives the heap's free memory back
    to the system when the process grew by ``slack_bytes`` or more since the last trim."""

    def __init__(self, slack_bytes: int = TRIM_SLACK_BYTES) -> None:
        self.slack_bytes = slack_bytes
        self._trim = _malloc_trim()
        self._floor = resident_bytes()
        self.trims = 0

    @property
    def available(self) -> bool:
        """False where the C library has no ``malloc_trim`` (then calls do nothing)."""
        return self._trim is not None

    def __call__(self) -> bool:
        """Trim if the process grew enough; True if it trimmed."""
        if self._trim is None or resident_bytes() - self._floor < self.slack_bytes:
            return False
        self._trim(0)
        self._floor = resident_bytes()
        self.trims += 1
        return True
