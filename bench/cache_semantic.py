"""Semantic response cache: what a lookup costs with the learned check, and how it decides on this
project's own labelled pairs.

The pairs are ``bench/data/paraphrases.yaml`` and ``paraphrases_fresh.yaml`` (read their headers):
paraphrases and near misses of every kind, in five languages. Both are among the learned check's
training files (``bench.train_paraphrase``), so the precision and recall printed here are in-sample:
a regression check, not a quality figure. The quality figure is the frozen blind pairs'
(``python -m bench.blind``), never trained on.

Each pair is evaluated as the cache meets it (``evaluate``): ``a`` alone in a fresh partition of a
``SemanticIndex`` with the product's defaults, then ``b`` looked up; a hit is a match.
precision = true hits / hits; recall = true hits / same pairs. ``evaluate`` is also what
``bench.blind`` and ``bench.cache`` run.

Crowded: every ``a`` prompt of a set in one partition and every ``b`` looked up from its text,
``--rounds`` times: the cost of one lookup (embedding with both encoders, the prompt's features,
the search, the check of the nearest candidate, or of more with ``crowded(candidates=)``; median
and p90), and the hits on another pair's ``a`` (counted false: a few pairs do ask what another
pair asks). A ``b`` that is, word for word, another pair's ``a`` (a writer's near miss of one
prompt can be the prompt of another pair) is answered as the gateway answers it: by its exact key,
with that identical prompt's own answer, before the semantic index is asked
(``extproc.cache.lookup``); it is counted apart (``exact``), outside the index's precision and
recall. Full partition: one lookup of a prepared prompt
against 10,000 stored prompts (random vectors beside real prompts' features): the search and the
check alone.

``--newer``: the same check on ``bench/data/paraphrases_next/``, four writers' pairs the shipped
models never trained on (out of sample; mostly one topic asked two ways), pairwise at each
operating point and crowded, alone and beside ``--distractors`` prompts of the training files in
every partition (a busy cache's other traffic): a hit on one counts false and is listed, since
some of them ask what the lookup asks.

Prints one JSON line; writes docs/cache-semantic.png (not with ``--newer``).

    python -m bench.cache_semantic [--rounds 3] [--newer [--distractors 2000,8000]]
"""

from __future__ import annotations

import argparse
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
from extproc.cache.semantic import DEFAULT_CANDIDATES, DEFAULT_CAPACITY, Check, Prompt, SemanticIndex
from extproc.config import SemanticCacheSpec
from extproc.config.schema import OPERATING_POINTS
from extproc.routing.embedders import Embedder, build_embedder

DATA = Path(__file__).parent / "data"
OWN = {"own": DATA / "paraphrases.yaml", "fresh": DATA / "paraphrases_fresh.yaml"}
NEWER = DATA / "paraphrases_next"  # four writers' pairs the shipped models never trained on
READ = NEWER / "distractor_hits_read.yaml"  # ``--newer``'s hits on other traffic, read by hand
PLOT = Path(__file__).parent.parent / "docs" / "cache-semantic.png"
BATCH = 32  # texts per embed call


@dataclass(frozen=True, slots=True)
class Pair:
    """One labelled pair; ``split``: the set (or writer) it comes from."""

    a: str
    b: str
    same: bool
    kind: str  # paraphrase | number | negation | entity | other | unrelated | ...
    lang: str
    split: str


def load(name: str) -> list[Pair]:
    """The labelled pairs of one of ``OWN``'s files."""
    return load_pairs(OWN[name], name)


def load_pairs(path: Path, split: str) -> list[Pair]:
    """The labelled pairs of one file (``pairs:`` of a, b, same, kind, lang), all in ``split``."""
    return [Pair(p["a"], p["b"], bool(p["same"]), p["kind"], str(p["lang"]), split)
            for p in yaml.safe_load(path.read_text())["pairs"]]


def load_newer() -> list[Pair]:
    """``NEWER``'s pairs, one split a writer (file)."""
    return [pair for path in sorted(NEWER.glob("paraphrases_*.yaml")) for pair in load_pairs(path, path.stem)]


