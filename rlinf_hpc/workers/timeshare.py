"""Time-multiplexing of one rank's device between the components placed on it.

Before a command runs for component X on a rank that hosts several components, the rank makes
X resident: with ``switch = "full"`` every other resident component's state (whatever its
worker returns from `Worker.switch_state`: a model and optionally its optimizer) moves to host
memory and X's comes back, bit for bit (a worker whose state the runtime cannot move, such as
an inference engine with a sleep mode of its own, moves it in `Worker.switch_out` /
`switch_in` instead); with ``"light"`` the others only `release_caches`.
Each switch is a timeline span (category ``switch``) with its seconds and compression ratio.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime.timeline import Timeline
from rlinf_hpc.workers.base import Worker

if TYPE_CHECKING:  # imported where a switch is made: it needs torch, time-sharing may not
    from rlinf_hpc.scheduler.offload import ModuleSwitch

log = get_logger("timeshare")


class DeviceTimeShare:
    """Which components of this rank are resident on its device, and the switches between."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self._switches: dict[str, ModuleSwitch] = {}
        self._offloaded: set[str] = set()
        #: Offloaded components whose worker moved its state itself (`Worker.switch_out`).
        self._self_moved: set[str] = set()
        #: (component switched in, seconds, bytes moved, compression ratio) of every switch.
        self.history: list[tuple[str, float, int, float]] = []

    def forget(self, component: str) -> None:
        """The component left this rank: bring its state back (its worker is being torn down)."""
        switch = self._switches.pop(component, None)
        if switch is not None and component in self._offloaded:
            switch.onload()
        self._offloaded.discard(component)
        self._self_moved.discard(component)

    def activate(self, component: str, workers: dict[str, Worker], mode: str, offload: str) -> float:
        """Make ``component`` resident before it runs (no-op with one component or ``off``,
        except that a component still switched out comes back: e.g. after a re-partition
        left it alone on its rank). Returns the seconds the switch took."""
        sharing = len(workers) >= 2 and mode != "off"
        if not sharing and component not in self._offloaded:
            return 0.0
        start = time.time()
        moved, ratios = 0, []
        for name, worker in workers.items() if sharing else ():
            if name == component or name in self._offloaded:
                continue
            if mode == "light":
                worker.release_caches()
                continue
            switch = self._switch_for(name, worker, offload)
            if switch is not None:
                snapshot = switch.offload()
                self._offloaded.add(name)
                moved += snapshot.raw_bytes
                ratios.append(snapshot.ratio)
            elif (own := worker.switch_out()) is not None:  # the worker moves its state itself
                self._offloaded.add(name)
                self._self_moved.add(name)
                moved += own
        onloaded = component in self._offloaded
        if onloaded:
            if component in self._self_moved:
                workers[component].switch_in()
                self._self_moved.discard(component)
            else:
                self._switches[component].onload()
            self._offloaded.discard(component)
        seconds = time.time() - start
        switched = bool(moved) or onloaded or mode == "light"
        if switched:
            ratio = sum(ratios) / len(ratios) if ratios else 1.0
            self.history.append((component, seconds, moved, ratio))
            self.timeline.add(
                f"switch to {component}",
                "switch",
                component,
                start,
                time.time(),
                mode=mode,
                bytes=moved,
                ratio=round(ratio, 3),
            )
        return seconds if switched else 0.0

    @contextmanager
    def host_view(self, component: str) -> Iterator[None]:
        """Run the body with ``component``'s state readable where it is: resident, or (when it
        is switched out) its host copy — nothing is moved back to the device."""
        moved = component in self._offloaded and component not in self._self_moved
        switch = self._switches.get(component) if moved else None
        with switch.host_view() if switch is not None else nullcontext():
            yield

    def _switch_for(self, name: str, worker: Worker, offload: str) -> ModuleSwitch | None:
        if name not in self._switches:
            state: Any = worker.switch_state()
            if state is None:
                return None
            from rlinf_hpc.scheduler.offload import ModuleSwitch, OffloadOptions

            module, optimizer = state if isinstance(state, tuple) else (state, None)
            self._switches[name] = ModuleSwitch(module, optimizer, OffloadOptions(mode=offload), key=name)
        return self._switches[name]
