"""A continuous stage: one engine that admits items whenever it has room, for the whole step.

A micro-batched stage calls its method once per micro-batch, so a generation engine with
continuous batching pays its long tail once per micro-batch: the call ends only when its
longest response is done, while its slots empty one by one (the seed's long tail, paid
``N / k`` times instead of once). A continuous stage (``Pipeline.stage(..., continuous=True)``)
calls ``method(feed)`` once per step instead; the method is a generator that admits new items
from the `Feed` as its slots free (``feed.take(n)``), yields the outputs that are done (each list
goes downstream at once) and returns when ``feed.ended`` and nothing is left in work — what an
inference engine's own scheduler does (vLLM adds requests to a running batch between steps).

The stage's busy time is the step's time minus the time the engine waited with nothing in work;
it reports one "micro-batch" of everything it took (its sizes are the engine's business) and the
time from its first item to its first output (the cost model's latency of the stage).

An engine that also reports its steps (``feed.progress(decode_steps, active, finished)`` after
each of its iterations, ``feed.slots``, and ``feed.partial`` if it carries its tail over to its
next step) lets ``auto`` model it (`engine_model.EngineModel`):
an engine's time is not proportional to its share of the requests (its longest response bounds
it whatever the share), so one share's seconds per item mispredict another's.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlinf_hpc.channel import EndOfStream
from rlinf_hpc.runtime.cpu_time import CpuClock

if TYPE_CHECKING:
    from rlinf_hpc.channel import Channel
    from rlinf_hpc.scheduler.protocol import StageSpec
    from rlinf_hpc.workers.base import Worker


class Feed:
    """The input of a continuous stage. ``take(n)`` returns up to ``n`` items that have arrived
    (none is possible); ``take(n, wait=True)`` waits for at least one unless the stream ended.
    `ended` is True once every producer closed and everything was taken.

    A taken item counts as work from then on: the engine's time between takes is what the
    channel measures as its rate, so an engine should take only what it can admit now."""

    def __init__(self, source: Channel) -> None:
        self._source = source
        self.ended = False
        self.taken = 0
        #: When the first item was taken (monotonic), for the time to the first output.
        self.first_taken_at: float | None = None
        #: Seconds spent in ``take(wait=True)`` (the engine had nothing in work).
        self.wait_s = 0.0
        #: The engine's batch capacity (sequences at once), if it says (`progress`).
        self.slots: int | None = None
        #: Partial rollouts, if the engine says: it stops once its input ended and at most this
        #: fraction of the requests it admitted still decode, and carries them into its next
        #: step (the cost model then ends its time there instead of at its longest response).
        self.partial = 0.0
        #: Seconds and decode steps reported, summed per batch size (bounded by the slots
        #: however many steps an engine reports; the cost model's fit is the same).
        self._by_active: dict[int, list[float]] = {}
        #: Decode steps (tokens) of each finished request, as reported.
        self.lengths: list[int] = []
        self._mark: float | None = None  # the end of the last reported iteration or idle wait

    def take(self, max_items: int, wait: bool = False) -> list[Any]:
        if self.ended or max_items < 1:
            return []
        started = time.monotonic()
        try:
            items = self._source.get_batch(max_items=max_items, block=wait)
        except EndOfStream:
            self.ended = True
            items = []
        now = time.monotonic()
        if wait:
            self.wait_s += now - started
            self._mark = now  # an idle wait is not part of the next iteration
        if items and self.first_taken_at is None:
            self.first_taken_at = now
        self.taken += len(items)
        return items

    def progress(self, decode_steps: int, active: int, finished: list[int] | tuple[int, ...] = ()) -> None:
        """Optional, for the cost model: the engine ran ``decode_steps`` decode steps with
        ``active`` sequences in its batch since its last report (or since it last waited idle,
        or its first take), and these requests finished (their decode steps each)."""
        now = time.monotonic()
        since = self._mark if self._mark is not None else self.first_taken_at
        if since is not None and decode_steps > 0 and active > 0:
            entry = self._by_active.setdefault(int(active), [0.0, 0])
            entry[0] += now - since
            entry[1] += int(decode_steps)
        self._mark = now
        self.lengths.extend(int(n) for n in finished)

    @property
    def steps(self) -> list[tuple[float, int, int]]:
        """``(seconds, decode steps, sequences in the batch)`` per batch size reported."""
        return [(s, int(n), k) for k, (s, n) in sorted(self._by_active.items())]


def run_continuous(
    worker: Worker,
    spec: StageSpec,
    method: Callable[..., Any],
    source: Channel,
    put: Callable[[list[Any]], None],
) -> dict[str, Any]:
    """One engine call over the whole step's input; what `run_stage` returns, without finish."""
    feed = Feed(source)
    started, wall_start, clock = time.monotonic(), time.time(), CpuClock()
    lap = clock.lap()
    produced = method(feed)
    if not inspect.isgenerator(produced):
        name = f"{type(worker).__name__}.{spec.method}"
        raise TypeError(
            f"{name} runs as a continuous stage, so it must be a generator: take items from the "
            "feed it is given (feed.take(n)), yield lists of outputs as they are done, and "
            "return once feed.ended and nothing is left in work"
        )
    first_output_s = None
    for chunk in produced:
        if chunk is not None:
            if first_output_s is None and feed.first_taken_at is not None:
                first_output_s = time.monotonic() - feed.first_taken_at
            put(list(chunk))
    if not feed.ended:  # the engine returned early: the rest of the stream must not be lost
        name = f"{type(worker).__name__}.{spec.method}"
        raise RuntimeError(
            f"{name} returned before its input ended ({feed.taken} items taken): a continuous "
            "stage must take every item (loop until feed.ended)"
        )
    took = time.monotonic() - started
    cpu_s, runqueue_s = clock.since(lap)
    hook = worker.comm.span_hook
    if hook is not None:
        name = f"{worker.component}.{spec.method}"
        hook(name, "engine", worker.component, wall_start, time.time(), items=feed.taken)
    return {
        "items": feed.taken,
        "micro_batches": [feed.taken] if feed.taken else [],
        "changes": [],
        "busy_s": took - feed.wait_s,
        "cpu_s": cpu_s,  # of the busy time: on a core, and waiting for one (`cpu_time`)
        "runqueue_s": runqueue_s,
        "wait_s": feed.wait_s,
        "first_wait_s": 0.0 if feed.first_taken_at is None else feed.first_taken_at - started,
        "first_output_s": first_output_s,
        "engine": (
            {"slots": feed.slots, "steps": steps, "lengths": feed.lengths, "partial": feed.partial}
            if feed.slots and (steps := feed.steps) and feed.lengths
            else None
        ),
    }
