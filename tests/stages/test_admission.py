"""The admission stage on its own: what is reserved, and what each verdict of the store becomes.
(Exact limits against a real store: tests/quota/ and tests/test_admission.py.)"""

from __future__ import annotations

import orjson

from extproc.api import Operation
from extproc.body import BodyLimits, analyze
from extproc.config import parse_config
from extproc.keys import hash_key
from extproc.predict import OutputLengthPredictor
from extproc.quota.limits import Figure, Lease, LimitKind, Verdict
from extproc.quota.store import StoreUnavailable
from extproc.stages.admission import Admissions
from extproc.state import RequestState, new_state
from extproc.steps import Admit, Reply

DOCUMENT = {
    "pools": [{"name": "p", "endpoints": ["10.0.0.1:8000"]}],
    "models": [{"name": "m", "pool": "p", "price": {"input": 1.0, "output": 2.0}}],
    "tenants": [{"name": "limited", "keys": [{"sha256": hash_key("sk-l").hex()}], "limits": {"rpm": 10}},
                {"name": "free", "keys": [{"sha256": hash_key("sk-f").hex()}]}],
}
CONFIG = parse_config(DOCUMENT, env={})


def _state(tenant: str, max_tokens: int = 100) -> RequestState:
    state = new_state("lease-1")
    state.tenant = CONFIG.tenants_by_name[tenant]
    state.model = CONFIG.models_by_name["m"]
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})
    state.facts = analyze(Operation.CHAT, body, {"m": "m"}, BodyLimits()).facts
    return state


def test_a_tenant_without_limits_is_not_asked_about() -> None:
    assert Admissions(OutputLengthPredictor()).admit(_state("free")) is None


def test_the_reservation_is_the_input_estimate_plus_the_predicted_output_at_the_models_prices() -> None:
    state = _state("limited", max_tokens=100)
    asked = Admissions(OutputLengthPredictor()).admit(state)
    assert isinstance(asked, Admit) and asked.admission.tenant == "limited" and asked.admission.lease_id == "lease-1"
    assert state.facts is not None
    output = state.reserved_tokens - state.facts.input_tokens
    assert 0 < output <= 100  # nothing learned yet: the predictor's default, capped by max_tokens
    assert asked.admission.reserve_tokens == state.reserved_tokens
    assert asked.admission.reserve_cost == state.reserved_cost == round(state.facts.input_tokens * 1.0 + output * 2.0)
    assert asked.admission.qos == ""  # a class without limits of its own is not a scope


def test_an_admitted_request_holds_its_lease_and_carries_the_rate_headers() -> None:
    state = _state("limited")
    lease = Lease("limited", "", "lease-1", 10, 0, 60_000, "memory")
    verdict = Verdict(True, (Figure("tenant", LimitKind.REQUESTS, 10, 9, 6000),), lease=lease)
    assert Admissions(OutputLengthPredictor()).admitted(state, verdict) is None
    assert state.lease is lease and ("x-ratelimit-remaining-requests", "9") in state.rate_headers
    assert [p.name for p in state.phases] == ["quota"]


def test_a_refusal_names_the_limit_and_when_to_retry() -> None:
    state = _state("limited")
    verdict = Verdict(False, (Figure("tenant", LimitKind.REQUESTS, 10, 0, 6000),), refused_by=LimitKind.REQUESTS,
                      refused_scope="tenant", retry_after_ms=6000)
    reply = Admissions(OutputLengthPredictor()).admitted(state, verdict)
    assert isinstance(reply, Reply) and reply.status == 429 and ("retry-after", "6") in reply.headers
    assert state.lease is None and state.rejected is not None


def test_a_store_that_is_down_and_fails_closed_is_a_503() -> None:
    reply = Admissions(OutputLengthPredictor()).admitted(_state("limited"), StoreUnavailable("down"))
    assert isinstance(reply, Reply) and reply.status == 503 and ("retry-after", "1") in reply.headers
