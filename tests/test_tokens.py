"""Input-token estimation: media headers and formulas, rules, the fallback, and exact agreement
with the simulated pod's ``usage.prompt_tokens``."""

from __future__ import annotations

import base64
import io
import struct
import wave
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer

from extproc.api import Operation, ParsedRequest, parse_request
from extproc.resources import DEFAULT_TOKENIZER, resolve_resource
from extproc.sim import SimOptions, build_app
from extproc.sim.options import DEFAULT_MODEL
from extproc.sim.tokens import SimTokenizer
from extproc.templates import AUDIO_PLACEHOLDER_TOKENS, IMAGE_PLACEHOLDER_TOKENS, Media
from extproc.tokens import (
    SIM_POD_RULES,
    Base64Bytes,
    BpeEstimator,
    CountingRules,
    FallbackEstimator,
    RawBytes,
    TokenEstimate,
    audio_duration,
    audio_tokens,
    data_url_bytes,
    heuristic_tokens,
    image_size,
    image_tokens,
    openai_tile_tokens,
    wav_duration,
)

# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """DeepSeek's byte-level BPE, loaded once for the module (~0.5 s)."""
    return Tokenizer.from_file(str(resolve_resource(DEFAULT_TOKENIZER)))


@pytest.fixture(scope="module")
def pod_estimator(tokenizer: Tokenizer) -> BpeEstimator:
    """Counts like the simulated pod: ChatML, 576 per image, 750 per audio clip."""
    return BpeEstimator(tokenizer, SIM_POD_RULES)


@pytest.fixture(scope="module")
def sim_tokenizer(tokenizer: Tokenizer) -> SimTokenizer:
    """The pod's tokenizer over the same loaded file (its word table takes ~0.25 s)."""
    return SimTokenizer(tokenizer)


@pytest.fixture
async def pod(sim_tokenizer: SimTokenizer) -> AsyncIterator[TestClient]:
    """An in-process simulated pod, generating instantly."""
    app = build_app(SimOptions(time_scale=0.0), sim_tokenizer)
    client = TestClient(TestServer(app))
    await client.start_server()
    yield client
    await client.close()


def chat(messages: list[dict[str, Any]], **fields: Any) -> ParsedRequest:
    return parse_request(Operation.CHAT, orjson.dumps({"model": "m", "messages": messages, **fields}))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---------------------------------------------------------------------------------------------
# Hand-built media headers (just the bytes each parser reads)


def png(width: int, height: int) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I4sII", 13, b"IHDR", width, height) + b"\x08\x02\x00\x00\x00"


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00" * 8


def webp_vp8(width: int, height: int) -> bytes:
    frame = b"\x00\x00\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height)
    return b"RIFF" + struct.pack("<I", 30) + b"WEBP" + b"VP8 " + struct.pack("<I", 10) + frame + b"\x00" * 4


def webp_vp8l(width: int, height: int) -> bytes:
    bits = (width - 1) | (height - 1) << 14
    lossless = b"\x2f" + struct.pack("<I", bits)
    return b"RIFF" + struct.pack("<I", 30) + b"WEBPVP8L" + struct.pack("<I", 5) + lossless + b"\x00" * 6


def webp_vp8x(width: int, height: int) -> bytes:
    canvas = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    flags = b"\x00" * 4
    return b"RIFF" + struct.pack("<I", 30) + b"WEBPVP8X" + struct.pack("<I", 10) + flags + canvas + b"\x00" * 4


def jpeg(width: int, height: int, *, exif_bytes: int = 0, fill: bool = False) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x00" * 9
    app1 = b"\xff\xe1" + struct.pack(">H", exif_bytes + 2) + b"\x00" * exif_bytes if exif_bytes else b""
    sof = (b"\xff" if fill else b"") + b"\xff\xc2" + struct.pack(">HBHH", 17, 8, height, width) + b"\x00" * 12
    return b"\xff\xd8" + app0 + app1 + sof + b"\xff\xda"


