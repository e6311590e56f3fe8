"""The order of ext_proc messages on one stream, as an explicit table.

Envoy sends, for the main filter's processing mode (request headers SEND, request body BUFFERED,
request trailers SEND): request headers, then (unless the request had no body or was answered) the
whole body at once, then trailers if the client sent any.
Response phases are skipped in the shipped envoy.yaml; if an operator turns them on they pass
through. Anything else is a protocol error, never a silent skip.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """An ext_proc message kind (the ``request`` oneof of ProcessingRequest)."""

    REQUEST_HEADERS = "request_headers"
    REQUEST_BODY = "request_body"
    REQUEST_TRAILERS = "request_trailers"
    RESPONSE_HEADERS = "response_headers"
    RESPONSE_BODY = "response_body"
    RESPONSE_TRAILERS = "response_trailers"


class Stage(enum.Enum):
    """Where a stream is: what the next message may be."""

    START = "start"  # nothing received yet
    AWAIT_BODY = "await_body"  # headers done, the request body is coming
    AWAIT_TRAILERS = "await_trailers"  # the whole (buffered) body came; trailers follow
    FORWARDED = "forwarded"  # the request went upstream; only response phases may follow
    ANSWERED = "answered"  # an ImmediateResponse was sent; Envoy sends nothing more


class ProtocolError(Exception):
    """A message arrived that the table does not allow in the current stage."""


# (stage, phase) -> True if allowed. The handler decides the next stage (see `advance`).
ALLOWED: frozenset[tuple[Stage, Phase]] = frozenset(
    {
        (Stage.START, Phase.REQUEST_HEADERS),
        (Stage.AWAIT_BODY, Phase.REQUEST_BODY),
        (Stage.AWAIT_BODY, Phase.REQUEST_TRAILERS),  # trailers and no body: answered with a 400
        (Stage.AWAIT_TRAILERS, Phase.REQUEST_TRAILERS),
        (Stage.FORWARDED, Phase.RESPONSE_HEADERS),
        (Stage.FORWARDED, Phase.RESPONSE_BODY),
        (Stage.FORWARDED, Phase.RESPONSE_TRAILERS),
    }
)


def check(stage: Stage, phase: Phase) -> None:
    """Raise ProtocolError unless ``phase`` may arrive in ``stage``."""
    if (stage, phase) not in ALLOWED:
        raise ProtocolError(f"unexpected {phase.value} message while {stage.value}")


def advance(stage: Stage, phase: Phase, *, answered: bool, end_of_stream: bool) -> Stage:
    """The stage after handling ``phase``: answered streams end; a request without body is forwarded."""
    if answered:
        return Stage.ANSWERED
    if phase is Phase.REQUEST_HEADERS:
        return Stage.FORWARDED if end_of_stream else Stage.AWAIT_BODY
    if phase is Phase.REQUEST_BODY and not end_of_stream:
        return Stage.AWAIT_TRAILERS  # BUFFERED sends the body once: only trailers may follow
    return Stage.FORWARDED
