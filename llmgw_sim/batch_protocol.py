"""The batch protocol's messages (``protos/llmgw/v1/batch.proto``) in terms of the pod's own types.

Pure: no grpc, no asyncio. A batch item is checked as the ``/v1/completions`` body with its one
prompt and its sampling parameters (``item_body``), so an item is refused exactly when that body
would be, with the same status and message. ``DeltaCursor`` turns the engine's progress on each
item into the ``Delta`` messages still to send.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.protos.llmgw.v1 import batch_pb2
from llmgw_sim.generate import OutputPlan
from llmgw_sim.scheduler import SimSequence

SERVICE_NAME = "llmgw.v1.BatchGeneration"
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"


def batch_problem(request: batch_pb2.GenerateRequest) -> str | None:
    """Why the whole call is malformed (gRPC INVALID_ARGUMENT), or None."""
    if not request.items:
        return "items: a batch needs at least one item"
    seen: set[int] = set()
    for position, item in enumerate(request.items):
        if item.index in seen:
            return f"items[{position}].index: {item.index} is used by an earlier item"
        seen.add(item.index)
    return None


def item_body(item: batch_pb2.BatchItem, batch_model: str) -> dict[str, object]:
    """The OpenAI ``/v1/completions`` body that asks for what ``item`` asks for (one prompt, one
    choice). Unset optional parameters are left out, so they take vLLM's defaults."""
    params = item.params
    body: dict[str, object] = {"stop": list(params.stop), "ignore_eos": params.ignore_eos,
                               "min_tokens": params.min_tokens}
    model = item.model or batch_model
    if model:
        body["model"] = model
    which = item.WhichOneof("prompt")
    if which == "text":
        body["prompt"] = item.text
    elif which == "token_ids":
        body["prompt"] = list(item.token_ids.ids)
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if params.HasField(name):
            body[name] = getattr(params, name)
    return body


def error_delta(index: int, status: int, err_type: str, message: str, param: str | None) -> batch_pb2.Delta:
    """The only delta of a refused item."""
    return batch_pb2.Delta(index=index, error=batch_pb2.Error(status=status, type=err_type, message=message,
                                                              param=param or ""))


class DeltaCursor:
    """How much of each accepted item has been sent.

    ``indices[i]``, ``plans[i]``, ``seqs[i]`` and ``prompt_tokens[i]`` describe the item at
    position ``i`` of the engine's tracker; ``take`` gets the tracker's per-position count of
    delivered tokens and returns the deltas not sent yet, one per item that advanced. Several
    engine steps behind a slow reader merge into one delta, as vLLM's streams merge them.
    """

    __slots__ = ("_indices", "_plans", "_prompt_tokens", "_sent", "_seqs")

    def __init__(self, indices: Sequence[int], plans: Sequence[OutputPlan], seqs: Sequence[SimSequence],
                 prompt_tokens: Sequence[int]) -> None:
        if not len(indices) == len(plans) == len(seqs) == len(prompt_tokens):
            raise ValueError("one index, plan, sequence and prompt length per item")
        self._indices = list(indices)
        self._plans = list(plans)
        self._seqs = list(seqs)
        self._prompt_tokens = list(prompt_tokens)
        self._sent = [0] * len(self._plans)

    def take(self, delivered: Sequence[int]) -> list[batch_pb2.Delta]:
        """The deltas of the tokens delivered since the previous call."""
        deltas: list[batch_pb2.Delta] = []
        for position, plan in enumerate(self._plans):
            now, before = delivered[position], self._sent[position]
            if now <= before:
                continue
            self._sent[position] = now
            text = "".join(plan.deltas[before:now])
            index = self._indices[position]
            if now == len(plan.token_ids):
                # Counted as the HTTP API counts one prompt with one choice (server.SimPod._usage).
                usage = batch_pb2.Usage(prompt_tokens=self._prompt_tokens[position], completion_tokens=now,
                                        cached_tokens=self._seqs[position].cached_tokens)
                deltas.append(batch_pb2.Delta(index=index, text=text, finish_reason=plan.finish_reason,
                                              stop_reason=plan.stop_reason or "", usage=usage))
            elif text:  # a token cut by a stop string adds no text
                deltas.append(batch_pb2.Delta(index=index, text=text))
        return deltas
