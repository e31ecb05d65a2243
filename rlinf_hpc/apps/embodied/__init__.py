"""The `embodied_ppo` app: CPU simulators (gymnasium: classic control, MuJoCo) on env ranks, the
policy on policy ranks, PPO with a critic and GAE on actor ranks; pipelined env/policy stepping
and optional asynchronous parameter updates. Its sections: [env], [ppo]."""

from rlinf_hpc.apps.embodied.config import EnvConfig, PPOConfig
from rlinf_hpc.config.apps import App

APP = App(
    name="embodied_ppo",
    flow="rlinf_hpc.apps.embodied.flow:embodied_ppo_flow",
    validate="rlinf_hpc.apps.embodied.checks:validate",
    sections={"env": EnvConfig, "ppo": PPOConfig},
    resumable_keys=("ppo.iterations",),
    # the model's state holds the observation statistics only when normalize_observations is on
    fixed_keys=(
        "env.id",
        "env.envs_per_rank",
        "env.pipeline_stages",
        "ppo.hidden_sizes",
        "ppo.normalize_observations",
    ),
    description="CPU simulators, the policy elsewhere, PPO with asynchronous parameter updates",
)
