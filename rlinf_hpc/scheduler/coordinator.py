"""The coordinator (world rank 0): places components, drives them, ends the job cleanly.

It needs no accelerator. It turns the config's components into groups of worker ranks, each
with its own MPI communicator, sends commands to them (futures come back at once), can move
ranks between groups while the job runs, and on the way out makes every rank leave its service
loop — or, when a rank no longer answers, aborts the whole job instead of hanging.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlinf_hpc.channel import Channel, channel_for
from rlinf_hpc.cluster import RankSlot
from rlinf_hpc.comm import COORDINATOR_RANK, Backoff, ControlPlane, DataPlane, Directory, abort
from rlinf_hpc.config import Config, config_from_dict
from rlinf_hpc.errors import JobInterrupted, UserError
from rlinf_hpc.log import get_logger
from rlinf_hpc.scheduler.calls import Calls
from rlinf_hpc.scheduler.group import ComponentGroup
from rlinf_hpc.scheduler.placement import Placement, channel_specs, effective_device, plan_placement
from rlinf_hpc.scheduler.protocol import (
    Answer,
    Join,
    Leave,
    Request,
    SetDirectory,
    Shutdown,
)

log = get_logger("coordinator")


class Coordinator:
    """Runs on world rank 0. The macro flow gets one and calls `group(name)` on it.

    >>> # in a flow: def my_flow(coordinator): coordinator.group("actor").call("train").result()
    """

    def __init__(
        self,
        config: Config,
        control: ControlPlane,
        slots: list[RankSlot],
        comm: DataPlane | None = None,
        recorder: Callable[..., None] | None = None,
    ) -> None:
        if control.rank != COORDINATOR_RANK:
            raise RuntimeError("the Coordinator runs on world rank 0 only")
        self.config = config
        self.control = control
        #: The coordinator's own data plane: it can send to and receive from any worker.
        self.comm = comm
        self._recorder = recorder
        self._channels = dict(config.channels)
        self.slots = slots
        self._slot_of = {s.rank: s for s in slots}
        self._placement: Placement | None = None
        self._next_comm_tag = 1000
        self._directory_version = 0
        #: Commands in flight, replies, departures and the job's fatal error.
        self.calls = Calls(
            control, comm, config.job.call_timeout_s, self._serve_request, self._components_label
        )
        #: The run directory (``--run-dir``) where flows may write their files; None without one.
        self.run_dir: Path | None = None
        #: Called as ``hook(pipeline name, StepResult)`` after every pipeline step.
        self.step_hooks: list[Callable[[str, Any], None]] = []
        #: Timeline spans the workers handed over when they left (see runtime.timeline).
        self.worker_spans: list[dict[str, Any]] = self.calls.worker_spans
        #: The job's checkpoint manager (`rlinf_hpc.runtime.checkpoint.manager`), set by the runner.
        self.checkpoints: Any = None

    # -- placement ---------------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        """The current component -> ranks placement (after `start`)."""
        if self._placement is None:
            raise RuntimeError("Coordinator.start() has not run yet")
        return self._placement

    @property
    def worker_ranks(self) -> list[int]:
        """Every world rank but the coordinator's."""
        return [s.rank for s in self.slots if s.rank != COORDINATOR_RANK]

    def start(self) -> Placement:
        """Plan the placement from the config and form every group. Raises `UserError`."""
        placement = plan_placement(self.config, self.slots)
        self._publish_directory(placement.groups)
        self._form_groups(placement.groups, placement.groups.keys())
        self._placement = placement
        return placement

    def _publish_directory(self, groups: Mapping[str, list[int]], wait: bool = True) -> Directory:
        """Every rank's data plane learns the new placement before any worker uses it.

        With ``wait=False`` (serving a worker's request from inside a wait) the workers take it
        in between their commands; failures still surface through the futures."""
        self._directory_version += 1
        devices = {
            rank: effective_device(self.config.components[name], self._slot_of[rank])
            for name, ranks in groups.items()
            for rank in ranks
        }
        directory = Directory(
            groups={name: list(ranks) for name, ranks in groups.items()},
            devices={0: "cpu", **devices},
            nodes={s.rank: s.node_index for s in self.slots},
            world_size=len(self.slots),
            version=self._directory_version,
            channels=channel_specs(self._channels, groups),
        )
        if self.comm is not None:
            self.comm.set_directory(directory)
        futures = []
        for rank in self.worker_ranks:
            future = self.calls.new_future(rank, "-", "set_directory")
            self.control.send_command(rank, SetDirectory(future.call_id, directory))
            futures.append(future)
        if wait:
            self.calls.wait_all(futures)
        else:  # nobody waits on these: a failure becomes the job's failure at the next wait
            self.calls.background.update(f.call_id for f in futures)
        return directory

    def create_channel(
        self, name: str, producers: list[str] | str, consumers: list[str] | str, **options: Any
    ) -> None:
        """Declare a channel while the job runs (as if it were under ``[channels.NAME]``);
        every rank learns it before this returns. ``options``: policy, capacity, ...
        A bad declaration raises `UserError` saying which key is wrong."""
        self.update_channels({name: {"producers": producers, "consumers": consumers, **options}})

    def update_channels(
        self, add: Mapping[str, dict[str, Any]], remove: Iterable[str] = (), wait: bool = True
    ) -> None:
        """Remove channels and declare new ones with one directory update (one round trip to
        every rank). Removed channels must be finished: items still queued are dropped.

        ``wait=False`` returns once the update is sent: each rank takes it before any command
        sent to it later (a rank runs its commands in order), so a stage launched next finds
        its channels; an item that reaches a rank before the rank took the update waits in its
        data plane's stash until the channel's consumer asks for it. A rank that fails to take
        it fails the job at the coordinator's next wait."""
        for name in remove:
            if self._channels.pop(name, None) is None:
                raise KeyError(f"no channel '{name}' to remove")
        for name, spec in add.items():
            self._declare_channel(name, spec)
        self._publish_directory(self.placement.groups, wait=wait)

    def channel(self, name: str) -> Channel:
        """The coordinator's handle on channel ``name`` (it may produce into it)."""
        if self.comm is None:
            raise RuntimeError("this coordinator has no data plane")
        return channel_for(self.comm, name)

    def _declare_channel(self, name: str, spec: dict[str, Any]) -> None:
        if name in self._channels:
            raise UserError(f"channel '{name}' exists already; pick another name.")
        declared = {k: v.model_dump() for k, v in self._channels.items()}
        checked = config_from_dict(
            {**self.config.model_dump(), "channels": {**declared, name: spec}},
            f"create_channel('{name}')",
        )
        self._channels = dict(checked.channels)

    def _serve_request(self, rank: int, request: Request) -> None:
        """A worker asked, from inside a method, for a job-wide change."""
        try:
            if request.kind != "create_channel":
                raise UserError(f"unknown request '{request.kind}'")
            payload = dict(request.payload)
            self._declare_channel(payload.pop("name"), payload)
            answer = Answer(True, self._publish_directory(self.placement.groups, wait=False))
        except UserError as exc:
            answer = Answer(False, error=str(exc))
        self.control.send_answer(rank, answer)

    def channel_stats(self) -> dict[str, list[dict[str, Any]]]:
        """`Channel.stats` of every channel from every worker rank taking part in it, by channel
        (written to ``events.jsonl`` when the flow returns)."""
        futures: dict[str, list[Any]] = {}
        for name, channel in channel_specs(self._channels, self.placement.groups).items():
            for rank in sorted(set(channel.producers) | set(channel.consumers)):
                component = next(iter(self.placement.components_on(rank)), None)
                if component is None:  # the coordinator itself: its stats are local
                    continue
                handle = self.group(component)
                index = self.placement.ranks_of(component).index(rank)
                futures.setdefault(name, []).append(handle.subset([index]).call("channel_stats", name))
        return {name: [f.result()[0] for f in group] for name, group in futures.items()}

    def record(self, event: str, **fields: Any) -> None:
        """Append an event (metrics, channel stats, ...) to the run's ``events.jsonl``."""
        if self._recorder is not None:
            self._recorder(event, **fields)

    def group(self, name: str) -> ComponentGroup:
        """Handle on a component group by name."""
        if name not in self.placement.groups:
            raise KeyError(f"no component '{name}'; the job has {', '.join(self.placement.groups)}")
        return ComponentGroup(self, name)

    def repartition(self, new_groups: Mapping[str, Sequence[int]]) -> Placement:
        """Move ranks between components while the job runs.

        Components not named keep their ranks. Ranks that leave a component tear their worker
        down and free its communicator; every changed group gets a fresh communicator; ranks
        that join build the worker and run its ``setup``.
        """
        current = self.placement.groups
        for name, ranks in new_groups.items():
            if name not in current:
                raise ValueError(f"repartition names unknown component '{name}'")
            bad = [r for r in ranks if r not in self.worker_ranks]
            if bad or not ranks or len(set(ranks)) != len(ranks):
                raise ValueError(
                    f"repartition of '{name}' needs distinct worker ranks from {self.worker_ranks}, "
                    f"got {list(ranks)}"
                )
        target = {name: sorted(new_groups.get(name, ranks)) for name, ranks in current.items()}
        changed = [name for name in current if target[name] != current[name]]
        leaving = [(name, rank) for name in changed for rank in current[name] if rank not in target[name]]
        futures = []
        for name, rank in leaving:
            future = self.calls.new_future(rank, name, "teardown")
            self.control.send_command(rank, Leave(future.call_id, name))
            futures.append(future)
        self.calls.wait_all(futures)
        self._publish_directory(target)
        self._form_groups(target, changed)
        self._placement = Placement(target)
        log.info("repartitioned: %s", ", ".join(f"{n}={target[n]}" for n in changed) or "no change")
        return self._placement

    def _form_groups(self, groups: Mapping[str, list[int]], names: Iterable[str]) -> None:
        futures = []
        for name in names:
            component = self.config.components[name]
            tag = self._next_comm_tag
            self._next_comm_tag += 1
            for rank in groups[name]:
                future = self.calls.new_future(rank, name, "setup")
                join = Join(
                    future.call_id,
                    name,
                    component.worker,
                    tuple(groups[name]),
                    tag,
                    dict(component.options),
                    effective_device(component, self._slot_of[rank]),
                    self.config.job.seed,
                    self.config.placement.switch,
                    self.config.placement.offload,
                )
                self.control.send_command(rank, join)
                futures.append(future)
        self.calls.wait_all(futures)

    # -- calls (the ledger is `scheduler.calls.Calls`) ---------------------------------------
    def calls_in_flight(self) -> list[str]:
        """Worker commands sent and not answered yet (the coordinator's own background
        directory updates excluded), after routing every reply that has arrived."""
        return self.calls.in_flight()

    def pump(self) -> bool:
        """Receive and route every reply that has arrived (`Calls.pump`). True if any did."""
        return self.calls.pump()

    def _components_label(self, rank: int) -> str:
        return "+".join(self.placement.components_on(rank)) if self._placement else "-"  # as heartbeats

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self, exit_code: int, reason: str, timeout: float | None = None) -> bool:
        """Ask every worker to leave; True if all acknowledged, else abort the whole job."""
        if exit_code == 0:
            self.calls.raise_if_fatal()  # a failure no wait saw yet: the job did not succeed
        timeout = self.config.job.shutdown_timeout_s if timeout is None else timeout
        remaining = [r for r in self.worker_ranks if r not in self.calls.departed]
        for rank in remaining:
            self.control.send_command(rank, Shutdown(reason))
        deadline = time.monotonic() + timeout
        backoff = Backoff()
        while any(r not in self.calls.departed for r in remaining) and time.monotonic() < deadline:
            try:
                if self.pump():
                    backoff.reset()
                else:
                    backoff.sleep()
            except JobInterrupted as exc:  # the launcher ends the job while it stops (srun's
                # SIGTERM to every task once one died: rank 0's came while it waited for the dead
                # one, and the exception left it in an unbounded MPI_Finalize until srun's SIGKILL,
                # 30 s on); the handlers ignore a second signal
                log.warning(
                    "received %s while stopping (%s): 2 s more for the ranks", exc.signal_name, reason
                )
                deadline = min(deadline, time.monotonic() + 2.0)
        silent = [r for r in remaining if r not in self.calls.departed]
        if not silent:
            return True
        busy = "; ".join(
            f"rank {r} busy in {', '.join(f.describe() for f in self.calls.busy.get(r, {}).values())}"
            if self.calls.busy.get(r)
            else f"rank {r} idle"
            for r in silent
        )
        log.error(
            "ranks %s did not acknowledge shutdown within %.0f s (%s): aborting the job",
            silent,
            timeout,
            busy,
        )
        abort(exit_code or 1)
        return False
