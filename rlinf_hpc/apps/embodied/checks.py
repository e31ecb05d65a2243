"""The embodied app's input checks, run before any rank starts (by `rlinf-hpc run`, then by
rank 0): components, placement, the environment id and spaces, the split of env over actor
ranks. Imports no torch."""

from __future__ import annotations

from rlinf_hpc.apps.embodied.envs import check_env_id
from rlinf_hpc.config import Config
from rlinf_hpc.config.apps import require_components
from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger

log = get_logger("embodied")

COMPONENTS = ("env", "policy", "actor")


def validate(config: Config) -> None:
    """Before any worker starts: components, the environment, the split of env ranks."""
    require_components(config, COMPONENTS, "embodied_ppo")
    placement = config.placement
    if placement.mode == "auto" and not any({"policy", "actor"} <= set(g) for g in placement.groups):
        raise UserError(
            'placement.mode = "auto" for embodied PPO starts with policy and actor sharing ranks '
            "(env ranks apart: an env rank waits for the policy's actions while it steps) and then "
            "keeps them shared or splits those ranks between them, whichever measured faster. "
            'Add groups = [["policy", "actor"]] under [placement].'
        )
    for unit in config.placement_units():
        if "env" in unit and "policy" in unit:
            raise UserError(
                f'placement.mode = "{config.placement.mode}" puts env and policy on the same ranks, '
                "but an env rank waits for the policy's actions while it steps, so the two need ranks "
                'of their own. Use "disaggregated", or "hybrid" (or "auto") with groups = '
                '[["policy", "actor"]] (policy and actor time-share ranks; env ranks separate).'
            )
    shared = any("policy" in u and "actor" in u for u in config.placement_units())
    if config.ppo.async_updates and shared and placement.mode != "auto":
        log.warning(
            "ppo.async_updates with policy and actor on the same ranks: the next rollout and the "
            "update take turns there instead of overlapping (give the actor ranks of its own)"
        )
    check_env_id(config.env.id, config.env.options)
    envs, actors = config.components["env"].num_ranks, config.components["actor"].num_ranks
    what = f"components.actor.num_ranks = {actors}"
    if placement.mode == "auto":  # the warm-up's actor: on the group's ranks, all of them
        actors = next(config.unit_size(u) for u in config.placement_units() if "actor" in u)
        what = f"the {actors} ranks policy and actor share in auto's warm-up (their num_ranks added)"
    if envs % actors:
        raise UserError(
            f"components.env.num_ranks = {envs} cannot be split evenly over "
            f"{what}: every actor rank trains on the rollouts of "
            "the same number of env ranks (data parallel). Make env ranks a multiple of actor ranks."
        )
    samples = config.ppo.rollout_steps * config.env.envs_per_rank * envs // actors
    if samples < config.ppo.minibatches:
        raise UserError(
            f"each actor rank gets {samples} transitions per rollout, fewer than ppo.minibatches = "
            f"{config.ppo.minibatches}; raise ppo.rollout_steps or env.envs_per_rank."
        )
