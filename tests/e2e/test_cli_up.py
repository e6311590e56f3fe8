"""`llmgw up` as a user runs it: ready within 10 s, answers, stops every child, reports a dead one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from extproc.launcher import free_port

def _children(pid: int) -> list[int]:
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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def up(tmp_path: Path):  # noqa: ANN201
    config = ROOT / "config" / "local.yaml"  # exactly what `make up` runs
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc.cli", "up", "--config", str(config), "--port", str(port),
         "--workers", "2", "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if k != "LLMGW_DEV_KEY"},
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Ctrl-C stops everything"):
            break
    ready_after = time.monotonic() - started
    yield proc, port, "".join(lines), ready_after
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_up_is_ready_answers_and_stops_cleanly(up) -> None:  # noqa: ANN001
    proc, port, welcome, ready_after = up
    assert ready_after < 10, f"ready after {ready_after:.1f} s"
    assert f"http://127.0.0.1:{port}/v1" in welcome
    # The printed openai example, run as a user would paste it.
    example = re.search(r"python - <<'EOF'\n(.*?)\nEOF", welcome, re.S)
    assert example is not None
    result = subprocess.run([sys.executable, "-c", example.group(1)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    curl = re.search(r"(curl -sN .*?)\n\n", welcome, re.S)
    assert curl is not None and "stream" in curl.group(1) and "Authorization: Bearer sk-llmgw-" in curl.group(1)
    wrong_key = example.group(1).replace('api_key="sk-llmgw-', 'api_key="sk-wrong-')
    refused = subprocess.run([sys.executable, "-c", wrong_key], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "AuthenticationError: Error code: 401" in refused.stderr

    children = _children(proc.pid)
    assert len(children) == 5  # two pods, two extproc workers, Envoy
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    time.sleep(0.2)
    assert not [pid for pid in children if _alive(pid)], "orphans left behind"


def test_up_reports_a_dead_child_and_exits_nonzero(up) -> None:  # noqa: ANN001
    proc, port, welcome, _ready = up
    key = re.search(r'api_key="([^"]+)"', welcome)
    assert key is not None
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key.group(1), max_retries=0)
    assert client.models.list().data
    children = _children(proc.pid)
    pods = [pid for pid in children if "extproc.sim" in Path(f"/proc/{pid}/cmdline").read_text()]
    os.kill(pods[0], signal.SIGKILL)
    assert proc.wait(timeout=15) == 1
    assert proc.stderr is not None and "pod-local-" in proc.stderr.read()  # names the child that died
    time.sleep(0.2)
    assert not [pid for pid in children if _alive(pid)], "orphans left behind"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)


def test_up_with_a_bad_config_names_the_field(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"pools": [{"name": "p", "endpoints": ["nohost"]}], "models": []}))
    result = subprocess.run([sys.executable, "-m", "extproc.cli", "up", "--config", str(config), "--port",
                             str(free_port()), "--run-dir", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "pools[0].endpoints[0]" in result.stderr


def test_serve_runs_workers_on_one_port_and_stops(tmp_path: Path) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from tests.helpers import request_headers

    config = tmp_path / "llmgw.yaml"
    config.write_text(yaml.safe_dump({"pools": [{"name": "p", "endpoints": ["127.0.0.1:9"]}],
                                      "models": [{"name": "m", "pool": "p"}]}))
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "serve", "--config", str(config), "--port", "0",
                             "--workers", "2", "--run-dir", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY 127.0.0.1:") and "(2 workers)" in line
        address = line.split()[1]
        assert len(_children(proc.pid)) == 2
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            models = {":method": "GET", ":path": "/v1/models"}
            for _ in range(4):  # new connections may land on either worker; both must answer
                answer = list(stub.Process(iter([request_headers(models, end_of_stream=True)]), timeout=5))
                assert answer[0].immediate_response.status.code == 200
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        time.sleep(0.2)
        assert not [pid for pid in children if _alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
