"""Translation between Envoy's ext_proc protobuf messages and the core's plain values."""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ProcessingResponse,
)

from extproc.phases import Phase
from extproc.steps import Answer, Continue, Reply

# Envoy's ext_proc filter sends header values in raw_value (bytes); older releases used value.
OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# ImmediateResponse.details becomes the reply's response code details: envoy.yaml's
# local_reply_config rewrites Envoy's own replies into OpenAI errors and leaves those marked so.
REPLY_DETAILS = "llmgw"


def headers_to_dict(header_map: HeaderMap) -> dict[str, str]:
    """Envoy header map -> {lower-case name: value}; a repeated header keeps its last value.

    Envoy 1.40 sends values in ``raw_value``; ``value`` is read only when that is empty.
    """
    return {h.key: h.raw_value.decode("utf-8", "replace") or h.value for h in header_map.headers}


def _set_headers(mutation: HeaderMutation, headers: tuple[tuple[str, str], ...]) -> None:
    # Filled in place: ~1 us per header, against ~2.4 us through nested constructors.
    add = mutation.set_headers.add
    for key, value in headers:
        option = add(append_action=OVERWRITE)
        header = option.header
        header.key = key
        header.raw_value = value.encode()


def _fill(common: CommonResponse, decision: Continue) -> None:
    if decision.clear_route_cache:
        common.clear_route_cache = True
    if decision.set_headers or decision.remove_headers:
        mutation = common.header_mutation
        _set_headers(mutation, decision.set_headers)
        mutation.remove_headers.extend(decision.remove_headers)
    if decision.body is not None:
        # CONTINUE_AND_REPLACE is for headers; a body phase replaces the body with a BodyMutation.
        common.body_mutation.body = decision.body


def to_response(phase: Phase, decision: Answer) -> ProcessingResponse:
    """The ProcessingResponse answering a ``phase`` message with ``decision``."""
    response = ProcessingResponse()
    if isinstance(decision, Reply):
        reply = response.immediate_response
        reply.status.code = decision.status
        _set_headers(reply.headers, decision.headers)
        reply.body = decision.body
        reply.details = REPLY_DETAILS
        return response
    if phase is Phase.REQUEST_HEADERS:
        response.request_headers.SetInParent()  # the answer's kind is set even when it changes nothing
        _fill(response.request_headers.response, decision)
    elif phase is Phase.REQUEST_BODY:
        response.request_body.SetInParent()
        _fill(response.request_body.response, decision)
    else:
        return _other(phase, decision)
    if decision.metadata:
        response.dynamic_metadata.update(dict(decision.metadata))
    return response


def _other(phase: Phase, decision: Continue) -> ProcessingResponse:
    common = CommonResponse()
    _fill(common, decision)
    if phase is Phase.RESPONSE_HEADERS:
        return ProcessingResponse(response_headers=HeadersResponse(response=common))
    if phase is Phase.RESPONSE_BODY:
        return ProcessingResponse(response_body=BodyResponse(response=common))
    if phase is Phase.REQUEST_TRAILERS:
        return ProcessingResponse(request_trailers={})
    return ProcessingResponse(response_trailers={})
