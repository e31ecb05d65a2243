"""Who is where: component groups, each world rank's device and node.

Workers address each other as ``(component, group_rank)`` or by world rank; the directory
turns either into a world rank and says which device and node it lives on (for routing).
The coordinator sends every rank a fresh copy whenever the placement changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

Address: TypeAlias = "int | tuple[str, int]"


@dataclass(frozen=True)
class ChannelSpec:
    """A channel as every rank sees it: who produces, who consumes, how items are balanced."""

    name: str
    producers: tuple[int, ...]
    consumers: tuple[int, ...]
    policy: str = "performance_aware"
    capacity: int = 64
    consumer_weights: tuple[float, ...] | None = None
    #: Consumers move queued items to host memory when device memory use passes this fraction.
    offload_above: float | None = None
    #: Channels of one lineage share their producers' measured consumer rates (see `Channel`).
    lineage: str | None = None


@dataclass(frozen=True)
class Directory:
    """Placement as seen by the data plane."""

    groups: dict[str, list[int]] = field(default_factory=dict)
    devices: dict[int, str] = field(default_factory=dict)
    nodes: dict[int, int] = field(default_factory=dict)
    world_size: int = 0
    version: int = 0
    channels: dict[str, ChannelSpec] = field(default_factory=dict)

    def resolve(self, address: Address) -> int:
        """World rank of ``address``; ValueError that says what exists when it does not."""
        if isinstance(address, tuple):
            if len(address) != 2:
                raise ValueError(f"address {address!r} is not (component, group_rank)")
            component, group_rank = address
            ranks = self.groups.get(component)
            if ranks is None:
                known = ", ".join(sorted(self.groups)) or "none"
                raise ValueError(
                    f"no component '{component}' in the job (components: {known}); it may have "
                    "left after a re-partition"
                )
            if not isinstance(group_rank, int) or not 0 <= group_rank < len(ranks):
                raise ValueError(
                    f"component '{component}' has {len(ranks)} rank(s) (group ranks "
                    f"0..{len(ranks) - 1}), so ({component!r}, {group_rank!r}) does not exist "
                    "or has left"
                )
            return ranks[group_rank]
        if isinstance(address, bool) or not isinstance(address, int):
            raise ValueError(f"address {address!r} is neither a world rank nor (component, rank)")
        if not 0 <= address < self.world_size:
            raise ValueError(f"world rank {address} does not exist (world size {self.world_size})")
        return address

    def name_of(self, rank: int) -> str:
        """``rank 3 (actor:1)`` for messages."""
        if rank == 0:
            return "rank 0 (coordinator)"
        roles = [f"{c}:{ranks.index(rank)}" for c, ranks in self.groups.items() if rank in ranks]
        return f"rank {rank} ({', '.join(roles)})" if roles else f"rank {rank}"

    def roles_of(self, rank: int) -> tuple[tuple[str, int], ...]:
        """(component, group_rank) pairs of ``rank``: its address(es) in the job."""
        return tuple((c, ranks.index(rank)) for c, ranks in self.groups.items() if rank in ranks)

    def device_of(self, rank: int) -> str:
        """Device tensors sent to ``rank`` should land on (``cpu`` if unknown)."""
        return self.devices.get(rank, "cpu")

    def same_node(self, a: int, b: int) -> bool:
        """True when both ranks run on the same node."""
        return self.nodes.get(a, -1) == self.nodes.get(b, -2)
