"""``lora``: 1 when the pod has the request's adapter loaded (running or waiting, per vLLM's
``vllm:lora_requests_info``), 0.5 when it has room for another, else 0."""

from __future__ import annotations

from extproc.routing.plugins import PickContext, scorer


@scorer("lora")
def lora(context: PickContext) -> list[float]:
    request = context.request
    if not request.adapter:
        return [0.0] * len(context.candidates)
    out = []
    for state in context.states:
        if state is None or state.max_lora <= 0:
            out.append(0.0)
        elif request.model in state.running_adapters or request.model in state.waiting_adapters:
            out.append(1.0)
        elif len(state.running_adapters) < state.max_lora:
            out.append(0.5)
        else:
            out.append(0.0)
    return out
