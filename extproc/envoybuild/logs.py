"""What Envoy logs and how it answers by itself: the gRPC access log that settles every request in
extproc, the JSON access log on stdout, and Envoy's own local replies in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from extproc.config import GatewaySpec
from extproc.envoybuild import names
from extproc.envoybuild.envoyapi import (
    accesslogdatav3,
    accesslogv3,
    celv3,
    corev3,
    grpclogv3,
    hcmv3,
    matcherv3,
    protobuf,
    streamlogv3,
)
from extproc.envoybuild.output import seconds, typed

OVERWRITE = corev3.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def extproc_service() -> corev3.GrpcService:
    """extproc's gRPC port, through its cluster: ext_proc and the access-log service."""
    return corev3.GrpcService(envoy_grpc=corev3.GrpcServiceEnvoyGrpc(cluster_name=names.EXTPROC_CLUSTER))


def settlement_log() -> accesslogv3.AccessLog:
    """Every request extproc forwarded (its decision is in the llmgw metadata) goes to extproc's
    gRPC access log service, on one long-lived stream per Envoy worker; any worker settles it:
    quota, ledger, metrics, trace span.

    Each entry is sent at once (``buffer_size_bytes`` 0): a finished request's concurrency slot must
    come back before its client's next request (a 10 ms batch window made back-to-back requests of a
    concurrency-1 tenant 429). A pod that answers 429/503 with retry-after is left alone that long
    (extproc.sinks), so that header is logged too.
    """
    return accesslogv3.AccessLog(
        name="envoy.access_loggers.http_grpc",
        filter=accesslogv3.AccessLogFilter(metadata_filter=accesslogv3.MetadataFilter(
            matcher=matcherv3.MetadataMatcher(filter=names.METADATA_NAMESPACE,
                                              path=[matcherv3.MetadataMatcherPathSegment(key="id")],
                                              value=matcherv3.ValueMatcher(present_match=True)),
            match_if_key_not_found=False,
        )),
        typed_config=typed(grpclogv3.HttpGrpcAccessLogConfig(
            additional_response_headers_to_log=["retry-after"],
            common_config=grpclogv3.CommonGrpcAccessLogConfig(
                log_name="llmgw",
                transport_api_version=corev3.ApiVersion.V3,
                grpc_service=extproc_service(),
                buffer_flush_interval=seconds(1),
                buffer_size_bytes=0,
            ),
        )),
    )


def attempt_log() -> accesslogv3.AccessLog:
    """The router's per-attempt log (``upstream_log``): each attempt a pod refused with 429 or 503
    goes to extproc's access log service under the log name ``llmgw-attempt``, with the pod's
    ``retry-after``. The request's own entry names only the last attempt's pod, so a pod that asked
    for a pause and whose request Envoy retried elsewhere would go unheard without it."""
    refused = [accesslogv3.AccessLogFilter(status_code_filter=accesslogv3.StatusCodeFilter(
        comparison=accesslogv3.ComparisonFilter(op=accesslogv3.ComparisonFilterOp.EQ,
                                                value=corev3.RuntimeUInt32(default_value=status,
                                                                           runtime_key=f"llmgw.attempt_log_{status}"))))
        for status in (429, 503)]
    return accesslogv3.AccessLog(
        name="envoy.access_loggers.http_grpc",
        filter=accesslogv3.AccessLogFilter(or_filter=accesslogv3.OrFilter(filters=refused)),
        typed_config=typed(grpclogv3.HttpGrpcAccessLogConfig(
            additional_response_headers_to_log=["retry-after"],
            common_config=grpclogv3.CommonGrpcAccessLogConfig(
                log_name=names.ATTEMPT_LOG,
                transport_api_version=corev3.ApiVersion.V3,
                grpc_service=extproc_service(),
                buffer_flush_interval=seconds(1),
                buffer_size_bytes=0,
            ),
        )),
    )


def log_options(spec: GatewaySpec) -> hcmv3.HttpConnectionManagerHcmAccessLogOptions:
    """In-flight requests are logged every third of ``quota.lease_ttl_s`` too (DownstreamPeriodic):
    the entry renews a long generation's concurrency lease. Every access log of the connection
    manager gets these periodic entries; the stdout log prints only the final one."""
    return hcmv3.HttpConnectionManagerHcmAccessLogOptions(
        access_log_flush_interval=seconds(spec.quota.lease_ttl_s / 3))


def stdout_log() -> accesslogv3.AccessLog:
    """One JSON line per finished request on Envoy's stdout (`llmgw up`: its log file)."""
    line = {
        "time": "%START_TIME%",
        "request_id": "%REQ(X-REQUEST-ID)%",
        "method": "%REQ(:METHOD)%",
        "path": "%REQ(:PATH)%",
        "status": "%RESPONSE_CODE%",
        "flags": "%RESPONSE_FLAGS%",
        "details": "%RESPONSE_CODE_DETAILS%",  # who answered: upgrade_failed, llmgw, via_upstream...
        "model": "%REQ(X-LLMGW-MODEL)%",
        "upstream": "%UPSTREAM_HOST%",
        "duration_ms": "%DURATION%",
        "bytes_sent": "%BYTES_SENT%",
    }
    return accesslogv3.AccessLog(
        name="envoy.access_loggers.stdout",
        filter=accesslogv3.AccessLogFilter(log_type_filter=accesslogv3.LogTypeFilter(
            types=[accesslogdatav3.AccessLogType.DownstreamEnd, accesslogdatav3.AccessLogType.NotSet])),
        typed_config=typed(streamlogv3.StdoutAccessLog(
            log_format=corev3.SubstitutionFormatString(json_format=protobuf.Struct.from_dict(line)))),
    )


