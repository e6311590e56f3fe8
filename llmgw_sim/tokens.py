"""The simulated model's tokenizer: real prompt token ids, and the word tokens it "generates".

Prompts are encoded with a real ``tokenizers`` tokenizer (by default DeepSeek's byte-level BPE),
so ``usage.prompt_tokens`` and prefix-cache blocks behave like a real pod's. Output is drawn
from a fixed table of ordinary word tokens: the most frequent (lowest-id) vocabulary entries
that are a space followed by 3-10 lowercase letters (``Ġword`` in byte-level BPE, ``▁word`` in
SentencePiece), plus ``,`` and ``.``; an answer opens with a capitalised word without a space.
Each such token decodes to a fixed string, so per-step deltas need no detokenizer call and the
concatenated text re-encodes to the very same ids.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from extproc.resources import resolve_resource
from llmgw_sim.template import Placeholder, Segment

NUM_WORD_TOKENS = 2000
NUM_OPENING_TOKENS = 200
_SPACE_MARKERS = ("Ġ", "▁")
_WORD = re.compile(r"(?:Ġ|▁)[a-z]{3,10}")
_OPENING = re.compile(r"[A-Z][a-z]{2,8}")
_PUNCTUATION = (",", ".")
# Media placeholders hash as negative ids, which no real token has (see template.py).
_PLACEHOLDER_ID_SPACE = 2**31


# Temperature widens the pool of words (see ``WordTable.pool``): buckets of 0.25 up to 2.0.
_TEMPERATURE_BUCKETS = 8
_MIN_POOL = 16


@dataclass(frozen=True, slots=True)
class WordTable:
    """Token ids the simulator may emit and the text each one decodes to mid-sentence.

    ``pools[b]`` is what a temperature in bucket ``b`` (``round(T * 4)``, capped at 8) samples
    from: the ``max(16, 2000 * b / 8)`` most frequent words, plus punctuation at ~1 in 40.
    """

    pools: tuple[tuple[int, ...], ...]
    opening_ids: tuple[int, ...]
    punctuation_ids: frozenset[int]
    filler_id: int
    text: dict[int, str]

    def pool(self, temperature: float) -> tuple[int, ...]:
        """The body-token pool for ``temperature`` (0 = greedy: the narrowest pool)."""
        return self.pools[min(_TEMPERATURE_BUCKETS, round(temperature * 4))]

    def separate_punctuation(self, ids: list[int]) -> None:
        """Replace (in place) punctuation that follows punctuation with the filler word:
        BPE would merge ``.,`` into one token, and the text must re-encode to the same ids."""
        punctuation = self.punctuation_ids
        previous = False
        for k, token in enumerate(ids):
            if token in punctuation:
                if previous:
                    ids[k] = self.filler_id
                previous = not previous
            else:
                previous = False


class SimTokenizer:
    """A loaded tokenizer plus the simulator's output word table."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.words = _build_word_table(tokenizer)

    @classmethod
    def from_spec(cls, spec: str) -> SimTokenizer:
        """Load the tokenizer.json named by ``spec`` (a path or ``pkg:<package>/<file>``)."""
        return cls(Tokenizer.from_file(str(resolve_resource(spec))))

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (the template carries its own)."""
        if len(texts) == 1:
            return [self.tokenizer.encode(texts[0], add_special_tokens=False).ids]
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def encode_segments(self, segments: Sequence[Segment]) -> list[int]:
        """Token ids of a rendered chat prompt; each media placeholder becomes ``count`` copies
        of an id derived from its key (negative, so it never collides with a real token)."""
        texts = [seg for seg in segments if isinstance(seg, str)]
        encoded = iter(self.encode_texts(texts) if texts else [])
        ids: list[int] = []
        for seg in segments:
            if isinstance(seg, Placeholder):
                ids.extend([-1 - seg.key % _PLACEHOLDER_ID_SPACE] * seg.count)
            else:
                ids.extend(next(encoded))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (for tests and debugging)."""
        return self.tokenizer.decode(list(ids))


def _piece_text(piece: str) -> str:
    for marker in _SPACE_MARKERS:
        if piece.startswith(marker):
            return " " + piece[len(marker):]
    return piece


def _build_word_table(tokenizer: Tokenizer) -> WordTable:
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    # Lowest ids first: BPE assigns ids in merge order, so those are the most frequent pieces.
    body = sorted(i for piece, i in vocab.items() if _WORD.fullmatch(piece))[:NUM_WORD_TOKENS]
    opening = sorted(i for piece, i in vocab.items() if _OPENING.fullmatch(piece))[:NUM_OPENING_TOKENS]
    punctuation = [vocab[p] for p in _PUNCTUATION if p in vocab]
    if len(body) < 50 or not opening:
        raise ValueError("tokenizer has too few plain word tokens to simulate output")
    pieces = {i: tokenizer.id_to_token(i) or "" for i in body + opening + punctuation}  # ids of the vocabulary
    pools = []
    for bucket in range(_TEMPERATURE_BUCKETS + 1):
        words = body[:max(_MIN_POOL, len(body) * bucket // _TEMPERATURE_BUCKETS)]
        # Punctuation is listed several times so that it shows up at a plausible rate.
        pools.append(tuple(words + punctuation * max(1, len(words) // 40)))
    return WordTable(
        pools=tuple(pools),
        opening_ids=tuple(opening),
        punctuation_ids=frozenset(punctuation),
        filler_id=body[0],
        text={i: _piece_text(pieces[i]) for i in body + opening + punctuation},
    )
