"""End to end: the response cache through Envoy with the openai client. A deterministic request's
answer is kept from the pod's response (Envoy's Lua filter hands it over in the access-log
entry) and answered again by the gateway, JSON or streamed as the client asks, per tenant; a hit
counts against the tenant's request limit and not its tokens, and goes to the ledger."""

from __future__ import annotations

import hashlib
import itertools
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest

from extproc.launcher import StackInfo
from tests.e2e.conftest import MODEL, small_stack
from tests.helpers import wait_for

KEY_A, KEY_B = "sk-cache-tenant-a", "sk-cache-tenant-b"
CONFIG = {
    "models": [{"name": MODEL, "pool": "local", "cache": {"ttl_s": 300}}],
    "tenants": [
        {"name": "cache-a", "keys": [{"sha256": hashlib.sha256(KEY_A.encode()).hexdigest()}],
         "limits": {"rpm": 1000, "tpm": 1_000_000}},
        {"name": "cache-b", "keys": [{"sha256": hashlib.sha256(KEY_B.encode()).hexdigest()}]},
    ],
}


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    # Two workers: the answer is stored by whichever settles the miss, and found by either.
    with small_stack(tmp_path_factory, "cache", pods=1, extra_config=CONFIG, workers=2, metrics_port=0,
                     sim_args=("--seed", "3", "--record", "1000")) as info:
        yield info


def _client(info: StackInfo, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{info.base_url}/v1", api_key=key, max_retries=0, timeout=30)


def _ask(info: StackInfo, key: str, text: str, **extra: object) -> tuple[dict[str, str], object]:
    raw = _client(info, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], temperature=0, **{"max_tokens": 12, **extra})
    parsed = raw.parse()
    return dict(raw.headers), (list(parsed) if extra.get("stream") else parsed)



def _until_hit(info: StackInfo, key: str, text: str, **extra: object) -> tuple[dict[str, str], object]:
    """The answer is stored once its access-log entry is settled: ask until the cache answers."""
    def hit() -> tuple[dict[str, str], object] | None:
        headers, answer = _ask(info, key, text, **extra)
        return (headers, answer) if headers.get("x-llmgw-cache") == "hit" else None

    return wait_for("an answer from the cache", hit, 20.0, interval=0.0)  # each ask takes a round trip


def test_a_deterministic_answer_comes_back_from_the_cache_as_json_or_streamed(cached: StackInfo) -> None:
    text = "cache me: what is the boiling point of water?"
    headers, first = _ask(cached, KEY_A, text)
    assert headers["x-llmgw-cache"] == "miss"
    headers, again = _until_hit(cached, KEY_A, text)
    assert headers["x-llmgw-cache"] == "hit"
    assert again.choices[0].message.content == first.choices[0].message.content  # type: ignore[attr-defined]
    assert again.choices[0].finish_reason == first.choices[0].finish_reason  # type: ignore[attr-defined]
    assert again.usage.completion_tokens == first.usage.completion_tokens  # type: ignore[attr-defined]
    assert again.id != first.id  # type: ignore[attr-defined]
    headers, chunks = _ask(cached, KEY_A, text, stream=True, stream_options={"include_usage": True})
    assert headers["x-llmgw-cache"] == "hit" and headers["content-type"].startswith("text/event-stream")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # type: ignore[union-attr]
    assert streamed == first.choices[0].message.content  # type: ignore[attr-defined]
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens  # type: ignore[union-attr]


def test_a_client_can_ask_past_the_cache_with_cache_control(cached: StackInfo) -> None:
    text = "cache me: how far is the moon?"
    _ask(cached, KEY_A, text)
    _until_hit(cached, KEY_A, text)
    headers, _ = _ask(cached, KEY_A, text, extra_headers={"Cache-Control": "no-cache"})
    assert headers["x-llmgw-cache"] == "miss"  # a pod answered; its answer is stored again
    headers, _ = _ask(cached, KEY_A, text, extra_headers={"Cache-Control": "no-store"})
    assert "x-llmgw-cache" not in headers  # the cache was not part of it at all
    headers, _ = _ask(cached, KEY_A, text)
    assert headers["x-llmgw-cache"] == "hit"  # the others still get the stored answer


