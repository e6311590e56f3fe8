"""Semantic response cache: how often a hit is right, how many paraphrases get one, what a lookup costs.

The labelled pairs are in ``bench/data/paraphrases.yaml`` (read its header): 177 paraphrases
(``same: true``) and about 50 near-misses of each kind (number, negation, entity, other) plus
unrelated pairs, in five languages. Each pair is evaluated as the cache would meet it: ``a`` alone
in a fresh partition of an ``extproc.cache.semantic.SemanticIndex``, then ``b`` looked up; a hit
is a match. precision = true hits / hits; recall = true hits / same pairs.

The pairs are split deterministically by the SHA-256 of ``a + "\\n" + b``: two thirds "tune", one
third "held out". For each embedder (hashing, minilm, hybrid), with and without the guard, the
threshold is chosen on "tune" only: the best recall where precision >= 99% both pairwise and
crowded (below), and of the thresholds reaching it, the highest (false hits are the costly
error). ``threshold_pairwise_only`` is what the pairwise figure alone would choose. A
configuration that never reaches 99% is reported at its most precise threshold, marked
``target_met_on_tune: false``. Precision and recall are then measured through a real index on
both splits at that threshold.
Seven prompts appear in two pairs on purpose, so a prompt may be in both splits.

Crowded: every ``a`` prompt in one partition and every ``b`` looked up; a hit is right only on
its own ``a`` of a same pair, and a hit on another pair's ``a`` counts as false (conservative: a
few pairs do ask what another pair asks). The pairwise protocol cannot show that the nearest of
many stored prompts scores higher than a single stored prompt does.

Cost: one lookup in that crowded partition (embedding, facts, search, guard), median over all
``b`` prompts and ``--rounds`` passes; the search and guard alone against a full partition
(10,000 prompts of random vectors); the guard's two parts (reading a prompt's facts, comparing
two prompts).

Prints one JSON line; writes docs/cache-semantic.png.

    python -m bench.cache_semantic [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rich.console import Console
from rich.progress import Progress

from bench.common import calibration_ms, emit
from extproc.cache.semantic import (
    DEFAULT_CANDIDATES,
    DEFAULT_CAPACITY,
    DEFAULT_EMBEDDER,
    DEFAULT_THRESHOLD,
    Check,
    Facts,
    Prompt,
    SemanticIndex,
    disagreement,
    facts,
)
from extproc.routing.embedders import Embedder, build_embedder

DATA = Path(__file__).parent / "data" / "paraphrases.yaml"
# Written after the guard's rules and the threshold were chosen, by someone who saw neither the
# rules nor this file's pairs: a second held-out set, never tuned on (read its header).
FRESH_DATA = Path(__file__).parent / "data" / "paraphrases_fresh.yaml"
PLOT = Path(__file__).parent.parent / "docs" / "cache-semantic.png"
KINDS = ("hashing", "minilm", "hybrid")  # cheapest first: a tie goes to the cheaper
TARGET_PRECISION = 0.99
THRESHOLDS = [round(i / 100, 2) for i in range(1, 101)]  # 0.01 .. 1.00
TUNE, HELD_OUT, FRESH = "tune", "held_out", "fresh"
BATCH = 32  # texts per embed call


@dataclass(frozen=True, slots=True)
class Pair:
    """One labelled pair."""

    a: str
    b: str
    same: bool
    kind: str  # paraphrase | number | negation | entity | other | unrelated
    lang: str
    split: str  # TUNE | HELD_OUT


def split_of(a: str, b: str) -> str:
    """The pair's split, from a hash of its text: one third held out."""
    digest = hashlib.sha256(f"{a}\n{b}".encode()).digest()
    return HELD_OUT if int.from_bytes(digest[:8], "big") % 3 == 0 else TUNE


def load(path: Path = DATA, split: str | None = None) -> list[Pair]:
    """The labelled pairs (all in ``split`` if given, else split by hash)."""
    return [Pair(p["a"], p["b"], bool(p["same"]), p["kind"], p["lang"], split or split_of(p["a"], p["b"]))
            for p in yaml.safe_load(path.read_text())["pairs"]]


