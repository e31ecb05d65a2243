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
#: A device-to-device copy of the weights (HBM-class bandwidth, GB/s): what a component pays for
#: weights another component on its rank holds already.
LOCAL_COPY_GBPS = 1000.0
#: The weight sync whose weights this process (a rank: its components share it) holds.
_HELD = {"sync": -1}
#: Decode steps an emulated engine runs between admissions (new requests join the running batch
#: at these boundaries; 20 steps are ~20 ms at the default time scale).
ENGINE_QUANTUM = 20


class EmulatedStage(Worker):
    #: Partial rollouts (`engine`): the fraction of a step's requests left decoding when the
    #: engine stops, and the most steps a response may span (``emulation``'s keys).
    partial = 0.0
    partial_span = 2

    def setup(self) -> None:
        emulation = self.job_config.emulation  # type: ignore[union-attr]
        self.profile = get_profile(emulation.profile)
        self.cost = self.profile.stages[self.component]
        self.scale = emulation.time_scale
        self.partial, self.partial_span = emulation.partial_rollouts, emulation.partial_rollout_steps
        self._in_work = 0  # samples of the micro-batch in work (device memory)
        #: Partial rollouts: (decode steps left, item) of the requests the engine's last step
        #: stopped before they were done.
        self._carry: list[tuple[int, dict[str, Any]]] = []
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
        made up.

        With ``emulation.partial_rollouts = f`` (partial rollouts) the engine does not wait for
        that tail: once its input has ended, the requests it must finish in this step are done
        and at most a fraction ``f`` of the requests it admitted still decode, it stops and keeps
        them (with the decode steps they have left) for its next step, where they are admitted
        first. A response spans at most ``emulation.partial_rollout_steps`` steps (it must finish
        in its last one), so its first tokens are at most that minus one updates stale (``lag``
        on the item: the steps it began before the one that finished it)."""
        profile, slots = self.profile, self.profile.slots
        partial, span = self.partial, self.partial_span
        feed.slots = slots  # and `feed.progress` below: what the cost model needs of an engine
        feed.partial = partial
        # (decode step it ends at, seq, item, decode step it started at, in its last allowed step)
        active: list[tuple[int, int, dict[str, Any], int, bool]] = []
        clock = 0  # decode steps
        emulated = 0.0  # seconds of decode work so far
        anchor = time.monotonic()  # real time at emulated 0 (moved by time not made up)
        decoded = 0  # tokens decoded this step (carried requests: their part in this step)
        seq, admitted, must = 0, 0, 0  # must: requests in their last allowed step
        for left, item in self._carry:  # what the last step left, admitted first
            lag = item.get("lag", 0) + 1
            last = lag + 1 >= span
            heapq.heappush(active, (left, seq, {**item, "lag": lag}, 0, last))
            seq, admitted, must = seq + 1, admitted + 1, must + last
        self._carry = []
        while True:
            if len(active) < slots and not feed.ended:
                waited = time.monotonic()
                new = feed.take(slots - len(active), wait=not active)
                if not active:  # the engine was empty: waiting is not work
                    anchor += time.monotonic() - waited
                for item in new:
                    heapq.heappush(active, (clock + item["length"], seq, item, clock, False))
                    seq, admitted = seq + 1, admitted + 1
                self._in_work = len(active)
            if not active:
                if feed.ended:
                    break
                continue
            if partial and feed.ended and must == 0 and len(active) <= partial * admitted:
                self._carry = [(end - clock, item) for end, _, item, _, _ in active]
                decoded += sum(clock - begun for _, _, _, begun, _ in active)
                break
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
                end, _, item, begun, last = heapq.heappop(active)
                done.append(item)
                decoded += end - begun
                must -= last
            feed.progress(steps, running, [item["length"] for item in done])
            if done:
                yield done
        self._account_tokens(admitted - len(self._carry), decoded, emulated)

    def _account(self, lengths: list[int], seconds: float) -> None:
        self._account_tokens(len(lengths), sum(lengths), seconds)

    def _account_tokens(self, items: int, tokens: int, seconds: float) -> None:
        self._items += items
        self._tokens += tokens
        self._slept += seconds
        if self.cost.kind == "generate":  # at full occupancy the same tokens would take
            self._useful += self.profile.full_occupancy_seconds(tokens)
        else:
            self._useful += seconds

    def finish(self) -> dict[str, Any]:
        """End of the step (the actor's optimizer step, or its update over the samples it took:
        ``finish_per_sample``); this rank's figures, then reset."""
        finish = self.cost.finish_s + self.cost.finish_per_sample * self._items
        self._sleep(finish)
        self._in_work = 0
        stats = {
            "rank": self.rank,
            "items": self._items,
            "tokens": self._tokens,
            "slept_s": (self._slept + finish) * self.scale,
            "useful_s": (self._useful + finish) * self.scale,
        }
        self._reset()
        return stats

    # -- weight sync ---------------------------------------------------------------------------
    def send_weights(self, sync: int = 0) -> float:
        """The trainer's side of weight sync ``sync`` (bandwidth-scaled); returns the bytes moved."""
        self._sleep(self.profile.sync_s)
        _HELD["sync"] = sync
        return self.profile.weights_gb * GB

    def receive_weights(self, sync: int = 0) -> float:
        """A destination's side: over the interconnect, or — where this rank holds the weights of
        this sync already (it sent them, or a component beside this one received them) — a copy
        on the device, as the real sync's process-local mailbox does (`rlinf_hpc.workers.weights`).
        Returns the bytes that crossed the interconnect."""
        if _HELD["sync"] == sync:
            self._sleep(self.profile.weights_gb / LOCAL_COPY_GBPS)
            return 0.0
        self._sleep(self.profile.sync_s)
        _HELD["sync"] = sync
        return self.profile.weights_gb * GB

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