def _hot_hits(info: StackInfo) -> float:
    assert info.metrics_url is not None
    text = httpx.get(info.metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('llmgw_cache_lookups_total{outcome="hot"}'))


def test_a_key_hit_again_and_again_is_answered_from_the_hot_key_allow_list(cached: StackInfo) -> None:
    text = "cache me: how many legs does a spider have?"
    _, first = _ask(cached, KEY_A, text)
    _until_hit(cached, KEY_A, text)
    before = _hot_hits(cached)
    for _ in range(8):  # at least 4 on one of the two workers: hot there from its 4th
        headers, again = _ask(cached, KEY_A, text)
        assert headers["x-llmgw-cache"] == "hit"
        assert again.choices[0].message.content == first.choices[0].message.content  # type: ignore[attr-defined]
    wait_for("the condition", lambda: _hot_hits(cached) > before)  # the counters reach the metrics once a second


def test_one_tenant_never_gets_anothers_answer(cached: StackInfo) -> None:
    text = "cache me: name a prime number"
    _ask(cached, KEY_A, text)
    assert _until_hit(cached, KEY_A, text)[0]["x-llmgw-cache"] == "hit"
    assert _ask(cached, KEY_B, text)[0]["x-llmgw-cache"] == "miss"


def test_sampled_requests_are_not_cached(cached: StackInfo) -> None:
    raw = _client(cached, KEY_A).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "cache me not"}], max_tokens=4, temperature=0.8)
    assert "x-llmgw-cache" not in raw.headers


def test_a_hit_counts_against_requests_not_tokens_and_reaches_the_ledger(cached: StackInfo) -> None:
    text = "cache me: how many legs does a spider have?"
    _ask(cached, KEY_A, text)
    _until_hit(cached, KEY_A, text)
    before, _ = _ask(cached, KEY_A, text)
    after, _ = _ask(cached, KEY_A, text)
    assert before["x-llmgw-cache"] == after["x-llmgw-cache"] == "hit"
    assert int(after["x-ratelimit-remaining-requests"]) < int(before["x-ratelimit-remaining-requests"])
    ledger = cached.config_path.parent / "usage.jsonl"  # the node's ledger without Redis

    def cached_records() -> list[dict[str, object]]:
        records = [orjson.loads(line) for line in ledger.read_bytes().splitlines() if line.strip()]
        return [r for r in records if r.get("kind") == "cached" and r.get("tenant") == "cache-a"]

    hits = wait_for("a cached answer in the ledger", cached_records, 10.0, interval=0.05)
    assert all(r["cost_usd"] == 0 and r["status"] == 200 and r["output_tokens"] > 0 for r in hits)


def test_a_stampede_of_one_request_is_answered_by_a_few_generations(cached: StackInfo) -> None:
    pod = cached.pod_urls["local"][0]
    text = "cache me: a stampede of the same question"
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 48,
            "temperature": 0, "ignore_eos": True}  # ~0.6 s of generation: the others arrive meanwhile

    def generations() -> int:
        recorded = httpx.get(f"{pod}/debug/requests", timeout=5).json()["requests"]
        return sum(1 for r in recorded if text in orjson.dumps(r).decode())

    def ask(_: int) -> httpx.Response:
        return httpx.post(f"{cached.base_url}/v1/chat/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {KEY_A}"})

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, range(12)))
    assert all(a.status_code == 200 for a in answers)
    contents = {a.json()["choices"][0]["message"]["content"] for a in answers}
    assert len(contents) == 1  # one answer for all
    # Each worker sends the first miss on, then fetches the hot key once for everyone waiting (a
    # slow machine may need another warm-up while an answer stored elsewhere is announced).
    assert generations() <= len(answers) // 2
    assert sum(a.headers.get("x-llmgw-cache") == "hit" for a in answers) >= len(answers) // 2


