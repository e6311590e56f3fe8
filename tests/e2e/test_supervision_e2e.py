"""Supervision: a killed extproc worker or pod is started again and the node keeps serving; the
concurrency slot a dead worker held comes back by its lease's TTL.

Every wait is a condition with a deadline, generous enough for a CPU hog beside the suite.
"""

from __future__ import annotations

import os
import re
import signal
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

from extproc.launcher import Backoff, Child, ChildExit, LocalStack, StackInfo, StackOptions
from tests.e2e.conftest import MODEL
from tests.e2e.test_cli_up import STARTUP_S, assert_no_orphans, children_of, cmdline, models_answered, serve, wait_for

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
    # A request's two ext_proc streams share one Envoy connection, so one worker: those the survivor
    # did not log were on the killed one.
    survivor_log = survivor.output()
    on_victim = [s.outcome for s in streams if f'"request_id":"{s.request_id}"' not in survivor_log]
    print(f"\nworker back after {back_after:.1f} s; {failed_meanwhile} requests failed meanwhile; "
          f"{outcomes.count('cut')} of {len(streams)} streams in flight cut ({len(on_victim)} were on the "
          f"killed worker: {on_victim})")
    assert set(outcomes) <= {"complete", "cut"}

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


def test_a_dead_workers_slot_comes_back_by_its_lease_ttl(tmp_path: Path) -> None:
    """The slot of a stream held by a SIGKILLed worker is freed by nobody: its lease expires
    ``quota.lease_ttl_s`` after the last renewal (every TTL/3); then the restarted worker admits."""
    stack = _stack(tmp_path, {
        "pools": [{"name": "local", "simulate": 1}], "models": [{"name": MODEL, "pool": "local"}],
        "tenants": [{"name": "solo", "keys": [{"env": "SUP_SOLO_KEY"}], "limits": {"concurrency": 1}}],
        "quota": {"lease_ttl_s": LEASE_TTL_S},
    }, workers=1, env={"SUP_SOLO_KEY": SOLO_KEY})
    solo = {"authorization": f"Bearer {SOLO_KEY}"}
    with stack as info:
        worker = _child(stack, "extproc-1")
        held = Stream(info.base_url, max_tokens=6000, headers=solo)  # ~75 s: outlives the test
        try:
            assert held.first_chunk.wait(STARTUP_S) and held.status == 200
            assert _status(info.base_url, solo) == 429  # the limit bites while the slot is held
            victim = worker.pid
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            answers: list[tuple[float, int | None]] = []
            while not answers or answers[-1][1] != 200:
                assert time.monotonic() - killed < LEASE_TTL_S + STARTUP_S, f"not admitted again: {answers}"
                answers.append((time.monotonic() - killed, _status(info.base_url, solo)))
                time.sleep(0.05)
        finally:
            held.hang_up()
        served = [(at, status) for at, status in answers if status in (200, 429)]  # the new worker answered
        back, admitted = served[0][0], answers[-1][0]
        print(f"\nworker back after {back:.1f} s, tenant admitted again after {admitted:.1f} s "
              f"(lease TTL {LEASE_TTL_S} s); answers: {[status for _, status in answers]}")
        assert worker.pid != victim and worker.restarts >= 1  # workers=1: the restarted worker admitted it
        assert admitted <= max(LEASE_TTL_S, back) + 3.0
        if back < LEASE_TTL_S / 2:  # back well before the lease could expire: it still held the slot
            assert served[0][1] == 429, answers


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
