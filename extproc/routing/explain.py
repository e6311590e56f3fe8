"""How a request body would be routed, and why: every rule tried with each condition it states
(``llmgw route --explain``). Pure: the same analysis and rules the gateway runs."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from extproc.api import OPERATIONS_BY_PATH, ApiError, load_object, validate
from extproc.body import BodyLimits, check_structure
from extproc.config import GatewayConfig
from extproc.routing.features import extract
from extproc.routing.rules import RouteContext, choose
from extproc.tokens import BpeEstimator, FallbackEstimator, TokenEstimator


def explain(config: GatewayConfig, body: bytes, path: str = "/v1/chat/completions", tenant: str | None = None,
            qos: str | None = None) -> dict[str, Any]:
    """The route of ``body`` as the gateway would choose it: the features read, each rule tried and
    each of its conditions, and the outcome (model, pool, rule). Raises ``ApiError`` for a body the
    gateway would refuse, and ``KeyError`` for an unknown tenant."""
    operation = OPERATIONS_BY_PATH[path]
    raw = load_object(body)
    check_structure(raw, BodyLimits(**config.server.limits.model_dump()))
    parsed = validate(operation, raw)
    request = parsed.model
    owner = config.tenants_by_name[tenant] if tenant is not None else None
    chosen_qos = qos or (owner.qos[0] if owner is not None else "")
    requested = config.lookup(request.model)
    served = requested.name if requested is not None else None
    input_tokens = _estimator(config, served).estimate(parsed).total
    features = extract(raw)
    context = RouteContext(request.model, features, bool(getattr(request, "stream", False)), request.output_limit,
                           input_tokens, dict(owner.tags) if owner is not None else {}, chosen_qos)
    route = choose(config.rules, context, explain=True)
    if route.rule is not None:
        model, pool, rule = route.rule.model, route.rule.pool, route.rule.name
        input_tokens = _estimator(config, model).estimate(parsed).total
    elif requested is not None:
        model, pool, rule = requested.name, requested.pool.name, ""
    else:
        raise ApiError(404, f"The model '{request.model}' does not exist and no routing rule takes it.",
                       param="model", code="model_not_found")
    return {
        "requested_model": request.model,
        "features": {**asdict(features), "modalities": sorted(features.modalities),
                     "stream": context.stream, "max_tokens": context.max_tokens, "input_tokens": input_tokens,
                     "tenant_tags": dict(context.tenant_tags), "qos": chosen_qos},
        "rules": [{"rule": name, "matched": all(ok for _, ok, _ in checks),
                   "conditions": [{"condition": c, "holds": ok, "request": seen} for c, ok, seen in checks]}
                  for name, checks in route.explanation],
        "decision": {"model": model, "pool": pool, "rule": rule or "model",
                     "why": f"rule {rule!r} matched" if rule else "no rule matched: the requested model's own pool"},
    }


def _estimator(config: GatewayConfig, served: str | None) -> TokenEstimator:
    model = config.lookup(served) if served else None
    if model is not None and model.tokenizer is not None:
        return BpeEstimator.from_spec(str(model.tokenizer))
    return FallbackEstimator()