class _Memo:
    """An embedder that embeds each text once (the bench embeds the same prompts for each figure)."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.name = inner.name
        self.threshold = inner.threshold
        self._vectors: dict[str, np.ndarray] = {}

    def embed(self, texts: list[str]) -> np.ndarray:
        """See ``Embedder.embed``."""
        missing = list(dict.fromkeys(t for t in texts if t not in self._vectors))
        if missing:
            self._vectors.update(zip(missing, self.inner.embed(missing), strict=True))
        return np.stack([self._vectors[t] for t in texts])


def embed_all(embedder: Embedder, texts: list[str], progress: Progress | None, label: str) -> None:
    """Embed ``texts`` in batches (through a ``_Memo``, which keeps them), with a progress bar."""
    task = progress.add_task(label, total=len(texts)) if progress else None
    for start in range(0, len(texts), BATCH):
        embedder.embed(texts[start:start + BATCH])
        if progress and task is not None:
            progress.advance(task, len(texts[start:start + BATCH]))


# ---------------------------------------------------------------------------------------------
# Figures

def figures(hit: np.ndarray, same: np.ndarray) -> dict[str, Any]:
    """Precision and recall of a hit vector against the labels, with the counts behind them."""
    hits, true_hits, positives = int(hit.sum()), int((hit & same).sum()), int(same.sum())
    return {
        "precision": round(true_hits / hits, 4) if hits else None,
        # Wilson 95% lower bound: with ~100 hits, 99% precision is within one false hit
        "precision_low95": round(_wilson_low(true_hits, hits), 4) if hits else None,
        "recall": round(true_hits / positives, 4) if positives else None,
        "hits": hits, "false_hits": hits - true_hits, "same": positives,
    }


def _wilson_low(successes: int, total: int, z: float = 1.96) -> float:
    """The lower end of the Wilson score interval for a proportion."""
    p = successes / total
    centre = p + z * z / (2 * total)
    spread = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    return (centre - spread) / (1 + z * z / total)


def sweep(scores: np.ndarray, allowed: np.ndarray, same: np.ndarray) -> Curve:
    """(threshold, precision, recall) at every threshold of THRESHOLDS; a hit: score >= t and allowed."""
    out = []
    for t in THRESHOLDS:
        hit = (scores >= t) & allowed
        f = figures(hit, same)
        out.append((t, f["precision"], f["recall"] or 0.0))
    return out


Curve = list[tuple[float, float | None, float]]  # (threshold, precision, recall)


def choose(curve: Curve, crowd: Curve | None = None) -> float | None:
    """The threshold with the best recall of ``curve`` where its precision, and that of
    ``crowd`` if given, is >= TARGET_PRECISION (None: never reached); of those, the highest: the
    same recall on tune, and the widest margin against false hits."""
    crowd_precision = {t: p for t, p, _ in crowd} if crowd is not None else {}
    feasible = [(t, r) for t, p, r in curve if p is not None and p >= TARGET_PRECISION and r > 0
                and (crowd is None or (crowd_precision[t] or 0.0) >= TARGET_PRECISION)]
    if not feasible:
        return None
    best = max(r for _, r in feasible)
    return max(t for t, r in feasible if r == best)


def most_precise(curve: Curve) -> float:
    """For a configuration that never reaches the target: the threshold of its best precision
    (of those, the best recall)."""
    return max(((t, p, r) for t, p, r in curve if p is not None and r > 0), key=lambda x: (x[1], x[2]))[0]


def nearest_accepted(scores: np.ndarray, queries: list[Facts], stored: list[Facts], guard: bool
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Per query row of ``scores`` (queries x stored prompts of one partition): the score and
    column of the prompt ``SemanticIndex.match`` returns at any threshold up to that score (its
    best-scoring candidate the guard accepts among the best DEFAULT_CANDIDATES), or (-inf, -1)."""
    best = np.full(len(scores), -np.inf, dtype=np.float32)
    column = np.full(len(scores), -1)
    for i, row in enumerate(scores):
        for j in np.argsort(-row, kind="stable")[:DEFAULT_CANDIDATES]:
            if not guard or disagreement(queries[i], stored[j]) is None:
                best[i], column[i] = row[j], j
                break
    return best, column


