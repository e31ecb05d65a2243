"""The `emulated_rl` app: an RL step whose stages sleep what a real accelerator would spend
(long-tailed generation, inference, training, weight sync, context switches, device memory), so
the real runtime — coordinator, channels, elastic micro-batches, time-share, auto placement —
can be run at 8-32 ranks on a small box. Labelled as emulation everywhere it reports."""

from rlinf_hpc.apps.emulated.config import EmulationConfig
from rlinf_hpc.config.apps import App


def _check(config: object) -> None:
    from rlinf_hpc.apps.emulated.profile_file import get_profile

    profile = get_profile(config.emulation.profile)  # type: ignore[attr-defined]
    components = list(config.components)  # type: ignore[attr-defined]
    if components != list(profile.stages):
        raise ValueError(
            f"emulation.profile '{profile.name}' has the stages {list(profile.stages)} (in that "
            f"order); the config's components are {components}: declare exactly those"
        )


APP = App(
    name="emulated_rl",
    flow="rlinf_hpc.apps.emulated.flow:emulated_rl_flow",
    validate="rlinf_hpc.apps.emulated.checks:validate",
    sections={"emulation": EmulationConfig},
    check=_check,
    description="an RL step on emulated accelerators (sleep-costed stages) for scale experiments",
)
