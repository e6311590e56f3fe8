"""Analysis: the request-body stage. The body's facts (bounded parse, validation, token estimate,
routing rules; ``extproc.body``), on the event loop or, for a large body, in the helper process
(``Analyze``); then semantic routing's intent (``Classify``) when the client asked for it."""

from __future__ import annotations

from dataclasses import replace

from extproc import validation
from extproc.api import ApiError
from extproc.body import NO_RULES, Analysis, BodyLimits, Routing, SemanticRouting, analyze, with_model
from extproc.config import GatewayConfig
from extproc.routing.intents import IntentMatch
from extproc.state import RequestState
from extproc.steps import RETRY_SOON, Analyze, Answer, Classify, Continue, Step, TokenizerSpec
from extproc.tokens import BpeEstimator, TokenEstimator


class BodyAnalysis:
    """What the body says, and which intent it has."""

    def __init__(self, config: GatewayConfig) -> None:
        self._loaded: dict[TokenizerSpec, TokenEstimator] = {}  # one per tokenizer file and template
        self.reload(config)

    def reload(self, config: GatewayConfig) -> None:
        """Use a new config snapshot from the next request on. Tokenizers are loaded here (once per
        file, kept across reloads), never on a request."""
        loaded, self._loaded, self._counters, self._tokenizers = self._loaded, {}, {}, {}
        for model in config.models:
            if model.tokenizer is None:
                continue
            template = model.jinja_template
            spec = (str(model.tokenizer), template.source if template is not None else None)
            if spec not in self._loaded:
                self._loaded[spec] = loaded.get(spec) or BpeEstimator.from_spec(spec[0], chat_template=template)
            self._counters[model.name], self._tokenizers[model.name] = self._loaded[spec], spec
        self._served_names = {name: model.name for name, model in config.models_by_name.items()}
        self._limits = BodyLimits(**config.server.limits.model_dump())
        intents = config.intents
        self._intents = SemanticRouting(intents.model_name, intents.default[0], intents.default[1], intents.max_chars) \
            if intents is not None else None
        self.config = config

    def request_body(self, state: RequestState, body: bytes) -> Step | None:
        """Analyze the body here, or (``Analyze``) have the shell analyze a large one off the event
        loop and hand the result to ``analyzed``."""
        assert state.operation is not None, "the phase table lets a body in only after POST headers"
        config = self.config
        state.begin()
        state.body = body
        if len(body) > config.max_body_bytes:
            return state.reject(validation.too_large(len(body), config.max_body_bytes))
        routing = Routing(config.rules, state.tenant.tags if state.tenant else (), state.qos,
                          config.prefix_blocks, self._intents) \
            if config.rules or config.prefix_blocks[0] or self._intents else NO_RULES
        if len(body) >= config.server.offload_body_bytes:
            return Analyze(state.operation, body, self._served_names, self._limits, self._tokenizers, routing)
        try:
            analysis = analyze(state.operation, body, self._served_names, self._limits, self._counters, routing)
        except ApiError as error:
            return state.reject(error)
        return self.analyzed(state, analysis)

    def request_trailers(self, state: RequestState) -> Answer:
        """Trailers: after the body they pass; with no body before them the request is empty."""
        if state.facts is None and state.rejected is None:
            return state.reject(validation.EMPTY_BODY)
        return Continue()

    def analyzed(self, state: RequestState, analysis: Analysis | ApiError) -> Step | None:
        """The body's facts (or why it is refused); ``Classify`` when semantic routing chooses the
        model, else None: on to resolution."""
        if isinstance(analysis, ApiError):
            # 503: the body-analysis helper is too busy to answer within Envoy's message timeout
            return state.reject(analysis, RETRY_SOON if analysis.status == 503 else ())
        state.facts, state.new_body = analysis.facts, analysis.body
        state.end("tokens")
        if analysis.facts.intent_text is not None:
            return Classify(analysis.facts.intent_text)
        return None

    def classified(self, state: RequestState, match: IntentMatch | None) -> None:
        """Semantic routing's answer: the intent's model and pool, else the default route's (which
        ``analyze`` already set); the forwarded body gets the chosen model."""
        facts, body = state.facts, state.new_body
        assert facts is not None and body is not None
        score = match.score if match is not None else None
        if match is not None and match.intent is not None:
            intent = match.intent
            facts = replace(facts, served=intent.model, pool=intent.pool, intent=intent.name, score=score)
        else:
            facts = replace(facts, intent="default", score=score)
        state.facts = facts
        state.new_body = with_model(body, facts.served or facts.model)
        state.end("intent")
