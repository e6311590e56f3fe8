"""Semantic routing and the semantic cache on the frozen blind sets (``bench/data/blind/``, read its
README): data written apart from the mechanism, by writers who saw none of it, and never tuned on.

Routing: each of the three configs (``routing_*.yaml``: a user's own small ``intents:``, 6-8
examples per intent, and 80 new prompts, 12 of them out of every intent's domain) is compiled as
the gateway compiles it, with the defaults, and every prompt classified through the same index
the gateway builds (``extproc.routing.classifier.build_index``). A prompt is right when the chosen
intent is its label; ``none`` is right when no intent is chosen (the default route). Each lane is an
embedder with its default decision, or ``embedder:decision`` (``multilingual:threshold``: the
threshold decision the learned one replaced, in the same run).

Cache: every pair of the four writers' files (``cache_pairs_*.yaml``) is evaluated as the cache
meets it (``bench.cache_semantic.evaluate``: ``a`` alone in a fresh partition, then ``b`` looked
up) with the defaults (``cache: {semantic: {}}``) and, with ``--cache-precisions``, at the learned
check's other operating points; and crowded (``bench.cache_semantic.crowded``): each writer's ``a``
prompts in one partition, every ``b`` looked up, a hit on another pair's ``a`` counted false, as
a cache holding many prompts meets a new one. precision = right hits / hits; recall = right
hits / paraphrase pairs.

With ``--stack``, each config also runs through the real stack (Envoy, one extproc worker, a
simulated pod answering at once), as a user's client would: every prompt is sent at c=1 with
``model: auto`` and, alternately, to the default model by name; the intent is read back from the
served model, and ``auto``'s added latency is the difference of the two p50s.

Only aggregates are printed (per config, writer, language and kind): the items themselves are not,
so that nothing is tuned on them by reading the failures.

    python -m bench.blind [--routing-embedders multilingual,hybrid,minilm,hashing] [--no-cache] [--stack]
                          [--cache-precisions 0.98,0.995]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import yaml
from rich.progress import Progress

from bench.cache_semantic import Pair, crowded, evaluate, load_pairs
from bench.common import emit
from extproc.cache.semantic import SemanticIndex
from extproc.config import SemanticCacheSpec, parse_config
from extproc.launcher import LocalStack, StackOptions
from extproc.routing.classifier import build_index
from extproc.routing.embedders import build_embedder

BLIND = Path(__file__).parent / "data" / "blind"
NONE = "none"
ROUTING_TARGET = 0.90


def routing_configs() -> dict[str, dict[str, Any]]:
    """Each blind routing file by its short name (``assistant``, ``support``, ``platform``)."""
    return {path.stem.removeprefix("routing_"): yaml.safe_load(path.read_text())
            for path in sorted(BLIND.glob("routing_*.yaml"))}


def gateway_document(blind: dict[str, Any], embedder: str, decision: str | None = None) -> dict[str, Any]:
    """The blind config as a user's llmgw.yaml: one model per intent, a default route, defaults
    everywhere else."""
    routes = []
    for intent in blind["intents"]:
        routes.append({"name": intent["name"], "model": f"model-{intent['name']}", "examples": intent["examples"],
                       "description": intent.get("description", "")})
    models = [{"name": r["model"], "pool": "pool"} for r in routes] + [{"name": "default-model", "pool": "pool"}]
    return {"pools": [{"name": "pool", "endpoints": ["127.0.0.1:1"]}], "models": models,
            "intents": {"embedder": {"kind": embedder}, "default": {"model": "default-model"}, "routes": routes,
                        "cache_size": 0, **({"decision": decision} if decision else {})}}


def route_blind(name: str, blind: dict[str, Any], lane: str) -> dict[str, Any]:
    """Accuracy of one config's prompts in ``lane`` (an embedder, or ``embedder:decision``), and the
    time one prompt takes."""
    embedder, _, decision = lane.partition(":")
    config = parse_config(gateway_document(blind, embedder, decision or None))
    assert config.intents is not None
    built = time.perf_counter()
    index = build_index(config.intents)
    build_s = time.perf_counter() - built
    items = blind["eval"]
    predicted, times = [], []
    for item in items:
        started = time.perf_counter()
        match = index.classify(item["prompt"])
        times.append((time.perf_counter() - started) * 1000)
        predicted.append(match.intent.name if match.intent is not None else NONE)
    labels = [item["intent"] for item in items]
    right = [p == label for p, label in zip(predicted, labels, strict=True)]
    in_domain = [r for r, label in zip(right, labels, strict=True) if label != NONE]
    outside = [r for r, label in zip(right, labels, strict=True) if label == NONE]
    langs = Counter(item.get("lang", "en") for item in items)
    return {
        "config": name, "embedder": embedder, "lane": lane, "decision": index.decision, "prompts": len(items),
        "accuracy": round(sum(right) / len(right), 4),
        "in_domain_accuracy": round(sum(in_domain) / len(in_domain), 4),
        "none_accuracy": round(sum(outside) / len(outside), 4) if outside else None,
        "sent_to_default_wrongly": sum(1 for p, label in zip(predicted, labels, strict=True)
                                       if p == NONE and label != NONE),
        "wrong_intent": sum(1 for p, label in zip(predicted, labels, strict=True)
                            if p != NONE and p != label),
        "by_lang": {lang: round(sum(r for r, item in zip(right, items, strict=True)
                                    if item.get("lang", "en") == lang) / count, 4)
                    for lang, count in sorted(langs.items())},
        "p50_ms": round(statistics.median(times), 3), "build_s": round(build_s, 2),
    }


def route_through_stack(name: str, blind: dict[str, Any], lane: str, progress: Progress) -> dict[str, Any]:
    """The config through Envoy and extproc: accuracy read from the served model, and the p50 of
    ``auto`` against the default model named directly (alternating, one request at a time)."""
    embedder, _, decision = lane.partition(":")
    document = gateway_document(blind, embedder, decision or None)
    document["pools"] = [{"name": "pool", "simulate": 1}]
    items = blind["eval"]
    with TemporaryDirectory(prefix="llmgw-blind-") as tmp:
        path = Path(tmp) / "llmgw.yaml"
        path.write_text(yaml.safe_dump(document))
        options = StackOptions(config_path=path, run_dir=Path(tmp), port=0, workers=1, envoy_concurrency=1,
                               log_level="WARNING", sim_args=("--time-scale", "0", "--log-level", "ERROR"))
        with LocalStack(options) as info, httpx.Client(base_url=info.base_url, timeout=30) as client:
            auto_ms, direct_ms, predicted = [], [], []
            task = progress.add_task(f"{name} through the stack", total=len(items))
            for item in items:
                for model in ("auto", "default-model"):
                    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": item["prompt"]}]}
                    started = time.perf_counter()
                    response = client.post("/v1/chat/completions", json=body)
                    elapsed = (time.perf_counter() - started) * 1000
                    response.raise_for_status()
                    if model == "auto":
                        auto_ms.append(elapsed)
                        served = response.json()["model"]
                        predicted.append(served.removeprefix("model-") if served != "default-model" else NONE)
                    else:
                        direct_ms.append(elapsed)
                progress.advance(task)
    right = [p == item["intent"] for p, item in zip(predicted, items, strict=True)]
    return {"config": name, "embedder": embedder, "accuracy": round(sum(right) / len(right), 4),
            "auto_p50_ms": round(statistics.median(auto_ms), 3),
            "direct_p50_ms": round(statistics.median(direct_ms), 3),
            "auto_added_p50_ms": round(statistics.median(auto_ms) - statistics.median(direct_ms), 3)}


def cache_pairs() -> list[Pair]:
    """Every writer's pairs (``split`` is the writer)."""
    return [pair for path in sorted(BLIND.glob("cache_pairs_*.yaml"))
            for pair in load_pairs(path, path.stem.removeprefix("cache_pairs_"))]


