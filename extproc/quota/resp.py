"""``PipelinedConnection``: one Redis connection shared by every call on the quota hot path.

redis-py checks a pooled connection out per call and runs each through its retry, timeout and
parsing layers: about 0.3 ms of CPU per call here, twice per request, most of what quotas cost
(``bench.quota``). Redis answers the commands of one connection in the order they came, so all
callers can share one: a call packs its command (hiredis), every command of one event-loop turn
leaves in one write, and replies, parsed by hiredis's C reader, go to the callers first in,
first out. redis-py still parses the URL and serves everything off the hot path.

Failures are plain ``ConnectionError``/``TimeoutError``. A reply that is late (``timeout_s``)
breaks the connection: what came after it can no longer be matched, so every call waiting on it
fails, and the next call connects afresh.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from typing import Any

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url

Packed = bytes



def _pack(args: tuple[str | int | bytes, ...]) -> bytes:
    """One command in RESP (hiredis's C packer; its stub types the arguments as a 1-tuple)."""
    return hiredis.pack_command(args)  # type: ignore[arg-type]

class RedisReplyError(Exception):
    """Redis answered one command with an error (``-ERR ...``, ``-NOSCRIPT ...``)."""


class _Protocol(asyncio.Protocol):
    """The socket's side: writes what callers queued, hands each reply to the oldest waiter."""

    def __init__(self, batch_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = hiredis.Reader(replyError=RedisReplyError)
        self._transport: Any = None  # an asyncio.Transport (uvloop's does not subclass it)
        self._waiting: deque[asyncio.Future[Any]] = deque()  # in the order their commands were written
        self._soon: list[tuple[Packed, asyncio.Future[Any]]] = []
        self._later: list[tuple[Packed, asyncio.Future[Any]]] = []
        self._soon_handle: asyncio.Handle | None = None
        self._later_handle: asyncio.TimerHandle | None = None
        self._batch_s = batch_s
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def send(self, command: Packed, *, later: bool = False) -> asyncio.Future[Any]:
        """Queue ``command``; written at the end of this loop turn, or within ``batch_s`` if ``later``."""
        if self.lost is not None:
            raise ConnectionError(f"redis connection lost: {self.lost}")
        future = self._loop.create_future()
        if later:
            self._later.append((command, future))
            if self._later_handle is None:
                self._later_handle = self._loop.call_later(self._batch_s, self._write)
        else:
            self._soon.append((command, future))
            if self._soon_handle is None:
                self._soon_handle = self._loop.call_soon(self._write)
        return future

    def _write(self) -> None:
        # Whatever waits goes now, in one write: the deferred ones ride along with the urgent ones.
        for handle in (self._soon_handle, self._later_handle):
            if handle is not None:
                handle.cancel()
        self._soon_handle = self._later_handle = None
        queued = self._later + self._soon
        self._later, self._soon = [], []
        if self._transport is None or self.lost is not None:
            for _, future in queued:
                _fail(future, ConnectionError("redis connection lost"))
            return
        self._waiting.extend(future for _, future in queued)
        self._transport.writelines([command for command, _ in queued])

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            if not self._waiting:
                self.abort(ConnectionError("redis sent a reply nobody asked for"))
                return
            future = self._waiting.popleft()
            if future.done():  # its caller gave up (cancelled); the reply is dropped
                continue
            if isinstance(reply, RedisReplyError):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("closed by the server")
        error = ConnectionError(f"redis connection lost: {self.lost}")
        for future in self._waiting:
            _fail(future, error)
        self._waiting.clear()
        for _, future in self._soon + self._later:
            _fail(future, error)
        self._soon, self._later = [], []

    async def close(self, timeout_s: float) -> None:
        """Write what is queued, wait (up to ``timeout_s``) for its replies, then close."""
        self._write()
        pending = [future for future in self._waiting if not future.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        if self._transport is not None:
            self._transport.close()

    def abort(self, reason: BaseException) -> None:
        """Drop the connection: every waiting call fails with ``reason``'s message."""
        if self.lost is None:
            self.lost = reason
        if self._transport is not None:
            self._transport.abort()  # connection_lost follows and fails the waiters


def tls_context(params: Mapping[str, Any]) -> ssl.SSLContext:
    """The TLS context of a ``rediss://`` URL's options (redis-py's names): ``ssl_ca_certs`` (a
    private CA; else the system's), ``ssl_certfile`` and ``ssl_keyfile`` (a client certificate),
    ``ssl_cert_reqs=none`` (no verification)."""
    context = ssl.create_default_context(cafile=params.get("ssl_ca_certs"))
    if params.get("ssl_certfile"):
        context.load_cert_chain(params["ssl_certfile"], params.get("ssl_keyfile"))
    if str(params.get("ssl_cert_reqs", "required")).lower() in ("none", "cert_none"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _consume(future: asyncio.Future[Any]) -> None:
    """Read a reply nobody waits for (an ``ASKING``'s ``OK``), so that its error is not logged."""
    if not future.cancelled():
        future.exception()


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


class PipelinedConnection:
    """Commands from many coroutines over one connection, replies matched in order."""

    def __init__(self, url: str, *, timeout_s: float = 0.5, connect_timeout_s: float = 0.5,
                 batch_s: float = 0.05) -> None:
        params = parse_url(url)
        self._kind = params.pop("connection_class", None)
        self._params = params
        self.timeout_s, self.connect_timeout_s, self.batch_s = timeout_s, connect_timeout_s, batch_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None

    async def call(self, *args: str | int | bytes, later: bool = False, key: str | bytes | None = None,
                   asking: bool = False) -> Any:
        """Send one command and return its reply; ``later`` lets it wait up to ``batch_s`` to be
        written with others (for calls nobody is waiting on). Raises ``RedisReplyError`` for an
        error reply, ``ConnectionError``/``TimeoutError`` for an outage. ``key``: the key a cluster
        would route it by (``extproc.quota.cluster``); one server has no use for it. ``asking``:
        ``ASKING`` is written just before it (Redis Cluster's answer to ``ASK``: the node takes the
        command for a slot it is importing)."""
        protocol = self._live() or await self._connect()
        asked = protocol.send(_pack(("ASKING",)), later=later) if asking else None
        future = protocol.send(_pack(args), later=later)
        try:
            async with asyncio.timeout(self.timeout_s + (self.batch_s if later else 0.0)):
                if asked is not None:
                    await asked
                return await future
        except TimeoutError:
            raise self._late(protocol) from None

    async def calls(self, commands: list[tuple[str | int | bytes, ...]], *, asking: bool = False,
                    key: str | bytes | None = None) -> list[Any]:
        """Send ``commands`` together, in order, on this one connection, and return their replies;
        an error reply comes back as its ``RedisReplyError`` rather than raised (the commands
        before it took effect). What must follow other commands on their own connection goes so:
        ``WAIT`` counts the replicas that have this connection's writes. ``asking``: ``ASKING``
        before each; ``key``: as ``call``'s."""
        protocol = self._live() or await self._connect()
        futures = []
        for args in commands:
            if asking:
                protocol.send(_pack(("ASKING",))).add_done_callback(_consume)
            futures.append(protocol.send(_pack(args)))
        try:
            async with asyncio.timeout(self.timeout_s):
                replies = await asyncio.gather(*futures, return_exceptions=True)
        except TimeoutError:
            raise self._late(protocol) from None
        for reply in replies:
            if isinstance(reply, BaseException) and not isinstance(reply, RedisReplyError):
                raise reply
        return replies

    def _live(self) -> _Protocol | None:
        """The connection, unless there is none yet or it was lost."""
        protocol = self._protocol
        return protocol if protocol is not None and protocol.lost is None else None

    def _late(self, protocol: _Protocol) -> TimeoutError:
        """A reply came too late: nothing after it can be matched any more, so the connection goes."""
        protocol.abort(TimeoutError(f"no reply within {self.timeout_s}s"))
        return TimeoutError(f"redis: no reply within {self.timeout_s}s")

    async def _connect(self) -> _Protocol:
        # One connection attempt at a time; the callers arriving meanwhile wait for the same one.
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_task(self._open())
        return await asyncio.shield(self._connecting)

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        protocol = _Protocol(self.batch_s)
        params = self._params
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if self._kind is UnixDomainSocketConnection:
                    await loop.create_unix_connection(lambda: protocol, params["path"])
                else:
                    context = tls_context(params) if self._kind is SSLConnection else None
                    await loop.create_connection(lambda: protocol, params.get("host", "localhost"),
                                                 params.get("port", 6379), ssl=context)
                handshake: list[tuple[str | int | bytes, ...]] = []
                if params.get("password"):
                    user = params.get("username")
                    handshake.append(("AUTH", user, params["password"]) if user else ("AUTH", params["password"]))
                if params.get("db"):
                    handshake.append(("SELECT", params["db"]))
                for command in handshake:
                    await protocol.send(_pack(command))
        except TimeoutError:
            protocol.abort(TimeoutError("connect timed out"))
            raise TimeoutError(f"redis: no connection within {self.connect_timeout_s}s") from None
        except RedisReplyError as error:  # a wrong password is a configuration error, not an outage
            protocol.abort(error)
            raise
        self._protocol = protocol
        return protocol

    async def close(self) -> None:
        """Send what is queued, wait briefly for the replies, then close."""
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.lost is None:
            await protocol.close(self.timeout_s)
