"""The resolution stage on its own: the served model, breakers and fallback chains, degradation
and shedding, and the spare model Envoy's last attempt goes to."""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson
import pytest

from extproc.api import Operation
from extproc.body import BodyLimits, analyze
from extproc.config import GatewayConfig, Pool, parse_config
from extproc.routing.picker import Picker
from extproc.routing.router import Router
from extproc.stages.resolution import Resolution, Unavailable, pool_load, shed
from extproc.state import RequestState, new_state
from extproc.steps import Reply

DOCUMENT = {
    "pools": [{"name": "big", "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]},
              {"name": "small", "endpoints": ["10.0.1.1:8000"]}],
    "models": [{"name": "big-model", "pool": "big", "fallback": ["small-model"]},
               {"name": "small-model", "pool": "small"}],
    "breakers": {"min_requests": 2, "open_s": 30},
}


@dataclass(frozen=True)
class Pod:
    running: float = 0.0
    waiting: float = 0.0


class States:
    def __init__(self, pods: dict[str, Pod]) -> None:
        self.pods = pods

    def get(self, endpoint: str) -> Pod | None:
        return self.pods.get(endpoint)


def _resolution(document: dict, pods: dict[str, Pod] | None = None) -> Resolution:
    config = parse_config(document, env={})
    router = Router(Picker(random.Random(0), States(pods or {})))  # type: ignore[arg-type]
    router.configure(config)
    return Resolution(config, router)


def _state(config: GatewayConfig, model: str, qos: str = "") -> RequestState:
    state = new_state("1")
    state.operation, state.qos = Operation.CHAT, qos
    state.body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    served = {name: m.name for name, m in config.models_by_name.items()}
    analysis = analyze(Operation.CHAT, state.body, served, BodyLimits())
    state.facts, state.new_body = analysis.facts, analysis.body
    return state


def _open(resolution: Resolution, pool: str) -> None:
    breakers = resolution.router.breakers
    for _ in range(2):
        breakers.record(pool, "", True, 0.0)
    breakers.pool(pool).opened_at = 1e18  # open for good, whatever the clock says


def test_the_model_and_its_own_pool_with_its_fallback_as_the_spare() -> None:
    resolution = _resolution(DOCUMENT)
    state = _state(resolution.config, "big-model")
    assert resolution.resolve(state) is None
    assert state.model is not None and state.model.name == "big-model" and state.pool is not None
    assert state.pool.name == "big"
    assert state.spare is not None and state.spare[0].name == "small-model"


def test_an_unknown_model_is_a_404() -> None:
    resolution = _resolution(DOCUMENT)
    reply = resolution.resolve(_state(resolution.config, "nope"))
    assert isinstance(reply, Reply) and reply.status == 404


def test_an_open_pool_hands_the_request_down_its_fallback_chain_with_the_body_rewritten() -> None:
    resolution = _resolution(DOCUMENT)
    _open(resolution, "big")
    state = _state(resolution.config, "big-model")
    assert resolution.resolve(state) is None
    assert state.model is not None and state.model.name == "small-model" and state.fallback_from == "big-model"
    assert state.new_body is not None and orjson.loads(state.new_body)["model"] == "small-model"
    assert state.spare is None  # the chain is spent


def test_no_pool_left_is_unavailable_then_a_503_with_the_time_until_a_probe() -> None:
    resolution = _resolution(DOCUMENT)
    _open(resolution, "big")
    _open(resolution, "small")
    state = _state(resolution.config, "big-model")
    unavailable = resolution.resolve(state)
    assert isinstance(unavailable, Unavailable) and unavailable.pool.name == "big"
    reply = resolution.no_pool(state, unavailable.pool)
    assert reply.status == 503 and int(dict(reply.headers)["retry-after"]) >= 1
    assert orjson.loads(reply.body)["error"]["code"] == "pool_unavailable"


def test_breakers_off_never_divert() -> None:
    resolution = _resolution({**DOCUMENT, "breakers": {"enabled": False}})
    _open(resolution, "big")
    state = _state(resolution.config, "big-model")
    assert resolution.resolve(state) is None and state.pool is not None and state.pool.name == "big"


DEGRADING = {**DOCUMENT, "pools": [
    {"name": "big", "endpoints": ["10.0.0.1:8000"],
     "degrade": {"max_concurrent": 10, "share": {"batch": 0.5, "default": 1.0}, "action": {"batch": "fallback"}}},
    {"name": "small", "endpoints": ["10.0.1.1:8000"]}]}


def test_a_loaded_pool_sends_the_class_that_gives_way_to_the_fallback_and_keeps_the_others() -> None:
    resolution = _resolution(DEGRADING, {"10.0.0.1:8000": Pod(running=4, waiting=2)})  # load 6 of 10
    batch = _state(resolution.config, "big-model", qos="batch")
    assert resolution.resolve(batch) is None and batch.pool is not None and batch.pool.name == "small"
    default = _state(resolution.config, "big-model")
    assert resolution.resolve(default) is None and default.pool is not None and default.pool.name == "big"


def test_a_loaded_pool_refuses_the_class_that_gives_way_without_a_fallback() -> None:
    document = {**DEGRADING, "pools": [{**DEGRADING["pools"][0], "degrade": {"max_concurrent": 10}},
                                       DEGRADING["pools"][1]]}
    resolution = _resolution(document, {"10.0.0.1:8000": Pod(running=9)})
    reply = resolution.resolve(_state(resolution.config, "big-model", qos="batch"))
    assert isinstance(reply, Reply) and reply.status == 429
    assert orjson.loads(reply.body)["error"]["code"] == "pool_overloaded"


def test_pool_load_counts_known_pods_only() -> None:
    pool = Pool("p", ("a:1", "b:1"))
    assert pool_load(States({}), pool) is None  # type: ignore[arg-type]
    assert pool_load(States({"a:1": Pod(running=2, waiting=3)}), pool) == 5  # type: ignore[arg-type]


SHED_POOL = Pool("gpu", ("a:1", "b:1", "c:1"), shed=(("batch", 2.0), ("default", 8.0), ("realtime", 32.0)))


@pytest.mark.parametrize(("waiting", "refused"), [
    (1.0, set()),
    (4.0, {"batch"}),
    (12.0, {"batch", "balanced", ""}),
    (40.0, {"batch", "balanced", "", "realtime"}),
])
def test_shedding_refuses_batch_first_then_the_default_class_then_realtime(waiting: float, refused: set[str]) -> None:
    states = States({pod: Pod(waiting=waiting) for pod in SHED_POOL.endpoints})
    refusing = {qos for qos in ("batch", "balanced", "", "realtime")
                if shed(states, SHED_POOL, qos) is not None}  # type: ignore[arg-type]
    assert refusing == refused


def test_shedding_uses_known_pods_only_and_sheds_nothing_when_none_is_known() -> None:
    states = States({"a:1": Pod(waiting=10)})  # b, c unknown: mean over a alone
    assert shed(states, SHED_POOL, "batch") is not None  # type: ignore[arg-type]
    assert shed(States({}), SHED_POOL, "batch") is None  # type: ignore[arg-type]
    assert shed(states, Pool("free", SHED_POOL.endpoints), "batch") is None  # type: ignore[arg-type]
