"""Tenant limits through the real stack: two extproc workers share the node's quota store."""

from __future__ import annotations

import time

import httpx
import openai

from extproc.launcher import StackInfo
from tests.e2e.conftest import MODEL, RPM_KEY, SOLO_KEY, TENANT_KEY, BackgroundStream
from tests.helpers import wait_for

HELLO = [{"role": "user", "content": "hi"}]


def _chat(stack: StackInfo, key: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": HELLO, "max_tokens": 2, **extra},
                      headers={"authorization": f"Bearer {key}"})


def test_requests_per_minute_is_exact_across_workers(stack: StackInfo) -> None:
    answers = [_chat(stack, RPM_KEY) for _ in range(7)]  # new connections: both workers take some
    assert [a.status_code for a in answers] == [200] * 5 + [429] * 2
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers[:5]] == ["4", "3", "2", "1", "0"]
    assert all(a.headers["x-ratelimit-limit-requests"] == "5" for a in answers)
    refused = answers[5]
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
    assert "requests per minute" in error["message"] and "team-rpm" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 61  # 1-second buckets: an admission counts 60-61 s
    assert refused.headers["x-request-id"]


def test_openai_client_sees_a_rate_limit_error(stack: StackInfo) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=RPM_KEY, max_retries=0)
    for _ in range(6):  # the window may already be full from the test above
        try:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
        except openai.RateLimitError as error:
            assert error.code == "rate_limit_exceeded"
            return
    raise AssertionError("never refused")


def test_concurrency_slot_is_released_when_the_client_hangs_up(stack: StackInfo) -> None:
    with BackgroundStream(stack.base_url, 2000, {"authorization": f"Bearer {SOLO_KEY}"}):
        busy = _chat(stack, SOLO_KEY)
        assert busy.status_code == 429
        assert "concurrent requests" in busy.json()["error"]["message"]
    # (leaving the block hung up mid-stream)
    assert _eventually_admitted(stack, SOLO_KEY) < 2.0  # from its access-log entry, not the 60 s lease TTL
    # A finished request gives its slot back when its access-log entry is settled (asynchronously,
    # so a request sent the same instant may still meet it held).
    assert _eventually_admitted(stack, SOLO_KEY) < 2.0


def _eventually_admitted(stack: StackInfo, key: str) -> float:
    """Seconds until a request of ``key`` is admitted (polling every 50 ms, up to 5 s)."""
    def answered() -> httpx.Response | None:
        answer = _chat(stack, key)
        return None if answer.status_code == 429 else answer

    started = time.monotonic()
    assert wait_for(f"a request of {key} not refused", answered, 5.0, interval=0.05).status_code == 200
    return time.monotonic() - started


def test_no_rate_headers_for_an_unlimited_tenant_and_client_copies_dropped(stack: StackInfo) -> None:
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": HELLO, "max_tokens": 1},
                          headers={"authorization": f"Bearer {TENANT_KEY}", "x-ratelimit-limit-requests": "999"})
    assert response.status_code == 200
    assert not [h for h in response.headers if h.startswith("x-ratelimit-")]


def test_long_generation_keeps_its_slot_past_the_lease_ttl(tmp_path_factory) -> None:
    from tests.e2e.conftest import small_stack

    extra = {"tenants": [{"name": "solo", "keys": [{"env": "RENEW_KEY"}], "limits": {"concurrency": 1}}],
             "quota": {"lease_ttl_s": 0.6}}
    with small_stack(tmp_path_factory, "renew", pods=1, extra_config=extra, env={"RENEW_KEY": "sk-renew"}) as info:
        # ~150 decode steps of ~12 ms: about 2 s, three lease TTLs
        with BackgroundStream(info.base_url, 150, {"authorization": "Bearer sk-renew"}) as stream:
            time.sleep(1.2)  # two TTLs in: without renewal the lease would have expired
            assert _chat(info, "sk-renew").status_code == 429
            stream.join()
        assert stream.status == 200
        assert _eventually_admitted(info, "sk-renew") < 2.0