def cache_blind(progress: Progress, precision: float | None = None) -> dict[str, Any]:
    """The semantic cache with its defaults (``precision``: the learned check's operating point)
    over every blind pair: overall, per writer, per kind."""
    spec = SemanticCacheSpec(precision=precision)
    pairs = cache_pairs()
    result = evaluate(pairs, progress=progress, precision=spec.precision)
    by_writer = {writer: result[writer] for writer in dict.fromkeys(p.split for p in pairs)}
    return {"embedder": spec.embedder, "check": result["check"], "threshold": result["threshold"],
            "pairs": len(pairs), "paraphrases": sum(p.same for p in pairs), **result["all"], "by_writer": by_writer,
            "false_hits_by_kind": result["false_hits_by_kind"], "missed_by_lang": result["missed_by_lang"],
            **check_costs(pairs, spec.embedder, spec.threshold)}


def check_costs(pairs: list[Pair], embedder: str, threshold: float | None, sample: int = 200) -> dict[str, Any]:
    """What the check costs on the hot path, over the first ``sample`` pairs (one thread): preparing
    one prompt (embedding it, the second encoder's vector, its features: once a request) and a
    lookup of a partition holding one stored prompt (the cosine and the check of that candidate),
    in medians and p99s."""
    index = SemanticIndex(build_embedder(embedder), threshold)
    index.prepare("warm-up")
    prepare_ms, lookup_us = [], []
    for i, pair in enumerate(pairs[:sample]):
        started = time.perf_counter()
        query = index.prepare(pair.b)
        prepare_ms.append((time.perf_counter() - started) * 1000)
        index.add(str(i), pair.a, b"k")
        tries = []
        for _ in range(3):
            started = time.perf_counter()
            index.match(str(i), query)
            tries.append((time.perf_counter() - started) * 1e6)
        lookup_us.append(min(tries))
    prepare_ms.sort()
    lookup_us.sort()
    return {"prepare_ms": {"median": round(statistics.median(prepare_ms), 3),
                           "p99": round(prepare_ms[int(0.99 * len(prepare_ms))], 3)},
            "lookup_one_candidate_us": {"median": round(statistics.median(lookup_us), 1),
                                        "p99": round(lookup_us[int(0.99 * len(lookup_us))], 1)}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.blind", description=__doc__.split("\n\n")[0])
    parser.add_argument("--routing-embedders", type=lambda v: v.split(","),
                        default=["multilingual", "multilingual:threshold", "hybrid", "minilm", "hashing"],
                        help="lanes: an embedder with its default decision, or embedder:decision")
    parser.add_argument("--stack", action="store_true",
                        help="also each config through the real stack (the first embedder)")
    parser.add_argument("--no-cache", action="store_true", help="routing only")
    parser.add_argument("--no-routing", action="store_true", help="the cache only")
    parser.add_argument("--cache-precisions", type=lambda v: [float(p) for p in v.split(",")], default=[],
                        help="the cache also at these operating points of the learned check (0.98,0.995)")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"bench": "blind"}
    with Progress(transient=True) as progress:
        if not args.no_routing:
            configs = routing_configs()
            task = progress.add_task("routing", total=len(configs) * len(args.routing_embedders))
            rows = []
            for embedder in args.routing_embedders:
                for name, blind in configs.items():
                    rows.append(route_blind(name, blind, embedder))
                    progress.advance(task)
            out["routing"] = rows
            out["routing_mean_accuracy"] = {
                lane: round(statistics.mean(r["accuracy"] for r in rows if r["lane"] == lane), 4)
                for lane in args.routing_embedders}
            out["routing_target"] = ROUTING_TARGET
            if args.stack:
                stack = [route_through_stack(name, blind, args.routing_embedders[0], progress)
                         for name, blind in configs.items()]
                out["routing_stack"] = stack
                out["routing_stack_auto_added_p50_ms"] = round(statistics.median(
                    r["auto_added_p50_ms"] for r in stack), 3)
        if not args.no_cache:
            out["cache"] = cache_blind(progress)
            # as a busy cache meets them: each writer's a prompts in one partition, every b looked up
            out["cache_crowded"] = crowded(cache_pairs(), 1, progress)
            for precision in args.cache_precisions:
                at = cache_blind(progress, precision=precision)
                out.setdefault("cache_at_precision", {})[str(precision)] = {
                    key: at[key] for key in ("precision", "precision_low95", "recall", "hits", "false_hits")}
    emit("blind", out)


if __name__ == "__main__":
    main()
