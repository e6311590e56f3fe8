"""A refused large body's memory goes back to the system (``extproc.memory``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a fresh interpreter: refuse 300 bodies of 1 MiB, 20 in flight at a time (a bad field, found
# after the whole body was parsed), then report how much larger the process is than before.
SCRIPT = """
import orjson, sys
from extproc.memory import return_large_blocks
from extproc.api import ApiError, Operation
from extproc.body import BodyLimits, analyze
fixed = sys.argv[1] == "fixed" and return_large_blocks()
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
def refuse(body):
    try:
        analyze(Operation.CHAT, body, {"m": "m"}, BodyLimits())
    except ApiError as error:
        assert error.status == 400
    else:
        raise AssertionError("accepted")
start = rss_mb()
for batch in range(15):
    bodies = [orjson.dumps({"model": "m", "n": -1, "messages": [
        {"role": "user", "content": f"{batch} {i} " + "x" * (1 << 20)}]}) for i in range(20)]
    for body in bodies:
        refuse(body)
    del bodies
print(fixed, round(rss_mb() - start, 1))
"""


def grown_mb(mode: str) -> tuple[bool, float]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True).stdout
    fixed, grown = out.split()
    return fixed == "True", float(grown)


def test_refused_bodies_leave_no_memory_behind() -> None:
    fixed, grown = grown_mb("fixed")
    if not fixed:
        pytest.skip("not glibc: its mmap threshold cannot be fixed here")
    assert grown < 8  # MB, after 300 MiB of refused bodies (glibc's default threshold: ~24 MB here)