def crowd_sweep(best: np.ndarray, right: np.ndarray, same: np.ndarray) -> Curve:
    """(threshold, precision, recall) in a crowded partition: a hit is right only on the query's own
    ``a`` of a same pair (``right``); a hit on another pair's ``a`` counts as false."""
    out = []
    for t in THRESHOLDS:
        hit = best >= t
        hits, true_hits = int(hit.sum()), int((hit & right).sum())
        out.append((t, round(true_hits / hits, 4) if hits else None, true_hits / max(1, int(same.sum()))))
    return out


# ---------------------------------------------------------------------------------------------
# Through the index

def evaluate(kind: str, guard: bool, threshold: float | None, *, embedder: Embedder | None = None,
             pairs: list[Pair] | None = None, progress: Progress | None = None,
             check: Check | None = None, precision: float | None = None) -> dict[str, Any]:
    """Precision and recall at ``threshold`` through a real ``SemanticIndex`` (each pair: ``a``
    added to a fresh partition, ``b`` matched), on the tune split, the held-out split and all
    pairs, and the kinds of the false hits. ``embedder``: one already built (default: ``kind``'s);
    ``precision``: the learned check's operating point (default: its model's)."""
    pairs = load() if pairs is None else pairs
    embedder = build_embedder(kind) if embedder is None else embedder
    index = SemanticIndex(embedder, threshold, capacity=1, guard=guard, check=check or ("rules" if guard else "none"),
                          precision=precision)
    texts = list(dict.fromkeys(t for p in pairs for t in (p.a, p.b)))
    label = f"{kind} + {index.check} at {index.threshold}"
    task = progress.add_task(label, total=len(texts)) if progress else None
    prepared: dict[str, Prompt] = {}
    for start in range(0, len(texts), BATCH):
        chunk = texts[start:start + BATCH]
        prepared.update(zip(chunk, index.prepare_many(chunk), strict=True))
        if progress and task is not None:
            progress.advance(task, len(chunk))
    hit = np.zeros(len(pairs), dtype=bool)
    for i, pair in enumerate(pairs):
        index.add(str(i), prepared[pair.a], i.to_bytes(4, "big"))
        found = index.match(str(i), prepared[pair.b])
        hit[i] = found is not None and found.key == i.to_bytes(4, "big")
    same = np.array([p.same for p in pairs])
    result: dict[str, Any] = {"embedder": kind, "guard": guard, "check": index.check, "threshold": index.threshold}
    for split in dict.fromkeys(p.split for p in pairs):
        rows = np.array([p.split == split for p in pairs])
        result[split] = figures(hit[rows], same[rows])
    result["all"] = figures(hit, same)
    result["false_hits_by_kind"] = dict(Counter(p.kind for p, h in zip(pairs, hit, strict=True) if h and not p.same))
    result["missed_by_lang"] = dict(Counter(p.lang for p, h in zip(pairs, hit, strict=True) if p.same and not h))
    return result


