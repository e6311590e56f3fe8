"""Which queued requests share the next call when more wait than one call holds. Pure: no I/O.

The oldest request (by rank: class, then arrival with aging) always goes. The others join it in
rank order, except that those close to it go first: a prompt that begins with the same block of
text (a shared system prompt or few-shot preamble, the picker's 256-character prefix block) or
whose embedding's cosine with the oldest reaches the threshold (the reference papers' 0.72).
Together in one call on one pod, they share its prefix cache as they are prefilled. A request
passed over is older at the next batch, so grouping delays it by batches, never forever.

Embeddings come from the lexical hashing embedder (``extproc.routing.embedders``): about 0.1 ms
a prompt on this project's CPUs, where MiniLM takes ~7 ms (235 ms for 32 prompts), which the
coordinator would pay for every request at saturation, the only time grouping matters. At 0.72
a lexical cosine picks out near-duplicates and templated prompts (the same text with a few
words changed), which are what share cache blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

PREFIX_CHARS = 256  # the picker's default prefix block (endpoint_picker prefix.block_chars)
PREFIX = "prefix"
SEMANTIC = "semantic"


def choose(prompts: Sequence[str], tokens: Sequence[int], size: int, budget: int, threshold: float | None,
           vectors: Callable[[], np.ndarray]) -> tuple[list[int], dict[str, int]]:
    """The indices (into ``prompts``, given in rank order) of the next batch: at most ``size``
    requests and ``budget`` prompt tokens, the first always. ``vectors()`` embeds the prompts
    (unit rows), asked only when more wait than fit. Also how many joined for each affinity."""
    count = len(prompts)
    if count == 0:
        return [], {}
    if count <= size and sum(tokens) <= budget:
        return list(range(count)), {}
    close: dict[int, str] = {}
    seed = prompts[0]
    block = seed[:PREFIX_CHARS]
    for i in range(1, count):
        if len(block) == PREFIX_CHARS and prompts[i].startswith(block):
            close[i] = PREFIX
    if threshold is not None:
        matrix = vectors()
        similarity = matrix[1:] @ matrix[0]
        for near in np.flatnonzero(similarity >= threshold) + 1:
            close.setdefault(int(near), SEMANTIC)
    order = [0, *sorted(close), *(i for i in range(1, count) if i not in close)]
    chosen: list[int] = []
    left = budget
    for i in order:
        if len(chosen) == size:
            break
        if chosen and tokens[i] > left:
            continue
        chosen.append(i)
        left -= tokens[i]
    joined: dict[str, int] = {}
    for i in chosen:
        if i in close:
            joined[close[i]] = joined.get(close[i], 0) + 1
    return sorted(chosen), joined
