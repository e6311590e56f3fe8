"""W3C Trace Context (https://www.w3.org/TR/trace-context/), W3C Baggage
(https://www.w3.org/TR/baggage/) and request ids, as pure functions."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import quote

# traceparent = version "-" trace-id "-" parent-id "-" trace-flags  (section 3.2.2)
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
# A client's x-request-id is kept when it is short and made of safe characters.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
# A baggage key is an RFC 9110 token (Baggage 3.3.1.2).
_BAGGAGE_KEY = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
# Left readable in baggage values; every other byte is percent-encoded, "%" and "+" included
# (OpenTelemetry's Python and Java propagators decode "+" as a space).
_BAGGAGE_SAFE = ":/@"
BAGGAGE_MAX_MEMBERS = 64  # what a propagator must at least carry (Baggage 3.3.3)
BAGGAGE_MAX_BYTES = 8192


@dataclass(frozen=True, slots=True)
class TraceContext:
    """The gateway's span within a trace: the trace it belongs to and the caller's span, if any."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    flags: str

    @property
    def traceparent(self) -> str:
        """The header value that makes the gateway's span the parent of the pod's."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"


def random_hex(nbytes: int) -> str:
    """``nbytes`` random bytes as hex, never all zero."""
    while True:
        value = os.urandom(nbytes).hex()
        if value.strip("0"):  # all-zero ids are invalid (3.2.2.3, 3.2.2.4)
            return value


IdSource = Callable[[int], str]  # nbytes -> hex id; tests pass a deterministic one


def continue_or_start(header: str | None, new_id: IdSource = random_hex) -> TraceContext:
    """Continue the caller's trace from a valid ``traceparent``; otherwise start a new, sampled one.

    Version ff and all-zero ids are invalid (3.2.2.1, 3.2.2.3-4); a version 00 header must have
    exactly four fields, a higher version may carry more (3.2.4: parse what we understand).
    """
    if header:
        match = _TRACEPARENT.match(header.strip())
        if match:
            version, trace_id, parent_id, flags, rest = match.groups()
            valid = (
                version != "ff"
                and not (version == "00" and rest)
                and trace_id.strip("0")
                and parent_id.strip("0")
            )
            if valid:
                return TraceContext(trace_id, new_id(8), parent_id, flags)
    return TraceContext(new_id(16), new_id(8), None, "01")


def request_id(header: str | None, new_id: IdSource = random_hex) -> str:
    """Keep a well-formed client ``x-request-id``; otherwise generate a UUID (version 4 layout)."""
    if header and _REQUEST_ID.match(header):
        return header
    return str(uuid.UUID(hex=new_id(16), version=4))


def baggage(items: Iterable[tuple[str, str]]) -> str:
    """A W3C ``baggage`` header value: ``key=value`` members joined by commas, each value's UTF-8
    percent-encoded (Baggage 3.3.1.3).

    A key that is not a token raises ``ValueError``. Members past 64, or past 8192 bytes in all,
    are left out whole: a receiver need not carry more, and a member is never cut (3.3.3)."""
    members: list[str] = []
    size = 0
    for key, value in items:
        if not _BAGGAGE_KEY.match(key):
            raise ValueError(f"baggage key {key!r} is not a token")
        member = f"{key}={quote(value, safe=_BAGGAGE_SAFE)}"
        added = len(member) + (1 if members else 0)  # ASCII after encoding: characters are bytes
        if len(members) == BAGGAGE_MAX_MEMBERS or size + added > BAGGAGE_MAX_BYTES:
            continue
        members.append(member)
        size += added
    return ",".join(members)
