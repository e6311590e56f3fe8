"""Input-token estimation: media formulas, rules, the fallback, and exact agreement with the
simulated pod's ``usage.prompt_tokens`` (media headers themselves: tests/test_media.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer

from extproc.api import Operation, ParsedRequest, parse_request
from extproc.chat_template import JinjaChatTemplate
from extproc.resources import DEFAULT_TOKENIZER, resolve_resource
from extproc.templates import AUDIO_PLACEHOLDER_TOKENS, IMAGE_PLACEHOLDER_TOKENS, Media
from extproc.tokens import (
    SIM_POD_RULES,
    BpeEstimator,
    CountingRules,
    FallbackEstimator,
    TokenEstimate,
    audio_tokens,
    heuristic_tokens,
    image_tokens,
    openai_tile_tokens,
)
from llmgw_sim import SimOptions, build_app
from llmgw_sim.options import DEFAULT_MODEL
from llmgw_sim.tokens import SimTokenizer
from tests.test_media import b64, gif, png, wav_bytes

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


# ---------------------------------------------------------------------------------------------
# Images


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


# ---------------------------------------------------------------------------------------------
# Audio


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


# A model's own template that adds a system turn of its own, as SmolLM2's and Qwen's do.
DEFAULT_SYSTEM = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
                  "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
                  "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_the_models_own_template_counts_the_whole_rendered_prompt(tokenizer: Tokenizer) -> None:
    template = JinjaChatTemplate.from_string(DEFAULT_SYSTEM)
    estimator = BpeEstimator(tokenizer, chat_template=template)
    messages = [{"role": "user", "content": "Hello there, 12345!"}]
    rendered = len(tokenizer.encode(template(messages, None), add_special_tokens=False))
    estimate = estimator.estimate(chat(messages))
    assert (estimate.total, estimate.exact) == (rendered, True)
    # The default system turn is what the named template (ChatML) alone would miss.
    assert estimate.total > BpeEstimator(tokenizer).estimate(chat(messages)).total
    assert estimate.template == BpeEstimator(tokenizer).estimate(chat(messages)).template  # the split stays


def test_chats_the_models_template_cannot_render_are_counted_turn_by_turn(tokenizer: Tokenizer) -> None:
    refuses = JinjaChatTemplate.from_string("{{ raise_exception('roles must alternate') }}")
    estimator = BpeEstimator(tokenizer, SIM_POD_RULES, chat_template=refuses)
    plain = BpeEstimator(tokenizer, SIM_POD_RULES)
    messages = [{"role": "user", "content": "Hello there"}]
    assert estimator.estimate(chat(messages)) == plain.estimate(chat(messages))
    with_image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                               {"type": "image_url", "image_url": {"url": PNG_URL}}]}]
    renders = BpeEstimator(tokenizer, SIM_POD_RULES, chat_template=JinjaChatTemplate.from_string(DEFAULT_SYSTEM))
    assert renders.estimate(chat(with_image)) == plain.estimate(chat(with_image))  # media: the template sees no image


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
