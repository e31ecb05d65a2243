"""`EmulatedStage`: one rank's emulated device running one stage of the profile.

It sleeps what the profile says the stage costs on the micro-batch it gets (items are
``{"uid", "length"}``), holds the profile's memory on its device, pays the profile's switch
costs when the time-share moves it (`switch_out`/`switch_in`, `release_caches`), and reports,
per step, the time the work would take at full efficiency (``useful_s``) next to the time it
slept, so the flow can tell device idleness from work.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator
from typing import Any

from rlinf_hpc.apps.emulated.profile_file import get_profile
from rlinf_hpc.workers.base import Worker

GB = 1e9
#: Decode steps an emulated engine runs between admissions (new requests join the running batch
#: at these boundaries; 20 steps are ~20 ms at the default time scale).
ENGINE_QUANTUM = 20


class EmulatedStage(Worker):
    def setup(self) -> None:
        emulation = self.job_config.emulation  # type: ignore[union-attr]
        self.profile = get_profile(emulation.profile)
        self.cost = self.profile.stages[self.component]
        self.scale = emulation.time_scale
        self._in_work = 0  # samples of the micro-batch in work (device memory)
        self._reset()

    def _reset(self) -> None:
        self._items = self._tokens = 0
        self._slept = self._useful = 0.0

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds * self.scale)

    # -- the stage ---------------------------------------------------------------------------
    def process(self, batch: list[dict[str, Any]]) -> Any:
        """The micro-batch's cost, slept; a rollout streams each response when it is done."""
        lengths = [item["length"] for item in batch]
        self._in_work = len(batch)  # held until the next call: the elastic rule reads it after
        if self.cost.kind == "generate":
            return self._generate(batch, lengths)
        seconds = self.profile.stage_seconds(self.component, lengths)
        self._sleep(seconds)
        self._account(lengths, seconds)
        return batch

    def _generate(self, batch: list[dict[str, Any]], lengths: list[int]) -> Iterator[list[dict[str, Any]]]:
        seconds, ends = self.profile.rollout_schedule(lengths)
        chunk = max(1, len(batch) // 8)
        started, ready = time.monotonic(), []
        for end, item in sorted(zip(ends, batch, strict=True), key=lambda pair: pair[0]):
            ready.append(item)
            if len(ready) >= chunk:
                time.sleep(max(0.0, end * self.scale - (time.monotonic() - started)))
                yield ready
                ready = []
        time.sleep(
            max(0.0, (seconds + self.cost.seconds_per_call) * self.scale - (time.monotonic() - started))
        )
        self._account(lengths, seconds + self.cost.seconds_per_call)
        if ready:
            yield ready

    def engine(self, feed: Any) -> Iterator[list[dict[str, Any]]]:
        """A continuous-batching engine for the whole step (a continuous stage): requests join
        the running batch whenever a slot is free, each decode step costs ``decode_step_s *
        (alpha + (1 - alpha) * active / slots)`` (the cost `Profile.rollout_schedule` charges a
        micro-batch), and each response goes downstream when it is done. The low-occupancy tail
        is paid once, when the step's requests run out. Emulated time is kept against the clock
        (sleep overshoot does not accumulate); time lost waiting for input or downstream is not
        made up."""
        profile, slots = self.profile, self.profile.slots
        feed.slots = slots  # and `feed.progress` below: what the cost model needs of an engine
        active: list[tuple[int, int, dict[str, Any]]] = []  # (decode step it ends at, seq, item)
        clock = 0  # decode steps
        emulated = 0.0  # seconds of decode work so far
        anchor = time.monotonic()  # real time at emulated 0 (moved by time not made up)
        admitted: list[int] = []
        seq = 0
        while True:
            if len(active) < slots and not feed.ended:
                waited = time.monotonic()
                new = feed.take(slots - len(active), wait=not active)
                if not active:  # the engine was empty: waiting is not work
                    anchor += time.monotonic() - waited
                for item in new:
                    heapq.heappush(active, (clock + item["length"], seq, item))
                    admitted.append(item["length"])
                    seq += 1
                self._in_work = len(active)
            if not active:
                if feed.ended:
                    break
                continue
            steps = min(active[0][0] - clock, ENGINE_QUANTUM)
            occupancy = len(active) / slots
            emulated += steps * profile.decode_step_s * (profile.alpha + (1 - profile.alpha) * occupancy)
            clock += steps
            lag = time.monotonic() - anchor - emulated * self.scale
            if lag < 0:
                time.sleep(-lag)
            elif lag > ENGINE_QUANTUM * profile.decode_step_s * self.scale:
                anchor += lag  # lost to the box or to backpressure: not made up
            running = len(active)
            done = []
            while active and active[0][0] <= clock:
                done.append(heapq.heappop(active)[2])
            feed.progress(steps, running, [item["length"] for item in done])
            if done:
                yield done
        self._account(admitted, emulated)

    def _account(self, lengths: list[int], seconds: float) -> None:
        self._items += len(lengths)
        self._tokens += sum(lengths)
        self._slept += seconds
        if self.cost.kind == "generate":  # at full occupancy the same tokens would take
            self._useful += self.profile.decode_step_s * sum(lengths) / self.profile.slots
        else:
            self._useful += seconds

    def finish(self) -> dict[str, Any]:
        """End of the step (the actor's optimizer step); this rank's figures, then reset."""
        self._sleep(self.cost.finish_s)
        self._in_work = 0
        stats = {
            "rank": self.rank,
            "items": self._items,
            "tokens": self._tokens,
            "slept_s": (self._slept + self.cost.finish_s) * self.scale,
            "useful_s": (self._useful + self.cost.finish_s) * self.scale,
        }
        self._reset()
        return stats

    # -- weight sync ---------------------------------------------------------------------------
    def send_weights(self) -> float:
        """Either side of a weight sync (bandwidth-scaled); returns the bytes moved."""
        self._sleep(self.profile.sync_s)
        return self.profile.weights_gb * GB

    receive_weights = send_weights

    # -- the emulated device -------------------------------------------------------------------
    def memory_fraction(self) -> float:
        if not self.cost.on_device:
            return 0.0
        used = self.cost.state_gb + self._in_work * self.cost.gb_per_sample
        return min(1.0, used / self.profile.device_gb)

    def memory_profile(self) -> dict[str, float] | None:
        if not self.cost.on_device or self.cost.gb_per_sample <= 0:
            return None
        return {
            "device_bytes": self.profile.device_gb * GB,
            "state_bytes": self.cost.state_gb * GB,
            "bytes_per_sample": self.cost.gb_per_sample * GB,
        }

    def release_caches(self) -> None:
        if self.cost.on_device:
            self._sleep(self.profile.switch_light_s)

    def switch_out(self) -> int | None:
        if not self.cost.on_device:
            return None
        self._sleep(self.profile.switch_full_s / 2)  # the seed's full switch: out and back in
        return int(self.cost.state_gb * GB)

    def switch_in(self) -> None:
        self._sleep(self.profile.switch_full_s / 2)