def crowded(embedder: Embedder, guard: bool, pairs: list[Pair], threshold: float, rounds: int,
            progress: Progress) -> dict[str, Any]:
    """Every ``a`` prompt in one partition, every ``b`` prompt looked up from its text: the cost
    of one ``match`` (embedding, facts, search, guard; median and p90 microseconds), and the
    hits on another pair's ``a`` (the nearest of many scores higher than one stored prompt; such
    a hit is false unless the two pairs happen to ask the same thing)."""
    index = SemanticIndex(embedder, threshold, guard=guard, check="rules" if guard else "none")
    for prompt in index.prepare_many(list(dict.fromkeys(p.a for p in pairs))):
        index.add("", prompt, prompt.text.encode())
    task = progress.add_task(f"{embedder.name}{' + guard' if guard else ''} lookups", total=rounds * len(pairs))
    times = []
    hit = np.zeros(len(pairs), dtype=bool)
    right = np.zeros(len(pairs), dtype=bool)
    other = np.zeros(len(pairs), dtype=bool)
    for round_ in range(rounds):
        for i, pair in enumerate(pairs):
            started = time.perf_counter()
            found = index.match("", pair.b)
            times.append(time.perf_counter() - started)
            progress.advance(task)
            if round_ == 0 and found is not None:
                hit[i], right[i], other[i] = True, found.text == pair.a and pair.same, found.text != pair.a
    times.sort()
    same = np.array([p.same for p in pairs])
    out: dict[str, Any] = {"entries": index.size("")}
    for split in (TUNE, HELD_OUT):
        rows = np.array([p.split == split for p in pairs])
        hits, true_hits = int(hit[rows].sum()), int(right[rows].sum())
        out[split] = {"precision": round(true_hits / hits, 4) if hits else None,
                      "recall": round(true_hits / int((same & rows).sum()), 4), "hits": hits,
                      "false_hits": hits - true_hits, "on_another_pair": int(other[rows].sum())}
    out["lookup_us"] = {"median": round(statistics.median(times) * 1e6, 1),
                        "p90": round(times[int(0.9 * len(times))] * 1e6, 1)}
    return out


