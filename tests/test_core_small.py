"""Small pure pieces: trace context, endpoint picker, phase table, usage extraction, config errors."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from extproc.config import ConfigError, parse_config
from extproc.phases import Phase, ProtocolError, Stage, advance, check
from extproc.routing.picker import Picker
from extproc.telemetry.tracecontext import continue_or_start, request_id
from tests.helpers import CONFIG


@pytest.mark.parametrize(
    ("header", "continued"),
    [
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", True),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", True),  # unsampled is still valid
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", True),  # future version: extra ok
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", False),  # v00 has four fields
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),  # version ff is invalid
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),  # all-zero trace id
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),  # all-zero parent id
        ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", False),  # upper case is invalid
        ("garbage", False),
        (None, False),
    ],
)
def test_traceparent(header: str | None, continued: bool) -> None:
    trace = continue_or_start(header)
    assert (trace.parent_span_id is not None) is continued
    if continued:
        assert trace.trace_id == header.split("-")[1]  # type: ignore[union-attr]
    assert len(trace.traceparent.split("-")) == 4


def test_generated_request_id_is_a_uuid() -> None:
    generated = request_id(None)
    assert len(generated) == 36 and generated[14] == "4"


def test_picker_ties_are_random_but_balanced() -> None:
    picker = Picker(random.Random(7))
    endpoints = ("a:1", "b:1", "c:1")
    picks = Counter(picker.pick(endpoints) for _ in range(30))
    assert picks == {"a:1": 10, "b:1": 10, "c:1": 10}  # never more than one apart while nothing ends
    for endpoint in endpoints:
        picker.release(endpoint)
    assert picker.in_flight("a:1") == 9


@pytest.mark.parametrize(
    ("stage", "phase", "allowed"),
    [
        (Stage.START, Phase.REQUEST_HEADERS, True),
        (Stage.START, Phase.REQUEST_BODY, False),  # body before headers
        (Stage.AWAIT_BODY, Phase.REQUEST_HEADERS, False),  # headers twice
        (Stage.AWAIT_BODY, Phase.REQUEST_BODY, True),
        (Stage.AWAIT_BODY, Phase.REQUEST_TRAILERS, True),  # trailers, no body: the gateway refuses it
        (Stage.AWAIT_TRAILERS, Phase.REQUEST_BODY, False),  # BUFFERED sends the body once
        (Stage.AWAIT_TRAILERS, Phase.REQUEST_TRAILERS, True),
        (Stage.ANSWERED, Phase.REQUEST_BODY, False),  # nothing after an ImmediateResponse
        (Stage.FORWARDED, Phase.RESPONSE_HEADERS, True),  # an operator may turn response phases on
        (Stage.FORWARDED, Phase.REQUEST_BODY, False),
    ],
)
def test_phase_table(stage: Stage, phase: Phase, allowed: bool) -> None:
    if allowed:
        check(stage, phase)
    else:
        with pytest.raises(ProtocolError):
            check(stage, phase)


def test_advance() -> None:
    assert advance(Stage.START, Phase.REQUEST_HEADERS, answered=False, end_of_stream=False) is Stage.AWAIT_BODY
    assert advance(Stage.START, Phase.REQUEST_HEADERS, answered=True, end_of_stream=False) is Stage.ANSWERED
    assert advance(Stage.AWAIT_BODY, Phase.REQUEST_BODY, answered=False, end_of_stream=True) is Stage.FORWARDED
    assert advance(Stage.AWAIT_BODY, Phase.REQUEST_BODY, answered=False, end_of_stream=False) is Stage.AWAIT_TRAILERS


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["pools"][0].update(endpoints=["nohost"]), "pools[0].endpoints[0]: 'nohost' is not IP:port"),
        (lambda c: c["pools"][0].update(endpoints=["10.0.0.1:80", "vllm-0.svc:8000"]),
         "pools[0].endpoints[1]: 'vllm-0.svc:8000': use the pod's IP address"),
        (lambda c: c["pools"][0].update(colour="red"), "pools[0].colour: unknown field"),
        (lambda c: c["models"][1].update(pool="gpu"), "models[1].pool: no pool named 'gpu'"),
        (lambda c: c["models"][1].update(aliases=["gpt-4o-mini"]), "models[1].aliases[0]: 'gpt-4o-mini' is already"),
        (lambda c: c["server"].update(max_body_bytes=-1), "server.max_body_bytes: Input should be greater than 0"),
        (lambda c: c.update(pools=[*c["pools"], dict(c["pools"][0])]), "pools[2].name: duplicate name 'general'"),
        (lambda c: c.update(tenants=[{"name": "t", "keys": [{"env": "POOL_KEY"}], "qos": ["batch"],
                                      "qos_limits": {"gold": {"rpm": 1}}}]),
         "tenants[0]: qos_limits.gold: not one of this tenant's qos classes ['batch']"),
        (lambda c: c.update(tenants=[{"name": "t", "keys": [{"env": "POOL_KEY"}], "budget": {"daily_usd": -1}}]),
         "tenants[0].budget.daily_usd: Input should be greater than or equal to 0"),
        (lambda c: c.update(tenants=[{"name": "t", "keys": [{"env": "POOL_KEY"}], "budget": {"weekly_usd": 1}}]),
         "tenants[0].budget.weekly_usd: unknown field"),
        (lambda c: c.update(tenants=[{"name": "t"}]), "tenants[0].keys: empty, and no redis_url"),
        (lambda c: c.update(keys={"poll_s": 0}), "keys.poll_s: Input should be greater than 0"),
    ],
    ids=["endpoint", "hostname", "unknown-field", "unknown-pool", "duplicate-alias", "negative-limit", "duplicate-pool",
         "qos-limits-unknown-class", "negative-budget", "unknown-budget-period", "no-keys-anywhere", "zero-poll"],
)
def test_config_errors_name_the_field(change, message: str) -> None:
    import copy

    document = copy.deepcopy(CONFIG)
    change(document)
    with pytest.raises(ConfigError) as caught:
        parse_config(document, env={"POOL_KEY": "k"})
    assert message in str(caught.value)


def test_missing_credential_env_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"pools\[1\]\.credential\.env: environment variable POOL_KEY is not set"):
        parse_config(CONFIG, env={})


def test_credential_is_not_in_repr() -> None:
    config = parse_config(CONFIG, env={"POOL_KEY": "sk-very-secret"})
    assert "sk-very-secret" not in repr(config)
