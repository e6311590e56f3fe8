"""Process-wide memory settings of extproc's processes.

glibc serves allocations above ``M_MMAP_THRESHOLD`` (128 KiB) with mmap and gives them back on free,
but raises that threshold to the largest block freed so far (up to 32 MiB): after a few 1 MiB
request bodies, later ones come from the heap, whose free space is seldom returned. Measured
(tests/test_memory.py): 300 refused bodies of 1 MiB, 20 at a time, left a process 24 MB larger;
with the threshold fixed, 1 MB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("llmgw.memory")
_M_MMAP_THRESHOLD = -3  # malloc.h
MMAP_THRESHOLD_BYTES = 128 << 10


def return_large_blocks() -> bool:
    """Fix glibc's mmap threshold at 128 KiB, so a large body's memory goes back to the system
    when it is freed. False (and nothing done) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS)
        return False
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD) failed: large bodies may stay in the heap")
        return False
    return True
