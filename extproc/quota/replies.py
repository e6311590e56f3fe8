"""What a refused admission tells the client: OpenAI's 429 ``rate_limit_exceeded`` naming the limit
and when to retry, or a 402 ``insufficient_quota`` for a spent budget. Pure."""

from __future__ import annotations

from extproc.api import ApiError
from extproc.quota.limits import LimitKind, Verdict, format_duration

_LIMIT_NAMES = {
    LimitKind.REQUESTS: "requests per minute (rpm)",
    LimitKind.TOKENS: "tokens per minute (tpm)",
    LimitKind.CONCURRENCY: "concurrent requests",
    LimitKind.DAILY_TOKENS: "tokens per day",
}
UNAVAILABLE = ApiError(503, "Rate limits cannot be checked right now; retry shortly.", type="server_error",
                       code="service_unavailable")


def refusal(tenant: str, verdict: Verdict) -> ApiError:
    """The error for a refused admission: a budget's 402, else a rate limit's 429."""
    if verdict.refused_by is not None and verdict.refused_by.is_budget:
        return over_budget(tenant, verdict)
    return rate_limited(tenant, verdict)


def rate_limited(tenant: str, verdict: Verdict) -> ApiError:
    """OpenAI's 429: ``rate_limit_exceeded``, the error type naming what ran out."""
    kind = verdict.refused_by or LimitKind.REQUESTS
    figure = verdict.tightest(kind)
    limit = f" (limit {figure.limit})" if figure is not None else ""
    if verdict.retry_after_ms is None:
        wait = " This request alone exceeds it: send a smaller one."
    else:
        wait = f" Please try again in {max(1, -(-verdict.retry_after_ms // 1000))}s."
    scope = f" for QoS class {verdict.refused_scope}" if verdict.refused_scope == "qos" else ""
    message = f"Rate limit reached for {tenant}{scope} on {_LIMIT_NAMES[kind]}{limit}.{wait}"
    kind_type = "tokens" if kind in (LimitKind.TOKENS, LimitKind.DAILY_TOKENS) else "requests"
    return ApiError(429, message, type=kind_type, code="rate_limit_exceeded")


def over_budget(tenant: str, verdict: Verdict) -> ApiError:
    """A spending budget ran out: OpenAI's ``insufficient_quota``, with HTTP 402 (Payment Required)
    rather than OpenAI's 429, so that clients do not retry what only a new period can fix."""
    kind = verdict.refused_by or LimitKind.DAILY_COST
    figure = verdict.tightest(kind)
    period = "daily" if kind is LimitKind.DAILY_COST else "monthly"
    budget = f" of ${figure.limit / 1e6:,.2f}" if figure is not None else ""
    if verdict.retry_after_ms is None:
        when = " This request alone would exceed it."
    else:
        boundary = "midnight" if period == "daily" else "the start of the month"
        when = f" It resets in {format_duration(verdict.retry_after_ms)} (at {boundary}, UTC)."
    message = f"You exceeded your current quota: {tenant} has used its {period} spending budget{budget}.{when}"
    return ApiError(402, message, type="insufficient_quota", code="insufficient_quota")
