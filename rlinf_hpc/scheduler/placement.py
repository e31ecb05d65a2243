"""Which worker ranks host which component, checked against what the job actually has.

`plan_placement` is pure: config + gathered rank slots in, a `Placement` (or a `UserError`
that says how many ranks/GPUs are missing and how to ask SLURM for them) out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rlinf_hpc.cluster import RankSlot, compress_cpus
from rlinf_hpc.comm import COORDINATOR_RANK, ChannelSpec
from rlinf_hpc.config import ChannelConfig, ComponentConfig, Config
from rlinf_hpc.errors import UserError


@dataclass(frozen=True)
class Placement:
    """Component name -> world ranks (sorted), in config order."""

    groups: dict[str, list[int]]

    def ranks_of(self, component: str) -> list[int]:
        """World ranks of ``component``."""
        return self.groups[component]

    def components_on(self, rank: int) -> list[str]:
        """Components hosted by world rank ``rank``."""
        return [name for name, ranks in self.groups.items() if rank in ranks]


def _how_to_get_ranks(total: int) -> str:
    return (
        f"Start the job with {total} ranks: `rlinf-hpc run CONFIG --np {total}` locally, "
        f"`sbatch -n {total} ...` or `srun -n {total} ...` on SLURM (rank 0 is the coordinator "
        "and hosts no component)."
    )


def _fits(component: ComponentConfig, slot: RankSlot) -> bool:
    return component.device != "gpu" or slot.has_gpu


def effective_device(component: ComponentConfig, slot: RankSlot) -> str:
    """The device a component's worker uses on ``slot``: ``cpu`` when the config says so."""
    return "cpu" if component.device == "cpu" else slot.device


def _check_explicit(name: str, component: ComponentConfig, slots: dict[int, RankSlot]) -> None:
    assert component.ranks is not None
    missing = [r for r in component.ranks if r not in slots]
    if missing:
        need = max(component.ranks) + 1
        raise UserError(
            f"component '{name}' asks for ranks {component.ranks}, but the job has ranks "
            f"0..{len(slots)} only (missing {missing}). {_how_to_get_ranks(need)} Or change "
            f"components.{name}.ranks."
        )
    no_gpu = [r for r in component.ranks if not _fits(component, slots[r])]
    if no_gpu:
        raise UserError(
            f"component '{name}' has device = \"gpu\" but ranks {no_gpu} see no GPU. Ask SLURM "
            "for GPUs (e.g. `sbatch --gpus-per-task=1`), check CUDA_VISIBLE_DEVICES, or set "
            f'components.{name}.device = "cpu".'
        )


def plan_placement(config: Config, slots: list[RankSlot]) -> Placement:
    """Assign worker ranks to components: explicit ``ranks`` first, then the next free ranks.

    Raises `UserError` when the job is too small or lacks GPUs for a component.
    """
    worker_slots = {s.rank: s for s in slots if s.rank != COORDINATOR_RANK}
    if not worker_slots:
        needed = config.num_worker_ranks_needed + 1
        raise UserError(
            f"the job has a single rank, but rank 0 is the coordinator and the components "
            f"({', '.join(config.components)}) need {needed - 1} worker rank(s). "
            f"{_how_to_get_ranks(needed)}"
        )
    parts = [s.het_group for s in slots]
    if any(p is not None for p in parts) and None in parts:
        outside = [s.rank for s in slots if s.het_group is None]
        raise UserError(
            f"the heterogeneous job's layout (RLINF_HPC_HET_TASKS / SLURM_NTASKS_HET_GROUP_<i>) covers "
            f"{len(slots) - len(outside)} ranks but the job has {len(slots)} (ranks {outside} are in no "
            "part): make the parts' task counts add up to the ranks started."
        )
    if config.placement.mode == "auto" and not config.placement.groups:  # everyone everywhere
        pinned = [n for n, c in config.components.items() if c.het_group is not None]
        if pinned:
            raise UserError(
                f'placement.mode = "auto" moves components across every worker rank, but '
                f"{', '.join(pinned)} must stay in their heterogeneous job component (het_group): "
                "choose disaggregated, collocated or hybrid for a heterogeneous job."
            )
        return _plan_auto(config, worker_slots)
    groups: dict[str, list[int]] = {}
    taken: set[int] = set()
    for name, component in config.components.items():
        if component.ranks is not None:
            _check_explicit(name, component, worker_slots)
            groups[name] = sorted(component.ranks)
            taken.update(component.ranks)
    for unit in config.placement_units():
        members = [n for n in unit if config.components[n].ranks is None]
        if not members:
            continue
        size = config.unit_size(members)
        needs_gpu = any(config.components[n].device == "gpu" for n in members)
        het_group = _unit_het_group(config, members, worker_slots)
        free = [
            r for r in sorted(worker_slots) if r not in taken and _in_het_group(worker_slots[r], het_group)
        ]
        usable = [r for r in free if not needs_gpu or worker_slots[r].has_gpu]
        if len(usable) < size:
            label = members[0] if len(members) == 1 else f"{'+'.join(members)} (sharing ranks)"
            groups_text = ", ".join(f"'{n}' {len(r)}" for n, r in groups.items()) or "none yet"
            if needs_gpu and len(free) >= size:
                gpu_names = [n for n in members if config.components[n].device == "gpu"]
                raise UserError(
                    f"component '{label}' needs {size} rank(s) with a GPU "
                    f'(device = "gpu"), but only {len(usable)} free worker rank(s) see one. Ask '
                    "SLURM for GPUs (e.g. `sbatch --gpus-per-task=1`) or set "
                    f'components.{gpu_names[0]}.device = "cpu".'
                )
            if het_group is not None:
                raise UserError(
                    f"component '{label}' needs {size} rank(s) in component {het_group} of the "
                    f"heterogeneous job, but only {len(usable)} of its ranks are free (taken so far: "
                    f"{groups_text}). Give that `#SBATCH hetjob` component more tasks (--ntasks) or "
                    "the component fewer ranks."
                )
            total = config.num_worker_ranks_needed + 1
            raise UserError(
                f"component '{label}' needs {size} worker rank(s) but only "
                f"{len(free)} remain: the job has {len(worker_slots) + 1} ranks (rank 0 is the "
                f"coordinator, {len(worker_slots)} workers; taken so far: {groups_text}). "
                f"{_how_to_get_ranks(total)}"
            )
        unit_ranks = usable[:size]
        for name in members:  # auto's warm-up: every member on all of the unit's ranks
            count = size if config.placement.mode == "auto" else config.components[name].num_ranks
            groups[name] = unit_ranks[:count]
        taken.update(unit_ranks)
    ordered = {name: groups[name] for name in config.components}
    return Placement(ordered)


