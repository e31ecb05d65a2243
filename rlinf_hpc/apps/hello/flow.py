"""The `hello` flow: send numbers to every component group and print what came back.

It shows the whole control path in a few lines: the coordinator splits work over the ranks of
each group, both groups compute at the same time, and the results come back as futures.
"""

from __future__ import annotations

from typing import Any

from rlinf_hpc.runtime.console import print_table
from rlinf_hpc.scheduler import Coordinator, GroupFuture


def hello_flow(coordinator: Coordinator) -> dict[str, Any]:
    """Every group applies its operation to 1..num_items, split over its ranks."""
    numbers = list(range(1, coordinator.config.hello.num_items + 1))
    futures: dict[str, GroupFuture] = {}
    for name in coordinator.placement.groups:
        group = coordinator.group(name)
        chunks = [numbers[i :: len(group)] for i in range(len(group))]
        futures[name] = group.call_each("apply", chunks)  # all groups work concurrently

    rows = []
    summary: dict[str, Any] = {}
    for name, future in futures.items():
        replies = future.result()
        outputs = sorted(x for reply in replies for x in reply["outputs"])
        summary[name] = {"outputs": outputs, "ranks": [r["rank"] for r in replies]}
        for reply in replies:
            pairs = ", ".join(f"{i}->{o}" for i, o in zip(reply["inputs"], reply["outputs"], strict=True))
            rows.append((name, str(reply["rank"]), reply["device"], pairs))
    print_table("hello: what came back", ["component", "rank", "device", "input->output"], rows)
    return summary