def distractor_prompts(count: int, pairs: list[Pair]) -> list[str]:
    """``count`` prompts of the training files (``paraphrases*.yaml``) that are none of ``pairs``'
    prompts, drawn with a fixed seed: other writers' traffic on the same everyday topics."""
    own = {text for pair in pairs for text in (pair.a, pair.b)}
    prompts = [text for path in sorted(DATA.glob("paraphrases*.yaml")) for pair in load_pairs(path, path.stem)
               for text in (pair.a, pair.b) if text not in own]
    drawn = list(dict.fromkeys(prompts))
    np.random.default_rng(0).shuffle(drawn)
    return drawn[:count]


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


def evaluate(pairs: list[Pair] | None = None, *, progress: Progress | None = None, check: Check = "learned",
             precision: float | None = None, threshold: float | None = None,
             embedder: Embedder | None = None) -> dict[str, Any]:
    """Precision and recall through a real ``SemanticIndex`` with the product's defaults (each
    pair: ``a`` added to a fresh partition, ``b`` matched), per split and over all pairs, and the
    kinds of the false hits. ``precision``: the learned check's operating point (default: its
    model's); ``check="none"``: the cosine alone, at ``threshold``."""
    pairs = load("own") + load("fresh") if pairs is None else pairs
    spec = SemanticCacheSpec(precision=precision)
    index = SemanticIndex(embedder or build_embedder(spec.embedder), threshold, capacity=1, check=check,
                          precision=spec.precision)
    texts = list(dict.fromkeys(t for p in pairs for t in (p.a, p.b)))
    task = progress.add_task(f"{spec.embedder} + {index.check} at {index.threshold}", total=len(texts)) \
        if progress else None
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
    result: dict[str, Any] = {"embedder": spec.embedder, "check": index.check, "threshold": index.threshold,
                              "operating_point": (spec.precision or 0.99) if index.check == "learned" else None}
    for split in dict.fromkeys(p.split for p in pairs):
        rows = np.array([p.split == split for p in pairs])
        result[split] = figures(hit[rows], same[rows])
    result["all"] = figures(hit, same)
    result["false_hits_by_kind"] = dict(Counter(p.kind for p, h in zip(pairs, hit, strict=True) if h and not p.same))
    result["missed_by_lang"] = dict(Counter(p.lang for p, h in zip(pairs, hit, strict=True) if p.same and not h))
    return result


