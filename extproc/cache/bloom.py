"""A Bloom filter over SHA-256 digests: "certainly absent" answered in memory, without a store trip.

The digests are already uniform, so the k bit positions are read straight out of the digest
(8 bytes each) instead of hashing again. With m bits and n members the false-positive rate is
about (1 - e^(-k n / m))^k: the whitepaper's m = 1 MiB (8 Mi bits), k = 3 gives ~1e-7 for
10,000 keys, so a flood of random keys almost never reaches the key store.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

DEFAULT_BITS = 8 * 1024 * 1024  # 1 MiB
DEFAULT_HASHES = 3


class BloomFilter:
    """A fixed-size Bloom filter of 32-byte digests; built once, then only read."""

    __slots__ = ("_bits", "_m", "_k", "count")

    def __init__(self, digests: Iterable[bytes] = (), bits: int = DEFAULT_BITS, hashes: int = DEFAULT_HASHES) -> None:
        if not 1 <= hashes <= 4:
            raise ValueError("hashes must be 1..4 (each takes 8 bytes of a 32-byte digest)")
        self._m = bits
        self._k = hashes
        self._bits = bytearray((bits + 7) // 8)
        self.count = 0
        for digest in digests:
            self.add(digest)

    def _positions(self, digest: bytes) -> list[int]:
        return [int.from_bytes(digest[8 * i: 8 * i + 8], "little") % self._m for i in range(self._k)]

    def add(self, digest: bytes) -> None:
        """Insert a 32-byte digest."""
        for position in self._positions(digest):
            self._bits[position >> 3] |= 1 << (position & 7)
        self.count += 1

    def __contains__(self, digest: bytes) -> bool:
        return all(self._bits[p >> 3] & (1 << (p & 7)) for p in self._positions(digest))

    def false_positive_rate(self) -> float:
        """The expected false-positive rate at the current number of members."""
        return (1 - math.exp(-self._k * self.count / self._m)) ** self._k
