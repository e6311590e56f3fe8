"""A seeded fuzzer through the real local stack: bodies, headers, methods and raw HTTP/1.1.

Every answer must be a success (200 with a valid OpenAI response: JSON, or SSE for a stream) or an
OpenAI error (``content-type: application/json``, ``{"error": {"message", "type", "param", "code"}}``)
with a documented status; no other 5xx than a 503 whose code says unavailable; never a hang, never a
dead child process. After the run a tenant with ``limits: {concurrency: N}`` must still hold N
streams at once (and be refused the N+1th): no quota slot leaked.

Case generation and answer checking are plain functions (no I/O, seeded ``random.Random`` per case:
case ``i`` of seed ``S`` is the same on every run), shared with ``tests/e2e/test_fuzz_e2e.py``.
Prints one JSON line (violations deduplicated by kind, each with its smallest repro); writes
bench/results/fuzz.json; exits 1 on any violation.

    python -m bench.fuzz [--cases 10000] [--seed 20240601] [--concurrency 8]
    python -m bench.fuzz --seed S --replay I      # send case I alone and show what came back
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import re
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------
# What the fuzzed stack serves (tests/e2e/test_fuzz_e2e.py starts the same one)

MODEL = "llama-3-8b-instruct"
ALIAS = "gpt-4o-mini"
SLOW_MODEL = "fuzz-slow"  # served by one real-time pod: holds streams open for the slot check
MAX_BODY = 256 * 1024
SLOT_LIMIT = 16  # the limited tenant's concurrency: above any fuzz concurrency, so it never bites
LIMITED_KEY, OPEN_KEY = "sk-fuzz-limited-7f3a9c", "sk-fuzz-open-51be02"
KEY_ENV = {"FUZZ_LIMITED_KEY": LIMITED_KEY, "FUZZ_OPEN_KEY": OPEN_KEY}
# Instant pods with short replies: 10,000 cases in minutes.
FAST_POD_ARGS = ("--time-scale", "0", "--output-len-mean", "16", "--log-level", "ERROR")
DEFAULT_SEED = 20240601


def fuzz_config(slow_endpoint: str, pods: int = 2) -> dict[str, Any]:
    """The llmgw config of the fuzzed stack: simulated pods, a limited tenant (limits too high to
    bite) and an unlimited one, and the real-time pod at ``slow_endpoint`` for the slot check."""
    high = {"rpm": 10**7, "tpm": 10**12, "concurrency": SLOT_LIMIT, "daily_tokens": 10**15}
    return {
        "server": {"max_body_bytes": MAX_BODY},
        "pools": [{"name": "local", "simulate": pods}, {"name": "slow", "endpoints": [slow_endpoint]}],
        "models": [{"name": MODEL, "pool": "local", "aliases": [ALIAS]}, {"name": SLOW_MODEL, "pool": "slow"}],
        "tenants": [
            {"name": "fuzz-limited", "keys": [{"env": "FUZZ_LIMITED_KEY"}], "qos": ["standard", "batch"],
             "limits": high, "qos_limits": {"batch": {"concurrency": SLOT_LIMIT, "rpm": 10**7}}},
            {"name": "fuzz-open", "keys": [{"env": "FUZZ_OPEN_KEY"}]},
        ],
        # A leaked slot must still be held when the check runs, not expire with its lease.
        "quota": {"lease_ttl_s": 600},
    }


# ---------------------------------------------------------------------------------------------
# Cases and answers


@dataclass(frozen=True, slots=True)
class Case:
    """One request to send. Header values are latin-1 text (one char per byte)."""

    index: int
    kind: str  # generator, e.g. "body.deep_nesting"
    method: str
    target: str  # request target as sent: path and query (or "*", or absolute form)
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    raw: bytes | None = None  # the exact bytes to send over a socket (httpx cannot send them)
    chunked: bool = False  # send the body with transfer-encoding: chunked
    half_close: bool = False  # shut the socket's write side after sending (raw only)
    no_answer_ok: bool = False  # broken framing: the server may close without answering

    @property
    def size(self) -> int:
        """Bytes on the wire, roughly: what makes one repro smaller than another."""
        if self.raw is not None:
            return len(self.raw)
        return len(self.target) + len(self.body) + sum(len(k) + len(v) + 4 for k, v in self.headers)


@dataclass(frozen=True, slots=True)
class Answer:
    """What came back: a status, headers (names lower-case) and body, or a failure."""

    status: int | None
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    failure: str | None = None  # "hang", "no answer: ...", "cut off: ..."

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (lower-case), if any."""
        return next((v for k, v in self.headers if k == name), None)


@dataclass(frozen=True, slots=True)
class Violation:
    """A broken promise: ``kind`` groups the same bug across cases, ``detail`` is this answer's."""

    kind: str
    detail: str


# ---------------------------------------------------------------------------------------------
# Case generation (pure: one seeded Random per case)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
_NEST = "\x00fuzz-splice\x00"  # a string value later replaced by raw JSON text
_NEST_JSON = json.dumps(_NEST).encode()
_WEIRD_VALUES: tuple[Any, ...] = (None, True, False, 0, -1, 1.5, "", "x", [], {}, [1, "a"], {"a": 1},
                                  2**64, -(2**63) - 1, "\U0001f916", [[[]]], {"": None})
_WEIRD_STRINGS = (
    "", " ", "\x00", "a\x00b", "\ud800", "\udfff\ud800", "\U0001f916" * 50, "\u202eevil", "\u200b" * 20,
    "e\u0301" * 100, "\uffff\ufffe", "\U0010ffff", "ll\u0430ma-3-8b-instruct", "\\u0000", "%s%n%x",
    "' OR 1=1 --", "<script>alert(1)</script>", "../../etc/passwd", "\r\nx-injected: 1", "\t\n\r\f\b",
    "{{7*7}}", "null", "A" * 5000,
)
_RAW_NUMBERS = ("NaN", "Infinity", "-Infinity", "nan", "inf", "1e400", "-1e400", "1E999", "-0", "0e0",
                "123456789012345678901234567890123456789", "1" + "0" * 5000, "0x10", "01", "1.", ".5",
                "+1", "1e-400", "18446744073709551616", "-9223372036854775809", "9223372036854775807")
_HUGE_NUMBERS: tuple[Any, ...] = (0, -1, -(2**63), 2**63, 2**64, 10**30, 1e308, -1e308, 1.5, 1e-300,
                                  -0.0, 2**31, 2**31 - 1, 129, 128, 21, True, "5", "1e3", " 5", "")
_NUMERIC_FIELDS = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "seed",
                             "presence_penalty", "frequency_penalty", "top_logprobs"),
    "/v1/completions": ("max_tokens", "n", "best_of", "temperature", "top_p", "seed", "logprobs"),
    "/v1/embeddings": ("dimensions",),
}
_IMAGE = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9"
          "awAAAABJRU5ErkJggg==")


def _rand_text(rng: random.Random, words: int) -> str:
    vocab = ("hello", "gateway", "the", "quick", "fox", "tokens", "limit", "stream", "json", "pod")
    return " ".join(rng.choice(vocab) for _ in range(words))


