"""The `toy_pipeline` flow: the macro flow of `rlinf_hpc.scheduler.Pipeline` in a few
lines, over the job's components in config order (each a `rlinf_hpc.apps.toy.workers:ToyStage`).

``[flow] options``: ``steps`` (default 3), ``num_items`` per step (default 64). Each step
feeds ``num_items`` numbers; the summary holds every output (sorted by id), the per-step sums
and step times, which must not depend on the placement.
"""

from __future__ import annotations

from typing import Any

from rlinf_hpc.errors import UserError
from rlinf_hpc.runtime.console import print_table
from rlinf_hpc.scheduler import Coordinator, Pipeline


def toy_pipeline_flow(coordinator: Coordinator) -> dict[str, Any]:
    options = dict(coordinator.config.flow.options)
    steps = options.pop("steps", 3)
    num_items = options.pop("num_items", 64)
    valid = all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (steps, num_items))
    if options or not valid:
        raise UserError(
            f"flow.options for toy_pipeline take steps (int >= 1) and num_items (int >= 1); got "
            f"{dict(coordinator.config.flow.options)}"
        )
    pipe = Pipeline(coordinator, "toy")
    for name in coordinator.config.components:
        pipe.stage(name, "process", finish="total")
    outputs, sums, rows, seconds = [], [], [], []
    for step in range(steps):
        ids = range(step * num_items, (step + 1) * num_items)
        items = [{"id": i, "value": i, "trail": []} for i in ids]
        result = pipe.run(items)
        outputs += result.outputs
        sums.append([sum(v) for v in result.finished.values()])
        seconds.append(result.seconds)
        sizes = " ".join(f"{s['component']}:{s['mean_micro_batch']:.1f}" for s in result.stages)
        rows.append((str(step), result.placement, f"{result.seconds:.3f}", str(len(result.outputs)), sizes))
    pipe.close()
    print_table("toy pipeline", ["step", "placement", "seconds", "outputs", "mean micro-batch"], rows)
    return {
        "outputs": sorted(outputs, key=lambda o: o["id"]),
        "sums": sums,
        "step_seconds": seconds,
        "placement": pipe.placement_label,
    }