def full_partition_cost(dim: int, pairs: list[Pair], threshold: float, guard: bool) -> dict[str, float]:
    """Median microseconds of ``match`` with an embedded prompt (search and guard, no embedding)
    against a partition at capacity: random unit vectors, with every ``a`` prompt's facts."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((DEFAULT_CAPACITY, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = SemanticIndex(_NoEmbedder(), threshold, guard=guard, check="rules" if guard else "none")
    texts = [p.a for p in pairs]
    stored = [facts(t) for t in texts]
    for i in range(DEFAULT_CAPACITY):
        index.add("", Prompt(f"{texts[i % len(texts)]} #{i}", vectors[i], stored[i % len(texts)]), i.to_bytes(4, "big"))
    # queries: stored vectors slightly perturbed, so that some candidates reach the threshold
    times = []
    for i, pair in enumerate(pairs):
        vector = vectors[i] + 0.05 * rng.standard_normal(dim).astype(np.float32)
        query = Prompt(pair.b, vector / np.linalg.norm(vector), facts(pair.b) if guard else None)
        started = time.perf_counter()
        index.match("", query)
        times.append(time.perf_counter() - started)
    return {"median_us": round(statistics.median(times) * 1e6, 1), "entries": index.size(""),
            "matrix_mb": round(DEFAULT_CAPACITY * dim * 4 / 1e6, 1)}


class _NoEmbedder:
    """For an index fed only prepared prompts."""

    name = "none"
    threshold = 1.0

    def embed(self, texts: list[str]) -> np.ndarray:
        """Never called: every prompt comes prepared."""
        raise AssertionError("the prompts come prepared")


def guard_cost(pairs: list[Pair]) -> dict[str, Any]:
    """Microseconds to read one prompt's facts and to compare two prompts' facts (each the best
    of three tries, then the median and p99 over all pairs), and which rule refuses which pairs."""
    reads, compares = [], []
    verdicts: dict[str, Counter[str]] = {"same": Counter(), "different": Counter()}
    refused_same_by_lang: Counter[str] = Counter()
    for pair in pairs:
        for text in (pair.a, pair.b):
            reads.append(min(_timed(facts, text)[1] for _ in range(3)))
        fa, fb = facts(pair.a), facts(pair.b)
        rule, _ = _timed(disagreement, fa, fb)
        compares.append(min(_timed(disagreement, fa, fb)[1] for _ in range(3)))
        verdicts["same" if pair.same else "different"][rule or "accepted"] += 1
        if pair.same and rule is not None:
            refused_same_by_lang[pair.lang] += 1
    reads.sort()
    compares.sort()
    return {
        "facts_us": {"median": round(statistics.median(reads) * 1e6, 1),
                     "p99": round(reads[int(0.99 * len(reads))] * 1e6, 1)},
        "compare_us": {"median": round(statistics.median(compares) * 1e6, 1),
                       "p99": round(compares[int(0.99 * len(compares))] * 1e6, 1)},
        # the first rule refusing each pair: on same pairs a lost hit, on different pairs a false hit avoided
        "verdicts": {label: dict(counts.most_common()) for label, counts in verdicts.items()},
        "refused_same_by_lang": dict(refused_same_by_lang),
    }


def _timed(function: Any, *args: Any) -> tuple[Any, float]:
    """``function(*args)`` and the seconds it took."""
    started = time.perf_counter()
    out = function(*args)
    return out, time.perf_counter() - started


# ---------------------------------------------------------------------------------------------
# Output

def plot(result: dict[str, Any], curves: dict[str, dict[str, list[tuple[float, float | None, float]]]],
         path: Path) -> None:
    """Precision against recall over the threshold sweep, tune and held out; the chosen thresholds marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
    for ax, split in zip(axes, (TUNE, HELD_OUT), strict=True):
        for order, (name, config) in enumerate(result["configs"].items()):
            colour = f"C{KINDS.index(config['embedder'])}"
            style = "-" if config["guard"] else ":"
            points = [(r, p) for _, p, r in curves[name][split] if p is not None]
            ax.plot([r for r, _ in points], [p for _, p in points], color=colour, linestyle=style, label=name)
            at, packed = config[split], config["crowded"][split]
            if packed["precision"] is not None:
                ax.plot(packed["recall"], packed["precision"], marker="s", color=colour, markersize=5,
                        fillstyle="none")
            if at["precision"] is not None:
                ax.plot(at["recall"], at["precision"], marker="o" if config["guard"] else "x", color=colour,
                        markersize=8)
                label = f"{config['threshold']:.2f}" + ("" if config["target_met_on_tune"] else " (best precision)")
                ax.annotate(label, (at["recall"], at["precision"]), fontsize=7, textcoords="offset points",
                            xytext=(-70 if at["recall"] > 0.8 else 6, -10 - 8 * (order % 3)), color=colour)
        ax.axhline(TARGET_PRECISION, color="grey", linestyle="--", linewidth=0.8, label="precision 99%")
        ax.set_xlabel("recall (true hits / same pairs)")
        ax.set_xlim(0, 1.02)
        ax.set_ylim(0.4, 1.01)
        counts = result["pairs"][split]
        ax.set_title(f"{split.replace('_', ' ')}: {counts['pairs']} pairs, {counts['same']} same\n"
                     f"o / x: at the threshold chosen on tune; square: the same, crowded partition", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("precision (true hits / hits)")
    axes[1].legend(fontsize=8, loc="lower left")
    fig.suptitle("semantic cache: threshold sweep per embedder, with the guard (solid) and without (dotted)")
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_semantic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="timed passes over the b prompts")
    args = parser.parse_args()

    pairs, fresh = load(), load(FRESH_DATA, FRESH)
    same = np.array([p.same for p in pairs])
    rows = {split: np.array([p.split == split for p in pairs]) for split in (TUNE, HELD_OUT)}
    texts = list(dict.fromkeys(t for p in pairs for t in (p.a, p.b)))
    allowed = np.array([disagreement(facts(p.a), facts(p.b)) is None for p in pairs])
    crowd = list(dict.fromkeys(p.a for p in pairs))  # the crowded partition: every a prompt
    crowd_facts = [facts(t) for t in crowd]
    query_facts = [facts(p.b) for p in pairs]
    own = np.array([crowd.index(p.a) for p in pairs])
    before = calibration_ms()
    result: dict[str, Any] = {
        "pairs": {"all": {"pairs": len(pairs), "same": int(same.sum())},
                  **{split: {"pairs": int(r.sum()), "same": int((same & r).sum()),
                             "by_kind": dict(Counter(p.kind for p in pairs if p.split == split))}
                     for split, r in rows.items()},
                  FRESH: {"pairs": len(fresh), "same": sum(p.same for p in fresh),
                          "by_kind": dict(Counter(p.kind for p in fresh))}},
        "target_precision": TARGET_PRECISION,
        "configs": {},
    }
    curves: dict[str, dict[str, list[tuple[float, float | None, float]]]] = {}
    embedders: dict[str, _Memo] = {}
    with Progress(transient=True, console=Console(stderr=True)) as progress:  # stdout: the JSON line only
        for kind in KINDS:
            embedder = embedders[kind] = _Memo(build_embedder(kind))
            embed_all(embedder, texts, progress, f"embedding with {kind}")
            vectors_a = embedder.embed([p.a for p in pairs])
            vectors_b = embedder.embed([p.b for p in pairs])
            scores = np.einsum("ij,ij->i", vectors_a, vectors_b)
            crowd_scores = vectors_b @ embedder.embed(crowd).T
            for guard in (False, True):
                name = f"{kind}{' + guard' if guard else ''}"
                gate = allowed if guard else np.ones(len(pairs), dtype=bool)
                curves[name] = {split: sweep(scores[r], gate[r], same[r]) for split, r in rows.items()}
                best, column = nearest_accepted(crowd_scores, query_facts, crowd_facts, guard)
                right = (column == own) & same
                crowd_tune = crowd_sweep(best[rows[TUNE]], right[rows[TUNE]], same[rows[TUNE]])
                threshold = choose(curves[name][TUNE], crowd_tune)
                met = threshold is not None
                if threshold is None:
                    threshold = most_precise(curves[name][TUNE])
                # through the index, not the sweep's arithmetic (the two must agree)
                config = evaluate(kind, guard, threshold, embedder=embedder, pairs=pairs, progress=progress)
                config["target_met_on_tune"] = met
                config["threshold_pairwise_only"] = choose(curves[name][TUNE])
                config["crowded"] = crowded(embedder.inner, guard, pairs, threshold, args.rounds, progress)
                on_fresh = evaluate(kind, guard, threshold, embedder=embedder, pairs=fresh, progress=progress)
                config[FRESH] = {**on_fresh[FRESH], "false_hits_by_kind": on_fresh["false_hits_by_kind"]}
                for split in (TUNE, HELD_OUT):  # precision / recall every 0.05
                    config[f"sweep_{split}"] = {f"{t:.2f}": [p, round(r, 3)] for t, p, r in curves[name][split]
                                                if round(t * 100) % 5 == 0}
                result["configs"][name] = config
        result["full_partition_match_us"] = {
            kind: {f"guard_{'on' if guard else 'off'}": full_partition_cost(
                embedders[kind].embed(["x"]).shape[1], pairs, result["configs"][kind]["threshold"], guard)
                for guard in (False, True)} for kind in KINDS}
    result["guard"] = guard_cost(pairs)
    reachable = [c for c in result["configs"].values() if c["target_met_on_tune"]]
    best = max(reachable, key=lambda c: (c["tune"]["recall"], -KINDS.index(c["embedder"])))
    result["chosen"] = {"embedder": best["embedder"], "guard": best["guard"], "threshold": best["threshold"],
                        "rule": "best tune recall at tune precision >= 99%, pairwise and crowded; a tie goes "
                                "to the cheaper embedder"}
    result["defaults"] = {"embedder": DEFAULT_EMBEDDER, "threshold": DEFAULT_THRESHOLD,
                          "match_chosen": (DEFAULT_EMBEDDER, DEFAULT_THRESHOLD)
                          == (best["embedder"], best["threshold"])}
    result["calibration_ms"] = {"before": before, "after": calibration_ms()}
    plot(result, curves, PLOT)
    emit("cache_semantic", result)


if __name__ == "__main__":
    main()
