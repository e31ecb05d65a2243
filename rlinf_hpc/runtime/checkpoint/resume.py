"""Which checkpoint a run resumes from (``--resume auto|never|PATH``) and whether it fits the
config the run was started with."""

from __future__ import annotations

import time
from pathlib import Path

from rlinf_hpc.config import Config
from rlinf_hpc.config.apps import config_class, resolve_app, runner_of
from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime.checkpoint.store import (
    Checkpoint,
    CheckpointStore,
    config_differences,
    describe_differences,
    open_checkpoint,
)

log = get_logger("checkpoint")


def find_resume_target(store: CheckpointStore, mode: str) -> Checkpoint | None:
    """The checkpoint ``--resume MODE`` asks for (None: start afresh); `UserError` for a
    PATH that is not a usable checkpoint."""
    if mode == "never":
        if store.has_any():
            aside = store.root / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir()
            for path in [*store.committed(), *store.root.glob("step-*.tmp")]:
                path.rename(aside / path.name)
            log.warning("--resume never: earlier checkpoints moved to %s", aside)
        return None
    if mode == "auto":
        found = store.newest_complete()
        if found is None and store.has_any():
            log.warning("no complete checkpoint in %s: starting from the beginning", store.root)
        return found
    path = Path(mode).expanduser()
    if path.name.startswith("step-") and path.name.endswith(".tmp"):
        newest = CheckpointStore(path.parent).newest_complete() if path.parent.is_dir() else None
        raise UserError(
            f"--resume {mode} is a save that did not finish (a step-N.tmp folder has no manifest, "
            "and its files may be partial): resume from a complete checkpoint instead — "
            + (f"the newest in {path.parent} is {newest.path}" if newest else f"{path.parent} holds none")
            + " (or `--resume auto`)."
        )
    try:
        if (path / "manifest.json").is_file() or path.name.startswith("step-"):
            return open_checkpoint(path)
        if path.is_dir():
            found = CheckpointStore(path).newest_complete()
            if found is not None:
                return found
            raise ValueError("it holds no complete checkpoint (step-N/ with a manifest.json)")
        raise ValueError("it does not exist")
    except ValueError as exc:
        raise UserError(
            f"--resume {mode} is not a usable checkpoint: {exc}. Give a step-N directory "
            "written by rlinf-hpc (or a directory of them), `auto` or `never`."
        ) from None


def with_current_defaults(saved: dict) -> dict:
    """A saved config with the keys this version added since filled in at their defaults, so
    that upgrading rlinf_hpc between a save and its resume is no config change (the saved
    dict as it is if this version's schema refuses it)."""
    try:
        schema = config_class(resolve_app(runner_of(saved)))
        return schema.model_validate(saved).model_dump(mode="json")
    except (ValueError, UserError):  # pydantic's ValidationError is a ValueError
        return saved


def check_fits(checkpoint: Checkpoint, config: Config, force: bool) -> None:
    """`UserError` listing the keys if ``checkpoint`` was written with another config (changeable
    keys pass with ``force``; model, task and flow keys never)."""
    saved = with_current_defaults(checkpoint.manifest["config"])
    current = config.model_dump(mode="json")
    changed, fixed = config_differences(saved, current)
    if fixed:
        raise UserError(
            f"checkpoint {checkpoint.path} was written by a job whose {', '.join(fixed)} differ "
            f"({describe_differences(saved, current, fixed)}); its state cannot be loaded into "
            "this one. Start a new run directory, or resume with the original settings."
        )
    if changed and not force:
        raise UserError(
            f"checkpoint {checkpoint.path} was written with a different config: "
            f"{describe_differences(saved, current, changed)}. Resume with the same config, add "
            "--force-resume to accept the changes, or --resume never to start afresh."
        )
    if changed:
        log.warning("resuming with changed config keys (--force-resume): %s", ", ".join(changed))
