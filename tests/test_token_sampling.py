"""Long prompts: the admission estimate costs the same whatever the prompt's length, and stays
within its stated error (``extproc.tokens.SampledCounter``)."""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Iterator
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import orjson
import pytest
import yaml
from tokenizers import Tokenizer

from extproc.api import Operation, parse_request
from extproc.resources import DEFAULT_TOKENIZER, resolve_resource
from extproc.tokens import (
    EXACT_CHARS,
    MAX_ENCODED_CHARS,
    SAMPLE_WINDOWS,
    SAMPLED_ERROR_BOUND,
    SIM_POD_RULES,
    WINDOW_CHARS,
    BpeEstimator,
)

ROOT = Path(__file__).resolve().parent.parent
FROZEN_SETS = ("intents.yaml", "paraphrases.yaml", "paraphrases_fresh.yaml")


class CountingTokenizer:
    """DeepSeek's tokenizer, counting the characters it is asked to encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.chars = 0

    def encode(self, text: str, **options: Any) -> Any:
        self.chars += len(text)
        return self._tokenizer.encode(text, **options)

    def encode_batch_fast(self, texts: list[str], **options: Any) -> Any:
        self.chars += sum(map(len, texts))
        return self._tokenizer.encode_batch_fast(texts, **options)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(resolve_resource(DEFAULT_TOKENIZER)))


@pytest.fixture
def counted(tokenizer: Tokenizer) -> tuple[BpeEstimator, CountingTokenizer]:
    """An estimator whose tokenizer counts what it encodes (built after the estimator's own probe)."""
    estimator = BpeEstimator(tokenizer, SIM_POD_RULES)
    spy = CountingTokenizer(tokenizer)
    estimator._tokenizer = spy  # type: ignore[assignment]
    return estimator, spy


def _chinese(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        if sum("\u4e00" <= c <= "\u9fff" for c in node) > len(node) * 0.3:
            yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _chinese(value)
    elif isinstance(node, list):
        for value in node:
            yield from _chinese(value)


def _corpora() -> dict[str, str]:
    """Texts of several kinds that stay put while this repository changes (a corpus read from our
    own files moved the worst draw with every edit): Python's language reference (prose), the
    asyncio package's source (code), JSON, and the Chinese sentences of the frozen evaluation sets."""
    prose = "\n\n".join(topics[key] for key in sorted(topics))
    code = "\n".join(p.read_text() for p in sorted(Path(asyncio.__file__).parent.glob("*.py")))
    sentences = [s for name in FROZEN_SETS for s in _chinese(yaml.safe_load((ROOT / "bench/data" / name).read_text()))]
    rng = random.Random(3)
    chinese = "".join(rng.choice(sentences) for _ in range(3000))
    records = [{"id": i, "name": f"item-{i}", "score": round(i * 0.37, 2), "tags": ["a", "b"]} for i in range(20000)]
    data = orjson.dumps({"data": records}).decode()
    kinds = {"prose": prose, "code": code, "chinese": chinese, "json": data}
    kinds["mixed"] = "".join(text[i * 20000:(i + 1) * 20000] for i in range(10) for text in kinds.values())
    kinds["halves"] = prose[:100_000] + chinese[:100_000]
    return kinds


CORPORA = _corpora()


def _fit(text: str, size: int) -> str:
    return (text * (size // len(text) + 1))[:size]


@pytest.mark.parametrize("size", [220_000, 1_000_000], ids=["220k", "1M"])
@pytest.mark.parametrize("kind", sorted(CORPORA))
def test_sampled_estimate_is_within_its_bound(tokenizer: Tokenizer, kind: str, size: int) -> None:
    estimator = BpeEstimator(tokenizer)
    text = _fit(CORPORA[kind], size)
    exact = len(tokenizer.encode(text, add_special_tokens=False).ids)
    errors = []
    for seed in range(50):
        count = estimator.counter(random.Random(seed))
        errors.append((count(text) - exact) / exact)
        assert count.exact is False
    assert max(map(abs, errors)) <= SAMPLED_ERROR_BOUND, errors
    assert statistics.pstdev(errors) <= 0.035  # the docstring's spread
    assert abs(statistics.mean(errors)) <= 0.025  # unbiased but for a window's cut (JSON has few spaces)


def _chat_body(messages: list[dict[str, Any]]) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages})


@pytest.mark.parametrize(
    ("messages", "most"),
    [
        # one 4 MB prompt: only its windows are encoded
        pytest.param([{"role": "user", "content": "word " * 800_000}],
                     SAMPLE_WINDOWS * (WINDOW_CHARS + WINDOW_CHARS // 4) + 200, id="one 4 MB prompt"),
        # 2048 messages of 2 KB: exact up to EXACT_CHARS, then at the rate seen
        pytest.param([{"role": "user", "content": f"message {i} " + "lorem ipsum " * 170} for i in range(2048)],
                     EXACT_CHARS + 200, id="2048 messages"),
        # 500 long messages: sampled until MAX_ENCODED_CHARS, then at the rate seen
        pytest.param([{"role": "user", "content": f"part {i} " + "dolor sit amet " * 700} for i in range(500)],
                     MAX_ENCODED_CHARS + SAMPLE_WINDOWS * (WINDOW_CHARS + WINDOW_CHARS // 4) + 200,
                     id="500 long messages"),
    ],
)
def test_counting_cost_does_not_grow_with_the_prompt(counted: tuple[BpeEstimator, CountingTokenizer],
                                                      messages: list[dict[str, Any]], most: int) -> None:
    estimator, spy = counted
    request = parse_request(Operation.CHAT, _chat_body(messages))
    estimate = estimator.estimate(request)
    assert spy.chars <= most  # characters encoded, markers included
    assert estimate.exact is False
    tokens = len(estimator._tokenizer.encode("".join(m["content"] for m in messages[:40]),  # type: ignore[attr-defined]
                                             add_special_tokens=False))
    exact = tokens * len(messages) / min(40, len(messages))  # every message alike
    assert abs(estimate.text - exact) <= 0.1 * exact  # the rate carries over to what was not encoded


def test_short_prompts_stay_exact(counted: tuple[BpeEstimator, CountingTokenizer]) -> None:
    estimator, spy = counted
    content = "The quick brown fox jumps over the lazy dog. " * (EXACT_CHARS // 48)
    request = parse_request(Operation.CHAT, _chat_body([{"role": "user", "content": content}]))
    estimate = estimator.estimate(request)
    assert estimate.exact is True
    run = f"<|im_start|>user\n{content}<|im_end|>\n"
    expected = len(estimator._tokenizer.encode(run, add_special_tokens=False))  # type: ignore[attr-defined]
    expected += len(estimator._tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False))  # type: ignore[attr-defined]
    assert estimate.total == expected


def test_whole_prompt_path_is_bounded_too(tokenizer: Tokenizer) -> None:
    """A tokenizer that may merge across turns encodes the merged prompt: sampled as well."""
    estimator = BpeEstimator(tokenizer, SIM_POD_RULES)
    estimator.turnwise = False
    text = _fit(CORPORA["prose"], 300_000)
    request = parse_request(Operation.CHAT, _chat_body([{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": text}]))
    estimate = estimator.estimate(request)
    exact = len(tokenizer.encode(text, add_special_tokens=False).ids)
    assert estimate.exact is False
    assert abs(estimate.text - exact) <= SAMPLED_ERROR_BOUND * exact + 20
