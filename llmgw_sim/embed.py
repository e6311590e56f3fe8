"""Deterministic embeddings for ``/v1/embeddings``: similar token bags, similar vectors.

A feature-hashing bag of tokens (Weinberger et al., ICML'09): each token id adds +-1 to four
coordinates picked by a stable hash of the id, and the sum is L2-normalised. The same input always
gives the same vector, and inputs sharing tokens have a cosine similarity that grows with the
overlap, which is what a semantic cache or a retrieval test needs from a fake embedder.
``dimensions`` (OpenAI) truncates and re-normalises, as Matryoshka embeddings do. The default
width, 4096, is the hidden size of 7B-class embedding models (e5-mistral-7b-instruct).
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from collections.abc import Sequence

DEFAULT_EMBEDDING_DIM = 4096
_SLOTS_PER_TOKEN = 4
_MASK = (1 << 64) - 1


def embed(token_ids: Sequence[int], dim: int) -> list[float]:
    """The unit-length embedding of ``token_ids`` with ``dim`` coordinates."""
    if dim < 1:
        raise ValueError("dim must be >= 1")
    vec = [0.0] * dim
    for token in token_ids:
        # hash() of an int tuple is stable across processes (no PYTHONHASHSEED).
        h = hash((token, 0x5EED)) & _MASK
        for slot in range(_SLOTS_PER_TOKEN):
            bits = h >> (slot * 16)
            vec[(bits >> 1) % dim] += 1.0 if bits & 1 else -1.0
    norm = math.sqrt(sum(x * x for x in vec))
    if norm == 0.0:
        vec[0], norm = 1.0, 1.0  # every contribution cancelled: any fixed unit vector will do
    return [x / norm for x in vec]


def truncate(vec: list[float], dimensions: int) -> list[float]:
    """The first ``dimensions`` coordinates, re-normalised to unit length."""
    head = vec[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def to_base64(vec: list[float]) -> str:
    """``encoding_format: base64``: little-endian float32 bytes, base64 (OpenAI, vLLM)."""
    data = array("f", vec)
    if data.itemsize != 4:
        raise RuntimeError("platform float is not 32-bit")
    if sys.byteorder == "big":
        data.byteswap()
    return base64.b64encode(data.tobytes()).decode("ascii")
