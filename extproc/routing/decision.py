"""The routing decision: which pod of the model's pool serves a request, which one Envoy retries
on, and the headers and metadata that carry the decision. Pure: no I/O.

The decision travels with the request as Envoy dynamic metadata (``accounting.Decision``), so the
access-log entry that ends the request brings it back to whichever worker settles it. The picker's
count of requests in flight is this process's: a pick is released when the request's entry reaches
this process, or forgotten after ``forget_after_s`` (its entry went to another worker, or nowhere).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from extproc.accounting import CACHE_HIT, CACHE_MISS, CACHE_STALE, Decision
from extproc.api import ApiError
from extproc.body import BodyFacts
from extproc.config import Pool
from extproc.decisions import Continue
from extproc.routing.breaker import Breakers
from extproc.routing.health import EndpointHealth
from extproc.routing.picker import EndpointPicker, PickRequest
from extproc.state import RequestState
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
RULE_MODEL = "model"  # no rule matched: the model the client named, in its own pool
RULE_INTENTS = "intents"  # no rule matched: semantic routing (the client named ``intents.model_name``)
# Set on a request whose usage chunk the gateway asked for: the Lua filter of envoy/envoy.yaml
# removes the header before the pod, and the chunk (`"choices":[]` with a `usage` object) before
# the client. x-llmgw-* from a client is stripped first, so it cannot be forged.
STRIP_USAGE_HEADER = "x-llmgw-strip-usage"
METADATA_NAMESPACE = "llmgw"
SPARE_HEADER = "x-llmgw-fallback"  # "host model": the attempt Envoy makes on host gets that model
CACHE_HEADER = "x-llmgw-cache"  # hit (the gateway answered from its cache), miss (the pod's answer is stored)


class Router:
    """Picks endpoints (skipping unhealthy ones) and remembers its picks until their requests end."""

    def __init__(self, picker: EndpointPicker, health: EndpointHealth, forget_after_s: float = 120.0,
                 breakers: Breakers | None = None) -> None:
        self.picker = picker
        self.health = health
        self.breakers = breakers  # None: circuit breakers off
        self.coordinator: str | None = None  # host:port of the batching coordinator, if there is one
        self.forget_after_s = forget_after_s
        # id -> (decision, deadline): what this process routed and has not seen end yet
        self._picked: OrderedDict[str, tuple[Decision, float]] = OrderedDict()

    def route(self, state: RequestState, qos_header: str) -> Continue:
        """Pick the endpoint and a fallback for Envoy's one retry; set the routing headers, the
        trace baggage, the new body (an alias, an added usage chunk) and the decision metadata."""
        facts, model, trace, pool = state.facts, state.model, state.trace, state.pool
        assert facts is not None and model is not None and trace is not None and pool is not None
        usable = self.health.usable(pool.endpoints)
        breakers, now = self.breakers, time.monotonic()
        if breakers is not None:  # pods whose breaker is open are left out (unless all are)
            usable = tuple(e for e in usable if breakers.pod(e).would_allow(now)) or usable
        request = PickRequest(model.name, facts.prefix, pool.picker, pool.draining, model.lora)
        # Envoy's override_host policy tries the listed hosts in order, one per attempt: a pod that
        # refuses the connection or resets before answering is retried once on the fallback.
        endpoint, fallback = self.picker.choose(usable, request)
        if breakers is not None:
            breakers.pod(endpoint).allows(now)  # a half-open pod's probe is this request
        state.endpoint = endpoint
        hosts = [endpoint] if fallback is None else [endpoint, fallback]
        tenant = state.tenant.name if state.tenant is not None else ""
        batch = self._batch_settings(state)
        spare = None
        if state.spare is not None and batch is None:  # a pod of the fallback model, tried last
            spare_model, spare_pool = state.spare
            spare_request = PickRequest(spare_model.name, facts.prefix, spare_pool.picker, spare_pool.draining,
                                        spare_model.lora)
            spare_host = self.picker.fallback(self.health.usable(spare_pool.endpoints), "", spare_request)
            if spare_host is not None:
                hosts.append(spare_host)
                spare = f"{spare_host} {spare_model.name}"
        destination = ",".join(hosts)
        set_headers: list[tuple[str, str]] = [
            (ROUTE_HEADER, ROUTE_DIRECT if batch is None else ROUTE_BATCH),
            (DESTINATION_HEADER, destination),
            (MODEL_HEADER, model.name),
            (POOL_HEADER, pool.name),
            # what was decided and why, copied onto the response by Envoy (envoy.yaml)
            (DECISION_HEADER, decision_header(facts.rule or _rule_of(facts), facts.intent, facts.score,
                                              model.name, pool.name, state.fallback_from)),
            # W3C baggage for the pod: the seeds' "trace colouring" (batch id joins when batching lands)
            ("baggage", baggage(_baggage_items(state.request_id, model.version, tenant))),
        ]
        if tenant:
            set_headers.append((TENANT_HEADER, tenant))
            set_headers.append((qos_header, state.qos))
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
        decision = decision_of(state, endpoint)
        self._picked[state.id] = (decision, time.monotonic() + self.forget_after_s)
        return Continue(set_headers=tuple(set_headers), body=new_body, clear_route_cache=True,
                        metadata=((METADATA_NAMESPACE, decision.metadata()),))

    def _batch_settings(self, state: RequestState) -> str | None:
        """The ``x-llmgw-batch`` value when the request goes to the coordinator, else None: its
        pool batches its class, it can share a call, and the coordinator answers its probes."""
        pool, facts = state.pool, state.facts
        assert pool is not None and facts is not None
        settings = pool.batching
        if not (facts.batchable and settings.batches(state.qos) and self.coordinator is not None
                and self.health.is_usable(self.coordinator)):
            return None
        group = "" if settings.group_threshold is None else f"; group={settings.group_threshold:g}"
        return (f"wait_ms={settings.wait_ms(state.qos):g}; size={settings.max_batch_size}; "
                f"tokens={settings.max_batched_tokens}{group}")

    def load(self, pool: Pool) -> float | None:
        """Requests running and waiting on the pool's pods, as last scraped (None: none known)."""
        states = [s for s in (self.picker.states.get(e) for e in pool.endpoints) if s is not None]
        return sum(s.running + s.waiting for s in states) if states else None

    def shed(self, pool: Pool, qos: str) -> ApiError | None:
        """QoS shedding: a 429 when the pool's pods have more requests waiting on average than
        class ``qos`` may queue behind (``pools[].shed``); None to go on. Pods whose state is
        unknown are left out of the average; with none known, nothing is shed."""
        depth = pool.shed_depth(qos)
        if depth is None:
            return None
        states = self.picker.states
        waiting = [s.waiting for s in (states.get(e) for e in pool.endpoints if e not in pool.draining)
                   if s is not None]
        if not waiting:
            return None
        mean = sum(waiting) / len(waiting)
        if mean <= depth:
            return None
        return ApiError(429, f"Pool {pool.name!r} is overloaded ({mean:.1f} requests waiting per pod); "
                        f"{qos or 'default'} requests are shed past {depth:g}. Please try again in 1s.",
                        type="requests", code="pool_overloaded")

    def ended(self, record_id: str) -> None:
        """The request ``record_id`` ended (its access-log entry came): its pick is released."""
        picked = self._picked.pop(record_id, None)
        if picked is not None:
            self.picker.release(picked[0].endpoint)

    def running(self, record_id: str) -> None:
        """A periodic entry says the request still runs: keep its pick."""
        picked = self._picked.get(record_id)
        if picked is not None:
            self._picked[record_id] = (picked[0], time.monotonic() + self.forget_after_s)
            self._picked.move_to_end(record_id)

    def forget_stale(self, now: float | None = None) -> list[Decision]:
        """Release the picks whose entries never came here, and return their decisions: their
        requests were settled by another worker, or never (the access-log stream was down)."""
        now = time.monotonic() if now is None else now
        stale = [decision for decision, deadline in self._picked.values() if deadline <= now]
        for decision in stale:
            self.ended(decision.id)
        return stale

    @property
    def picks(self) -> int:
        """Picks whose requests have not ended yet, as far as this process knows."""
        return len(self._picked)


