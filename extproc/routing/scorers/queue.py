"""``queue``: fewest requests waiting at the pod (its engine's waiting gauge), as a ratio to the fewest."""

from __future__ import annotations

from extproc.routing.plugins import PickContext, fewest, scorer


@scorer("queue")
def queue(context: PickContext) -> list[float]:
    return fewest([s.waiting if s is not None else None for s in context.states])
