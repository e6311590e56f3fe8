"""extproc.body: bounded analysis of request bodies (no network)."""

from __future__ import annotations

import orjson
import pytest

from extproc.api import ApiError, Operation
from extproc.body import BodyLimits, analyze, check_structure

SERVED = {"llama": "llama", "gpt-4o-mini": "llama"}
HI = [{"role": "user", "content": "hi"}]
LIMITS = BodyLimits(max_depth=8, max_messages=4, max_tools=2, max_content_parts=3, max_prompts=3, max_values=50)


def _nested(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(("body", "param", "words"), [
    # The body itself is level 1, so a value under a key sits at level 2.
    ({"model": "llama", "messages": HI, "x": _nested(8)}, "x[0][0][0][0][0][0][0]", "nested more than 8"),
    ({"model": "llama", "messages": [{"role": "user", "content": "a", "meta": {"a": {"b": _nested(5)}}}]},
     "messages[0].meta.a.b[0][0][0]", "nested more than 8"),
    ({"model": "llama", "messages": HI * 5}, "messages", "Too many messages: 5"),
    ({"model": "llama", "messages": HI, "tools": [{}] * 3}, "tools", "Too many tools: 3"),
    ({"model": "llama", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 2}] * 2},
     "messages", "content parts"),
    ({"model": "llama", "prompt": ["a"] * 4}, "prompt", "entries in prompt"),
    ({"model": "llama", "messages": HI, "junk": list(range(60))}, "junk", "more than 50 JSON values"),
], ids=["depth", "depth-in-message", "messages", "tools", "parts", "prompts", "values"])
def test_structure_bounds_name_the_param(body: dict[str, object], param: str, words: str) -> None:
    with pytest.raises(ApiError) as refused:
        check_structure(body, LIMITS)
    assert refused.value.status == 400 and refused.value.code == "invalid_value"
    assert refused.value.param == param and words in refused.value.message


def test_structure_within_bounds_passes() -> None:
    check_structure({"model": "llama", "messages": HI * 4, "tools": [{}] * 2, "x": _nested(7)}, LIMITS)


def test_deep_nesting_is_a_400_before_validation_not_a_crash_in_the_rewrite() -> None:
    # 300 levels: past orjson's dumps limit (254), which once crashed the alias rewrite after admission.
    body = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}],"x":' + b"[" * 300 + b"]" * 300 + b"}"
    with pytest.raises(ApiError) as refused:
        analyze(Operation.CHAT, body, SERVED, BodyLimits())
    assert refused.value.status == 400 and refused.value.param is not None and refused.value.param.startswith("x[0]")


def test_facts_of_an_alias_stream_carry_the_rewritten_body() -> None:
    body = orjson.dumps({"model": "gpt-4o-mini", "messages": HI, "stream": True, "n": 2, "max_tokens": 9, "top_k": 3})
    analysis = analyze(Operation.CHAT, body, SERVED, BodyLimits())
    facts, new_body = analysis.facts, analysis.body
    read = (facts.model, facts.served, facts.stream, facts.n, facts.output_limit)
    assert read == ("gpt-4o-mini", "llama", True, 2, 9)
    assert facts.strip_usage and facts.input_tokens > 0 and not facts.embedding
    assert new_body is not None
    sent = orjson.loads(new_body)
    assert sent["model"] == "llama" and sent["stream_options"] == {"include_usage": True} and sent["top_k"] == 3


def test_canonical_plain_request_is_forwarded_unchanged() -> None:
    analysis = analyze(Operation.CHAT, orjson.dumps({"model": "llama", "messages": HI}), SERVED, BodyLimits())
    facts, new_body = analysis.facts, analysis.body
    assert new_body is None and facts.served == "llama" and not facts.strip_usage


def test_unknown_model_is_reported_not_rewritten() -> None:
    body = orjson.dumps({"model": "nope", "messages": HI, "stream": True})
    analysis = analyze(Operation.CHAT, body, SERVED, BodyLimits())
    facts, new_body = analysis.facts, analysis.body
    assert facts.served is None and new_body is None and not facts.strip_usage


def test_embeddings_facts() -> None:
    facts = analyze(Operation.EMBEDDINGS, orjson.dumps({"model": "llama", "input": ["a b", "c"]}), SERVED,
                    BodyLimits()).facts
    assert facts.embedding and facts.output_limit == 0 and facts.input_tokens > 0


@pytest.mark.parametrize(("body", "code"), [
    (b"{nope", "invalid_json"),
    (b"[1]", "invalid_json"),
    (b'{"messages": []}', "missing_required_parameter"),
    (b'{"model": "llama", "messages": [{"role": "user", "content": 3}]}', "invalid_type"),
], ids=["not-json", "not-object", "no-model", "bad-type"])
def test_bad_bodies_are_400s(body: bytes, code: str) -> None:
    with pytest.raises(ApiError) as refused:
        analyze(Operation.CHAT, body, SERVED, BodyLimits())
    assert refused.value.status == 400 and refused.value.code == code
