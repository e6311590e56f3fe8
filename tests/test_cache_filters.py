"""The cache's penetration-guard filters: no false negatives, false-positive rates that match their formulas.

Keys are seeded random 32-byte strings, standing in for SHA-256 digests, so every count below is
the same on every run; the tolerances are still set wide enough (several Poisson standard
deviations) that a change of seed would not fail them.
"""

from __future__ import annotations

import math
import random

import pytest

from extproc.cache.filters import BloomFilter, CuckooFilter


def digests(n: int, seed: int) -> list[bytes]:
    """``n`` distinct uniform 32-byte keys (collisions among 2^256 values do not happen)."""
    blob = random.Random(seed).randbytes(32 * n)
    return [blob[i:i + 32] for i in range(0, len(blob), 32)]


def false_positives(present: BloomFilter | CuckooFilter, absent: list[bytes]) -> int:
    """How many keys that were never added the filter reports present."""
    return sum(key in present for key in absent)


def poisson_ceiling(expected: float) -> float:
    """A count above this is not bad luck: the mean plus six standard deviations, plus one."""
    return expected + 6 * math.sqrt(expected) + 1


ADDED = digests(100_000, seed=1)
NEVER_ADDED = digests(200_000, seed=2)


@pytest.fixture(scope="module")
def full_bloom() -> BloomFilter:
    """The reference design: m = 1 MiB of bits, k = 3, with 100k keys."""
    bloom = BloomFilter()
    for key in ADDED:
        bloom.add(key)
    return bloom


# --- Bloom filter ---------------------------------------------------------------------------------


def test_bloom_defaults_are_the_reference_design() -> None:
    bloom = BloomFilter()
    assert (bloom.m_bits, bloom.k, bloom.count) == (8 * 2**20, 3, 0)


def test_bloom_has_no_false_negatives(full_bloom: BloomFilter) -> None:
    assert full_bloom.count == len(ADDED)
    assert all(key in full_bloom for key in ADDED)


def test_bloom_fp_rate_at_the_default_size(full_bloom: BloomFilter) -> None:
    # (1 - e^(-3 * 100k / 2^23))^3 = 4.34e-5: about 8.7 false positives in 200k lookups.
    assert full_bloom.expected_fp_rate() == pytest.approx(4.34e-5, rel=0.01)
    expected = full_bloom.expected_fp_rate() * len(NEVER_ADDED)
    assert false_positives(full_bloom, NEVER_ADDED) <= poisson_ceiling(expected)


def test_bloom_fp_rate_matches_the_formula_when_measurable() -> None:
    # m = 2^16 bits, n = 5000: (1 - e^(-0.229))^3 = 0.86%, about 1700 false positives in 200k lookups.
    bloom = BloomFilter(m_bits=2**16, k=3)
    bloom.add_many(ADDED[:5000])
    measured = false_positives(bloom, NEVER_ADDED) / len(NEVER_ADDED)
    assert measured == pytest.approx(bloom.expected_fp_rate(), rel=0.30)


def test_bloom_add_many_equals_adding_one_by_one() -> None:
    one_by_one, at_once = BloomFilter(m_bits=2**16), BloomFilter(m_bits=2**16)
    for key in ADDED[:1000]:
        one_by_one.add(key)
    at_once.add_many(iter(ADDED[:1000]))  # any iterable, a generator included
    assert at_once.count == one_by_one.count == 1000
    assert all(key in at_once for key in ADDED[:1000])
    assert [key in at_once for key in NEVER_ADDED[:5000]] == [key in one_by_one for key in NEVER_ADDED[:5000]]


