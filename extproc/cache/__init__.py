"""Guards and caches: Bloom filter against penetration, response cache (later)."""
