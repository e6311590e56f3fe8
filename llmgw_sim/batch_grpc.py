"""The gRPC shell of the simulated pod: ``llmgw.v1.BatchGeneration`` (``protos/llmgw/v1/batch.proto``).

Every item of a call is checked and planned as the one-prompt ``/v1/completions`` request it
stands for, and becomes one sequence of the pod's own engine: items with different sampling
parameters share engine batches (with each other and with HTTP requests), and use the same KV
cache, prefix cache and metrics. A refused item gets its error and the others go on. Cancelling
the call aborts what has not finished. Injected faults apply once per call: an error is the whole
call's gRPC status (500 INTERNAL, 503 UNAVAILABLE), as a failed merged HTTP call would be.

The server runs on the pod's asyncio loop, next to aiohttp (``serve_batch_grpc``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf.json_format import MessageToDict

from extproc.protos.llmgw.v1 import batch_pb2, batch_pb2_grpc
from llmgw_sim.batch_protocol import (
    GENERATE_METHOD,
    DeltaCursor,
    batch_problem,
    error_delta,
    item_body,
)
from llmgw_sim.engine import RequestTracker
from llmgw_sim.generate import OutputPlan
from llmgw_sim.scheduler import SimSequence
from llmgw_sim.server import RequestError, SimPod

log = logging.getLogger("llmgw_sim.batch")
_FAULT_CODES = {500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE}
_STOP_GRACE_S = 1.0  # as the HTTP server's shutdown timeout
# A batch may carry as many prompts as one HTTP body (aiohttp client_max_size in server.build_app).
_MAX_MESSAGE_BYTES = 64 * 1024**2


class BatchGenerationService(batch_pb2_grpc.BatchGenerationServicer):
    """``Generate`` on one pod."""

    def __init__(self, pod: SimPod) -> None:
        self._pod = pod

    async def Generate(self, request: batch_pb2.GenerateRequest,  # noqa: N802 (the proto's name)
                       context: grpc.aio.ServicerContext) -> AsyncIterator[batch_pb2.GenerateResponse]:
        """Stream the deltas of every item of ``request`` as the engine produces them."""
        pod = self._pod
        arrived = time.monotonic()
        crash = pod.faults.count_request()
        try:
            if pod.recorded is not None:  # --record N
                pod.record("POST", GENERATE_METHOD, _metadata(context),
                           MessageToDict(request, preserving_proto_field_name=True))
            problem = batch_problem(request)
            if problem is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            decision = pod.faults.decide()
            if decision.error_status is not None:
                await context.abort(_FAULT_CODES[decision.error_status], "injected failure (simulated pod)")
            if decision.hang:
                await pod.closing.wait()  # or until the caller cancels
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the pod is shutting down")

            refused, tracker, cursor = self._admit(request, arrived)
            if refused:
                yield batch_pb2.GenerateResponse(deltas=refused)
            if tracker is None:
                return
            if decision.spike_s:
                await asyncio.sleep(decision.spike_s)
            pod.engine.submit(tracker)
            try:
                while True:
                    await tracker.wait()
                    done = tracker.done  # read first: the engine may finish while a response is sent
                    deltas = cursor.take(tracker.delivered)
                    if deltas:
                        yield batch_pb2.GenerateResponse(deltas=deltas)
                    if done:
                        break
            finally:
                if not tracker.done:  # cancelled by the caller, or the server stops
                    pod.abort(tracker)
        finally:
            if crash:
                pod.exit_soon()

    def _admit(self, request: batch_pb2.GenerateRequest,
               arrived: float) -> tuple[list[batch_pb2.Delta], RequestTracker | None, DeltaCursor]:
        """Check and plan every item: the error deltas of the refused ones, and one streaming
        tracker (None when every item was refused) with its cursor for the accepted ones."""
        pod = self._pod
        refused: list[batch_pb2.Delta] = []
        indices: list[int] = []
        seqs: list[SimSequence] = []
        plans: list[OutputPlan] = []
        prompt_tokens: list[int] = []
        for item in request.items:
            try:
                valid = pod.validate_generation("completion", item_body(item, request.model))
            except RequestError as err:
                refused.append(error_delta(item.index, err.status, err.err_type, str(err), err.param))
                log.info("batch %s item %d (request %s) refused: %s", request.batch_id, item.index,
                         item.request_id, err)
                continue
            item_seqs, item_plans = pod.plan_sequences(valid)  # one prompt, n = 1: one sequence
            indices.append(item.index)
            seqs.extend(item_seqs)
            plans.extend(item_plans)
            prompt_tokens.append(len(valid.prompt_ids[0]))
        tracker = RequestTracker(seqs, plans, True, arrived) if seqs else None
        return refused, tracker, DeltaCursor(indices, plans, seqs, prompt_tokens)


def _metadata(context: grpc.aio.ServicerContext) -> list[tuple[str, str]]:
    return [(key, value) for key, value in context.invocation_metadata() or ()
            if isinstance(value, str)]  # binary (-bin) values are not recorded


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve_batch_grpc(pod: SimPod) -> AsyncIterator[None]:
    """An aiohttp cleanup context: serve the batch protocol on ``pod.options.batch_grpc_port``
    (0 picks a free port, then ``pod.batch_grpc_port`` says which) while the app runs."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES)])
    batch_pb2_grpc.add_BatchGenerationServicer_to_server(BatchGenerationService(pod), server)
    options = pod.options
    port = server.add_insecure_port(_address(options.host, options.batch_grpc_port or 0))
    await server.start()
    pod.batch_grpc_port = port
    log.info("batch gRPC (llmgw.v1.BatchGeneration) on %s", _address(options.host, port))
    try:
        yield
    finally:
        pod.batch_grpc_port = None
        await server.stop(_STOP_GRACE_S)
