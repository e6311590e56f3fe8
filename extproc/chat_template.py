"""A model's own chat template: the Jinja ``chat_template`` of its ``tokenizer_config.json`` (or a
``.jinja`` file), compiled once when the config is, and rendered as Hugging Face transformers'
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` does
(``transformers/utils/chat_template_utils.py``):

* an ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension and a ``{% generation %}`` block that renders its body;
* ``tojson`` as ``json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)``
  (Jinja's own escapes HTML), and the globals ``raise_exception(message)`` and ``strftime_now(format)``;
* the variables ``messages``, ``tools``, ``documents`` (None), ``add_generation_prompt`` (True) and
  the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) as strings; in
  ``tokenizer_config.json`` each is a string or an ``AddedToken`` object with its ``content``.

Messages reach the template as vLLM's chat endpoint hands them over for a text-only model (its
"string" content format): ``content`` a string (``null`` -> ``""``, text parts joined with
``"\\n"``), other keys whose value is null dropped (as transformers does). Image and audio parts
cannot become text: ``TemplateError``. Rendering is pure; only ``load_chat_template`` reads files.

The text is exactly transformers'. A template that writes ``bos_token`` itself (Llama 3) sent as a
``/v1/completions`` prompt, which vLLM encodes with ``add_special_tokens``, may get a second BOS from
a tokenizer that adds one (Llama 3's does; Qwen has none, DeepSeek's tokenizer.json adds none).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from extproc.resources import resolve_resource
from extproc.templates import TemplateError

# transformers' SpecialTokensMixin.SPECIAL_TOKENS_ATTRIBUTES: what apply_chat_template passes as variables.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.50 saves the template beside the config


class ChatTemplateError(ValueError):
    """A chat template that cannot be loaded or compiled (the config names the field)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in transformers' environment; ``ChatTemplateError`` on bad syntax."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"template syntax error at line {error.lineno}: {error.message}") from None


@dataclass(frozen=True, slots=True)
class JinjaChatTemplate:
    """A compiled chat template and the special tokens it is rendered with; called as the
    coordinator's prompt renderer: ``(messages, tools) -> prompt``."""

    source: str  # the config's value (a path or pkg:<package>/<file>)
    template: jinja2.Template = field(repr=False, compare=False)
    special_tokens: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_string(cls, template: str, special_tokens: dict[str, str] | None = None,
                    source: str = "<string>") -> JinjaChatTemplate:
        """Compile ``template`` (``ChatTemplateError`` on bad syntax)."""
        return cls(source, compile_template(template), tuple(sorted((special_tokens or {}).items())))

    def render(self, messages: object, tools: object = None) -> str:
        """The prompt for OpenAI chat ``messages`` (and ``tools``), ending with the generation
        prompt; ``TemplateError`` naming the field for what it cannot render, or carrying the
        template's own ``raise_exception`` message."""
        chat = list(_template_messages(messages))
        if tools is not None and not isinstance(tools, list):
            raise TemplateError("tools must be a list", "tools")
        try:
            return self.template.render(messages=chat, tools=tools, documents=None, add_generation_prompt=True,
                                        **dict(self.special_tokens))
        except jinja2.TemplateError as error:  # raise_exception(), an undefined value misused, a sandbox refusal
            raise TemplateError(f"chat template {self.source}: {error.message or error}", "messages") from None
        except (TypeError, ValueError) as error:  # Python operations in the template on odd values
            raise TemplateError(f"chat template {self.source}: {error}", "messages") from None

    __call__ = render


def _template_messages(messages: object) -> Iterator[dict[str, object]]:
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise TemplateError("message must be an object", param)
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise TemplateError("message needs a string 'role'", f"{param}.role")
        plain = {key: value for key, value in message.items() if value is not None}
        plain["content"] = _text_content(message.get("content"), f"{param}.content")
        yield plain


def _text_content(content: object, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TemplateError("content must be a string or a list of content parts", param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get(kind) if isinstance(part, dict) and kind in ("text", "refusal") else None
        if not isinstance(text, str):
            raise TemplateError(f"a {kind!r} content part cannot be rendered as text", f"{param}[{i}]")
        texts.append(text)
    return "\n".join(texts)


def load_chat_template(spec: str) -> JinjaChatTemplate:
    """Load and compile the chat template ``spec`` names (a path or ``pkg:<package>/<file>``): a
    ``tokenizer_config.json`` (its ``chat_template``, else a ``chat_template.jinja`` beside it, and
    its special tokens), or a template file (special tokens from a ``tokenizer_config.json`` beside
    it, if any). ``ChatTemplateError`` says what is wrong."""
    try:
        path = resolve_resource(spec)
    except FileNotFoundError as error:
        raise ChatTemplateError(str(error)) from None
    if path.suffix == ".json":
        config = _read_json(path)
        source = config.get("chat_template")
        if source is None and (path.parent / TEMPLATE_FILE).is_file():
            source = _read_text(path.parent / TEMPLATE_FILE)
        source = _default_template(source, path)
    else:
        source = _read_text(path)
        sibling = path.parent / TOKENIZER_CONFIG
        config = _read_json(sibling) if sibling.is_file() else {}
    return JinjaChatTemplate.from_string(source, _special_tokens(config), spec)


def _default_template(value: object, path: Path) -> str:
    # transformers saves several templates as [{"name": ..., "template": ...}] and uses "default"
    # (or "tool_use" when given tools, which the coordinator never is: tools are never batched).
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise ChatTemplateError(f"{path}: chat_template has no template named 'default' "
                                    f"(names: {', '.join(map(str, named))})")
        value = named["default"]
    if value is None:
        raise ChatTemplateError(f"{path}: no chat_template in it")
    if not isinstance(value, str):
        raise ChatTemplateError(f"{path}: chat_template must be a string")
    return value


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ChatTemplateError(f"{path}: cannot read it: {error}") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(_read_text(path))
    except json.JSONDecodeError as error:
        raise ChatTemplateError(f"{path}: not JSON: {error}") from None
    if not isinstance(document, dict):
        raise ChatTemplateError(f"{path}: expected a JSON object")
    return document
