"""Admission: the tenant's quota. The tokens to hold (the input estimate and the predicted output,
capped by max_tokens) and their cost are reserved by the quota store (``Admit``); its verdict
admits the request with a lease, or refuses it (429/402 naming the limit; 503 when the store is
down and the config fails closed)."""

from __future__ import annotations

from extproc.accounting import micro_dollars
from extproc.predict import OutputLengthPredictor
from extproc.quota.limits import UNLIMITED, Admission, Verdict
from extproc.quota.replies import UNAVAILABLE, refusal
from extproc.quota.store import StoreUnavailable
from extproc.state import RequestState
from extproc.steps import RETRY_SOON, Admit, Reply


class Admissions:
    """Reservations against the tenant's limits."""

    def __init__(self, predictor: OutputLengthPredictor) -> None:
        self.predictor = predictor

    def admit(self, state: RequestState) -> Admit | None:
        """The quota store's question for a tenant with limits; None (no limits): on to the cache."""
        quota = state.tenant.quota(state.qos) if state.tenant is not None else None
        if quota is None:
            return None
        assert state.tenant is not None and state.model is not None
        input_tokens, output_tokens = self._reserve(state)
        state.reserved_tokens = input_tokens + output_tokens
        state.reserved_cost = micro_dollars(state.model.prices.cost(input_tokens, output_tokens, 0))
        # The class is a scope of its own only where it has limits: counting it otherwise doubles the
        # store's writes for nothing (a limit added by a reload counts from then on).
        admission = Admission(tenant=state.tenant.name, lease_id=state.id,
                              qos=state.qos if quota.qos != UNLIMITED else "",
                              reserve_tokens=state.reserved_tokens, reserve_cost=state.reserved_cost)
        return Admit(admission, quota)

    def admitted(self, state: RequestState, verdict: Verdict | StoreUnavailable) -> Reply | None:
        """The quota store's verdict: None (admitted, the lease held): on to the cache; else the
        refusal naming the limit."""
        if isinstance(verdict, StoreUnavailable):
            # The quota store is down and the config says fail closed.
            return state.reject(UNAVAILABLE, RETRY_SOON)
        state.end("quota")
        if not verdict.admitted:
            state.new_body = None
            tenant = state.tenant.name if state.tenant is not None else "this key"
            return state.reject(refusal(tenant, verdict), verdict.headers())
        state.lease = verdict.lease
        state.rate_headers = verdict.headers()
        return None

    def _reserve(self, state: RequestState) -> tuple[int, int]:
        """Tokens to hold: the input estimate and the predicted output (capped by max_tokens)."""
        facts = state.facts
        assert facts is not None
        if facts.embedding:
            return facts.input_tokens, 0
        key = (state.tenant.name if state.tenant else "", state.model.name if state.model else "")
        return facts.input_tokens, self.predictor.predict(key, facts.output_limit, facts.n)
