"""The quota arithmetic, with no store and no clock: tables of (state, now) -> check."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from extproc.quota.limits import (
    Admission,
    Check,
    Figure,
    LimitKind,
    Limits,
    Quota,
    ScopeState,
    Verdict,
    check_day,
    check_leases,
    check_window,
    decide,
    format_duration,
    live,
    month_of,
    scopes_of,
    settle_bucket,
)

NOW = 1_000_000_500  # ms: half-way through bucket 1_000_000
B = 1_000_000  # the current bucket
DAY_START = 1_000_000_500 // 86_400_000 * 86_400_000
TO_MIDNIGHT = DAY_START + 86_400_000 - NOW


@pytest.mark.parametrize(("buckets", "limit", "need", "expected"), [
    pytest.param({}, 3, 1, Check(True, 0, None, 60_500), id="empty window fits; reset when this bucket leaves"),
    pytest.param({B - 10: 2}, 3, 1, Check(True, 2, None, 60_500), id="last slot"),
    pytest.param({B - 10: 3}, 3, 1, Check(False, 3, 50_500, 50_500), id="full: wait until bucket b-10 leaves"),
    pytest.param({B - 60: 1}, 1, 1, Check(False, 1, 500, 500), id="b-60 still counts (under 60 s old, maybe)"),
    pytest.param({B - 61: 5}, 1, 1, Check(True, 0, None, 60_500), id="b-61 is over 60 s old: forgotten"),
    pytest.param({B - 30: 2, B - 5: 2}, 3, 1, Check(False, 4, 30_500, 55_500),
                 id="wait for the oldest bucket only: 4-2+1 <= 3"),
    pytest.param({B - 30: 2, B - 5: 2}, 3, 3, Check(False, 4, 55_500, 55_500), id="need 3: both must leave"),
    pytest.param({B - 30: 2}, 3, 4, Check(False, 2, None, 30_500), id="need over the limit: never"),
    pytest.param({B - 30: 2}, 10, 0, Check(True, 2, None, 30_500), id="zero need: reset from the newest bucket"),
    pytest.param({}, 0, 1, Check(False, 0, None, 0), id="limit 0 refuses all"),
])
def test_check_window(buckets: dict[int, int], limit: int, need: int, expected: Check) -> None:
    assert check_window(buckets, NOW, limit, need) == expected


def test_live_drops_buckets_out_of_the_window() -> None:
    assert live({B - 61: 1, B - 60: 2, B: 3}, NOW) == {B - 60: 2, B: 3}  # b-61 left; b-60 and b stay


@pytest.mark.parametrize(("live_leases", "limit", "expected"), [
    pytest.param(0, 2, Check(True, 0, None, 0), id="free slot"),
    pytest.param(1, 2, Check(True, 1, None, 0), id="last slot"),
    pytest.param(2, 2, Check(False, 2, 1_000, 0), id="full: suggest a 1 s wait"),
    pytest.param(0, 0, Check(False, 0, None, 0), id="limit 0: never"),
])
def test_check_leases(live_leases: int, limit: int, expected: Check) -> None:
    assert check_leases(live_leases, limit) == expected


@pytest.mark.parametrize(("used", "limit", "need", "expected"), [
    pytest.param(0, 1000, 1000, Check(True, 0, None, TO_MIDNIGHT), id="exactly the budget"),
    pytest.param(500, 1000, 501, Check(False, 500, TO_MIDNIGHT, TO_MIDNIGHT), id="over: wait for midnight UTC"),
    pytest.param(0, 1000, 1001, Check(False, 0, None, TO_MIDNIGHT), id="bigger than the budget: never"),
])
def test_check_day(used: int, limit: int, need: int, expected: Check) -> None:
    assert check_day(used, NOW, limit, need) == expected


EMPTY = ScopeState({}, {}, 0, 0)
BUSY = ScopeState({B - 20: 9}, {B - 20: 900}, 3, 5000)


@pytest.mark.parametrize(("scopes", "reserve", "admitted", "refused", "retry"), [
    pytest.param([("tenant", Limits(rpm=10, tpm=1000), BUSY)], 100, True, None, None, id="all limits take it"),
    pytest.param([("tenant", Limits(rpm=9), BUSY)], 100, False, ("tenant", LimitKind.REQUESTS), 40_500,
                 id="rpm full"),
    pytest.param([("tenant", Limits(tpm=1000), BUSY)], 101, False, ("tenant", LimitKind.TOKENS), 40_500,
                 id="tpm one token short"),
    pytest.param([("tenant", Limits(concurrency=3, rpm=9), BUSY)], 1, False, ("tenant", LimitKind.REQUESTS),
                 40_500, id="two refusals: the longer wait is reported (rpm 40 s > concurrency 1 s)"),
    pytest.param([("tenant", Limits(tpm=100, daily_tokens=5100), BUSY)], 101, False,
                 ("tenant", LimitKind.TOKENS), None, id="a limit that can never be met beats any wait"),
    pytest.param([("tenant", Limits(rpm=100), BUSY), ("qos", Limits(rpm=9), BUSY)], 1, False,
                 ("qos", LimitKind.REQUESTS), 40_500, id="the QoS class's own limit refuses"),
    pytest.param([("tenant", Limits(), EMPTY)], 10**9, True, None, None, id="unlimited"),
])
def test_decide(scopes: list[tuple[str, Limits, ScopeState]], reserve: int, admitted: bool,
                refused: tuple[str, LimitKind] | None, retry: int | None) -> None:
    verdict = decide(scopes, reserve, NOW)
    assert verdict.admitted is admitted
    assert (None if refused is None else (verdict.refused_scope, verdict.refused_by)) == refused
    assert verdict.retry_after_ms == retry


def test_refusal_reports_remaining_without_this_request() -> None:
    verdict = decide([("tenant", Limits(rpm=20), BUSY), ("qos", Limits(rpm=9), BUSY)], 1, NOW)
    by_scope = {figure.scope: figure.remaining for figure in verdict.figures}
    assert by_scope == {"tenant": 11, "qos": 0}  # 20 - 9 used (nothing taken: refused); 9 - 9


def test_admission_takes_its_share_off_remaining() -> None:
    verdict = decide([("tenant", Limits(rpm=20, tpm=1000), BUSY)], 50, NOW)
    assert [(figure.kind, figure.remaining) for figure in verdict.figures] == [
        (LimitKind.REQUESTS, 10),  # 20 - 9 - this one
        (LimitKind.TOKENS, 50),  # 1000 - 900 - 50
    ]


@pytest.mark.parametrize(("admitted_ms", "delta", "expected"), [
    pytest.param(NOW - 30_000, -50, B - 30, id="refund into its own bucket while it counts"),
    pytest.param(NOW - 30_000, 50, B - 30, id="surplus into its own bucket too"),
    pytest.param(NOW - 90_000, 50, B, id="late surplus counts now"),
    pytest.param(NOW - 90_000, -50, None, id="late refund: nothing to return"),
])
def test_settle_bucket(admitted_ms: int, delta: int, expected: int | None) -> None:
    assert settle_bucket(admitted_ms, NOW, delta) == expected


@pytest.mark.parametrize(("limits", "replicas", "expected"), [
    pytest.param(Limits(rpm=100, tpm=10_001), 3, Limits(rpm=33, tpm=3333), id="rounded down"),
    pytest.param(Limits(concurrency=2), 4, Limits(concurrency=1), id="never below 1"),
    pytest.param(Limits(rpm=0), 4, Limits(rpm=0), id="a zero limit stays zero"),
    pytest.param(Limits(), 4, Limits(), id="unlimited stays unlimited"),
])
def test_share(limits: Limits, replicas: int, expected: Limits) -> None:
    assert limits.share(replicas) == expected


@pytest.mark.parametrize(("ms", "text"), [
    (20, "20ms"),  # under a second: milliseconds
    (1000, "1s"),
    (1500, "1.5s"),
    (360_000, "6m0s"),  # OpenAI writes minutes with seconds
    (3_723_000, "1h2m3s"),
])
def test_format_duration(ms: int, text: str) -> None:
    assert format_duration(ms) == text


def test_headers() -> None:
    decision = Verdict(False, (
        Figure("tenant", LimitKind.REQUESTS, 100, 40, 2000),
        Figure("qos", LimitKind.REQUESTS, 10, 0, 59_000),
        Figure("tenant", LimitKind.TOKENS, 1000, 10, 1500),
    ), LimitKind.REQUESTS, "qos", 1200)
    assert decision.headers() == (
        ("x-ratelimit-limit-requests", "10"),  # the tightest scope: the QoS class
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "59s"),
        ("x-ratelimit-limit-tokens", "1000"),
        ("x-ratelimit-remaining-tokens", "10"),
        ("x-ratelimit-reset-tokens", "1.5s"),
        ("retry-after", "2"),  # 1.2 s rounded up
    )


def test_scopes() -> None:
    quota = Quota(Limits(rpm=1), Limits(rpm=2))
    assert scopes_of(quota, "") == (("tenant", Limits(rpm=1)),)  # no class: the tenant only
    assert scopes_of(quota, "batch") == (("tenant", Limits(rpm=1)), ("qos", Limits(rpm=2)))


@pytest.mark.parametrize("bad", [
    lambda: Limits(rpm=-1),
    lambda: Admission("", "r1", 1),
    lambda: Admission("t", "r1", -1),
])
def test_invalid(bad: object) -> None:
    with pytest.raises(ValueError):
        bad()  # type: ignore[operator]


@pytest.mark.parametrize("iso, month, next_month", [
    ("2026-11-29T13:00:00", "2026-11", "2026-12-01"),
    ("2026-12-31T23:59:59.999", "2026-12", "2027-01-01"),  # the year turns
    ("2024-02-29T12:00:00", "2024-02", "2024-03-01"),  # a leap day
    ("2100-02-28T00:00:00", "2100-02", "2100-03-01"),  # a century that is not a leap year
])
def test_month_of(iso: str, month: str, next_month: str) -> None:
    now = int(datetime.fromisoformat(iso).replace(tzinfo=UTC).timestamp() * 1000)
    index, next_start = month_of(now)
    year, number = divmod(index, 12)
    assert f"{year}-{number + 1:02d}" == month
    assert next_start == int(datetime.fromisoformat(next_month).replace(tzinfo=UTC).timestamp() * 1000)
