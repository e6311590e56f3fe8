"""A refused large body's memory goes back to the system (``extproc.memory``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from extproc.memory import HeapTrim, resident_bytes

# In a fresh interpreter: refuse 300 bodies of 1 MiB, 20 in flight at a time (a bad field, found
# after the whole body was parsed), then report how much larger the process is than before, and
# again after a HeapTrim call (what housekeeping does once a second).
SCRIPT = """
import orjson
from extproc.memory import HeapTrim, resident_bytes
from extproc.api import ApiError, Operation
from extproc.body import BodyLimits, analyze
trim = HeapTrim()
def refuse(body):
    try:
        analyze(Operation.CHAT, body, {"m": "m"}, BodyLimits())
    except ApiError as error:
        assert error.status == 400
    else:
        raise AssertionError("accepted")
start = resident_bytes()
for batch in range(15):
    bodies = [orjson.dumps({"model": "m", "n": -1, "messages": [
        {"role": "user", "content": f"{batch} {i} " + "x" * (1 << 20)}]}) for i in range(20)]
    for body in bodies:
        refuse(body)
    del bodies
grown = resident_bytes() - start
trimmed = trim()
print(trim.available, trimmed, grown / 2**20, (resident_bytes() - start) / 2**20)
"""


def test_refused_bodies_leave_no_memory_behind() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    available, trimmed, grown, after = out.split()
    if available != "True":
        pytest.skip("not glibc: no malloc_trim here")
    # glibc keeps ~24 MB of those bodies in its heap; the trim gives them back.
    assert trimmed == "True" and float(after) < 8, (grown, after)  # MB, after 300 MiB of bodies


def test_a_trim_waits_for_the_process_to_grow() -> None:
    trim = HeapTrim(slack_bytes=1 << 40)
    if not trim.available or not resident_bytes():
        pytest.skip("no malloc_trim or /proc here")
    assert not trim() and trim.trims == 0  # not grown by a TiB since it was made
    trim.slack_bytes = 0
    assert trim() and trim.trims == 1
