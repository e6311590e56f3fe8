"""KV-cache block pool with automatic prefix caching, after vLLM's design (v1 ``KVCacheManager``).

A prompt's token ids are cut into blocks of ``block_size`` tokens; only full blocks are hashed,
each hash chained on the previous block's (``hash(parent_hash, block_tokens)``), so one hash
names a whole prefix. Blocks referenced by a running sequence are *active*; when the last
reference goes, a hashed block stays cached but *evictable*, in LRU order, until new
allocations need its room. KV usage counts active blocks only, like ``vllm:kv_cache_usage_perc``.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# vLLM seeds the chain with a fixed "none" hash for the first block; any constant will do.
_ROOT_HASH = 0


def block_hashes(token_ids: Sequence[int], block_size: int, lora: str | None = None) -> list[int]:
    """Chained hashes of the full ``block_size`` blocks of ``token_ids`` (a partial tail is
    not hashed). Python's hash of a tuple of ints is stable across runs (no PYTHONHASHSEED).
    vLLM puts a LoRA adapter's name in every block's hash (extra keys), so an adapter never
    shares cached blocks with the base model or another adapter: here it seeds the chain."""
    hashes: list[int] = []
    parent = _ROOT_HASH if lora is None else zlib.crc32(lora.encode()) + 1
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class KVAllocation:
    """The blocks one sequence holds: references on hashed prompt blocks, plus private blocks
    (the partial prompt tail and the output tokens)."""

    hashed: list[int]
    private_blocks: int


class KVBlockPool:
    """A fixed number of KV blocks shared by all sequences, with an LRU prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._private = 0

    @property
    def active_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return len(self._refs) + self._private

    @property
    def cached_blocks(self) -> int:
        """Unreferenced hashed blocks kept for reuse (evictable)."""
        return len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.active_blocks / self.num_blocks

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are already in the pool (active or evictable)."""
        count = 0
        for h in hashes:
            if h not in self._refs and h not in self._evictable:
                break
            count += 1
        return count

    def try_allocate(self, hashes: Sequence[int], total_blocks: int) -> KVAllocation | None:
        """Reference ``hashes`` (sharing any already present) plus private blocks up to
        ``total_blocks``; evict LRU cached blocks as needed. None when it does not fit."""
        private = total_blocks - len(hashes)
        if private < 0:
            raise ValueError("total_blocks must cover the hashed blocks")
        reactivate = 0
        fresh = private
        for h in hashes:
            if h in self._refs:
                continue
            if h in self._evictable:
                reactivate += 1
            else:
                fresh += 1
        if self.active_blocks + reactivate + fresh > self.num_blocks:
            return None
        for h in hashes:
            refs = self._refs.get(h)
            if refs is not None:
                self._refs[h] = refs + 1
            else:
                self._evictable.pop(h, None)
                self._refs[h] = 1
        self._private += private
        overflow = self.active_blocks + len(self._evictable) - self.num_blocks
        for _ in range(max(0, overflow)):
            self._evictable.popitem(last=False)
        return KVAllocation(hashed=list(hashes), private_blocks=private)

    def free(self, allocation: KVAllocation) -> None:
        """Drop one sequence's references. Hashed blocks are released tail first, so the
        tail of a prefix is evicted before its head (as vLLM frees in reverse order)."""
        for h in reversed(allocation.hashed):
            refs = self._refs[h] - 1
            if refs:
                self._refs[h] = refs
            else:
                del self._refs[h]
                self._evictable[h] = None
        self._private -= allocation.private_blocks
        allocation.hashed = []
        allocation.private_blocks = 0
