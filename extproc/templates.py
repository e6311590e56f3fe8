"""Chat templates: OpenAI chat ``messages`` (and ``tools``) -> the prompt a model server encodes.

One definition shared by the gateway (``extproc.tokens`` estimates prompt tokens from it) and the
simulated pod (``llmgw_sim`` encodes it), so the estimate and the pod's ``usage.prompt_tokens``
come from the very same text. Pure: raw JSON values in, frozen turns out; no I/O.

A template renders to ``Turn``s: a fixed ``prefix`` and ``suffix`` (the role markers) around a
``body`` of text and media parts. Turn boundaries are where a byte-level BPE pre-tokenizer
always splits (after ``<|im_end|>\\n``), which lets a counter encode (and cache) turn by turn.
``render_chat`` flattens turns into the segments the pod encodes: adjacent text merged, each
image or audio part a ``Placeholder`` of a fixed token count.

``chatml`` (Qwen and many vLLM chat models)::

    <|im_start|>tools\\n{compact JSON of tools}<|im_end|>\\n   (only when tools are given)
    <|im_start|>{role}\\n{content}{tool_calls JSON}<|im_end|>\\n    (once per message)
    <|im_start|>assistant\\n                                       (the generation prompt)

Content parts (OpenAI chat ``content`` arrays) render in order: ``text`` and ``refusal`` parts
concatenate (vLLM treats a refusal part as text); ``image_url`` and ``input_audio`` parts become
media. The pod's placeholder sizes:

* ``IMAGE_PLACEHOLDER_TOKENS = 576``: LLaVA-1.5 feeds a 336 px image through CLIP ViT-L/14,
  (336 / 14)^2 = 576 patch tokens.
* ``AUDIO_PLACEHOLDER_TOKENS = 750``: Qwen2-Audio encodes a 30 s clip with a Whisper encoder
  pooled to one token per 40 ms, 30 s / 40 ms = 750 tokens.

Each placeholder carries a key derived from the media's URL/data, so two different images do
not share prefix-cache blocks (vLLM mixes a multimodal hash into the block hash likewise).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import orjson

IMAGE_PLACEHOLDER_TOKENS = 576
AUDIO_PLACEHOLDER_TOKENS = 750

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

MediaKind = Literal["image", "audio"]


class TemplateError(ValueError):
    """A message the template cannot render; ``param`` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Media:
    """An image or audio content part as sent: ``source`` is an image's URL (``data:`` or remote)
    or an audio part's ``input_audio`` object; ``detail`` is ``image_url.detail``."""

    kind: MediaKind
    source: object
    detail: str = "auto"


@dataclass(frozen=True, slots=True)
class Turn:
    """One rendered turn: ``prefix + body + suffix``. ``role`` is the message's role, ``tools``
    for the tool-definitions turn, ``generation`` for the assistant prompt that ends a chat."""

    role: str
    prefix: str
    body: tuple[str | Media, ...]
    suffix: str


@dataclass(frozen=True, slots=True)
class Placeholder:
    """A run of ``count`` media tokens standing for one image or audio clip."""

    kind: MediaKind
    count: int
    key: int


Segment = str | Placeholder


class ChatTemplate(Protocol):
    """Renders OpenAI ``messages`` and optional ``tools`` (raw JSON values) into turns; raises
    ``TemplateError`` naming the field it cannot render."""

    def __call__(self, messages: object, tools: object = None) -> tuple[Turn, ...]: ...


def _content_body(content: object, param: str, out: list[str | Media]) -> None:
    """Append one message's content: a string, null, or a list of OpenAI content parts."""
    if content is None:
        return
    if isinstance(content, str):
        out.append(content)
        return
    if not isinstance(content, list):
        raise TemplateError("content must be a string or a list of content parts", param)
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise TemplateError("content part must be an object", where)
        kind = part.get("type")
        if kind == "text" or kind == "refusal":
            text = part.get(kind)
            if not isinstance(text, str):
                raise TemplateError(f"{kind} part needs a string '{kind}'", f"{where}.{kind}")
            out.append(text)
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise TemplateError("image_url part needs image_url.url", f"{where}.image_url")
            detail = image.get("detail") if isinstance(image, dict) else None
            out.append(Media("image", url, detail if isinstance(detail, str) else "auto"))
        elif kind == "input_audio":
            audio = part.get("input_audio")
            if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                raise TemplateError("input_audio part needs input_audio.data", f"{where}.input_audio")
            out.append(Media("audio", audio))
        else:
            raise TemplateError(f"unsupported content part type {kind!r}", f"{where}.type")


