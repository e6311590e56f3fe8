"""Envoy's API as typed dataclasses (the `envoy-data-plane` package), one module per proto package,
named as Envoy's Go control planes name them (``corev3``, ``routev3``, ``hcmv3``...).

They are imported here, once, with a warnings filter: envoy-data-plane 2.2.0's generated classes use
a pydantic idiom deprecated since pydantic 2.12, one warning per class at import, about its code.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Using `@model_validator` with mode='after' on a classmethod")
    from envoy_data_plane.envoy.config.accesslog import v3 as accesslogv3
    from envoy_data_plane.envoy.config.bootstrap import v3 as bootstrapv3
    from envoy_data_plane.envoy.config.cluster import v3 as clusterv3
    from envoy_data_plane.envoy.config.common.mutation_rules import v3 as mutationrulesv3
    from envoy_data_plane.envoy.config.core import v3 as corev3
    from envoy_data_plane.envoy.config.endpoint import v3 as endpointv3
    from envoy_data_plane.envoy.config.listener import v3 as listenerv3
    from envoy_data_plane.envoy.config.overload import v3 as overloadv3
    from envoy_data_plane.envoy.config.route import v3 as routev3
    from envoy_data_plane.envoy.data.accesslog import v3 as accesslogdatav3
    from envoy_data_plane.envoy.extensions.access_loggers.filters.cel import v3 as celv3
    from envoy_data_plane.envoy.extensions.access_loggers.grpc import v3 as grpclogv3
    from envoy_data_plane.envoy.extensions.access_loggers.stream import v3 as streamlogv3
    from envoy_data_plane.envoy.extensions.compression.brotli.decompressor import v3 as brotliv3
    from envoy_data_plane.envoy.extensions.compression.gzip.decompressor import v3 as gzipv3
    from envoy_data_plane.envoy.extensions.compression.zstd.decompressor import v3 as zstdv3
    from envoy_data_plane.envoy.extensions.filters.http.decompressor import v3 as decompressorv3
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc import v3 as extprocv3
    from envoy_data_plane.envoy.extensions.filters.http.header_mutation import v3 as headermutationv3
    from envoy_data_plane.envoy.extensions.filters.http.lua import v3 as luav3
    from envoy_data_plane.envoy.extensions.filters.http.router import v3 as routerv3
    from envoy_data_plane.envoy.extensions.filters.http.upstream_codec import v3 as upstreamcodecv3
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager import v3 as hcmv3
    from envoy_data_plane.envoy.extensions.load_balancing_policies.least_request import v3 as leastrequestv3
    from envoy_data_plane.envoy.extensions.load_balancing_policies.override_host import v3 as overridehostv3
    from envoy_data_plane.envoy.extensions.resource_monitors.downstream_connections import v3 as downstreamconnectionsv3
    from envoy_data_plane.envoy.extensions.resource_monitors.fixed_heap import v3 as fixedheapv3
    from envoy_data_plane.envoy.extensions.transport_sockets.raw_buffer import v3 as rawbufferv3
    from envoy_data_plane.envoy.extensions.transport_sockets.tls import v3 as tlsv3
    from envoy_data_plane.envoy.extensions.upstreams.http import v3 as upstreamhttpv3
    from envoy_data_plane.envoy.type import v3 as typev3
    from envoy_data_plane.envoy.type.matcher import v3 as matcherv3
    from envoy_data_plane.google import protobuf as protobuf

__all__ = [
    "accesslogdatav3", "accesslogv3", "bootstrapv3", "brotliv3", "celv3", "clusterv3", "corev3", "decompressorv3",
    "downstreamconnectionsv3", "endpointv3", "extprocv3", "fixedheapv3", "grpclogv3", "gzipv3", "hcmv3",
    "headermutationv3", "leastrequestv3", "listenerv3", "luav3", "matcherv3", "mutationrulesv3", "overloadv3",
    "overridehostv3", "protobuf", "rawbufferv3", "routerv3", "routev3", "streamlogv3", "tlsv3", "typev3",
    "upstreamcodecv3", "upstreamhttpv3", "zstdv3",
]
