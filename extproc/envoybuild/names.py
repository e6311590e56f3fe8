"""The names the gateway's Envoy objects go by: routes, clusters and filters refer to each other by
them, and `llmgw up`, the tests and the benchmarks find objects of a built config by them."""

from __future__ import annotations

LISTENER = "llm_gateway"
ROUTE_CONFIG = "llm_routes"
VIRTUAL_HOST = "llm"

EXTPROC_CLUSTER = "llmgw_extproc"  # ext_proc and the gRPC access-log service, on one port
COORDINATOR_CLUSTER = "llm_coordinator"
PODS_CLUSTER = "llm_pods"

DIRECT_ROUTE = "direct"  # `direct-<pool>` for a pool's own route
BATCH_ROUTE = "batch"
NO_ROUTE = "no_route"

# The HTTP filters, in the order they run (the router last).
DECOMPRESSORS = ("envoy.filters.http.decompressor.gzip", "envoy.filters.http.decompressor.brotli",
                 "envoy.filters.http.decompressor.zstd")
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
RESPONSE_FILTER = "envoy.filters.http.lua.response"
ROUTER_FILTER = "envoy.filters.http.router"
CONNECTION_MANAGER = "envoy.filters.network.http_connection_manager"

# Headers extproc sets on a request it forwards, that the routes match on.
ROUTE_HEADER = "x-llmgw-route"  # direct | batch
POOL_HEADER = "x-llmgw-pool"
ENDPOINT_HEADER = "x-gateway-destination-endpoint"  # "pick,fallback": one per attempt (override_host)

METADATA_NAMESPACE = "llmgw"  # extproc's decision, as dynamic metadata
ATTEMPT_LOG = "llmgw-attempt"  # the access-log name of the router's refused attempts (logs.attempt_log)

# The ways in `llmgw envoy-config --target` builds (extproc.envoybuild.targets).
TARGET_NAMES = ("local", "compose", "tls", "snippet", "istio")