@pytest.mark.parametrize(
    ("data", "size"),
    [
        pytest.param(png(1920, 1080), (1920, 1080), id="png"),
        pytest.param(gif(320, 200), (320, 200), id="gif"),
        pytest.param(webp_vp8(1000, 750), (1000, 750), id="webp lossy"),
        pytest.param(webp_vp8l(16383, 1), (16383, 1), id="webp lossless, 14-bit extremes"),
        pytest.param(webp_vp8x(5000, 3000), (5000, 3000), id="webp extended (24-bit canvas)"),
        pytest.param(jpeg(640, 480), (640, 480), id="jpeg progressive SOF2"),
        pytest.param(jpeg(4032, 3024, exif_bytes=60000), (4032, 3024), id="jpeg behind a 60 KB EXIF"),
        pytest.param(jpeg(10, 20, fill=True), (10, 20), id="jpeg with a fill byte"),
        pytest.param(png(0, 10), None, id="zero width is no size"),
        pytest.param(png(100, 100)[:20], None, id="truncated png"),
        pytest.param(b"\xff\xd8\xff\xda", None, id="jpeg scan before any frame"),
        pytest.param(b"\xff\xd8\x00\x00", None, id="jpeg garbage after SOI"),
        pytest.param(b"BM" + b"\x00" * 40, None, id="bmp is not recognised"),
        pytest.param(b"", None, id="empty"),
    ],
)
def test_image_size_from_headers(data: bytes, size: tuple[int, int] | None) -> None:
    assert image_size(RawBytes(data)) == size
    assert image_size(Base64Bytes(b64(data))) == size  # same through lazy base64


@pytest.mark.parametrize("fmt", ["PNG", "GIF", "JPEG", "WEBP"])
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_image_size_of_real_files(fmt: str, mode: str) -> None:
    from PIL import Image  # a dev dependency (via matplotlib): missing, this fails; the parsers use none

    buffer = io.BytesIO()
    Image.new(mode, (123, 45)).save(buffer, format=fmt)
    assert image_size(Base64Bytes(b64(buffer.getvalue()))) == (123, 45)


@pytest.mark.parametrize(
    ("width", "height", "detail", "tokens"),
    [
        pytest.param(1024, 1024, "high", 765, id="1024 square -> 768 square, 4 tiles (OpenAI example)"),
        pytest.param(2048, 4096, "high", 1105, id="2048x4096 -> 768x1536, 6 tiles (OpenAI example)"),
        pytest.param(4096, 8192, "low", 85, id="low detail is flat (OpenAI example)"),
        pytest.param(512, 512, "auto", 255, id="one tile; auto counts as high"),
        pytest.param(100, 100, "high", 255, id="small images are not scaled up"),
        pytest.param(800, 600, "high", 765, id="short side under 768 stays: 2x2 tiles"),
        pytest.param(3000, 1000, "high", 1445, id="fit to 2048x682, short side under 768: 4x2 tiles"),
        pytest.param(768, 2048, "high", 1445, id="the most tiles an image can take: 2x4"),
        pytest.param(0, 10, "high", 85, id="degenerate size costs the base only"),
    ],
)
def test_openai_tile_formula(width: int, height: int, detail: str, tokens: int) -> None:
    assert openai_tile_tokens(width, height, detail) == tokens


@pytest.mark.parametrize(
    ("url", "detail", "tokens"),
    [
        pytest.param("data:image/png;base64," + b64(png(2048, 4096)), "high", 1105, id="data URL read"),
        pytest.param("data:image/gif;base64," + b64(gif(400, 300)), "auto", 255, id="small gif: one tile"),
        pytest.param("https://example.com/cat.jpg", "high", 765, id="remote: default 1024 square"),
        pytest.param("https://example.com/cat.jpg", "low", 85, id="remote low detail needs no size"),
        pytest.param("data:image/png;base64,!!!!", "high", 765, id="unreadable data: default size"),
        pytest.param("data:image/png,no-comma-means-percent", "high", 765, id="not an image: default"),
    ],
)
def test_image_tokens_by_openai_tiles(url: str, detail: str, tokens: int) -> None:
    assert image_tokens(Media("image", url, detail), CountingRules()) == tokens


def test_image_tokens_as_fixed_placeholders() -> None:
    media = Media("image", "data:image/png;base64," + b64(png(4000, 4000)), "high")
    assert image_tokens(media, SIM_POD_RULES) == IMAGE_PLACEHOLDER_TOKENS  # size ignored, like the pod


@pytest.mark.parametrize(
    ("text", "start", "length"),
    [
        pytest.param("aGVsbG8gd29ybGQ=", 0, 5, id="aligned"),
        pytest.param("aGVsbG8gd29ybGQ=", 4, 4, id="mid-group start"),
        pytest.param("aGVsbG8gd29ybGQ=", 9, 10, id="past the end: short read"),
        pytest.param("aGVs\nbG8g\nd29y\nbGQ=", 2, 6, id="MIME line breaks"),
        pytest.param("aGVsbG8gd29ybGQ", 6, 5, id="missing padding"),
    ],
)
def test_base64_reads_any_window(text: str, start: int, length: int) -> None:
    source = Base64Bytes(text)
    assert source.read(start, length) == b"hello world"[start:start + length]
    assert source.size == 11


