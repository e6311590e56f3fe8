"""Redis Cluster: where the gateway's shared state lives when one Redis is not enough.

``redis_url`` names one server (``redis://``, ``rediss://``, ``unix://``) or a cluster by some of
its nodes: ``redis+cluster://[user:password@]host:port[,host:port...][/0]`` (``rediss+cluster://``
for TLS, with ``?ssl_ca_certs=/path/ca.pem`` for a private CA; ``TLS_OPTIONS``). The factories
here hand every user of Redis the right client for either:

- ``pipelined(url)``: the hot path's connection (quotas, the response cache's lookups): a
  ``PipelinedConnection`` to one server, or a ``ClusterConnection``, one pipelined connection per
  primary, each command sent to the primary owning its key's slot;
- ``client(url)`` / ``sync_client(url)``: redis-py's ``Redis`` or ``RedisCluster`` (keys, the
  ledger, the cache's streams, ``llmgw usage``), which follow the cluster themselves.

Every multi-key script's keys share a slot: quota keys carry the tenant as a hash tag
(``llmgw:quota:{tenant}:...``), the key table ``{keys}``; the ledger and the cache's announcements
are one stream each, so a reader of a stream misses nothing.

``ClusterConnection`` learns the slots with ``CLUSTER SLOTS`` from any node it knows, and follows
redirections: ``MOVED`` (the slot moved for good: its owner is noted, the whole map re-read in the
background, the command sent again there), ``ASK`` (a slot being migrated: ``ASKING`` then the
command on the node named, the map unchanged) and ``TRYAGAIN`` (a multi-key command during a
migration: sent again shortly). A node that does not answer (a failover under way) makes it re-read
the map from the others and send the command once more; a cluster that still cannot answer is an
outage (``ConnectionError``), as one Redis away is.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from redis.crc import key_slot

from extproc.quota.resp import PipelinedConnection, RedisReplyError

log = logging.getLogger("llmgw.redis")
SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SLOTS = 16384
# TLS options a URL's query may carry (redis-py's names): a private CA, a client certificate, or
# ssl_cert_reqs=none to skip verification.
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
MAX_REDIRECTIONS = 5
TRYAGAIN_S = 0.05
T = TypeVar("T")


@dataclass(frozen=True)
class ClusterUrl:
    """A ``redis+cluster://`` URL: the scheme of each node's connection, credentials, seed nodes."""

    scheme: str  # redis or rediss
    username: str | None
    password: str | None
    seeds: tuple[tuple[str, int], ...]
    tls: tuple[tuple[str, str], ...] = ()  # TLS_OPTIONS given in the query, as given

    def node_url(self, host: str, port: int) -> str:
        """The URL of one node, with the cluster's credentials, scheme and TLS options."""
        auth = ""
        if self.password is not None:
            auth = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@"
        return f"{self.scheme}://{auth}{host}:{port}/0" + (f"?{urlencode(self.tls)}" if self.tls else "")


