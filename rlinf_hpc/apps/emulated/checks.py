"""The emulated app's input checks, run before any rank starts (no torch here: every launch
would pay for it)."""

from __future__ import annotations

from typing import Any

from rlinf_hpc.apps.emulated.profile_file import get_profile
from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger

log = get_logger("emulated")


def validate(config: Any) -> None:
    """Enough samples for the stages; a very small time scale is flagged (sleeps of well under
    a millisecond measure the runtime's overhead, not the profile)."""
    emulation = config.emulation
    profile = get_profile(emulation.profile)
    samples = emulation.samples_per_step or profile.samples_per_step
    per_sample = profile.full_occupancy_seconds((profile.short[0] + profile.short[1]) / 2)
    if per_sample * emulation.time_scale < 1e-4:
        log.warning(
            "emulation.time_scale %g makes a response cost %.1f us of sleep: the runtime's own "
            "overhead will dominate (raise it)", emulation.time_scale,
            1e6 * per_sample * emulation.time_scale,
        )  # fmt: skip
    if samples < len(config.components):
        raise UserError(
            f"emulation.samples_per_step ({samples}) is smaller than the number of stages; raise it"
        )
    if emulation.partial_rollouts and not emulation.continuous_generation:
        raise UserError(
            f"emulation.partial_rollouts = {emulation.partial_rollouts:g} carries an engine's "
            "unfinished requests into its next step, and there is no engine with "
            "emulation.continuous_generation = false (one generate call per micro-batch ends "
            "with its longest response). Set continuous_generation = true or partial_rollouts = 0."
        )
