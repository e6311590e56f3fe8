"""API keys: tenants by key hash, 401s, and revocation by config reload."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from pathlib import Path
from types import MappingProxyType

import orjson
import pytest
import yaml

from extproc.app import watch_config
from extproc.auth import presented_key
from extproc.config import hash_key, load_config, parse_config
from extproc.gateway import Gateway
from extproc.keys import KeySnapshot
from extproc.routing.picker import Picker
from extproc.steps import Continue, Reply
from tests.helpers import CONFIG, eventually, post_headers

KEY_A, KEY_B = "sk-team-a", "sk-team-b"
WITH_TENANTS = {
    **CONFIG,
    "tenants": [
        {"name": "team-a", "keys": [{"sha256": hash_key(KEY_A).hex()}], "qos": ["standard", "batch"],
         "tags": {"cost-center": "42"}},
        {"name": "team-b", "keys": [{"env": "TEAM_B_KEY"}]},
    ],
}
CHAT = b'{"model": "llama-3-8b-instruct", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture
def gateway() -> Gateway:
    config = parse_config(WITH_TENANTS, env={"POOL_KEY": "p", "TEAM_B_KEY": KEY_B})
    return Gateway(config, Picker(random.Random(0)))


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"authorization": "Bearer sk-1"}, "sk-1"),
        ({"authorization": "bearer  sk-1 "}, "sk-1"),  # scheme is case-insensitive; spaces trimmed
        ({"authorization": "Basic abc"}, None),  # not a bearer token
        ({"authorization": "Bearer "}, None),  # empty token
        ({"api-key": "sk-azure"}, "sk-azure"),  # Azure OpenAI's header
        ({"x-api-key": "sk-x"}, "sk-x"),
        ({}, None),
    ],
)
def test_presented_key(headers: dict[str, str], key: str | None) -> None:
    assert presented_key(headers) == key


@pytest.mark.parametrize(
    ("key", "tenant"),
    [(KEY_A, "team-a"), (KEY_B, "team-b"), ("sk-unknown", None)],
)
def test_keys_resolve_to_tenants(gateway: Gateway, key: str, tenant: str | None) -> None:
    state = gateway.new_request()
    decision = gateway.request_headers(state, post_headers(authorization=f"Bearer {key}"), False)
    if tenant is None:
        assert isinstance(decision, Reply) and decision.status == 401
        assert orjson.loads(decision.body)["error"]["code"] == "invalid_api_key"
        assert key not in decision.body.decode()  # the key is never echoed
    else:
        assert isinstance(decision, Continue) and state.tenant is not None and state.tenant.name == tenant


def test_tenant_header_goes_to_the_pod(gateway: Gateway) -> None:
    state = gateway.new_request()
    gateway.request_headers(state, post_headers(authorization=f"Bearer {KEY_A}"), False)
    decision = gateway.request_body(state, CHAT)
    assert isinstance(decision, Continue) and dict(decision.set_headers)["x-llmgw-tenant"] == "team-a"


def test_models_list_needs_a_key(gateway: Gateway) -> None:
    reply = gateway.request_headers(gateway.new_request(), {":method": "GET", ":path": "/v1/models"}, True)
    assert isinstance(reply, Reply) and reply.status == 401
    ok = gateway.request_headers(gateway.new_request(), {":method": "GET", ":path": "/v1/models",
                                                         "x-api-key": KEY_A}, True)
    assert isinstance(ok, Reply) and ok.status == 200


def test_unknown_path_is_404_before_auth(gateway: Gateway) -> None:
    reply = gateway.request_headers(gateway.new_request(), {":method": "POST", ":path": "/v2/x"}, False)
    assert isinstance(reply, Reply) and reply.status == 404


def test_keys_are_never_in_the_config_repr() -> None:
    config = parse_config(WITH_TENANTS, env={"POOL_KEY": "p", "TEAM_B_KEY": KEY_B})
    assert KEY_B not in repr(config) and hash_key(KEY_B).hex() not in repr(config)


def test_same_key_for_two_tenants_is_an_error() -> None:
    document = {**WITH_TENANTS, "tenants": [*WITH_TENANTS["tenants"],
                                            {"name": "team-c", "keys": [{"env": "TEAM_B_KEY"}]}]}
    with pytest.raises(ValueError, match=r"tenants\[2\]\.keys\[0\]: the same key is already given to tenant 'team-b'"):
        parse_config(document, env={"POOL_KEY": "p", "TEAM_B_KEY": KEY_B})


async def test_revoked_key_stops_working_after_reload(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "llmgw.yaml"
    path.write_text(yaml.safe_dump(WITH_TENANTS))
    os.environ["TEAM_B_KEY"], os.environ["POOL_KEY"] = KEY_B, "p"
    gateway = Gateway(load_config(path), Picker())
    watcher = asyncio.create_task(watch_config(path, gateway, interval=0.02))
    try:
        revoked = {**WITH_TENANTS, "tenants": WITH_TENANTS["tenants"][1:]}  # team-a's key is gone
        await asyncio.sleep(0)  # one turn of the loop, not a wait: the watcher's first step reads the mtime
        path.write_text(yaml.safe_dump(revoked))
        os.utime(path, ns=(1, 10**18))  # a distinct mtime even on coarse clocks
        await eventually(lambda: gateway.config.tenant_for(hash_key(KEY_A)) is None, 2, what="the reload")
        before = gateway.config
        with caplog.at_level(logging.ERROR, logger="llmgw.extproc"):
            path.write_text("pools: [")  # broken YAML: refused, the running config stays
            os.utime(path, ns=(2, 2 * 10**18))
            await eventually(lambda: "config reload refused" in caplog.text, 2, what="the refusal")
        assert gateway.config is before
    finally:
        watcher.cancel()
        del os.environ["TEAM_B_KEY"], os.environ["POOL_KEY"]


def test_a_key_is_not_called_wrong_while_the_redis_key_table_is_not_loaded() -> None:
    # A worker serving without Redis's table (not loaded at start, or past keys.max_stale_s) cannot
    # tell an unknown key from one stored there: a retryable 503, not a 401. No key at all: a 401.
    config = parse_config({**WITH_TENANTS, "redis_url": "redis://127.0.0.1:1/0"},
                          env={"POOL_KEY": "p", "TEAM_B_KEY": KEY_B})
    gateway = Gateway(config, Picker(random.Random(0)))
    unknown = gateway.request_headers(gateway.new_request(), post_headers(authorization="Bearer sk-redis"), False)
    assert isinstance(unknown, Reply) and unknown.status == 503
    assert orjson.loads(unknown.body)["error"]["code"] == "keys_unavailable"
    assert ("retry-after", "1") in unknown.headers
    missing = gateway.request_headers(gateway.new_request(), post_headers(), False)
    assert isinstance(missing, Reply) and missing.status == 401
    known = gateway.request_headers(gateway.new_request(), post_headers(authorization=f"Bearer {KEY_A}"), False)
    assert isinstance(known, Continue)  # the config's own keys need no Redis
    gateway.set_redis_keys(KeySnapshot(MappingProxyType({hash_key("sk-redis"): "team-a"}), 3))
    assert isinstance(gateway.request_headers(gateway.new_request(), post_headers(authorization="Bearer sk-redis"),
                                              False), Continue)
    wrong = gateway.request_headers(gateway.new_request(), post_headers(authorization="Bearer sk-wrong"), False)
    assert isinstance(wrong, Reply) and wrong.status == 401  # loaded: an unknown key is wrong
