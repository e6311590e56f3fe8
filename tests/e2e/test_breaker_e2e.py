"""End to end: circuit breakers and the fallback chain through Envoy with the openai client. A pool
whose pods fail opens its breaker, its model's requests go to the fallback model, the breaker
half-opens and closes once the pods recover; with every pool failing, a stale cached answer, else
a 503 with retry-after."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml

from extproc.launcher import LocalStack, StackInfo, StackOptions
from tests.helpers import wait_for

CONFIG = {
    "pools": [{"name": "big", "simulate": 1},
              {"name": "small", "simulate": 2, "degrade": {"timeout_s": {"default": 2.0}}}],
    "models": [{"name": "big-model", "pool": "big", "fallback": ["small-model"], "cache": {"ttl_s": 1}},
               {"name": "small-model", "pool": "small"}],
    "breakers": {"min_requests": 3, "open_s": 5.0, "probes": 2},  # long enough to see it open beside a CPU hog
}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    run_dir = tmp_path_factory.mktemp("breaker")
    config = run_dir / "llmgw.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    # One worker: every record reaches the breakers that decide.
    options = StackOptions(config_path=config, run_dir=run_dir, port=0, workers=1, envoy_concurrency=1,
                           log_level="WARNING", sim_args=("--seed", "5", "--record", "1000"))
    with LocalStack(options) as info:
        yield info


def _faults(info: StackInfo, pool: str, **settings: float) -> None:
    for url in info.pod_urls[pool]:
        httpx.put(f"{url}/debug/faults", json=settings, timeout=5).raise_for_status()


def _ask(info: StackInfo, **extra: object) -> httpx.Response:
    body = {"model": "big-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}
    return httpx.post(f"{info.base_url}/v1/chat/completions", json=body, timeout=30)



def _refused(response: httpx.Response) -> bool:
    return response.status_code == 503 and response.json()["error"]["code"] == "pool_unavailable"


def _served_by(response: httpx.Response) -> str:
    return response.headers.get("x-llmgw-pool", "")


def test_a_failing_pool_falls_back_then_closes_again_when_it_recovers(chain: StackInfo) -> None:
    wait_for("the condition", lambda: _served_by(_ask(chain)) == "big", timeout=40.0)  # closed (whatever ran before)
    _faults(chain, "big", error_rate=1.0)
    # Its pods answer 500/503 until the breaker has seen enough of them; then the fallback serves.
    wait_for("the condition", lambda: _served_by(_ask(chain)) == "small")
    answer = _ask(chain)
    assert answer.status_code == 200 and answer.json()["model"] == "small-model"
    assert "fallback_from=big-model" in answer.headers["x-llmgw-decision"]
    client = openai.OpenAI(base_url=f"{chain.base_url}/v1", api_key="unused", max_retries=0)
    streamed = list(client.chat.completions.create(model="big-model", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, stream=True))
    assert streamed[-1].choices[0].finish_reason is not None  # a stream falls back before its first byte
    _faults(chain, "big")  # recovered: after open_s the breaker lets probes through, then closes
    wait_for("the condition", lambda: _served_by(_ask(chain)) == "big", timeout=40.0)
    assert all(_served_by(_ask(chain)) == "big" for _ in range(5))


def test_with_every_pool_failing_a_stale_answer_or_a_503(chain: StackInfo) -> None:
    deterministic = {"temperature": 0, "messages": [{"role": "user", "content": "remember me"}]}
    wait_for("the condition", lambda: _ask(chain, **deterministic).headers.get("x-llmgw-cache") == "hit")
    _faults(chain, "big", error_rate=1.0)
    _faults(chain, "small", error_rate=1.0)
    try:
        # A request now and then is a half-open breaker's probe, and fails at the pod: ask again.
        refused: list[httpx.Response] = []
        wait_for("the condition", lambda: _refused(refused.append(_ask(chain)) or refused[-1]))
        assert int(refused[-1].headers["retry-after"]) >= 1
        stale: list[httpx.Response] = []
        wait_for("a stale copy", lambda: stale.append(_ask(chain, **deterministic))
                 or stale[-1].headers.get("x-llmgw-cache") == "stale")
        assert stale[-1].status_code == 200 and stale[-1].json()["choices"][0]["message"]["content"]
    finally:
        _faults(chain, "big")
        _faults(chain, "small")


def _recorded(url: str) -> int:
    return len(httpx.get(f"{url}/debug/requests", timeout=5).json()["requests"])


def test_a_pod_that_asks_for_a_pause_with_retry_after_gets_no_traffic_meanwhile(chain: StackInfo) -> None:
    # Whatever ran before: the pool's breaker closed again (every answer a 200 for a while).
    wait_for("the condition", lambda: all(_ask(chain, model="small-model").status_code == 200 for _ in range(5)))
    tired = chain.pod_urls["small"][0]
    httpx.put(f"{tired}/debug/faults", json={"error_rate": 1.0, "error_status": 503, "retry_after_s": 60},
              timeout=5).raise_for_status()
    try:
        # Its 503 goes on to the pool's other pod (the client still gets its answer); sooner or
        # later the picker sends one there.
        before = _recorded(tired)
        wait_for("a request to the tired pod", lambda: _ask(chain, model="small-model").status_code == 200
                 and _recorded(tired) > before)
        # The router's log of that refused attempt reaches extproc a moment after the client has its
        # answer (later on a loaded machine), with the pod's retry-after: the 60 s it asked for, not
        # the 2 s back-off of a pod that failed an attempt.
        wait_for("the pause heard", lambda: any(
            f"pod {tired.removeprefix('http://')} asked for a pause: no traffic for 60 s" in log.read_text()
            for log in chain.log_dir.glob("extproc-*.log")), timeout=30)
        # Requests may have gone there meanwhile; from now on, none for the 60 s asked (longer than
        # any back-off so far). Every answer is a 200 all along.
        before = _recorded(tired)
        assert all(_ask(chain, model="small-model").status_code == 200 for _ in range(20))
        assert _recorded(tired) == before
    finally:
        httpx.put(f"{tired}/debug/faults", json={}, timeout=5).raise_for_status()


def test_a_pod_that_refuses_hands_the_request_to_the_fallback_model_before_the_first_byte(chain: StackInfo) -> None:
    # The breaker has not opened yet: Envoy itself takes the refusal (503) to the third host
    # extproc listed, a pod of small-model, whose model the upstream Lua filter writes into the body.
    wait_for("the condition", lambda: all(_served_by(_ask(chain)) == "big" for _ in range(3)))
    _faults(chain, "big", error_rate=1.0, error_status=503)
    try:
        answer = _ask(chain)
        assert answer.status_code == 200 and answer.json()["model"] == "small-model"
        client = openai.OpenAI(base_url=f"{chain.base_url}/v1", api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(
            model="big-model", messages=[{"role": "user", "content": "stream"}], max_tokens=4, stream=True))
        assert chunks[0].model == "small-model" and chunks[-1].choices[0].finish_reason is not None
    finally:
        _faults(chain, "big")


def test_a_class_timeout_ends_a_request_that_runs_past_it(chain: StackInfo) -> None:
    started = time.monotonic()
    slow = _ask(chain, model="small-model", max_tokens=1000, ignore_eos=True)  # ~12 s of generation
    assert slow.status_code == 504 and time.monotonic() - started < 10
    assert slow.json()["error"]["type"] == "server_error"
