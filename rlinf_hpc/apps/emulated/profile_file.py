"""Cost profiles of one's own: a TOML file instead of a built-in name (`profiles.PROFILES`).

``emulation.profile`` (and ``tools/bench_scale.py --profile``) takes a built-in name or the path
of a ``.toml`` file. The file holds `profiles.Profile`'s fields at its top level and one
``[stages.NAME]`` table per stage with `profiles.StageCost`'s fields (the stages in the order
the RL step runs them; the job's components must be exactly these). ``base = "grpo-7b"``
starts from a built-in profile: top-level fields replace the base's, a stage table changes the
fields it names of the base's stage (or adds a stage, at the end). For example, the 7B step with
a tail three times as long and a slower interconnect::

    name = "grpo-7b-longtail"
    base = "grpo-7b"
    long = [1500, 6000]
    long_fraction = 0.03
    bandwidth_gbps = 12.5

    [stages.actor]
    seconds_per_token = 8e-4

The stages that train are the trailing ones with an optimizer step (a ``finish_s`` or
``finish_per_sample``; a critic after the actor, say), else the last; ``trainers = ["actor",
"critic"]`` names them. The first of them sends its weights to ``sync_to`` (default: the stages
before the trainers that run on a device); off-policy they are the training pipeline.

Everything is checked when the config is read (unknown keys with the nearest valid one, types,
ranges, ``sync_to`` naming stages), so a mistake stops the job before any rank starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from pathlib import Path
from typing import Any

import tomllib

from rlinf_hpc.apps.emulated.profiles import PROFILES, Profile, StageCost

_KINDS = ("generate", "per_token", "per_sample")
_NON_NEGATIVE = {
    "seconds_per_token", "seconds_per_sample", "seconds_per_call", "finish_s", "finish_per_sample",
    "state_gb", "gb_per_sample", "weights_gb", "switch_light_s", "switch_full_s",
}  # fmt: skip
_POSITIVE = {"decode_step_s", "bandwidth_gbps", "device_gb"}


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


def get_profile(spec: str) -> Profile:
    """The built-in profile ``spec`` names, or the profile in the TOML file at path ``spec``."""
    if spec in PROFILES:
        return PROFILES[spec]
    if not spec.endswith(".toml"):
        near = difflib.get_close_matches(spec, list(PROFILES), n=1, cutoff=0.5)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise ProfileError(
            f"'{spec}' is not a profile{hint}: use a built-in one ({', '.join(PROFILES)}) or the "
            "path of a .toml profile file of your own (see rlinf_hpc/apps/emulated/profile_file.py)"
        )
    path = Path(spec).expanduser().resolve()
    return _load(str(path), path.stat().st_mtime_ns if path.is_file() else 0)


@functools.lru_cache(maxsize=16)
def _load(path: str, _mtime: int) -> Profile:
    return load_profile(Path(path))


def load_profile(path: Path) -> Profile:
    """The profile in ``path`` (see the module docstring); `ProfileError` says what is wrong."""
    where = f"emulation profile {path}"
    if not path.is_file():
        raise ProfileError(
            f"{where}: no such file (give an absolute path, or one relative to the directory you launch from)"
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{where}: not valid TOML ({exc})") from None
    base_name = data.pop("base", None)
    if base_name is not None and base_name not in PROFILES:
        raise ProfileError(f"{where}: base = '{base_name}' is not a built-in profile ({', '.join(PROFILES)})")
    base = PROFILES[base_name] if base_name else None
    fields = {f.name: f for f in dataclasses.fields(Profile)}
    stage_fields = {f.name: f for f in dataclasses.fields(StageCost)}
    _unknown(where, data, set(fields) - {"notes"} | {"base"}, "")
    stages: dict[str, StageCost] = dict(base.stages) if base else {}
    tables = data.pop("stages", {})
    if not isinstance(tables, dict):
        raise ProfileError(f"{where}: 'stages' must be tables, [stages.NAME] for each stage")
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ProfileError(f"{where}: stages.{name} must be a table ([stages.{name}])")
        _unknown(where, table, set(stage_fields), f"stages.{name}.")
        if name not in stages and "kind" not in table:
            raise ProfileError(f"{where}: stages.{name} needs a kind ({', '.join(_KINDS)})")
        values = {k: _checked(where, f"stages.{name}.{k}", stage_fields[k], v) for k, v in table.items()}
        stages[name] = dataclasses.replace(stages[name], **values) if name in stages else StageCost(**values)
    if not stages:
        raise ProfileError(f"{where}: no stages; add a [stages.NAME] table per stage (or base = a built-in)")
    values = {k: _checked(where, k, fields[k], v) for k, v in data.items()}
    values["stages"] = stages
    if base is None:
        values.setdefault("name", path.stem)
        values.setdefault("description", f"custom profile ({path.name}; emulated)")
        if "samples_per_step" not in values:
            raise ProfileError(f"{where}: samples_per_step is required (responses or transitions per step)")
        # the policy trainer sends its weights to the stages before the trainers on a device
        profile = Profile(**values)
        if "sync_to" not in values:
            before = profile.generation_stages
            profile = dataclasses.replace(profile, sync_to=tuple(n for n in before if stages[n].on_device))
    else:
        values.setdefault("name", path.stem)
        values.setdefault("description", f"{base.description}, changed by {path.name}")
        profile = dataclasses.replace(base, **values)
    _consistent(where, profile)
    return profile


def _unknown(where: str, table: dict[str, Any], valid: set[str], prefix: str) -> None:
    for key in table:
        if key not in valid and not (prefix == "" and key == "stages"):
            near = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.5)
            hint = f" (did you mean '{prefix}{near[0]}'?)" if near else ""
            valid_keys = ", ".join(sorted(valid))
            raise ProfileError(f"{where}: unknown key '{prefix}{key}'{hint}; valid: {valid_keys}")


def _checked(where: str, key: str, field: dataclasses.Field[Any], value: Any) -> Any:
    """``value`` converted to the field's type, or a `ProfileError` naming ``key``."""
    name, kind = field.name, str(field.type)
    try:
        if kind in ("str", "'str'"):
            if not isinstance(value, str):
                raise TypeError("a string")
            if name == "kind" and value not in _KINDS:
                raise TypeError(f"one of {', '.join(_KINDS)}")
            return value
        if kind == "bool":
            if not isinstance(value, bool):
                raise TypeError("true or false")
            return value
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TypeError("a whole number >= 1")
            return value
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError("a number")
            value = float(value)
            if name in _POSITIVE and value <= 0:
                raise TypeError("a number > 0")
            if name in _NON_NEGATIVE and value < 0:
                raise TypeError("a number >= 0")
            if name in ("alpha", "long_fraction") and not 0 <= value <= 1:
                raise TypeError("a number from 0 to 1")
            return value
        if kind.startswith("tuple[int, int]"):
            if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)):
                raise TypeError("two whole numbers [low, high]")
            if not 1 <= value[0] <= value[1]:
                raise TypeError("[low, high] with 1 <= low <= high")
            return (value[0], value[1])
        if kind.startswith("tuple[str"):
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise TypeError("a list of stage names")
            return tuple(value)
    except TypeError as exc:
        raise ProfileError(f"{where}: {key} must be {exc}, got {value!r}") from None
    raise ProfileError(f"{where}: {key} cannot be set in a profile file")


def _consistent(where: str, profile: Profile) -> None:
    names = list(profile.stages)
    for name in profile.trainers:
        if name not in profile.stages:
            raise ProfileError(f"{where}: trainers names '{name}', which is not a stage ({', '.join(names)})")
    if profile.trainers and (
        len(profile.trainers) >= len(names) or list(profile.trainers) != names[-len(profile.trainers) :]
    ):
        raise ProfileError(
            f"{where}: trainers = {list(profile.trainers)} must be the step's last stages, in order, "
            f"with at least one stage before them (the stages are {names})"
        )
    for name in profile.sync_to:
        if name not in profile.stages:
            raise ProfileError(
                f"{where}: sync_to names '{name}', which is not a stage ({', '.join(profile.stages)})"
            )
    for name, cost in profile.stages.items():
        if cost.on_device and cost.state_gb >= profile.device_gb:
            raise ProfileError(
                f"{where}: stages.{name}.state_gb ({cost.state_gb:g}) does not fit the device "
                f"(device_gb = {profile.device_gb:g}): lower it or raise device_gb"
            )
