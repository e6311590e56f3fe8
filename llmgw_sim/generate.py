"""What the simulated model says: a deterministic output plan per choice.

A plan is fixed when the request is admitted: its length, its token ids, the text delta each
token adds, and why it ends. The engine then only decides *when* each token appears.

* Randomness: one ``random.Random`` per choice, seeded from (seed, prompt ids, choice index).
  The seed is the request's ``seed``; with ``temperature == 0`` (greedy) it is a constant, so
  the same prompt always gives the same text; with neither, the server draws one.
* Length: ``min(max_tokens, L)`` with ``L ~ LogNormal`` of mean ``output_len_mean`` and shape
  ``output_len_sigma`` (a long right tail, like chat replies in ShareGPT); ``L`` reaching
  ``max_tokens`` finishes with ``"length"``, otherwise the model "emitted EOS" (``"stop"``).
  ``ignore_eos`` (vLLM's sampling parameter) always generates ``max_tokens``; ``min_tokens``
  (also vLLM's) is a floor.
* Stop strings (OpenAI ``stop``): the text is cut before the earliest-ending match, the
  finish reason is ``"stop"`` and ``stop_reason`` names the string (as vLLM reports it);
  generation stops at the token that completed the match, which is counted.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from llmgw_sim.tokens import WordTable

FinishReason = Literal["stop", "length"]

# A fixed seed for greedy decoding: temperature 0 makes the text a function of the prompt.
_GREEDY_SEED = 0
DEFAULT_OUTPUT_LEN_MEAN = 256.0
DEFAULT_OUTPUT_LEN_SIGMA = 1.0


@dataclass(frozen=True, slots=True)
class LengthModel:
    """The default output-length distribution (a log-normal with the given mean)."""

    mean: float = DEFAULT_OUTPUT_LEN_MEAN
    sigma: float = DEFAULT_OUTPUT_LEN_SIGMA

    def __post_init__(self) -> None:
        if self.mean < 1 or self.sigma < 0:
            raise ValueError("output length: mean must be >= 1 and sigma >= 0")

    def sample(self, rng: random.Random) -> int:
        """One natural output length (>= 1) before any max_tokens cap."""
        mu = math.log(self.mean) - self.sigma * self.sigma / 2
        return max(1, round(rng.lognormvariate(mu, self.sigma)))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The OpenAI/vLLM sampling parameters the simulator honours."""

    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass(slots=True)
class OutputPlan:
    """One choice's whole output: token ids, the text each adds, and how it finishes."""

    token_ids: list[int]
    deltas: list[str]
    finish_reason: FinishReason
    stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The full output text."""
        return "".join(self.deltas)


def prompt_key(prompt_ids: Sequence[int]) -> int:
    """A stable key of a prompt's token ids (hashes of int tuples ignore PYTHONHASHSEED)."""
    return hash(tuple(prompt_ids))


def choice_seed(params: SamplingParams, fallback_seed: int, prompt: int, choice_index: int) -> int:
    """The RNG seed of one choice of the prompt with key ``prompt`` (see module doc)."""
    if params.temperature == 0:
        base = _GREEDY_SEED
    elif params.seed is not None:
        base = params.seed
    else:
        base = fallback_seed
    return hash((base, prompt, choice_index))


def plan_output(words: WordTable, lengths: LengthModel, params: SamplingParams, seed: int, *,
                ignore_eos: bool = False, opening: bool = True) -> OutputPlan:
    """The output of one choice. ``ignore_eos`` forces max_tokens (a server-wide default);
    ``opening`` starts with a capitalised word (a chat answer) rather than a continuation."""
    rng = random.Random(seed)
    natural = lengths.sample(rng)
    if params.ignore_eos or ignore_eos:
        natural = params.max_tokens
    natural = max(natural, params.min_tokens)
    length = min(natural, params.max_tokens)
    finish: FinishReason = "length" if natural >= params.max_tokens else "stop"
    pool = words.pool(params.temperature)
    if opening:
        ids = [rng.choice(words.opening_ids)]
        ids.extend(rng.choices(pool, k=length - 1))
    else:
        ids = rng.choices(pool, k=length)
    words.separate_punctuation(ids)
    text_of = words.text
    deltas = [text_of[i] for i in ids]
    if params.stop:
        return _apply_stop(ids, deltas, params.stop) or OutputPlan(ids, deltas, finish)
    return OutputPlan(ids, deltas, finish)


def _apply_stop(ids: list[int], deltas: list[str], stops: Sequence[str]) -> OutputPlan | None:
    """Cut at the stop string whose first match ends earliest; None when none matches."""
    full = "".join(deltas)
    best: tuple[int, int, str] | None = None  # (match end, match start, stop string)
    for stop in stops:
        start = full.find(stop)
        if start >= 0 and (best is None or start + len(stop) < best[0]):
            best = (start + len(stop), start, stop)
    if best is None:
        return None
    end, cut, stop = best
    kept_deltas: list[str] = []
    offset = 0
    for delta in deltas:
        kept_deltas.append(delta[:max(0, cut - offset)])
        offset += len(delta)
        if offset >= end:
            break
    return OutputPlan(ids[:len(kept_deltas)], kept_deltas, "stop", stop)
