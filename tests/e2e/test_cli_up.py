"""`llmgw up` and `llmgw serve` as a user runs them: ready, answering, restarting a killed child,
stopping every child.

Robust on a busy 2-core machine: every wait is a condition with a deadline (never a fixed sleep);
the launchers bind free ports themselves (``--port 0``, read back from what they print) instead
of ports picked here that someone else may take first; their stdout is read by a thread to the
end (a pipe nobody reads fills up and blocks the writer) and their stderr goes to a file that a
failure shows.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

import httpx
import openai
import pytest
import yaml

from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 60  # generous: a CPU hog beside the suite makes a start take ~15 s instead of ~2 s
T = TypeVar("T")


def children_of(pid: int) -> list[int]:
    """Direct children of a process (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def cmdline(pid: int) -> list[str]:
    """A process's argv ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []



@dataclass
class Launched:
    """A launcher process: its stdout lines (read to the end by a thread), its stderr file."""

    proc: subprocess.Popen[str]
    stderr_path: Path
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, argv: list[str], stderr_path: Path, env: dict[str, str] | None = None) -> Launched:
        """Run ``argv`` (stdout piped and drained, stderr to ``stderr_path``)."""
        with open(stderr_path, "w") as stderr:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                                    text=True, env=env, cwd=ROOT)
        launched = cls(proc, stderr_path)
        assert proc.stdout is not None
        threading.Thread(target=launched._drain, args=(proc.stdout,), daemon=True).start()
        return launched

    def _drain(self, stdout: IO[str]) -> None:
        for line in stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output

    @property
    def stderr(self) -> str:
        """What it wrote to stderr so far."""
        return self.stderr_path.read_text(errors="replace")

    def read_until(self, prefix: str, timeout: float) -> str:
        """Its stdout up to and including the first line starting with ``prefix``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no line {prefix!r} within {timeout:.0f} s; stdout: {''.join(self.seen)!r}\n"
                            f"stderr: {self.stderr}")
            if not line:
                pytest.fail(f"it exited ({self.proc.wait()}) before a line {prefix!r}; "
                            f"stdout: {''.join(self.seen)!r}\nstderr: {self.stderr}")
            self.seen.append(line)
            if line.startswith(prefix):
                return "".join(self.seen)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, and its exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL if it still runs (cleanup; its children get PR_SET_PDEATHSIG)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def assert_no_orphans(pids: list[int]) -> None:
    """Every one of ``pids`` is gone (the launcher waited for them before it exited)."""
    running = [(pid, cmdline(pid)) for pid in pids if alive(pid)]  # named now: once gone, a pid has no cmdline
    wait_for(f"none left behind of {running}", lambda: not any(alive(pid) for pid, _ in running), 5.0, 0.05)


@dataclass
class Up:
    """A running `llmgw up`."""

    launched: Launched
    port: int
    welcome: str
    ready_after: float

    @property
    def proc(self) -> subprocess.Popen[str]:
        """The launcher process."""
        return self.launched.proc


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    config = ROOT / "config" / "local.yaml"  # exactly what `make up` runs
    started = time.monotonic()
    launched = Launched.start(
        [sys.executable, "-m", "extproc.cli", "up", "--config", str(config), "--port", "0",
         "--workers", "2", "--run-dir", str(tmp_path / "run")],
        tmp_path / "stderr.txt", env={k: v for k, v in os.environ.items() if k != "LLMGW_DEV_KEY"})
    try:
        welcome = launched.read_until("Ctrl-C stops everything", STARTUP_S)
        ready_after = time.monotonic() - started
        gateway = re.search(r"gateway\s+http://127\.0\.0\.1:(\d+)/v1", welcome)
        assert gateway is not None, welcome
        yield Up(launched, int(gateway.group(1)), welcome, ready_after)
    finally:
        launched.kill()


@pytest.mark.timeout(240)
def test_up_is_ready_answers_and_stops_cleanly(up: Up) -> None:
    # How fast it starts is a benchmark's business (~2 s idle, ~15 s beside a CPU hog), not a test's.
    print(f"llmgw up ready after {up.ready_after:.1f} s")
    assert f"http://127.0.0.1:{up.port}/v1" in up.welcome
    # The printed openai example, run as a user would paste it.
    example = re.search(r"python - <<'EOF'\n(.*?)\nEOF", up.welcome, re.S)
    assert example is not None
    result = subprocess.run([sys.executable, "-c", example.group(1)], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    curl = re.search(r"(curl -sN .*?)\n\n", up.welcome, re.S)
    assert curl is not None and "stream" in curl.group(1) and "Authorization: Bearer sk-llmgw-" in curl.group(1)
    wrong_key = example.group(1).replace('api_key="sk-llmgw-', 'api_key="sk-wrong-')
    refused = subprocess.run([sys.executable, "-c", wrong_key], capture_output=True, text=True, timeout=90)
    assert refused.returncode != 0 and "AuthenticationError: Error code: 401" in refused.stderr

    children = children_of(up.proc.pid)
    assert len(children) == 5  # two pods, two extproc workers, Envoy
    assert up.launched.stop() == 0, up.launched.stderr
    assert_no_orphans(children)


@pytest.mark.timeout(240)
def test_up_restarts_a_killed_pod_on_its_address(up: Up) -> None:
    key = re.search(r'api_key="([^"]+)"', up.welcome)
    assert key is not None
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key=key.group(1), max_retries=0)
    assert client.models.list().data
    pods = [pid for pid in children_of(up.proc.pid) if "llmgw_sim" in cmdline(pid)]
    assert len(pods) == 2
    victim = pods[0]
    argv = cmdline(victim)
    port = argv[argv.index("--port") + 1]
    os.kill(victim, signal.SIGKILL)

    # One line names the child, how it died and when it starts again.
    line = wait_for("a line about the killed pod", lambda: re.search(
        rf"pod-local-\d \(pid {victim}\) was killed by SIGKILL after [\d.]+ s; starting it again in [\d.]+ s",
        up.launched.stderr), STARTUP_S)
    assert line
    # Back on the same port (the gateway config and Envoy's cluster name it), and serving.
    again = wait_for("the pod started again", lambda: [
        pid for pid in children_of(up.proc.pid) if pid != victim and cmdline(pid) == argv], STARTUP_S)

    def pod_answers() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for("the pod answering on its old address", pod_answers, STARTUP_S, interval=0.1)
    for _ in range(4):  # either pod may be picked: both answer
        reply = client.chat.completions.create(model="gpt-4o-mini", max_tokens=4,
                                               messages=[{"role": "user", "content": "Hello!"}])
        assert reply.choices[0].message.content
    assert up.proc.poll() is None, up.launched.stderr  # the node never stopped

    children = children_of(up.proc.pid)
    assert again[0] in children and len(children) == 5
    assert up.launched.stop() == 0, up.launched.stderr
    assert_no_orphans(children)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{up.port}/v1/models", timeout=2)