def parse_cluster(url: str) -> ClusterUrl | None:
    """The cluster ``url`` names, or None for a single server's URL. Raises ``ValueError`` for a
    cluster URL without a node, with a port that is not a number, or with a database other than 0
    (a cluster has only 0)."""
    scheme, _, rest = url.partition("://")
    if scheme not in SCHEMES:
        return None
    split = urlsplit(f"{SCHEMES[scheme]}://{rest}")
    if split.path not in ("", "/", "/0"):
        raise ValueError("a Redis Cluster has only database 0")
    tls = tuple(parse_qsl(split.query, keep_blank_values=True))
    unknown = sorted({name for name, _ in tls} - set(TLS_OPTIONS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a cluster URL option ({', '.join(TLS_OPTIONS)})")
    credentials, _, hosts = split.netloc.rpartition("@")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    seeds = []
    for node in hosts.split(","):
        host, _, port = node.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{node.strip() or '(empty)'}: a cluster node is host:port")
        seeds.append((host.strip("[]"), int(port)))
    return ClusterUrl(SCHEMES[scheme], unquote(username) or None, unquote(password) if credentials else None,
                      tuple(seeds), tls)


def check_url(url: str) -> None:
    """Raise ``ValueError`` naming what is wrong with ``url`` as a ``redis_url``."""
    scheme = url.partition("://")[0]
    if scheme in SCHEMES:
        parse_cluster(url)
    elif scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"{scheme}: not a Redis URL scheme (redis, rediss, unix, redis+cluster, rediss+cluster)")


def pipelined(url: str, *, timeout_s: float = 0.5, connect_timeout_s: float = 0.5,
              batch_s: float = 0.05) -> PipelinedConnection | ClusterConnection:
    """The hot path's connection to ``url``: one server's, or the cluster's."""
    cluster = parse_cluster(url)
    if cluster is None:
        return PipelinedConnection(url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, batch_s=batch_s)
    return ClusterConnection(cluster, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, batch_s=batch_s)


def client(url: str, **options: Any) -> Any:
    """redis-py's asyncio client for ``url``: ``Redis``, or ``RedisCluster`` from the seed nodes."""
    from redis import asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode

    return _redis_py(url, aioredis.Redis, aioredis.RedisCluster, ClusterNode, options)


def sync_client(url: str, **options: Any) -> Any:
    """redis-py's blocking client for ``url`` (the CLI's): ``Redis`` or ``RedisCluster``."""
    import redis
    from redis.cluster import ClusterNode

    return _redis_py(url, redis.Redis, redis.RedisCluster, ClusterNode, options)


def _redis_py(url: str, single: Any, cluster_class: Any, node: Any, options: dict[str, Any]) -> Any:
    """One of redis-py's client classes (asyncio or blocking) for ``url``."""
    cluster = parse_cluster(url)
    if cluster is None:
        return single.from_url(url, **options)
    return cluster_class(startup_nodes=[node(host, port) for host, port in cluster.seeds],
                         username=cluster.username, password=cluster.password, ssl=cluster.scheme == "rediss",
                         **dict(cluster.tls), **options)


def _routing_key(args: tuple[str | int | bytes, ...]) -> str | int | bytes | None:
    """The key a command is routed by: a script's first key, else its first argument."""
    name = args[0].upper() if isinstance(args[0], (str, bytes)) else b""
    if name in ("EVALSHA", "EVAL", b"EVALSHA", b"EVAL"):
        return args[3] if int(args[2]) > 0 else None
    return args[1] if len(args) > 1 else None


def _slot(key: str | int | bytes) -> int:
    return int(key_slot(key if isinstance(key, bytes) else str(key).encode()))


class ClusterConnection:
    """One ``PipelinedConnection`` per primary; each command goes where its key's slot lives."""

    def __init__(self, cluster: ClusterUrl, *, timeout_s: float = 0.5, connect_timeout_s: float = 0.5,
                 batch_s: float = 0.05) -> None:
        self.cluster = cluster
        self.timeout_s, self.connect_timeout_s, self.batch_s = timeout_s, connect_timeout_s, batch_s
        self._nodes: dict[tuple[str, int], PipelinedConnection] = {}
        self._slots: list[tuple[str, int] | None] = [None] * SLOTS
        self._known: list[tuple[str, int]] = list(cluster.seeds)  # nodes to ask for the map
        self._refreshing: asyncio.Task[None] | None = None
        self.redirections = 0  # MOVED and ASK followed, for tests and diagnostics
        self.refreshes = 0

    def _node(self, address: tuple[str, int]) -> PipelinedConnection:
        connection = self._nodes.get(address)
        if connection is None:
            connection = self._nodes[address] = PipelinedConnection(
                self.cluster.node_url(*address), timeout_s=self.timeout_s, connect_timeout_s=self.connect_timeout_s,
                batch_s=self.batch_s)
        return connection

    async def call(self, *args: str | int | bytes, later: bool = False, key: str | bytes | None = None) -> Any:
        """Send one command to the primary of its key's slot (``key``, else the command's own: a
        script's first key or the first argument) and return its reply; see
        ``PipelinedConnection.call``."""
        routing = key if key is not None else _routing_key(args)
        slot = _slot(routing) if routing is not None else random.randrange(SLOTS)
        return await self._routed(slot, lambda node, asking: node.call(*args, later=later, asking=asking))

    async def calls(self, commands: list[tuple[str | int | bytes, ...]], *, key: str | bytes) -> list[Any]:
        """Send ``commands`` together on the connection to ``key``'s primary (see
        ``PipelinedConnection.calls``). A redirection answering the first command sends them all
        again where it points; a node that does not answer, once more after the map is re-read."""
        async def together(node: PipelinedConnection, asking: bool) -> list[Any]:
            replies = await node.calls(commands, asking=asking)
            if isinstance(replies[0], RedisReplyError):
                raise replies[0]  # a redirection (or an error) for them all
            return replies

        return await self._routed(_slot(key), together)

    async def _routed(self, slot: int, send: Callable[[PipelinedConnection, bool], Awaitable[T]]) -> T:
        """``send`` to the primary of ``slot`` (with ``ASKING`` when an ``ASK`` points elsewhere),
        following redirections, and once more after the map is re-read if the node does not answer."""
        asking: tuple[str, int] | None = None
        failed_over = False
        for _ in range(MAX_REDIRECTIONS + 1):
            address = asking or self._slots[slot]
            if address is None:
                await self.refresh()
                address = self._slots[slot]
                if address is None:
                    raise ConnectionError(f"redis cluster: no node serves slot {slot}")
            try:
                return await send(self._node(address), asking is not None)
            except RedisReplyError as error:
                asking = await self._redirected(error, slot)
            except (ConnectionError, TimeoutError, OSError):
                # The node is gone or hung: a failover may have given its slots to a replica.
                if failed_over:
                    raise
                failed_over, asking = True, None
                await self.refresh(forget=address)
        raise ConnectionError(f"redis cluster: more than {MAX_REDIRECTIONS} redirections for slot {slot}")

    async def _redirected(self, error: RedisReplyError, slot: int) -> tuple[str, int] | None:
        """Where a command answered with ``error`` goes next: the node an ``ASK`` names (sent with
        ``ASKING``), else None (the slot's owner, which a ``MOVED`` just changed; after a
        ``TRYAGAIN``'s pause). Any other error is raised, ``CLUSTERDOWN`` as an outage."""
        kind, _, rest = str(error).partition(" ")
        if kind in ("MOVED", "ASK"):
            self.redirections += 1
            target = _address(rest)
            if kind == "ASK":
                return target
            self._slots[slot] = target
            self._refresh_soon()
            return None
        if kind == "TRYAGAIN":
            await asyncio.sleep(TRYAGAIN_S)
            return None
        if kind == "CLUSTERDOWN":
            raise ConnectionError(f"redis cluster: {error}") from error
        raise error

    def owner(self, key: str | bytes) -> str:
        """``host:port`` of the primary serving ``key``'s slot as last known ("" before the map is read)."""
        address = self._slots[_slot(key)]
        return f"{address[0]}:{address[1]}" if address is not None else ""

    def _refresh_soon(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self.refresh())

    async def refresh(self, forget: tuple[str, int] | None = None) -> None:
        """Read the slot map (``CLUSTER SLOTS``) from the first node that answers; ``forget``: a
        node that just failed, asked last."""
        nodes = sorted(dict.fromkeys([*self._nodes, *self._known]), key=lambda node: node == forget)
        errors = []
        for address in nodes:
            try:
                reply = await self._node(address).call("CLUSTER", "SLOTS")
            except (ConnectionError, TimeoutError, OSError, RedisReplyError) as error:
                errors.append(f"{address[0]}:{address[1]}: {error}")
                continue
            slots: list[tuple[str, int] | None] = [None] * SLOTS
            for start, end, primary, *_replicas in reply:
                host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
                owner = (host or address[0], int(primary[1]))
                for slot in range(int(start), int(end) + 1):
                    slots[slot] = owner
            self._slots = slots
            self._known = list(dict.fromkeys([*self._known, *(s for s in slots if s is not None)]))
            self.refreshes += 1
            if forget is not None and forget not in slots:
                stale = self._nodes.pop(forget, None)
                if stale is not None:
                    await stale.close()
            return
        raise ConnectionError(f"redis cluster: no node answered CLUSTER SLOTS ({'; '.join(errors)})")

    async def close(self) -> None:
        """Close every node's connection."""
        if self._refreshing is not None:
            self._refreshing.cancel()
        nodes, self._nodes = list(self._nodes.values()), {}
        for connection in nodes:
            await connection.close()


def _address(text: str) -> tuple[str, int]:
    """``"3999 127.0.0.1:6381"`` (a MOVED or ASK error's rest) as (host, port)."""
    where = text.split()[-1]
    host, _, port = where.rpartition(":")
    return host.strip("[]"), int(port)
