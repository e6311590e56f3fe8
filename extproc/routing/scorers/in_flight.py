"""``in_flight``: fewest requests this process has in flight to the pod, as a ratio to the fewest."""

from __future__ import annotations

from extproc.routing.plugins import PickContext, fewest, scorer


@scorer("in_flight")
def in_flight(context: PickContext) -> list[float]:
    return fewest([float(context.in_flight.get(e, 0)) for e in context.candidates])
