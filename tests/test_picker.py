"""The endpoint picker's plugins (filters, scorers) and the prefix index, with no network (QoS shedding:
tests/stages/test_resolution.py)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from extproc.config import PickerSpec
from extproc.config.schema import DEFAULT_WEIGHTS
from extproc.routing.picker import Picker, PickRequest
from extproc.routing.prefix import PrefixIndex, block_hashes, prefix_hashes

PODS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
A, B, C = PODS
SCORED = PickerSpec()


@dataclass(frozen=True)
class Pod:
    waiting: float = 0.0
    kv_usage: float = 0.0
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_lora: int = 0
    models: frozenset[str] = frozenset()


class States:
    def __init__(self, pods: dict[str, Pod]) -> None:
        self.pods = pods

    def get(self, endpoint: str) -> Pod | None:
        return self.pods.get(endpoint)


def only(**weights: float) -> PickerSpec:
    zero = dict.fromkeys(DEFAULT_WEIGHTS, 0.0)
    return PickerSpec(kind="scored", weights={**zero, **weights})


def picker(pods: dict[str, Pod] | None = None, seed: int = 0) -> Picker:
    return Picker(random.Random(seed), States(pods or {}))


# -- prefix hashes and index ---------------------------------------------------------------------

def chat(system: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"model": "m", "messages": messages}


def test_equal_prefixes_hash_equal_and_a_different_start_changes_every_block() -> None:
    system = "You are a careful assistant. " * 40
    one = prefix_hashes(chat(system, "What is the capital of France? " * 8), 64, 256)
    two = prefix_hashes(chat(system, "Write a haiku about rain, please. " * 8), 64, 256)
    other = prefix_hashes(chat("Be terse. " + system, "What is the capital of France? " * 8), 64, 256)
    shared = len(system) // 64
    assert one[:shared] == two[:shared] and one[shared + 1:] and one[shared + 1:] != two[shared + 1:]
    assert not set(one) & set(other)  # each hash covers the whole prefix before it


def test_only_whole_blocks_are_hashed_and_at_most_max_blocks() -> None:
    assert block_hashes("x" * 63, 64) == ()
    assert len(block_hashes("x" * 200, 64)) == 3
    assert len(prefix_hashes({"prompt": "y" * 10_000}, 64, 8)) == 8
    assert prefix_hashes({"input": "embeddings have no prompt prefix"}, 16, 8) == ()


def test_index_finds_the_longest_match_per_pod() -> None:
    index = PrefixIndex()
    long, short = (1, 2, 3, 4), (1, 2)
    index.record(long, A)
    index.record(short, B)
    assert index.matches((1, 2, 3, 9), PODS) == {A: 3, B: 2, C: 0}
    assert index.matches((7, 2, 3), PODS) == {A: 0, B: 0, C: 0}


def test_index_is_bounded_and_drops_a_prefix_tail_first() -> None:
    index = PrefixIndex(capacity=4)
    index.record((1, 2, 3), A)
    index.record((10, 11, 12), B)  # 6 hashes for 4 places: A's tail and more go
    assert len(index) == 4
    assert index.matches((10, 11, 12), PODS)[B] == 3
    assert index.matches((1, 2, 3), PODS)[A] == 1  # the head outlived the tail
    index.forget(B)
    assert index.matches((10, 11, 12), PODS)[B] == 0


# -- scorers ---------------------------------------------------------------------------------------

def test_queue_scorer_prefers_the_shortest_queue() -> None:
    p = picker({A: Pod(waiting=9), B: Pod(waiting=1), C: Pod(waiting=5)})
    assert p.pick(PODS, PickRequest(picker=only(queue=1))) == B


def test_kv_cache_scorer_prefers_the_most_free_cache() -> None:
    p = picker({A: Pod(kv_usage=0.9), B: Pod(kv_usage=0.5), C: Pod(kv_usage=0.2)})
    assert p.pick(PODS, PickRequest(picker=only(kv_cache=1))) == C


def test_an_unknown_pod_is_not_taken_for_an_idle_one() -> None:
    p = picker({A: Pod(waiting=3, kv_usage=0.6), B: Pod(waiting=3, kv_usage=0.6)})  # C: never scraped / stale
    picks = Counter(p.pick(PODS, PickRequest(picker=only(queue=1, kv_cache=1))) for _ in range(30))
    assert picks[C] == 0 and picks[A] and picks[B]


def test_in_flight_scorer_spreads_requests() -> None:
    p = picker()
    picks = Counter(p.pick(PODS, PickRequest(picker=only(in_flight=1))) for _ in range(30))
    assert picks == {A: 10, B: 10, C: 10}


def test_prefix_affinity_sends_a_session_back_to_its_pod() -> None:
    p = picker({pod: Pod() for pod in PODS}, seed=3)
    system = "You are the support bot of ACME. Answer kindly. " * 30
    first = PickRequest(prefix=prefix_hashes(chat(system, "My order is late."), 64, 256), picker=SCORED)
    chosen = p.pick(PODS, first)
    p.release(chosen)
    follow_up = prefix_hashes(chat(system, "My order is late.", "Sorry! Which order?", "Number 42."), 64, 256)
    for _ in range(5):
        assert p.pick(PODS, PickRequest(prefix=follow_up, picker=SCORED)) == chosen
        p.release(chosen)


def test_workers_without_a_shared_index_place_a_new_prefix_on_the_same_home_pod() -> None:
    pods = {pod: Pod() for pod in PODS}
    for prefix in [(7, 8, 9), (123456789, 1), (2**63 + 5, 2)]:
        homes = {picker(pods, seed=seed).pick(PODS, PickRequest(prefix=prefix, picker=SCORED)) for seed in range(6)}
        assert len(homes) == 1  # six workers, each with its own index and tie-break, agree
    spread = {picker(pods).pick(PODS, PickRequest(prefix=(p,), picker=SCORED)) for p in range(40)}
    assert spread == set(PODS)  # different prefixes have different homes


def test_load_outweighs_a_shared_prefix_when_its_pod_is_swamped() -> None:
    prefix = tuple(range(10))
    p = picker({A: Pod(waiting=40, kv_usage=0.95), B: Pod(), C: Pod()})
    p.prefixes.record(prefix, A)
    assert p.pick(PODS, PickRequest(prefix=prefix, picker=SCORED)) in (B, C)
    scores = {row.endpoint: dict(row.scores) for row in p.score(PODS, PickRequest(prefix=prefix, picker=SCORED))}
    assert scores[A]["prefix"] == 1.0 and scores[B]["prefix"] == 0.0


def test_lora_affinity_prefers_a_pod_with_the_adapter_then_one_with_room() -> None:
    pods = {A: Pod(running_adapters=frozenset({"other"}), max_lora=1),
            B: Pod(running_adapters=frozenset({"sql"}), max_lora=2),
            C: Pod(max_lora=2)}
    lora = only(lora=1)
    assert picker(pods).pick(PODS, PickRequest("sql", picker=lora, adapter=True)) == B
    pods[B] = Pod(running_adapters=frozenset({"x", "y"}), max_lora=2)
    assert picker(pods).pick(PODS, PickRequest("sql", picker=lora, adapter=True)) == C
    scores = picker(pods).score(PODS, PickRequest("base", picker=lora))  # not an adapter: no effect
    assert {dict(row.scores)["lora"] for row in scores} == {0.0}


# -- filters and baselines -------------------------------------------------------------------------

def test_draining_pods_get_no_new_requests_unless_all_drain() -> None:
    p = picker()
    request = PickRequest(picker=SCORED, draining=frozenset({A, B}))
    assert {p.pick(PODS, request) for _ in range(10)} == {C}
    assert p.pick((A, B), request) in (A, B)


def test_pods_not_serving_the_model_are_filtered() -> None:
    pods = {A: Pod(models=frozenset({"llama"})), B: Pod(models=frozenset({"llama", "sql-lora"})), C: None}
    p = picker({k: v for k, v in pods.items() if v is not None})
    assert {p.pick(PODS, PickRequest("sql-lora", picker=SCORED)) for _ in range(20)} <= {B, C}
    assert p.pick((A,), PickRequest("sql-lora", picker=SCORED)) == A  # never filtered to nothing


def test_round_robin_and_least_in_flight_baselines() -> None:
    p = picker()
    rr = PickRequest(picker=PickerSpec(kind="round_robin"))
    assert [p.pick(PODS, rr) for _ in range(6)] == [A, B, C, A, B, C]
    q = picker()
    least = PickRequest(picker=PickerSpec(kind="least_in_flight"))
    assert Counter(q.pick(PODS, least) for _ in range(9)) == {A: 3, B: 3, C: 3}


def test_fallback_is_the_best_other_pod() -> None:
    p = picker({A: Pod(waiting=1), B: Pod(waiting=5), C: Pod(waiting=9)})
    request = PickRequest(picker=only(queue=1))
    assert p.fallback(PODS, A, request) == B
    assert p.fallback((A,), A, request) is None
