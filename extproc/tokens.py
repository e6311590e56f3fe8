"""Input-token estimation: how many prompt tokens a validated request will cost on its model.

Pure (no I/O past loading a tokenizer file once): a ``ParsedRequest`` in, a ``TokenEstimate`` out,
broken down into text, chat-template overhead, tool definitions (and schemas), images and audio.

* ``BpeEstimator`` counts with the model's own ``tokenizers`` tokenizer, rendering chats with the
  very template the server uses (``extproc.templates``, or the model's own Jinja template where
  the config names one), so for text it matches the server's ``usage.prompt_tokens`` exactly
  (tested against ``llmgw_sim`` and against llama.cpp serving SmolLM2) up to ``EXACT_CHARS`` of text
  per request. Past that a request's long texts are estimated from sampled windows
  (``SampledCounter``): what a request costs to count stops growing with its prompt.
* ``FallbackEstimator`` is the heuristic for a model without a tokenizer file.

Media follow ``CountingRules``, per model: images by OpenAI's tile formula or a fixed placeholder
count (what a LLaVA-style server such as the simulated pod charges), audio by its duration or a
fixed count. Image sizes and audio durations come from their headers (``extproc.media``), read
straight out of the base64 text without decoding the whole payload.

Input tokens are counted once per prompt, never per choice: ``n`` and ``best_of`` multiply output
tokens only (OpenAI and vLLM ``usage.prompt_tokens`` alike). A completions request with several
prompts costs the sum of its prompts; a prompt given as token ids costs its length.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal, Protocol

import orjson
from tokenizers import Tokenizer

from extproc.api import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ParsedRequest
from extproc.media import Base64Bytes, audio_duration, data_url_bytes, image_size
from extproc.resources import resolve_resource
from extproc.templates import Media, TemplateError, Turn, get_template, text_runs, to_segments

# ---------------------------------------------------------------------------------------------
# Rules and results

ImageCounting = Literal["openai-tiles"] | int
AudioCounting = Literal["duration"] | int

# OpenAI vision pricing ("Calculating costs", detail high/auto): 85 base + 170 per 512 px tile.
_TILE_TOKENS = 170
_BASE_IMAGE_TOKENS = 85
_TILE_PX = 512
_FIT_PX = 2048
_SHORT_SIDE_PX = 768
# Whisper-style encoders (Qwen2-Audio): one token per 40 ms of audio.
DEFAULT_AUDIO_TOKENS_PER_SECOND = 25.0
# An image whose size is unknown (remote URL, unreadable header) counts as a 1024 px square:
# 765 tokens, the cost of any square of at least 768 px. The most a high-detail image can cost is
# 8 tiles (768 x 2048 after scaling): 1445 tokens.
DEFAULT_IMAGE_SIZE = (1024, 1024)


@dataclass(frozen=True, slots=True)
class CountingRules:
    """How the server behind one model turns a request into prompt tokens.

    ``template``: the chat template's name in ``extproc.templates.TEMPLATES``.
    ``image_tokens``: ``"openai-tiles"`` (OpenAI's tile formula by detail and size) or a fixed
    count per image (a placeholder-style server: ``llmgw_sim`` uses 576).
    ``audio_tokens``: ``"duration"`` (seconds x ``audio_tokens_per_second``, rounded up) or a fixed
    count per clip (``llmgw_sim`` uses 750).
    ``count_response_schema``: whether a ``response_format`` JSON schema is put into the prompt
    (OpenAI structured outputs do; vLLM's guided decoding constrains sampling and adds nothing).
    """

    template: str = "chatml"
    image_tokens: ImageCounting = "openai-tiles"
    audio_tokens: AudioCounting = "duration"
    audio_tokens_per_second: float = DEFAULT_AUDIO_TOKENS_PER_SECOND
    default_image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE
    count_response_schema: bool = False

    def __post_init__(self) -> None:
        get_template(self.template)  # an unknown name fails here, at config compile time
        if not (self.image_tokens == "openai-tiles" or _count(self.image_tokens)):
            raise ValueError(f"image_tokens: expected 'openai-tiles' or a count >= 0, "
                             f"got {self.image_tokens!r}")
        if not (self.audio_tokens == "duration" or _count(self.audio_tokens)):
            raise ValueError(f"audio_tokens: expected 'duration' or a count >= 0, "
                             f"got {self.audio_tokens!r}")
        if not self.audio_tokens_per_second > 0:
            raise ValueError("audio_tokens_per_second must be positive")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# The simulated pod (llmgw_sim): ChatML, fixed media placeholders (see extproc.templates).
SIM_POD_RULES = CountingRules(image_tokens=576, audio_tokens=750)


@dataclass(frozen=True, slots=True)
class TokenEstimate:
    """Estimated input tokens of one request, by kind; ``exact`` is False for a heuristic count.

    ``template`` is the chat template's role markers and generation prompt; ``tools`` the tool
    definitions turn (and the response schema when the rules count it). BPE may merge a token
    across the boundary between a marker and its content, so the text/template split can be off by
    a token per message; ``total`` is what the server counts.
    """

    text: int = 0
    template: int = 0
    tools: int = 0
    images: int = 0
    audio: int = 0
    exact: bool = True

    @property
    def total(self) -> int:
        """All input tokens: what ``usage.prompt_tokens`` should report."""
        return self.text + self.template + self.tools + self.images + self.audio


class TokenEstimator(Protocol):
    """Estimates the input tokens of a validated request for one model."""

    rules: CountingRules

    def estimate(self, request: ParsedRequest) -> TokenEstimate:
        """Input tokens of ``request`` (chat, completions or embeddings)."""
        ...

    def count_text(self, text: str) -> int:
        """Tokens of plain ``text`` (no template, no special tokens)."""
        ...


# ---------------------------------------------------------------------------------------------
# Estimators


# What one request may cost to count. Its text is encoded exactly up to EXACT_CHARS characters in
# all: DeepSeek's BPE takes ~0.3 us a character (a 4 KB prompt ~1 ms of a core, a 220 KB one ~80 ms).
# Past that, a long text is estimated from SAMPLE_WINDOWS windows of WINDOW_CHARS characters (~1 ms
# in all, whatever its length), and once MAX_ENCODED_CHARS were encoded the rest counts at the token
# rate seen so far: no request encodes more than that, whatever it holds.
EXACT_CHARS = 8192
SAMPLE_WINDOWS = 64
WINDOW_CHARS = 64
MAX_ENCODED_CHARS = 65_536
SHORT_CHARS = 64  # template markers and the like: always exact (the LRU keeps them)
# The sampled estimate's error, measured on 220 KB and 1 MB texts of prose, code, JSON and Chinese,
# mixed in 20 KB blocks or in halves (tests/test_token_sampling.py, 50 seeded draws of each): the
# standard deviation of the relative error is 0.2-3.2%, the mean within 2.5% (+2% on JSON, whose
# windows cut tokens for want of spaces), and no draw of the 600 was off by more than 9.3%. The
# bound, 10%, is about 3 standard deviations of the widest kind: a rare estimate may pass it.
SAMPLED_ERROR_BOUND = 0.10


class SampledCounter:
    """Counts one request's texts at a bounded cost (a callable, one per request).

    - texts up to ``SHORT_CHARS``, and any text while the request has encoded at most
      ``EXACT_CHARS``, are encoded exactly (``exact_len``: the estimator's LRU);
    - a text of at least twice the sample is estimated from ``SAMPLE_WINDOWS`` windows of
      ``WINDOW_CHARS`` (``sample_len`` encodes them in one batch), one at a random offset in each
      of as many equal strata (a prompt whose kind changes along it, prose then code, is sampled in
      each part), each widened to the next space so no word is cut: its count is the windows'
      tokens per character times its length;
    - other texts, and any once ``MAX_ENCODED_CHARS`` were encoded (thousands of messages), count at
      the token rate seen so far in this request.

    The offsets are random per request, so no prompt can be written to be undercounted; and an
    admission estimate is only a reservation: settlement charges what the pod reports.
    ``exact`` is False once anything was estimated.
    """

    __slots__ = ("_exact_len", "_sample_len", "_rng", "_spent", "_tokens", "_chars", "exact")

    def __init__(self, exact_len: Callable[[str], int], sample_len: Callable[[list[str]], int],
                 rng: random.Random | None = None) -> None:
        self._exact_len = exact_len
        self._sample_len = sample_len
        self._rng = rng or _RNG
        self._spent = 0  # characters encoded for this request
        self._tokens = self._chars = 0  # what the encoded texts held: the request's token rate
        self.exact = True

    def __call__(self, text: str) -> int:
        size = len(text)
        if size <= SHORT_CHARS:
            return self._exact_len(text) if size else 0
        if self._spent + size <= EXACT_CHARS:
            tokens = self._exact_len(text)
            self._note(size, tokens)
            return tokens
        self.exact = False
        sample = SAMPLE_WINDOWS * WINDOW_CHARS
        if size >= 2 * sample and self._spent + sample <= MAX_ENCODED_CHARS:
            return self._sampled(text)
        if not self._chars:
            return heuristic_tokens(text)
        return round(size * self._tokens / self._chars)

    def _note(self, chars: int, tokens: int) -> None:
        self._spent += chars
        self._tokens += tokens
        self._chars += chars

    def _sampled(self, text: str) -> int:
        size = len(text)
        stratum = size / SAMPLE_WINDOWS
        slack = WINDOW_CHARS // 4
        windows = []
        chars = 0
        for i in range(SAMPLE_WINDOWS):
            start = int(i * stratum + self._rng.random() * (stratum - WINDOW_CHARS))
            space = text.find(" ", start, start + slack)
            start = space if space >= 0 else start  # begin at a word's leading space, as BPE splits
            end = start + WINDOW_CHARS
            space = text.find(" ", end, end + slack)
            end = space if space >= 0 else end
            windows.append(text[start:end])
            chars += end - start
        tokens = self._sample_len(windows)
        self._note(chars, tokens)
        return round(size * tokens / chars)


_RNG = random.Random()


ChatRenderer = Callable[[object, object], str]  # (messages, tools) -> prompt; TemplateError if it cannot


class BpeEstimator:
    """Counts with the model's ``tokenizers`` tokenizer (any ``tokenizer.json``).

    Chat prompts are encoded turn by turn, and each turn's token count is kept in an LRU of
    ``cache_size`` entries (texts up to ``cache_max_chars`` characters), so a system prompt or a
    conversation's earlier turns are not encoded again on the next request. That equals encoding
    the whole prompt only when the tokenizer's pre-tokenizer always splits between turns; it is
    checked on a probe conversation at construction, and where it fails the prompt is encoded the
    way the server does (media placeholders split it, nothing else), uncached.

    ``chat_template``: the model's own template (``models[].chat_template``: a default system turn,
    its own markers). A text-only chat is then rendered with it and the whole prompt counted, as
    the server does; the named template only splits that total into text and markers. Chats with
    media, or that it cannot render, are counted turn by turn.
    """

    def __init__(self, tokenizer: Tokenizer, rules: CountingRules = CountingRules(), *,
                 chat_template: ChatRenderer | None = None, cache_size: int = 4096,
                 cache_max_chars: int = 8192) -> None:
        self.rules = rules
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._template = get_template(rules.template)
        self._cache_max_chars = cache_max_chars
        self._cached: Callable[[str], int] = lru_cache(maxsize=cache_size)(self._encode_len)
        self.turnwise = self._splits_between_turns()

    @classmethod
    def from_spec(cls, spec: str, rules: CountingRules = CountingRules(), *,
                  chat_template: ChatRenderer | None = None, **options: int) -> BpeEstimator:
        """Load the ``tokenizer.json`` named by ``spec`` (a path or ``pkg:<package>/<file>``)."""
        return cls(Tokenizer.from_file(str(resolve_resource(spec))), rules, chat_template=chat_template, **options)

    def _encode_len(self, text: str) -> int:
        # No special tokens: the template writes its own markers (as the server encodes it).
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def count_text(self, text: str) -> int:
        """Tokens of ``text``; texts up to ``cache_max_chars`` go through the LRU."""
        if not text:
            return 0
        if len(text) <= self._cache_max_chars:
            return self._cached(text)
        return self._encode_len(text)

    def _sample_len(self, texts: list[str]) -> int:
        # encode_batch_fast skips the offsets nobody reads here (a quarter of encode's time)
        return sum(len(e) for e in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False))

    def counter(self, rng: random.Random | None = None) -> SampledCounter:
        """A counter for one request's texts: exact up to ``EXACT_CHARS``, sampled past them."""
        return SampledCounter(self.count_text, self._sample_len, rng)

    def estimate(self, request: ParsedRequest) -> TokenEstimate:
        """Input tokens of ``request``, exact for text when the template matches the server's and
        the request holds at most ``EXACT_CHARS`` of it (else within ``SAMPLED_ERROR_BOUND``,
        and ``exact`` is False)."""
        count = self.counter()
        if isinstance(request.model, ChatCompletionRequest):
            turns = self._template(request.raw.get("messages"), request.raw.get("tools"))
            rendered = self._rendered(request, turns)
            if rendered is not None:
                estimate = _rendered_estimate(rendered, turns, request, count, self.rules)
            elif self.turnwise:
                estimate = _chat_estimate(turns, request, count, self.rules, exact=True)
            else:
                estimate = self._chat_merged(turns, request, count)
            return estimate if count.exact else replace(estimate, exact=False)
        return TokenEstimate(text=_prompt_tokens(request, count), exact=count.exact)

    def _rendered(self, request: ParsedRequest, turns: tuple[Turn, ...]) -> str | None:
        """The prompt as the model's own template writes it; None without one, for a chat with
        media (the template sees text only), or one it cannot render (the pod will refuse it)."""
        if self._chat_template is None or any(isinstance(p, Media) for turn in turns for p in turn.body):
            return None
        try:
            return self._chat_template(request.raw.get("messages"), request.raw.get("tools"))
        except TemplateError:
            return None

    def _chat_merged(self, turns: tuple[Turn, ...], request: ParsedRequest, count: SampledCounter) -> TokenEstimate:
        """Encode the text runs between media exactly as the server does; attribute afterwards."""
        split = _chat_estimate(turns, request, count, self.rules, exact=True)
        schema = _schema_tokens(request, count, self.rules)
        merged_count = self.counter()
        merged = sum(merged_count(seg) for seg in to_segments(turns) if isinstance(seg, str))
        count.exact = count.exact and merged_count.exact
        text = max(0, merged - split.template - (split.tools - schema))
        return TokenEstimate(text=text, template=split.template, tools=split.tools,
                             images=split.images, audio=split.audio)

    def _splits_between_turns(self) -> bool:
        """Whether encoding turn by turn gives the same count as encoding the merged prompt."""
        turns = self._template(_PROBE_MESSAGES, _PROBE_TOOLS)
        turnwise = sum(self._encode_len(run) for turn in turns for run in text_runs(turn))
        merged = sum(self._encode_len(seg) for seg in to_segments(turns) if isinstance(seg, str))
        return turnwise == merged


# Turn endings and openings that tempt a BPE pre-tokenizer to merge across the boundary.
_PROBE_MESSAGES = [
    {"role": "system", "content": "You are terse.  "},
    {"role": "user", "content": "\n\nNumbers 12345, 中文文本, <|tags|> and trailing newlines\n\n\n"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "content": " 42 ", "tool_call_id": "c1"},
    {"role": "user", "content": [{"type": "text", "text": "a"},
                                 {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}},
                                 {"type": "text", "text": " b?!"}]},
]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


class FallbackEstimator:
    """A heuristic for a model that has no tokenizer file: ``heuristic_tokens`` of each text part
    and of each of the template's role markers, media as ``rules`` say.

    How far off it is, against DeepSeek's byte-level BPE (the samples in tests/test_tokens.py):
    casual chat within a few percent; English prose over by about 30% (that vocabulary packs
    about 5 characters per token); code, JSON and emoji under by 10-40%, digit strings by up to
    50% (digits are split in groups of three); CJK over by up to about 80% (about 1.7 characters
    per token there). ChatML's markers: 8 by the heuristic where that BPE takes 14. Meant for
    quota reservations that are reconciled with the server's reported usage afterwards, never
    for billing.
    """

    def __init__(self, rules: CountingRules = CountingRules()) -> None:
        self.rules = rules
        self._template = get_template(rules.template)

    def count_text(self, text: str) -> int:
        """``heuristic_tokens(text)``."""
        return heuristic_tokens(text)

    def estimate(self, request: ParsedRequest) -> TokenEstimate:
        """Heuristic input tokens of ``request``; ``exact`` is False."""
        if isinstance(request.model, ChatCompletionRequest):
            turns = self._template(request.raw.get("messages"), request.raw.get("tools"))
            return _chat_estimate(turns, request, heuristic_tokens, self.rules, exact=False)
        return TokenEstimate(text=_prompt_tokens(request, heuristic_tokens), exact=False)


def heuristic_tokens(text: str) -> int:
    """About 4 ASCII characters per token (OpenAI's rule of thumb for English), plus one token
    per non-ASCII character (CJK runs about one per character; accented Latin overcounts)."""
    if text.isascii():
        return -(-len(text) // 4)
    ascii_chars = len(text.encode("ascii", "ignore"))
    return -(-ascii_chars // 4) + len(text) - ascii_chars


# ---------------------------------------------------------------------------------------------
# Request walking (shared by the estimators)


def _chat_estimate(turns: tuple[Turn, ...], request: ParsedRequest, count: Callable[[str], int],
                   rules: CountingRules, *, exact: bool) -> TokenEstimate:
    """Count turn by turn. An exact counter encodes each text run (markers included) as the
    server does, and the markers alone are attributed to the template; a heuristic counter is
    applied to markers and content separately (it is not additive over concatenation)."""
    text = template = tools = images = audio = 0
    for turn in turns:
        markers = count(turn.prefix) + count(turn.suffix)
        if exact:
            tokens = sum(count(run) for run in text_runs(turn))
            markers = min(tokens, markers)
        else:
            tokens = markers + sum(count(part) for part in turn.body if isinstance(part, str))
        if turn.role == "tools":
            tools += tokens
        else:
            template += markers
            text += tokens - markers
        for part in turn.body:
            if isinstance(part, Media):
                if part.kind == "image":
                    images += image_tokens(part, rules)
                else:
                    audio += audio_tokens(part, rules)
    tools += _schema_tokens(request, count, rules)
    return TokenEstimate(text, template, tools, images, audio, exact)


def _rendered_estimate(prompt: str, turns: tuple[Turn, ...], request: ParsedRequest, count: SampledCounter,
                       rules: CountingRules) -> TokenEstimate:
    """The whole ``prompt`` counted (markers, default turns and all, as the server encodes it);
    the named template's turn-by-turn count only splits it into markers, tools and text."""
    split = _chat_estimate(turns, request, count, rules, exact=True)
    total = count(prompt) + _schema_tokens(request, count, rules)
    template = min(split.template, total)
    tools = min(split.tools, total - template)
    return TokenEstimate(text=total - template - tools, template=template, tools=tools)


def _schema_tokens(request: ParsedRequest, count: Callable[[str], int], rules: CountingRules) -> int:
    model = request.model
    if not rules.count_response_schema or not isinstance(model, ChatCompletionRequest):
        return 0
    response_format = request.raw.get("response_format")
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return 0
    return count(orjson.dumps(response_format.get("json_schema")).decode())


def _prompt_tokens(request: ParsedRequest, count: Callable[[str], int]) -> int:
    """Completions ``prompt`` / embeddings ``input``: strings are encoded, token ids counted."""
    model = request.model
    if isinstance(model, CompletionRequest):
        prompt = model.prompt
    elif isinstance(model, EmbeddingRequest):
        prompt = model.input
    else:
        raise TypeError(f"not a request model: {type(model).__name__}")
    if isinstance(prompt, str):
        return count(prompt)
    total = 0
    for item in prompt:
        if isinstance(item, str):
            total += count(item)
        elif isinstance(item, list):
            total += len(item)
        else:
            total += 1  # a flat list of token ids: one id each
    return total


# ---------------------------------------------------------------------------------------------
# Images


def image_tokens(media: Media, rules: CountingRules) -> int:
    """Tokens of one image part under ``rules``."""
    if rules.image_tokens != "openai-tiles":
        return rules.image_tokens
    if media.detail == "low":
        return _BASE_IMAGE_TOKENS
    size = None
    if isinstance(media.source, str) and media.source.startswith("data:"):
        source = data_url_bytes(media.source)
        size = image_size(source) if source is not None else None
    width, height = size or rules.default_image_size
    return openai_tile_tokens(width, height, media.detail)


def openai_tile_tokens(width: int, height: int, detail: str = "auto") -> int:
    """OpenAI's vision cost: ``low`` is 85; ``high``/``auto`` scale the image to fit 2048 x 2048,
    then its shortest side down to 768 (never up), and cost 170 per 512 px tile plus 85."""
    if detail == "low":
        return _BASE_IMAGE_TOKENS
    if width <= 0 or height <= 0:
        return _BASE_IMAGE_TOKENS
    longest = max(width, height)
    if longest > _FIT_PX:
        width, height = width * _FIT_PX // longest, height * _FIT_PX // longest
    shortest = min(width, height)
    if shortest > _SHORT_SIDE_PX:
        width, height = width * _SHORT_SIDE_PX // shortest, height * _SHORT_SIDE_PX // shortest
    tiles = -(-width // _TILE_PX) * -(-height // _TILE_PX)
    return _TILE_TOKENS * tiles + _BASE_IMAGE_TOKENS


# ---------------------------------------------------------------------------------------------
# Audio


def audio_tokens(media: Media, rules: CountingRules) -> int:
    """Tokens of one ``input_audio`` part under ``rules``."""
    if rules.audio_tokens != "duration":
        return rules.audio_tokens
    audio = media.source if isinstance(media.source, dict) else {}
    data = audio.get("data")
    if not isinstance(data, str):
        return 0
    seconds = audio_duration(Base64Bytes(data), str(audio.get("format")))
    return math.ceil(seconds * rules.audio_tokens_per_second)