def crowded(pairs: list[Pair], rounds: int, progress: Progress, candidates: int = DEFAULT_CANDIDATES,
            distractors: list[str] | None = None, precision: float | None = None) -> dict[str, Any]:
    """Each split's ``a`` prompts in one partition (a split: one set or writer), every ``b`` prompt
    looked up from its text (``candidates``: how many stored prompts the check is offered): the
    cost of one ``match`` (median and p90 milliseconds), and the hits, a hit on another pair's
    ``a`` counted false; a ``b`` stored word for word (a pair's ``a`` or a distractor) is the exact
    key's (``exact``), not the index's, as in the gateway. ``distractors``: more prompts stored in
    every partition first (a busy cache's other traffic); a hit on one is counted false too, and
    listed (``on_distractor``, ``distractor_hits``: some ask what the lookup asks, which only
    reading them tells). ``precision``: the learned check's operating point (default: its model's)."""
    spec = SemanticCacheSpec(precision=precision)
    index = SemanticIndex(build_embedder(spec.embedder), spec.threshold, candidates=candidates,
                          capacity=max(DEFAULT_CAPACITY, len(pairs) + len(distractors or ())),
                          precision=spec.precision)
    splits = list(dict.fromkeys(p.split for p in pairs))
    for prompt in index.prepare_many(list(distractors or ())):
        for split in splits:
            index.add(split, prompt, prompt.text.encode())
    stored = list(dict.fromkeys((p.split, p.a) for p in pairs))
    prepared = index.prepare_many([text for _, text in stored])
    for (split, _), prompt in zip(stored, prepared, strict=True):
        index.add(split, prompt, prompt.text.encode())
    stored_set = set(stored)
    distracting = set(distractors or ())
    exact = np.array([(p.split, p.b) in stored_set or p.b in distracting for p in pairs])
    task = progress.add_task("crowded lookups", total=rounds * len(pairs))
    times = []
    hit = np.zeros(len(pairs), dtype=bool)
    right = np.zeros(len(pairs), dtype=bool)
    other = np.zeros(len(pairs), dtype=bool)
    on_distractor: list[dict[str, Any]] = []
    for round_ in range(rounds):
        for i, pair in enumerate(pairs):
            if exact[i]:  # the exact key answers it; the gateway never asks the index
                progress.advance(task)
                continue
            started = time.perf_counter()
            found = index.match(pair.split, pair.b)
            times.append(time.perf_counter() - started)
            progress.advance(task)
            if round_ == 0 and found is not None:
                hit[i], right[i], other[i] = True, found.text == pair.a and pair.same, found.text != pair.a
                if found.text in distracting:
                    on_distractor.append({"lookup": pair.b, "stored": found.text, "cosine": found.score})
    times.sort()
    same = np.array([p.same for p in pairs])
    out: dict[str, Any] = {"entries": sum(index.size(split) for split in splits)}
    for split in [*splits, "all"]:
        rows = np.array([split in ("all", p.split) for p in pairs])
        hits, true_hits = int(hit[rows].sum()), int(right[rows].sum())
        positives = int((same & rows & ~exact).sum())
        out[split] = {"precision": round(true_hits / hits, 4) if hits else None,
                      "recall": round(true_hits / positives, 4) if positives else None, "hits": hits,
                      "false_hits": hits - true_hits, "on_another_pair": int(other[rows].sum()),
                      "exact": int(exact[rows].sum())}
    out["lookup_ms"] = {"median": round(statistics.median(times) * 1e3, 2),
                        "p90": round(times[int(0.9 * len(times))] * 1e3, 2)}
    if distractors:
        out["distractors"] = len(distractors)
        out["on_distractor"] = len(on_distractor)
        out["distractor_hits"] = on_distractor
    return out


