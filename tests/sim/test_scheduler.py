"""Continuous, dynamic and static batch formation, KV admission and prefix-cache accounting."""

from __future__ import annotations

import itertools

import pytest

from llmgw_sim.costmodel import CostParams
from llmgw_sim.prefix_cache import block_hashes
from llmgw_sim.scheduler import (
    Arrival,
    ContinuousScheduler,
    DynamicScheduler,
    Scheduler,
    SimSequence,
    StaticScheduler,
    make_scheduler,
    simulate,
)

BS = 16
# 10 ms per step, no per-sequence or prefill cost, unless a test says otherwise.
FLAT = CostParams(decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.0,
                  max_num_seqs=4, kv_cache_tokens=16 * 100, block_size=BS)


_fresh = itertools.count(10_000, 1000)
_calls = itertools.count(1)


def seq(prompt: list[int] | int, output_len: int, call: int | None = None) -> SimSequence:
    """A sequence, its own call unless ``call`` is given; an int prompt is that many tokens shared
    with no other prompt."""
    if isinstance(prompt, int):
        start = next(_fresh)
        ids = list(range(start, start + prompt))
    else:
        ids = prompt
    return SimSequence(prompt_len=len(ids), block_hashes=block_hashes(ids, BS), output_len=output_len,
                       call=next(_calls) if call is None else call)


def test_continuous_emits_one_token_per_step_and_retires() -> None:
    sched = ContinuousScheduler(FLAT)
    a, b = seq(10, 1), seq(10, 3)
    sched.add(a)
    sched.add(b)
    first = sched.step()
    assert first.admitted == [a, b] and first.finished == [a]  # a needs one token only
    assert sched.num_running == 1
    sched.step()
    last = sched.step()
    assert last.finished == [b] and b.generated == 3
    assert sched.num_running == 0 and sched.pool.active_blocks == 0  # KV freed on finish


@pytest.mark.parametrize(
    ("params", "prompts", "admitted"),
    [
        pytest.param(FLAT, [10] * 6, 4, id="max_num_seqs=4 caps the batch"),
        pytest.param(CostParams(max_num_seqs=8, kv_cache_tokens=64, block_size=BS), [20, 20, 20], 2,
                     id="KV pool of 4 blocks holds two 2-block sequences"),
        pytest.param(CostParams(max_num_seqs=8, max_num_batched_tokens=100, block_size=BS),
                     [60, 60, 60], 1, id="prefill budget 100 admits one 60-token prompt"),
        pytest.param(CostParams(max_num_seqs=8, max_num_batched_tokens=100, block_size=BS),
                     [500, 10], 1, id="an over-budget prompt is still admitted alone"),
    ],
)
def test_continuous_admission_limits(params: CostParams, prompts: list[int], admitted: int) -> None:
    sched = ContinuousScheduler(params)
    for p in prompts:
        sched.add(seq(p, 5))
    assert len(sched.step().admitted) == admitted


def test_prefix_hits_skip_prefill() -> None:
    params = CostParams(decode_base_s=0.0, decode_per_seq_s=0.0, prefill_per_token_s=0.001,
                        block_size=BS)
    sched = ContinuousScheduler(params)
    shared = list(range(40))  # 2 full blocks + 8 tokens
    sched.add(seq(shared, 1))
    cold = sched.step()
    assert (cold.prefix_queries, cold.prefix_hits, cold.prefill_tokens) == (40, 0, 40)
    sched.add(seq(shared + [99] * 8, 1))
    warm = sched.step()
    assert warm.prefix_queries == 48  # queries count every prompt token
    assert warm.prefix_hits == 32  # the two cached full blocks
    assert warm.prefill_tokens == 16  # only the uncached tail is computed
    assert warm.duration_s == pytest.approx(0.016)


def test_a_fully_cached_prompt_still_recomputes_its_last_block() -> None:
    sched = ContinuousScheduler(FLAT)
    prompt = list(range(32))  # exactly two blocks
    sched.add(seq(prompt, 1))
    sched.step()
    sched.add(seq(prompt, 1))
    again = sched.step()
    assert again.prefix_hits == 16  # vLLM caps hits at num_tokens - 1: the last block is recomputed


