"""MemoryStore under a fake clock: the window slides, late usage counts now, the day resets at midnight."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.quota.limits import DAY_MS, Admission, LimitKind, Limits, Quota
from extproc.quota.memory import MemoryStore


class Clock:
    """A settable clock, in seconds like ``time.time``."""

    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> float:
        return self.ms / 1000


START = 20_000 * DAY_MS + 10_000  # 10 s after a UTC midnight


@pytest.fixture
def clock() -> Clock:
    """Time at ``START``."""
    return Clock(START)


async def admitted(store: MemoryStore, quota: Quota, tokens: int = 0, lease_id: str = "r") -> bool:
    """Whether one admission goes through."""
    return (await store.admit(Admission("acme", lease_id, tokens), quota)).admitted


@pytest.mark.parametrize(("later_ms", "expected"), [
    pytest.param(59_999, False, id="59.999 s later: still in the window"),
    pytest.param(60_000, False, id="60 s later: its bucket still counts (conservative)"),
    pytest.param(60_999, False, id="60.999 s: bucket b-60 still counts"),
    pytest.param(61_000, True, id="61 s: the bucket has left"),
])
async def test_window_slides(clock: Clock, later_ms: int, expected: bool) -> None:
    store, quota = MemoryStore(clock=clock), Quota(Limits(rpm=1))
    assert await admitted(store, quota, lease_id="a")
    clock.ms += later_ms
    assert await admitted(store, quota, lease_id="b") is expected


async def test_late_surplus_counts_now_and_late_refund_is_dropped(clock: Clock) -> None:
    store, quota = MemoryStore(clock=clock, lease_ttl_s=600), Quota(Limits(tpm=1000))
    first = (await store.admit(Admission("acme", "long", 100), quota)).lease
    second = (await store.admit(Admission("acme", "short", 500), quota)).lease
    assert first is not None and second is not None
    clock.ms += 90_000  # both reservations have left the window
    await store.release(first, 800)  # 700 more than reserved, spent in a long stream: counts now
    await store.release(second, 0)  # a refund for tokens that already left: nothing to return
    decision = await store.admit(Admission("acme", "next", 0), quota)
    assert decision.figures[0].remaining == 300  # 1000 - 700


async def test_daily_budget_resets_at_midnight_utc(clock: Clock) -> None:
    store, quota = MemoryStore(clock=clock), Quota(Limits(daily_tokens=1000))
    assert await admitted(store, quota, 1000, "a")
    refused = await store.admit(Admission("acme", "b", 1), quota)
    assert (refused.refused_by, refused.retry_after_ms) == (LimitKind.DAILY_TOKENS, DAY_MS - 10_000)  # to midnight
    clock.ms += DAY_MS - 10_000
    assert await admitted(store, quota, 1000, "c")  # a new UTC day


async def test_expired_lease_frees_its_slot_and_cannot_be_renewed(clock: Clock) -> None:
    store, quota = MemoryStore(clock=clock, lease_ttl_s=30), Quota(Limits(concurrency=1))
    lease = (await store.admit(Admission("acme", "a", 0), quota)).lease
    assert lease is not None
    clock.ms += 29_999
    assert not await admitted(store, quota, lease_id="b")  # still held
    clock.ms += 1
    assert await admitted(store, quota, lease_id="c")  # expired at exactly its expiry
    assert await store.renew(lease) is None


def test_workers_starting_together_all_open_the_quota_file(tmp_path: Path) -> None:
    """Six workers open a new quota file at once, 30 times: each switches it to WAL, and SQLite
    answers "database is locked" at once (not after its busy timeout) to all but one of a tie.
    Without the retry about one round in five lost a worker."""
    import sqlite3
    import threading

    for round_ in range(30):
        path = tmp_path / f"quota-{round_}.sqlite"
        start = threading.Barrier(6)
        errors: list[Exception] = []

        def open_store(start: threading.Barrier = start, path: Path = path, errors: list[Exception] = errors) -> None:
            start.wait()
            try:
                MemoryStore(path)
            except sqlite3.Error as error:
                errors.append(error)

        threads = [threading.Thread(target=open_store) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors, f"round {round_}: {errors[0]}"