def test_bloom_clear_forgets_every_key() -> None:
    bloom = BloomFilter(m_bits=2**16)
    bloom.add_many(ADDED[:100])
    bloom.clear()
    assert bloom.count == 0
    assert bloom.expected_fp_rate() == 0.0
    assert not any(key in bloom for key in ADDED[:100])  # an empty filter has no bit set


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"m_bits": 0}, "m_bits"),
        ({"m_bits": -8}, "m_bits"),
        ({"m_bits": 12}, "m_bits"),  # not whole bytes
        ({"k": 0}, "k"),
    ],
    ids=["zero-bits", "negative-bits", "partial-byte", "no-positions"],
)
def test_bloom_rejects_bad_arguments(kwargs: dict[str, int], names: str) -> None:
    with pytest.raises(ValueError, match=rf"^{names}: "):
        BloomFilter(**kwargs)


@pytest.mark.parametrize("method", ["add", "__contains__"])
def test_bloom_rejects_a_digest_too_short_to_read(method: str) -> None:
    with pytest.raises(ValueError, match=r"^digest: need at least 16 bytes, got 8"):
        getattr(BloomFilter(m_bits=64), method)(b"\x01" * 8)


# --- Cuckoo filter --------------------------------------------------------------------------------


def fill(cuckoo: CuckooFilter, keys: list[bytes]) -> list[bytes]:
    """Add keys until the filter refuses one; the keys it took."""
    taken = []
    for key in keys:
        if not cuckoo.add(key):
            break
        taken.append(key)
    return taken


@pytest.mark.parametrize(
    ("capacity", "bucket_size", "slots"),
    [
        (65536, 4, 65536),  # the default: 16384 buckets of 4
        (1000, 4, 1024),  # 250 buckets round up to 256
        (1, 4, 4),  # one bucket
        (100, 1, 128),
    ],
    ids=["default", "rounded-up", "one-bucket", "bucket-of-one"],
)
def test_cuckoo_buckets_are_a_power_of_two(capacity: int, bucket_size: int, slots: int) -> None:
    assert CuckooFilter(capacity=capacity, bucket_size=bucket_size).slots == slots


def test_cuckoo_has_no_false_negatives() -> None:
    cuckoo = CuckooFilter()
    keys = ADDED[:50_000]
    assert all(cuckoo.add(key) for key in keys)
    assert len(cuckoo) == len(keys)
    assert all(key in cuckoo for key in keys)


def test_cuckoo_remove_takes_out_only_that_key() -> None:
    cuckoo = CuckooFilter(capacity=16384, seed=3)
    keys = ADDED[:10_000]
    for key in keys:
        cuckoo.add(key)
    removed, kept = keys[::2], keys[1::2]
    assert all(cuckoo.remove(key) for key in removed)
    assert len(cuckoo) == len(kept)
    # Removing added keys never loses another: a key sharing the fingerprint shares both buckets.
    assert all(key in cuckoo for key in kept)
    # A removed key still matches only through another key's equal fingerprint (~2e-5 each here).
    assert false_positives(cuckoo, removed) <= 1


def test_cuckoo_remove_of_an_absent_key_changes_nothing() -> None:
    cuckoo = CuckooFilter(capacity=4096)
    for key in ADDED[:1000]:
        cuckoo.add(key)
    assert not any(cuckoo.remove(key) for key in NEVER_ADDED[:1000])  # seeded: no fingerprint collides
    assert len(cuckoo) == 1000
    assert all(key in cuckoo for key in ADDED[:1000])


def test_cuckoo_add_is_a_multiset_insert() -> None:
    cuckoo = CuckooFilter(capacity=64)
    key = ADDED[0]
    assert cuckoo.add(key) and cuckoo.add(key)
    assert len(cuckoo) == 2
    assert cuckoo.remove(key) and key in cuckoo  # one copy left
    assert cuckoo.remove(key) and key not in cuckoo
    assert not cuckoo.remove(key)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cuckoo_fills_past_ninety_percent_and_keeps_every_key(seed: int) -> None:
    cuckoo = CuckooFilter(capacity=4096, bucket_size=4, seed=seed)
    taken = fill(cuckoo, ADDED)
    # Fan et al. report ~95% load for 4-slot buckets before an insert fails.
    assert len(taken) >= 0.90 * cuckoo.slots
    assert cuckoo.is_full
    assert len(cuckoo) == len(taken)
    # The fingerprint evicted by the last failed relocation waits in the stash: nothing was lost.
    assert all(key in cuckoo for key in taken)
    # While full, add refuses without changing anything.
    assert not cuckoo.add(NEVER_ADDED[0])
    assert len(cuckoo) == len(taken)