def test_dynamic_batch_blocks_newcomers_until_longest_finishes() -> None:
    sched = DynamicScheduler(FLAT)
    long, short = seq(10, 5), seq(10, 1)
    sched.add(long)
    sched.add(short)
    sched.step()
    late = seq(10, 1)
    sched.add(late)
    for _ in range(3):
        result = sched.step()
        assert late not in result.admitted  # waits although the batch has a free slot
        assert result.batch_size == 2  # the finished short member is still padding
    final = sched.step()
    assert final.finished == [long]
    assert sched.step().admitted == [late]  # the next batch


def test_static_batch_is_one_call() -> None:
    sched = StaticScheduler(FLAT)
    first = [seq(10, 2, call=1), seq(10, 3, call=1)]
    second = [seq(10, 1, call=2), seq(10, 1, call=2)]
    for s in first + second:
        sched.add(s)
    result = sched.step()
    assert result.admitted == first  # the second call waits although the batch has free slots
    assert sched.step().batch_size == 2 and sched.step().finished == [first[1]]
    assert sched.step().admitted == second


def make(kind: str, params: CostParams) -> Scheduler:
    return make_scheduler(kind, params)  # type: ignore[arg-type]


def mixed_workload() -> list[Arrival]:
    # One long generation, then short requests trickling in while it runs.
    arrivals = [Arrival(0.0, seq(10, 100))]
    arrivals += [Arrival(0.05 * i, seq(10, 5)) for i in range(1, 8)]
    return arrivals


@pytest.mark.parametrize(
    ("kind", "makespan_s", "mean_short_latency_s"),
    [
        # 100 steps of 10 ms for the long one; each short joins at the next step, 5 steps later done.
        pytest.param("continuous", 1.0, 0.055, id="continuous: shorts join the running batch"),
        # Shorts wait for the 1.0 s batch, then run as 4 + 3 (max_num_seqs=4): done at 1.05 and
        # 1.10, i.e. latencies (1.0 + .95 + .9 + .85 + .85 + .8 + .75) / 7 = 0.87.
        pytest.param("dynamic", 1.10, 0.87, id="dynamic: shorts wait for the 100-token batch"),
        # Each short is a call of its own: they run one after another, 5 steps each, after the
        # long one: done at 1.05, 1.10, ... 1.35, each 1.0 s after it arrived.
        pytest.param("static", 1.35, 1.0, id="static: shorts run one call at a time"),
    ],
)
def test_mixed_workload(kind: str, makespan_s: float, mean_short_latency_s: float) -> None:
    arrivals = mixed_workload()
    result = simulate(make(kind, FLAT), arrivals)
    assert result.makespan_s == pytest.approx(makespan_s, abs=0.011)
    shorts = [result.finish_s[a.seq] - a.time_s for a in arrivals[1:]]
    assert sum(shorts) / len(shorts) == pytest.approx(mean_short_latency_s, abs=0.02)


def test_continuous_beats_dynamic_on_mixed_lengths() -> None:
    params = CostParams(max_num_seqs=8, block_size=BS)  # the default A100 figures
    mean_latency = {}
    for kind in ("continuous", "dynamic"):
        arrivals = [Arrival(0.02 * i, seq(200, 20 + (i * 37) % 200)) for i in range(40)]
        result = simulate(make(kind, params), arrivals)
        mean_latency[kind] = sum(result.finish_s[a.seq] - a.time_s for a in arrivals) / len(arrivals)
    assert mean_latency["continuous"] < 0.7 * mean_latency["dynamic"]


def test_abort_frees_kv() -> None:
    sched = ContinuousScheduler(FLAT)
    a = seq(40, 10)
    sched.add(a)
    sched.step()
    assert sched.pool.active_blocks > 0
    sched.abort(a)
    assert sched.num_running == 0 and sched.pool.active_blocks == 0


def test_sequence_larger_than_cache_is_refused() -> None:
    sched = ContinuousScheduler(CostParams(kv_cache_tokens=64, block_size=BS))
    with pytest.raises(ValueError):
        sched.add(seq(60, 10))  # 70 tokens never fit in 64
