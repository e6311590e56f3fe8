"""Batch formation of the simulated pod: continuous (iteration-level), dynamic and static batching.

Both schedulers are pure: ``step()`` decides one engine iteration, advances every sequence in
the batch by one token and says how long the iteration took on the simulated GPU
(``CostParams.step_time``). The asyncio engine (``engine.py``) sleeps that long and hands the
tokens out; ``simulate()`` runs the same schedulers on a virtual clock for tests and planning.

* ``continuous``: iteration-level scheduling (Orca, OSDI'22; vLLM). Each step first admits
  waiting sequences, in arrival order, while the running set is below ``max_num_seqs``, the KV
  pool has room and the step's prefill budget (``max_num_batched_tokens``) lasts; a sequence
  leaves the batch on the step it finishes.
* ``dynamic``: one batch at a time, formed by the server from whatever waits (Triton's dynamic
  batcher). A batch of up to ``max_num_seqs`` waiting sequences is decoded until its longest
  member finishes; finished members keep their (padded) slot, and arrivals wait for the next batch.
* ``static``: one batch at a time, and a batch is one call: the prompts (and choices) a single
  HTTP or batch-protocol call carries, as a server without a batcher runs them (Triton's default
  scheduler "simply distributes inference requests to all model instances": a request's batch is
  the one it brings; a Hugging Face ``generate()`` behind a web handler). Calls wait in arrival
  order. This is the server the reference papers' gateway-side batching pays off against: sent
  one request per call it runs batches of one; merged calls are batches.

Prefix-cache accounting follows vLLM: queries count a prompt's tokens, hits count the tokens
served from cache, and at least the last prompt token is always recomputed.

LoRA follows vLLM's scheduler: a waiting sequence whose adapter is not in the batch is skipped
(it keeps its place in the queue, later ones may pass) while the batch already holds
``max_loras`` distinct adapters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from llmgw_sim.costmodel import CostParams
from llmgw_sim.prefix_cache import KVAllocation, KVBlockPool

EngineKind = Literal["continuous", "dynamic", "static"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("continuous", "dynamic", "static")


@dataclass(slots=True, eq=False)
class SimSequence:
    """One generated sequence (one choice of one prompt) as the scheduler sees it.

    ``index`` is the choice index within its request; the scheduler does not use it. ``call``
    numbers the call (HTTP request or batch-protocol call) it came with; the static scheduler
    batches one call at a time.
    """

    prompt_len: int
    block_hashes: list[int]
    output_len: int
    index: int = 0
    lora: str | None = None
    call: int = 0
    generated: int = 0
    cached_tokens: int = 0
    finished: bool = False
    aborted: bool = False
    allocation: KVAllocation | None = None


@dataclass(slots=True)
class StepResult:
    """What one engine iteration did."""

    duration_s: float
    batch_size: int
    admitted: list[SimSequence] = field(default_factory=list)
    emitted: list[SimSequence] = field(default_factory=list)
    finished: list[SimSequence] = field(default_factory=list)
    prefill_tokens: int = 0
    prompt_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


class Scheduler(Protocol):
    """A batch-formation policy over a KV block pool."""

    params: CostParams
    pool: KVBlockPool

    @property
    def num_running(self) -> int:
        """Sequences in the current batch that still generate."""
        ...

    @property
    def num_waiting(self) -> int:
        """Sequences not yet admitted."""
        ...

    @property
    def running_loras(self) -> frozenset[str]:
        """LoRA adapters of the sequences in the batch."""
        ...

    @property
    def waiting_loras(self) -> frozenset[str]:
        """LoRA adapters of the sequences not yet admitted."""
        ...

    def add(self, seq: SimSequence) -> None:
        """Queue a sequence (FCFS)."""
        ...

    def abort(self, seq: SimSequence) -> None:
        """Drop a sequence wherever it is and release its KV blocks."""
        ...

    def step(self) -> StepResult:
        """Run one iteration; a result with ``batch_size == 0`` means the scheduler is idle."""
        ...


class _SchedulerBase:
    """What both policies share: the waiting queue, the KV pool and admission of one sequence."""

    def __init__(self, params: CostParams, max_loras: int = 1) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.params = params
        self.max_loras = max_loras
        self.pool = KVBlockPool(params.num_blocks, params.block_size)
        self._waiting: deque[SimSequence] = deque()

    @property
    def num_waiting(self) -> int:
        """Sequences not yet admitted."""
        return len(self._waiting)

    @property
    def waiting_loras(self) -> frozenset[str]:
        """LoRA adapters of the sequences not yet admitted."""
        return frozenset(seq.lora for seq in self._waiting if seq.lora is not None)

    def _lora_blocked(self, seq: SimSequence, loras: set[str]) -> bool:
        """vLLM: a new adapter may not join a batch that already holds ``max_loras`` of them."""
        return seq.lora is not None and seq.lora not in loras and len(loras) >= self.max_loras

    def add(self, seq: SimSequence) -> None:
        """Queue a sequence (FCFS); it must fit in an empty KV pool."""
        if seq.output_len < 1:
            raise ValueError("output_len must be >= 1")
        if self._blocks_needed(seq) > self.pool.num_blocks:
            raise ValueError("sequence is larger than the whole KV cache")
        self._waiting.append(seq)

    def _blocks_needed(self, seq: SimSequence) -> int:
        return self.params.blocks_for(seq.prompt_len + seq.output_len)

    def _hit_blocks(self, seq: SimSequence) -> int:
        # vLLM recomputes at least the last prompt token (max cache hit = num_tokens - 1).
        limit = (seq.prompt_len - 1) // self.params.block_size
        return self.pool.cached_prefix_blocks(seq.block_hashes[:limit])

    def _try_admit(self, seq: SimSequence, result: StepResult) -> bool:
        hits = self._hit_blocks(seq) * self.params.block_size
        allocation = self.pool.try_allocate(seq.block_hashes, self._blocks_needed(seq))
        if allocation is None:
            return False
        seq.allocation = allocation
        seq.cached_tokens = hits
        result.admitted.append(seq)
        result.prefill_tokens += seq.prompt_len - hits
        result.prompt_tokens += seq.prompt_len
        result.prefix_queries += seq.prompt_len
        result.prefix_hits += hits
        return True

    def _release(self, seq: SimSequence) -> None:
        if seq.allocation is not None:
            self.pool.free(seq.allocation)
            seq.allocation = None

    def _remove_waiting(self, seq: SimSequence) -> bool:
        try:
            self._waiting.remove(seq)
        except ValueError:
            return False
        return True


class ContinuousScheduler(_SchedulerBase):
    """Iteration-level batching (Orca / vLLM): admit and retire sequences every step."""

    def __init__(self, params: CostParams, max_loras: int = 1) -> None:
        super().__init__(params, max_loras)
        self._running: list[SimSequence] = []

    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self._running)

    @property
    def running_loras(self) -> frozenset[str]:
        """LoRA adapters of the sequences in the batch."""
        return frozenset(seq.lora for seq in self._running if seq.lora is not None)

    def abort(self, seq: SimSequence) -> None:
        """Drop a sequence wherever it is and release its KV blocks."""
        seq.aborted = True
        if not self._remove_waiting(seq) and seq in self._running:
            self._running.remove(seq)
        self._release(seq)

    def step(self) -> StepResult:
        """Admit what fits, then advance every running sequence by one token."""
        result = StepResult(duration_s=0.0, batch_size=0)
        params = self.params
        loras = set(self.running_loras)
        skipped: list[SimSequence] = []
        while self._waiting and len(self._running) < params.max_num_seqs:
            seq = self._waiting[0]
            if self._lora_blocked(seq, loras):
                skipped.append(self._waiting.popleft())  # vLLM skips it; it keeps its place in the queue
                continue
            new_tokens = seq.prompt_len - self._hit_blocks(seq) * params.block_size
            # A prompt larger than the budget is still admitted when it would be first.
            if result.admitted and result.prefill_tokens + new_tokens > params.max_num_batched_tokens:
                break
            if not self._try_admit(seq, result):
                break
            self._waiting.popleft()
            self._running.append(seq)
            if seq.lora is not None:
                loras.add(seq.lora)
        self._waiting.extendleft(reversed(skipped))
        batch = self._running
        result.batch_size = len(batch)
        result.duration_s = params.step_time(len(batch), result.prefill_tokens)
        result.emitted = list(batch)
        still_running: list[SimSequence] = []
        for seq in batch:
            seq.generated += 1
            if seq.generated >= seq.output_len:
                seq.finished = True
                result.finished.append(seq)
                self._release(seq)
            else:
                still_running.append(seq)
        self._running = still_running
        return result


class DynamicScheduler(_SchedulerBase):
    """Dynamic batching: a batch of whatever waits runs until its longest member is done."""

    def __init__(self, params: CostParams, max_loras: int = 1) -> None:
        super().__init__(params, max_loras)
        self._batch: list[SimSequence] = []

    @property
    def num_running(self) -> int:
        """Unfinished sequences of the current batch."""
        return sum(1 for seq in self._batch if not seq.finished)

    @property
    def running_loras(self) -> frozenset[str]:
        """LoRA adapters of the unfinished sequences of the batch."""
        return frozenset(seq.lora for seq in self._batch if seq.lora is not None and not seq.finished)

    def abort(self, seq: SimSequence) -> None:
        """Drop a sequence; inside a batch it stops generating but keeps its padded slot."""
        seq.aborted = True
        if self._remove_waiting(seq):
            return
        if seq in self._batch:
            seq.finished = True
            self._end_batch_if_done()

    def step(self) -> StepResult:
        """Form a batch when none runs, then advance its unfinished members by one token."""
        result = StepResult(duration_s=0.0, batch_size=0)
        if not self._batch:
            loras: set[str] = set()
            skipped: list[SimSequence] = []
            while self._waiting and len(self._batch) < self.params.max_num_seqs:
                seq = self._waiting[0]
                if self._batch and not self._joins(seq, self._batch[0]):
                    break
                if self._lora_blocked(seq, loras):
                    skipped.append(self._waiting.popleft())
                    continue
                if not self._try_admit(seq, result):
                    break
                self._batch.append(self._waiting.popleft())
                if seq.lora is not None:
                    loras.add(seq.lora)
            self._waiting.extendleft(reversed(skipped))
        if not self._batch:
            return result
        # Finished members are padding: they still cost a slot in every step of the batch.
        result.batch_size = len(self._batch)
        result.duration_s = self.params.step_time(len(self._batch), result.prefill_tokens)
        for seq in self._batch:
            if seq.finished:
                continue
            seq.generated += 1
            result.emitted.append(seq)
            if seq.generated >= seq.output_len:
                seq.finished = True
                result.finished.append(seq)
        self._end_batch_if_done()
        return result

    def _joins(self, seq: SimSequence, first: SimSequence) -> bool:
        """Whether ``seq`` may join the batch ``first`` opened: any waiting sequence may."""
        return True

    def _end_batch_if_done(self) -> None:
        if all(seq.finished for seq in self._batch):
            for seq in self._batch:
                self._release(seq)
            self._batch = []


class StaticScheduler(DynamicScheduler):
    """Static batching: the batch is one call's sequences, run until its longest one is done."""

    def _joins(self, seq: SimSequence, first: SimSequence) -> bool:
        """Only the sequences of the call that opened the batch (they wait side by side)."""
        return seq.call == first.call