class _CacheReads:
    """Redis's MONITOR, in a thread: the commands that read the response cache's entries."""

    def __init__(self, url: str) -> None:
        import redis

        self._monitor = redis.Redis.from_url(url).monitor()
        self._monitor.__enter__()
        self.reads: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for command in self._monitor.listen():
                if "llmgw:rc:e:" in command["command"] and command["command"].startswith("GET"):
                    self.reads.append(command["command"])
        except Exception:  # noqa: BLE001 (the connection closes when the test is done)
            pass

    def close(self) -> None:
        self._monitor.connection.disconnect()
        self._thread.join(5)


def test_a_flood_of_never_seen_prompts_never_reaches_redis_past_the_bloom_filter(
        tmp_path_factory: pytest.TempPathFactory, own_redis_server) -> None:
    config = {**CONFIG, "redis_url": own_redis_server.url}
    with small_stack(tmp_path_factory, "cache-redis", pods=1, extra_config=config, workers=2) as info:
        text = "cache me in redis: a known question"
        _ask(info, KEY_A, text)
        assert _until_hit(info, KEY_A, text)[0]["x-llmgw-cache"] == "hit"  # stored by one worker, found by both
        reads = _CacheReads(own_redis_server.url)
        try:
            for i in range(60):  # never-seen deterministic prompts: each a miss the filter answers
                flood = f"flood {i} {time.monotonic_ns()}"
                assert _ask(info, KEY_A, flood, max_tokens=1)[0]["x-llmgw-cache"] == "miss"
            _ask(info, KEY_A, text)  # a known key does go to Redis: the monitor sees it
            wait_for("the condition", lambda: len(reads.reads) >= 1)
        finally:
            reads.close()
        # At 1 MiB and k = 3 with a handful of keys, a false positive is about one in 10^10.
        assert len(reads.reads) == 1, reads.reads


def test_a_paraphrase_gets_the_cached_answer_and_a_different_question_does_not(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Two workers: the prompt of a stored answer is shared with both, whichever missed it.
    config = {**CONFIG, "models": [{"name": MODEL, "pool": "local", "cache": {"ttl_s": 300, "semantic": {}}}]}
    with small_stack(tmp_path_factory, "paraphrase", pods=1, extra_config=config, workers=2,
                     envoy_concurrency=2) as info:
        _paraphrases(info)
        # The miss's prompt was shared through the node's store (no Redis here: its SQLite file).
        with sqlite3.connect(info.config_path.parent / "cache.sqlite") as db:
            shared = [orjson.loads(r)["t"] for r, in db.execute("SELECT record FROM shared")]
        assert shared.count("What is the capital city of France?") == 1, shared


def _paraphrases(cached: StackInfo) -> None:
    def ask(text: str) -> tuple[dict[str, str], object]:
        raw = _client(cached, KEY_A).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0)
        return dict(raw.headers), raw.parse()

    headers, first = ask("What is the capital city of France?")
    assert headers["x-llmgw-cache"] == "miss"
    # The first answer is stored once its access-log entry is settled, and its prompt is then
    # shared with every worker. Until then a paraphrase misses, and its own answer is stored under
    # its own exact key (and shared in turn): so each try is worded a little differently.
    answers = {first.choices[0].message.content}  # type: ignore[attr-defined]
    for wanted in range(5):  # the first, then more, whichever worker each new connection reaches
        deadline = time.monotonic() + 20
        for tries in itertools.count(1):
            headers, again = ask(f"what's the capital of France{'?' * (wanted * 100 + tries)}")
            if headers.get("x-llmgw-cache") == "hit" or time.monotonic() > deadline:
                break
            answers.add(again.choices[0].message.content)  # type: ignore[attr-defined]
        assert headers["x-llmgw-cache"] == "hit", (wanted, tries, headers)
        assert headers.get("x-llmgw-cache-match", "").startswith("semantic; score="), (wanted, tries, headers)
        assert again.choices[0].message.content in answers, (again, answers)  # type: ignore[attr-defined]
    other, _ = ask("What is the capital city of Spain?")  # close in meaning, another answer: the guard says no
    assert other["x-llmgw-cache"] == "miss", other
