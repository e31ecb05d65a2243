"""``placement.mode = "auto"`` for embodied PPO: policy and actor sharing ranks, or split —
each measured for a few iterations, the faster kept.

The embodied flow is not a `Pipeline` (env ranks step and ask the policy ranks for actions
through a channel; the actor trains on whole rollouts), so the framework's auto, which models a
pipeline's stages, does not apply. Here there are two placements of the group of ranks that
policy and actor share in the config (``groups = [["policy", "actor"]]``, as many ranks as their
``num_ranks`` add up to; env ranks apart) — both on all of them, or the policy on the first
``policy.num_ranks`` and the actor on the rest — and a model of either from the other's numbers
would have to guess how policy inference and the update scale with ranks and what sharing costs
(switches, cores). On this 2-core box the guess of linear scaling was 50% off: the update of a
small MLP took as long on one actor rank as on two, and two policy ranks sharing the cores with
the env ranks slowed the rollout. So both are measured:

1. ``auto_warmup_steps`` iterations shared, then ``auto_warmup_steps`` split (the move is a
   shrink: each rank keeps what it holds, and the actor ranks confirm it from one of them);
2. the last iteration of each is compared; with ``ppo.async_updates`` the split one counts as the
   longer of its rollout and its update plus the sync (the next rollout is then collected while
   the actor trains — the trials themselves run synchronously, as a rollout in flight must not
   see ranks move), the shared one as measured (there the two take turns);
3. if sharing was faster, policy and actor move back onto all the group's ranks: the actor ranks
   that join adopt the state of one that trained (`ActorWorker.adopt_state`), the policy ranks
   that join get the weights (the flow syncs them).

Both measurements, the choice and the next iteration's time are logged and recorded
(``auto_placement``, ``auto_placement_measured``) and kept in checkpoints (a resume does not
measure again; the checkpoint's groups are taken back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlinf_hpc.log import get_logger

if TYPE_CHECKING:
    from rlinf_hpc.scheduler import Coordinator

log = get_logger("auto")


def iteration_estimate(record: dict[str, Any], asynchronous: bool, shared: bool) -> float:
    """An iteration's seconds in this placement, from a synchronous iteration's ``record``:
    as measured, or — asynchronous updates on ranks of their own — the longer of rollout and
    update, plus the weight sync.

    >>> r = {"iteration_s": 1.6, "rollout_s": 1.0, "train_s": 0.5, "weight_sync_s": 0.02}
    >>> [iteration_estimate(r, *how) for how in ((False, False), (True, True), (True, False))]
    [1.6, 1.6, 1.02]
    """
    if asynchronous and not shared:
        return max(record["rollout_s"], record["train_s"]) + record["weight_sync_s"]
    return record["iteration_s"]


class EmbodiedAuto:
    """The auto mode's state for the embodied flow: measuring shared, then split, then decided."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        config = coordinator.config
        self.enabled = config.placement.mode == "auto"
        self.asynchronous = config.ppo.async_updates
        self.warmup = config.placement.auto_warmup_steps
        self.policy_ranks = config.components["policy"].num_ranks if self.enabled else 0
        self.iterations = 0
        self.group: list[int] = coordinator.placement.ranks_of("policy") if self.enabled else []
        self.estimates: dict[str, float] = {}
        self.choice: str | None = None  # "shared" or "split"
        self.measured_s: float | None = None

    @property
    def warming_up(self) -> bool:
        return self.enabled and self.choice is None

    @property
    def label(self) -> str:
        if not self.enabled:
            return self.coordinator.config.placement.mode
        if self.choice:
            return f"auto:{self.choice}"
        return "auto:trial (shared)" if self.iterations < self.warmup else "auto:trial (split)"

    def state_dict(self) -> dict[str, Any]:
        return {
            "iterations": self.iterations,
            "group": self.group,
            "estimates": self.estimates,
            "choice": self.choice,
            "measured_s": self.measured_s,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.iterations, self.group = state["iterations"], list(state["group"])
            self.estimates, self.choice = dict(state["estimates"]), state["choice"]
            self.measured_s = state["measured_s"]

    def after_iteration(self, record: dict[str, Any]) -> bool:
        """Count a finished iteration and move when a trial ends. True when policy ranks joined
        (they need the weights before the next rollout)."""
        if not self.enabled:
            return False
        if self.choice is not None:
            if self.measured_s is None:
                self._measured(record)
            return False
        self.iterations += 1
        if self.iterations == self.warmup:  # shared measured: try the split
            self.estimates["shared"] = iteration_estimate(record, self.asynchronous, shared=True)
            split = self.policy_ranks
            if not 0 < split < len(self.group):
                self._decide("shared", f"no split of {len(self.group)} rank(s)")
                return False
            log.info(
                "auto: shared on ranks %s: %.3f s per iteration; trying policy on %s, actor on %s",
                self.group, record["iteration_s"], self.group[:split], self.group[split:],
            )  # fmt: skip
            source = self.group[split]  # an actor rank that stays (each holds the same state)
            self.coordinator.repartition({"policy": self.group[:split], "actor": self.group[split:]})
            self.coordinator.group("actor").call("adopt_state", source).result()
            return False
        if self.iterations == 2 * self.warmup:  # split measured: keep the faster
            self.estimates["split"] = iteration_estimate(record, self.asynchronous, shared=False)
            faster = min(self.estimates, key=self.estimates.__getitem__)
            if faster == "shared":
                source = self.coordinator.placement.ranks_of("actor")[0]
                self.coordinator.repartition({"policy": self.group, "actor": self.group})
                self.coordinator.group("actor").call("adopt_state", source).result()
            self._decide(faster, "both measured")
            return faster == "shared"
        return False

    def _decide(self, choice: str, why: str) -> None:
        self.choice = choice
        log.info(
            "auto: per iteration%s %s (%s) -> %s",
            " with asynchronous updates" if self.asynchronous else "",
            ", ".join(f"{k} {v:.3f} s" for k, v in self.estimates.items()), why, choice,
        )  # fmt: skip
        placement = self.coordinator.placement
        self.coordinator.record(
            "auto_placement", choice=choice, estimates_s=dict(self.estimates), asynchronous=self.asynchronous,
            policy=placement.ranks_of("policy"), actor=placement.ranks_of("actor"),
        )  # fmt: skip

    def _measured(self, record: dict[str, Any]) -> None:
        self.measured_s = record["iteration_s"]
        expected = self.estimates[self.choice]
        log.info(
            "auto: %s iteration expected %.3f s, measured %.3f s (%+.0f%%)",
            self.choice, expected, self.measured_s, 100 * (self.measured_s - expected) / max(expected, 1e-9),
        )  # fmt: skip
        self.coordinator.record(
            "auto_placement_measured", choice=self.choice, predicted_s=expected, measured_s=self.measured_s
        )
