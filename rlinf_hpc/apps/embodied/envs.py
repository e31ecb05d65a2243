"""Batches of simulators behind one small interface, and its gymnasium adapter.

`BatchEnv` is what an env worker drives: ``reset``/``step`` on the whole batch (numpy arrays
with a leading instance axis), the observation and action specs, and ``get_state``/``set_state``
for checkpoints. `GymBatch` implements it over gymnasium environments (classic control, MuJoCo)
stepped in this process: no vector-env subprocesses, so nothing forks an MPI rank. An adapter
for a GPU simulator (ManiSkill, LIBERO) implements the same five methods.

Each instance resets itself when its episode ends; ``step`` reports ``terminated`` and
``truncated`` separately, and for an instance whose episode ended the observation the step
*led to* (``final_obs``) next to the reset one, so GAE can bootstrap a time limit correctly.
Instance ``i`` of env rank ``r`` is seeded from ``(job seed, r, i)``.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rlinf_hpc.errors import UserError


@dataclass(frozen=True)
class Spec:
    """What the policy needs to know: observation size, and a discrete action count or a
    continuous action size with bounds."""

    obs_dim: int
    discrete: bool
    action_dim: int  # discrete: number of actions; continuous: vector size
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()


@dataclass
class StepResult:
    obs: np.ndarray  # [n, obs_dim] observations to act on next (reset ones where episodes ended)
    reward: np.ndarray  # [n] float32
    terminated: np.ndarray  # [n] bool
    truncated: np.ndarray  # [n] bool
    final_obs: np.ndarray  # [n, obs_dim]: where each step led (== obs unless the episode ended)
    episode_returns: list[float]  # returns of the episodes that ended in this step
    episode_lengths: list[int]


class BatchEnv(Protocol):
    spec: Spec

    def reset(self) -> np.ndarray: ...

    def step(self, actions: np.ndarray) -> StepResult: ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def check_env_id(env_id: str, options: dict[str, Any] | None = None) -> Spec:
    """The spec of ``env_id`` (made once, closed); `UserError` for an unknown id (with the
    nearest registered names), a missing simulator package, or spaces no policy here handles."""
    import gymnasium as gym

    if env_id not in gym.registry:
        near = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.5)
        hint = f" Nearest registered: {', '.join(near)}." if near else ""
        raise UserError(f"env.id = '{env_id}' is not a registered gymnasium environment.{hint}")
    try:
        env = gym.make(env_id, **(options or {}))
    except (gym.error.DependencyNotInstalled, ImportError) as exc:
        entry = str(getattr(gym.registry[env_id], "entry_point", ""))
        fix = "install what it names, then run the job again"
        if "mujoco" in entry or "mujoco" in str(exc).lower():  # (Box2D's say what they need)
            fix = "pip install mujoco (the mujoco extra: pip install -e '.[mujoco]')"
        needs = f"env.id = '{env_id}' needs a package that is not installed"
        raise UserError(f"{needs} ({exc}): {fix}.") from None
    except TypeError as exc:
        raise UserError(f"env.options for '{env_id}' are not accepted by gymnasium.make: {exc}.") from None
    try:
        return spec_of(env, env_id)
    finally:
        env.close()


def spec_of(env: Any, env_id: str) -> Spec:
    """The `Spec` of a made environment; `UserError` for spaces the policy cannot handle."""
    from gymnasium import spaces

    obs, act = env.observation_space, env.action_space
    if not (isinstance(obs, spaces.Box) and len(obs.shape) == 1):
        raise UserError(
            f"env.id = '{env_id}' observes {obs}; the embodied policy takes flat vector "
            "observations (a 1-D Box). Wrap the environment (e.g. FlattenObservation) or pick another."
        )
    if isinstance(act, spaces.Discrete):
        return Spec(int(obs.shape[0]), True, int(act.n))
    if isinstance(act, spaces.Box) and len(act.shape) == 1:
        low, high = tuple(map(float, act.low)), tuple(map(float, act.high))
        return Spec(int(obs.shape[0]), False, int(act.shape[0]), low, high)
    raise UserError(
        f"env.id = '{env_id}' acts in {act}; the embodied policy handles Discrete actions and "
        "flat continuous (1-D Box) actions."
    )


class GymBatch:
    """``n`` gymnasium environments stepped in this process (see the module docstring)."""

    def __init__(
        self,
        env_id: str,
        n: int,
        seed: int,
        rank: int,
        max_episode_steps: int | None = None,
        options: dict[str, Any] | None = None,
        offset: int = 0,
    ) -> None:
        import gymnasium as gym

        kwargs = dict(options or {})
        if max_episode_steps is not None:
            kwargs["max_episode_steps"] = max_episode_steps
        self.envs = [gym.make(env_id, **kwargs) for _ in range(n)]
        self.spec = spec_of(self.envs[0], env_id)
        self.seeds = [
            int(np.random.SeedSequence([seed, rank, offset + i]).generate_state(1)[0]) for i in range(n)
        ]
        self._returns = np.zeros(n, dtype=np.float64)
        self._lengths = np.zeros(n, dtype=np.int64)
        self._obs = np.zeros((n, self.spec.obs_dim), dtype=np.float32)

    def reset(self) -> np.ndarray:
        obs = [env.reset(seed=s)[0] for env, s in zip(self.envs, self.seeds, strict=True)]
        self._obs = np.stack(obs).astype(np.float32)
        self._returns[:] = 0
        self._lengths[:] = 0
        return self._obs.copy()

    def step(self, actions: np.ndarray) -> StepResult:
        n = len(self.envs)
        obs = np.empty_like(self._obs)
        final = np.empty_like(self._obs)
        reward = np.empty(n, dtype=np.float32)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        returns: list[float] = []
        lengths: list[int] = []
        for i, env in enumerate(self.envs):
            action = int(actions[i]) if self.spec.discrete else actions[i]
            o, r, term, trunc, _ = env.step(action)
            reward[i], terminated[i], truncated[i] = r, term, trunc
            final[i] = o
            self._returns[i] += r
            self._lengths[i] += 1
            if term or trunc:
                returns.append(float(self._returns[i]))
                lengths.append(int(self._lengths[i]))
                self._returns[i] = 0
                self._lengths[i] = 0
                o, _ = env.reset()
            obs[i] = o
        self._obs = obs
        return StepResult(obs.copy(), reward, terminated, truncated, final, returns, lengths)

    def get_state(self) -> dict[str, Any]:
        """Every instance's state without pickling: its RNG, time-limit counter and physics
        (MuJoCo: qpos, qvel, time; classic control: its state vector), plus the running
        episode statistics and the current observations."""
        return {
            "envs": [_instance_state(env) for env in self.envs],
            "returns": self._returns.copy(),
            "lengths": self._lengths.copy(),
            "obs": self._obs.copy(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        for env, saved in zip(self.envs, state["envs"], strict=True):
            _restore_instance(env, saved)
        self._returns = np.asarray(state["returns"], dtype=np.float64).copy()
        self._lengths = np.asarray(state["lengths"], dtype=np.int64).copy()
        self._obs = np.asarray(state["obs"], dtype=np.float32).copy()

    def close(self) -> None:
        for env in self.envs:
            env.close()


_MUJOCO_FIELDS = ("qpos", "qvel", "act", "ctrl", "qacc_warmstart")


def _time_limit(env: Any) -> Any:
    from gymnasium.wrappers import TimeLimit

    while env is not None and not isinstance(env, TimeLimit):
        env = getattr(env, "env", None)
    return env


def _instance_state(env: Any) -> dict[str, Any]:
    base = env.unwrapped
    limit = _time_limit(env)
    state: dict[str, Any] = {
        "rng": json.dumps(base.np_random.bit_generator.state),
        "elapsed": -1 if limit is None else int(limit._elapsed_steps or 0),
    }
    if hasattr(base, "data") and hasattr(base, "set_state"):  # MuJoCo
        data = base.data  # the solver's warm start too: without it the next steps differ slightly
        state |= {name: getattr(data, name).copy() for name in _MUJOCO_FIELDS}
        state["time"] = float(data.time)
    elif getattr(base, "state", None) is not None:  # classic control
        state |= {"state": np.asarray(base.state, dtype=np.float64).copy()}
        state["steps_beyond"] = getattr(base, "steps_beyond_terminated", None)
    else:
        raise UserError(
            f"cannot checkpoint {base.spec.id if base.spec else type(base).__name__}: its state is "
            "neither MuJoCo physics nor a classic-control state vector; give its adapter get_state"
        )
    return state


def _restore_instance(env: Any, state: dict[str, Any]) -> None:
    base = env.unwrapped
    base.np_random.bit_generator.state = json.loads(state["rng"])
    limit = _time_limit(env)
    if limit is not None and state["elapsed"] >= 0:
        limit._elapsed_steps = state["elapsed"]
    if "qpos" in state:
        base.set_state(np.asarray(state["qpos"]), np.asarray(state["qvel"]))
        for name in _MUJOCO_FIELDS:
            getattr(base.data, name)[:] = state[name]
        base.data.time = state["time"]
    else:
        saved = np.asarray(state["state"])
        base.state = saved.copy() if isinstance(base.state, np.ndarray) else tuple(saved.tolist())
        if hasattr(base, "steps_beyond_terminated"):
            base.steps_beyond_terminated = state["steps_beyond"]
