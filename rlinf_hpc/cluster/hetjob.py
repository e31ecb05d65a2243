"""The components of a heterogeneous SLURM job (``#SBATCH hetjob``) and which ranks are whose.

One ``srun --het-group=0,1 ...`` step starts one MPI world across the components: the tasks of
component 0 come first (world ranks 0 .. n0-1, rank 0 the coordinator), then component 1's,
and so on. SLURM gives the batch script each component's task count as
``SLURM_NTASKS_HET_GROUP_<i>`` (with ``SLURM_HET_SIZE`` components); the template
(``slurm/hetjob_embodied.sbatch``) passes them on as ``RLINF_HPC_HET_TASKS="n0,n1,..."``, which
also lets an mpiexec run on one machine reproduce a hetjob's placement (the tests do).
A component of the config names its heterogeneous component with ``het_group``.

>>> layout = read_het_layout({"RLINF_HPC_HET_TASKS": "3,2"})
>>> layout.sizes, layout.group_of(2), layout.group_of(3), layout.ranks_of(1)
((3, 2), 0, 1, [3, 4])
>>> read_het_layout({"SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "1",
...                  "SLURM_NTASKS_HET_GROUP_1": "4"}).sizes
(1, 4)
>>> read_het_layout({}) is None
True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rlinf_hpc.errors import UserError

LAYOUT_VARIABLE = "RLINF_HPC_HET_TASKS"


@dataclass(frozen=True)
class HetLayout:
    """Task counts of the heterogeneous components, in order."""

    sizes: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def ranks_of(self, group: int) -> list[int]:
        first = sum(self.sizes[:group])
        return list(range(first, first + self.sizes[group]))

    def group_of(self, rank: int) -> int:
        for group in range(len(self.sizes)):
            if rank in self.ranks_of(group):
                return group
        raise ValueError(f"rank {rank} is beyond the heterogeneous job's {self.total} tasks")

    def describe(self) -> str:
        return ", ".join(f"component {g}: ranks {self.ranks_of(g)[0]}-{self.ranks_of(g)[-1]}"
                         for g in range(len(self.sizes)))  # fmt: skip


def read_het_layout(env: Mapping[str, str] | None = None) -> HetLayout | None:
    """The layout from ``RLINF_HPC_HET_TASKS`` or SLURM's ``*_HET_GROUP_<i>`` variables; None
    outside a heterogeneous job. `UserError` for a malformed value."""
    env = os.environ if env is None else env
    raw = env.get(LAYOUT_VARIABLE)
    if raw:
        try:
            sizes = tuple(int(part) for part in raw.split(","))
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) < 1:
            raise UserError(
                f"{LAYOUT_VARIABLE}='{raw}' is not a list of task counts, e.g. '3,2' (component 0 "
                "has 3 tasks, component 1 has 2); slurm/hetjob_embodied.sbatch sets it from "
                "SLURM_NTASKS_HET_GROUP_<i>."
            )
        return HetLayout(sizes)
    count = env.get("SLURM_HET_SIZE")
    if not count or not count.isdigit():
        return None
    sizes_found = []
    for group in range(int(count)):
        value = env.get(f"SLURM_NTASKS_HET_GROUP_{group}") or env.get(
            f"SLURM_STEP_NUM_TASKS_HET_GROUP_{group}"
        )
        if value is None or not value.isdigit():
            return None  # a step of one component only: no layout to place by
        sizes_found.append(int(value))
    return HetLayout(tuple(sizes_found))
