"""Ranks that share CPU cores: how much longer each one's work takes in a placement.

On CPU ranks a stage's speed depends on its neighbours. ``auto``'s warm-up runs every stage on
every worker rank at once (4 ranks on this project's 2-core box: each gets half a core), the
split it predicts runs stages side by side that are not always busy together. Each rank's stage
loop measures how much of its busy time it spent on a core and how long it waited for one
(`runtime.cpu_time`); `profiles.profiles_from_step` takes the wait out (a profile's times are
then a rank's alone) and keeps the share that is CPU work (`PhaseProfile.cpu_fraction`).
`contended` puts back what a placement's own neighbours cost, by processor sharing: a runnable
rank on a node of ``C`` cores with ``k`` other runnable ranks runs ``max(1, (k + 1) / C)`` times
slower, the others each runnable for the share of the step their CPU work takes (independent
of one another: a Poisson-binomial count), solved to a fixed point with the step time.

>>> round(slowdown([1.0, 1.0, 1.0], 2), 3)  # four ranks always runnable on 2 cores
2.0
>>> round(slowdown([0.5], 2), 3)  # one neighbour on 2 cores: never slower
1.0
>>> round(slowdown([0.5, 0.5], 2), 3)  # both neighbours at once a quarter of the time
1.125
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlinf_hpc.comm import COORDINATOR_RANK
from rlinf_hpc.scheduler.cost_model import PhaseProfile

if TYPE_CHECKING:
    from rlinf_hpc.scheduler.coordinator import Coordinator

#: Fixed-point rounds at most, and the change in step time that ends them.
_ROUNDS, _TOLERANCE = 20, 1e-3


@dataclass(frozen=True)
class SharedCores:
    """Where the worker ranks run, in the order ``auto`` gives them out (rank index ``i`` of a
    split is the ``i``-th worker rank): each one's node, each node's cores, and each node's
    background (how many of its cores other processes keep busy: the coordinator's share)."""

    nodes: tuple[int, ...]
    cores: tuple[int, ...]
    background: tuple[float, ...] = ()

    def others(self, index: int, busy: Sequence[float]) -> list[float]:
        """The runnable shares of the ranks (and the background) beside rank ``index``."""
        node = self.nodes[index]
        near = [b for i, b in enumerate(busy) if i != index and self.nodes[i] == node]
        if node < len(self.background) and self.background[node] > 0:
            near.append(min(1.0, self.background[node]))
        return near


def slowdown(others: Sequence[float], cores: int) -> float:
    """How much longer a runnable rank's CPU work takes on ``cores`` cores beside ranks each
    runnable with the probabilities ``others`` (processor sharing, their counts independent)."""
    counts = [1.0]  # P(k others runnable)
    for p in others:
        p = min(1.0, max(0.0, p))
        counts = [
            (counts[k] if k < len(counts) else 0.0) * (1 - p) + (counts[k - 1] * p if k else 0.0)
            for k in range(len(counts) + 1)
        ]
    return sum(q * max(1.0, (k + 1) / max(1, cores)) for k, q in enumerate(counts))


def contended(
    profiles: list[PhaseProfile],
    stage_ranks: list[set[int]],
    num_items: int | Sequence[int],
    cores: SharedCores | None,
    step_time: Callable[[list[PhaseProfile]], float],
) -> float:
    """The step time ``step_time`` gives for the profiles once each stage's CPU work is
    stretched by its ranks' neighbours (its slowest rank's stretch). ``num_items``: the step's
    items, or each stage's (pipelines side by side). Without ``cores``, or without CPU work,
    the profiles as they are.

    >>> cores = SharedCores(nodes=(0, 0, 0, 0), cores=(2,))
    >>> cpu = PhaseProfile("train", 0.01, cpu_fraction=1.0)
    >>> together = lambda ps: 100 * ps[0].seconds_per_item / 4
    >>> round(contended([cpu], [{0, 1, 2, 3}], 100, cores, together), 3)  # 4 busy ranks, 2 cores
    0.5
    >>> contended([cpu], [{0}], 100, cores, lambda ps: 100 * ps[0].seconds_per_item)  # one, alone
    1.0
    """
    if cores is None or not any(p.cpu_fraction > 0 or p.finish_cpu_fraction > 0 for p in profiles):
        return step_time(profiles)
    items = [num_items] * len(profiles) if isinstance(num_items, int) else list(num_items)
    stretch = [1.0] * len(cores.nodes)
    step = previous = 0.0
    for _ in range(_ROUNDS):
        per_stage = [max(stretch[r] for r in ranks) for ranks in stage_ranks]
        step = step_time([p.stretched(s) for p, s in zip(profiles, per_stage, strict=True)])
        if step <= 0 or abs(step - previous) <= _TOLERANCE * step:
            break
        previous = step
        demand = [0.0] * len(stretch)  # each rank's CPU seconds in the step, stretched
        for p, ranks, s, n in zip(profiles, stage_ranks, per_stage, items, strict=True):
            cpu = p.cpu_seconds(n, len(ranks)) * s
            for r in ranks:
                demand[r] += cpu
        busy = [min(1.0, d / step) for d in demand]
        known: dict[tuple[int, float], float] = {}  # ranks of one stage alike: computed once
        fresh = []
        for i, b in enumerate(busy):
            key = (cores.nodes[i], b)
            if key not in known:
                known[key] = slowdown(cores.others(i, busy), cores.cores[cores.nodes[i]])
            fresh.append(known[key])
        stretch = [(old + new) / 2 for old, new in zip(stretch, fresh, strict=True)]
    return step


def shared_cores(coordinator: Coordinator, coordinator_busy: float) -> SharedCores:
    """The worker ranks' nodes (in the order ``auto`` gives ranks out), each node's cores (those
    its ranks may run on, together) and the coordinator's share of its node's."""
    slots = {slot.rank: slot for slot in coordinator.slots}
    order: dict[int, int] = {}  # node index -> its position among the workers' nodes
    for rank in coordinator.worker_ranks:
        order.setdefault(slots[rank].node_index, len(order))
    cpus: dict[int, set[int]] = {}
    for slot in coordinator.slots:
        if slot.node_index in order:
            cpus.setdefault(order[slot.node_index], set()).update(slot.cpus)
    background = [0.0] * len(order)
    mine = slots.get(COORDINATOR_RANK)
    if mine is not None and mine.node_index in order:
        background[order[mine.node_index]] = coordinator_busy
    return SharedCores(
        tuple(order[slots[rank].node_index] for rank in coordinator.worker_ranks),
        tuple(max(1, len(cpus.get(i, ()))) for i in range(len(order))),
        tuple(background),
    )
