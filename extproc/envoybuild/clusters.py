"""The gateway's upstreams: the pods, the batching coordinator, and extproc (ext_proc and the gRPC
access-log service share its port).

An address by IP makes a STATIC cluster; a DNS name (a compose service) a STRICT_DNS one, which
resolves it. In a mesh the endpoints come from EDS instead (`istio`).
"""

from __future__ import annotations

from collections.abc import Sequence

import betterproto2

from extproc.envoybuild import names
from extproc.envoybuild.addresses import HostPort
from extproc.envoybuild.envoyapi import (
    clusterv3,
    corev3,
    endpointv3,
    hcmv3,
    headermutationv3,
    leastrequestv3,
    luav3,
    mutationrulesv3,
    overridehostv3,
    protobuf,
    upstreamcodecv3,
    upstreamhttpv3,
)
from extproc.envoybuild.filters import lua_source
from extproc.envoybuild.logs import OVERWRITE
from extproc.envoybuild.output import seconds, typed

HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
EXTPROC_STREAMS_PER_CONNECTION = 100  # then Envoy opens a new connection, which may reach another worker


def address(where: HostPort) -> corev3.Address:
    """A socket address."""
    return corev3.Address(socket_address=corev3.SocketAddress(address=where.host, port_value=where.port))


def load_assignment(cluster: str, hosts: Sequence[HostPort]) -> endpointv3.ClusterLoadAssignment:
    """``hosts``, each once, in one locality."""
    endpoints = [endpointv3.LbEndpoint(endpoint=endpointv3.Endpoint(address=address(h))) for h in dict.fromkeys(hosts)]
    return endpointv3.ClusterLoadAssignment(cluster_name=cluster,
                                            endpoints=[endpointv3.LocalityLbEndpoints(lb_endpoints=endpoints)])


def discovery(hosts: Sequence[HostPort]) -> clusterv3.ClusterDiscoveryType:
    """STATIC when every host is an IP address, else STRICT_DNS (Envoy resolves the names)."""
    if all(h.is_ip for h in hosts):
        return clusterv3.ClusterDiscoveryType.STATIC
    return clusterv3.ClusterDiscoveryType.STRICT_DNS


def _many(limit: int, retries: int | None = None) -> clusterv3.CircuitBreakers:
    return clusterv3.CircuitBreakers(thresholds=[clusterv3.CircuitBreakersThresholds(
        max_connections=limit, max_pending_requests=limit, max_requests=limit, max_retries=retries)])


def _policy(name: str, config: betterproto2.Message) -> clusterv3.LoadBalancingPolicy:
    extension = corev3.TypedExtensionConfig(name=name, typed_config=typed(config))
    return clusterv3.LoadBalancingPolicy(
        policies=[clusterv3.LoadBalancingPolicyPolicy(typed_extension_config=extension)])


def _http(config: upstreamhttpv3.HttpProtocolOptionsExplicitHttpConfig,
          filters: list[hcmv3.HttpFilter] | None = None,
          common: corev3.HttpProtocolOptions | None = None) -> dict[str, protobuf.Any]:
    """The cluster's ``typed_extension_protocol_options``: the upstream protocol, and upstream filters."""
    options = upstreamhttpv3.HttpProtocolOptions(explicit_http_config=config, http_filters=filters or [],
                                                 common_http_protocol_options=common)
    return {HTTP_PROTOCOL_OPTIONS: typed(options)}


def pods(hosts: Sequence[HostPort]) -> clusterv3.Cluster:
    """Every pod of every pool.

    The pod extproc picked is x-gateway-destination-endpoint, "primary,fallback": the override_host
    policy takes one per attempt, so the one retry goes to the fallback. A pod missing from this list
    is never reached: the fallback policy (least request, healthy pods) picks instead.
    """
    health = corev3.HealthStatus
    return clusterv3.Cluster(
        name=names.PODS_CLUSTER,
        type=discovery(hosts),
        connect_timeout=seconds(2),
        # Upstream filters run once per attempt: the attempt that reaches the fallback model's pod
        # gets that model in its body (see the direct route's retry policy).
        typed_extension_protocol_options=_http(upstreamhttpv3.HttpProtocolOptionsExplicitHttpConfig(
            http_protocol_options=corev3.Http1ProtocolOptions()), upstream_filters()),
        load_balancing_policy=_policy("envoy.load_balancing_policies.override_host", overridehostv3.OverrideHost(
            override_host_sources=[overridehostv3.OverrideHostOverrideHostSource(header=names.ENDPOINT_HEADER)],
            fallback_policy=_policy("envoy.load_balancing_policies.least_request", leastrequestv3.LeastRequest()),
        )),
        # The pods extproc lists are used whatever Envoy thinks of their health: extproc's picker
        # already left out the pods its probes, ejections and breakers distrust, and Envoy's fallback
        # policy would pick a pod of any pool (one that may not serve the model: a 404).
        common_lb_config=clusterv3.ClusterCommonLbConfig(override_host_status=corev3.HealthStatusSet(statuses=[
            health.UNKNOWN, health.HEALTHY, health.DEGRADED, health.UNHEALTHY, health.DRAINING, health.TIMEOUT])),
        # Envoy's own view of pod health steers the fallback policy; extproc probes pods itself too.
        health_checks=[corev3.HealthCheck(
            timeout=seconds(1), interval=seconds(2), unhealthy_threshold=2, healthy_threshold=1,
            http_health_check=corev3.HealthCheckHttpHealthCheck(path="/health"))],
        outlier_detection=clusterv3.OutlierDetection(
            split_external_local_origin_errors=True, consecutive_local_origin_failure=2, consecutive_5xx=5,
            base_ejection_time=seconds(5), max_ejection_percent=50),
        load_assignment=load_assignment(names.PODS_CLUSTER, hosts),
        circuit_breakers=_many(100_000),  # long generations: many concurrent requests per pod is normal
    )


