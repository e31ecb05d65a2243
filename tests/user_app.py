"""An app outside the rlinf_hpc package, as a user writes one (README "Your own app"): a config
section of its own, a cross-section check, a worker and a flow. Imported via PYTHONPATH."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rlinf_hpc.config.apps import App
from rlinf_hpc.config.section import Section
from rlinf_hpc.workers import Worker


class CounterConfig(Section):
    """[counter]: what every rank counts."""

    start: int = Field(0, description="First number.")
    count: int = Field(4, ge=1, description="Numbers per rank.")


class CounterWorker(Worker):
    def count(self, start: int, count: int) -> list[int]:
        return [start + self.group_rank * count + i for i in range(count)]


def counter_flow(coordinator: Any) -> dict[str, Any]:
    counter = coordinator.config.counter  # the app's section, typed and validated
    numbers = coordinator.group("counters").call("count", counter.start, counter.count).result()
    print("COUNTED " + repr(numbers), flush=True)
    return {"numbers": numbers}


def check(config: Any) -> None:
    if "counters" not in config.components:
        raise ValueError("the counter app needs a [components.counters] table")


APP = App(
    name="counter",
    flow="user_app:counter_flow",
    sections={"counter": CounterConfig},
    check=check,
    resumable_keys=("counter.count",),
    description="every rank of [components.counters] counts from counter.start",
)
