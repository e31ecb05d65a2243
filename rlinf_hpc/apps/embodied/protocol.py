"""What the embodied workers say to each other: the request channel, message tags, and the
arrays of a trajectory (`EnvWorker` -> `PolicyWorker`, `EnvWorker` -> `ActorWorker`)."""

from __future__ import annotations

#: Env ranks' requests for actions, load-balanced over the policy ranks.
CHANNEL = "observations"
WEIGHTS_TAG = "embodied-weights"
DONE_TAG = "rollout-done"
#: What an env rank sends its actor rank per rollout: ``[steps, simulators, ...]`` arrays.
TRAJECTORY = ("obs", "next_obs", "actions", "logp", "rewards", "discounted", "terminated", "truncated")


def actions_tag(slot: int) -> tuple[str, int]:
    return ("actions", slot)


def rollout_tag(iteration: int) -> tuple[str, int]:
    return ("rollout", iteration)