def full_partition_cost(pairs: list[Pair], progress: Progress) -> dict[str, float]:
    """Median and p90 milliseconds of ``match`` with a prepared prompt (the search and the check, no
    embedding) against a partition at capacity: random unit vectors with real prompts' features
    and second vectors; the queries are stored vectors slightly perturbed, so that candidates reach
    the threshold and the check runs."""
    spec = SemanticCacheSpec()
    index = SemanticIndex(build_embedder(spec.embedder), spec.threshold)
    texts = list(dict.fromkeys(p.a for p in pairs))[:200]
    real = index.prepare_many(texts)
    rng = np.random.default_rng(0)
    dim = real[0].vector.shape[0]
    vectors = rng.standard_normal((DEFAULT_CAPACITY, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for i in range(DEFAULT_CAPACITY):
        model = real[i % len(real)]
        index.add("", Prompt(f"{model.text} #{i}", vectors[i], model.facts, model.meaning), i.to_bytes(4, "big"))
    queries = index.prepare_many([p.b for p in pairs[:200]])
    times = []
    task = progress.add_task("full partition", total=len(queries))
    for i, query in enumerate(queries):
        vector = vectors[i] + 0.05 * np.asarray(rng.standard_normal(dim), dtype=np.float32)
        started = time.perf_counter()
        index.match("", Prompt(query.text, vector / np.linalg.norm(vector), query.facts, query.meaning))
        times.append(time.perf_counter() - started)
        progress.advance(task)
    times.sort()
    return {"median_ms": round(statistics.median(times) * 1e3, 3),
            "p90_ms": round(times[int(0.9 * len(times))] * 1e3, 3), "entries": index.size(""),
            "matrix_mb": round(DEFAULT_CAPACITY * dim * 4 / 1e6, 1)}


def plot(points: dict[str, dict[str, Any]], path: Path) -> None:
    """Precision and recall at each operating point, per set of pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for n, split in enumerate(OWN):
        at = [(float(p), r[split]) for p, r in points.items() if r[split]["precision"] is not None]
        ax.plot([f["recall"] for _, f in at], [f["precision"] for _, f in at], marker="o", color=f"C{n}",
                label=f"{split} pairs")
        for point, f in at:
            ax.annotate(f"{point}", (f["recall"], f["precision"]), fontsize=7, textcoords="offset points",
                        xytext=(4, -10), color=f"C{n}")
    ax.axhline(0.99, color="grey", linestyle="--", linewidth=0.8, label="precision 99%")
    ax.set_xlabel("recall (true hits / same pairs)")
    ax.set_ylabel("precision (true hits / hits)")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0.8, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("semantic cache, learned check at its operating points\n"
                 "(this project's own pairs: training data, in-sample)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_semantic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="timed passes over the b prompts")
    parser.add_argument("--newer", action="store_true",
                        help=f"the shipped check on {NEWER.name}/ (never trained on): pairwise, crowded, and crowded "
                             "beside --distractors other prompts (hits on them listed in the JSON, to read)")
    parser.add_argument("--distractors", type=lambda v: [int(n) for n in v.split(",")], default=[2000, 8000])
    args = parser.parse_args()
    if args.newer:
        newer(args.distractors)
        return
    pairs = load("own") + load("fresh")
    before = calibration_ms()
    result: dict[str, Any] = {"pairs": {split: {"pairs": sum(p.split == split for p in pairs),
                                                "same": sum(p.same and p.split == split for p in pairs)}
                                        for split in OWN},
                              "in_sample": True}
    with Progress(transient=True, console=Console(stderr=True)) as progress:  # stdout: the JSON line only
        embedder = build_embedder(SemanticCacheSpec().embedder)
        result["at_precision"] = {str(point): evaluate(pairs, progress=progress, precision=point, embedder=embedder)
                                  for point in OPERATING_POINTS}
        result["crowded"] = crowded(pairs, args.rounds, progress)
        result["full_partition_match"] = full_partition_cost(pairs, progress)
    result["calibration_ms"] = {"before": before, "after": calibration_ms()}
    plot(result["at_precision"], PLOT)
    emit("cache_semantic", result)


def newer(counts: list[int]) -> None:
    """``--newer``: out-of-sample figures on the newer writers' pairs, crowded as the partition fills."""
    pairs = load_newer()
    result: dict[str, Any] = {"pairs": len(pairs), "same": sum(p.same for p in pairs), "in_sample": False}
    with Progress(transient=True, console=Console(stderr=True)) as progress:
        embedder = build_embedder(SemanticCacheSpec().embedder)
        result["at_precision"] = {str(point): evaluate(pairs, progress=progress, precision=point, embedder=embedder)
                                  for point in OPERATING_POINTS}
        strict, most = max(OPERATING_POINTS), max([0, *counts])
        drawn = distractor_prompts(most, pairs)  # one seeded draw: each smaller count takes its first prompts
        result["crowded"] = {str(count): crowded(pairs, 1, progress, distractors=drawn[:count])
                             for count in [0, *counts]}
        # The strictest operating point beside the most traffic: what an operator of a busy cache can pick.
        result[f"crowded_at_{strict}"] = {str(most): crowded(pairs, 1, progress, precision=strict, distractors=drawn)}
    for run in [*result["crowded"].values(), *result[f"crowded_at_{strict}"].values()]:
        if "distractor_hits" in run:
            run["read"] = read_by_hand(run)
    emit("cache_semantic_newer", result)


def read_by_hand(run: dict[str, Any]) -> dict[str, Any]:
    """A crowded run's precision with its hits on distractors judged as ``READ`` judged them (one
    not there counts wrong): how many were read, how many asked something else, and the precision
    with the right ones counted right."""
    read = {(h["lookup"], h["stored"]): bool(h["same"]) for h in yaml.safe_load(READ.read_text())["hits"]}
    verdicts = [read.get((h["lookup"], h["stored"])) for h in run["distractor_hits"]]
    right = sum(v is True for v in verdicts)
    every = run["all"]
    true_hits = every["hits"] - every["false_hits"] + right
    return {"read": sum(v is not None for v in verdicts), "same": right, "different": sum(v is False for v in verdicts),
            "precision": round(true_hits / every["hits"], 4) if every["hits"] else None}


if __name__ == "__main__":
    main()
