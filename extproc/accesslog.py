"""Envoy's gRPC access log service (``envoy.access_loggers.http_grpc``): one entry per finished
request, batched on long-lived streams (one per Envoy worker), with the request's dynamic metadata.

The shell only translates: an ``HTTPAccessLogEntry`` becomes the decision extproc attached
(``llmgw`` namespace) and what Envoy saw of the response (the entry's own fields and the Lua
filter's ``llmgw.response`` namespace); ``accounting.build_record`` joins them and the
``Settlement`` sinks take the record. Entries carry everything, so any worker settles any request.
Periodic entries (the connection manager's ``access_log_flush_interval``) renew a long
generation's lease.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf.struct_pb2 import ListValue, Struct

from extproc.accounting import NAMESPACE, RESPONSE_NAMESPACE, Decision, ResponseFacts, Usage
from extproc.envoybuild.names import ATTEMPT_LOG
from extproc.sinks import Settlement

log = logging.getLogger("llmgw.accesslog")
PERIODIC = al.AccessLogType.Value("DownstreamPeriodic")
# Envoy's response flags (ResponseFlags fields) by their short names, as %RESPONSE_FLAGS% prints them.
FLAG_CODES = {
    "failed_local_healthcheck": "LH", "no_healthy_upstream": "UH", "upstream_request_timeout": "UT",
    "local_reset": "LR", "upstream_remote_reset": "UR", "upstream_connection_failure": "UF",
    "upstream_connection_termination": "UC", "upstream_overflow": "UO", "no_route_found": "NR",
    "delay_injected": "DI", "fault_injected": "FI", "rate_limited": "RL", "unauthorized_details": "UAEX",
    "rate_limit_service_error": "RLSE", "downstream_connection_termination": "DC",
    "upstream_retry_limit_exceeded": "URX", "stream_idle_timeout": "SI", "invalid_envoy_request_headers": "IH",
    "downstream_protocol_error": "DPE", "upstream_max_stream_duration_reached": "UMSDR",
    "response_from_cache_filter": "RFCF", "no_filter_config_found": "NFCF", "duration_timeout": "DT",
    "upstream_protocol_error": "UPE", "no_cluster_found": "NC", "overload_manager": "OM",
    "dns_resolution_failure": "DF", "downstream_remote_reset": "DR",
}


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """Receives Envoy's entries and hands each finished request's record to the settlement."""

    def __init__(self, settlement: Settlement) -> None:
        self.settlement = settlement
        self.entries = 0  # received, for tests and diagnostics
        self.unreadable = 0

    async def StreamAccessLogs(  # noqa: N802 (the gRPC method name)
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        """Read a stream of batches until Envoy closes it (its first message names the log)."""
        attempts = False
        async for message in request_iterator:
            if message.HasField("identifier"):
                attempts = message.identifier.log_name == ATTEMPT_LOG
            for entry in message.http_logs.log_entry:
                self.entries += 1
                if attempts:
                    self.refused(entry)
                else:
                    self.receive(entry)
        return als_pb2.StreamAccessLogsResponse()

    def refused(self, entry: al.HTTPAccessLogEntry) -> None:
        """One attempt a pod refused (the router's upstream log): a pod that asked for a pause gets
        it, even when Envoy retried the request on another pod and its client got an answer."""
        retry_after_s = _retry_after(entry.response.response_headers.get("retry-after", ""))
        address = entry.common_properties.upstream_remote_address.socket_address
        if retry_after_s is not None and address.address:
            self.settlement.feedback.paused(f"{address.address}:{address.port_value}", retry_after_s)

    def receive(self, entry: al.HTTPAccessLogEntry) -> None:
        """One entry: a running request's renewal, or a finished one's settlement."""
        common = entry.common_properties
        filter_metadata = common.metadata.filter_metadata
        if NAMESPACE not in filter_metadata:
            return  # not a request extproc forwarded (the logger's filter should not send these)
        try:
            decision = Decision.from_metadata(plain(filter_metadata[NAMESPACE]))
        except ValueError as error:
            self.unreadable += 1
            log.error("access-log entry without a readable decision: %s", error)
            return
        if common.access_log_type == PERIODIC:
            self.settlement.running(decision)
            return
        response = plain(filter_metadata[RESPONSE_NAMESPACE]) if RESPONSE_NAMESPACE in filter_metadata else {}
        self.settlement.finished(decision, response_facts(entry, response))


def response_facts(entry: al.HTTPAccessLogEntry, lua: Mapping[str, Any]) -> ResponseFacts:
    """What Envoy saw of the response: the entry's fields and the Lua filter's findings."""
    common = entry.common_properties
    start_ns = common.start_time.ToNanoseconds()
    if common.HasField("time_to_last_downstream_tx_byte"):
        end_ns = start_ns + common.time_to_last_downstream_tx_byte.ToNanoseconds()
    elif common.HasField("duration"):
        end_ns = start_ns + common.duration.ToNanoseconds()
    else:
        end_ns = start_ns + common.time_to_last_rx_byte.ToNanoseconds()
    first_byte = (start_ns + common.time_to_first_upstream_rx_byte.ToNanoseconds()
                  if common.HasField("time_to_first_upstream_rx_byte") else None)
    address = common.upstream_remote_address.socket_address
    upstream = f"{address.address}:{address.port_value}" if address.address else ""
    flags = ",".join(FLAG_CODES.get(field.name, field.name) for field, value in common.response_flags.ListFields()
                     if value is True)
    usage = None
    if "out" in lua and "in" in lua:
        usage = Usage(int(lua["in"]), int(lua["out"]), int(lua.get("cached", 0)))
    first_event = lua.get("first_ms")
    return ResponseFacts(
        status=entry.response.response_code.value, end_ns=end_ns,
        response_bytes=entry.response.response_body_bytes, upstream=upstream, flags=flags,
        attempts=max(1, common.upstream_request_attempt_count), first_byte_ns=first_byte, usage=usage,
        content_events=int(lua.get("events", 0)),
        first_event_ns=int(first_event * 1_000_000) if first_event is not None else None,
        streamed=bool(lua.get("sse", False)),
        retry_after_s=_retry_after(entry.response.response_headers.get("retry-after", "")),
        body=lua["body"].encode() if isinstance(lua.get("body"), str) and not lua.get("body_cut") else None)


def _retry_after(value: str) -> float | None:
    """A retry-after header's delay in seconds (the HTTP-date form is not used by inference pods)."""
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 < seconds <= 3600 else None


def plain(struct: Struct) -> dict[str, Any]:
    """A protobuf Struct as plain Python values (numbers stay floats)."""
    return {key: _value(value) for key, value in struct.items()}


def _value(value: object) -> object:
    if isinstance(value, Struct):
        return plain(value)
    if isinstance(value, ListValue):
        return [_value(v) for v in value]
    return value
