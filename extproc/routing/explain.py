"""How a request body would be routed, and why: every rule tried with each condition it states
(``llmgw route --explain``). Pure: the same analysis and rules the gateway runs."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from extproc.api import OPERATIONS_BY_PATH, ApiError, load_object, validate
from extproc.body import BodyLimits, check_structure
from extproc.config import GatewayConfig
from extproc.routing.classifier import build_index
from extproc.routing.features import extract, intent_text
from extproc.routing.intents import IntentIndex
from extproc.routing.prefix import prefix_hashes
from extproc.routing.rules import RouteContext, choose
from extproc.tokens import BpeEstimator, FallbackEstimator, TokenEstimator


def explain(config: GatewayConfig, body: bytes, path: str = "/v1/chat/completions", tenant: str | None = None,
            qos: str | None = None, index: IntentIndex | None = None) -> dict[str, Any]:
    """The route of ``body`` as the gateway would choose it: the features read, each rule tried and
    each of its conditions, semantic routing's match when it applies (with ``index``, else one
    built from the config), and the outcome (model, pool, rule, intent). Raises ``ApiError`` for a
    body the gateway would refuse, and ``KeyError`` for an unknown tenant."""
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
    intents, semantic = config.intents, None
    if route.rule is not None:
        model, pool, rule = route.rule.model, route.rule.pool, route.rule.name
        input_tokens = _estimator(config, model).estimate(parsed).total
        classify = route.rule.intents and intents is not None
        why = f"rule {rule!r} matched"
    elif intents is not None and request.model == intents.model_name:
        (model, pool), rule, classify = intents.default, "intents", True
        why = f"{request.model!r} asks for semantic routing"
    elif requested is not None:
        model, pool, rule, classify = requested.name, requested.pool.name, "", False
        why = "no rule matched: the requested model's own pool"
    else:
        raise ApiError(404, f"The model '{request.model}' does not exist and no routing rule takes it.",
                       param="model", code="model_not_found")
    if classify:
        assert intents is not None
        index = index or build_index(intents)
        text = intent_text(raw, intents.max_chars)
        match = index.classify(text)
        if match.intent is not None:
            model, pool = match.intent.model, match.intent.pool
        if match.probability is not None:  # the learned decision
            why += f"; intent {match.best!r} is likeliest (probability {match.probability:.3f}, " \
                   f"confidence {index.confidence:.3f}, similarity {match.score:.3f})" + \
                   ("" if match.intent is not None else ": not sure enough, the default route")
        elif match.intent is not None:
            why += f"; intent {match.intent.name!r} is nearest ({match.score:.3f} >= {index.threshold:.2f}, " \
                   f"{match.score - match.runner_up:.3f} over the runner-up)"
        else:
            why += f"; no intent is sure enough (nearest {match.best!r} at {match.score:.3f}, threshold " \
                   f"{index.threshold:.2f}, margin {index.margin:.2f} over {match.runner_up:.3f}): the default route"
        semantic = {"embedder": index.embedder.name, "text": text, "nearest": match.best, "score": match.score,
                    "runner_up": match.runner_up, "decision": index.decision, "probability": match.probability,
                    "confidence": index.confidence, "threshold": index.threshold, "margin": index.margin,
                    "intent": match.intent.name if match.intent is not None else "default"}
    block_chars, max_blocks = config.prefix_blocks
    return {
        "requested_model": request.model,
        "features": {**asdict(features), "modalities": sorted(features.modalities),
                     "stream": context.stream, "max_tokens": context.max_tokens, "input_tokens": input_tokens,
                     "tenant_tags": dict(context.tenant_tags), "qos": chosen_qos,
                     "prefix_blocks": len(prefix_hashes(raw, block_chars, max_blocks)) if block_chars else 0},
        "rules": [{"rule": name, "matched": all(ok for _, ok, _ in checks),
                   "conditions": [{"condition": c, "holds": ok, "request": seen} for c, ok, seen in checks]}
                  for name, checks in route.explanation],
        "intents": semantic,
        "decision": {"model": model, "pool": pool, "rule": rule or "model",
                     "intent": semantic["intent"] if semantic else None,
                     "score": semantic["score"] if semantic else None, "why": why},
    }


def _estimator(config: GatewayConfig, served: str | None) -> TokenEstimator:
    model = config.lookup(served) if served else None
    if model is not None and model.tokenizer is not None:
        return BpeEstimator.from_spec(str(model.tokenizer), chat_template=model.jinja_template)
    return FallbackEstimator()