def make_scheduler(kind: EngineKind, params: CostParams, max_loras: int = 1) -> Scheduler:
    """The scheduler named ``kind`` (one of ``ENGINE_KINDS``)."""
    if kind == "continuous":
        return ContinuousScheduler(params, max_loras)
    if kind == "dynamic":
        return DynamicScheduler(params, max_loras)
    if kind == "static":
        return StaticScheduler(params, max_loras)
    raise ValueError(f"engine: unknown kind {kind!r} (expected one of {ENGINE_KINDS})")


@dataclass(frozen=True, slots=True)
class Arrival:
    """A sequence that reaches the scheduler at ``time_s`` on the virtual clock."""

    time_s: float
    seq: SimSequence


@dataclass(slots=True)
class SimulationResult:
    """Virtual-clock times of a ``simulate()`` run, keyed by sequence identity."""

    first_token_s: dict[SimSequence, float]
    finish_s: dict[SimSequence, float]
    makespan_s: float
    steps: int


def simulate(scheduler: Scheduler, arrivals: Iterable[Arrival]) -> SimulationResult:
    """Run ``scheduler`` over ``arrivals`` on a virtual clock until every sequence finishes."""
    pending = deque(sorted(arrivals, key=lambda a: a.time_s))
    first: dict[SimSequence, float] = {}
    done: dict[SimSequence, float] = {}
    now = 0.0
    steps = 0
    while pending or scheduler.num_running or scheduler.num_waiting:
        while pending and pending[0].time_s <= now:
            scheduler.add(pending.popleft().seq)
        result = scheduler.step()
        if result.batch_size == 0:
            if not pending:
                raise RuntimeError("scheduler stalled with waiting sequences")
            now = pending[0].time_s
            continue
        steps += 1
        now += result.duration_s
        for seq in result.emitted:
            first.setdefault(seq, now)
        for seq in result.finished:
            done[seq] = now
    return SimulationResult(first_token_s=first, finish_s=done, makespan_s=now, steps=steps)
