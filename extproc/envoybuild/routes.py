"""The gateway's routes: extproc decides, then Envoy routes on the headers extproc set.

x-llmgw-route is set by extproc from the body (its ``clear_route_cache`` makes Envoy pick the route
again); any copy a client sent is removed first. ``direct`` goes to the pod extproc picked (the pods
cluster's override_host policy reads x-gateway-destination-endpoint), ``batch`` to the batching
coordinator. A request extproc neither answered nor routed meets ``no_route``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from extproc.config import GatewaySpec, PoolSpec
from extproc.envoybuild import names
from extproc.envoybuild.envoyapi import corev3, matcherv3, protobuf, routev3
from extproc.envoybuild.logs import OVERWRITE
from extproc.envoybuild.output import seconds, typed

# The first-byte timeout of a pool that sets none (pools[].first_byte_timeout_s).
DEFAULT_FIRST_BYTE_S: float = PoolSpec.model_fields["first_byte_timeout_s"].default
NO_ROUTE_BODY = ('{"error":{"message":"the gateway made no routing decision for this request",'
                 '"type":"server_error","param":null,"code":"no_route"}}')


def response_headers() -> list[corev3.HeaderValueOption]:
    """What extproc set on the request that the client gets back: copying them avoids a
    response-headers round trip to extproc."""
    def copy(name: str) -> corev3.HeaderValueOption:  # an empty value adds no header (keep_empty_value: false)
        return corev3.HeaderValueOption(header=corev3.HeaderValue(key=name, value=f"%REQ({name.upper()})%"),
                                        append_action=OVERWRITE)

    return [
        copy("x-request-id"),
        copy("traceparent"),
        # The routing decision (pool; rule, model and pool), set by extproc on the request.
        copy("x-llmgw-pool"),
        copy("x-llmgw-decision"),
        # miss: the response cache had no answer, and keeps this one (hits never reach here).
        copy("x-llmgw-cache"),
        # OpenAI's rate-limit headers on admitted requests (absent when the tenant has no limits).
        *(copy(f"x-ratelimit-{what}-{unit}") for unit in ("requests", "tokens")
          for what in ("limit", "remaining", "reset")),
    ]


def _on(header: str, value: str) -> routev3.HeaderMatcher:
    return routev3.HeaderMatcher(name=header, string_match=matcherv3.StringMatcher(exact=value))


def direct(pool: PoolSpec | None, prefix: str) -> routev3.Route:
    """To the pod extproc picked; ``pool``'s own route (matched on x-llmgw-pool too) carries its
    first-byte timeout, the generic one (``pool`` None) serves any pool without its own."""
    headers = [_on(names.ROUTE_HEADER, "direct")]
    if pool is not None:
        headers.append(_on(names.POOL_HEADER, pool.name))
    first_byte = pool.first_byte_timeout_s if pool is not None else DEFAULT_FIRST_BYTE_S
    return routev3.Route(
        name=names.DIRECT_ROUTE if pool is None else f"{names.DIRECT_ROUTE}-{pool.name}",
        match=routev3.RouteMatch(prefix=prefix, headers=headers),
        route=routev3.RouteAction(
            cluster=names.PODS_CLUSTER,
            timeout=seconds(0),  # a generation may stream for minutes
            # A pod that refuses the connection, resets or stays silent past the per-try idle timeout
            # before answering: one retry, on the fallback endpoint extproc listed second in
            # x-gateway-destination-endpoint (override_host policy). A pod's 429 or 5xx too (a
            # status, so before the first byte reaches the client): the request goes on to the next
            # host listed. extproc lists a third, a pod of the model's fallback model, when the
            # model has one (x-envoy-max-retries: 2), and the upstream Lua filter of llm_pods gives
            # that attempt the fallback model: a failing pool's 500s reach its fallback at once,
            # not only once its breaker opens.
            retry_policy=routev3.RetryPolicy(
                retry_on="connect-failure,refused-stream,reset,retriable-status-codes",
                retriable_status_codes=[429, 500, 502, 503, 504],
                num_retries=1,
                # The first byte (prefill, or a whole non-streamed answer) and every later gap.
                per_try_idle_timeout=seconds(first_byte),
            ),
        ),
    )


def batch(prefix: str) -> routev3.Route:
    """To the batching coordinator (pools with ``batching``), which merges and calls the pods."""
    return routev3.Route(name=names.BATCH_ROUTE,
                         match=routev3.RouteMatch(prefix=prefix, headers=[_on(names.ROUTE_HEADER, "batch")]),
                         route=routev3.RouteAction(cluster=names.COORDINATOR_CLUSTER, timeout=seconds(0)))


def no_route(prefix: str) -> routev3.Route:
    """What a request matches before extproc decided, and after if it routed nowhere: a 503."""
    return routev3.Route(
        name=names.NO_ROUTE,
        match=routev3.RouteMatch(prefix=prefix),
        response_headers_to_add=[corev3.HeaderValueOption(
            header=corev3.HeaderValue(key="content-type", value="application/json"), append_action=OVERWRITE)],
        direct_response=routev3.DirectResponseAction(status=503, body=corev3.DataSource(inline_string=NO_ROUTE_BODY)),
    )


def gateway_routes(spec: GatewaySpec, prefix: str = "/") -> list[routev3.Route]:
    """Every pool's own route, the generic direct route, the batch route, then no_route."""
    return [*(direct(pool, prefix) for pool in spec.pools), direct(None, prefix), batch(prefix), no_route(prefix)]


def enable_filters(routes: Sequence[routev3.Route], filters: Sequence[str]) -> list[routev3.Route]:
    """``routes`` turning on ``filters``, which the listener has off by default (`gateway_filters`),
    and each carrying the response headers a dedicated virtual host would add.

    A ``FilterConfig`` whose ``config`` is an empty ``Any`` turns a disabled filter on (Envoy
    refuses one with no ``config`` at all).
    """
    enabled: dict[str, protobuf.Any] = {name: typed(routev3.FilterConfig(config=protobuf.Any())) for name in filters}
    return [replace(r, response_headers_to_add=[*response_headers(), *r.response_headers_to_add],
                    typed_per_filter_config=enabled) for r in routes]


def route_config(spec: GatewaySpec) -> routev3.RouteConfiguration:
    """The dedicated gateway's routes: one virtual host for every domain."""
    return routev3.RouteConfiguration(name=names.ROUTE_CONFIG, virtual_hosts=[routev3.VirtualHost(
        name=names.VIRTUAL_HOST, domains=["*"], response_headers_to_add=response_headers(),
        routes=gateway_routes(spec))])
