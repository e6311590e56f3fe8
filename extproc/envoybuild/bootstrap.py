"""A whole Envoy bootstrap for a dedicated gateway: the local stack's (`llmgw up`, envoy/envoy.yaml)
and the docker-compose stack's, which differ only in their addresses; either may listen with TLS
(`TlsFiles`: envoy/tls/envoy.yaml is the example)."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.config import GatewaySpec
from extproc.envoybuild import clusters, filters, logs, names, routes
from extproc.envoybuild.addresses import Addresses, HostPort
from extproc.envoybuild.envoyapi import (
    bootstrapv3,
    corev3,
    downstreamconnectionsv3,
    fixedheapv3,
    hcmv3,
    listenerv3,
    overloadv3,
    tlsv3,
)
from extproc.envoybuild.output import seconds, typed

# Multimodal bodies reach MBs: the listener's buffer must exceed extproc's max_body_bytes, so that
# extproc (not Envoy) answers oversize bodies with an OpenAI-style 413.
# What one connection may buffer: a whole request body (ext_proc buffers it) and its headers, and
# no more, so a stalled upload pins at most this much; at least 1 MiB for the response filter,
# which reads an answer up to 1 MiB for the cache.
HEADROOM_BYTES = 64 << 10
MIN_BUFFER_BYTES = 1 << 20


def buffer_limit_bytes(spec: GatewaySpec) -> int:
    """The listener's ``per_connection_buffer_limit_bytes``: the body limit plus headers' room."""
    return max(spec.server.max_body_bytes, MIN_BUFFER_BYTES) + HEADROOM_BYTES
FIXED_HEAP = "envoy.resource_monitors.fixed_heap"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The listener's certificate chain and private key (PEM files Envoy reads; it watches them:
    a renewed certificate is picked up without a restart when its directory is swapped, as
    Kubernetes secrets are)."""

    certificate: str
    private_key: str


def downstream_tls(files: TlsFiles) -> corev3.TransportSocket:
    """TLS 1.2 or 1.3 for clients, offering HTTP/2 and HTTP/1.1 by ALPN."""
    versions = tlsv3.TlsParametersTlsProtocol
    context = tlsv3.DownstreamTlsContext(common_tls_context=tlsv3.CommonTlsContext(
        tls_params=tlsv3.TlsParameters(tls_minimum_protocol_version=versions.TLSv1_2,
                                       tls_maximum_protocol_version=versions.TLSv1_3),
        alpn_protocols=["h2", "http/1.1"],
        tls_certificates=[tlsv3.TlsCertificate(certificate_chain=corev3.DataSource(filename=files.certificate),
                                               private_key=corev3.DataSource(filename=files.private_key))]))
    return corev3.TransportSocket(name="envoy.transport_sockets.tls", typed_config=typed(context))


def bootstrap(spec: GatewaySpec, at: Addresses, tls: TlsFiles | None = None) -> bootstrapv3.Bootstrap:
    """The gateway's whole Envoy config for ``spec``, listening and connecting where ``at`` says,
    with TLS on the listener when ``tls`` names its files."""
    return bootstrapv3.Bootstrap(
        admin=bootstrapv3.Admin(address=clusters.address(at.admin)),
        overload_manager=overload_manager(),
        static_resources=bootstrapv3.BootstrapStaticResources(
            listeners=[listenerv3.Listener(
                name=names.LISTENER,
                address=clusters.address(at.listener),
                per_connection_buffer_limit_bytes=buffer_limit_bytes(spec),
                filter_chains=[listenerv3.FilterChain(
                    filters=[listenerv3.Filter(name=names.CONNECTION_MANAGER,
                                               typed_config=typed(connection_manager(spec)))],
                    transport_socket=downstream_tls(tls) if tls is not None else None)],
            )],
            clusters=[clusters.pods(pod_addresses(spec, at)), clusters.coordinator(at.coordinator),
                      clusters.extproc(at.extproc)],
        ),
    )


def pod_addresses(spec: GatewaySpec, at: Addresses) -> list[HostPort]:
    """``at.pods``, else every endpoint of the config's pools, else the placeholder."""
    if at.pods:
        return list(at.pods)
    listed = [HostPort.parse(e) for pool in spec.pools for e in pool.endpoints]
    return listed or [at.placeholder_pod]


