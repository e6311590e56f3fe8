"""A real Redis Cluster on 127.0.0.1 for tests and benchmarks: ``masters`` primaries sharing the
16,384 slots evenly, each with ``replicas`` replicas, made with the cluster's own commands
(``CLUSTER MEET``, ``ADDSLOTS``, ``REPLICATE``: redis-cli is not needed) from the same
``redis-server`` the single-node tests use. Free ports only; every node is a child of this process.
"""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from llmgw_testing.redis_server import RedisServer

SLOTS = 16384
BUS_OFFSET = 10000  # a node's cluster bus listens this far above its port (which must be <= 55535)


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (10,000 above) is free too."""
    for _ in range(1000):
        port = random.randint(20000, 65535 - BUS_OFFSET)
        if _free(port) and _free(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class RedisCluster:
    binary: str
    workdir: Path
    masters: int = 3
    replicas: int = 0
    node_timeout_ms: int = 5000  # how long a primary may be silent before it is failed (its replica takes over)
    host: str = "127.0.0.1"  # the address every node binds and announces
    tls: tuple[Path, Path] | None = None  # (certificate, key): clients, the bus and replication over TLS only
    env: dict[str, str] | None = None  # the servers' environment (llmgw_testing.redis_tls)
    password: str | None = None  # every node's requirepass
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every primary as a seed node (``rediss+cluster://``, the
        password and ``?ssl_ca_certs=`` with TLS)."""
        auth = f":{self.password}@" if self.password else ""
        seeds = ",".join(f"{self.host}:{node.port}" for node in self.nodes[:self.masters])
        if self.tls is not None:
            return f"rediss+cluster://{auth}{seeds}?ssl_ca_certs={self.tls[0]}"
        return f"redis+cluster://{auth}{seeds}"

    def client(self, node: RedisServer) -> redis.Redis:
        if self.tls is not None:
            return redis.Redis(host=self.host, port=node.port, socket_timeout=2, password=self.password, ssl=True,
                               ssl_ca_certs=str(self.tls[0]))
        return redis.Redis(host=self.host, port=node.port, socket_timeout=2, password=self.password)

    def start(self, timeout: float = 30.0) -> None:
        """Start every node, join them, give the primaries their slots and the replicas their
        primaries; return once every node says the cluster is ok."""
        for index in range(self.masters * (1 + self.replicas)):
            workdir = self.workdir / f"node-{index}"
            workdir.mkdir(parents=True, exist_ok=True)
            node = RedisServer(self.binary, workdir, port=cluster_port(), host=self.host, extra_args=(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-replica-validity-factor", "0",
                # the other primaries keep serving their slots while one is failing over
                "--cluster-require-full-coverage", "no",
                *(("--tls-cluster", "yes", "--tls-replication", "yes") if self.tls else ())),
                tls=self.tls, env=self.env, password=self.password)
            node.start()
            self.nodes.append(node)
        first = self.client(self.nodes[0])
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", self.host, node.port)
        per = SLOTS // self.masters
        for index, node in enumerate(self.nodes[:self.masters]):
            end = SLOTS if index == self.masters - 1 else (index + 1) * per
            self.client(node).execute_command("CLUSTER", "ADDSLOTS", *range(index * per, end))
        self._wait(lambda: all(len(self._nodes_of(node)) == len(self.nodes) for node in self.nodes), timeout,
                   "every node knows every other")
        for index, node in enumerate(self.nodes[self.masters:]):
            primary = self.nodes[index % self.masters]
            primary_id = self.client(primary).execute_command("CLUSTER", "MYID")
            self.client(node).execute_command("CLUSTER", "REPLICATE", primary_id)
        self._wait(lambda: all(self.ok(node) and self._covered(node) for node in self.nodes), timeout,
                   "the cluster ok, every slot served, on every node")

    def _nodes_of(self, node: RedisServer) -> list[str]:
        return self.client(node).execute_command("CLUSTER", "NODES").decode().strip().splitlines()

    def ok(self, node: RedisServer) -> bool:
        """Whether ``node`` says the cluster is ok (every slot served)."""
        try:
            info = self.client(node).execute_command("CLUSTER", "INFO").decode()
        except redis.RedisError:
            return False
        return "cluster_state:ok" in info

    def _covered(self, node: RedisServer) -> bool:
        """Whether ``node``'s slot map serves all 16,384 slots (what a client reads first)."""
        try:
            ranges = self.client(node).execute_command("CLUSTER", "SLOTS")
        except redis.RedisError:
            return False
        return sum(int(end) - int(start) + 1 for start, end, *_ in ranges) == SLOTS

    def primary_of(self, slot: int) -> RedisServer:
        """The node serving ``slot`` now."""
        for start, end, primary, *_ in self.client(self.nodes[-1]).execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(node for node in self.nodes if node.port == int(primary[1]))
        raise LookupError(slot)

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        """The nodes replicating ``primary`` now (by ``primary``'s own ``CLUSTER NODES``)."""
        lines = [line.split() for line in self._nodes_of(primary)]
        mine = next(fields[0] for fields in lines if "myself" in fields[2])
        ports = {int(fields[1].split("@")[0].rpartition(":")[2]) for fields in lines
                 if fields[3] == mine and "fail" not in fields[2]}
        return [node for node in self.nodes if node.port in ports]

    @staticmethod
    def _wait(check: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster: {what}: not within {timeout:.0f} s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill every node."""
        for node in self.nodes:
            node.stop()
