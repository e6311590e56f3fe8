"""What a request's body says about how to route it: its fields and its prompt's structure. Pure.

Computed once per request from the validated JSON (``extract``), small and picklable, so the body
analysis in the helper process computes them too. Rules (``extproc.routing.rules``) match on them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from extproc.cjk import HAN, HANGUL, KANA

# Unicode script ranges that name a language (or a family) with no dictionary: enough to send
# Chinese prompts to a pool whose model reads them well. Latin-script text is "latin".
_SCRIPTS = (
    ("ja", re.compile(f"[{KANA}]")),  # kana first: Japanese also uses Han characters
    ("ko", re.compile(f"[{HANGUL}]")),
    ("zh", re.compile(f"[{HAN}]")),
    ("ru", re.compile(r"[\u0400-\u04ff]")),  # Cyrillic
    ("ar", re.compile(r"[\u0600-\u06ff]")),
    ("he", re.compile(r"[\u0590-\u05ff]")),
    ("hi", re.compile(r"[\u0900-\u097f]")),  # Devanagari
    ("el", re.compile(r"[\u0370-\u03ff]")),
    ("th", re.compile(r"[\u0e00-\u0e7f]")),
)
_LETTER = re.compile(r"[A-Za-z]")
_JSON_ASKED = re.compile(r"\bjson\b", re.IGNORECASE)
_LANGUAGE_SAMPLE = 2000  # characters of the last user turn read for its script


@dataclass(frozen=True, slots=True)
class PromptFeatures:
    """Request fields and prompt structure, as rules read them."""

    temperature: float | None = None
    response_format: str = "text"  # text, json_object, json_schema
    tools: bool = False
    modalities: frozenset[str] = frozenset({"text"})  # text, image, audio
    system_prompt: bool = False
    few_shot: int = 0  # user/assistant example pairs before the last user turn
    code_blocks: bool = False  # a fenced ``` block anywhere in the prompt
    json_output: bool = False  # response_format asks for JSON, or the prompt says "JSON"
    language: str = ""  # the last user turn's script: zh, ja, ko, ru, ar, he, hi, el, th, latin ("" unknown)


def extract(raw: dict[str, Any]) -> PromptFeatures:
    """The features of a validated request body (chat, completion or embedding). Fields the
    operation does not validate (``messages`` in an embedding request) may hold anything."""
    temperature = raw.get("temperature")
    response_format = raw.get("response_format")
    format_type = str(response_format.get("type", "text")) if isinstance(response_format, dict) else "text"
    messages = raw.get("messages")
    if not isinstance(messages, list):  # completions and embeddings: the prompt is the text
        prompt = raw.get("prompt", raw.get("input"))
        text = prompt if isinstance(prompt, str) else " ".join(p for p in prompt if isinstance(p, str)) \
            if isinstance(prompt, list) else ""
        return PromptFeatures(
            temperature=float(temperature) if isinstance(temperature, (int, float)) else None,
            response_format=format_type, code_blocks="```" in text,
            json_output=format_type != "text" or bool(_JSON_ASKED.search(text[:_LANGUAGE_SAMPLE])),
            language=language_of(text))
    modalities = {"text"}
    system = code = json_words = False
    roles: list[str] = []
    last_user = ""
    for message in messages:
        if not isinstance(message, dict):  # a field the operation ignores may hold anything
            continue
        role = message.get("role", "")
        roles.append(role)
        text = _text_of(message.get("content"), modalities)
        system = system or role in ("system", "developer")
        code = code or "```" in text
        if role in ("system", "developer", "user"):
            json_words = json_words or bool(_JSON_ASKED.search(text[:_LANGUAGE_SAMPLE]))
        if role == "user":
            last_user = text
    return PromptFeatures(
        temperature=float(temperature) if isinstance(temperature, (int, float)) else None,
        response_format=format_type, tools=bool(raw.get("tools")), modalities=frozenset(modalities),
        system_prompt=system, few_shot=_few_shot(roles), code_blocks=code,
        json_output=format_type != "text" or json_words, language=language_of(last_user))


def intent_text(raw: dict[str, Any], limit: int) -> str:
    """What semantic routing classifies: the last user turn (a completion's prompt, an embedding's
    input), its first ``limit`` characters."""
    messages = raw.get("messages")
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                return _text_of(message.get("content"), set())[:limit]
        return ""
    prompt = raw.get("prompt", raw.get("input"))
    if isinstance(prompt, list):
        prompt = next((p for p in prompt if isinstance(p, str)), "")
    return prompt[:limit] if isinstance(prompt, str) else ""


def _text_of(content: Any, modalities: set[str]) -> str:
    """A message's text; its media parts are noted in ``modalities``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind == "image_url":
            modalities.add("image")
        elif kind in ("input_audio", "audio_url"):
            modalities.add("audio")
    return " ".join(texts)


def _few_shot(roles: list[str]) -> int:
    """User/assistant pairs before the last user turn: the examples a few-shot prompt gives."""
    turns = [r for r in roles if r in ("user", "assistant")]
    if turns and turns[-1] == "user":
        turns = turns[:-1]
    return sum(1 for i in range(len(turns) - 1) if turns[i] == "user" and turns[i + 1] == "assistant")


def language_of(text: str) -> str:
    """The script of ``text`` (its first 2000 characters): a language code where a script names one,
    ``latin`` for Latin letters, ``""`` when there are no letters."""
    sample = text[:_LANGUAGE_SAMPLE]
    for code, script in _SCRIPTS:
        if script.search(sample):
            return code
    return "latin" if _LETTER.search(sample) else ""
