"""Train the semantic cache's learned paraphrase check (``extproc/cache/paraphrase.py``) and write
``extproc/cache/paraphrase_model.json``.

Training data: this project's own labelled pairs, ``bench/data/paraphrases.yaml``,
``paraphrases_fresh.yaml`` and ``paraphrases_train_*.yaml`` (37 files, one writer each: paraphrases
and near misses of every kind, over twenty languages; 13,513 pairs once those sharing a prompt with
the blind sets are left out), and 2,702 pairs drawn from them (``drawn``: a rewording beside
another pair's prompt of its file, labelled different). The shipped model was trained on all of
them.
The blind sets (``bench/data/blind/``) are not trained on: ``python -m bench.blind`` measures the
trained model on them afterwards. Only their prompts' texts are read here, so that a training pair
sharing a prompt with them (a common question both sides wrote) is left out.

The cosine feature comes from the embedder the model is trained for (``--embedder``, the semantic
cache's default, ``minilm``): a model is valid only with that embedder. Both parts are fitted: the
boosted stumps over the words, and the logistic regression over ``pair_vector`` (L2 penalty
``--l2``, inputs standardised, Newton steps; the standardisation is folded into the shipped
weights). The cross-encoder's votes (``extproc/cache/pairs.py``), cross-validated by
``python -m bench.train_pair_encoder --folds 4``, join the two parts' cross-validated log-odds
through a logistic regression (``Stack``; ``--no-cross``: without them). The probability
threshold is chosen by cross-validation by writer (the two parts: one file held out at a time;
the cross-encoder: four groups of files): the lowest that keeps precision at ``--precision``
(99%) on the held-out files, so that the shipped model's false-hit rate is estimated on a writer
it was not fitted to, as a user's traffic is, and keeps it for new writers: for 95% of sets of
writers drawn with replacement from these (``threshold_for``), since one writer's pairs share a
style and a new writer's may not; the steps before the model (vetoes, the same words)
are part of what is cross-validated, and the model is fitted only on the pairs they leave open.
``min_cosine`` is the lowest cosine of a pair the cross-validated model served: the index offers
it no candidate below that. ``min_meaning`` is the second encoder's cosine above which 98% of the
training paraphrases lie (``MEANING_QUANTILE``): no pair below it is served (but the same words),
in cross-validation as in a lookup. The parts were fitted on paraphrases and near misses only,
and read two unrelated prompts as a heavy rewording: without the floor, 1.5% of random pairs of
prompts from two writers' files and 4.8% from one file were served. The thresholds that held 98%
and 99.5% are shipped too (``operating_points``: an operator's ``semantic.precision``).

Prints one JSON line (the cross-validated precision and recall).

    python -m bench.train_paraphrase [--embedder minilm] [--precision 0.99] [--l2 300] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import yaml
from rich.progress import Progress

from bench.common import emit
from extproc.cache.paraphrase import (
    CROSS_CAP,
    ENCODER,
    FEATURES,
    MODEL_PATH,
    Linear,
    ParaphraseModel,
    Stack,
    pair_features,
    pair_vector,
    read,
    same_words,
    veto,
)
from extproc.config.schema import OPERATING_POINTS  # the cross-validated precisions an operator may ask for
from extproc.routing.embedders import build_embedder
from extproc.stumps import fit_stumps

DATA = Path(__file__).parent / "data"
FOLDS_PATH = DATA / "pair_encoder_folds.json"  # bench.train_pair_encoder writes it
BLIND = DATA / "blind"  # only their prompts' texts are read here, to leave those out of training
DRAWN_SHARE, DRAWN_BAND = 0.2, (0.15, 0.9)  # drawn pairs a file (``drawn``), and their MiniLM cosines
MEANING_QUANTILE = 0.02  # of the paraphrases' second-encoder cosines: the serving floor ``min_meaning``
DRAWS, LOW_QUANTILE = 1000, 0.05  # threshold_for's draws of writers, and the share of them that may fall short
TRAINING = (DATA / "paraphrases.yaml", DATA / "paraphrases_fresh.yaml",
            *sorted(DATA.glob("paraphrases_train_*.yaml")))


def pairs() -> list[tuple[str, str, bool, str]]:
    """The training pairs: the labelled ones (``labelled_pairs``), then each file's drawn pairs
    (``drawn``)."""
    labelled = labelled_pairs()
    return labelled + drawn(labelled)


def labelled_pairs() -> list[tuple[str, str, bool, str]]:
    """The labelled pairs: (a, b, same, the file it comes from), but for those with a prompt that a
    blind set has too (common questions, written by both sides): the blind figure must be of
    prompts never seen."""
    seen = {text.strip().lower() for path in sorted(BLIND.glob("cache_pairs_*.yaml"))
            for pair in yaml.safe_load(path.read_text())["pairs"] for text in (pair["a"], pair["b"])}
    return [(p["a"], p["b"], bool(p["same"]), path.name) for path in TRAINING
            for p in yaml.safe_load(path.read_text())["pairs"]
            if p["a"].strip().lower() not in seen and p["b"].strip().lower() not in seen]


def drawn(labelled: list[tuple[str, str, bool, str]], vectors: Mapping[str, np.ndarray] | None = None
          ) -> list[tuple[str, str, bool, str]]:
    """Pairs no writer wrote, as a partition holding many prompts offers them: for ``DRAWN_SHARE``
    of each file's pairs (drawn with a seed from the file's name), its ``b`` beside another pair's
    ``a`` of the same file, drawn among those whose MiniLM cosine with it lies in ``DRAWN_BAND`` (a
    candidate the index would check, not likely a rewording of it), labelled different. A prompt
    that a labelled pair already joins to ``b``, the same text, or the same words are not drawn.
    Without them the check's parts never saw two unrelated prompts and read some as a heavy
    rewording ("How do you quit Vim?" / "how to undo the last git commit"). ``vectors``: the
    prompts' MiniLM vectors (embedded here if not given)."""
    files: dict[str, list[tuple[str, str, bool, str]]] = {}
    for pair in labelled:
        files.setdefault(pair[3], []).append(pair)
    texts = list(dict.fromkeys(t for a, b, *_ in labelled for t in (a, b)))
    if vectors is None:
        vectors = embed_all("minilm", texts)
    facts = {text: read(text) for text in texts}  # once a prompt, not once a candidate
    joined = {frozenset((a.strip().lower(), b.strip().lower())) for a, b, *_ in labelled}
    out = []
    low, high = DRAWN_BAND
    for name, file_pairs in files.items():
        rng = random.Random(zlib.crc32(name.encode()))
        stored = list(dict.fromkeys(a for a, *_ in file_pairs))
        matrix = np.stack([vectors[a] for a in stored])
        for _, b, *_ in rng.sample(file_pairs, round(DRAWN_SHARE * len(file_pairs))):
            cosines = matrix @ vectors[b]
            fits = [a for a, cosine in zip(stored, cosines, strict=True) if low <= cosine < high
                    and frozenset((a.strip().lower(), b.strip().lower())) not in joined
                    and not same_words(facts[a], facts[b])]
            if fits:
                out.append((b, rng.choice(fits), False, name))
    return out