def upstream_filters() -> list[hcmv3.HttpFilter]:
    """Per attempt (an upstream filter runs once for each): the attempt that goes to the fallback
    model's pod (x-llmgw-fallback: "host model", set by extproc) gets that model in the body
    (``fallback.lua``); the header mutation tells the script which host this attempt reached."""
    reached = corev3.HeaderValueOption(header=corev3.HeaderValue(key="x-llmgw-upstream-host", value="%UPSTREAM_HOST%"),
                                       append_action=OVERWRITE)
    mutation = headermutationv3.HeaderMutation(mutations=headermutationv3.Mutations(
        request_mutations=[mutationrulesv3.HeaderMutation(append=reached)]))
    fallback = luav3.Lua(stat_prefix="llmgw_fallback",
                         default_source_code=corev3.DataSource(inline_string=lua_source("fallback.lua")))
    return [
        hcmv3.HttpFilter(name="envoy.filters.http.header_mutation", typed_config=typed(mutation)),
        hcmv3.HttpFilter(name="envoy.filters.http.lua", typed_config=typed(fallback)),
        hcmv3.HttpFilter(name="envoy.filters.http.upstream_codec", typed_config=typed(upstreamcodecv3.UpstreamCodec())),
    ]


def coordinator(where: HostPort) -> clusterv3.Cluster:
    """The batching coordinator (HTTP), which merges a pool's batchable requests."""
    return clusterv3.Cluster(name=names.COORDINATOR_CLUSTER, type=discovery([where]), connect_timeout=seconds(2),
                             load_assignment=load_assignment(names.COORDINATOR_CLUSTER, [where]))


def extproc(where: HostPort) -> clusterv3.Cluster:
    """extproc's gRPC port: ext_proc streams and the access-log service.

    Every request being decided holds an ext_proc stream, and each Envoy worker one access-log
    stream: Envoy's default of 1024 concurrent requests is too low for bursts.

    The workers of one extproc node share its port (SO_REUSEPORT): the kernel gives each new
    connection to one of them, and an Envoy worker keeps one connection. So a connection carries
    ``EXTPROC_STREAMS_PER_CONNECTION`` streams, then Envoy opens another, which may reach another
    worker: under 8 clients (2 workers, 2 Envoy threads) the busiest worker's share of extproc's CPU
    was 97% (median of 5 stacks) with one connection for ever, 60% with 100 streams per connection
    (the access-log streams stay where they started).
    """
    return clusterv3.Cluster(
        name=names.EXTPROC_CLUSTER,
        type=discovery([where]),
        connect_timeout=seconds(1),
        circuit_breakers=_many(1_000_000, retries=1000),
        typed_extension_protocol_options=_http(upstreamhttpv3.HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=corev3.Http2ProtocolOptions(max_concurrent_streams=10_000)),
            common=corev3.HttpProtocolOptions(max_requests_per_connection=EXTPROC_STREAMS_PER_CONNECTION)),
        # grpc.health.v1 (extproc is SERVING once its config and keys are loaded, NOT_SERVING once
        # it drains): with several extproc hosts, one starting or stopping gets no new streams.
        health_checks=[corev3.HealthCheck(
            timeout=seconds(1), interval=seconds(1), unhealthy_threshold=1, healthy_threshold=1,
            grpc_health_check=corev3.HealthCheckGrpcHealthCheck())],
        # A host whose connection failed (a crashed replica) is out at once, not at the next health
        # check; never the last one (max 50%: one host alone is never ejected).
        outlier_detection=clusterv3.OutlierDetection(
            split_external_local_origin_errors=True, consecutive_local_origin_failure=1,
            base_ejection_time=seconds(2), max_ejection_percent=50),
        load_assignment=load_assignment(names.EXTPROC_CLUSTER, [where]),
    )
