"""Translation between Envoy's ext_proc protobuf messages and the core's plain values."""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from extproc.decisions import Continue, Decision, Reply
from extproc.phases import Phase

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


def _mutation(decision: Continue) -> HeaderMutation | None:
    if not decision.set_headers and not decision.remove_headers:
        return None
    return HeaderMutation(
        set_headers=[
            HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode()), append_action=OVERWRITE)
            for k, v in decision.set_headers
        ],
        remove_headers=list(decision.remove_headers),
    )


def _common(decision: Continue) -> CommonResponse:
    common = CommonResponse(clear_route_cache=decision.clear_route_cache)
    mutation = _mutation(decision)
    if mutation is not None:
        common.header_mutation.CopyFrom(mutation)
    if decision.body is not None:
        # CONTINUE_AND_REPLACE is for headers; a body phase replaces the body with a BodyMutation.
        common.body_mutation.CopyFrom(BodyMutation(body=decision.body))
    return common


def to_response(phase: Phase, decision: Decision) -> ProcessingResponse:
    """The ProcessingResponse answering a ``phase`` message with ``decision``."""
    if isinstance(decision, Reply):
        return ProcessingResponse(
            immediate_response=ImmediateResponse(
                status=HttpStatus(code=decision.status),
                headers=HeaderMutation(
                    set_headers=[
                        HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode()), append_action=OVERWRITE)
                        for k, v in decision.headers
                    ]
                ),
                body=decision.body,
                details=REPLY_DETAILS,
            )
        )
    common = _common(decision)
    if phase is Phase.REQUEST_HEADERS:
        response = ProcessingResponse(request_headers=HeadersResponse(response=common))
    elif phase is Phase.REQUEST_BODY:
        response = ProcessingResponse(request_body=BodyResponse(response=common))
    else:
        return _other(phase, common)
    if decision.metadata:
        response.dynamic_metadata.CopyFrom(_struct(decision.metadata))
    return response


def _struct(metadata: tuple[tuple[str, object], ...]) -> Struct:
    struct = Struct()
    struct.update(dict(metadata))
    return struct


def _other(phase: Phase, common: CommonResponse) -> ProcessingResponse:
    if phase is Phase.RESPONSE_HEADERS:
        return ProcessingResponse(response_headers=HeadersResponse(response=common))
    if phase is Phase.RESPONSE_BODY:
        return ProcessingResponse(response_body=BodyResponse(response=common))
    if phase is Phase.REQUEST_TRAILERS:
        return ProcessingResponse(request_trailers={})
    return ProcessingResponse(response_trailers={})