def _error(message: str, type_: str, code: str) -> corev3.SubstitutionFormatString:
    body: dict[str, Any] = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return corev3.SubstitutionFormatString(json_format=protobuf.Struct.from_dict(body))


def _mapper(condition: accesslogv3.AccessLogFilter, message: str, type_: str, code: str,
            status: int | None = None) -> hcmv3.ResponseMapper:
    request_id = corev3.HeaderValue(key="x-request-id", value="%REQ(X-REQUEST-ID)%")
    return hcmv3.ResponseMapper(
        filter=condition,
        status_code=status,
        headers_to_add=[corev3.HeaderValueOption(header=request_id, append_action=OVERWRITE)],
        body_format_override=_error(message, type_, code),
    )


def _flags(*flags: str) -> accesslogv3.AccessLogFilter:
    return accesslogv3.AccessLogFilter(response_flag_filter=accesslogv3.ResponseFlagFilter(flags=list(flags)))


def _cel(expression: str) -> accesslogv3.AccessLogFilter:
    return accesslogv3.AccessLogFilter(extension_filter=accesslogv3.ExtensionFilter(
        name="envoy.access_loggers.extension_filters.cel",
        typed_config=typed(celv3.ExpressionFilter(expression=expression))))


def local_replies() -> hcmv3.LocalReplyConfig:
    """Envoy's own answers (local replies) in OpenAI's error shape; first match wins.

    extproc's ImmediateResponses are local replies too: extproc/wire.py marks them with the response
    code details ``llmgw``, and no mapper matches them (nor the no_route direct_response). Those
    not told apart by a response flag are told apart by their response code details
    (%RESPONSE_CODE_DETAILS%, in CEL).
    """
    return hcmv3.LocalReplyConfig(mappers=[
        # No pod or coordinator to talk to: refused, reset, no healthy host, circuit open.
        _mapper(_flags("UF", "UH", "UO", "URX", "UC", "UR", "LR", "NC", "DF"),
                "The model server for this request is unavailable; try again.", "server_error",
                "upstream_unavailable", 503),
        _mapper(_flags("UT"), "The model server did not answer in time.", "server_error", "upstream_timeout", 504),
        _mapper(_flags("SI"),  # stream_idle_timeout, before any response
                "The request or its response was idle for too long.", "invalid_request_error", "stream_idle_timeout"),
        _mapper(_cel("response.code_details in ['request_overall_timeout', 'request_header_timeout']"),
                "The request was not received in time.", "invalid_request_error", "request_timeout"),
        _mapper(_cel("response.code_details == 'overload'"),  # overload manager: stop_accepting_requests
                "The gateway is overloaded; try again shortly.", "server_error", "service_unavailable"),
        _mapper(_cel("response.code_details == 'request_payload_too_large'"),  # over the buffer limit
                "The request body is larger than the gateway accepts.", "invalid_request_error", "request_too_large"),
        _mapper(_cel("response.code == 431"),  # the codec's header limits (http1.headers_too_large...)
                "The request headers are too large or too many.", "invalid_request_error", "request_headers_too_large"),
        # Not HTTP Envoy accepts (bad framing, HTTP/1.0): 400, not its 501/426 (a 426 needs an
        # Upgrade header Envoy does not send; SDKs retry a 5xx). The DPE flag is set only later.
        _mapper(_cel("response.code_details.startsWith('http1.') || response.code_details.startsWith('http2.') "
                     "|| response.code_details == 'low_version'"),
                "The request is not valid HTTP/1.1 or HTTP/2 (%RESPONSE_CODE_DETAILS%).", "invalid_request_error",
                "malformed_request", 400),
        _mapper(_cel("response.code_details == 'upgrade_failed'"),  # websocket, h2c mixed with others...
                "Protocol upgrades (WebSocket and others) are not supported: send plain HTTP requests.",
                "invalid_request_error", "upgrade_not_supported"),
        _mapper(_cel("response.code_details in ['absolute_path_rejected', 'route_not_found']"),  # OPTIONS *
                "Unknown request URL: %REQ(:METHOD)% %REQ(:PATH)%.", "invalid_request_error", "unknown_url", 404),
        # The ext_proc filter failed: extproc too slow (message_timeout) or unreachable (status_on_error).
        _mapper(_cel("response.code_details.startsWith('ext_proc_error') && response.code == 504"),
                "The gateway did not decide on this request in time; try again.", "server_error", "gateway_timeout"),
        _mapper(_cel("response.code_details.startsWith('ext_proc_error')"),
                "The gateway cannot process requests right now; try again.", "server_error", "service_unavailable"),
        # Any other error Envoy answers itself (malformed request, ...): the status it chose.
        _mapper(_cel("response.code >= 400 && !(response.code_details in ['llmgw', 'direct_response'])"),
                "The gateway refused this request (%RESPONSE_CODE_DETAILS%).",
                "%CEL(response.code >= 500 ? 'server_error' : 'invalid_request_error')%", "gateway_error"),
    ])
