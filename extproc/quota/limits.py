"""Quota arithmetic: what one admission may take, given what a tenant has used (pure; no I/O, no clock).

Algorithms (the Redis Lua script in ``redis_store`` mirrors these functions line for line):

* **Requests and tokens per minute**: a sliding window of one-second buckets. An admission at
  time ``t`` is counted in bucket ``t // 1 s``; a bucket counts while it overlaps the trailing
  60 s, i.e. for the 61 buckets ``b-60 .. b`` of the current bucket ``b``. Every request or token
  of the last 60 s is therefore counted (the window never under-counts), and each is forgotten
  between 60 and 61 s after its admission. Guarantee: in any 60 s interval, at most ``rpm``
  requests and at most ``tpm`` *reserved* tokens are admitted. Memory is at most 61 counters per
  limit, whatever the rate. Reconciliation moves a request's tokens from the reservation to the
  real usage in its own bucket, so the real usage exceeds ``tpm`` by at most what in-flight
  requests under-reserved.
* **Concurrency**: leases with an expiry; a live lease holds one slot until released or expired.
* **Daily tokens**: one counter per UTC day (day number ``t // 86 400 s``), reset at midnight UTC.
* **Spending budgets**: the cost (micro-dollars, from the model's prices) charged per UTC day and
  per UTC calendar month. Like tokens, a request reserves its estimated cost and is reconciled to
  the cost of its real usage.

A request is admitted only if every limit of every scope (the tenant's, and its QoS class's)
takes it; then all of them are charged at once, otherwise none.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import IntEnum

WINDOW_MS = 60_000
BUCKET_MS = 1_000
# Buckets b-60 .. b overlap the trailing 60 s, so a bucket j counts until bucket j+61 begins.
SPAN = WINDOW_MS // BUCKET_MS + 1
DAY_MS = 86_400_000
# When a concurrency slot frees is unknown (a release can come at any moment): suggest a short wait.
CONCURRENCY_RETRY_MS = 1_000


class LimitKind(IntEnum):
    """One kind of limit; the value is its index in the figures and the Lua script's reply."""

    REQUESTS = 0  # per minute
    TOKENS = 1  # per minute, input + output
    CONCURRENCY = 2  # requests in flight
    DAILY_TOKENS = 3  # per UTC day
    DAILY_COST = 4  # micro-dollars per UTC day
    MONTHLY_COST = 5  # micro-dollars per UTC calendar month

    @property
    def is_budget(self) -> bool:
        """A spending budget (refused as ``insufficient_quota``), not a rate limit."""
        return self in (LimitKind.DAILY_COST, LimitKind.MONTHLY_COST)

    @property
    def label(self) -> str:
        """The name used in errors, logs and metrics (``requests``, ``daily_tokens``, ...)."""
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits of one scope; ``None`` means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None
    daily_tokens: int | None = None
    daily_cost: int | None = None  # micro-dollars
    monthly_cost: int | None = None  # micro-dollars

    def __post_init__(self) -> None:
        for kind, value in zip(LimitKind, self.as_tuple(), strict=True):
            if value is not None and value < 0:
                raise ValueError(f"{kind.label}: a limit cannot be negative ({value})")

    def as_tuple(self) -> tuple[int | None, ...]:
        """The limits in ``LimitKind`` order."""
        return (self.rpm, self.tpm, self.concurrency, self.daily_tokens, self.daily_cost, self.monthly_cost)

    def share(self, replicas: int) -> Limits:
        """This replica's share when each of ``replicas`` enforces the limits alone (at least 1 each).

        Rounded down so that the replicas together never exceed the limit, except where a limit
        smaller than the replica count would otherwise lock the tenant out.
        """
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1 ({replicas})")

        def part(value: int | None) -> int | None:
            return None if value is None else max(1, value // replicas) if value else 0

        return Limits(*(part(value) for value in self.as_tuple()))


UNLIMITED = Limits()


@dataclass(frozen=True, slots=True)
class Quota:
    """The limits that govern one admission: the tenant's own, and those of its QoS class."""

    tenant: Limits
    qos: Limits = UNLIMITED

    def share(self, replicas: int) -> Quota:
        """Both scopes' limits divided among ``replicas`` (see ``Limits.share``)."""
        return Quota(self.tenant.share(replicas), self.qos.share(replicas))


@dataclass(frozen=True, slots=True)
class Admission:
    """One request asking to start: who, in which QoS class, and how many tokens it reserves.

    ``reserve_tokens`` is the estimated input plus the predicted output, ``reserve_cost`` their
    price in micro-dollars; ``lease_id`` is unique per request (the request id) and names its
    concurrency lease and its charge.
    The store supplies the time (Redis uses its own clock), so no ``now`` travels here.
    """

    tenant: str
    lease_id: str
    reserve_tokens: int
    qos: str = ""
    reserve_cost: int = 0

    def __post_init__(self) -> None:
        if not self.tenant or not self.lease_id:
            raise ValueError("an admission needs a tenant and a lease id")
        if self.reserve_tokens < 0 or self.reserve_cost < 0:
            raise ValueError(f"reservations cannot be negative ({self.reserve_tokens}, {self.reserve_cost})")


@dataclass(frozen=True, slots=True)
class Figure:
    """One limit's state after the decision, for the ``x-ratelimit-*`` headers."""

    scope: str  # "tenant" or "qos"
    kind: LimitKind
    limit: int
    remaining: int
    reset_ms: int  # until the limit is back to full (OpenAI's x-ratelimit-reset-*)


@dataclass(frozen=True, slots=True)
class Lease:
    """What an admitted request holds until it ends: give it back to ``reconcile``/``release``."""

    tenant: str
    qos: str
    lease_id: str
    reserved_tokens: int
    admitted_ms: int  # the store's clock
    expires_ms: int
    store: str  # the name of the store that issued it (a fallback wrapper routes by it)
    reserved_cost: int = 0  # micro-dollars
    holds_slot: bool = True  # a concurrency limit counts it: its release must not wait


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to an ``Admission``: admitted (with a lease), or refused with the limit and a wait.

    ``retry_after_ms`` is ``None`` when waiting cannot help: the request alone exceeds a limit.
    """

    admitted: bool
    figures: tuple[Figure, ...] = ()
    refused_by: LimitKind | None = None
    refused_scope: str | None = None
    retry_after_ms: int | None = None
    lease: Lease | None = None

    def tightest(self, kind: LimitKind) -> Figure | None:
        """The figure of ``kind`` with the fewest remaining across scopes (what headers report)."""
        figures = [figure for figure in self.figures if figure.kind is kind]
        return min(figures, key=lambda figure: (figure.remaining, -figure.reset_ms), default=None)

    def headers(self) -> tuple[tuple[str, str], ...]:
        """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, plus ``retry-after``."""
        out: list[tuple[str, str]] = []
        for kind, name in ((LimitKind.REQUESTS, "requests"), (LimitKind.TOKENS, "tokens")):
            figure = self.tightest(kind)
            if figure is not None:
                out += [(f"x-ratelimit-limit-{name}", str(figure.limit)),
                        (f"x-ratelimit-remaining-{name}", str(figure.remaining)),
                        (f"x-ratelimit-reset-{name}", format_duration(figure.reset_ms))]
        if not self.admitted and self.retry_after_ms is not None:
            # RFC 9110 Retry-After is whole seconds; round up so a retry is never early.
            out.append(("retry-after", str(max(1, math.ceil(self.retry_after_ms / 1000)))))
        return tuple(out)


def format_duration(ms: int) -> str:
    """A reset time as OpenAI writes it: ``20ms``, ``1s``, ``6m0s``, ``1h2m3s``."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    seconds = ms / 1000
    hours, rest = divmod(int(seconds), 3600)
    minutes = rest // 60
    secs = seconds - hours * 3600 - minutes * 60
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return text


# --- the window arithmetic -------------------------------------------------------------------


def bucket_of(now_ms: int) -> int:
    """The one-second bucket that an admission at ``now_ms`` is counted in."""
    return now_ms // BUCKET_MS


def day_of(now_ms: int) -> int:
    """The UTC day number (days since the epoch) of ``now_ms``."""
    return now_ms // DAY_MS


def month_of(now_ms: int) -> tuple[int, int]:
    """The UTC calendar month of ``now_ms`` (``year * 12 + month - 1``) and when the next begins (ms)."""
    return _month_of_day(now_ms // DAY_MS)


@functools.lru_cache(maxsize=64)
def _month_of_day(day: int) -> tuple[int, int]:
    moment = datetime.fromtimestamp(day * (DAY_MS // 1000), tz=UTC)
    index = moment.year * 12 + moment.month - 1
    year, month = divmod(index + 1, 12)
    return index, int(datetime(year, month + 1, 1, tzinfo=UTC).timestamp() * 1000)


def live(buckets: Mapping[int, int], now_ms: int) -> dict[int, int]:
    """The buckets that still count at ``now_ms`` (the others can be deleted)."""
    oldest = bucket_of(now_ms) - SPAN + 1
    return {bucket: count for bucket, count in buckets.items() if bucket >= oldest}


@dataclass(frozen=True, slots=True)
class Check:
    """Whether ``need`` more fits under one limit now, and the figures either way."""

    fits: bool
    used: int
    retry_after_ms: int | None  # None when fitting, or when it can never fit
    reset_ms: int


def check_window(buckets: Mapping[int, int], now_ms: int, limit: int, need: int) -> Check:
    """Sliding-window check: does ``need`` fit with the live buckets' sum, and when else would it."""
    oldest = bucket_of(now_ms) - SPAN + 1
    used, newest = 0, None
    for bucket, count in buckets.items():  # one pass, no copies: this runs on every admission
        if bucket >= oldest and count:
            used += count
            if newest is None or bucket > newest:
                newest = bucket
    if used + need <= limit:
        last = bucket_of(now_ms) if need else newest
        return Check(True, used, None, 0 if last is None else (last + SPAN) * BUCKET_MS - now_ms)
    reset = 0 if newest is None else (newest + SPAN) * BUCKET_MS - now_ms
    if need > limit:
        return Check(False, used, None, reset)
    freed = 0
    for bucket, count in sorted(live(buckets, now_ms).items()):  # oldest first: each leaves at its own boundary
        freed += count
        if used - freed + need <= limit:
            return Check(False, used, (bucket + SPAN) * BUCKET_MS - now_ms, reset)
    raise AssertionError("unreachable: once every bucket has left, need <= limit fits")


def check_leases(live_leases: int, limit: int) -> Check:
    """Concurrency check: one more lease fits while fewer than ``limit`` are live."""
    fits = live_leases + 1 <= limit
    retry = None if fits or limit == 0 else CONCURRENCY_RETRY_MS
    return Check(fits, live_leases, retry, 0)


def check_day(used: int, now_ms: int, limit: int, need: int) -> Check:
    """Daily budget check: ``need`` fits under what is left of today's (UTC) budget."""
    return check_period(used, (day_of(now_ms) + 1) * DAY_MS - now_ms, limit, need)


def check_period(used: int, reset_ms: int, limit: int, need: int) -> Check:
    """A budget per calendar period: ``need`` fits under what is left; else wait for the reset."""
    if used + need <= limit:
        return Check(True, used, None, reset_ms)
    return Check(False, used, None if need > limit else reset_ms, reset_ms)


@dataclass(frozen=True, slots=True)
class ScopeState:
    """What one scope has used, as the store read it at ``now_ms``."""

    requests: Mapping[int, int]  # bucket -> requests admitted
    tokens: Mapping[int, int]  # bucket -> tokens charged
    leases: int  # live leases
    day_tokens: int  # tokens charged today (UTC)
    day_cost: int = 0  # micro-dollars charged today (UTC)
    month_cost: int = 0  # micro-dollars charged this month (UTC)


@dataclass(frozen=True, slots=True)
class Ruling:
    """The decision for all scopes, before the store attaches a lease."""

    admitted: bool
    figures: tuple[Figure, ...]
    refused_by: LimitKind | None = None
    refused_scope: str | None = None
    retry_after_ms: int | None = None


def decide(scopes: Sequence[tuple[str, Limits, ScopeState]], reserve: int, now_ms: int,
           reserve_cost: int = 0) -> Ruling:
    """Admit only if every limit of every scope takes one request, ``reserve`` tokens and
    ``reserve_cost`` micro-dollars.

    When several limits refuse, the reported one is the one with the longest wait (a limit that
    can never be met beats any wait), so that ``retry-after`` is never too early.
    """
    checked: list[tuple[str, LimitKind, int, Check, int]] = []
    refusals: list[tuple[float, str, LimitKind]] = []
    for scope, limits, state in scopes:
        for kind, limit in zip(LimitKind, limits.as_tuple(), strict=True):
            if limit is None:
                continue
            check, need = _check(kind, limit, state, reserve, reserve_cost, now_ms)
            checked.append((scope, kind, limit, check, need))
            if not check.fits:
                wait = math.inf if check.retry_after_ms is None else check.retry_after_ms
                refusals.append((wait, scope, kind))
    admitted = not refusals
    figures = tuple(Figure(scope, kind, limit, max(limit - check.used - (need if admitted else 0), 0),
                           check.reset_ms) for scope, kind, limit, check, need in checked)
    if admitted:
        return Ruling(True, figures)
    wait, scope, kind = max(refusals, key=lambda refusal: refusal[0])
    return Ruling(False, figures, kind, scope, None if wait == math.inf else int(wait))


def _check(kind: LimitKind, limit: int, state: ScopeState, reserve: int, cost: int, now_ms: int
           ) -> tuple[Check, int]:
    if kind is LimitKind.REQUESTS:
        return check_window(state.requests, now_ms, limit, 1), 1
    if kind is LimitKind.TOKENS:
        return check_window(state.tokens, now_ms, limit, reserve), reserve
    if kind is LimitKind.CONCURRENCY:
        return check_leases(state.leases, limit), 1
    if kind is LimitKind.DAILY_TOKENS:
        return check_day(state.day_tokens, now_ms, limit, reserve), reserve
    if kind is LimitKind.DAILY_COST:
        return check_period(state.day_cost, (day_of(now_ms) + 1) * DAY_MS - now_ms, limit, cost), cost
    return check_period(state.month_cost, month_of(now_ms)[1] - now_ms, limit, cost), cost


def settle_bucket(admitted_ms: int, now_ms: int, delta: int) -> int | None:
    """Where a reconciliation's ``delta`` (actual - charged tokens) goes in the window.

    Into the request's own bucket while that still counts; a late surplus goes into the current
    bucket (the tokens were spent, so they count now); a late refund is dropped (nothing to return).
    """
    if bucket_of(admitted_ms) >= bucket_of(now_ms) - SPAN + 1:
        return bucket_of(admitted_ms)
    return bucket_of(now_ms) if delta > 0 else None


def scopes_of(quota: Quota, qos: str) -> tuple[tuple[str, Limits], ...]:
    """The scopes an admission is counted in: always the tenant, and its QoS class when it has one."""
    return (("tenant", quota.tenant),) + ((("qos", quota.qos),) if qos else ())

