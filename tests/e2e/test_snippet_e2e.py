"""The plain-Envoy snippet in an Envoy that serves something else: real traffic with the official
openai client through an unrelated bootstrap (a public listener with its own /healthz route, and a
second listener) into which the snippet was spliced, with the local extproc and simulated pods.

The Envoy's other routes must never meet extproc (its filters are off there); the gateway's
routes decide, route, strip the usage chunk a client did not ask for, and settle every request
through the gRPC access log into the node's ledger.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from extproc import envoyconf
from extproc.config import load_spec
from extproc.envoybuild.addresses import Addresses, HostPort
from extproc.envoybuild.snippet import snippet, splice
from extproc.launcher import Child, ProcessGroup, StackInfo, wait_http_ok
from extproc.ledger import UsageRecord, read_file
from tests.e2e.conftest import MODEL, small_stack
from tests.e2e.test_envoy_config import unrelated_bootstrap
from tests.helpers import wait_for

HELLO = [{"role": "user", "content": "hello"}]
READY_S = 30.0


@dataclass(frozen=True)
class HostEnvoy:
    """The Envoy the snippet went into, and the llmgw stack it reaches."""

    stack: StackInfo
    public: str  # base URL of the listener with the snippet
    internal: str  # base URL of the listener without it
    admin: str


def _admin_address(path: Path, envoy: Child) -> str:
    def written() -> str:
        assert envoy.proc.poll() is None, f"envoy exited ({envoy.proc.returncode}): see {envoy.log_path}"
        return path.read_text().strip() if path.is_file() else ""

    return wait_for(f"envoy's admin address (see {envoy.log_path})", written, READY_S, interval=0.05)


def _listener_ports(admin: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{admin}/listeners?format=json", timeout=5) as response:
        statuses = json.load(response)["listener_statuses"]
    return {s["name"]: int(s["local_address"]["socket_address"]["port_value"]) for s in statuses}


@pytest.fixture(scope="module")
def host_envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostEnvoy]:
    with small_stack(tmp_path_factory, "snippet-stack", pods=2, sim_args=("--record", "50")) as info:
        # The stack's resolved config lists its simulated pods; extproc listens where the stack says.
        pieces = snippet(load_spec(info.config_path), Addresses(extproc=HostPort.parse(info.extproc_address)))
        run_dir = Path(tmp_path_factory.mktemp("host-envoy"))
        path = envoyconf.write(splice(unrelated_bootstrap(), "public", pieces), run_dir / "envoy.yaml")
        group = ProcessGroup(run_dir / "logs")
        try:
            admin_file = run_dir / "admin.address"  # port 0 everywhere: Envoy binds free ports itself
            envoy = group.spawn("envoy", [envoyconf.envoy_binary(), "-c", str(path), "--use-dynamic-base-id",
                                          "--admin-address-path", str(admin_file), "--concurrency", "1",
                                          "--log-level", "warn"], ready_line=False)
            admin = f"http://{_admin_address(admin_file, envoy)}"
            wait_http_ok(f"{admin}/ready", READY_S, envoy)
            ports = _listener_ports(admin)
            yield HostEnvoy(info, f"http://127.0.0.1:{ports['public']}", f"http://127.0.0.1:{ports['internal']}", admin)
        finally:
            group.stop()


def _ext_proc_streams(envoy: HostEnvoy) -> int:
    with urllib.request.urlopen(f"{envoy.admin}/stats?format=json&filter=ext_proc.streams_started", timeout=5) as r:
        stats = json.load(r)["stats"]
    return sum(int(s.get("value", 0)) for s in stats if s.get("name", "").endswith("ext_proc.streams_started"))


def _ledger_record(envoy: HostEnvoy, request_id: str, timeout: float = 10) -> UsageRecord:
    ledger = envoy.stack.log_dir.parent / "usage.jsonl"
    found = wait_for(f"a ledger record for {request_id} (the access log reaching extproc)", lambda: [
        r for r in read_file(ledger) if r.request_id == request_id] if ledger.exists() else [], timeout, 0.05)
    assert len(found) == 1, found
    return found[0]


def test_the_host_envoy_s_own_routes_never_meet_extproc(host_envoy: HostEnvoy) -> None:
    before = _ext_proc_streams(host_envoy)
    public = httpx.get(f"{host_envoy.public}/healthz", timeout=5)
    internal = httpx.get(f"{host_envoy.internal}/healthz", timeout=5)
    assert (public.status_code, public.text) == (200, "public ok")  # extproc would have said 404 unknown_url
    assert (internal.status_code, internal.text) == (200, "internal ok")
    assert _ext_proc_streams(host_envoy) == before  # the filters stayed off on these routes


def test_openai_client_through_the_snippet(host_envoy: HostEnvoy) -> None:
    client = openai.OpenAI(base_url=f"{host_envoy.public}/v1", api_key="unused", max_retries=0, timeout=30)
    assert MODEL in [m.id for m in client.models.list()]  # answered by extproc from its config
    request_id = f"snippet-{uuid.uuid4()}"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=5, extra_headers={"x-request-id": request_id})
    completion = raw.parse()
    assert completion.choices[0].message.content
    # Headers extproc set on the request come back on the response (the routes carry them here).
    assert raw.headers["x-llmgw-pool"] == "local" and raw.headers["x-request-id"] == request_id
    record = _ledger_record(host_envoy, request_id)
    assert completion.usage is not None
    assert record.kind == "served" and record.output_tokens == completion.usage.completion_tokens


def test_a_stream_loses_the_usage_chunk_it_did_not_ask_for(host_envoy: HostEnvoy) -> None:
    client = openai.OpenAI(base_url=f"{host_envoy.public}/v1", api_key="unused", max_retries=0, timeout=30)
    request_id = f"snippet-stream-{uuid.uuid4()}"
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, stream=True,
                                                 extra_body={"ignore_eos": True},
                                                 extra_headers={"x-request-id": request_id}))
    assert chunks and all(c.usage is None for c in chunks)  # the Lua response filter removed it
    record = _ledger_record(host_envoy, request_id)
    assert not record.usage_estimated and record.output_tokens == 12  # ...after reading it


def test_unknown_api_paths_are_answered_by_extproc(host_envoy: HostEnvoy) -> None:
    response = httpx.post(f"{host_envoy.public}/v1/nothing-here", json={}, timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_url"