def _baggage_items(request_id: str, version: str, tenant: str) -> list[tuple[str, str]]:
    items = [("llmgw.request_id", request_id)]
    if version:
        items.append(("llmgw.model.version", version))
    if tenant:
        items.append(("llmgw.tenant", tenant))
    return items


def decision_of(state: RequestState, endpoint: str = "") -> Decision:
    """The request's decision so far (a refused request has no pool nor endpoint)."""
    facts, model, trace = state.facts, state.model, state.trace
    pool = state.pool or (model.pool if model is not None else None)
    return Decision(
        id=state.id, request_id=state.request_id, started_ns=state.started_ns, path=state.path,
        model=facts.model if facts is not None else "", served_model=model.name if model is not None else "",
        model_version=model.version if model is not None else "", pool=pool.name if pool is not None else "",
        endpoint=endpoint, rule=(facts.rule or _rule_of(facts)) if model is not None and facts is not None else "",
        stream=facts.stream if facts is not None else False,
        input_tokens=facts.input_tokens if facts is not None else 0,
        max_tokens=facts.output_limit if facts is not None else None, n=facts.n if facts is not None else 1,
        tenant=state.tenant.name if state.tenant is not None else "", qos=state.qos,
        trace_id=trace.trace_id if trace else "", span_id=trace.span_id if trace else "",
        parent_span_id=(trace.parent_span_id or "") if trace else "", sampled=state.sampled,
        lease=state.lease, phases=tuple(state.phases), intent=facts.intent if facts is not None else "",
        score=facts.score if facts is not None else None,
        cache="" if state.cache_key is None else (CACHE_STALE if state.cache_stale else CACHE_HIT)
        if state.cached is not None else CACHE_MISS,
        fallback_from=state.fallback_from,
        cache_key=state.cache_key.hex() if state.cache_key is not None and state.cached is None else "")


def _rule_of(facts: BodyFacts) -> str:
    return RULE_INTENTS if facts.intent else RULE_MODEL


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
