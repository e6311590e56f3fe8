"""Operating extproc: the gRPC health service and reflection, a config reloaded on SIGHUP under
load without one failed request, and a graceful shutdown (NOT_SERVING first, in-flight streams
finished, the ledger flushed)."""

from __future__ import annotations

import hashlib
import os
import signal
import ssl
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from extproc.launcher import LocalStack, StackOptions
from tests.e2e.conftest import MODEL
from tests.helpers import wait_for

OLD_KEY, NEW_KEY = "sk-ops-old", "sk-ops-new"
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
ACCESS_LOG = "envoy.service.accesslog.v3.AccessLogService"


def _config(*keys: str) -> dict[str, object]:
    return {"pools": [{"name": "local", "simulate": 1}], "models": [{"name": MODEL, "pool": "local"}],
            "tenants": [{"name": f"t{i}", "keys": [{"sha256": hashlib.sha256(key.encode()).hexdigest()}],
                         "limits": {"rpm": 100_000}} for i, key in enumerate(keys)]}



def _stack(tmp_path: Path, config: dict[str, object], workers: int = 2) -> LocalStack:
    path = tmp_path / "llmgw.yaml"
    path.write_text(yaml.safe_dump(config))
    return LocalStack(StackOptions(config_path=path, run_dir=tmp_path, port=0, workers=workers,
                                   envoy_concurrency=1, log_level="WARNING"))


def test_health_and_reflection_name_both_services(tmp_path: Path) -> None:
    with _stack(tmp_path, _config(OLD_KEY), workers=1) as info, grpc.insecure_channel(info.extproc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", EXT_PROC, ACCESS_LOG):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=5)
        listed = {service.name for reply in replies for service in reply.list_services_response.service}
        assert {EXT_PROC, ACCESS_LOG, "grpc.health.v1.Health"} <= listed


def test_sighup_reloads_the_config_under_load_without_a_failed_request(tmp_path: Path) -> None:
    stack = _stack(tmp_path, _config(OLD_KEY))
    with stack as info:
        client = openai.OpenAI(base_url=f"{info.base_url}/v1", api_key=OLD_KEY, max_retries=0, timeout=30)
        outcomes: Counter[str] = Counter()
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                try:
                    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, stream=outcomes.total() % 2 == 0)
                    outcomes["ok"] += 1
                except openai.APIError as error:
                    outcomes[type(error).__name__] += 1

        threads = [threading.Thread(target=load) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            wait_for("the condition", lambda: outcomes["ok"] >= 20)
            path = info.config_path  # the workers' config: the stack's, its simulated pods' addresses filled in
            mtime = path.stat().st_mtime_ns
            resolved = yaml.safe_load(path.read_text())
            resolved["tenants"] = _config(OLD_KEY, NEW_KEY)["tenants"]
            path.write_text(yaml.safe_dump(resolved))
            os.utime(path, ns=(mtime, mtime))  # the file looks unchanged: only the signal reloads it
            assert stack.reload() == 2

            fresh = openai.OpenAI(base_url=f"{info.base_url}/v1", api_key=NEW_KEY, max_retries=0, timeout=30)

            def new_key_works() -> bool:
                try:
                    fresh.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
                    return True
                except openai.AuthenticationError:
                    return False

            # Both workers: several answers in a row (Envoy spreads its streams over them).
            wait_for("the condition", lambda: all(new_key_works() for _ in range(6)))
            before = outcomes["ok"]
            wait_for("the condition", lambda: outcomes["ok"] >= before + 20)  # and the load went on meanwhile
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert set(outcomes) == {"ok"}, outcomes


def test_sigterm_turns_health_not_serving_then_exits_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "llmgw.yaml"
    config = _config(OLD_KEY)
    config["pools"] = [{"name": "local", "endpoints": ["127.0.0.1:9"]}]
    path.write_text(yaml.safe_dump(config))
    worker = subprocess.Popen([sys.executable, "-m", "extproc.app", "--config", str(path), "--host", "127.0.0.1",
                               "--port", "0", "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "LLMGW_QUOTA_PATH": str(tmp_path / "quota.sqlite")})
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline()  # "READY host:port"
        assert line.startswith("READY "), line
        with grpc.insecure_channel(line.split()[1]) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=EXT_PROC),
                                                               timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            worker.send_signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # before it goes
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_tls_listener_serves_https_with_http2_and_http1(tmp_path: Path) -> None:
    certificate, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=llmgw-test",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(certificate)],
                   check=True, capture_output=True)
    path = tmp_path / "llmgw.yaml"
    path.write_text(yaml.safe_dump(_config(OLD_KEY)))
    options = StackOptions(config_path=path, run_dir=tmp_path, port=0, workers=1, envoy_concurrency=1,
                           log_level="WARNING", tls=(certificate, key))
    with LocalStack(options) as info:
        assert info.base_url.startswith("https://")
        for http2 in (True, False):
            with httpx.Client(verify=ssl.create_default_context(cafile=str(certificate)), http2=http2) as http:
                client = openai.OpenAI(base_url=f"{info.base_url}/v1", api_key=OLD_KEY, max_retries=0, timeout=30,
                                       http_client=http)
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
                assert raw.http_response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
                assert raw.parse().choices[0].message.content
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on that port
            httpx.get(info.base_url.replace("https://", "http://") + "/v1/models", timeout=5)
