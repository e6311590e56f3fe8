"""Network namespaces on one bridge: several "nodes" on this machine, each with its own network
stack (its own loopback and ports), reaching the host (and a Redis bound to the bridge's address)
and reached by it at their own addresses. Needs root and ``ip`` (iproute2).

    with Bridge.create(2) as bridge:        # 10.x.y.1 on the host, 10.x.y.10 and .11 inside
        subprocess.Popen(bridge.nodes[0].wrap(["python", "-m", "extproc.cli", "up", ...]))

Every name carries a random tag, so tests on a shared machine never meet; ``close`` deletes the
namespaces and the bridge (their veth pairs go with them).
"""

from __future__ import annotations

import random
import subprocess
import uuid
from dataclasses import dataclass, field
from types import TracebackType


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _subnets_in_use() -> set[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr"], check=True, capture_output=True, text=True).stdout
    return {word.rsplit(".", 1)[0] for line in out.splitlines() for word in line.split() if word.count(".") == 3}


@dataclass(frozen=True)
class Node:
    """One namespace: its name and its address on the bridge."""

    namespace: str
    address: str

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass
class Bridge:
    name: str
    prefix: str  # "10.x.y": the host is .1, node i is .(10 + i)
    nodes: list[Node] = field(default_factory=list)

    @property
    def host(self) -> str:
        """The host's address on the bridge (where a Redis for the nodes listens)."""
        return f"{self.prefix}.1"

    @classmethod
    def create(cls, count: int) -> Bridge:
        """A bridge with ``count`` namespaces on it, each with its loopback up."""
        used = _subnets_in_use()
        prefix = next(p for p in (f"10.{random.randint(200, 250)}.{random.randint(0, 255)}" for _ in range(100))
                      if p not in used)
        tag = uuid.uuid4().hex[:6]
        bridge = cls(f"lgw{tag}", prefix)
        try:
            _ip("link", "add", bridge.name, "type", "bridge")
            _ip("addr", "add", f"{bridge.host}/24", "dev", bridge.name)
            _ip("link", "set", bridge.name, "up")
            for index in range(count):
                node = Node(f"llmgw-{tag}-{index}", f"{prefix}.{10 + index}")
                outside, inside = f"lgw{tag}h{index}", f"lgw{tag}n{index}"
                _ip("netns", "add", node.namespace)
                bridge.nodes.append(node)
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", node.namespace)
                _ip("link", "set", outside, "master", bridge.name, "up")
                _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", inside)
                _ip("-n", node.namespace, "link", "set", inside, "up")
                _ip("-n", node.namespace, "link", "set", "lo", "up")
        except BaseException:
            bridge.close()
            raise
        return bridge

    def close(self) -> None:
        """Delete the namespaces and the bridge."""
        for node in self.nodes:
            subprocess.run(["ip", "netns", "del", node.namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.name], capture_output=True, timeout=30)
        self.nodes = []

    def __enter__(self) -> Bridge:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
