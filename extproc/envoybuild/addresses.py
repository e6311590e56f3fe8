"""Where the processes Envoy talks to listen: for the local stack, and for the docker-compose stack.

The compose stack's service names and ports are named here once: `compose/envoy.yaml` is built from
them, and the compose file's test compares its services against them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import NamedTuple

from extproc.config import ServerSpec


class HostPort(NamedTuple):
    """A TCP address: an IP address or a DNS name, and a port."""

    host: str
    port: int

    @classmethod
    def parse(cls, address: str) -> HostPort:
        """``host:port`` (``[v6]:port`` too), as the gateway config writes endpoints."""
        host, _, port = address.rpartition(":")
        return cls(host.strip("[]"), int(port))

    @property
    def is_ip(self) -> bool:
        """An IP address (a STATIC cluster takes it), else a name (a STRICT_DNS cluster resolves it)."""
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True


# Default ports: the gateway listener of `llmgw up`, Envoy's admin, extproc (server.port), the
# batching coordinator (`llmgw coordinator` without server.coordinator) and a pod (vLLM's default).
LISTEN_PORT = 10000
ADMIN_PORT = 9901
EXTPROC_PORT = ServerSpec().port
COORDINATOR_PORT = 8081
POD_PORT = 8000


@dataclass(frozen=True, slots=True)
class Addresses:
    """The listener, the admin interface, and the upstreams of one Envoy.

    ``pods`` empty: the pods cluster lists the endpoints of the config's pools (`llmgw up` fills in
    those of simulated pools), or ``placeholder_pod`` when no pool has any yet.
    """

    listener: HostPort = HostPort("0.0.0.0", LISTEN_PORT)
    admin: HostPort = HostPort("127.0.0.1", ADMIN_PORT)  # loopback only
    extproc: HostPort = HostPort("127.0.0.1", EXTPROC_PORT)
    coordinator: HostPort = HostPort("127.0.0.1", COORDINATOR_PORT)
    pods: tuple[HostPort, ...] = ()
    placeholder_pod: HostPort = HostPort("127.0.0.1", POD_PORT)


LOCAL = Addresses()

# docker-compose: each process is a service, reached by its service name on the compose network.
COMPOSE_ENVOY = "envoy"
COMPOSE_EXTPROC = HostPort("extproc", EXTPROC_PORT)
COMPOSE_COORDINATOR = HostPort("coordinator", COORDINATOR_PORT)
COMPOSE_PODS = (HostPort("pod-a", POD_PORT), HostPort("pod-b", POD_PORT))
COMPOSE_REDIS = HostPort("redis", 6379)
COMPOSE = Addresses(
    listener=HostPort("0.0.0.0", LISTEN_PORT),
    admin=HostPort("0.0.0.0", ADMIN_PORT),  # inside the container; publish it only on loopback
    extproc=COMPOSE_EXTPROC,
    coordinator=COMPOSE_COORDINATOR,
    pods=COMPOSE_PODS,
)