def connection_manager(spec: GatewaySpec) -> hcmv3.HttpConnectionManager:
    """The gateway's HTTP connection manager: an edge proxy in front of slow, long generations."""
    return hcmv3.HttpConnectionManager(
        stat_prefix=names.LISTENER,
        # An edge proxy: clients are external, so Envoy strips the x-envoy-* control headers they send
        # (a client must not set x-envoy-retry-on or x-envoy-upstream-rq-timeout-ms). Nothing is
        # internal, loopback and private ranges included.
        use_remote_address=True,
        internal_address_config=hcmv3.HttpConnectionManagerInternalAddressConfig(
            cidr_ranges=[corev3.CidrRange(address_prefix="255.255.255.255", prefix_len=32)]),
        # Keep a client's x-request-id; extproc validates it and replaces an invalid one.
        preserve_external_request_id=True,
        # Long generations: no idle cut while a pod is still streaming.
        stream_idle_timeout=seconds(spec.envoy.stream_idle_timeout_s),
        # Time to *receive* a request: disarmed once the whole request has passed every decoder
        # filter (ext_proc's decision included) or the response starts, so it never cuts a
        # generation. It cuts stalled or trickled uploads (408), which pin up to the buffer limit
        # each; 60 s takes an 8 MiB body at ~1.2 Mbit/s.
        request_timeout=seconds(60),
        request_headers_timeout=seconds(10),
        # 431 past these (Envoy's defaults: 60 KiB, 100); every header also travels to extproc.
        max_request_headers_kb=32,
        common_http_protocol_options=corev3.HttpProtocolOptions(max_headers_count=64),
        # Envoy's edge advice (docs: best_practices/edge): one HTTP/2 connection may not open
        # unbounded streams, each buffering a body (defaults: 2^31 streams, 256 MiB windows). The
        # windows are wider than its 64 KiB / 1 MiB so MB uploads stay fast on distant clients.
        http2_protocol_options=corev3.Http2ProtocolOptions(
            max_concurrent_streams=100, initial_stream_window_size=1 << 20, initial_connection_window_size=16 << 20),
        access_log_options=logs.log_options(spec),
        access_log=[logs.settlement_log(), logs.stdout_log()],
        local_reply_config=logs.local_replies(),
        route_config=routes.route_config(spec),
        http_filters=[*filters.gateway_filters(), filters.router()],
    )


def _above(fraction: float) -> list[overloadv3.Trigger]:
    return [overloadv3.Trigger(name=FIXED_HEAP, threshold=overloadv3.ThresholdTrigger(value=fraction))]


def _scaled(scaling: float, saturation: float) -> list[overloadv3.Trigger]:
    return [overloadv3.Trigger(name=FIXED_HEAP, scaled=overloadv3.ScaledTrigger(
        scaling_threshold=scaling, saturation_threshold=saturation))]


def overload_manager() -> overloadv3.OverloadManager:
    """Memory and connection caps. Set the heap size to ~80% of Envoy's memory limit: every
    connection may buffer a whole body (the listener's buffer limit: ``server.max_body_bytes`` + 64 KiB),
    so the heap actions, not the connection cap, are what bound many stalled uploads."""
    return overloadv3.OverloadManager(
        refresh_interval=seconds(0.25),
        # Streams buffering >= 1 MiB can be reset.
        buffer_factory_config=overloadv3.BufferFactoryConfig(minimum_account_to_track_power_of_two=20),
        resource_monitors=[
            overloadv3.ResourceMonitor(name=FIXED_HEAP, typed_config=typed(
                fixedheapv3.FixedHeapConfig(max_heap_size_bytes=2 << 30))),  # 2 GiB
            # Past this, new connections are closed at once (no HTTP answer); keep it under half the fd limit.
            overloadv3.ResourceMonitor(
                name="envoy.resource_monitors.global_downstream_max_connections", typed_config=typed(
                    downstreamconnectionsv3.DownstreamConnectionsConfig(max_active_downstream_connections=10_000))),
        ],
        actions=[
            overloadv3.OverloadAction(name="envoy.overload_actions.shrink_heap", triggers=_above(0.90)),
            # Resets the streams holding the most buffered memory first (HTTP/2 only, says Envoy's doc).
            overloadv3.OverloadAction(name="envoy.overload_actions.reset_high_memory_stream",
                                      triggers=_scaled(0.85, 0.95)),
            # New requests get a 503 (local_reply_config); streams already running go on.
            overloadv3.OverloadAction(name="envoy.overload_actions.stop_accepting_requests", triggers=_above(0.95)),
        ],
        loadshed_points=[
            # HTTP/1 uploads still arriving are cut (a local reply, then close); running generations
            # send nothing more, so they go on.
            overloadv3.LoadShedPoint(name="envoy.load_shed_points.http1_server_abort_dispatch", triggers=_above(0.95)),
            overloadv3.LoadShedPoint(name="envoy.load_shed_points.tcp_listener_accept", triggers=_above(0.98)),
        ],
    )
