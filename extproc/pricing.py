"""Token prices per model, for the cost of each usage record."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prices:
    """US dollars per million tokens."""

    input: float = 0.0
    output: float = 0.0
    cached: float = 0.0

    def cost(self, input_tokens: int, output_tokens: int, cached_tokens: int) -> float:
        """The cost of one request; cached input tokens are billed at the cached price."""
        fresh = max(0, input_tokens - cached_tokens)
        return (fresh * self.input + cached_tokens * self.cached + output_tokens * self.output) / 1e6
