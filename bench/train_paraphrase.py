"""Train the semantic cache's learned paraphrase check (``extproc/cache/paraphrase.py``) and write
``extproc/cache/paraphrase_model.json``.

Training data: this project's own labelled pairs, ``bench/data/paraphrases.yaml``,
``paraphrases_fresh.yaml`` and ``paraphrases_train_*.yaml`` (2,956 pairs from ten writers:
paraphrases and near misses of every kind, thirteen languages; 2,815 once those sharing a prompt with
the blind sets are left out).
The blind sets (``bench/data/blind/``) are not trained on: ``python -m bench.blind`` measures the
trained model on them afterwards. Only their prompts' texts are read here, so that a training pair
sharing a prompt with them (a common question both sides wrote) is left out.

The cosine feature comes from the embedder the model is trained for (``--embedder``, the semantic
cache's default, ``minilm``): a model is valid only with that embedder. The probability threshold
is chosen by five-fold cross-validation on the training pairs: the lowest that keeps precision at
``--precision`` (99%) on the held-out folds, so that the shipped model's false-hit rate is
estimated on pairs it was not fitted to; the steps before the model (vetoes, the same words) are
part of what is cross-validated, and the model is fitted only on the pairs they leave open.
``min_cosine`` is the lowest cosine of a pair the cross-validated model served: the index offers
it no candidate below that.

Prints one JSON line (the cross-validated precision and recall).

    python -m bench.train_paraphrase [--embedder minilm] [--precision 0.99] [--write]
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import numpy as np
import yaml
from rich.progress import Progress

from bench.common import emit
from extproc.cache.paraphrase import MODEL_PATH, ParaphraseModel, pair_features, read, same_words, veto
from extproc.routing.embedders import build_embedder
from extproc.stumps import fit_stumps

DATA = Path(__file__).parent / "data"
BLIND = DATA / "blind"  # only their prompts' texts are read here, to leave those out of training
TRAINING = (DATA / "paraphrases.yaml", DATA / "paraphrases_fresh.yaml",
            *sorted(DATA.glob("paraphrases_train_*.yaml")))
FOLDS = 5


def pairs() -> list[tuple[str, str, bool]]:
    """The training pairs: (a, b, same), but for those with a prompt that a blind set has too
    (common questions, written by both sides): the blind figure must be of prompts never seen."""
    seen = {text.strip().lower() for path in sorted(BLIND.glob("cache_pairs_*.yaml"))
            for pair in yaml.safe_load(path.read_text())["pairs"] for text in (pair["a"], pair["b"])}
    return [(p["a"], p["b"], bool(p["same"])) for path in TRAINING for p in yaml.safe_load(path.read_text())["pairs"]
            if p["a"].strip().lower() not in seen and p["b"].strip().lower() not in seen]


def features(embedder_name: str, data: list[tuple[str, str, bool]], progress: Progress
             ) -> tuple[np.ndarray, np.ndarray]:
    """Each pair's features, with ``embedder_name``'s cosine, and what the steps before the model
    say of it: 0 (a veto: never served), 1 (the same words: served), else -1 (the model decides)."""
    embedder = build_embedder(embedder_name)
    texts = list(dict.fromkeys(t for a, b, _ in data for t in (a, b)))
    task = progress.add_task(f"embedding {len(texts)} prompts ({embedder_name})", total=len(texts))
    vectors: dict[str, np.ndarray] = {}
    for start in range(0, len(texts), 32):
        chunk = texts[start:start + 32]
        vectors.update(zip(chunk, embedder.embed(chunk), strict=True))
        progress.advance(task, len(chunk))
    read_once = {text: read(text) for text in texts}
    x = np.array([pair_features(float(vectors[a] @ vectors[b]), read_once[a], read_once[b]) for a, b, _ in data])
    ruled = np.array([0.0 if veto(read_once[a], read_once[b]) else 1.0 if same_words(read_once[a], read_once[b])
                      else -1.0 for a, b, _ in data])
    return x, ruled


def threshold_for(probability: np.ndarray, same: np.ndarray, precision: float) -> tuple[float, float, float]:
    """The lowest threshold whose hits keep ``precision``: (threshold, its precision, recall)."""
    order = np.argsort(-probability, kind="stable")
    hits = np.cumsum(same[order])
    precisions = hits / np.arange(1, len(order) + 1)
    ok = np.flatnonzero(precisions >= precision)
    if ok.size == 0:
        return 1.0, 0.0, 0.0
    last = int(ok[-1])
    return float(probability[order[last]]), float(precisions[last]), float(hits[last] / same.sum())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.train_paraphrase", description=__doc__.split("\n\n")[0])
    parser.add_argument("--embedder", default="minilm")
    parser.add_argument("--precision", type=float, default=0.99)
    parser.add_argument("--rounds", type=int, default=300, help="boosting rounds (stumps)")
    parser.add_argument("--write", action="store_true", help=f"write {MODEL_PATH.name}")
    args = parser.parse_args(argv)
    data = pairs()
    same = np.array([s for _, _, s in data], dtype=float)
    with Progress(transient=True) as progress:
        x, ruled = features(args.embedder, data, progress)
    learned = ruled < 0  # the model is trained on, and decides, the pairs the steps before it leave open
    folds = np.random.default_rng(0).integers(0, FOLDS, len(data))
    held_out = np.where(learned, 0.0, ruled)
    for fold in range(FOLDS):
        train, test = learned & (folds != fold), learned & (folds == fold)
        stumps, bias = fit_stumps(x[train], same[train], rounds=args.rounds)
        model = ParaphraseModel(stumps, bias, 0.5)
        held_out[test] = [model.probability(list(row)) for row in x[test]]
    threshold, precision, recall = threshold_for(held_out, same, args.precision)
    served = learned & (held_out >= threshold)
    min_cosine = float(x[served, 0].min()) if served.any() else 1.0
    stumps, bias = fit_stumps(x[learned], same[learned], rounds=args.rounds)
    model = ParaphraseModel(stumps, bias, round(threshold, 6), args.embedder, round(max(0.01, min_cosine - 0.01), 4))
    about = {"trained_on": [p.name for p in TRAINING], "pairs": len(data),
             "pairs_vetoed": int((ruled == 0).sum()), "pairs_same_words": int((ruled == 1).sum()),
             "cross_validated": {"folds": FOLDS, "precision": round(precision, 4), "recall": round(recall, 4)},
             "trained": datetime.date.today().isoformat()}
    if args.write:
        MODEL_PATH.write_text(model.to_json(**about))
    emit("train_paraphrase", {"bench": "train_paraphrase", "stumps": len(stumps), "threshold": model.threshold,
                              "embedder": model.embedder, "min_cosine": model.min_cosine, **about})


if __name__ == "__main__":
    main()