def render_chatml(messages: object, tools: object = None) -> tuple[Turn, ...]:
    """The ChatML template (see the module docstring), ending with the generation prompt."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list", "messages")
    turns: list[Turn] = []
    if tools is not None:
        turns.append(Turn("tools", f"{IM_START}tools\n", (orjson.dumps(tools).decode(),), f"{IM_END}\n"))
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise TemplateError("message must be an object", param)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise TemplateError("message needs a string 'role'", f"{param}.role")
        body: list[str | Media] = []
        _content_body(message.get("content"), f"{param}.content", body)
        tool_calls = message.get("tool_calls")
        if tool_calls:
            body.append(orjson.dumps(tool_calls).decode())
        turns.append(Turn(role, f"{IM_START}{role}\n", tuple(body), f"{IM_END}\n"))
    turns.append(Turn("generation", f"{IM_START}assistant\n", (), ""))
    return tuple(turns)


TEMPLATES: Mapping[str, ChatTemplate] = {"chatml": render_chatml}


def get_template(name: str) -> ChatTemplate:
    """The template registered as ``name``; ``ValueError`` lists the known names."""
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r} (known: {', '.join(sorted(TEMPLATES))})") from None


def text_runs(turn: Turn) -> list[str]:
    """The turn's text split at its media parts (``prefix`` opens the first run, ``suffix`` closes
    the last); empty runs are dropped. A tokenizer encodes each run on its own."""
    runs: list[str] = []
    pending = [turn.prefix]
    for part in turn.body:
        if isinstance(part, Media):
            runs.append("".join(pending))
            pending = []
        else:
            pending.append(part)
    pending.append(turn.suffix)
    runs.append("".join(pending))
    return [run for run in runs if run]


def media_key(payload: object) -> int:
    """A stable 64-bit key for a media part's URL or data (placeholder identity)."""
    digest = hashlib.blake2b(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS), digest_size=8)
    return int.from_bytes(digest.digest(), "big")


def to_segments(turns: tuple[Turn, ...], image_tokens: int = IMAGE_PLACEHOLDER_TOKENS,
                audio_tokens: int = AUDIO_PLACEHOLDER_TOKENS) -> list[Segment]:
    """Flatten turns into what a server encodes: adjacent text merged into one string, each
    media part a ``Placeholder`` of ``image_tokens`` / ``audio_tokens`` tokens."""
    merged: list[Segment] = []
    pending: list[str] = []
    for turn in turns:
        pending.append(turn.prefix)
        for part in turn.body:
            if isinstance(part, str):
                pending.append(part)
                continue
            if pending:
                merged.append("".join(pending))
                pending = []
            count = image_tokens if part.kind == "image" else audio_tokens
            merged.append(Placeholder(part.kind, count, media_key(part.source)))
        pending.append(turn.suffix)
    text = "".join(pending)
    if text:
        merged.append(text)
    return [seg for seg in merged if seg != ""]


def render_chat(messages: object, tools: object = None, template: str = "chatml") -> list[Segment]:
    """Render OpenAI chat ``messages`` (and optional ``tools``) with ``template``, ending with the
    assistant generation prompt, as segments (adjacent text merged into one string)."""
    return to_segments(get_template(template)(messages, tools))


class ChatML:
    """ChatML as one prompt string (``models[].chat_template: chatml``, the simulated pod's
    template): the batching coordinator's renderer for the models that use it."""

    source = "chatml"

    def __call__(self, messages: object, tools: object = None) -> str:
        segments = render_chat(messages, tools)
        if not all(isinstance(segment, str) for segment in segments):
            raise TemplateError("media parts cannot be rendered as text", "messages")
        return "".join(segments)  # type: ignore[arg-type]


CHATML = ChatML()
