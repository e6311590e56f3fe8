"""Rule routing: the features a body has, the rule that matches it, and what the gateway then does."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import yaml

from extproc.config import ConfigError, hash_key, parse_config
from extproc.gateway import Gateway
from extproc.routing.explain import explain
from extproc.routing.features import PromptFeatures, extract, language_of
from extproc.routing.picker import Picker
from extproc.routing.rules import Match, Range, RouteContext, Rule, choose
from extproc.steps import Admit, Continue
from tests.helpers import post_headers

SYSTEM = {"role": "system", "content": "You are terse."}


def user(text: object) -> dict[str, object]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, object]:
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize(("body", "expected"), [
    pytest.param({"messages": [user("hi")]}, PromptFeatures(language="latin"), id="plain chat"),
    pytest.param({"messages": [SYSTEM, user("hi")], "temperature": 0.2},
                 PromptFeatures(temperature=0.2, system_prompt=True, language="latin"), id="system prompt"),
    pytest.param({"messages": [user("2+2"), assistant("4"), user("3+3"), assistant("6"), user("4+4")]},
                 PromptFeatures(few_shot=2, language=""), id="two few-shot pairs; digits are no letters"),
    pytest.param({"messages": [user("fix:\n```py\nx=1\n```")]}, PromptFeatures(code_blocks=True, language="latin"),
                 id="code block"),
    pytest.param({"messages": [user("answer in JSON please")]}, PromptFeatures(json_output=True, language="latin"),
                 id="json asked in words"),
    pytest.param({"messages": [user("x")], "response_format": {"type": "json_object"}},
                 PromptFeatures(response_format="json_object", json_output=True, language="latin"), id="json mode"),
    pytest.param({"messages": [user([{"type": "text", "text": "what is this"},
                                     {"type": "image_url", "image_url": {"url": "data:,"}}])]},
                 PromptFeatures(modalities=frozenset({"text", "image"}), language="latin"), id="image part"),
    pytest.param({"messages": [user("hi")], "tools": [{"type": "function", "function": {"name": "f"}}]},
                 PromptFeatures(tools=True, language="latin"), id="tools"),
    pytest.param({"prompt": "Once upon a time"}, PromptFeatures(language="latin"), id="completion prompt"),
])
def test_features(body: dict[str, object], expected: PromptFeatures) -> None:
    assert extract(body) == expected


@pytest.mark.parametrize(("text", "language"), [
    ("你好，世界", "zh"), ("こんにちは世界", "ja"), ("안녕하세요", "ko"), ("Привет, мир", "ru"),
    ("مرحبا", "ar"), ("नमस्ते", "hi"), ("Bonjour le monde", "latin"), ("12345", ""),
])
def test_language_is_the_script(text: str, language: str) -> None:
    assert language_of(text) == language


def ctx(model: str = "gpt-4o", **features: object) -> RouteContext:
    fields = {k: v for k, v in features.items() if k not in ("stream", "max_tokens", "input_tokens", "tags", "qos")}
    return RouteContext(model, PromptFeatures(**fields), stream=bool(features.get("stream", False)),  # type: ignore[arg-type]
                        max_tokens=features.get("max_tokens"), input_tokens=int(features.get("input_tokens", 0)),  # type: ignore[arg-type]
                        tenant_tags=dict(features.get("tags", {})), qos=str(features.get("qos", "")))  # type: ignore[arg-type]


RULES = (
    Rule("vision", Match(modalities=("image", "audio")), "vision-model", "vision"),
    Rule("long", Match(input_tokens=Range(min=8000)), "long-model", "long"),
    Rule("creative", Match(models=("gpt-4*",), temperature=Range(min=0.9)), "big-model", "big"),
    Rule("code", Match(code_blocks=True, language=("latin",)), "code-model", "code"),
    Rule("gold", Match(tenant_tags=(("tier", "gold"),), qos=("realtime",)), "big-model", "fast"),
)


@pytest.mark.parametrize(("context", "rule"), [
    pytest.param(ctx(modalities=frozenset({"text", "image"}), input_tokens=9000), "vision",
                 id="first match wins: an image before its length"),
    pytest.param(ctx(input_tokens=8000), "long", id="the range's bound is inclusive"),
    pytest.param(ctx(temperature=0.95), "creative", id="glob and temperature both hold"),
    pytest.param(ctx("llama", temperature=0.95), None, id="the glob does not hold: no rule"),
    pytest.param(ctx(temperature=None), None, id="no temperature sent is not in a closed range"),
    pytest.param(ctx(code_blocks=True, language="zh"), None, id="code, but not the language asked"),
    pytest.param(ctx(code_blocks=True, language="latin"), "code", id="code in Latin script"),
    pytest.param(ctx(tags={"tier": "gold"}, qos="realtime"), "gold", id="tenant tag and QoS class"),
    pytest.param(ctx(tags={"tier": "gold"}, qos="batch"), None, id="the tag without the class"),
])
def test_first_matching_rule(context: RouteContext, rule: str | None) -> None:
    chosen = choose(RULES, context).rule
    assert (chosen.name if chosen else None) == rule


BASE = {
    "pools": [{"name": "general", "endpoints": ["10.0.0.1:8000"]}, {"name": "long", "endpoints": ["10.0.2.1:8000"]}],
    "models": [{"name": "llama-3-8b-instruct", "pool": "general", "aliases": ["gpt-4o-mini"]},
               {"name": "llama-3-70b-long", "pool": "long"}],
    "tenants": [{"name": "gold", "keys": [{"sha256": hash_key("sk-gold").hex()}], "tags": {"tier": "gold"}}],
    "routes": [
        {"name": "auto-code", "match": {"models": ["auto"], "code_blocks": True}, "model": "llama-3-70b-long"},
        {"name": "auto", "match": {"models": ["auto"]}, "model": "llama-3-8b-instruct"},
        {"name": "long-prompts", "match": {"input_tokens": {"min": 200}}, "model": "llama-3-70b-long"},
        {"name": "gold-json", "match": {"tenant_tags": {"tier": "gold"}, "json_output": True},
         "model": "llama-3-8b-instruct", "pool": "long"},
    ],
}


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["routes"][0].update(model="nope"), "routes[0].model: 'nope' is not a model's name"),
    (lambda c: c["routes"][0].update(model="gpt-4o-mini"), "routes[0].model: 'gpt-4o-mini' is not a model's name"),
    (lambda c: c["routes"][3].update(pool="gpu"), "routes[3].pool: no pool named 'gpu'"),
    (lambda c: c["routes"][1]["match"].update(colour="red"), "routes[1].match.colour: unknown field"),
    (lambda c: c["routes"][1].update(name="auto-code"), "routes[1].name: duplicate name 'auto-code'"),
    (lambda c: c["routes"][1]["match"].update(modalities=["video"]),
     "routes[1].match.modalities[0]: Input should be 'image' or 'audio'"),
], ids=["unknown model", "alias", "unknown pool", "unknown condition", "duplicate", "unknown modality"])
def test_route_config_errors_name_the_field(change, message: str) -> None:
    document = json.loads(json.dumps(BASE))
    change(document)
    with pytest.raises(ConfigError) as caught:
        parse_config(document, env={})
    assert message in str(caught.value)


@pytest.fixture
def gateway() -> Gateway:
    return Gateway(parse_config(BASE, env={}), Picker(random.Random(0)))


def route(gateway: Gateway, body: dict[str, object], key: str = "sk-gold") -> Continue:
    state = gateway.new_request()
    assert isinstance(gateway.request_headers(state, post_headers(authorization=f"Bearer {key}"), False), Continue)
    decision = gateway.request_body(state, orjson.dumps(body))
    assert isinstance(decision, Continue) and not isinstance(decision, Admit), decision
    return decision


@pytest.mark.parametrize(("body", "rule", "model", "pool"), [
    pytest.param({"model": "auto", "messages": [user("hi")]}, "auto", "llama-3-8b-instruct", "general",
                 id="auto: the default intent"),
    pytest.param({"model": "auto", "messages": [user("```\nx\n```")]}, "auto-code", "llama-3-70b-long", "long",
                 id="auto with code"),
    pytest.param({"model": "gpt-4o-mini", "messages": [user("word " * 400)]}, "long-prompts", "llama-3-70b-long",
                 "long", id="a long prompt leaves its alias's pool"),
    pytest.param({"model": "gpt-4o-mini", "messages": [user("reply as JSON")]}, "gold-json",
                 "llama-3-8b-instruct", "long", id="the tenant's tag: same model, another pool"),
    pytest.param({"model": "gpt-4o-mini", "messages": [user("hi")]}, "model", "llama-3-8b-instruct", "general",
                 id="no rule: the alias's own model and pool"),
])
def test_the_gateway_routes_by_rule(gateway: Gateway, body: dict[str, object], rule: str, model: str,
                                    pool: str) -> None:
    decision = route(gateway, body)
    headers = dict(decision.set_headers)
    assert headers["x-llmgw-decision"] == f"rule={rule}; model={model}; pool={pool}"
    assert (headers["x-llmgw-model"], headers["x-llmgw-pool"]) == (model, pool)
    assert headers["x-gateway-destination-endpoint"] == {"general": "10.0.0.1:8000", "long": "10.0.2.1:8000"}[pool]
    sent = orjson.loads(decision.body) if decision.body is not None else body
    assert sent["model"] == model  # the pod is asked for the model it serves
    (_, carried), = decision.metadata
    metadata = orjson.loads(carried["decision"])
    assert (metadata["rule"], metadata["served_model"], metadata["pool"], metadata["model"]) == (
        rule, model, pool, body["model"])


def test_an_unknown_model_no_rule_takes_is_still_404() -> None:
    document = {**BASE, "routes": BASE["routes"][:1]}
    gateway = Gateway(parse_config(document, env={}), Picker())
    state = gateway.new_request()
    gateway.request_headers(state, post_headers(authorization="Bearer sk-gold"), False)
    reply = gateway.request_body(state, orjson.dumps({"model": "auto", "messages": [user("plain")]}))
    assert reply.status == 404  # type: ignore[union-attr]


def test_explain_lists_every_rule_tried_and_why() -> None:
    config = parse_config(BASE, env={})
    result = explain(config, orjson.dumps({"model": "gpt-4o-mini", "messages": [user("reply as JSON")]}),
                     tenant="gold")
    assert [r["rule"] for r in result["rules"]] == ["auto-code", "auto", "long-prompts", "gold-json"]
    assert [r["matched"] for r in result["rules"]] == [False, False, False, True]
    first = result["rules"][0]["conditions"][0]
    assert first == {"condition": "models", "holds": False, "request": "gpt-4o-mini"}
    assert result["decision"] == {"model": "llama-3-8b-instruct", "pool": "long", "rule": "gold-json",
                                  "intent": None, "score": None, "why": "rule 'gold-json' matched"}
    assert result["intents"] is None
    assert result["features"]["json_output"] is True and result["features"]["tenant_tags"] == {"tier": "gold"}


def test_llmgw_route_explain_command(tmp_path: Path) -> None:
    config = tmp_path / "llmgw.yaml"
    config.write_text(yaml.safe_dump(BASE))
    request = tmp_path / "request.json"
    request.write_bytes(orjson.dumps({"model": "auto", "messages": [user("```\nprint(1)\n```")]}))
    result = subprocess.run([sys.executable, "-m", "extproc.cli", "route", "--explain", str(request), "--config",
                             str(config), "--format", "json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["decision"]["rule"] == "auto-code"
    table = subprocess.run([sys.executable, "-m", "extproc.cli", "route", "--explain", str(request), "--config",
                            str(config)], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "model llama-3-70b-long in pool long" in table.stdout


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": [None], "input": [[]]},
    {"model": "m", "messages": [1, "x", {"role": 3, "content": {"a": 1}}], "input": "x"},
    {"model": "m", "prompt": [1, None, "x"], "response_format": {"type": 7}},
], ids=["null message", "odd messages", "odd prompt"])
def test_features_of_fields_no_schema_checked(body: dict[str, object]) -> None:
    extract(body)  # an embedding request's unvalidated fields never crash the gateway
