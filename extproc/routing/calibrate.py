"""``llmgw route --calibrate``: what a config's own intents promise, before any traffic.

Cross-validation over the examples the user wrote: each example is held out in turn, its intent's
prototype is rebuilt from the rest (and the description), and the example is classified as a new
prompt would be, by the config's decision (the learned one reads each intent's spread with the
held-out example in it; the threshold one, its threshold, margin and background). The share
classified right is the expected accuracy on in-domain prompts like the examples. An example that
lands on another intent, or on the default route, says where the config is thin; two intents whose
held-out examples land on each other, or whose prototypes are nearly the same vector, overlap, and
are named.

Pure apart from the embedder: the vectors come from the index the gateway builds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from extproc.routing.intents import IntentIndex

# Prototypes at least this similar are reported as overlapping even when no held-out example
# crossed over (the two intents' examples could describe one request).
PROTOTYPE_OVERLAP = 0.85


@dataclass(frozen=True, slots=True)
class Overlap:
    """Two intents that the embedder cannot keep apart well."""

    first: str
    second: str
    crossed: int  # held-out examples of either classified as the other
    cosine: float  # between their prototypes


@dataclass(frozen=True, slots=True)
class Calibration:
    """The cross-validated picture of one config's intents."""

    embedder: str
    scoring: str
    threshold: float
    margin: float
    decision: str  # "learned" or "threshold"
    confidence: float | None  # the learned decision's probability bar
    examples: int
    accuracy: float  # held-out examples classified as their own intent
    per_intent: dict[str, float]
    to_default: int  # held-out examples that fell under the threshold or the margin
    overlaps: tuple[Overlap, ...] = field(default=())

    @property
    def warnings(self) -> list[str]:
        """What a user should look at, one line each."""
        lines = [f"intents {o.first!r} and {o.second!r} overlap: {o.crossed} held-out example(s) crossed over, "
                 f"prototypes at cosine {o.cosine:.2f}; give each examples the other would not claim"
                 for o in self.overlaps]
        thin = [name for name, accuracy in self.per_intent.items() if accuracy < 0.5]
        if thin:
            lines.append(f"intents {', '.join(map(repr, thin))}: fewer than half their held-out examples found them; "
                         "add examples in the words clients use")
        return lines


def calibrate(index: IntentIndex) -> Calibration:
    """Hold each example out of ``index``'s intents in turn and classify it."""
    intents = index.intents
    vectors = index.vectors  # each intent's rows: its examples, then its description
    spans = index.spans
    names = [intent.name for intent in intents]
    right: Counter[str] = Counter()
    total: Counter[str] = Counter()
    crossed: Counter[tuple[str, str]] = Counter()
    to_default = 0
    for i, intent in enumerate(intents):
        start, end = spans[i]
        for row in range(start, start + len(intent.examples)):  # the description is never held out
            held_out = vectors[row]
            rest = [vectors[s:e] if j != i else np.delete(vectors[s:e], row - s, 0) for j, (s, e) in enumerate(spans)]
            match = index.decide_rows(held_out, rest)
            total[intent.name] += 1
            if match.intent is None:
                to_default += 1
            elif match.intent.name == intent.name:
                right[intent.name] += 1
            else:
                crossed[_pair(intent.name, match.intent.name)] += 1
    prototypes = index.prototypes
    overlaps = []
    for a in range(len(intents)):
        for b in range(a + 1, len(intents)):
            cosine = float(prototypes[a] @ prototypes[b])
            pair = _pair(names[a], names[b])
            if crossed[pair] or cosine >= PROTOTYPE_OVERLAP:
                overlaps.append(Overlap(pair[0], pair[1], crossed[pair], round(cosine, 3)))
    overlaps.sort(key=lambda o: (-o.crossed, -o.cosine))
    count = sum(total.values())
    return Calibration(
        index.embedder.name, index.scoring, index.threshold, index.margin, index.decision, index.confidence, count,
        round(sum(right.values()) / count, 4) if count else 0.0,
        {name: round(right[name] / total[name], 4) for name in names if total[name]},
        to_default, tuple(overlaps))


def _pair(first: str, second: str) -> tuple[str, str]:
    return (first, second) if first < second else (second, first)
