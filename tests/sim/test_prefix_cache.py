"""Chained block hashing and the LRU KV block pool."""

from __future__ import annotations

import pytest

from llmgw_sim.prefix_cache import KVBlockPool, block_hashes

BS = 4


@pytest.mark.parametrize(
    ("num_tokens", "num_hashes"),
    [
        pytest.param(3, 0, id="shorter than a block: nothing to hash"),
        pytest.param(4, 1, id="one full block"),
        pytest.param(11, 2, id="partial tail is not hashed"),
        pytest.param(12, 3, id="three full blocks"),
    ],
)
def test_only_full_blocks_are_hashed(num_tokens: int, num_hashes: int) -> None:
    assert len(block_hashes(list(range(num_tokens)), BS)) == num_hashes


def test_hashes_are_chained() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], BS)
    c = block_hashes([1, 2, 3, 4, 0, 0, 0, 0], BS)
    assert a[1] != b[1]  # same second block, different first: the chain differs
    assert a[0] == c[0] and a[1] != c[1]  # a shared prefix shares exactly its blocks


def test_hashes_are_stable() -> None:
    # int-tuple hashes ignore PYTHONHASHSEED, so blocks hash the same in every process
    assert block_hashes([1, 2, 3, 4], BS) == [hash((0, (1, 2, 3, 4)))]


@pytest.mark.parametrize(
    ("steps", "active", "cached", "usage"),
    [
        pytest.param([("alloc", "ab", 3)], 3, 0, 0.3, id="2 hashed + 1 private block"),
        pytest.param([("alloc", "ab", 3), ("alloc", "ab", 3)], 4, 0,
                     0.4, id="second sequence shares the two hashed blocks"),
        pytest.param([("alloc", "ab", 3), ("free", 0)], 0, 2, 0.0,
                     id="freed hashed blocks stay cached but count as free"),
        pytest.param([("alloc", "ab", 3), ("free", 0), ("alloc", "ab", 2)], 2, 0, 0.2,
                     id="re-used cached blocks become active again"),
    ],
)
def test_pool_accounting(steps: list[tuple], active: int, cached: int, usage: float) -> None:
    pool = KVBlockPool(num_blocks=10, block_size=BS)
    allocations = []
    for step in steps:
        if step[0] == "alloc":
            hashes = [ord(c) for c in step[1]]
            allocation = pool.try_allocate(hashes, step[2])
            assert allocation is not None
            allocations.append(allocation)
        else:
            pool.free(allocations[step[1]])
    assert pool.active_blocks == active
    assert pool.cached_blocks == cached
    assert pool.usage == pytest.approx(usage)


def test_allocation_fails_when_full_and_nothing_evictable() -> None:
    pool = KVBlockPool(num_blocks=4, block_size=BS)
    assert pool.try_allocate([1, 2], 3) is not None
    assert pool.try_allocate([7], 2) is None  # needs 2 fresh blocks, 1 left
    assert pool.active_blocks == 3  # a failed attempt changes nothing


def test_lru_eviction_evicts_tails_first() -> None:
    pool = KVBlockPool(num_blocks=4, block_size=BS)
    first = pool.try_allocate([1, 2, 3], 3)
    assert first is not None
    pool.free(first)  # 1, 2, 3 cached; freed tail first, so 3 is the oldest
    assert pool.try_allocate([], 2) is not None  # 2 fresh: 1 free + evict one
    assert pool.cached_prefix_blocks([1, 2, 3]) == 2  # head of the prefix survived
    assert pool.cached_blocks == 2


def test_cached_prefix_stops_at_first_miss() -> None:
    pool = KVBlockPool(num_blocks=8, block_size=BS)
    assert pool.try_allocate([1, 2, 3], 3) is not None
    assert pool.cached_prefix_blocks([1, 2, 9, 3]) == 2  # 3 is cached but after a miss