def _in_het_group(slot: RankSlot, het_group: int | None) -> bool:
    return het_group is None or slot.het_group == het_group


def _unit_het_group(config: Config, members: list[str], worker_slots: dict[int, RankSlot]) -> int | None:
    """The heterogeneous job component the unit's members ask for (the same one, or none);
    `UserError` when they disagree or the job is not heterogeneous."""
    wanted = {config.components[n].het_group for n in members} - {None}
    if not wanted:
        return None
    if len(wanted) > 1:
        raise UserError(
            f"components {', '.join(members)} share ranks but ask for different components of the "
            f"heterogeneous job ({sorted(wanted)}): give them the same het_group, or place them apart."
        )
    (group,) = wanted
    present = {s.het_group for s in worker_slots.values()} - {None}
    if not present:
        name = next(n for n in members if config.components[n].het_group is not None)
        raise UserError(
            f"components.{name}.het_group = {group}, but this job is not a heterogeneous SLURM job "
            "(no SLURM_HET_SIZE / RLINF_HPC_HET_TASKS): submit it with slurm/hetjob_embodied.sbatch "
            f"(`#SBATCH hetjob` components), or remove het_group."
        )
    if group not in present:
        raise UserError(
            f"het_group = {group} asks for component {group} of the heterogeneous job, which has "
            f"worker ranks only in component(s) {sorted(present)}."
        )
    return group


def _plan_auto(config: Config, worker_slots: dict[int, RankSlot]) -> Placement:
    groups = {}
    for name, component in config.components.items():
        usable = [r for r in sorted(worker_slots) if _fits(component, worker_slots[r])]
        if not usable:
            raise UserError(
                f"component '{name}' has device = \"gpu\" but no worker rank sees a GPU. Ask SLURM "
                f'for GPUs (e.g. `sbatch --gpus-per-task=1`) or set components.{name}.device = "cpu".'
            )
        groups[name] = usable
    return Placement(groups)


def channel_specs(
    channels: Mapping[str, ChannelConfig], groups: Mapping[str, list[int]]
) -> dict[str, ChannelSpec]:
    """Channels with component names turned into world ranks.

    Raises `UserError` when ``consumer_weights`` does not give one share per consumer rank.
    """
    specs = {}
    for name, channel in channels.items():

        def ranks(members: list[str]) -> tuple[int, ...]:
            found = {COORDINATOR_RANK} if "coordinator" in members else set()
            for member in members:
                found.update(groups.get(member, []))
            return tuple(sorted(found))

        consumers = ranks(channel.consumers)
        weights = channel.consumer_weights
        if weights is not None and len(weights) != len(consumers):
            raise UserError(
                f"channels.{name}.consumer_weights has {len(weights)} entries but the channel has "
                f"{len(consumers)} consumer rank(s) {list(consumers)}; give one share per rank."
            )
        specs[name] = ChannelSpec(
            name,
            ranks(channel.producers),
            consumers,
            channel.policy,
            channel.capacity,
            None if weights is None else tuple(weights),
            channel.offload_above,
            channel.lineage,
        )
    return specs


def placement_rows(config: Config, placement: Placement, slots: list[RankSlot]) -> list[tuple[str, ...]]:
    """Rows (component, rank, node, local rank, device, cpus) for the start-up table."""
    by_rank = {s.rank: s for s in slots}
    coordinator = by_rank[COORDINATOR_RANK]
    rows = [
        (
            "(coordinator)",
            str(COORDINATOR_RANK),
            f"{coordinator.node_index}:{coordinator.hostname}",
            str(coordinator.local_rank),
            "-",
            compress_cpus(coordinator.cpus),
        )
    ]
    for name, ranks in placement.groups.items():
        for rank in ranks:
            slot = by_rank[rank]
            rows.append(
                (
                    name,
                    str(rank),
                    f"{slot.node_index}:{slot.hostname}",
                    str(slot.local_rank),
                    effective_device(config.components[name], slot),
                    compress_cpus(slot.cpus),
                )
            )
    return rows