def test_up_with_a_bad_config_names_the_field(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"pools": [{"name": "p", "endpoints": ["nohost"]}], "models": []}))
    result = subprocess.run([sys.executable, "-m", "extproc.cli", "up", "--config", str(config), "--port", "0",
                             "--run-dir", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=STARTUP_S, cwd=ROOT)
    assert result.returncode == 1
    assert "pools[0].endpoints[0]" in result.stderr


def serve(tmp_path: Path, workers: int) -> tuple[Launched, str]:
    """`llmgw serve --port 0` of a small config, and the address its READY line names."""
    config = tmp_path / "llmgw.yaml"
    config.write_text(yaml.safe_dump({"pools": [{"name": "p", "endpoints": ["127.0.0.1:9"]}],
                                      "models": [{"name": "m", "pool": "p"}]}))
    launched = Launched.start([sys.executable, "-m", "extproc.cli", "serve", "--config", str(config), "--port", "0",
                               "--workers", str(workers), "--run-dir", str(tmp_path / "run")],
                              tmp_path / "stderr.txt")
    line = launched.read_until("READY ", STARTUP_S).splitlines()[-1]
    assert line.startswith("READY 127.0.0.1:") and f"({workers} workers)" in line
    return launched, line.split()[1]


def models_answered(address: str, attempts: int = 4) -> bool:
    """Whether ``attempts`` ext_proc streams asking for ``GET /v1/models`` are answered 200."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from tests.helpers import request_headers

    models = {":method": "GET", ":path": "/v1/models"}
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        for _ in range(attempts):
            answer = list(stub.Process(iter([request_headers(models, end_of_stream=True)]), timeout=30))
            if answer[0].immediate_response.status.code != 200:
                return False
    return True


def test_serve_runs_workers_on_one_port_and_stops(tmp_path: Path) -> None:
    launched, address = serve(tmp_path, workers=2)
    try:
        children = children_of(launched.proc.pid)
        assert len(children) == 2
        assert models_answered(address)
        assert launched.stop() == 0, launched.stderr
        assert_no_orphans(children)
    finally:
        launched.kill()


@pytest.mark.timeout(300)
def test_up_on_real_llamacpp_pods_answers_with_real_text(tmp_path: Path) -> None:
    config = ROOT / "config" / "llamacpp.yaml"  # exactly what `make up-llamacpp` runs
    launched = Launched.start(
        [sys.executable, "-m", "extproc.cli", "up", "--config", str(config), "--port", "0",
         "--workers", "1", "--run-dir", str(tmp_path / "run")],
        tmp_path / "stderr.txt", env={k: v for k, v in os.environ.items() if k != "LLMGW_DEV_KEY"})
    try:
        welcome = launched.read_until("Ctrl-C stops everything", 180)  # two model loads beside the rest
        example = re.search(r"python - <<'EOF'\n(.*?)\nEOF", welcome, re.S)
        assert example is not None
        result = subprocess.run([sys.executable, "-c", example.group(1)], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0 and result.stdout.strip(), result.stderr
        children = children_of(launched.proc.pid)
        servers = [grand for child in children for grand in children_of(child)
                   if cmdline(grand)[:1] and cmdline(grand)[0].endswith("llama-server")]
        assert len(servers) == 2  # two real engines, each under its `serve` wrapper
        # The model's own tokenizer and template, from its GGUF: the gateway counts as the engine does
        resolved = yaml.safe_load((tmp_path / "run" / "llmgw.resolved.yaml").read_text())
        smollm2 = next(m for m in resolved["models"] if m["name"] == "smollm2")
        assert Path(smollm2["tokenizer"]).name == "tokenizer.json" and Path(smollm2["tokenizer"]).exists()
        assert Path(smollm2["chat_template"]).name == "chat_template.jinja"
        assert launched.stop() == 0, launched.stderr
        assert_no_orphans(children + servers)
    finally:
        launched.kill()
