"""Supervision: a killed extproc worker or pod is started again and the node keeps serving; a dead
worker cuts no generation, and a slot nobody settles comes back by its lease's TTL.

Every wait is a condition with a deadline, generous enough for a CPU hog beside the suite.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from redis import Redis

from extproc.keys import RedisKeyTable
from extproc.launcher import Backoff, Child, ChildExit, LocalStack, StackInfo, StackOptions
from llmgw_testing.redis_server import RedisServer
from tests.e2e.conftest import MODEL
from tests.e2e.test_cli_up import STARTUP_S, Launched, assert_no_orphans, children_of, cmdline, models_answered, serve
from tests.helpers import request_headers, wait_for

SOLO_KEY = "sk-supervision-solo"
LEASE_TTL_S = 6.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(("quick_deaths", "delay"), [
    pytest.param(1, 0.2, id="first death: the shortest wait"),
    pytest.param(2, 0.4, id="dying young again doubles it"),
    pytest.param(6, 6.4, id="still doubling"),
    pytest.param(7, 10.0, id="capped"),
    pytest.param(10_000, 10.0, id="capped forever, never an overflow"),
])
def test_backoff_doubles_up_to_its_cap(quick_deaths: int, delay: float) -> None:
    assert Backoff().delay(quick_deaths) == pytest.approx(delay)


@pytest.mark.parametrize(("before", "ran_s", "after"), [
    pytest.param(3, 0.5, 4, id="died young: one more in a row"),
    pytest.param(3, 10.0, 1, id="ran stably first: counting starts again"),
])
def test_backoff_resets_after_a_stable_run(before: int, ran_s: float, after: int) -> None:
    assert Backoff().quick_deaths(before, ran_s) == after


def test_a_death_is_one_line_naming_child_cause_and_delay() -> None:
    killed = ChildExit("extproc-2", 4242, -signal.SIGKILL, 12.34, 1, 0.2)
    assert killed.describe() == "extproc-2 (pid 4242) was killed by SIGKILL after 12.3 s; starting it again in 0.2 s"
    crashed = ChildExit("pod-local-1", 7, 1, 0.1, 3, 0.8)
    assert crashed.describe() == ("pod-local-1 (pid 7) exited with code 1 after 0.1 s; starting it again in 0.8 s, "
                                  "3 quick deaths in a row")


# ---------------------------------------------------------------------------------------------


def _stack(run_dir: Path, config: dict[str, Any], **options: Any) -> LocalStack:
    (run_dir / "llmgw.yaml").write_text(yaml.safe_dump(config))
    settings: dict[str, Any] = {"port": 0, "envoy_concurrency": 2, "log_level": "WARNING", **options}
    return LocalStack(StackOptions(config_path=run_dir / "llmgw.yaml", run_dir=run_dir, **settings))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, StackInfo]]:
    """Two extproc workers and ONE pod: a request through the gateway answers only while it runs.
    INFO: each worker logs an access record per request it saw to the end."""
    stack = _stack(tmp_path_factory.mktemp("supervision"), {
        "pools": [{"name": "local", "simulate": 1}], "models": [{"name": MODEL, "pool": "local"}]},
        workers=2, log_level="INFO")
    with stack as info:
        yield stack, info


def _child(stack: LocalStack, name: str) -> Child:
    return next(child for child in stack.group.children if child.name == name)


def _connections(pid: int, port: int) -> int:
    """Established TCP connections that process ``pid`` accepted on ``port`` (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # gRPC listens on IPv6 even for 127.0.0.1 (v4-mapped)
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port, state, inode = int(fields[1].rpartition(":")[2], 16), fields[3], fields[9]
            count += local_port == port and state == "01" and inode in inodes  # 01: ESTABLISHED
    return count


def _back(child: Child, old_pid: int) -> bool:
    """Whether ``child`` runs again under a new pid and has printed its READY line (to its log)."""
    return child.pid != old_pid and child.proc.poll() is None and "READY " in child.output()


def _status(base_url: str, headers: dict[str, str] | None = None) -> int | None:
    """The status of one small chat completion through the gateway (None: no HTTP answer)."""
    try:
        return httpx.post(f"{base_url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30).status_code
    except httpx.HTTPError:
        return None


class Stream:
    """A streamed chat completion in a thread, recording how it ended: ``complete`` (``[DONE]``
    came), ``cut`` (the connection broke, or ended without ``[DONE]``), or ``hung up`` (by us)."""

    def __init__(self, base_url: str, max_tokens: int, headers: dict[str, str] | None = None) -> None:
        self.request_id = f"supervision-{uuid.uuid4()}"
        headers = {**(headers or {}), "x-request-id": self.request_id}
        self.first_chunk, self._hang_up = threading.Event(), threading.Event()
        self.status: int | None = None
        self.outcome = "running"
        self._thread = threading.Thread(target=self._run, args=(base_url, max_tokens, headers), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, max_tokens: int, headers: dict[str, str]) -> None:
        body = {**CHAT, "stream": True, "max_tokens": max_tokens, "ignore_eos": True}
        outcome = "cut"
        try:
            with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers,
                              timeout=60) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    self.first_chunk.set()
                    if line == "data: [DONE]":
                        outcome = "complete"
                    if self._hang_up.is_set():
                        outcome = "hung up"
                        break
        except httpx.HTTPError:
            pass  # cut: what this test counts
        finally:
            self.outcome = outcome
            self.first_chunk.set()

    def hang_up(self) -> None:
        """Close the connection mid-stream."""
        self._hang_up.set()
        self.join()

    def join(self, timeout: float = 90) -> str:
        """Wait for the end; how it ended."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "a stream neither ended nor broke within its time"
        return self.outcome


def test_a_killed_worker_is_started_again_and_the_node_keeps_serving(
        node: tuple[LocalStack, StackInfo], caplog: pytest.LogCaptureFixture) -> None:
    stack, info = node
    streams = [Stream(info.base_url, max_tokens=500) for _ in range(6)]  # ~6 s each at the pod's pace
    for stream in streams:
        assert stream.first_chunk.wait(STARTUP_S) and stream.status == 200
    # Envoy holds one HTTP/2 connection per worker thread to the extproc port, and the kernel spreads
    # them over the workers: kill one that holds streams.
    port = int(info.extproc_address.rpartition(":")[2])
    worker, survivor = sorted((c for c in stack.group.children if c.name.startswith("extproc")),
                              key=lambda c: _connections(c.pid, port), reverse=True)
    others = {child.name: child.pid for child in stack.group.children if child is not worker}
    victim = worker.pid

    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    failed_meanwhile = 0  # the other worker answers; a request on the dead one's connection fails once
    while not _back(worker, victim):
        assert time.monotonic() - killed < STARTUP_S, f"{worker.name} not back: {stack.group.exits}"
        failed_meanwhile += _status(info.base_url) != 200
    back_after = time.monotonic() - killed

    statuses = [_status(info.base_url) for _ in range(20)]  # new connections may land on either worker
    assert statuses == [200] * 20
    outcomes = [stream.join() for stream in streams]
    print(f"\nworker back after {back_after:.1f} s; {failed_meanwhile} requests failed meanwhile; "
          f"stream outcomes: {outcomes}")
    # extproc closes its stream once a request is decided: a worker's death cuts no generation.
    assert outcomes == ["complete"] * len(streams)

    # One death, one line; nothing else was touched (the node never stopped).
    deaths = [death for death in stack.group.exits if death.pid == victim]
    assert len(deaths) == 1 and deaths[0].returncode == -signal.SIGKILL and worker.restarts >= 1
    assert deaths[0].describe() in caplog.text
    assert {child.name: child.pid for child in stack.group.children if child is not worker} == others


def test_a_killed_pod_comes_back_on_its_address(node: tuple[LocalStack, StackInfo]) -> None:
    stack, info = node
    pod = _child(stack, "pod-local-1")
    victim, url = pod.pid, info.pod_urls["local"][0]
    assert _status(info.base_url) == 200
    os.kill(victim, signal.SIGKILL)
    wait_for("pod-local-1 running again", lambda: _back(pod, victim), STARTUP_S)
    assert f"READY {url}" in pod.output()  # the same address the config and Envoy's cluster hold
    wait_for("the gateway reaching the pod again", lambda: _status(info.base_url) == 200, STARTUP_S, interval=0.1)
    assert [_status(info.base_url) for _ in range(5)] == [200] * 5
    assert [death.name for death in stack.group.exits if death.pid == victim] == ["pod-local-1"]


def test_a_killed_worker_cuts_no_generation_and_its_slot_is_held_until_the_end(tmp_path: Path) -> None:
    """The worker that admitted a stream dies: the stream goes on (its decision is in Envoy's
    metadata), keeps its slot past the lease TTL (periodic access-log entries renew it, whoever
    receives them), and gives it back when it ends (its final entry reaches the restarted worker)."""
    stack = _stack(tmp_path, {
        "pools": [{"name": "local", "simulate": 1}], "models": [{"name": MODEL, "pool": "local"}],
        "tenants": [{"name": "solo", "keys": [{"env": "SUP_SOLO_KEY"}], "limits": {"concurrency": 1}}],
        "quota": {"lease_ttl_s": LEASE_TTL_S},
    }, workers=1, env={"SUP_SOLO_KEY": SOLO_KEY})
    solo = {"authorization": f"Bearer {SOLO_KEY}"}
    with stack as info:
        worker = _child(stack, "extproc-1")
        held = Stream(info.base_url, max_tokens=900, headers=solo)  # ~11 s at the pod's pace: past the TTL
        admitted_at = time.monotonic()
        try:
            assert held.first_chunk.wait(STARTUP_S) and held.status == 200
            assert _status(info.base_url, solo) == 429  # the limit bites while the slot is held
            victim = worker.pid
            os.kill(victim, signal.SIGKILL)
            wait_for("the worker started again", lambda: _back(worker, victim), STARTUP_S)
            # Past the lease's TTL the stream still holds its slot: renewed by the periodic entries.
            wait_for("the lease TTL to pass", lambda: time.monotonic() - admitted_at > LEASE_TTL_S + 1, 2 * LEASE_TTL_S)
            if held.outcome == "running":
                assert _status(info.base_url, solo) == 429
            assert held.join() == "complete"  # the worker's death cut nothing
        finally:
            held.hang_up()
        ended = time.monotonic()
        wait_for("the slot given back at the stream's end", lambda: _status(info.base_url, solo) == 200, STARTUP_S,
                 interval=0.05)
        print(f"\nslot back {time.monotonic() - ended:.2f} s after the stream ended")
        assert time.monotonic() - ended < LEASE_TTL_S  # settled from the entry, not by the TTL
        assert worker.pid != victim and worker.restarts >= 1


def _blackhole_access_log(dead_port: int) -> Any:
    """An envoy_patch sending the gRPC access log to a port nobody listens on (the stream is down)."""

    def patch(config: dict[str, Any], pod_urls: dict[str, list[str]]) -> None:
        listener = config["static_resources"]["listeners"][0]
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        for access_log in manager["access_log"]:
            if access_log["name"] == "envoy.access_loggers.http_grpc":
                access_log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = "nowhere"
        extproc = next(c for c in config["static_resources"]["clusters"] if c["name"] == "llmgw_extproc")
        nowhere = {**extproc, "name": "nowhere", "load_assignment": {"cluster_name": "nowhere", "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": dead_port}}}}]}]}}
        config["static_resources"]["clusters"].append(nowhere)

    return patch


def test_without_the_access_log_leases_come_back_by_ttl_and_the_ledger_marks_the_miss(tmp_path: Path) -> None:
    """Nothing blocks traffic when Envoy cannot deliver access-log entries: the request is served,
    its slot comes back by its lease's TTL, and the worker that decided it logs the miss and marks
    it ``unsettled`` in the ledger."""
    from extproc.launcher import free_port
    from extproc.ledger import read_file

    stack = _stack(tmp_path, {
        "pools": [{"name": "local", "simulate": 1}], "models": [{"name": MODEL, "pool": "local"}],
        "tenants": [{"name": "solo", "keys": [{"env": "SUP_SOLO_KEY"}], "limits": {"concurrency": 1}}],
        "quota": {"lease_ttl_s": 3.0},
    }, workers=1, env={"SUP_SOLO_KEY": SOLO_KEY}, envoy_patch=_blackhole_access_log(free_port()))
    solo = {"authorization": f"Bearer {SOLO_KEY}", "x-request-id": f"lost-{uuid.uuid4()}"}
    with stack as info:
        assert _status(info.base_url, solo) == 200
        served = time.monotonic()
        assert _status(info.base_url, solo) == 429  # nobody settled it: the slot is still held
        wait_for("the lease's TTL to free the slot", lambda: _status(info.base_url, solo) == 200, 3.0 + STARTUP_S,
                 interval=0.1)
        assert time.monotonic() - served >= 3.0 - 0.5
        ledger = info.log_dir.parent / "usage.jsonl"
        marked = wait_for("the miss in the ledger", lambda: [
            r for r in read_file(ledger) if r.request_id == solo["x-request-id"] and r.kind == "unsettled"
        ] if ledger.exists() else [], 30)
        assert marked[0].tenant == "solo" and marked[0].error == "no_access_log_entry"
        assert "got no access-log entry" in _child(stack, "extproc-1").output()


def test_serve_starts_a_killed_worker_again(tmp_path: Path) -> None:
    launched, address = serve(tmp_path, workers=1)  # one worker: the address answers only when it is back
    try:
        assert models_answered(address)
        (victim,) = children_of(launched.proc.pid)
        argv = cmdline(victim)
        os.kill(victim, signal.SIGKILL)
        wait_for("one line about the killed worker", lambda: re.search(
            rf"extproc-1 \(pid {victim}\) was killed by SIGKILL after [\d.]+ s; starting it again in [\d.]+ s",
            launched.stderr), STARTUP_S)
        (again,) = wait_for("the worker started again", lambda: [
            pid for pid in children_of(launched.proc.pid) if pid != victim and cmdline(pid) == argv], STARTUP_S)

        def answered() -> bool:
            try:
                return models_answered(address, attempts=1)
            except grpc.RpcError:  # not listening yet
                return False

        wait_for("the restarted worker answering", answered, STARTUP_S, interval=0.1)
        assert launched.proc.poll() is None, launched.stderr  # the node never stopped
        assert launched.stop() == 0, launched.stderr
        assert_no_orphans([again])
    finally:
        launched.kill()


def _models_status(address: str, key: str) -> int | None:
    """The status extproc answers ``GET /v1/models`` with for ``key`` (None: nobody listening)."""
    models = {":method": "GET", ":path": "/v1/models", "authorization": f"Bearer {key}"}
    try:
        with grpc.insecure_channel(address) as channel:
            answer = list(pb_grpc.ExternalProcessorStub(channel).Process(
                iter([request_headers(models, end_of_stream=True)]), timeout=10))
    except grpc.RpcError:
        return None
    return int(answer[0].immediate_response.status.code)


def test_a_restarted_worker_opens_its_port_only_once_it_has_the_keys_in_redis(
        tmp_path: Path, own_redis_server: RedisServer) -> None:
    # A key that only Redis holds: a worker that answered before its first key load would call it
    # wrong (401). Redis is paused while the restarted worker starts: it must wait, port closed.
    key = f"sk-restart-{uuid.uuid4().hex}"

    async def add() -> None:
        table = RedisKeyTable.from_url(own_redis_server.url)
        await table.add(key, "keyed")
        await table.aclose()

    asyncio.run(add())
    config = tmp_path / "llmgw.yaml"
    config.write_text(yaml.safe_dump({"pools": [{"name": "p", "endpoints": ["127.0.0.1:9"]}],
                                      "models": [{"name": "m", "pool": "p"}], "tenants": [{"name": "keyed"}],
                                      "redis_url": own_redis_server.url}))
    launched = Launched.start([sys.executable, "-m", "extproc.cli", "serve", "--config", str(config), "--port", "0",
                               "--workers", "1", "--run-dir", str(tmp_path / "run")], tmp_path / "stderr.txt")
    try:
        address = launched.read_until("READY ", STARTUP_S).splitlines()[-1].split()[1]
        assert _models_status(address, key) == 200
        (victim,) = children_of(launched.proc.pid)
        os.kill(victim, signal.SIGKILL)
        wait_for("the worker started again", lambda: [
            pid for pid in children_of(launched.proc.pid) if pid != victim], STARTUP_S, interval=0.01)
        admin = Redis.from_url(own_redis_server.url)
        admin.execute_command("CLIENT", "PAUSE", "3000", "ALL")  # before the new worker's imports are done
        statuses: list[int | None] = []
        wait_for("the restarted worker answering", lambda: statuses.append(_models_status(address, key))
                 or statuses[-1] is not None, STARTUP_S, interval=0.01)
        assert statuses[-1] == 200 and 401 not in statuses, statuses
        admin.close()
    finally:
        launched.kill()
