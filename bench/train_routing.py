"""Train semantic routing's learned decision (``extproc/routing/intents.py``) and write
``extproc/routing/intent_model.json``.

Training data: small intents configs written apart from this code, as a user writes one
(``bench/data/routing_train/*.yaml``: eleven writers, 33 configs of 5-8 intents with 6-8 examples,
and 80 new prompts each, 12-14 of them of no intent; the shipped model was trained on all of them,
its file lists them), and this project's own ``bench/data/intents.yaml``
cut to 7 examples an intent (three draws). The blind sets (``bench/data/blind/``) are never read:
``python -m bench.blind`` measures the trained model on them afterwards.

Each config is compiled as the gateway compiles it (its index, the shipped background prompts);
each (prompt, intent) is one row of ``intent_features``, labelled 1 when the prompt is that
intent's. The stumps' count and the probability bar are chosen by leave-one-writer-out
cross-validation: every writer's configs are decided by a model fitted on the other writers' only,
so the figure is that of a user whose config the model never saw. The threshold decision's
accuracy on the same configs is printed beside it.

Prints one JSON line.

    python -m bench.train_routing [--embedder multilingual] [--write]
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from rich.progress import Progress

from bench.common import emit
from extproc.routing.embedders import Embedder, build_embedder
from extproc.routing.intents import (
    FEATURES,
    MODEL_PATH,
    Intent,
    IntentIndex,
    IntentModel,
    background_prompts,
    decide_learned,
)
from extproc.stumps import fit_stumps

DATA = Path(__file__).parent / "data"
TRAIN = DATA / "routing_train"
OWN = DATA / "intents.yaml"
OWN_DRAWS, OWN_EXAMPLES = 3, 7
NONE = "none"
ROUNDS = (100, 200, 400)
BARS = tuple(round(float(x), 3) for x in np.arange(0.10, 0.81, 0.025))


@dataclass
class Config:
    name: str
    writer: str  # the cross-validation group
    intents: tuple[Intent, ...]
    prompts: list[str]
    labels: list[str]  # an intent's name or NONE


def configs() -> list[Config]:
    """The training configs: every writer's files, then the project's own set cut to 7 examples."""
    out = []
    for path in sorted(TRAIN.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        intents = tuple(Intent(i["name"], tuple(i["examples"]), "m", "p", i.get("description", ""))
                        for i in doc["intents"])
        out.append(Config(path.stem, path.stem.rsplit("_", 1)[0], intents, [e["prompt"] for e in doc["eval"]],
                          [e["intent"] for e in doc["eval"]]))
    own = yaml.safe_load(OWN.read_text())
    for draw in range(OWN_DRAWS):
        rng = np.random.default_rng(draw)
        intents = tuple(Intent(i["name"], tuple(str(e) for e in rng.choice(i["examples"], OWN_EXAMPLES, replace=False)),
                               "m", "p", i.get("description", "")) for i in own["intents"])
        out.append(Config(f"own_{draw}", "own", intents, [e["text"] for e in own["eval"]],
                          [e.get("intent", NONE) for e in own["eval"]]))
    return out


@dataclass
class Compiled:
    config: Config
    features: np.ndarray  # (prompts, intents, features)
    truth: np.ndarray  # (prompts, intents): 1 where the prompt is that intent's
    baseline: float  # the threshold decision's accuracy


def compile_config(config: Config, embedder: Embedder, center: bool) -> Compiled:
    """One config's rows, read through the index the gateway builds (``center``: on centred
    vectors), and the threshold decision's accuracy on it (as the gateway runs it: not centred)."""
    def index(centred: bool) -> IntentIndex:
        return IntentIndex(config.intents, embedder, cache_size=0, background=background_prompts(),
                           scoring="centroid", decision="threshold", center=centred)

    learned, threshold = index(center), index(False)
    names = [i.name for i in config.intents]
    truth = np.array([[float(label == name) for name in names] for label in config.labels])
    predicted = [m.intent.name if m.intent else NONE for m in threshold.classify_many(config.prompts)]
    baseline = float(np.mean([p == label for p, label in zip(predicted, config.labels, strict=True)]))
    return Compiled(config, learned.features(learned.embed(config.prompts)), truth, baseline)


def accuracy(probabilities: np.ndarray, compiled: Compiled, bar: float) -> float:
    """The share of prompts decided right at ``bar``, as the gateway decides them."""
    scores = compiled.features[:, :, FEATURES.index("score")]
    matches = [decide_learned(compiled.config.intents, row, chances, bar)
               for row, chances in zip(scores, probabilities, strict=True)]
    return float(np.mean([(m.intent.name if m.intent else NONE) == label
                          for m, label in zip(matches, compiled.config.labels, strict=True)]))


def fit(compiled: list[Compiled], rounds: int) -> tuple[tuple[tuple[int, float, float, float], ...], float]:
    x = np.concatenate([c.features.reshape(-1, c.features.shape[2]) for c in compiled])
    y = np.concatenate([c.truth.reshape(-1) for c in compiled])
    return fit_stumps(x, y, rounds=rounds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.train_routing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--embedder", default="multilingual")
    parser.add_argument("--no-center", dest="center", action="store_false",
                        help="train on the embedder's vectors as they are, not centred on general traffic's mean")
    parser.add_argument("--write", action="store_true", help=f"write {MODEL_PATH.name}")
    args = parser.parse_args(argv)
    embedder = build_embedder(args.embedder)
    data = configs()
    writers = sorted({c.writer for c in data})
    with Progress(transient=True) as progress:
        task = progress.add_task("embedding configs", total=len(data))
        compiled = []
        for config in data:
            compiled.append(compile_config(config, embedder, args.center))
            progress.advance(task)
        task = progress.add_task("cross-validating", total=len(ROUNDS) * len(writers))
        scores: dict[tuple[int, float], dict[str, float]] = {}  # (rounds, bar): config: held-out accuracy
        for rounds in ROUNDS:
            for writer in writers:
                stumps, bias = fit([c for c in compiled if c.config.writer != writer], rounds)
                model = IntentModel(stumps, bias, 0.5, args.embedder, args.center)
                for held in (c for c in compiled if c.config.writer == writer):
                    probabilities = model.probabilities(held.features)
                    for bar in BARS:
                        scores.setdefault((rounds, bar), {})[held.config.name] = accuracy(probabilities, held, bar)
                progress.advance(task)
    (rounds, bar), best = max(scores.items(), key=lambda item: (float(np.mean(list(item[1].values()))), -item[0][0]))
    stumps, bias = fit(compiled, rounds)
    model = IntentModel(stumps, bias, bar, args.embedder, args.center)
    writers_only = [c for c in compiled if c.config.writer != "own"]

    def mean(values: list[float]) -> float:
        return round(float(np.mean(values)), 4)

    about = {"trained_on": [c.config.name for c in compiled], "rounds": rounds,
             "cross_validated": {"by": "leave one writer out", "accuracy": mean(list(best.values())),
                                 "accuracy_writers": mean([best[c.config.name] for c in writers_only]),
                                 "threshold_decision": mean([c.baseline for c in compiled]),
                                 "threshold_decision_writers": mean([c.baseline for c in writers_only])},
             "trained": datetime.date.today().isoformat()}
    if args.write:
        MODEL_PATH.write_text(model.to_json(**about))
    emit("train_routing", {"bench": "train_routing", "embedder": args.embedder, "center": args.center,
                           "stumps": len(stumps),
                           "threshold": bar, **about})


if __name__ == "__main__":
    main()
