"""`ComponentGroup`: the coordinator's handle on a group of worker ranks.

The macro flow calls methods on a group by name; each call returns futures at once, so that
several groups can work at the same time::

    rollout = coordinator.group("rollout")
    samples = rollout.call("generate", prompts)      # every rank, same arguments
    scores = reward.call_each("score", [[1], [2]])    # one argument tuple per rank
    print(samples.result(), scores.result())
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlinf_hpc.scheduler.futures import GroupFuture

if TYPE_CHECKING:
    from rlinf_hpc.scheduler.coordinator import Coordinator


class ComponentGroup:
    """Worker ranks of one component, or a fixed subset of them (`subset`)."""

    def __init__(self, coordinator: Coordinator, name: str, group_ranks: Sequence[int] | None = None) -> None:
        self._coordinator = coordinator
        self.name = name
        self._group_ranks = None if group_ranks is None else list(group_ranks)

    @property
    def world_ranks(self) -> list[int]:
        """World ranks this handle addresses (follows re-partitions unless it is a subset)."""
        ranks = self._coordinator.placement.ranks_of(self.name)
        if self._group_ranks is None:
            return list(ranks)
        out_of_range = [i for i in self._group_ranks if i >= len(ranks)]
        if out_of_range:
            raise IndexError(
                f"subset of '{self.name}' uses group ranks {out_of_range}, but the group now has "
                f"{len(ranks)} rank(s)"
            )
        return [ranks[i] for i in self._group_ranks]

    def __len__(self) -> int:
        return len(self.world_ranks)

    def subset(self, group_ranks: Sequence[int]) -> ComponentGroup:
        """A handle on some of this group's ranks, by group rank (0 .. len-1)."""
        size = len(self._coordinator.placement.ranks_of(self.name))
        bad = [i for i in group_ranks if not 0 <= i < size]
        if bad or not group_ranks:
            raise ValueError(
                f"subset of '{self.name}' needs group ranks in 0..{size - 1}, got {list(group_ranks)}"
            )
        base = self._group_ranks or list(range(size))
        return ComponentGroup(self._coordinator, self.name, [base[i] for i in group_ranks])

    def call(self, method: str, *args: Any, **kwargs: Any) -> GroupFuture:
        """Run ``method(*args, **kwargs)`` on every rank of the handle; returns at once."""
        ranks = self.world_ranks
        return self._coordinator.calls.send(self.name, ranks, method, [args] * len(ranks), kwargs)

    def call_each(self, method: str, per_rank_args: Sequence[Any]) -> GroupFuture:
        """Run ``method`` with one argument tuple per rank (a non-tuple is one argument)."""
        ranks = self.world_ranks
        if len(per_rank_args) != len(ranks):
            raise ValueError(
                f"call_each('{method}') on '{self.name}' got {len(per_rank_args)} argument sets for "
                f"{len(ranks)} rank(s)"
            )
        args = [a if isinstance(a, tuple) else (a,) for a in per_rank_args]
        return self._coordinator.calls.send(self.name, ranks, method, args, {})

    def __repr__(self) -> str:
        return f"ComponentGroup({self.name!r}, ranks={self.world_ranks})"
