"""``prefix``: the share of the prompt's leading blocks last sent to the pod, from this process's
prefix index, which the ``PrefixAffinity`` producer reads before the scorers and updates with each
pick. A prefix sent nowhere yet scores ``HOME_SCORE`` on its home pod (rendezvous hashing of its
first block), so workers that do not share an index still place it alike."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from extproc.routing.plugins import PickContext, PickRequest, scorer
from extproc.routing.prefix import PrefixIndex

HOME_SCORE = 0.25
PRODUCED = "prefix"  # the producer's key in ``PickContext.produced``


class PrefixAffinity:
    """The prefix index as a producer: the blocks each candidate was sent, before the pick; the
    picked pod's blocks recorded after it."""

    name = PRODUCED

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def produce(self, context: PickContext) -> Mapping[str, int] | None:
        request = context.request
        if not request.prefix or request.picker.weights.get(PRODUCED, 0.0) <= 0:
            return None
        return self.index.matches(request.prefix, context.candidates)

    def picked(self, request: PickRequest, endpoint: str) -> None:
        if request.prefix and request.picker.kind == "scored" and request.picker.weights.get(PRODUCED, 0.0) > 0:
            self.index.record(request.prefix, endpoint)


@scorer("prefix")
def prefix(context: PickContext) -> list[float]:
    request, candidates = context.request, context.candidates
    matched = context.produced.get(PRODUCED)
    if not request.prefix or not isinstance(matched, Mapping):
        return [0.0] * len(candidates)
    if any(matched.values()):
        return [matched[e] / len(request.prefix) for e in candidates]
    # A prefix no pod was sent yet: its home pod (rendezvous hashing on the first block) gets a
    # quarter of a match, so every worker and every gateway replica places a new system prompt on
    # the same pod (when loads are close) instead of each on its own, and caches it once. Only a
    # quarter: at half, a burst of new prompts queued their prefills on their homes (bench.prefix
    # TTFT p99 ~490 ms against ~400 for least-in-flight; at a quarter ~230-320).
    first = request.prefix[0] & 0xFFFFFFFF
    ranks = [zlib.crc32(e.encode(), first) for e in candidates]
    home = max(ranks)
    return [HOME_SCORE if rank == home else 0.0 for rank in ranks]
