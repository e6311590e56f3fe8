"""The ChatML template and its multimodal placeholders."""

from __future__ import annotations

import pytest

from llmgw_sim.template import (
    AUDIO_PLACEHOLDER_TOKENS,
    IMAGE_PLACEHOLDER_TOKENS,
    Placeholder,
    TemplateError,
    render_chat,
)
from llmgw_sim.tokens import SimTokenizer


def test_renders_chatml_with_generation_prompt() -> None:
    segments = render_chat([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi"}])
    assert segments == ["<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


def test_text_parts_concatenate_like_a_string() -> None:
    parts = render_chat([{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                                      {"type": "text", "text": "lo"}]}])
    assert parts == render_chat([{"role": "user", "content": "Hello"}])


def test_media_become_placeholders(sim_tokenizer: SimTokenizer) -> None:
    text_only = [{"role": "user", "content": "Describe"}]
    with_media = [{"role": "user", "content": [
        {"type": "text", "text": "Describe"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ]}]
    segments = render_chat(with_media)
    kinds = [s.kind for s in segments if isinstance(s, Placeholder)]
    assert kinds == ["image", "audio"]
    base = len(sim_tokenizer.encode_segments(render_chat(text_only)))
    total = len(sim_tokenizer.encode_segments(segments))
    # the text splits at the media, so allow the boundary to shift by a token
    assert abs(total - base - IMAGE_PLACEHOLDER_TOKENS - AUDIO_PLACEHOLDER_TOKENS) <= 1


def test_different_images_get_different_placeholder_ids(sim_tokenizer: SimTokenizer) -> None:
    def ids(url: str) -> list[int]:
        return sim_tokenizer.encode_segments(render_chat(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]))
    assert ids("a") != ids("b")  # no false prefix-cache sharing between images
    assert ids("a") == ids("a")


def test_tools_and_tool_calls_count() -> None:
    plain = render_chat([{"role": "user", "content": "x"}])
    tools = render_chat([{"role": "user", "content": "x"}],
                        tools=[{"type": "function", "function": {"name": "f"}}])
    assert len(tools[0]) > len(plain[0])
    call = render_chat([{"role": "assistant", "content": None,
                         "tool_calls": [{"id": "1", "type": "function",
                                         "function": {"name": "f", "arguments": "{}"}}]}])
    assert '"name":"f"' in call[0]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        pytest.param([], "messages", id="empty list"),
        pytest.param("hi", "messages", id="not a list"),
        pytest.param([{"content": "x"}], "messages[0].role", id="missing role"),
        pytest.param([{"role": "user", "content": 3}], "messages[0].content", id="content not str/list"),
        pytest.param([{"role": "user", "content": [{"type": "video"}]}], "messages[0].content[0].type",
                     id="unknown part type"),
        pytest.param([{"role": "user", "content": [{"type": "image_url"}]}],
                     "messages[0].content[0].image_url", id="image without url"),
    ],
)
def test_invalid_messages_name_the_field(messages: object, param: str) -> None:
    with pytest.raises(TemplateError) as err:
        render_chat(messages)
    assert err.value.param == param