def test_data_urls() -> None:
    assert data_url_bytes("data:,A%20b").read(0, 3) == b"A b"  # RFC 2397 percent-encoding
    assert data_url_bytes("data:image/png;base64,aGk=").read(0, 2) == b"hi"  # type: ignore[union-attr]
    assert data_url_bytes("data:image/png;base64") is None  # no comma: malformed


# ---------------------------------------------------------------------------------------------
# Audio


def wav_bytes(seconds: float, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(width)
        out.setframerate(rate)
        out.writeframes(b"\x00" * int(seconds * rate) * channels * width)
    return buffer.getvalue()


def with_list_chunk(data: bytes) -> bytes:
    """Insert a LIST chunk of odd length (so followed by a pad byte) between ``fmt `` and ``data``."""
    info = b"INFOISFT" + struct.pack("<I", 3) + b"ab\x00"
    chunk = b"LIST" + struct.pack("<I", len(info)) + info + b"\x00"
    return data[:36] + chunk + data[36:]


def streamed(data: bytes) -> bytes:
    """Mark the data size unknown (0xFFFFFFFF), as streaming encoders do."""
    return data[:40] + b"\xff\xff\xff\xff" + data[44:]


@pytest.mark.parametrize(
    ("data", "seconds"),
    [
        pytest.param(wav_bytes(1.0), 1.0, id="16 kHz mono 16-bit"),
        pytest.param(wav_bytes(2.5, rate=44100, channels=2), 2.5, id="44.1 kHz stereo"),
        pytest.param(with_list_chunk(wav_bytes(0.5)), 0.5, id="LIST chunk before data"),
        pytest.param(streamed(wav_bytes(3.0, rate=8000)), 3.0, id="streamed: size to the end"),
        pytest.param(b"RIFF\x00\x00\x00\x00WAVEdata\x04\x00\x00\x00", None, id="data before fmt"),
        pytest.param(b"ID3\x03" + b"\x00" * 20, None, id="not a wav"),
    ],
)
def test_wav_duration(data: bytes, seconds: float | None) -> None:
    assert wav_duration(Base64Bytes(b64(data))) == (None if seconds is None else pytest.approx(seconds))


@pytest.mark.parametrize(
    ("data", "fmt", "seconds"),
    [
        pytest.param(wav_bytes(2.0), "wav", 2.0, id="wav from its header"),
        pytest.param(b"\x00" * 64000, "wav", 2.0, id="headerless wav: 32000 B/s"),
        pytest.param(b"\x00" * 32000, "mp3", 2.0, id="mp3: 128 kbit/s = 16000 B/s"),
    ],
)
def test_audio_duration(data: bytes, fmt: str, seconds: float) -> None:
    assert audio_duration(Base64Bytes(b64(data)), fmt) == pytest.approx(seconds, rel=1e-3)


@pytest.mark.parametrize(
    ("rules", "tokens"),
    [
        pytest.param(CountingRules(), 50, id="2 s x 25 tokens/s"),
        pytest.param(CountingRules(audio_tokens_per_second=10), 20, id="2 s x 10 tokens/s"),
        pytest.param(SIM_POD_RULES, AUDIO_PLACEHOLDER_TOKENS, id="fixed placeholder, like the pod"),
    ],
)
def test_audio_tokens(rules: CountingRules, tokens: int) -> None:
    media = Media("audio", {"data": b64(wav_bytes(2.0)), "format": "wav"})
    assert audio_tokens(media, rules) == tokens


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"template": "alpaca"}, "unknown chat template", id="unknown template"),
        pytest.param({"image_tokens": "tiles"}, "image_tokens", id="bad image rule"),
        pytest.param({"image_tokens": -1}, "image_tokens", id="negative image count"),
        pytest.param({"audio_tokens": True}, "audio_tokens", id="bool is not a count"),
        pytest.param({"audio_tokens_per_second": 0}, "positive", id="zero rate"),
    ],
)
def test_rules_are_validated(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CountingRules(**fields)


# ---------------------------------------------------------------------------------------------
# Estimates


def test_breakdown_by_kind(pod_estimator: BpeEstimator) -> None:
    plain = pod_estimator.estimate(chat([{"role": "user", "content": "Hello there"}]))
    assert (plain.tools, plain.images, plain.audio) == (0, 0, 0)
    assert plain.text == 2  # "Hello", " there"
    assert plain.template == 14 + 9  # one message's markers + the generation prompt ("ass", "istant")
    media = pod_estimator.estimate(chat([{"role": "user", "content": [
        {"type": "text", "text": "Hello there"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]))
    assert (media.images, media.audio) == (576, 750)
    tools = pod_estimator.estimate(chat([{"role": "user", "content": "Hello there"}],
                                        tools=[{"type": "function", "function": {"name": "f"}}]))
    assert tools.tools > 0 and tools.total == plain.total + tools.tools


def test_schema_counts_only_when_the_rules_say(tokenizer: Tokenizer) -> None:
    request = chat([{"role": "user", "content": "x"}], response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}})
    assert BpeEstimator(tokenizer).estimate(request).tools == 0  # vLLM: guided decoding
    assert BpeEstimator(tokenizer, CountingRules(count_response_schema=True)).estimate(request).tools > 0


@pytest.mark.parametrize(
    ("operation", "body", "tokens"),
    [
        pytest.param(Operation.COMPLETIONS, {"prompt": [1, 2, 3]}, 3, id="token ids"),
        pytest.param(Operation.COMPLETIONS, {"prompt": [[1, 2], [3]]}, 3, id="lists of ids: summed"),
        pytest.param(Operation.COMPLETIONS, {"prompt": "Hello there", "n": 4}, 2, id="n: once per prompt"),
        pytest.param(Operation.COMPLETIONS, {"prompt": ["Hello", "Hello there"]}, 3, id="prompts summed"),
        pytest.param(Operation.EMBEDDINGS, {"input": ["Hello", "Hello there"]}, 3, id="embeddings: strings"),
        pytest.param(Operation.EMBEDDINGS, {"input": [[5, 6], [7]]}, 3, id="embeddings: ids"),
    ],
)
def test_prompts_without_template(pod_estimator: BpeEstimator, operation: Operation,
                                  body: dict[str, Any], tokens: int) -> None:
    request = parse_request(operation, orjson.dumps({"model": "m", **body}))
    assert pod_estimator.estimate(request) == TokenEstimate(text=tokens)


def test_long_texts_bypass_the_cache(tokenizer: Tokenizer) -> None:
    estimator = BpeEstimator(tokenizer, cache_size=2, cache_max_chars=10)
    assert estimator.count_text("a" * 11 + " b") == estimator.count_text("a" * 11 + " b")
    for word in ("one", "two", "three"):
        estimator.count_text(word)
    assert estimator._cached.cache_info().currsize == 2  # type: ignore[attr-defined]  # bounded


def test_turnwise_counting_is_checked(tokenizer: Tokenizer) -> None:
    assert BpeEstimator(tokenizer).turnwise  # DeepSeek's pre-tokenizer splits after "<|im_end|>\n"


# Casual chat to digits: the fallback's error against DeepSeek's BPE, as its docstring states.
FALLBACK_SAMPLES = [
    pytest.param("hey, can you help me write a short email to my landlord about the broken heater? "
                 "it's been cold for a week and I'd like it fixed by friday. thanks!", 0.05, id="chat"),
    pytest.param("The gateway estimates how many tokens a request will cost before it reaches the "
                 "model server, so that quotas can be reserved up front and reconciled later. " * 3,
                 0.35, id="prose: over"),
    pytest.param('{"type":"object","properties":{"city":{"type":"string","description":"City"},'
                 '"unit":{"type":"string","enum":["c","f"]}},"required":["city"]}', 0.40, id="json: under"),
    pytest.param("大模型API网关已成为企业级AI基础设施的核心组件承担请求路由、鉴权限流、协议转换。",
                 0.80, id="cjk: over"),
    pytest.param("Order 12345678 shipped 2024-05-17 13:45:09, total $1,234.56.", 0.50, id="digits: under"),
]


@pytest.mark.parametrize(("text", "bound"), FALLBACK_SAMPLES)
def test_fallback_error_is_as_documented(pod_estimator: BpeEstimator, text: str, bound: float) -> None:
    exact = pod_estimator.count_text(text)
    assert abs(heuristic_tokens(text) - exact) <= bound * exact


def test_fallback_estimate_is_marked_inexact() -> None:
    estimate = FallbackEstimator(SIM_POD_RULES).estimate(chat([{"role": "user", "content": "abcdefgh"}]))
    assert estimate.exact is False
    assert estimate.text == 2  # 8 ASCII characters / 4
    assert estimate.template == 8 + 6  # markers by the heuristic: 5 + 3, then "<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------
# Accuracy against the simulated pod

LONG_TEXT = (
    "Section 4.2 of RFC 9110 says a server MAY ignore a range request; clients MUST cope. "
    "def tiles(w: int, h: int) -> int:\n    return -(-w // 512) * -(-h // 512)\n\n"
    "大模型API网关承担请求路由、鉴权限流、协议转换。東京は日本の首都です。 "
    "Prices: $1,234.56 / 7,890.12 EUR; ids 0xDEADBEEF, 1234567890123. Émigré café naïve. 🎉👍\n"
) * 28  # 7.9k characters: counted exactly (past EXACT_CHARS a request's text is sampled)

PNG_URL = "data:image/png;base64," + b64(png(800, 600))
AUDIO = {"data": b64(wav_bytes(1.0)), "format": "wav"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

ACCURACY_CASES = [
    pytest.param([{"role": "user", "content": "Hi"}], {}, id="plain"),
    pytest.param([{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
                  {"role": "user", "content": "And times 3?"}], {}, id="multi-turn"),
    pytest.param([{"role": "system", "content": "You are terse.  "},
                  {"role": "developer", "content": "\n\nAnswer in French.\n"},
                  {"role": "user", "content": "  leading and trailing spaces  "}], {},
                 id="system + developer"),
    pytest.param([{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                  {"role": "tool", "content": "{\"temp_c\": 21}", "tool_call_id": "c1"}],
                 {"tools": TOOLS, "tool_choice": "auto"}, id="tools and a call"),
    pytest.param([{"role": "user", "content": [
        {"type": "text", "text": "Compare these:"},
        {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "high"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/b.jpg"}},
        {"type": "text", "text": " and listen:"},
        {"type": "input_audio", "input_audio": AUDIO}]}], {}, id="multimodal"),
    pytest.param([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URL}}]}], {},
                 id="image only"),
    pytest.param([{"role": "system", "content": "Summarise."}, {"role": "user", "content": LONG_TEXT}], {},
                 id="long mixed text"),
    pytest.param([{"role": "user", "content": "<｜begin▁of▁sentence｜><|im_end|> 1234567 \n\n\n"}], {},
                 id="special-token text and digits"),
    pytest.param([{"role": "user", "content": "Say no."},
                  {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
                  {"role": "function", "content": None, "name": "f"}], {}, id="refusal part, function role"),
]


@pytest.fixture(scope="module")
def merged_estimator(tokenizer: Tokenizer) -> BpeEstimator:
    """The path taken for a tokenizer that may merge tokens across turns: the whole prompt at once."""
    estimator = BpeEstimator(tokenizer, SIM_POD_RULES)
    estimator.turnwise = False
    return estimator


@pytest.mark.parametrize("turnwise", [True, False], ids=["turn by turn", "whole prompt"])
@pytest.mark.parametrize(("messages", "fields"), ACCURACY_CASES)
async def test_chat_estimate_matches_pod_usage(pod: TestClient, pod_estimator: BpeEstimator,
                                               merged_estimator: BpeEstimator, turnwise: bool,
                                               messages: list[dict[str, Any]], fields: dict[str, Any]) -> None:
    body = {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 1, **fields}
    response = await pod.post("/v1/chat/completions", data=orjson.dumps(body),
                              headers={"content-type": "application/json"})
    assert response.status == 200, await response.text()
    usage = (await response.json())["usage"]
    estimator = pod_estimator if turnwise else merged_estimator
    estimate = estimator.estimate(parse_request(Operation.CHAT, orjson.dumps(body)))
    assert estimate.total == usage["prompt_tokens"]  # exact, not merely within 2%


@pytest.mark.parametrize(
    ("path", "operation", "fields"),
    [
        pytest.param("/v1/completions", Operation.COMPLETIONS, {"prompt": LONG_TEXT[:3000]},
                     id="completion text"),
        pytest.param("/v1/completions", Operation.COMPLETIONS, {"prompt": ["a b", "c d e"], "n": 2},
                     id="completion prompts"),
        pytest.param("/v1/embeddings", Operation.EMBEDDINGS, {"input": ["Hello", LONG_TEXT[:500]]},
                     id="embedding inputs"),
    ],
)
async def test_prompt_estimate_matches_pod_usage(pod: TestClient, pod_estimator: BpeEstimator, path: str,
                                                 operation: Operation, fields: dict[str, Any]) -> None:
    body = {"model": DEFAULT_MODEL, "max_tokens": 1, **fields} if operation is not Operation.EMBEDDINGS \
        else {"model": DEFAULT_MODEL, **fields}
    response = await pod.post(path, data=orjson.dumps(body), headers={"content-type": "application/json"})
    assert response.status == 200, await response.text()
    usage = (await response.json())["usage"]
    estimate = pod_estimator.estimate(parse_request(operation, orjson.dumps(body)))
    assert estimate.total == usage["prompt_tokens"]
