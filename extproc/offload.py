"""Large request bodies are analyzed in a helper process, so one tenant's 5 MB body never stalls
the event loop that serves everyone else's requests.

Python threads would not help: ``orjson.loads`` and pydantic's validator hold the GIL. The helper
is one spawned process per extproc worker (spawned, not forked: gRPC's threads do not survive a
fork), so the helpers scale with the workers, one per core; each is started with the server and
warmed up so the first large body pays no import. Bodies queue behind each other there, and the
queue is bounded by time: the helper's cost per byte is learned (an EWMA of what each body took),
and a body whose expected wait would pass ``max_wait_s`` (1 s, half of Envoy's 2 s ext_proc message
timeout) is refused at once with a retryable 503 instead of ending in a 504. ``max_queued_bytes``
(64 MiB) bounds the memory the queue holds, whatever the helper's speed.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from extproc.api import ApiError, Operation
from extproc.body import Analysis, BodyLimits, Routing, analyze
from extproc.chat_template import load_chat_template
from extproc.memory import HeapTrim
from extproc.steps import Analyze, TokenizerSpec
from extproc.tokens import BpeEstimator, TokenEstimator

log = logging.getLogger("llmgw.offload")
MAX_QUEUED_BYTES = 64 << 20
MAX_WAIT_S = 1.0
# Before the first body is timed: ~5 ms per MB (orjson, validation, digests; a hostile 8 MB body
# of tiny values costs up to ~50 ms per MB, which the EWMA then learns).
INITIAL_SECONDS_PER_BYTE = 5e-9
HELPER_NICENESS = 10
_PR_SET_PDEATHSIG = 1

Analyzed = Analysis | ApiError
_ErrorFields = tuple[int, str, str, str | None, str | None]


@functools.lru_cache(maxsize=64)
def _estimator(path: str, template: str | None) -> TokenEstimator:
    """A tokenizer (and the model's chat template), loaded once per helper process."""
    return BpeEstimator.from_spec(path, chat_template=load_chat_template(template) if template else None)


def _analyze_in_helper(operation: Operation, body: bytes, served_names: dict[str, str], limits: BodyLimits,
                       tokenizers: dict[str, TokenizerSpec], routing: Routing
                       ) -> tuple[Analysis | _ErrorFields, float]:
    """The analysis, and the seconds it took (wall time: a helper short of CPU, niced as it is,
    takes longer, and its queue must be bounded by what it really takes)."""
    started = time.perf_counter()
    # An ApiError does not survive pickling (a dataclass exception has no args): send its fields.
    try:
        estimators = {name: _estimator(*spec) for name, spec in tokenizers.items()}
        result: Analysis | _ErrorFields = analyze(
            operation, body, served_names, limits, estimators, routing)
    except ApiError as error:
        result = (error.status, error.message, error.type, error.param, error.code)
    return result, time.perf_counter() - started


def _helper_init(parent: int) -> None:
    """In the helper: die with the worker (even a SIGKILLed one: no orphan keeps its memory), and
    yield the CPU to the event loops serving everyone else's requests when it is short."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:
        os._exit(1)
    os.nice(HELPER_NICENESS)
    threading.Thread(target=_trim_forever, name="heap-trim", daemon=True).start()


def _trim_forever() -> None:
    """In the helper: the large bodies' memory goes back to the system once they are gone."""
    trim = HeapTrim()
    while trim.available:
        time.sleep(1.0)
        trim()


def _warm() -> None:
    """Imports done at start: the first large body should not pay for pydantic's."""


class BodyAnalyzer:
    """The helper process that analyzes large bodies; ``analyze`` answers like ``extproc.body.analyze``."""

    def __init__(self, max_queued_bytes: int = MAX_QUEUED_BYTES, max_wait_s: float = MAX_WAIT_S) -> None:
        self._max_queued = max_queued_bytes
        self._max_wait_s = max_wait_s
        self._queued = 0
        self.seconds_per_byte = INITIAL_SECONDS_PER_BYTE  # the helper's learned cost (EWMA)
        self._pool: ProcessPoolExecutor | None = None

    def _ensure_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=_helper_init,
                                             initargs=(os.getpid(),))
        return self._pool

    async def start(self) -> None:
        """Start the helper process and wait until it has imported what it needs."""
        await asyncio.get_running_loop().run_in_executor(self._ensure_pool(), _warm)

    def expected_wait_s(self, size: int) -> float:
        """How long a body of ``size`` bytes would take from now: what waits, then itself."""
        return (self._queued + size) * self.seconds_per_byte

    async def analyze(self, job: Analyze) -> Analyzed:
        """The body's facts and new body, or the ApiError refusing it (a 503 when it would wait
        past ``max_wait_s``, or past ``max_queued_bytes``)."""
        size = len(job.body)
        if self._queued and (self._queued + size > self._max_queued or self.expected_wait_s(size) > self._max_wait_s):
            return ApiError(503, "The gateway is busy with large requests; retry shortly.",
                            type="server_error", code="service_unavailable")
        self._queued += size
        try:
            result, seconds = await asyncio.get_running_loop().run_in_executor(
                self._ensure_pool(), _analyze_in_helper, job.operation, job.body, dict(job.served_names), job.limits,
                dict(job.tokenizers), job.routing)
        except BrokenProcessPool:
            log.error("the body-analysis helper process died; starting a new one")
            self._pool = None
            return ApiError(503, "The gateway could not analyze this request; retry shortly.",
                            type="server_error", code="service_unavailable")
        finally:
            self._queued -= size
        if size:
            self.seconds_per_byte += 0.2 * (seconds / size - self.seconds_per_byte)
        if isinstance(result, Analysis):
            return result
        status, message, kind, param, code = result
        return ApiError(status, message, type=kind, param=param, code=code)

    def close(self) -> None:
        """Stop the helper process."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