def embed_all(embedder_name: str, texts: list[str], progress: Progress | None = None) -> dict[str, np.ndarray]:
    """Each text's vector from ``embedder_name``."""
    embedder = build_embedder(embedder_name)
    task = None if progress is None else progress.add_task(f"embedding {len(texts)} prompts ({embedder_name})",
                                                           total=len(texts))
    vectors: dict[str, np.ndarray] = {}
    for start in range(0, len(texts), 32):
        chunk = texts[start:start + 32]
        vectors.update(zip(chunk, embedder.embed(chunk), strict=True))
        if progress is not None and task is not None:
            progress.advance(task, len(chunk))
    return vectors


def features(embedder_name: str, data: list[tuple[str, str, bool, str]], progress: Progress,
             vectors: Mapping[str, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each pair's stump features, with ``embedder_name``'s cosine (``vectors``: its vectors of
    every prompt, where the caller has them); its ``pair_vector`` (the second encoder's vectors
    too); and what the steps before the model say of it: 0 (a veto: never served), 1 (the same
    words: served), else -1 (the model decides)."""
    texts = list(dict.fromkeys(t for a, b, *_ in data for t in (a, b)))
    if vectors is None:
        vectors = embed_all(embedder_name, texts, progress)
    meanings = embed_all(ENCODER, texts, progress)
    read_once = {text: read(text) for text in texts}
    x = np.array([pair_features(float(vectors[a] @ vectors[b]), read_once[a], read_once[b]) for a, b, *_ in data])
    pair = np.array([pair_vector(row, vectors[a], vectors[b], meanings[a], meanings[b])
                     for row, (a, b, *_) in zip(x, data, strict=True)], dtype=np.float32)
    ruled = np.array([0.0 if veto(read_once[a], read_once[b]) else 1.0 if same_words(read_once[a], read_once[b])
                      else -1.0 for a, b, *_ in data])
    return x, pair, ruled


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float, steps: int = 30) -> Linear:
    """A logistic regression on standardised inputs, by Newton steps with an L2 penalty (the bias
    unpenalised), returned with the standardisation folded into its weights."""
    mean, scale = x.mean(axis=0), x.std(axis=0) + 1e-6
    z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])
    penalty = np.r_[np.full(z.shape[1] - 1, l2), 1e-6]
    w = np.zeros(z.shape[1])
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-(z @ w)))
        gradient = z.T @ (p - y) + penalty * w
        hessian = (z * (p * (1 - p))[:, None]).T @ z + np.diag(penalty)
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < 1e-6:
            break
    weights = w[:-1] / scale
    return Linear(weights.astype(np.float32), float(w[-1] - weights @ mean))


def cross_votes(data: list[tuple[str, str, bool, str]], path: Path) -> np.ndarray:
    """The cross-encoder's vote for each pair (``PairEncoder.votes``: the mean of its log-odds read
    both ways), from models that never saw its writer (``python -m bench.train_pair_encoder
    --folds 4`` wrote them to ``path``)."""
    from bench.train_pair_encoder import pairs_digest

    folds = json.loads(path.read_text())
    if folds["pairs_digest"] != pairs_digest(data):
        raise SystemExit(f"{path} scores other pairs than these: run python -m bench.train_pair_encoder "
                         f"--folds {folds['folds']} again")
    votes = (np.array(folds["logit"], dtype=float) + np.array(folds["swapped"], dtype=float)) / 2
    return np.clip(votes, -CROSS_CAP, CROSS_CAP)  # as a lookup caps them (Stack.join), before the stack is fitted


def fit_stack(words_and_vectors: np.ndarray, cross: np.ndarray, same: np.ndarray) -> Stack:
    """The logistic regression that joins the two votes (each a cross-validated log-odds)."""
    joined = fit_logistic(np.column_stack([words_and_vectors, cross]), same, l2=1.0)
    return Stack(round(float(joined.weights[0]), 6), round(float(joined.weights[1]), 6), round(joined.bias, 6))


def fit(x: np.ndarray, pair: np.ndarray, same: np.ndarray, rounds: int, l2: float) -> ParaphraseModel:
    """Both parts fitted on these pairs (threshold and floor not set yet)."""
    stumps, bias = fit_stumps(x, same, rounds=rounds)
    return ParaphraseModel(stumps, bias, 0.5, linear=fit_logistic(pair, same, l2), encoder=ENCODER)


def threshold_for(probability: np.ndarray, same: np.ndarray, precision: float,
                  writers: np.ndarray | None = None) -> tuple[float, float, float]:
    """The lowest threshold whose hits keep ``precision``: (threshold, its precision, recall).

    With ``writers`` (each pair's file), the precision that must hold is that of a new set of
    writers, not the pooled one: writers are drawn with replacement (``DRAWS`` times, seeded), and
    the threshold must keep ``precision`` in all but the worst ``LOW_QUANTILE`` of draws. Pairs of one
    writer share a style, so the pooled figure is as sure as a few dozen writers make it, not
    thousands of pairs: the pooled 99% threshold served 97.3% right answers to the blind set's
    writers. The precision and recall returned are the pooled ones at that threshold."""
    order = np.argsort(-probability, kind="stable")
    hits = np.cumsum(same[order])
    precisions = hits / np.arange(1, len(order) + 1)
    holds = precisions
    if writers is not None:
        names, writer = np.unique(writers[order], return_inverse=True)
        ranked = np.zeros((len(names), len(order)), dtype=np.float32)  # which writer's pair each rank is
        ranked[writer, np.arange(len(order))] = 1.0
        served, right = np.cumsum(ranked, axis=1), np.cumsum(ranked * same[order], axis=1)  # by writer, to each rank
        rng = np.random.default_rng(0)
        counts = np.stack([np.bincount(rng.integers(0, len(names), len(names)), minlength=len(names))
                           for _ in range(DRAWS)]).astype(np.float32)
        holds = np.quantile((counts @ right) / np.maximum(counts @ served, 1.0), LOW_QUANTILE, axis=0)
    ranked_probability = probability[order]
    tie_ends = np.r_[ranked_probability[1:] != ranked_probability[:-1], True]  # a threshold serves all its ties
    ok = np.flatnonzero((holds >= precision) & tie_ends)
    if ok.size == 0:
        return 1.0, 0.0, 0.0
    last = int(ok[-1])
    return float(probability[order[last]]), float(precisions[last]), float(hits[last] / same.sum())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.train_paraphrase", description=__doc__.split("\n\n")[0])
    parser.add_argument("--embedder", default="minilm")
    parser.add_argument("--precision", type=float, default=0.99)
    parser.add_argument("--rounds", type=int, default=300, help="boosting rounds (stumps)")
    parser.add_argument("--l2", type=float, default=300.0, help="the logistic part's L2 penalty")
    parser.add_argument("--cross", type=Path, default=FOLDS_PATH,
                        help="the cross-encoder's cross-validated votes (bench.train_pair_encoder --folds)")
    parser.add_argument("--no-cross", action="store_true", help="no cross-encoder: the words and vectors alone")
    parser.add_argument("--write", action="store_true", help=f"write {MODEL_PATH.name}")
    args = parser.parse_args(argv)
    with Progress(transient=True) as progress:
        labelled = labelled_pairs()
        # MiniLM's vectors, once: the drawn pairs are chosen by them, and the cosine feature is theirs
        minilm = embed_all("minilm", list(dict.fromkeys(t for a, b, *_ in labelled for t in (a, b))), progress)
        data = labelled + drawn(labelled, minilm)
        same = np.array([s for _, _, s, _ in data], dtype=float)
        files = np.array([name for *_, name in data])
        x, pair, ruled = features(args.embedder, data, progress, minilm if args.embedder == "minilm" else None)
        learned = ruled < 0  # the model is trained on, and decides, the pairs the steps before it leave open
        log_odds = np.zeros(len(data))
        task = progress.add_task("cross-validating, one writer's file held out at a time", total=len(TRAINING))
        for name in dict.fromkeys(files):
            train, test = learned & (files != name), learned & (files == name)
            log_odds[test] = fit(x[train], pair[train], same[train], args.rounds, args.l2).log_odds_many(
                x[test], pair[test])
            progress.advance(task)
        stack = None
        if not args.no_cross:
            cross = cross_votes(data, args.cross)
            stack = fit_stack(log_odds[learned], cross[learned], same[learned])
            log_odds = np.asarray(stack.join(log_odds, cross))
        meaning = pair[:, len(FEATURES)]  # pair_vector: the second encoder's cosine after the features
        min_meaning = float(np.quantile(meaning[same == 1], MEANING_QUANTILE))
        held_out = np.where(learned, 1.0 / (1.0 + np.exp(-log_odds)), ruled)
        held_out[learned & (meaning < round(min_meaning, 4))] = 0.0  # under the floor: never served
        threshold, precision, recall = threshold_for(held_out, same, args.precision, files)
        served = learned & (held_out >= threshold)
        min_cosine = float(x[served, 0].min()) if served.any() else 1.0
        trained = fit(x[learned], pair[learned], same[learned], args.rounds, args.l2)
    points = {p: threshold_for(held_out, same, p, files) for p in OPERATING_POINTS}
    model = ParaphraseModel(trained.stumps, trained.bias, round(threshold, 6), args.embedder,
                            round(max(0.01, min_cosine - 0.01), 4), trained.linear, ENCODER,
                            tuple((p, round(t, 6)) for p, (t, _, _) in points.items()), stack,
                            round(min_meaning, 4))
    about = {"trained_on": [p.name for p in TRAINING], "pairs": len(data),
             "pairs_vetoed": int((ruled == 0).sum()), "pairs_same_words": int((ruled == 1).sum()),
             "l2": args.l2, "cross_encoder": None if stack is None else args.cross.name,
             "cross_validated": {
                 "by": "leave one file (writer) out" + ("" if stack is None else
                                                        "; the cross-encoder: four groups of writers"),
                 "thresholds": f"held for {1 - LOW_QUANTILE:.0%} of {DRAWS} draws of writers",
                 "precision": round(precision, 4), "recall": round(recall, 4),
                 "operating_points": {str(p): {"precision": round(held, 4), "recall": round(r, 4)}
                                      for p, (_, held, r) in points.items()}},
             "trained": datetime.date.today().isoformat()}
    if args.write:
        MODEL_PATH.write_text(model.to_json(**about))
    emit("train_paraphrase", {"bench": "train_paraphrase", "stumps": len(model.stumps), "threshold": model.threshold,
                              "embedder": model.embedder, "encoder": model.encoder, "min_cosine": model.min_cosine,
                              "min_meaning": model.min_meaning,
                              **about})


if __name__ == "__main__":
    main()
