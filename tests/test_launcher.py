"""The launcher's children: started safely beside gRPC, stopped with their parent, and explained
when they fail."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.launcher import ChildFailed, ProcessGroup
from tests.e2e.test_cli_up import alive, cmdline
from tests.helpers import wait_for

SPAWNS_BESIDE_GRPC = 200


@pytest.fixture
def busy_channel() -> Iterator[None]:
    """A gRPC server and a channel that keeps calling it from another thread, as in a test run
    whose earlier tests left channels open."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    stub.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=10)
    done = threading.Event()

    def call() -> None:
        while not done.is_set():
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    yield
    done.set()
    caller.join(timeout=10)
    channel.close()
    server.stop(None)


@pytest.mark.usefixtures("busy_channel")
def test_children_start_beside_a_busy_grpc_channel(tmp_path: Path) -> None:
    # With a preexec_fn (a real fork, gRPC's fork handlers in the child) 8 of 300 such children
    # aborted before exec (grpc/grpc#43055); the kernel's vfork path runs no handlers.
    group = ProcessGroup(tmp_path)
    codes = []
    for _ in range(SPAWNS_BESIDE_GRPC):
        child = group.spawn("true", ["true"], ready_line=False)
        codes.append(child.proc.wait(timeout=30))
    assert codes == [0] * SPAWNS_BESIDE_GRPC


def test_a_child_stops_when_the_launcher_is_killed(tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, sys\n"
         "from pathlib import Path\n"
         "from extproc.launcher import ProcessGroup\n"
         "child = ProcessGroup(Path(sys.argv[1])).spawn('sleeper', ['sleep', '300'], ready_line=False)\n"
         "print(child.pid, flush=True)\n"
         "signal.pause()\n", str(tmp_path)],
        stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    try:
        assert launcher.stdout is not None
        sleeper = int(launcher.stdout.readline())
        wait_for("the child's sleep", lambda: cmdline(sleeper)[:1] == ["sleep"])
        launcher.send_signal(signal.SIGKILL)  # no cleanup of its own runs: only the kernel's signal
        launcher.wait(timeout=10)
        wait_for("the child to stop with its launcher", lambda: not alive(sleeper))
    finally:
        launcher.kill()
        launcher.wait(timeout=10)


def test_a_child_that_dies_before_ready_is_explained(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    child = group.spawn("broken", [sys.executable, "-c",
                                   "import sys; print('loading the config', file=sys.stderr); "
                                   "print('config.yaml: pools: field required', file=sys.stderr); sys.exit(3)"])
    with pytest.raises(ChildFailed) as failure:
        group.wait_ready_line(child, 20)
    message = str(failure.value)
    assert "broken exited with code 3 before it was ready" in message
    assert str(tmp_path / "broken.log") in message
    assert message.index("loading the config") < message.index("config.yaml: pools: field required")
