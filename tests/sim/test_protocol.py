"""Request-body validation (400s name the parameter) and prompt shapes."""

from __future__ import annotations

import pytest

from llmgw_sim.protocol import InvalidRequest, TextPrompt, TokenPrompt, parse_generation

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        pytest.param("a", [TextPrompt("a")], id="string"),
        pytest.param(["a", "b"], [TextPrompt("a"), TextPrompt("b")], id="list of strings"),
        pytest.param([1, 2, 3], [TokenPrompt([1, 2, 3])], id="token ids"),
        pytest.param([[1], [2, 3]], [TokenPrompt([1]), TokenPrompt([2, 3])], id="list of token-id lists"),
    ],
)
def test_completion_prompt_shapes(prompt: object, expected: list[object]) -> None:
    assert parse_generation("completion", {"prompt": prompt}).prompts == expected


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        pytest.param("chat", [], None, id="body not an object"),
        pytest.param("chat", {}, "messages", id="no messages"),
        pytest.param("completion", {}, "prompt", id="no prompt"),
        pytest.param("completion", {"prompt": []}, "prompt", id="empty prompt list"),
        pytest.param("completion", {"prompt": ["a", 1]}, "prompt", id="mixed prompt list"),
        pytest.param("chat", {**CHAT, "max_tokens": 0}, "max_tokens", id="max_tokens below 1"),
        pytest.param("chat", {**CHAT, "max_completion_tokens": "5"}, "max_completion_tokens",
                     id="max_completion_tokens not int"),
        pytest.param("chat", {**CHAT, "n": 0}, "n", id="n below 1"),
        pytest.param("chat", {**CHAT, "n": True}, "n", id="bool is not an int"),
        pytest.param("chat", {**CHAT, "temperature": -0.5}, "temperature", id="negative temperature"),
        pytest.param("chat", {**CHAT, "stop": [1]}, "stop", id="stop not strings"),
        pytest.param("chat", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options",
                     id="stream_options without stream"),
        pytest.param("chat", {**CHAT, "model": 5}, "model", id="model not a string"),
    ],
)
def test_invalid_bodies(endpoint: str, body: object, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_generation(endpoint, body)  # type: ignore[arg-type]
    assert err.value.param == param


def test_max_completion_tokens_wins() -> None:
    parsed = parse_generation("chat", {**CHAT, "max_tokens": 10, "max_completion_tokens": 3})
    assert parsed.max_tokens == 3  # OpenAI: max_tokens is deprecated in favour of it


def test_defaults() -> None:
    parsed = parse_generation("chat", CHAT)
    assert (parsed.n, parsed.max_tokens, parsed.temperature, parsed.stream, parsed.stop) == (
        1, None, 1.0, False, ())


def test_stop_string_becomes_tuple_and_drops_empties() -> None:
    assert parse_generation("chat", {**CHAT, "stop": "x"}).stop == ("x",)
    assert parse_generation("chat", {**CHAT, "stop": ["", "y"]}).stop == ("y",)
