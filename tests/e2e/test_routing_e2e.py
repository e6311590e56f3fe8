"""End to end: routing rules through Envoy, with the official openai client. The decision comes
back in x-llmgw-pool and x-llmgw-decision, and the pod of the rule's pool serves the request."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from extproc.launcher import StackInfo
from tests.e2e.conftest import MODEL, small_stack

LONG_MODEL = "llama-3-long"
RULES = {
    "pools": [{"name": "local", "simulate": 1}, {"name": "long", "simulate": 1}],
    "models": [{"name": MODEL, "pool": "local"}, {"name": LONG_MODEL, "pool": "long"}],
    "routes": [
        {"name": "auto-code", "match": {"models": ["auto"], "code_blocks": True}, "model": LONG_MODEL},
        {"name": "auto", "match": {"models": ["auto"]}, "model": MODEL},
        {"name": "long-prompts", "match": {"input_tokens": {"min": 300}}, "model": LONG_MODEL},
    ],
}


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    # small_stack writes pools and models itself; the rule set replaces them.
    with small_stack(tmp_path_factory, "routed", pods=1, extra_config=RULES, sim_args=("--record", "50")) as info:
        yield info


def _served_by(info: StackInfo, pool: str, request_id: str) -> bool:
    for url in info.pod_urls[pool]:
        for seen in httpx.get(f"{url}/debug/requests").json()["requests"]:
            if {k.lower(): v for k, v in seen["headers"].items()}.get("x-request-id") == request_id:
                return True
    return False


@pytest.mark.parametrize(("model", "prompt", "rule", "served", "pool"), [
    pytest.param("auto", "Say hi.", "auto", MODEL, "local", id="auto"),
    pytest.param("auto", "Fix this:\n```py\nprint(1\n```", "auto-code", LONG_MODEL, "long", id="auto with code"),
    pytest.param(MODEL, "word " * 400, "long-prompts", LONG_MODEL, "long", id="a long prompt"),
    pytest.param(MODEL, "Say hi.", "model", MODEL, "local", id="no rule"),
])
def test_rules_route_through_envoy(routed: StackInfo, model: str, prompt: str, rule: str, served: str,
                                   pool: str) -> None:
    client = openai.OpenAI(base_url=f"{routed.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    request_id = f"route-{uuid.uuid4()}"
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=3,
        extra_headers={"x-request-id": request_id})
    completion = raw.parse()
    assert completion.model == served  # the pod served the rule's model
    assert raw.headers["x-llmgw-pool"] == pool
    assert raw.headers["x-llmgw-decision"] == f"rule={rule}; model={served}; pool={pool}"
    assert _served_by(routed, pool, request_id)


CODER = "qwen-coder"
INTENTS = {
    "pools": [{"name": "local", "simulate": 1}, {"name": "code", "simulate": 1}],
    "models": [{"name": MODEL, "pool": "local"}, {"name": CODER, "pool": "code"}],
    "routes": [{"name": "support-tier", "match": {"models": ["support"]}, "model": MODEL, "intents": True}],
    "intents": {
        "embedder": {"kind": "hashing"},
        "default": {"model": MODEL},
        "routes": [
            {"name": "code", "model": CODER, "examples": [
                "fix the bug in my python function", "write a python function that parses json",
                "why does my javascript code throw a type error", "refactor this java class"]},
            {"name": "chat", "model": MODEL, "examples": [
                "tell me a joke about cats", "what should i cook for dinner tonight",
                "recommend a good novel to read this summer"]},
        ],
    },
}


@pytest.fixture(scope="module")
def semantic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    with small_stack(tmp_path_factory, "intents", pods=1, extra_config=INTENTS, sim_args=("--record", "50")) as info:
        yield info


@pytest.mark.parametrize(("model", "prompt", "rule", "intent", "served", "pool"), [
    pytest.param("auto", "please fix the bug in this python function", "intents", "code", CODER, "code",
                 id="auto, code"),
    pytest.param("auto", "tell me a joke about dogs", "intents", "chat", MODEL, "local", id="auto, chat"),
    pytest.param("auto", "zzz qqq", "intents", "default", MODEL, "local", id="auto, no intent"),
    pytest.param("support", "my javascript code throws a type error", "support-tier", "code", CODER, "code",
                 id="a rule asking for intents"),
])
def test_semantic_routing_through_envoy(semantic: StackInfo, model: str, prompt: str, rule: str, intent: str,
                                        served: str, pool: str) -> None:
    client = openai.OpenAI(base_url=f"{semantic.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    request_id = f"intent-{uuid.uuid4()}"
    for stream in (False, True):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}],
            max_tokens=3, stream=stream, extra_headers={"x-request-id": f"{request_id}-{stream}"})
        if stream:
            chunks = list(raw.parse())
            assert chunks and all(chunk.model == served for chunk in chunks)
        else:
            assert raw.parse().model == served  # the pod got the chosen model in the body
        decision = dict(part.split("=", 1) for part in raw.headers["x-llmgw-decision"].split("; "))
        chosen = (decision["rule"], decision["intent"], decision["model"], decision["pool"])
        assert chosen == (rule, intent, served, pool)
        assert -1.0 <= float(decision["score"]) <= 1.0
        assert _served_by(semantic, pool, f"{request_id}-{stream}")
