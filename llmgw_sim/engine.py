"""The asyncio shell around a scheduler: runs engine steps in (scaled) real time.

Each iteration asks the scheduler for a step, sleeps ``duration * time_scale`` (keeping a
deadline so the loop's own overhead does not stretch simulated time), then hands the step's
tokens to each request's ``RequestTracker``. With ``time_scale == 0`` a step still yields to
the event loop once, so HTTP handlers run between steps, but no time passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from llmgw_sim.generate import OutputPlan
from llmgw_sim.scheduler import Scheduler, SimSequence, StepResult

StepHook = Callable[[StepResult, Scheduler], None]
FinishHook = Callable[["RequestTracker", SimSequence], None]


class RequestTracker:
    """Delivery state of one HTTP request's sequences (``seq.index`` is its position here).

    A streaming consumer waits on ``wait()`` and reads ``delivered``; a non-streaming one only
    wakes when every sequence is done.
    """

    __slots__ = ("seqs", "plans", "streaming", "arrived_at", "delivered", "first_token_at", "finished_at",
                 "_remaining", "_event")

    def __init__(self, seqs: Sequence[SimSequence], plans: Sequence[OutputPlan], streaming: bool,
                 arrived_at: float) -> None:
        if len(seqs) != len(plans):
            raise ValueError("one output plan per sequence")
        self.seqs = list(seqs)
        self.plans = list(plans)
        self.streaming = streaming
        self.arrived_at = arrived_at
        self.delivered = [0] * len(self.seqs)
        self.first_token_at: list[float | None] = [None] * len(self.seqs)
        self.finished_at: float | None = None
        self._remaining = len(self.seqs)
        self._event = asyncio.Event()
        for index, seq in enumerate(self.seqs):
            seq.index = index

    @property
    def done(self) -> bool:
        """Every sequence has delivered its last token."""
        return self._remaining == 0

    def on_tokens(self, seq: SimSequence, now: float) -> None:
        """Called by the engine after a step in which ``seq`` produced a token."""
        index = seq.index
        if self.first_token_at[index] is None:
            self.first_token_at[index] = now
        self.delivered[index] = seq.generated
        if seq.finished:
            self._remaining -= 1
            if self._remaining == 0:
                self.finished_at = now
                self._event.set()
        if self.streaming:
            self._event.set()

    async def wait(self) -> None:
        """Until new tokens (streaming) or completion; then re-arm."""
        await self._event.wait()
        self._event.clear()


class SimEngine:
    """Runs ``scheduler`` steps forever (start with ``run()`` as a task)."""

    def __init__(self, scheduler: Scheduler, time_scale: float, on_step: StepHook,
                 on_finished: FinishHook, clock: Callable[[], float] = time.monotonic) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.scheduler = scheduler
        self.time_scale = time_scale
        self._on_step = on_step
        self._on_finished = on_finished
        self._clock = clock
        self._wake = asyncio.Event()
        self._trackers: dict[SimSequence, RequestTracker] = {}
        self._calls = 0
        self._halted = False

    def halt(self) -> None:
        """Stop stepping for good, from the step hook: that step's tokens are not handed out."""
        self._halted = True

    def submit(self, tracker: RequestTracker) -> None:
        """Queue every sequence of ``tracker``, as one call."""
        self._calls += 1
        for seq in tracker.seqs:
            seq.call = self._calls
            self.scheduler.add(seq)
            self._trackers[seq] = tracker
        self._wake.set()

    def abort(self, tracker: RequestTracker) -> None:
        """Drop whatever of ``tracker`` is still queued or running (the client went away)."""
        for seq in tracker.seqs:
            if self._trackers.pop(seq, None) is not None:
                self.scheduler.abort(seq)

    async def run(self) -> None:
        """The step loop."""
        scheduler = self.scheduler
        deadline = self._clock()
        while True:
            if not (scheduler.num_running or scheduler.num_waiting):
                self._wake.clear()
                await self._wake.wait()
                deadline = self._clock()
                continue
            result = scheduler.step()
            if self.time_scale:
                deadline += result.duration_s * self.time_scale
                await asyncio.sleep(max(0.0, deadline - self._clock()))
                if deadline < self._clock() - 1.0:
                    deadline = self._clock()  # far behind (a stalled loop): do not burst to catch up
            else:
                await asyncio.sleep(0)
            now = self._clock()
            self._on_step(result, scheduler)
            if self._halted:
                return
            trackers = self._trackers
            for seq in result.emitted:
                tracker = trackers.get(seq)
                if tracker is None:
                    continue  # aborted while the step ran
                if seq.finished:
                    del trackers[seq]
                tracker.on_tokens(seq, now)
                if seq.finished:
                    self._on_finished(tracker, seq)
