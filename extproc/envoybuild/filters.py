"""The HTTP filters of the gateway, in the order they run: decompressors, ext_proc (the decision),
the Lua filter that reads the response, then the router.

Each builder returns typed messages of `envoy-data-plane`; nothing here knows addresses.
"""

from __future__ import annotations

from dataclasses import replace
from importlib import resources

import betterproto2

from extproc.envoybuild import names
from extproc.envoybuild.envoyapi import (
    brotliv3,
    corev3,
    decompressorv3,
    extprocv3,
    gzipv3,
    hcmv3,
    luav3,
    mutationrulesv3,
    routerv3,
    typev3,
    zstdv3,
)
from extproc.envoybuild.logs import attempt_log, extproc_service
from extproc.envoybuild.output import seconds, typed


def lua_source(name: str) -> str:
    """The Lua script ``name`` (``response.lua``, ``fallback.lua``) shipped beside this module."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def _filter(name: str, config: betterproto2.Message, *, disabled: bool) -> hcmv3.HttpFilter:
    return hcmv3.HttpFilter(name=name, typed_config=typed(config), disabled=disabled)


def gateway_filters(*, disabled: bool = False) -> list[hcmv3.HttpFilter]:
    """Every filter before the router.

    ``disabled``: off unless a route turns them on (`routes.enable_filters`), for a listener that
    serves other routes too (an existing mesh): Envoy builds a request's filter chain from the
    route it first matched, so only requests to the gateway's routes meet extproc.
    """
    return [*decompressors(disabled=disabled), decision(disabled=disabled), response_reader(disabled=disabled)]


def decompressors(*, disabled: bool = False) -> list[hcmv3.HttpFilter]:
    """Request bodies sent with Content-Encoding gzip, br or zstd are decoded here, so extproc reads JSON.

    Each filter decodes the first coding listed and removes it from the header (extproc answers any
    coding left with a 415). Decoded bytes count against the buffer limit (a bomb ends as a 413), and
    a body that does not decode ends empty or cut short: extproc's 400, never a pod. Responses are
    left alone; no-transform is ignored (the body is ours to read). Each adds byte-count request
    trailers, which extproc lets pass.
    """
    libraries = (
        # max_inflate_ratio: deflate's own maximum; a bomb ends at the buffer limit.
        ("gzip", gzipv3.Gzip(max_inflate_ratio=1032)),
        ("br", brotliv3.Brotli()),
        ("zstd", zstdv3.Zstd()),
    )
    return [_filter(name, decompressorv3.Decompressor(
        decompressor_library=corev3.TypedExtensionConfig(name=library, typed_config=typed(config)),
        request_direction_config=decompressorv3.DecompressorRequestDirectionConfig(
            common_config=decompressorv3.DecompressorCommonDirectionConfig(ignore_no_transform_header=True)),
        response_direction_config=decompressorv3.DecompressorResponseDirectionConfig(
            common_config=decompressorv3.DecompressorCommonDirectionConfig(
                enabled=corev3.RuntimeFeatureFlag(default_value=False, runtime_key="llmgw.decompress_responses"))),
    ), disabled=disabled) for name, (library, config) in zip(names.DECOMPRESSORS, libraries, strict=True)]


def decision(*, disabled: bool = False) -> hcmv3.HttpFilter:
    """The decision maker: request headers SEND, body BUFFERED; extproc answers every message, then
    closes its stream (processing complete): nothing per request stays in Python after the decision.

    Routing on a header set from the body works because extproc's body response sets
    ``clear_route_cache``; the decision travels with the request as dynamic metadata (namespace
    ``llmgw``), and the access-log entry brings it back to whichever worker settles the request.
    """
    return _filter(names.EXT_PROC_FILTER, extprocv3.ExternalProcessor(
        grpc_service=replace(extproc_service(), timeout=seconds(5)),
        failure_mode_allow=False,  # fail closed: a quota system that fails open is a bypass
        # extproc down or too slow: a retryable 503, never forwarded.
        status_on_error=typev3.HttpStatus(code=typev3.StatusCode.ServiceUnavailable),
        message_timeout=seconds(2),  # generous enough for a Redis hiccup
        metadata_options=extprocv3.MetadataOptions(
            receiving_namespaces=extprocv3.MetadataOptionsMetadataNamespaces(untyped=[names.METADATA_NAMESPACE])),
        processing_mode=extprocv3.ProcessingMode(
            request_header_mode=extprocv3.ProcessingModeHeaderSendMode.SEND,
            request_body_mode=extprocv3.ProcessingModeBodySendMode.BUFFERED,
            response_header_mode=extprocv3.ProcessingModeHeaderSendMode.SKIP,
            response_body_mode=extprocv3.ProcessingModeBodySendMode.NONE,
            request_trailer_mode=extprocv3.ProcessingModeHeaderSendMode.SEND,  # trailers with no body: refused
            response_trailer_mode=extprocv3.ProcessingModeHeaderSendMode.SKIP,
        ),
        # allow_envoy: extproc sets x-envoy-max-retries (a third host: the fallback model's pod) and
        # x-envoy-upstream-rq-timeout-ms (a class's timeout); clients' own x-envoy-* are removed.
        mutation_rules=mutationrulesv3.HeaderMutationRules(allow_all_routing=True, allow_envoy=True),
    ), disabled=disabled)


def response_reader(*, disabled: bool = False) -> hcmv3.HttpFilter:
    """Envoy reads the response, so Python never sees a chunk (``response.lua``).

    For each request extproc forwarded (it set x-llmgw-route), the filter puts in the
    ``llmgw.response`` metadata the pod's usage object (in, out, cached: from a JSON body's tail or
    the SSE usage event), the number of SSE events with generated content (events; vLLM sends about
    one token per event: the estimate for a stream without usage) and the wall-clock ms of the first
    (first_ms: TTFT). Counts are stored as they grow, so a stream cut by the client still reports
    what it saw. The access-log entry carries them to extproc. extproc adds
    stream_options.include_usage to streams without it and marks them x-llmgw-strip-usage: that
    usage event is read here, then removed before the client.
    """
    return _filter(names.RESPONSE_FILTER, luav3.Lua(
        stat_prefix="llmgw_response",
        default_source_code=corev3.DataSource(inline_string=lua_source("response.lua")),
    ), disabled=disabled)


def router() -> hcmv3.HttpFilter:
    """The router, always last (a terminal filter cannot be disabled). Its attempts that pods
    refused are logged to extproc too (``logs.attempt_log``)."""
    return hcmv3.HttpFilter(name=names.ROUTER_FILTER,
                            typed_config=typed(routerv3.Router(upstream_log=[attempt_log()])))
