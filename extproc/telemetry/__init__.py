"""Request identity, W3C trace context, spans and metrics."""
