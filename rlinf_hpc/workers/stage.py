"""The micro flow on a worker rank: one pipeline stage, micro-batch by micro-batch.

`run_stage` takes micro-batches from the stage's input channel, calls the worker's method on
each (``method(batch) -> outputs``), puts the outputs into the output channel (or keeps them to
return when the stage is the last), and closes its output after the input ended. A method that
is a generator streams: each list it yields goes downstream at once (a continuous-batching
engine handing over the responses that finished while the rest of its batch still decodes). The
micro-batch size is elastic (`rlinf_hpc.scheduler.elastic.ElasticBatching`): it halves while a
stage on other ranks waits on this one (unless smaller micro-batches cost it much more per item)
and doubles under memory pressure; every change is logged with its reason and returned with the
sizes. An elastic micro-batch is what has arrived, up to its size; without ``elastic`` it is
exactly ``micro_batch`` items (the stage waits for them; only the stream's last one may be
smaller), as a fixed-micro-batch pipeline does, and so is the micro-batch of an elastic stage
found batch-bound (a short one would cost it nearly as much as a full one). The controller's
per-size costs live on the worker from step to step; the memory per sample of each micro-batch
is measured on CUDA ranks (`Worker.sample_memory`, for ``auto``'s bound). Each micro-batch is a
timeline span. A stage declared ``continuous`` runs its method once per step on a `Feed` it
admits items from as it has room (`rlinf_hpc.workers.continuous`): an engine with its own
scheduler, no micro-batches.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlinf_hpc.channel import Channel, EndOfStream
from rlinf_hpc.errors import CommTimeoutError
from rlinf_hpc.runtime.cpu_time import CpuClock
from rlinf_hpc.scheduler.elastic import ElasticBatching
from rlinf_hpc.scheduler.protocol import StageSpec
from rlinf_hpc.workers.continuous import run_continuous

if TYPE_CHECKING:
    from rlinf_hpc.workers.base import Worker


def _weight(item: Any, key: str | None) -> float:
    if key is None or not isinstance(item, dict) or key not in item:
        return 1.0
    value = item[key]
    return float(value) if isinstance(value, (int, float)) else float(len(value))


def run_stage(worker: Worker, spec: StageSpec) -> dict[str, Any]:
    """Run the stage on this rank until its input ends; returns what happened (and outputs)."""
    method = getattr(worker, spec.method, None)
    if method is None or not callable(method) or spec.method.startswith("_"):
        name = type(worker).__name__
        raise AttributeError(f"{name} has no public method '{spec.method}' to run as a stage")
    source = worker.channel(spec.source)
    sink = worker.channel(spec.sink) if spec.sink else None
    outputs: list[Any] = []
    last_output_at = None  # wall clock (`time.time`): compared across ranks by the cost model

    def put(chunk: list[Any]) -> None:
        nonlocal last_output_at
        last_output_at = time.time()
        if sink is not None:
            sink.put_batch(chunk, [_weight(x, spec.weight_key) for x in chunk])
        else:
            outputs.extend(chunk)

    if spec.continuous:
        ran = run_continuous(worker, spec, method, source, put)
    else:
        ran = _run_micro_batches(worker, spec, method, source, sink, put)
    ended_at = time.time()
    if sink is not None:
        sink.close()
    finish_started, clock = time.monotonic(), CpuClock()
    lap = clock.lap()
    finished = getattr(worker, spec.finish)() if spec.finish else None
    finish_s = time.monotonic() - finish_started
    finish_cpu_s, finish_runqueue_s = clock.since(lap)
    return {
        "rank": worker.rank,
        "component": worker.component,
        **ran,
        "ended_at": ended_at,
        "last_output_at": last_output_at,
        "finish_s": finish_s,
        "finish_cpu_s": finish_cpu_s,  # of which on a core, and waiting for one (`cpu_time`)
        "finish_runqueue_s": finish_runqueue_s,
        "switch_s": worker.last_switch_s,
        "outputs": outputs,
        "finish": finished,
    }


def _run_micro_batches(
    worker: Worker,
    spec: StageSpec,
    method: Callable[..., Any],
    source: Channel,
    sink: Channel | None,
    put: Callable[[list[Any]], None],
) -> dict[str, Any]:
    """Micro-batch by micro-batch until the input ends (sizes elastic)."""
    carried = worker.stage_sizes  # sizes carry over between steps (and into checkpoints)
    key = (spec.method, spec.min_micro_batch, spec.max_micro_batch, spec.micro_batch)
    knowledge = worker.elastic_knowledge.setdefault(key, {})
    size = carried.get(spec.method, spec.micro_batch) if spec.elastic else spec.micro_batch
    before = size
    if spec.elastic and spec.first_size:  # `auto` moved the ranks: start where it predicted
        size = max(spec.first_size, knowledge.get("floor", spec.min_micro_batch))
    batching = ElasticBatching(
        spec.min_micro_batch,
        spec.max_micro_batch,
        size,
        spec.wait_threshold_s,
        spec.memory_threshold,
        start=spec.micro_batch,
    )
    batching.adopt(knowledge)
    if spec.elastic and spec.first_size:  # and try the size before once, measured here
        batching.probe_after_move(before)
    meter = worker.sample_memory
    sizes: list[int] = []
    changes: list[dict[str, Any]] = []
    busy_s = wait_s = last_s = cpu_s = runqueue_s = 0.0
    clock = CpuClock()
    downstream_seen = 0.0
    hook = worker.comm.span_hook
    ended = False
    opened, first_wait_s = time.monotonic(), None
    first_output_s = None  # a streaming method's first micro-batch: its first output
    while not ended:
        asked = time.monotonic()
        batch = []
        try:
            batch = source.get_batch(max_items=batching.size)
            full = not spec.elastic or batching.batch_bound  # wait for a full micro-batch
            # fixed micro-batches are full (the baseline's rule); an elastic batch-bound stage
            # waits for the rest at most as long as a full micro-batch takes (`fill_wait_s`)
            patience = batching.fill_wait_s() if spec.elastic else None
            deadline = None if patience is None else time.monotonic() + patience
            while full and len(batch) < batching.size:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                more = batching.size - len(batch)
                try:
                    batch += source.get_batch(max_items=more, add_to_last=True, timeout=left)
                except CommTimeoutError:
                    break
        except EndOfStream:
            ended = True
        if not batch:
            wait_s += time.monotonic() - asked
            break
        started = time.monotonic()
        wait_s += started - asked
        if first_wait_s is None:
            first_wait_s = started - opened
        wall_start, lap = time.time(), clock.lap()
        meter.start()
        produced = method(batch)
        chunks = produced if inspect.isgenerator(produced) else [produced]
        for chunk in chunks:  # a generator streams its outputs as they are ready
            if chunk is not None:
                if first_output_s is None and chunks is produced:
                    first_output_s = time.monotonic() - started
                put(list(chunk))
        meter.stop(len(batch))
        took = time.monotonic() - started
        busy_s += took
        last_s = took
        cpu, runqueue = clock.since(lap)
        cpu_s, runqueue_s = cpu_s + cpu, runqueue_s + runqueue
        if hook is not None:
            name = f"{worker.component}.{spec.method}"
            hook(name, "micro-batch", worker.component, wall_start, time.time(), items=len(batch))
        sizes.append(len(batch))
        if spec.elastic:
            apart = sink is not None and spec.downstream_apart  # else waiting is a barrier
            downstream = sink.downstream_wait_s() if apart else 0.0
            weight = sum(_weight(x, spec.weight_key) for x in batch) if spec.weight_key else None
            size, reason = batching.update(
                downstream - downstream_seen, worker.memory_fraction(), len(batch), took, apart, weight
            )
            downstream_seen = downstream
            if reason is not None:
                worker.log.info("micro-batch of %s: %s", spec.method, reason)
                changes.append({"after_micro_batch": len(sizes), "size": size, "reason": reason})
    carried[spec.method] = batching.size
    return {
        "items": sum(sizes),
        "micro_batches": sizes,
        "changes": changes,
        "busy_s": busy_s,
        "cpu_s": cpu_s,  # of the busy time: on a core, and waiting for one (`cpu_time`)
        "runqueue_s": runqueue_s,
        "wait_s": wait_s,
        "first_wait_s": first_wait_s or 0.0,
        "first_output_s": first_output_s,
        "last_s": last_s,  # the last micro-batch: a long-tailed stream's last items are its longest
        "last_items": sizes[-1] if sizes else 0,
    }
