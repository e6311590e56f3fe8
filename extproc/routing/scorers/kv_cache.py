"""``kv_cache``: most free KV cache (1 - the engine's KV-cache use); an engine that does not report it
(NaN) scores as unknown."""

from __future__ import annotations

import math

from extproc.routing.plugins import PickContext, scorer


@scorer("kv_cache")
def kv_cache(context: PickContext) -> list[float]:
    return [0.0 if s is None or math.isnan(s.kv_usage) else max(0.0, min(1.0, 1.0 - s.kv_usage))
            for s in context.states]
