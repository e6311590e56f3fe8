"""Route: the pods that serve the request, and what goes on with it. The picked pod, the one
Envoy's one retry goes to and a spare model's pod tried last; the routing headers Envoy's routes
and Lua filters read; the trace baggage; the new body; and the decision, as Envoy dynamic metadata,
which the access-log entry that ends the request brings back to whichever worker settles it."""

from __future__ import annotations

from extproc.accounting import CACHE_MISS, NAMESPACE
from extproc.api import Operation
from extproc.qos import QOS_HEADER
from extproc.routing.engines import merges, profile_of
from extproc.routing.router import Router
from extproc.stages.cache import CACHE_HEADER
from extproc.state import RequestState
from extproc.steps import Continue
from extproc.telemetry.tracecontext import baggage
from extproc.validation import DESTINATION_HEADER

ROUTE_HEADER = "x-llmgw-route"
MODEL_HEADER = "x-llmgw-model"
POOL_HEADER = "x-llmgw-pool"
DECISION_HEADER = "x-llmgw-decision"
TENANT_HEADER = "x-llmgw-tenant"
ROUTE_DIRECT = "direct"
ROUTE_BATCH = "batch"  # to the batching coordinator (envoy.yaml's llm_coordinator cluster)
BATCH_HEADER = "x-llmgw-batch"  # the batch settings of the request's pool and class, for the coordinator
INPUT_TOKENS_HEADER = "x-llmgw-input-tokens"  # the gateway's count of the prompt (the coordinator splits usage by it)
# Set on a request whose usage chunk the gateway asked for: the Lua filter of envoy/envoy.yaml
# removes the header before the pod, and the chunk (`"choices":[]` with a `usage` object) before
# the client. x-llmgw-* from a client is stripped first, so it cannot be forged.
STRIP_USAGE_HEADER = "x-llmgw-strip-usage"
SPARE_HEADER = "x-llmgw-fallback"  # "host model": the attempt Envoy makes on host gets that model


class Route:
    """Sends an admitted, uncached request on to its pods."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def route(self, state: RequestState) -> Continue:
        """Pick the endpoint and a fallback for Envoy's one retry; set the routing headers, the
        trace baggage, the new body (an alias, an added usage chunk) and the decision metadata."""
        facts, model, trace, pool = state.facts, state.model, state.trace, state.pool
        assert facts is not None and model is not None and trace is not None and pool is not None
        router = self.router
        # Envoy's override_host policy tries the listed hosts in order, one per attempt: a pod that
        # refuses the connection or resets before answering is retried once on the fallback.
        endpoint, fallback = router.pick(model, pool, facts.prefix)
        state.endpoint = endpoint
        hosts = [endpoint] if fallback is None else [endpoint, fallback]
        tenant = state.tenant.name if state.tenant is not None else ""
        batch = self._batch_settings(state)
        spare = None
        if state.spare is not None and batch is None:  # a pod of the fallback model, tried last
            spare_model, spare_pool = state.spare
            spare_host = router.any_pod(spare_model, spare_pool, facts.prefix)
            if spare_host is not None:
                hosts.append(spare_host)
                spare = f"{spare_host} {spare_model.name}"
        set_headers: list[tuple[str, str]] = [
            (ROUTE_HEADER, ROUTE_DIRECT if batch is None else ROUTE_BATCH),
            (DESTINATION_HEADER, ",".join(hosts)),
            (MODEL_HEADER, model.name),
            (POOL_HEADER, pool.name),
            # what was decided and why, copied onto the response by Envoy (envoy.yaml)
            (DECISION_HEADER, decision_header(facts.chosen_by, facts.intent, facts.score, model.name, pool.name,
                                              state.fallback_from)),
            # W3C baggage for the pod: the seeds' "trace colouring" (batch id joins when batching lands)
            ("baggage", baggage(_baggage_items(state.request_id, model.version, tenant))),
        ]
        if tenant:
            set_headers.append((TENANT_HEADER, tenant))
            set_headers.append((QOS_HEADER, state.qos))
        timeout = pool.degrade.of(state.qos, pool.degrade.timeout_s)
        if timeout is not None:  # the class's bound on the whole request (Envoy answers 504 past it)
            set_headers.append(("x-envoy-upstream-rq-timeout-ms", str(int(timeout * 1000))))
        if spare is not None:  # envoy.yaml: llm_pods' upstream Lua filter rewrites that attempt's model
            set_headers.append((SPARE_HEADER, spare))
        # One attempt per host listed: a retry past them would go to Envoy's fallback policy, which
        # may pick a pod of another pool (one that does not serve the model: a 404).
        set_headers.append(("x-envoy-max-retries", str(len(hosts) - 1)))
        if batch is not None:
            set_headers.append((BATCH_HEADER, batch))
            set_headers.append((INPUT_TOKENS_HEADER, str(facts.input_tokens)))
        set_headers.extend(state.rate_headers)  # copied onto the response by Envoy (envoy.yaml)
        if pool.credential:
            set_headers.append(("authorization", f"Bearer {pool.credential}"))
        if facts.strip_usage:  # exact usage for the ledger; Envoy's Lua filter drops the chunk
            set_headers.append((STRIP_USAGE_HEADER, "1"))
        if state.cache_key is not None:  # Envoy's Lua filter keeps the answer for the cache; copied to the client
            set_headers.append((CACHE_HEADER, CACHE_MISS))
        new_body, state.new_body = state.new_body, None
        if new_body is not None:
            set_headers.append(("content-length", str(len(new_body))))
        state.end("route")
        decision = state.decision(endpoint)
        router.feedback.picked(decision)
        return Continue(set_headers=tuple(set_headers), body=new_body, clear_route_cache=True,
                        metadata=((NAMESPACE, decision.metadata()),))

    def _batch_settings(self, state: RequestState) -> str | None:
        """The ``x-llmgw-batch`` value when the request goes to the coordinator, else None: its
        pool batches its class, it can share a call, and the coordinator answers its probes."""
        pool, facts, model = state.pool, state.facts, state.model
        assert pool is not None and facts is not None and model is not None
        settings = pool.batching
        if not (facts.batchable and settings.batches(state.qos) and merges(pool) and self.router.coordinator_usable()):
            return None
        if state.operation is Operation.CHAT and model.chat_template is None \
                and profile_of(pool.engine).template_path is None:
            return None  # no template is known to render it into a merged prompt: it goes alone
        group = "" if settings.group_threshold is None else f"; group={settings.group_threshold:g}"
        return (f"wait_ms={settings.wait_ms(state.qos):g}; size={settings.max_batch_size}; "
                f"tokens={settings.max_batched_tokens}{group}")


def _baggage_items(request_id: str, version: str, tenant: str) -> list[tuple[str, str]]:
    items = [("llmgw.request_id", request_id)]
    if version:
        items.append(("llmgw.model.version", version))
    if tenant:
        items.append(("llmgw.tenant", tenant))
    return items


def decision_header(rule: str, intent: str, score: float | None, model: str, pool: str,
                    fallback_from: str = "") -> str:
    """``x-llmgw-decision``: what chose the model and pool, how sure semantic routing was, and
    the model it stands in for when its pool's breaker was open."""
    out = f"rule={rule}"
    if intent:
        out += f"; intent={intent}"
    if score is not None:
        out += f"; score={score:.3f}"
    out += f"; model={model}; pool={pool}"
    return f"{out}; fallback_from={fallback_from}; breaker=open" if fallback_from else out
