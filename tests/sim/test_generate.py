"""Deterministic output plans: seeds, lengths, stop strings, and real token ids."""

from __future__ import annotations

import random
import statistics

import pytest

from llmgw_sim.generate import (
    LengthModel,
    SamplingParams,
    choice_seed,
    plan_output,
    prompt_key,
)
from llmgw_sim.tokens import SimTokenizer

LENGTHS = LengthModel(mean=50, sigma=1.0)
PROMPT = prompt_key([1, 2, 3])


def plan(tok: SimTokenizer, params: SamplingParams, seed: int = 7, **kw: bool):
    return plan_output(tok.words, LENGTHS, params, choice_seed(params, seed, PROMPT, 0), **kw)


def test_same_seed_same_prompt_same_text(sim_tokenizer: SimTokenizer) -> None:
    params = SamplingParams(max_tokens=40, seed=42)
    a = plan(sim_tokenizer, params, seed=1)
    b = plan(sim_tokenizer, params, seed=2)  # the server's fallback seed does not matter
    assert a.token_ids == b.token_ids and a.text == b.text


def test_no_seed_uses_the_server_draw(sim_tokenizer: SimTokenizer) -> None:
    params = SamplingParams(max_tokens=40)
    assert plan(sim_tokenizer, params, seed=1).text != plan(sim_tokenizer, params, seed=2).text


def test_greedy_ignores_seed(sim_tokenizer: SimTokenizer) -> None:
    a = plan(sim_tokenizer, SamplingParams(max_tokens=40, temperature=0, seed=1))
    b = plan(sim_tokenizer, SamplingParams(max_tokens=40, temperature=0, seed=2))
    assert a.text == b.text  # temperature 0: text depends on the prompt only


def test_choices_differ() -> None:
    params = SamplingParams(max_tokens=8, seed=3)
    assert choice_seed(params, 0, PROMPT, 0) != choice_seed(params, 0, PROMPT, 1)


@pytest.mark.parametrize(
    ("params", "ignore_eos", "length", "finish"),
    [
        pytest.param(SamplingParams(max_tokens=5, seed=1), False, 5, "length",
                     id="natural length (~50) is cut by max_tokens=5"),
        pytest.param(SamplingParams(max_tokens=4000, ignore_eos=True, seed=1), False, 4000, "length",
                     id="request ignore_eos runs to max_tokens"),
        pytest.param(SamplingParams(max_tokens=300, seed=1), True, 300, "length",
                     id="server --ignore-eos runs to max_tokens"),
        pytest.param(SamplingParams(max_tokens=4000, min_tokens=3000, seed=1), False, 3000, "stop",
                     id="min_tokens floors the natural length, then EOS"),
    ],
)
def test_lengths(sim_tokenizer: SimTokenizer, params: SamplingParams, ignore_eos: bool,
                 length: int, finish: str) -> None:
    out = plan(sim_tokenizer, params, ignore_eos=ignore_eos)
    assert len(out.token_ids) == len(out.deltas) == length
    assert out.finish_reason == finish


def test_natural_length_stops_with_eos(sim_tokenizer: SimTokenizer) -> None:
    out = plan(sim_tokenizer, SamplingParams(max_tokens=100_000, seed=9))
    assert out.finish_reason == "stop" and 1 <= len(out.token_ids) < 100_000


def test_length_distribution_mean() -> None:
    rng = random.Random(0)
    samples = [LengthModel(mean=200, sigma=1.0).sample(rng) for _ in range(20_000)]
    assert statistics.fmean(samples) == pytest.approx(200, rel=0.05)  # log-normal with that mean


def test_text_reencodes_to_the_same_ids(sim_tokenizer: SimTokenizer) -> None:
    for seed in range(5):
        for opening in (True, False):
            out = plan(sim_tokenizer, SamplingParams(max_tokens=60, seed=seed), opening=opening)
            assert sim_tokenizer.decode(out.token_ids) == out.text
            assert sim_tokenizer.encode_texts([out.text])[0] == out.token_ids


def test_opening_word_is_capitalised(sim_tokenizer: SimTokenizer) -> None:
    chat = plan(sim_tokenizer, SamplingParams(max_tokens=5, seed=1))
    completion = plan(sim_tokenizer, SamplingParams(max_tokens=5, seed=1), opening=False)
    assert chat.text[0].isupper()
    assert completion.text[0] in " ,."  # a continuation: space-prefixed word or punctuation


@pytest.mark.parametrize("which", [pytest.param(w, id=f"stop at word {w}") for w in (1, 5, 12)])
def test_stop_string_cuts_text(sim_tokenizer: SimTokenizer, which: int) -> None:
    params = SamplingParams(max_tokens=30, seed=5)
    full = plan(sim_tokenizer, params)
    stop = full.deltas[which]
    cut = plan(sim_tokenizer, SamplingParams(max_tokens=30, seed=5, stop=("never-there", stop)))
    start = full.text.find(stop)
    assert cut.text == full.text[:start]  # the stop string itself is not returned
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert len(cut.token_ids) == len(cut.deltas) <= which + 1  # counted up to the matching token
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]


def test_stop_string_absent_changes_nothing(sim_tokenizer: SimTokenizer) -> None:
    params = SamplingParams(max_tokens=30, seed=5)
    with_stop = plan(sim_tokenizer, SamplingParams(max_tokens=30, seed=5, stop=("@@@",)))
    assert with_stop == plan(sim_tokenizer, params)


def test_temperature_widens_the_pool(sim_tokenizer: SimTokenizer) -> None:
    words = sim_tokenizer.words
    assert len(words.pool(0.0)) < len(words.pool(1.0)) < len(words.pool(2.0))
    assert words.pool(5.0) == words.pool(2.0)  # capped