def test_cuckoo_remove_makes_room_again() -> None:
    cuckoo = CuckooFilter(capacity=1024, seed=5)
    taken = fill(cuckoo, ADDED)
    for key in taken[:10]:
        assert cuckoo.remove(key)
    assert not cuckoo.is_full  # the stashed fingerprint went back into the table
    assert len(cuckoo) == len(taken) - 10
    assert all(key in cuckoo for key in taken[10:])
    assert cuckoo.add(NEVER_ADDED[0])


def test_cuckoo_kicks_are_deterministic_for_a_seed() -> None:
    first, second = CuckooFilter(capacity=1024, seed=9), CuckooFilter(capacity=1024, seed=9)
    assert fill(first, ADDED) == fill(second, ADDED)
    assert [key in first for key in NEVER_ADDED[:20_000]] == [key in second for key in NEVER_ADDED[:20_000]]


def test_cuckoo_fp_rate_matches_the_formula_when_measurable() -> None:
    # 8-bit fingerprints at ~95% load: 1 - (1 - 1/255)^(8 * 0.95) = 2.9%, about 5900 in 200k lookups.
    cuckoo = CuckooFilter(capacity=4096, fingerprint_bits=8)
    fill(cuckoo, ADDED)
    assert cuckoo.load_factor() >= 0.9
    measured = false_positives(cuckoo, NEVER_ADDED) / len(NEVER_ADDED)
    assert measured == pytest.approx(cuckoo.expected_fp_rate(), rel=0.30)


def test_cuckoo_fp_rate_stays_under_two_b_over_two_to_the_f() -> None:
    # 16-bit fingerprints, full: at most 2 * 4 / 2^16 = 1.2e-4, about 24 in 200k lookups.
    cuckoo = CuckooFilter(capacity=4096)
    fill(cuckoo, ADDED)
    bound = 2 * 4 / 2**16
    assert cuckoo.expected_fp_rate() <= bound
    assert false_positives(cuckoo, NEVER_ADDED) <= poisson_ceiling(bound * len(NEVER_ADDED))


def test_cuckoo_wide_fingerprints_use_a_wider_table() -> None:
    cuckoo = CuckooFilter(capacity=1024, fingerprint_bits=32)
    keys = ADDED[:900]
    assert all(cuckoo.add(key) for key in keys)
    assert all(key in cuckoo for key in keys)
    assert false_positives(cuckoo, NEVER_ADDED[:20_000]) == 0  # 2 * 4 / 2^32 per lookup
    assert all(cuckoo.remove(key) for key in keys)
    assert len(cuckoo) == 0


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"capacity": 0}, "capacity"),
        ({"bucket_size": 0}, "bucket_size"),
        ({"fingerprint_bits": 1}, "fingerprint_bits"),  # 1 bit leaves a single non-zero fingerprint
        ({"fingerprint_bits": 33}, "fingerprint_bits"),
        ({"max_kicks": -1}, "max_kicks"),
    ],
    ids=["no-capacity", "empty-buckets", "one-bit", "too-wide", "negative-kicks"],
)
def test_cuckoo_rejects_bad_arguments(kwargs: dict[str, int], names: str) -> None:
    with pytest.raises(ValueError, match=rf"^{names}: "):
        CuckooFilter(**kwargs)


@pytest.mark.parametrize("method", ["add", "remove", "__contains__"])
def test_cuckoo_rejects_a_digest_too_short_to_read(method: str) -> None:
    with pytest.raises(ValueError, match=r"^digest: need at least 16 bytes, got 0"):
        getattr(CuckooFilter(capacity=8), method)(b"")
