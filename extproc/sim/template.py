"""The simulated model's chat template: messages -> prompt segments (text and media placeholders).

The template is ChatML (as used by Qwen and many vLLM chat models)::

    <|im_start|>{role}\\n{content}<|im_end|>\\n      (once per message)
    <|im_start|>assistant\\n                          (the generation prompt)

``tools`` (OpenAI function definitions) are rendered first as a ``tools`` turn holding their
compact JSON. Content parts (OpenAI chat ``content`` arrays) are rendered in order: ``text``
parts are concatenated; ``image_url`` and ``input_audio`` parts become placeholders of a fixed
token count, the way multimodal models splice encoder outputs into the prompt:

* ``IMAGE_PLACEHOLDER_TOKENS = 576``: LLaVA-1.5 feeds a 336 px image through CLIP ViT-L/14,
  (336 / 14)^2 = 576 patch tokens.
* ``AUDIO_PLACEHOLDER_TOKENS = 750``: Qwen2-Audio encodes a 30 s clip with a Whisper encoder
  pooled to one token per 40 ms, 30 s / 40 ms = 750 tokens.

Each placeholder carries a key derived from the media's URL/data, so two different images do
not share prefix-cache blocks (vLLM mixes a multimodal hash into the block hash likewise).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

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
class Placeholder:
    """A run of ``count`` media tokens standing for one image or audio clip."""

    kind: MediaKind
    count: int
    key: int


Segment = str | Placeholder


def _media_key(payload: object) -> int:
    digest = hashlib.blake2b(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS), digest_size=8)
    return int.from_bytes(digest.digest(), "big")


def _render_content(content: object, param: str, out: list[Segment]) -> None:
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
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise TemplateError("text part needs a string 'text'", f"{where}.text")
            out.append(text)
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise TemplateError("image_url part needs image_url.url", f"{where}.image_url")
            out.append(Placeholder("image", IMAGE_PLACEHOLDER_TOKENS, _media_key(url)))
        elif kind == "input_audio":
            audio = part.get("input_audio")
            if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                raise TemplateError("input_audio part needs input_audio.data", f"{where}.input_audio")
            out.append(Placeholder("audio", AUDIO_PLACEHOLDER_TOKENS, _media_key(audio)))
        else:
            raise TemplateError(f"unsupported content part type {kind!r}", f"{where}.type")


def render_chat(messages: object, tools: object = None) -> list[Segment]:
    """Render OpenAI chat ``messages`` (and optional ``tools``) with the ChatML template,
    ending with the assistant generation prompt. Adjacent text is merged into one segment."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list", "messages")
    raw: list[Segment] = []
    if tools is not None:
        raw.append(f"{IM_START}tools\n{orjson.dumps(tools).decode()}{IM_END}\n")
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise TemplateError("message must be an object", param)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise TemplateError("message needs a string 'role'", f"{param}.role")
        raw.append(f"{IM_START}{role}\n")
        _render_content(message.get("content"), f"{param}.content", raw)
        tool_calls = message.get("tool_calls")
        if tool_calls:
            raw.append(orjson.dumps(tool_calls).decode())
        raw.append(f"{IM_END}\n")
    raw.append(f"{IM_START}assistant\n")
    return _merge_text(raw)


def _merge_text(raw: list[Segment]) -> list[Segment]:
    merged: list[Segment] = []
    pending: list[str] = []
    for seg in raw:
        if isinstance(seg, str):
            pending.append(seg)
            continue
        if pending:
            merged.append("".join(pending))
            pending = []
        merged.append(seg)
    if pending:
        merged.append("".join(pending))
    return merged