def _message(rng: random.Random) -> dict[str, Any]:
    roll = rng.random()
    if roll < 0.55:
        return {"role": "user", "content": _rand_text(rng, rng.randint(1, 12))}
    if roll < 0.65:
        return {"role": rng.choice(["system", "developer"]), "content": _rand_text(rng, 5)}
    if roll < 0.8:
        parts: list[dict[str, Any]] = [{"type": "text", "text": _rand_text(rng, 3)}]
        if rng.random() < 0.5:
            parts.append({"type": "image_url", "image_url": {"url": _IMAGE, "detail": rng.choice(["low", "auto"])}})
        if rng.random() < 0.2:
            parts.append({"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}})
        return {"role": "user", "content": parts}
    if roll < 0.9:
        return {"role": "assistant", "content": _rand_text(rng, 4)}
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]}


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "look something up",
                                             "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def valid_body(rng: random.Random, endpoint: str) -> dict[str, Any]:
    """A request body the gateway should accept for ``endpoint`` (small outputs)."""
    model = rng.choice((MODEL, MODEL, ALIAS))
    body: dict[str, Any]
    if endpoint == "/v1/embeddings":
        shape = rng.randrange(4)
        inputs: Any = [_rand_text(rng, 3), "the end"] if shape == 0 else (
            [1, 2, 3] if shape == 1 else ([[1, 2], [3]] if shape == 2 else _rand_text(rng, 6)))
        body = {"model": model, "input": inputs}
        if rng.random() < 0.3:
            body["encoding_format"] = rng.choice(["float", "base64"])
        return body
    if endpoint == "/v1/completions":
        shape = rng.randrange(4)
        prompt: Any = _rand_text(rng, 5) if shape == 0 else (
            ["The sky is", "Grass is"] if shape == 1 else ([10, 20, 30] if shape == 2 else [[10, 20], [30]]))
        body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(1, 12)}
        if rng.random() < 0.3:
            body["echo"] = rng.random() < 0.5
    else:
        messages = [_message(rng) for _ in range(rng.randint(1, 4))]
        if messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": "hi"})
        body = {"model": model, "messages": messages}
        body["max_completion_tokens" if rng.random() < 0.2 else "max_tokens"] = rng.randint(1, 12)
        if rng.random() < 0.25:
            body["tools"] = [_tool("lookup")]
            body["tool_choice"] = rng.choice(["auto", "none", "required",
                                              {"type": "function", "function": {"name": "lookup"}}])
        if rng.random() < 0.15:
            body["response_format"] = rng.choice([{"type": "json_object"}, {"type": "text"}, {
                "type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}}}])
    if rng.random() < 0.3:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": rng.random() < 0.5}
    for name, value in (("temperature", rng.choice([0, 0.2, 1.0, 2])), ("top_p", round(rng.random(), 2)),
                        ("n", rng.randint(1, 2)), ("stop", rng.choice(["\n", ["END", "STOP"]])),
                        ("seed", rng.randint(0, 2**31)), ("user", "user-42"), ("top_k", 5), ("min_p", 0.1)):
        if rng.random() < 0.15:
            body[name] = value
    return body


def _dumps(rng: random.Random, body: Any) -> bytes:
    text = json.dumps(body, ensure_ascii=rng.random() < 0.5, separators=rng.choice([(",", ":"), (", ", ": ")]))
    return text.encode("utf-8", "surrogatepass")  # lone surrogates become invalid UTF-8, on purpose


def _splice(encoded: bytes, raw_json: bytes) -> bytes:
    return encoded.replace(_NEST_JSON, raw_json, 1)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found: list[tuple[Any, ...]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        found.append((*prefix, key))
        found += _paths(child, (*prefix, key))
    return found


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _delete(doc: Any, path: tuple[Any, ...]) -> None:
    for key in path[:-1]:
        doc = doc[key]
    del doc[path[-1]]


def nested(rng: random.Random, depth: int, core: str = "1") -> bytes:
    """``depth`` levels of arrays, objects or both around ``core`` (raw JSON), built as text:
    no recursion, whatever the depth."""
    style = rng.randrange(3)
    opens, closes = [], []
    for level in range(depth):
        as_array = style == 0 or (style == 2 and level % 2 == 0)
        opens.append("[" if as_array else '{"a":')
        closes.append("]" if as_array else "}")
    return ("".join(opens) + core + "".join(reversed(closes))).encode()


def _nest_field(rng: random.Random, body: dict[str, Any], endpoint: str) -> str:
    """Put the splice marker where the nesting goes; return the field's name."""
    choices: list[str] = ["metadata", "stop", "logit_bias", "user", "<body>"]
    if endpoint == "/v1/chat/completions":
        choices += ["messages", "messages[0].content", "tools.parameters", "response_format.schema",
                    "stream_options", "tool_choice", "messages[0].tool_calls"]
    elif endpoint == "/v1/completions":
        choices += ["prompt", "prompt", "stream_options"]
    else:
        choices += ["input", "input"]
    where = rng.choice(choices)
    if where == "messages[0].content":
        body["messages"][0]["content"] = _NEST
    elif where == "messages[0].tool_calls":
        body["messages"].insert(0, {"role": "assistant", "content": None, "tool_calls": _NEST})
    elif where == "tools.parameters":
        body["tools"] = [_tool("lookup")]
        body["tools"][0]["function"]["parameters"] = _NEST
    elif where == "response_format.schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": _NEST}}
    elif where != "<body>":
        body[where] = _NEST
    return where


def _depth(rng: random.Random) -> int:
    edges = (1, 2, 10, 31, 32, 33, 64, 100, 127, 128, 129, 255, 256, 257, 500, 512, 999, 1000, 1001, 1024,
             1500, 2000)
    return rng.choice(edges) if rng.random() < 0.6 else rng.randint(1, 2000)


def _mutate(rng: random.Random, endpoint: str, body: dict[str, Any]) -> tuple[str, bytes]:
    """One mutation of a valid ``body``: its name and the bytes to send."""
    name = rng.choices(list(_MUTATIONS), weights=[w for w, _ in _MUTATIONS.values()])[0]
    return name, _MUTATIONS[name][1](rng, endpoint, body)


def _m_wrong_type(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    path = rng.choice(_paths(body))
    _set(body, path, rng.choice(_WEIRD_VALUES))
    return _dumps(rng, body)


def _m_missing(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    for _ in range(rng.randint(1, 2)):
        paths = _paths(body)
        if paths:
            _delete(body, rng.choice(paths))
    return _dumps(rng, body)


def _m_number(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    fields = _NUMERIC_FIELDS[endpoint]
    for name in rng.sample(fields, rng.randint(1, min(2, len(fields)))):
        body[name] = rng.choice(_HUGE_NUMBERS)
    if rng.random() < 0.3:  # token ids out of any vocabulary
        token = rng.choice((2**70, -1, 2**31, 0))
        if endpoint == "/v1/chat/completions":
            body["logit_bias"] = {str(token): rng.choice((100, -1e309, 5))}
        else:
            body["prompt" if endpoint == "/v1/completions" else "input"] = [token]
    return _dumps(rng, body).replace(b"Infinity", b"1e999")  # -1e309 overflows to a float infinity


def _m_raw_number(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    """NaN, Infinity, 5000-digit integers, 1e400...: tokens only a raw splice can write."""
    body[rng.choice(_NUMERIC_FIELDS[endpoint] + ("temperature", "seed"))] = _NEST
    return _splice(_dumps(rng, body), rng.choice(_RAW_NUMBERS).encode())


def _m_unicode(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    strings = [p for p in _paths(body) if isinstance(_get(body, p), str)] + [("model",), ("user",)]
    for path in rng.sample(strings, min(len(strings), rng.randint(1, 3))):
        _set(body, path, rng.choice(_WEIRD_STRINGS))
    return _dumps(rng, body)


def _m_bad_utf8(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    body[rng.choice(("model", "user", "stop", "x_extra"))] = _NEST
    junk = rng.choice((b"\xff\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82"))
    return _splice(_dumps(rng, body), b'"a' + junk + b'b"')


def _m_deep(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    where = _nest_field(rng, body, endpoint)
    depth = _depth(rng)
    if where == "<body>":
        return nested(rng, depth, _dumps(rng, body).decode("utf-8", "surrogatepass"))
    core = rng.choice(['"hi"', "1", "null", '{"role":"user","content":"hi"}', "[]", "{}"])
    return _splice(_dumps(rng, body), nested(rng, depth, core))


def _m_long_array(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    count = rng.choice((100, 500, 1000, 2000, 4096)) if rng.random() < 0.5 else rng.randint(10, 3000)
    what = rng.randrange(4)
    if endpoint == "/v1/chat/completions":
        if what == 0:
            body["messages"] = [{"role": "user", "content": "hi"}] * count
        elif what == 1:
            body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "a"}] * count}]
        elif what == 2:
            body["tools"] = [_tool(f"t{i}") for i in range(min(count, 1000))]
        else:
            body["stop"] = ["x"] * count
    elif endpoint == "/v1/completions":
        body["prompt"] = (["hi"] * count if what < 2 else [7] * (count * 4) if what == 2 else [[7, 8]] * count)
    else:
        body["input"] = ["hi"] * count if what < 2 else [[1, 2, 3]] * count
    if rng.random() < 0.2:
        body["logit_bias"] = {str(i): 1 for i in range(count)}
    return _dumps(rng, body)


def _m_huge_string(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    size = rng.choice((MAX_BODY - 200, MAX_BODY + 1, MAX_BODY + 4096, 60_000, 200_000))
    field_name = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/embeddings": "input"}[endpoint]
    text = "word " * (size // 5)
    body[field_name] = [{"role": "user", "content": text}] if field_name == "messages" else text
    return _dumps(rng, body)


def _m_not_json(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    return rng.choice((
        b"", b" ", b"\r\n", b"{}", b"[]", b"null", b"0", b'""', b"true", b"{", b"}", b"[{}]",
        b"model=x&messages=y", b"<xml><model>x</model></xml>", b"model: x\nmessages: []\n",
        b"{'model': 'llama-3-8b-instruct'}", b'{"model": "x",}', b'{"model": "x" /* c */}',
        b'{"model": "x"}\n{"model": "y"}', b"\x00" * 16, bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))),
        _rand_text(rng, 20).encode(), b'{"model":', b'"\\', b'{"a":"\\uZZZZ"}', b'{"a":"\\ud800"}',
    ))


def _m_truncated(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    encoded = _dumps(rng, body)
    return encoded[: rng.randint(1, max(1, len(encoded) - 1))]


def _m_trailing(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    junk = rng.choice((b"x", b"\x00", b"}", b"]", b", {}", b" " * 4000, b"\n\n\n", b'{"model":"x"}', b"\xff"))
    return _dumps(rng, body) + junk


def _m_duplicate_key(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    key, first, second = rng.choice((
        ("model", "no-such-model", body["model"]), ("model", body["model"], "no-such-model"),
        ("stream", True, False), ("stream", False, True), ("max_tokens", 1, -1), ("max_tokens", -1, 2),
        ("messages", 5, [{"role": "user", "content": "hi"}]), ("n", 1, 1000), ("stream_options", None, {"x": 1}),
    ))
    body.pop(key, None)
    pair = f'"{key}": {json.dumps(first)}, "{key}": {json.dumps(second)}, '.encode()
    encoded = _dumps(rng, body)
    return b"{" + pair + encoded[1:] if encoded != b"{}" else b"{" + pair[:-2] + b"}"


def _m_encoding(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    text = json.dumps(body)
    return rng.choice((
        b"\xef\xbb\xbf" + text.encode(), text.encode("utf-16"), text.encode("utf-16-le"), text.encode("utf-32"),
        b"\xef\xbb\xbf\xef\xbb\xbf" + text.encode(), b"\xfe\xff" + text.encode(), text.encode("utf-7"),
    ))


def _m_as_strings(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    for name, value in list(body.items()):
        if isinstance(value, bool | int | float) and rng.random() < 0.7:
            body[name] = json.dumps(value) if rng.random() < 0.8 else f" {value} "
    if rng.random() < 0.5:
        body[rng.choice(_NUMERIC_FIELDS[endpoint])] = rng.choice(("5", "1e2", "0x5", "five", "5.0"))
    return _dumps(rng, body)


def _m_model(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    body["model"] = rng.choice(("no-such-model", "", " ", f"{ALIAS} ", f" {MODEL}", MODEL.upper(), "x" * 2000,
                                f"{MODEL}\x00", f"../{MODEL}", SLOW_MODEL + "x", None, 7, ["x"], {"name": MODEL},
                                "\U0001f916", f"{MODEL}/v1"))
    return _dumps(rng, body)


def _m_roles(rng: random.Random, endpoint: str, body: dict[str, Any]) -> bytes:
    if endpoint != "/v1/chat/completions":
        return _m_wrong_type(rng, endpoint, body)
    odd: dict[str, Any] = rng.choice((
        {"role": "robot", "content": "x"}, {"role": "user"}, {"role": "user", "content": None},
        {"role": "assistant"}, {"role": "tool", "content": "x"}, {"role": "function", "content": "x"},
        {"role": "user", "content": [{"type": "video", "url": "x"}]}, {"role": "user", "content": [{}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _IMAGE, "detail": "ultra"}}]},
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x", "format": "ogg"}}]},
        {"role": "assistant", "content": None, "tool_calls": []}, {"role": "assistant", "tool_calls": [{}]},
        {"role": "user", "content": "x", "name": 5}, {"content": "x"}, {"role": None, "content": "x"},
        {"role": "user", "content": "", "extra": {"deep": [1, 2]}}, {"role": "USER", "content": "x"},
    ))
    body["messages"].insert(rng.randint(0, len(body["messages"])), odd)
    if rng.random() < 0.3:
        body["messages"] = rng.choice(([], {}, "hi", [[]], None))
    return _dumps(rng, body)


# name: (weight, mutation)
_MUTATIONS: dict[str, tuple[float, Callable[[random.Random, str, dict[str, Any]], bytes]]] = {
    "wrong_type": (10, _m_wrong_type), "missing_field": (6, _m_missing), "huge_number": (7, _m_number),
    "raw_number": (6, _m_raw_number), "unicode": (6, _m_unicode), "bad_utf8": (3, _m_bad_utf8),
    "deep_nesting": (12, _m_deep), "long_array": (4, _m_long_array), "huge_string": (1, _m_huge_string),
    "not_json": (6, _m_not_json), "truncated": (5, _m_truncated), "trailing_bytes": (3, _m_trailing),
    "duplicate_key": (4, _m_duplicate_key), "bom_encoding": (3, _m_encoding), "as_strings": (5, _m_as_strings),
    "model": (4, _m_model), "roles": (4, _m_roles),
}


def _auth(rng: random.Random) -> tuple[str, str]:
    key = rng.choice((LIMITED_KEY, OPEN_KEY))
    roll = rng.random()
    if roll < 0.8:
        return "authorization", f"Bearer {key}"
    return ("api-key" if roll < 0.9 else "x-api-key"), key  # Azure-style


def _base_headers(rng: random.Random) -> list[tuple[str, str]]:
    return [("content-type", "application/json"), _auth(rng)]


def _body_case(rng: random.Random, index: int, mutate: bool) -> Case:
    endpoint = rng.choice(ENDPOINTS)
    body = valid_body(rng, endpoint)
    if not mutate:
        return Case(index, "body.valid", "POST", endpoint, tuple(_base_headers(rng)), _dumps(rng, body))
    name, encoded = _mutate(rng, endpoint, body)
    return Case(index, f"body.{name}", "POST", endpoint, tuple(_base_headers(rng)), encoded)


_CONTENT_TYPES = (None, "", "text/plain", "application/json; charset=utf-8", "application/json;charset=UTF-8",
                  "APPLICATION/JSON", "application/jsonx", "application/json; charset=latin-1",
                  "multipart/form-data; boundary=x", "application/x-www-form-urlencoded",
                  "application/json, text/plain",
                  "application/*", "*/*", "json", "application/json; " + "x=y; " * 300, "application/vnd.api+json",
                  "application/json\x7f", "text/event-stream", "application/json; charset=utf-16")
_ENCODINGS = ("gzip", "gzip", "deflate", "br", "zstd", "identity", "gzip, gzip", "", "x-garbage", "chunked",
              "GZIP", "compress", "gzip;q=1", "identity, gzip")
_INTERNAL = (
    ("x-llmgw-route", ("batch", "direct", "nowhere", "")), ("x-llmgw-tenant", ("root", "fuzz-open", "")),
    ("x-llmgw-qos", ("standard", "batch", "premium", "", "x" * 300, "batch, standard")),
    ("x-llmgw-strip-usage", ("1", "true")), ("x-llmgw-model", (MODEL, "evil")), ("x-llmgw-span", ("x",)),
    ("x-gateway-destination-endpoint",
     ("127.0.0.1:1", "[::1]:80", "garbage", "10.255.255.1:80", "", "127.0.0.1:99999")),
    ("x-envoy-upstream-rq-timeout-ms", ("1", "0", "-1", "abc")), ("x-envoy-retry-on", ("5xx", "reset")),
    ("x-envoy-max-retries", ("100",)), ("x-envoy-original-path", ("/admin",)), ("x-envoy-internal", ("true",)),
    ("x-envoy-expected-rq-timeout-ms", ("1",)), ("x-envoy-decorator-operation", ("x",)),
    ("x-envoy-upstream-rq-per-try-timeout-ms", ("1",)), ("x-envoy-force-trace", ("true",)),
    ("x-forwarded-for", ("1.2.3.4", "garbage, ::1")), ("x-forwarded-proto", ("gopher",)),
    ("x-request-id", ("fuzz-1", "", "x" * 5000, "\xe9\xff", "a b", "../x")),
    ("traceparent", ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "garbage", "ff-" + "0" * 52,
                     "00-00000000000000000000000000000000-0000000000000000-01", "00-" + "a" * 200)),
    ("tracestate", ("a=b," * 200,)), ("x-ratelimit-limit-requests", ("999",)),
    ("x-llmgw-" + "a" * 100, ("1",)),
)
_ODD_AUTH = ("Bearer", "Bearer ", "Bearer  {key}", "bearer {key}", "BEARER {key}", "Basic {key}", "Bearer {key} ",
             "Bearer {key}x", "Bearer sk-" + "x" * 10_000, "Bearer \xe9\xff", "Bearer {key}, Bearer sk-other",
             "Token {key}", "{key}", "Bearer\t{key}", "Bearer sk-fuzz-limited-7f3a9C", "Digest realm=x")


def _header_case(rng: random.Random, index: int) -> Case:
    endpoint = rng.choice(ENDPOINTS)
    body = _dumps(rng, valid_body(rng, endpoint))
    headers = _base_headers(rng)
    what = rng.choice(("content_type", "content_encoding", "internal", "internal", "many", "long_value",
                       "auth", "auth", "misc", "chunked"))
    chunked = False
    if what == "content_type":
        headers = [h for h in headers if h[0] != "content-type"]
        value = rng.choice(_CONTENT_TYPES)
        if value is not None:
            headers.append(("content-type", value))
        if rng.random() < 0.15:
            headers.append(("content-type", rng.choice(("text/plain", "application/json"))))
    elif what == "content_encoding":
        encoding = rng.choice(_ENCODINGS)
        headers.append(("content-encoding", encoding))
        if rng.random() < 0.6 and encoding.lower().startswith("gzip"):
            body = gzip.compress(body, mtime=0)
        elif rng.random() < 0.5 and encoding == "deflate":
            body = zlib.compress(body)
    elif what == "internal":
        for name, values in rng.sample(_INTERNAL, rng.randint(1, 4)):
            headers.append((name, rng.choice(values)))
    elif what == "many":
        count = rng.choice((50, 99, 100, 101, 150, 300)) if rng.random() < 0.6 else rng.randint(10, 400)
        headers += [(f"x-fuzz-{i}", "v") for i in range(count)]
    elif what == "long_value":
        size = rng.choice((1024, 8192, 16_384, 59_000, 61_440, 65_536, 100_000))
        headers.append((rng.choice(("x-fuzz-long", "user-agent", "cookie", "x-request-id", "referer")), "a" * size))
    elif what == "auth":
        headers = [h for h in headers if h[0] not in ("authorization", "api-key", "x-api-key")]
        key = rng.choice((LIMITED_KEY, OPEN_KEY))
        for _ in range(rng.choice((0, 1, 1, 1, 2))):  # none, one or two credentials
            name = rng.choice(("authorization", "authorization", "api-key", "x-api-key", "proxy-authorization"))
            if name == "authorization" or rng.random() < 0.5:
                value = rng.choice(_ODD_AUTH).replace("{key}", key)
            else:
                value = rng.choice(("", " ", key + " ", "sk-bogus", key.upper(), key))
            headers.append((name, value))
    elif what == "misc":
        headers += rng.sample((
            ("expect", "100-continue"), ("connection", "close"), ("connection", "upgrade"), ("upgrade", "websocket"),
            ("upgrade", "h2c"), ("http2-settings", "AAMAAABkAARAAAAAAAIAAAAA"), ("te", "trailers"),
            ("accept-encoding", "gzip, br, zstd"), ("accept", "text/event-stream"), ("host", "evil.example"),
            ("host", ""), ("cookie", "a=b"), ("origin", "https://evil.example"), ("range", "bytes=0-10"),
            ("if-none-match", "*"), ("max-forwards", "0"), ("via", "1.1 loop"), ("x-http-method-override", "GET"),
            ("keep-alive", "timeout=1"), ("priority", "u=0"), ("Content-Type", "text/plain"),
        ), rng.randint(1, 3))
    else:  # chunked transfer-encoding: no content-length, the size is known only at the end
        chunked = True
    return Case(index, f"headers.{what}", "POST", endpoint, tuple(headers), body, chunked=chunked)


_METHODS = ("GET", "GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "HEAD", "PATCH", "TRACE", "PROPFIND")
_PATHS = (
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", f"/v1/models/{MODEL}",
    f"/v1/models/{ALIAS}", "/v1/models/no-such-model", "/v1/models/", f"/v1/models/{SLOW_MODEL}", "/", "/v1", "/v1/",
    "/v1/chat", "/v1/chat/completions/", "/V1/CHAT/COMPLETIONS", "/v1/images/generations", "/v1/files",
    "/v1/audio/transcriptions", "/v2/chat/completions", "/openai/deployments/gpt/chat/completions", "/metrics",
    "/health", "/debug/requests", "/stats", "/ready", "/server_info", "/clusters", "/v1/models/x/y",
    "/v1/chat/completions?x=1", "/v1/models?limit=1", "/v1/chat/completions?stream=true",
    "/v1/chat/completions?api-version=2024-02-01", "/v1/embeddings?" + "a=b&" * 500, "/v1/models/" + "m" * 300,
)
# Targets httpx would rewrite: sent over a raw socket.
_RAW_PATHS = (
    "//v1/chat/completions", "/v1//chat/completions", "/v1/../v1/chat/completions", "/v1/./chat/completions",
    "/../../../etc/passwd", "/v1/%2e%2e/%2e%2e/stats", "/v1/chat%2Fcompletions", "/v1/chat/completions%2F",
    "/v1/chat/completions;x=1", "/v1/chat/completions#frag", "/v1/chat/completions%00", "/v1/models/%00",
    "/v1/models/gpt-4o-mini%2F..%2F..", "/v1/models/\u00e9\u6f22", "/v1/chat/completions?%zz", "/%", "/%zz",
    "/v1/embeddings/../completions", "/v1/models/..", "/v1/chat/completions?\u00e9=1", "/v1/chat/\tcompletions",
    "*", "/v1/chat/completions" + "/x" * 35_000, "/v1/models?" + "q" * 70_000, "\\v1\\models",
)


def _method_case(rng: random.Random, index: int) -> Case:
    method = rng.choice(_METHODS)
    raw_path = rng.random() < 0.35
    target = rng.choice(_RAW_PATHS if raw_path else _PATHS)
    endpoint = target if target in ENDPOINTS else rng.choice(ENDPOINTS)
    has_body = method in ("POST", "PUT", "PATCH") or (method in ("DELETE", "GET") and rng.random() < 0.2)
    body = _dumps(rng, valid_body(rng, endpoint)) if has_body else b""
    headers = [*(_base_headers(rng) if has_body else [_auth(rng)])]
    case = Case(index, "method.raw_target" if raw_path else "method.path", method, target, tuple(headers), body)
    return _as_raw(case) if raw_path else case


def _as_raw(case: Case, version: str = "HTTP/1.1", half_close: bool = False) -> Case:
    """The same request as exact bytes: host and content-length added unless present."""
    names = {k.lower() for k, _ in case.headers}
    head = [f"{case.method} {case.target} {version}"]
    if "host" not in names:
        head.append("host: fuzz.local")
    head += [f"{k}: {v}" for k, v in case.headers]
    if case.body and "content-length" not in names and "transfer-encoding" not in names:
        head.append(f"content-length: {len(case.body)}")
    raw = ("\r\n".join(head) + "\r\n\r\n").encode("utf-8") + case.body
    return Case(case.index, case.kind, case.method, case.target, case.headers, case.body, raw=raw,
                half_close=half_close, no_answer_ok=case.no_answer_ok)


def _raw_case(rng: random.Random, index: int) -> Case:
    """Requests only a raw socket can send: framing, request lines, header syntax."""
    body = _dumps(rng, valid_body(rng, "/v1/chat/completions"))
    auth = f"authorization: Bearer {rng.choice((LIMITED_KEY, OPEN_KEY))}"
    path = "/v1/chat/completions"

    def request(lines: Iterable[str], payload: bytes = body, line: str = f"POST {path} HTTP/1.1") -> bytes:
        return ("\r\n".join([line, *lines]) + "\r\n\r\n").encode("utf-8", "surrogateescape") + payload

    std = ["host: fuzz.local", "content-type: application/json", auth]
    framed = [*std, f"content-length: {len(body)}"]
    what = rng.choice(("options_star", "content_length", "content_length", "short_body", "chunked", "chunked",
                       "request_line", "request_line", "header_syntax", "header_syntax", "host", "expect",
                       "pipelined", "trailers"))
    method, target, half_close, no_answer_ok = "POST", path, False, False
    if what == "options_star":
        method, target = "OPTIONS", "*"
        raw = request(["host: fuzz.local", auth, *rng.choice(([], ["content-length: 0"], ["max-forwards: 0"]))],
                      b"", "OPTIONS * HTTP/1.1")
    elif what == "content_length":
        value = rng.choice(("abc", "-1", "1.5", "+5", "0x10", "", "99999999999999999999", f" {len(body)} ",
                            f"{len(body)}, {len(body)}", f"{len(body)},{len(body) + 1}", "1e3", "\xe9"))
        lines = [*std, f"content-length: {value}"]
        if rng.random() < 0.3:
            lines = [*std, f"content-length: {len(body)}", f"content-length: {len(body) + rng.choice((0, 1))}"]
        raw = request(lines)
    elif what == "short_body":  # content-length past the body, then half-close: the request can never end
        declared = rng.choice((len(body) + 1, len(body) * 2, 10**9, MAX_BODY + 10, 2**63 - 1))
        raw, half_close, no_answer_ok = request([*std, f"content-length: {declared}"]), True, True
    elif what == "chunked":
        good = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        # (payload, transfer-encoding, more headers, whether the body can ever end)
        payload, te, extra, complete = rng.choice((
            (good, "chunked", [], True), (b"zz\r\n" + body + b"\r\n0\r\n\r\n", "chunked", [], True),
            (f"{len(body):x};ext=1\r\n".encode() + body + b"\r\n0\r\n\r\n", "chunked", [], True),
            (good, "chunked", [f"content-length: {len(body)}"], True), (good, "gzip, chunked", [], True),
            (good, "chunked, chunked", [], True), (body, "identity", [f"content-length: {len(body)}"], True),
            (b"-1\r\n" + body + b"\r\n0\r\n\r\n", "chunked", [], True), (good, "Chunked", [], True),
            (good, "xchunked", [], True), (good[: good.rfind(b"0\r\n\r\n")], "chunked", [], False),
            (f"{len(body) + 5:x}\r\n".encode() + body + b"\r\n0\r\n\r\n", "chunked", [], False),
            (b"ffffffffffffffffff\r\n" + body, "chunked", [], False),
        ))
        raw = request([*std, f"transfer-encoding: {te}", *extra], payload)
        half_close = no_answer_ok = not complete  # the client gives up: the server may just close
    elif what == "request_line":
        line = rng.choice((
            f"POST {path} HTTP/1.0", "GET /v1/models HTTP/1.0", f"POST {path} HTTP/2.0", f"POST {path} HTTP/1.2",
            f"POST {path} http/1.1", f"post {path} HTTP/1.1", f"POST  {path} HTTP/1.1", f"POST {path}  HTTP/1.1",
            f"POST {path} HTTP/1.1 extra", f"POST\t{path}\tHTTP/1.1", f"POST http://fuzz.local{path} HTTP/1.1",
            "GET http://evil.example/v1/models HTTP/1.1", f"POST https://fuzz.local{path} HTTP/1.1",
            "CONNECT fuzz.local:443 HTTP/1.1", f"{'P' * 300} {path} HTTP/1.1", f"POST {path}", "GET /",
            f"POST {path} HTTP/1.1\x00", "POST /v1/chat/\x00completions HTTP/1.1", "FOO(BAR) / HTTP/1.1",
        ))
        parts = line.split()
        method, target = parts[0], parts[1] if len(parts) > 1 else path
        no_answer_ok = line in ("GET /", f"POST {path}")  # HTTP/0.9: nothing to answer in
        raw = request(framed, body, line)
    elif what == "header_syntax":
        odd = rng.choice(("x-a : b", "no-colon-here", " leading-space: x", "x-fold: a\r\n continued",
                          "x-nul: a\x00b", "x(a): b", "\u00e9-name: x", ": empty-name", "x-a:\x7fb", "x-cr: a\rb",
                          "content-type : application/json", "x-a:" + "b" * 70_000, "x-utf8: \u00e9\u6f22"))
        raw = request([*framed, odd])
        if rng.random() < 0.2:  # bare LF line endings
            raw = raw.replace(b"\r\n", b"\n")
    elif what == "host":
        hosts = rng.choice(([], ["host: "], ["host: a", "host: b"], ["host: evil.example:99999"], ["host: [::1"],
                            ["host: a b"], ["host: " + "h" * 5000]))
        raw = request([*hosts, "content-type: application/json", auth, f"content-length: {len(body)}"])
    elif what == "expect":
        raw = request([*framed, "expect: " + rng.choice(("100-continue", "200-ok", "100-continue, x"))])
    elif what == "pipelined":  # two requests in one write: only the first answer is read
        second = request(["host: fuzz.local", auth], b"", "GET /v1/models HTTP/1.1")
        raw = request(framed) + rng.choice((second, b"GARBAGE\r\n\r\n"))
    else:  # trailers after a chunked body (ext_proc request_trailer_mode SEND)
        payload = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\nx-trailer: 1\r\n" + rng.choice(
            (b"", b"grpc-status: 0\r\n", b"content-length: 5\r\n")) + b"\r\n"
        raw = request([*std, "transfer-encoding: chunked", "te: trailers"], payload)
    return Case(index, f"raw.{what}", method, target, (), body, raw=raw, half_close=half_close,
                no_answer_ok=no_answer_ok)


_FAMILIES: tuple[tuple[float, Callable[[random.Random, int], Case]], ...] = (
    (15, lambda rng, i: _body_case(rng, i, mutate=False)),
    (45, lambda rng, i: _body_case(rng, i, mutate=True)),
    (20, _header_case),
    (12, _method_case),
    (8, _raw_case),
)


def make_case(seed: int, index: int) -> Case:
    """Case ``index`` of ``seed``: the same request on every run, whatever the other cases."""
    rng = random.Random(f"llmgw-fuzz/{seed}/{index}")
    family = rng.choices([f for _, f in _FAMILIES], weights=[w for w, _ in _FAMILIES])[0]
    case = family(rng, index)
    if case.raw is None and _needs_raw(case):
        case = _as_raw(case)
    return case


_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # RFC 9110 field names and methods


def _needs_raw(case: Case) -> bool:
    """httpx refuses or rewrites these: header names that are not tokens, values with control
    characters or edge whitespace, methods in lower case."""
    for name, value in case.headers:
        if not _TOKEN.match(name) or re.search(r"[\x00-\x08\x0a-\x1f\x7f]", value) or value != value.strip(" \t"):
            return True
    return not case.method.isupper()


def generate_cases(seed: int, count: int, start: int = 0) -> Iterator[Case]:
    """Cases ``start`` .. ``start + count - 1`` of ``seed``."""
    for index in range(start, start + count):
        yield make_case(seed, index)


# ---------------------------------------------------------------------------------------------
# Answer checking (pure)

# README error table (and the statuses an HTTP front door may need: 408 slow request, 431 headers).
ERROR_STATUSES = frozenset({400, 401, 402, 403, 404, 405, 408, 413, 415, 429, 431, 503})
_SUCCESS_OBJECTS = {"chat": "chat.completion", "completions": "text_completion", "embeddings": "list",
                    "models": "list", "model": "model"}
_CHUNK_OBJECTS = {"chat": "chat.completion.chunk", "completions": "text_completion"}


def operation_of(method: str, target: str) -> str | None:
    """The OpenAI operation a request names (``chat``, ``models``...), or None when the gateway serves
    nothing there."""
    path = target
    if "://" in path:  # absolute form: Envoy routes on its path
        path = "/" + path.split("://", 1)[1].partition("/")[2]
    path = path.partition("?")[0]
    if method == "POST":
        return {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                "/v1/embeddings": "embeddings"}.get(path)
    if method == "GET":
        if path == "/v1/models":
            return "models"
        if path.startswith("/v1/models/") and len(path) > len("/v1/models/"):
            return "model"
    return None


def _request_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _media_type(answer: Answer) -> str:
    return (answer.header("content-type") or "").partition(";")[0].strip().lower()


def _source(answer: Answer) -> str:
    """Who wrote the answer: Envoy's router marks what a pod sent with x-envoy-upstream-service-time."""
    return "pod" if answer.header("x-envoy-upstream-service-time") is not None else "gateway"


def check_answer(case: Case, answer: Answer) -> Violation | None:
    """The first broken promise in ``answer`` to ``case``, or None when it is a documented answer."""
    if answer.status is None:
        if answer.failure == "hang":
            return Violation("hang: no answer within the client timeout", answer.failure)
        if case.no_answer_ok:
            return None
        return Violation("no answer: connection closed without a response", answer.failure or "")
    status, source = answer.status, _source(answer)
    if answer.failure is not None:
        return Violation(f"{status} answer cut off (from {source})", answer.failure)
    if 200 <= status < 300:
        problem = _check_success(case, answer)
        return Violation(f"{status} {problem} (from {source})", _describe(answer)) if problem else None
    if status not in ERROR_STATUSES:
        return Violation(f"{status} status not documented (from {source}, {_media_type(answer) or 'no content-type'})",
                         _describe(answer))
    problem = _check_error(case, answer)
    return Violation(f"{status} {problem} (from {source})", _describe(answer)) if problem else None


def _check_error(case: Case, answer: Answer) -> str | None:
    media = _media_type(answer)
    if media != "application/json":
        return f"error content-type {media or 'missing'}"
    if case.method == "HEAD":
        return None  # no body in an answer to HEAD
    if not answer.body:
        return "error body empty"
    try:
        document = json.loads(answer.body)
    except (ValueError, RecursionError):
        return "error body not JSON"
    error = document.get("error") if isinstance(document, dict) else None
    if not isinstance(error, dict):
        return "error body without an error object"
    for key in ("message", "type", "param", "code"):
        if key not in error:
            return f"error object without {key}"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return "error message or type not a non-empty string"
    if answer.status == 503 and not str(error["code"]).endswith("unavailable"):
        return f"503 code {error['code']} is not a documented unavailability"
    if answer.status == 405 and answer.header("allow") is None:
        return "405 without allow"
    if answer.status == 429 and answer.header("retry-after") is None:
        return "429 without retry-after"
    return None


def _check_success(case: Case, answer: Answer) -> str | None:
    operation = operation_of(case.method, case.target)
    if operation is None:
        return f"success for {case.method} on a path the gateway does not serve"
    if answer.status != 200:
        return "success other than 200"
    media = _media_type(answer)
    request = _request_json(case.body) if operation in ("chat", "completions", "embeddings") else None
    asked_stream = operation in _CHUNK_OBJECTS and isinstance(request, dict) and request.get("stream") is True
    if media == "text/event-stream":
        if operation not in _CHUNK_OBJECTS:
            return f"SSE answer to {operation}"
        if isinstance(request, dict) and not asked_stream:
            return "SSE answer to a request without stream: true"
        options = request.get("stream_options") if isinstance(request, dict) else None
        usage_asked = isinstance(options, dict) and options.get("include_usage") is True
        return _check_sse(answer.body, _CHUNK_OBJECTS[operation], usage_asked or not isinstance(request, dict))
    if media != "application/json":
        return f"success content-type {media or 'missing'}"
    if asked_stream:
        return "JSON answer to a request with stream: true"
    try:
        document = json.loads(answer.body)
    except (ValueError, RecursionError):
        return "success body not JSON"
    if not isinstance(document, dict) or document.get("object") != _SUCCESS_OBJECTS[operation]:
        return f"success body is not a {_SUCCESS_OBJECTS[operation]} object"
    if operation in ("chat", "completions"):
        choices = document.get("choices")
        content_key = "message" if operation == "chat" else "text"
        if not isinstance(choices, list) or not choices or not all(
                isinstance(c, dict) and content_key in c for c in choices):
            return f"{operation} answer without choices carrying {content_key}"
    elif operation in ("embeddings", "models"):
        data = document.get("data")
        kind = "embedding" if operation == "embeddings" else "model"
        if not isinstance(data, list) or not all(isinstance(d, dict) and d.get("object") == kind for d in data):
            return f"{operation} answer whose data are not {kind} objects"
    elif not isinstance(document.get("id"), str):
        return "model answer without an id"
    return None


def _check_sse(body: bytes, chunk_object: str, usage_allowed: bool) -> str | None:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "SSE body not UTF-8"
    datas = []
    for event in re.split(r"\r?\n\r?\n", text.strip()):
        lines = [line[5:].removeprefix(" ") for line in event.splitlines() if line.startswith("data:")]
        if lines:
            datas.append("\n".join(lines))
    if not datas or datas[-1] != "[DONE]":
        return "SSE stream without a final data: [DONE]"
    for data in datas[:-1]:
        try:
            chunk = json.loads(data)
        except ValueError:
            return "SSE event not JSON"
        if not isinstance(chunk, dict) or "error" in chunk:
            return "SSE event is an error" if isinstance(chunk, dict) else "SSE event not an object"
        if chunk.get("object") != chunk_object or not isinstance(chunk.get("choices"), list):
            return f"SSE event is not a {chunk_object}"
        if not usage_allowed and chunk["choices"] == [] and isinstance(chunk.get("usage"), dict):
            return "SSE usage chunk the client did not ask for"
    return None


def _describe(answer: Answer) -> str:
    return (f"status {answer.status}, content-type {answer.header('content-type')!r}, "
            f"body {answer.body[:120]!r}")


# ---------------------------------------------------------------------------------------------
# Tallying and repros (pure)


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def repro(case: Case, answer: Answer, violation: Violation, seed: int) -> dict[str, Any]:
    """What a person needs to see the bug again: the request (clipped), the answer, the replay command."""
    request: dict[str, Any] = {"method": case.method, "target": _clip(case.target),
                               "headers": [[k, _clip(v, 120)] for k, v in case.headers],
                               "body_prefix": case.body[:200].decode("utf-8", "backslashreplace"),
                               "body_bytes": len(case.body)}
    if case.raw is not None:
        request = {"raw_prefix": case.raw[:300].decode("utf-8", "backslashreplace"), "raw_bytes": len(case.raw),
                   "half_close": case.half_close}
    elif case.chunked:
        request["transfer_encoding"] = "chunked"
    return {"kind": violation.kind, "case": case.index, "generator": case.kind, "request": request,
            "answer": {"status": answer.status, "content_type": answer.header("content-type"),
                       "body_prefix": answer.body[:200].decode("utf-8", "backslashreplace"),
                       "failure": answer.failure},
            "replay": f"python -m bench.fuzz --seed {seed} --replay {case.index}"}


@dataclass(slots=True)
class _KindTally:
    count: int = 0
    generators: Counter[str] = field(default_factory=Counter)
    smallest: tuple[int, dict[str, Any]] | None = None


@dataclass(slots=True)
class Tally:
    """Answers by status and violations by kind, each kind with its smallest repro."""

    seed: int
    cases: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    generators: Counter[str] = field(default_factory=Counter)
    violations: int = 0
    first: list[dict[str, Any]] = field(default_factory=list)
    kinds: dict[str, _KindTally] = field(default_factory=dict)

    def add(self, case: Case, answer: Answer, violation: Violation | None) -> None:
        """Count one case."""
        self.cases += 1
        self.generators[case.kind.partition(".")[0]] += 1
        self.answers[str(answer.status) if answer.status is not None else (answer.failure or "?").split(":")[0]] += 1
        if violation is None:
            return
        self.violations += 1
        found = repro(case, answer, violation, self.seed)
        if len(self.first) < 5:
            self.first.append(found)
        kind = self.kinds.setdefault(violation.kind, _KindTally())
        kind.count += 1
        kind.generators[case.kind] += 1
        if kind.smallest is None or case.size < kind.smallest[0]:
            kind.smallest = (case.size, found)

    def report(self) -> dict[str, Any]:
        """The figures for the JSON line."""
        kinds = sorted(self.kinds.items(), key=lambda item: -item[1].count)
        return {
            "cases": self.cases,
            "answers": dict(sorted(self.answers.items())),
            "families": dict(sorted(self.generators.items())),
            "violations": self.violations,
            "violation_kinds": [{"kind": name, "count": k.count, "generators": dict(k.generators.most_common(6)),
                                 "repro": k.smallest[1] if k.smallest else None} for name, k in kinds],
            "first_violations": self.first,
        }


# ---------------------------------------------------------------------------------------------
# Sending (I/O)


async def send_httpx(client: Any, base_url: str, case: Case, timeout: float) -> Answer:
    """Send ``case`` with httpx; collect the whole answer (or what came before a failure)."""
    import httpx

    async def chunks() -> AsyncIterator[bytes]:
        for at in range(0, len(case.body), 1000):
            yield case.body[at:at + 1000]

    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in case.headers]
    content: Any = case.body if case.body or case.method in ("POST", "PUT", "PATCH") else None
    if case.chunked:
        content = chunks()
    request = client.build_request(case.method, base_url + case.target, headers=headers, content=content)
    status: int | None = None
    got: list[tuple[str, str]] = []
    parts: list[bytes] = []
    try:
        async with asyncio.timeout(timeout):
            response = await client.send(request, stream=True)
            status = response.status_code
            got = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in response.headers.raw]
            try:
                async for part in response.aiter_raw():
                    parts.append(part)
            finally:
                await response.aclose()
    except (TimeoutError, httpx.TimeoutException):
        return Answer(status, tuple(got), b"".join(parts), "hang")
    except httpx.LocalProtocolError:
        return await send_raw(base_url, _as_raw(case), timeout)
    except httpx.HTTPError as error:
        failure = f"{type(error).__name__}: {error}"
        return Answer(status, tuple(got), b"".join(parts), failure if status is not None else f"no answer: {failure}")
    return Answer(status, tuple(got), b"".join(parts))


async def send_raw(base_url: str, case: Case, timeout: float) -> Answer:
    """Write ``case.raw`` to a new connection and read the first answer (HTTP/1.1 framing)."""
    assert case.raw is not None
    host, _, port = base_url.removeprefix("http://").partition(":")
    status: int | None = None
    headers: list[tuple[str, str]] = []
    body = bytearray()
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 20)
            try:
                writer.write(case.raw)
                if case.half_close:
                    writer.write_eof()
                await writer.drain()
            except ConnectionError:
                pass  # the server may answer and close before reading everything (431, 413)
            while status is None or 100 <= status < 200:
                head = await reader.readuntil(b"\r\n\r\n")
                status_line, *lines = head.decode("latin-1").split("\r\n")
                status = int(status_line.split(" ")[1])
                fields = (line.partition(":") for line in lines if line)
                headers = [(name.strip().lower(), value.strip()) for name, _, value in fields]
            values = dict(headers)
            if case.method == "HEAD" or status in (204, 304):
                pass
            elif "chunked" in values.get("transfer-encoding", "").lower():
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                    if size == 0:
                        break
                    body += await reader.readexactly(size)
                    await reader.readexactly(2)
            elif "content-length" in values:
                body += await reader.readexactly(int(values["content-length"]))
            else:
                body += await reader.read()
    except TimeoutError:
        return Answer(status, tuple(headers), bytes(body), "hang")
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as error:
        failure = f"{type(error).__name__}: {error}"[:200]
        return Answer(status, tuple(headers), bytes(body), failure if status is not None else f"no answer: {failure}")
    finally:
        if writer is not None:
            writer.close()
    return Answer(status, tuple(headers), bytes(body))


async def send_case(client: Any, base_url: str, case: Case, timeout: float) -> Answer:
    """Send ``case`` the way it needs: httpx, or a raw socket."""
    if case.raw is not None:
        return await send_raw(base_url, case, timeout)
    return await send_httpx(client, base_url, case, timeout)


def _client(concurrency: int, timeout: float) -> Any:
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency))


async def run_cases(base_url: str, cases: Iterable[Case], *, seed: int, concurrency: int = 8, timeout: float = 20.0,
                    on_done: Callable[[Tally], None] | None = None) -> Tally:
    """Send every case (``concurrency`` at a time), check each answer, tally them."""
    tally = Tally(seed)
    pending = iter(cases)
    async with _client(concurrency, timeout) as client:

        async def worker() -> None:
            for case in pending:
                answer = await send_case(client, base_url, case, timeout)
                tally.add(case, answer, check_answer(case, answer))
                if on_done is not None:
                    on_done(tally)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


async def check_slots(base_url: str, limit: int = SLOT_LIMIT, within: float = 10.0) -> dict[str, Any]:
    """Hold ``limit`` streams of the limited tenant at once on the real-time pod, then expect the
    next request refused: no slot leaked, and the limit still bites. Freed slots settle
    asynchronously, so a refusal before ``limit`` is retried until ``within`` seconds."""
    import httpx

    headers = {"authorization": f"Bearer {LIMITED_KEY}"}
    body = {"model": SLOW_MODEL, "messages": [{"role": "user", "content": "hold"}], "stream": True,
            "max_tokens": 4000, "ignore_eos": True}
    deadline = time.monotonic() + within
    held, refused_at, attempts = 0, None, 0
    async with httpx.AsyncClient(base_url=base_url, timeout=30, headers=headers,
                                 limits=httpx.Limits(max_connections=limit + 4)) as client:
        while True:
            attempts += 1
            streams: list[httpx.Response] = []
            # The body iterators are kept: a dropped one is closed by the garbage collector, and
            # closing it hangs up the connection (the slot would be freed, not held).
            readers: list[Any] = []
            try:
                refused_at = None
                for _ in range(limit):
                    response = await client.send(client.build_request("POST", "/v1/chat/completions", json=body),
                                                 stream=True)
                    streams.append(response)
                    readers.append(response.aiter_raw())
                    # Admitted and streaming: the first chunk came (a refusal or an empty answer did not).
                    if response.status_code != 200 or not await anext(readers[-1], b""):
                        refused_at = len(streams)
                        break
                held = len(streams) if refused_at is None else refused_at - 1
                if refused_at is None:
                    extra = await client.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1})
                    return {"limit": limit, "held": held, "attempts": attempts, "next_status": extra.status_code,
                            "ok": extra.status_code == 429}
            finally:
                for response in streams:
                    await response.aclose()
            if time.monotonic() > deadline:
                return {"limit": limit, "held": held, "attempts": attempts, "next_status": None, "ok": False}
            await asyncio.sleep(0.2)  # poll: hung-up streams free their slots as their access-log entries come


# ---------------------------------------------------------------------------------------------
# The stack and the command


@contextmanager
def slow_pod(log_dir: Path) -> Iterator[tuple[str, Any]]:
    """A real-time simulated pod serving SLOW_MODEL (streams last seconds); yields its address and group."""
    from extproc.launcher import ProcessGroup

    group = ProcessGroup(log_dir)
    try:
        child = group.spawn("pod-slow", [sys.executable, "-m", "llmgw_sim", "--host", "127.0.0.1", "--port", "0",
                                         "--model", SLOW_MODEL, "--log-level", "ERROR"])
        url = group.wait_ready_line(child, 30)
        yield url.removeprefix("http://"), group
    finally:
        group.stop()


def dead_children(*groups: Any) -> list[str]:
    """Every child of ``groups`` that died during the run (the supervisor restarts them at once,
    so its record of deaths counts, not only what is down now)."""
    return [f"{e.name} (exit {e.returncode})" for g in groups for e in g.exits] + [
        f"{c.name} (exit {c.proc.returncode})" for g in groups for c in g.children if c.proc.poll() is not None]


@contextmanager
def fuzz_stack(run_dir: Path, workers: int = 2) -> Iterator[tuple[str, list[Any]]]:
    """The fuzzed stack: yields its base URL and the process groups to watch."""
    import yaml

    from extproc.launcher import LocalStack, StackOptions, free_port

    with slow_pod(run_dir / "logs") as (slow, slow_group):
        config = run_dir / "llmgw.yaml"
        config.write_text(yaml.safe_dump(fuzz_config(slow)))
        stack = LocalStack(StackOptions(config_path=config, run_dir=run_dir, port=free_port(), workers=workers,
                                        envoy_concurrency=1, log_level="WARNING", sim_args=FAST_POD_ARGS,
                                        env=KEY_ENV, ready_timeout=60))
        with stack as info:
            yield info.base_url, [stack.group, slow_group]


def _tracebacks(log_dir: Path) -> int:
    return sum(p.read_text(errors="replace").count("Traceback") for p in log_dir.glob("extproc-*.log"))


async def _fuzz(args: argparse.Namespace, base_url: str) -> tuple[Tally, float, dict[str, Any]]:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("fuzz"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[violations]} violations"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("fuzz", total=args.cases, violations=0)
        started = time.perf_counter()
        tally = await run_cases(base_url, generate_cases(args.seed, args.cases), seed=args.seed,
                                concurrency=args.concurrency, timeout=args.timeout,
                                on_done=lambda t: progress.update(task, completed=t.cases, violations=t.violations))
        seconds = time.perf_counter() - started
    slots = await check_slots(base_url)
    return tally, seconds, slots


async def _replay(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    case = make_case(args.seed, args.replay)
    async with _client(1, args.timeout) as client:
        answer = await send_case(client, base_url, case, args.timeout)
    violation = check_answer(case, answer)
    return {"repro": repro(case, answer, violation or Violation("none", ""), args.seed),
            "answer_headers": [list(h) for h in answer.headers], "violation": violation and violation.kind}


def main() -> None:
    """``python -m bench.fuzz``."""
    import orjson

    from bench.common import emit

    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=20.0, help="per request, seconds: past it is a hang")
    parser.add_argument("--workers", type=int, default=2, help="extproc processes")
    parser.add_argument("--replay", type=int, metavar="INDEX", help="send case INDEX of --seed alone and show it")
    parser.add_argument("--keep-logs", type=Path, metavar="DIR", help="run the stack in DIR (kept) for its logs")
    args = parser.parse_args()
    if args.concurrency >= SLOT_LIMIT:
        parser.error(f"--concurrency must stay below the limited tenant's {SLOT_LIMIT} slots")

    with tempfile.TemporaryDirectory(prefix="llmgw-fuzz-") as tmp:
        run_dir = args.keep_logs or Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        with fuzz_stack(run_dir, args.workers) as (base_url, groups):
            if args.replay is not None:
                print(orjson.dumps(asyncio.run(_replay(args, base_url)), option=orjson.OPT_INDENT_2).decode())
                return
            tally, seconds, slots = asyncio.run(_fuzz(args, base_url))
            dead = dead_children(*groups)
        tracebacks = _tracebacks(run_dir / "logs")
    report = tally.report()
    result = {"bench": "fuzz", "seed": args.seed, "cases": tally.cases, "seconds": round(seconds, 1),
              "cases_per_s": round(tally.cases / seconds, 1), "concurrency": args.concurrency,
              "extproc_workers": args.workers, "violations": report.pop("violations") + len(dead) + (not slots["ok"]),
              "dead_children": dead, "slot_check": slots, "extproc_log_tracebacks": tracebacks, **report}
    emit("fuzz", result)
    if result["violations"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
