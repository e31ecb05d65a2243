"""Cost profiles of the emulated-accelerator workload: what each stage of an RL step would cost
on a real device, in seconds at the seed's scale (multiplied by ``emulation.time_scale`` when a
rank sleeps it).

This is an emulation, not a measurement: the figures are public orders of magnitude, chosen to
keep the *proportions* the seed describes (seed 000 §1-2: a 7B GRPO step whose generation has a
long tail — 95% of responses done within 100 s, 5% up to 200 s — and context switches of 43 ms
light / 217 ms full). The stage models:

* **rollout** (``generate``): a continuous-batching engine with ``slots`` sequences in flight.
  A call on ``n`` responses of lengths ``L_i`` (tokens) takes
  ``decode_step_s * (alpha * makespan + (1 - alpha) * sum(L_i) / slots)``: every decode step
  costs at least ``alpha`` of a full-occupancy one (weights are read whatever the occupancy),
  and ``makespan`` is the number of steps until the last response of the call is done (greedy
  slot assignment). So a batch waits on its longest response at low occupancy — the long tail.
  The worker streams each response downstream when it is done (a generator stage), as an
  engine with continuous batching can. With ``emulation.continuous_generation`` (the default)
  a rollout rank is one engine for the whole step instead (`EmulatedStage.engine`, a continuous
  stage): the same cost per decode step, requests joining the running batch as slots free.
* **reward** / **inference** / **actor** (``per_token``): compute-bound, ``seconds_per_token``
  times the tokens of the micro-batch, plus ``seconds_per_call``; the actor's optimizer step is
  ``finish_s`` once per step. A trainer that updates only once the step's samples are all in
  (several epochs over them, as the math actor does) puts that work in its finish instead:
  ``finish_per_sample`` seconds per sample the rank took.
* **env** / **policy** (embodied, ``per_sample``): seconds per sample (a simulator step on CPU,
  a policy forward), plus ``seconds_per_call``.

Each stage has a device memory footprint: ``state_gb`` resident, ``gb_per_sample`` while it
works on a micro-batch (KV cache, activations); weight sync moves ``weights_gb`` at
``bandwidth_gbps`` to each rank once (a second component on a rank copies them on the device).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from rlinf_hpc.scheduler.engine_model import slot_ends


@dataclass(frozen=True)
class StageCost:
    """One stage's cost model (seconds at the seed's scale)."""

    kind: str  # "generate" | "per_token" | "per_sample"
    seconds_per_token: float = 0.0
    seconds_per_sample: float = 0.0
    seconds_per_call: float = 0.0
    #: Once per step, after the stage's last micro-batch (the actor's optimizer step).
    finish_s: float = 0.0
    #: In that finish, per sample the rank took this step (an update over the step's samples).
    finish_per_sample: float = 0.0
    #: Device memory held while resident, and per sample of the micro-batch in work.
    state_gb: float = 0.0
    gb_per_sample: float = 0.0
    #: Runs on a device (time-shared, switch costs); False: a CPU simulator.
    on_device: bool = True


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    stages: dict[str, StageCost]
    samples_per_step: int
    #: Response lengths in tokens: short ones uniform in ``short``, a ``long_fraction`` of
    #: them uniform in ``long`` (the long tail).
    short: tuple[int, int] = (400, 1000)
    long: tuple[int, int] = (1500, 2000)
    long_fraction: float = 0.05
    decode_step_s: float = 0.1
    slots: int = 64
    alpha: float = 0.4
    weights_gb: float = 15.2
    bandwidth_gbps: float = 25.0
    switch_light_s: float = 0.043
    switch_full_s: float = 0.217
    device_gb: float = 80.0
    #: Which stages' ranks receive the actor's weights after each step.
    sync_to: tuple[str, ...] = ("rollout", "inference")
    #: The stages that update weights on the step's samples — the step's last stages, in order;
    #: the first is the policy whose weights go to ``sync_to``. Off-policy they are the training
    #: pipeline. Empty: the trailing stages with an optimizer step (a finish), else the last.
    trainers: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)

    @property
    def train_stages(self) -> tuple[str, ...]:
        """The stages that train (``trainers``, or the trailing ones with a finish — never the
        first stage — else the last stage).

        >>> PROFILES["grpo-7b"].train_stages, PROFILES["embodied"].train_stages
        (('actor',), ('actor',))
        """
        if self.trainers:
            return tuple(self.trainers)
        names = list(self.stages)
        trailing: list[str] = []
        for name in reversed(names[1:]):  # the first stage generates, whatever its finish
            cost = self.stages[name]
            if cost.finish_s <= 0 and cost.finish_per_sample <= 0:
                break
            trailing.insert(0, name)
        return tuple(trailing) or (names[-1],)

    @property
    def generation_stages(self) -> tuple[str, ...]:
        """The stages before the trainers (off-policy: the generation pipeline).

        >>> PROFILES["grpo-7b"].generation_stages
        ('rollout', 'reward', 'inference')
        """
        return tuple(self.stages)[: -len(self.train_stages)]

    @property
    def sync_s(self) -> float:
        return self.weights_gb / self.bandwidth_gbps

    def lengths(self, rng: random.Random, n: int) -> list[int]:
        """``n`` response lengths of the long-tailed distribution."""
        out = []
        for _ in range(n):
            low, high = self.long if rng.random() < self.long_fraction else self.short
            out.append(rng.randint(low, high))
        return out

    def rollout_schedule(self, lengths: list[int]) -> tuple[float, list[float]]:
        """One generate call on these responses (see the module's docstring): its seconds, and
        when each response is done (seconds from the call's start, in decode-step proportion)."""
        if not lengths:
            return 0.0, []
        ends = slot_ends(lengths, self.slots)  # each response takes the slot that frees first
        makespan = max(ends)
        total = self.decode_step_s * (self.alpha * makespan + (1 - self.alpha) * sum(lengths) / self.slots)
        return total, [total * end / makespan for end in ends]

    def full_occupancy_seconds(self, tokens: float) -> float:
        """Decode time of ``tokens`` on an engine whose every slot is busy (no long tail): the
        generation work a step holds at full efficiency."""
        return self.decode_step_s * tokens / self.slots

    def rollout_seconds(self, lengths: list[int]) -> float:
        return self.rollout_schedule(lengths)[0]

    def stage_seconds(self, component: str, lengths: list[int]) -> float:
        """Seconds one call of ``component`` takes on a micro-batch of these responses."""
        cost = self.stages[component]
        if cost.kind == "generate":
            return self.rollout_seconds(lengths) + cost.seconds_per_call
        if cost.kind == "per_token":
            return cost.seconds_per_token * sum(lengths) + cost.seconds_per_call
        return cost.seconds_per_sample * len(lengths) + cost.seconds_per_call

    def on_policy_floor_s(self, lengths: list[int]) -> float:
        """The least time an on-policy step on responses of these lengths can take on ideal
        devices, whatever the placement and however many ranks (seconds at the seed's scale):
        the step's longest response decoded alone on an engine (each decode step at least
        ``alpha + (1 - alpha) / slots`` of a full one), then that response through every later
        stage (a micro-batch of it alone), each trainer's optimizer step after its part of it
        (its ``finish_s``; the latest to end counts) and the weight sync the next step's
        generation waits for. A step whose work spread over its ranks takes longer is bound by
        that instead (the benchmark's ``ceiling``); this is the bound no rank count lifts.

        >>> profile = PROFILES["grpo-7b"]
        >>> round(profile.on_policy_floor_s([500, 2000]), 1)  # 81.9 + 0.02 + 0.4 + 1.2 + 2 + 0.56
        86.1
        """
        longest = max(lengths)
        total = ended = 0.0
        for name, cost in self.stages.items():
            if cost.kind == "generate":
                per_step = self.alpha + (1 - self.alpha) / self.slots
                total += self.decode_step_s * per_step * longest + cost.seconds_per_call
            else:
                total += self.stage_seconds(name, [longest])
            # a stage's optimizer step follows its last micro-batch (later stages' go on beside it)
            ended = max(ended, total + cost.finish_s + cost.finish_per_sample)
        return ended + self.sync_s

    def max_micro_batch(self, component: str) -> int | None:
        """The seed's rule for the largest micro-batch: 0.3 x (device - state) / per sample."""
        cost = self.stages[component]
        if not cost.on_device or cost.gb_per_sample <= 0:
            return None
        return max(1, math.floor(0.3 * (self.device_gb - cost.state_gb) / cost.gb_per_sample))


def _llm(name: str, billions: float, decode_step_s: float, slots: int, device_gb: float = 80.0) -> Profile:
    """A GRPO step of a ``billions``-parameter model: compute costs scale with the size,
    switch costs and weight bytes too (the seed's 43 / 217 ms are for 7B)."""
    scale = billions / 7.0
    weights = 2.0 * billions  # bf16
    return Profile(
        name=name,
        description=f"GRPO, {billions:g}B-parameter policy, long-tailed generation (emulated)",
        stages={
            "rollout": StageCost("generate", state_gb=weights, gb_per_sample=0.06 * scale),
            "reward": StageCost("per_sample", seconds_per_sample=0.02, on_device=False),
            "inference": StageCost(
                "per_token", seconds_per_token=2e-4 * scale, state_gb=weights, gb_per_sample=0.05 * scale
            ),
            "actor": StageCost(
                "per_token",
                seconds_per_token=6e-4 * scale,
                finish_s=2.0 * scale,
                state_gb=min(0.6 * device_gb, 8.0 * billions / 4),  # sharded weights + optimizer
                gb_per_sample=0.4 * scale,
            ),
        },
        samples_per_step=1024,
        decode_step_s=decode_step_s,
        slots=slots,
        weights_gb=weights,
        switch_light_s=0.043 * scale,
        switch_full_s=0.217 * scale,
        device_gb=device_gb,
    )


PROFILES: dict[str, Profile] = {
    "grpo-7b": _llm("grpo-7b", 7.0, decode_step_s=0.1, slots=64),
    "grpo-1.5b": _llm("grpo-1.5b", 1.5, decode_step_s=0.05, slots=128),
    "grpo-32b": _llm("grpo-32b", 32.0, decode_step_s=0.25, slots=32),
    "embodied": Profile(
        name="embodied",
        description="embodied PPO: CPU simulators, policy and actor on devices (emulated)",
        stages={
            "env": StageCost("per_sample", seconds_per_sample=0.4, on_device=False),
            "policy": StageCost(
                "per_sample",
                seconds_per_sample=0.02,
                seconds_per_call=0.05,
                state_gb=15.0,
                gb_per_sample=0.02,
            ),
            "actor": StageCost(
                "per_sample", seconds_per_sample=0.15, finish_s=1.0, state_gb=40.0, gb_per_sample=0.1
            ),
        },
        samples_per_step=1024,
        short=(1, 1),
        long=(1, 1),
        long_fraction=0.0,
        sync_to=("policy",),
    ),
}
