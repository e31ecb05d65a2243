"""Coordinator, component groups, placement and the coordinator <-> worker protocol."""

from rlinf_hpc.scheduler.coordinator import Coordinator
from rlinf_hpc.scheduler.futures import CallFuture, GroupFuture
from rlinf_hpc.scheduler.group import ComponentGroup
from rlinf_hpc.scheduler.pipeline import Pipeline, StepResult
from rlinf_hpc.scheduler.placement import Placement, effective_device, placement_rows, plan_placement
from rlinf_hpc.scheduler.steps import RunningStep, start_steps

__all__ = [
    "CallFuture",
    "ComponentGroup",
    "Coordinator",
    "GroupFuture",
    "Pipeline",
    "Placement",
    "RunningStep",
    "StepResult",
    "effective_device",
    "placement_rows",
    "plan_placement",
    "start_steps",
]
