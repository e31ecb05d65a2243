"""What every rank of `rlinf-hpc run` executes: start-up, then coordinator or service loop.

Start-up order (each step collective over the world): control plane, rank 0 reads the config
and broadcasts it (workers never parse files), every rank describes itself to rank 0, then rank
0 places the components and runs the flow while the workers serve commands.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlinf_hpc.channel import attach_channels, resolve_policy
from rlinf_hpc.cluster import JobEnvironment, build_topology, detect_environment, local_rank_info
from rlinf_hpc.cluster.allocation import read_allocation
from rlinf_hpc.comm import CommOptions, ControlPlane, DataPlane, library_version
from rlinf_hpc.comm.mpi import TRANSPORT_DEFAULTS
from rlinf_hpc.config import Config, config_from_dict, config_to_toml, load_config
from rlinf_hpc.config.apps import app_of
from rlinf_hpc.errors import (
    CheckpointStop,
    CommTimeoutError,
    JobInterrupted,
    UserError,
    WorkerError,
    WorkerInterrupted,
)
from rlinf_hpc.log import get_logger, setup_logging
from rlinf_hpc.runners.watching import DeathWatch, memory_hook, start_watchdog
from rlinf_hpc.runtime import disk, nccl
from rlinf_hpc.runtime.accounting import claim_culprit, claim_end, culprit_record
from rlinf_hpc.runtime.checkpoint.manager import CheckpointManager
from rlinf_hpc.runtime.checkpoint.state import seed_process
from rlinf_hpc.runtime.console import print_table
from rlinf_hpc.runtime.events import EventLog
from rlinf_hpc.runtime.heartbeat import HEARTBEATS, Heartbeat, read_heartbeat
from rlinf_hpc.runtime.rundir import RunDirectory, default_run_dir
from rlinf_hpc.runtime.signals import defer_sigterm, ignore_interrupts, install_signal_handlers
from rlinf_hpc.runtime.stragglers import StragglerDetector, make_straggler_hook
from rlinf_hpc.runtime.timeline import Timeline, write_spans
from rlinf_hpc.scheduler import Coordinator, placement_rows
from rlinf_hpc.workers import WorkerService, resolve_worker_class

log = get_logger("job")


@dataclass(frozen=True)
class JobRequest:
    """What the user asked for on the command line."""

    config_path: str
    overrides: tuple[str, ...] = ()
    run_dir: str | None = None
    requested_ranks: int | None = None
    #: ``auto`` (resume from the newest complete checkpoint if there is one), ``never``, or a path.
    resume: str = "auto"
    #: Resume even though (changeable) config keys differ from the checkpoint's.
    force_resume: bool = False


def _load_on_coordinator(
    control: ControlPlane, request: JobRequest, job_id: str | None
) -> tuple[Config, RunDirectory | None, Path]:
    """Rank 0 parses the config, checks and takes the run directory, and broadcasts the config
    (or the error) to every rank: a bad input stops the job before any rank works."""
    payload: dict[str, Any]
    run_dir: RunDirectory | None = None
    if control.rank == 0:
        try:
            config = load_config(request.config_path, request.overrides)
            path = Path(request.run_dir) if request.run_dir else default_run_dir(config.job.name)
            run_dir = RunDirectory(path)
            run_dir.open(job_id)
            payload = {"config": config.model_dump(mode="json"), "run_dir": str(path)}
        except UserError as exc:
            payload = {"error": str(exc)}
        except Exception as exc:  # a bug: say it to every rank (they wait in the broadcast), then raise
            control.broadcast_from_coordinator(
                {"error": f"rank 0 failed at start: {type(exc).__name__}: {exc}"}
            )
            raise
    else:
        payload = {}
    payload = control.broadcast_from_coordinator(payload)
    if "error" in payload:
        raise UserError(payload["error"])
    return config_from_dict(payload["config"], "rank 0's config"), run_dir, Path(payload["run_dir"])


@dataclass(frozen=True)
class JobEnd:
    """How `run_job` ended on this rank: its exit code, and the run directory every rank
    agreed on (None if the job failed before rank 0 chose it)."""

    code: int
    run_dir: Path | None


def run_job(request: JobRequest) -> JobEnd:
    """The body of `rlinf-hpc run` on one rank."""
    where: list[Path] = []
    code = _run_job(request, where)
    return JobEnd(code, where[0] if where else None)


def _run_job(request: JobRequest, where: list[Path]) -> int:
    environment = detect_environment()
    setup_logging(environment.rank if environment.rank is not None else "?", "init")
    install_signal_handlers()
    control = ControlPlane()
    # Before the MPI rank replaces the launcher's rank in the log prefix: if the tasks did not
    # join one MPI world, every task is MPI rank 0 and only launcher rank 0 should speak.
    environment.check_against_mpi(control.rank, control.size)
    setup_logging(control.rank, "coord" if control.rank == 0 else "worker")
    config, run_dir, run_path = _load_on_coordinator(control, request, environment.slurm_job_id)
    where.append(run_path)
    nccl.configure(run_path)  # before any process group: NCCL's failures land in the run dir
    setup_logging(control.rank, "coord" if control.rank == 0 else "worker", config.job.log_level)
    if config.checkpoint.enabled:  # a first SIGTERM saves the next step boundary, if it comes soon
        defer_sigterm(config.checkpoint.sigterm_save_s, coordinator=control.rank == 0)
    seed_process(config.job.seed, control.rank)
    infos = control.gather_to_coordinator(local_rank_info(control.rank, environment))
    comm = DataPlane(options=CommOptions(verify=config.comm.verify))  # collective: every rank, same order
    attach_channels(comm)  # channels follow every placement change from the first one on
    watch = config.watchdog
    heartbeat = (
        Heartbeat(run_path, control.rank, watch.heartbeat_s, watch.hang_timeout_s) if watch.enabled else None
    )
    try:
        if control.rank != 0:
            return WorkerService(control, comm, config, heartbeat).serve()
        assert infos is not None and run_dir is not None
        if heartbeat is not None:
            heartbeat.doing("coordinating")
        try:
            return _coordinate(config, control, comm, infos, environment, request, run_dir)
        finally:
            ignore_interrupts()  # the summary and the lock are written whatever arrives now
            run_dir.close()
    finally:
        ignore_interrupts()
        if heartbeat is not None:
            heartbeat.close()


def _coordinate(
    config: Config,
    control: ControlPlane,
    comm: DataPlane,
    infos: list[Any],
    environment: JobEnvironment,
    request: JobRequest,
    directory: RunDirectory,
) -> int:
    started = time.monotonic()
    run_dir = directory.path
    events = EventLog(run_dir / "events.jsonl", rank=0, run_id=directory.run_id)
    disk.watch().bind(events.write)  # a full run directory: one event, and a stop if it lasts
    slots = build_topology(infos)
    timeline = Timeline(0)
    comm.span_hook = timeline.add
    coordinator = Coordinator(config, control, slots, comm, recorder=events.write)
    coordinator.run_dir = run_dir
    watchdog = start_watchdog(config, control.size, directory, events, started)
    if config.checkpoint.enabled and watchdog is not None:  # srun's SIGTERM after a task died:
        defer_sigterm(config.checkpoint.sigterm_save_s, True, lambda: bool(watchdog.dead()))  # name it now
    coordinator.step_hooks.append(lambda pipeline, result: disk.watch().check())
    if config.watchdog.enabled:
        coordinator.step_hooks.append(memory_hook(config, coordinator, directory.path, events))
        detector = StragglerDetector(config.watchdog.straggler_window, config.watchdog.straggler_ratio)
        coordinator.step_hooks.append(make_straggler_hook(detector, events.write))
    checkpoints = CheckpointManager(
        config,
        run_dir,
        request.resume,
        request.force_resume,
        read_allocation(),  # None outside SLURM
    )
    checkpoints.coordinator = coordinator
    coordinator.checkpoints = checkpoints
    log.info(
        "job '%s': %d ranks on %d node(s), %s; %s",
        config.job.name,
        control.size,
        len({s.hostname for s in slots}),
        environment.describe(),
        library_version(),
    )
    if "MPIR_CVAR_CH4_NETMOD" in TRANSPORT_DEFAULTS:
        log.info(
            "MPI over OFI (MPIR_CVAR_CH4_NETMOD=ofi): under Slurm's pmi2 plugin UCX's start-up "
            "exchange can be cut (README: Running jobs); set MPIR_CVAR_CH4_NETMOD to choose yourself"
        )
    if request.requested_ranks and request.requested_ranks != control.size:
        log.warning("--np %d ignored: the launcher started %d ranks", request.requested_ranks, control.size)
    outcome, culprit = "failed", None
    summary: dict[str, Any] | None = None  # this run's, once it knows how it ended

    def conclude(how: str, who: dict[str, Any]) -> None:
        """Name the culprit before a shutdown that may end in an abort (nothing after it runs)."""
        nonlocal outcome, culprit
        outcome, culprit = how, who
        _conclude(directory, events, started, outcome, culprit)

    try:
        flow = _prepare(config, run_dir)
        checkpoints.open()
        with timeline.span("placement", "phase", "coordinator"):
            placement = coordinator.start()
        events.write("placement", groups=placement.groups)
        if watchdog is not None:  # it names from the heartbeats' pids, on the watchdog's thread
            watchdog.checks.append(DeathWatch(directory, events).check)
        print_table(
            f"placement: {control.size} ranks",
            ["component", "rank", "node", "local rank", "device", "cpus"],
            placement_rows(config, placement, slots),
        )
        with timeline.span("flow", "phase", "coordinator"):
            result = flow(coordinator)
        for name, stats in coordinator.channel_stats().items():  # into events.jsonl
            events.write("channel_stats", channel=name, ranks=stats)
        coordinator.shutdown(0, "flow finished")
        outcome = "ok"
        log.info("job '%s' finished in %.1f s", config.job.name, time.monotonic() - started)
        summary = _summary(outcome, started, result)
        return 0
    except CheckpointStop as exc:
        outcome = "checkpointed"
        coordinator.shutdown(0, f"checkpointed step {exc.step}")
        summary = _summary(outcome, started, {"stopped_after_step": exc.step, "reason": exc.reason})
        return checkpoints.exit_code_after_stop(exc)
    except JobInterrupted as exc:
        name = exc.signal_name
        who = culprit_record(0, "coordinator", "signal", f"received {name}", socket.gethostname())
        return _interrupted(coordinator, watchdog, exc, "rank 0 (coordinator)", lambda: conclude(name, who))
    except disk.DiskFull as exc:
        log.error("job stopped: %s", exc)
        conclude("disk full", culprit_of(exc, run_dir))
        coordinator.shutdown(exc.exit_code, "disk full")
        return exc.exit_code
    except UserError as exc:
        conclude("configuration error", culprit_of(exc, run_dir))
        coordinator.shutdown(2, "configuration error")
        raise
    except WorkerError as exc:
        signalled = coordinator.calls.fatal
        if isinstance(signalled, WorkerInterrupted):  # whatever the flow saw first of its leaving:
            # a signal to that rank (kill -TERM), or the launcher ending the job (srun, after a
            # task died: a dead rank of this node is named instead, by `_interrupted`)
            who = f"rank {signalled.rank} ({signalled.component})"
            named = culprit_of(signalled, run_dir)
            return _interrupted(
                coordinator, watchdog, signalled, who, lambda: conclude(signalled.signal_name, named)
            )
        if not exc.error.startswith("UserError: "):
            _dead_rank_first(watchdog, exc, f"then rank {exc.rank} ({exc.component}) failed")
            conclude("failed", culprit_of(exc, run_dir))
            return _fail(coordinator, exc)
        # a worker refused its input (options, files): a user error, reported as one
        error = UserError(
            f"{exc.error.removeprefix('UserError: ')} (rank {exc.rank}, component '{exc.component}')"
        )
        conclude("configuration error", {**culprit_of(exc, run_dir), "cause": "configuration"})
        coordinator.shutdown(2, "configuration error")
        raise error from None
    except Exception as exc:  # noqa: BLE001 - report once, stop every rank, exit non-zero
        _dead_rank_first(watchdog, exc, f"then the coordinator failed: {type(exc).__name__}")
        conclude("failed", culprit_of(exc, run_dir))
        return _fail(coordinator, exc)
    finally:
        if watchdog is not None:
            watchdog.close()
        checkpoints.close()
        _conclude(directory, events, started, outcome, culprit, summary)
        events.close()
        try:
            write_spans(timeline.drain() + coordinator.worker_spans, run_dir / "timeline.jsonl")
        except OSError as exc:
            if not disk.is_disk_error(exc):
                raise
            log.warning("timeline.jsonl not written: %s (%s)", exc.strerror, disk.describe_free(run_dir))


def _conclude(
    directory: RunDirectory,
    events: EventLog,
    started: float,
    outcome: str,
    culprit: dict[str, Any] | None,
    summary: dict[str, Any] | None = None,
) -> None:
    """Say how the run ended: the culprit claimed (`accounting`: the first named stands —
    the watchdog's or the death watch's when one of them named a rank before), the ``end``
    event once, ``summary.json`` (``summary``: a finished run's; else an interrupted one's)."""
    wall = round(time.monotonic() - started, 3)
    if disk.watch().failing and directory.reserve is not None:  # the last records need room
        directory.reserve.release()
    if culprit is not None:
        _, outcome, culprit = claim_culprit(directory.path, directory.run_id, outcome, culprit)
    elif summary is None and (claim := directory.claimed()) is not None:
        outcome, culprit = claim  # named by a watcher; a signal or failure ended the run after it
    if claim_end(directory.path, directory.run_id, "coordinator"):
        events.write("end", outcome=outcome, wall_seconds=wall, culprit=culprit)
    if summary is None:  # it did not finish: say so, never leave an earlier run's summary
        summary = {"outcome": outcome, "interrupted": True, "wall_seconds": wall, "culprit": culprit}
    directory.write_summary(summary)


def _prepare(config: Config, run_dir: Path) -> Any:
    """Before any worker does anything: keep the resolved config, check every import path."""
    (run_dir / "config.toml").write_text(config_to_toml(config), encoding="utf-8")
    app = app_of(config)
    flow = app.flow_function()
    validate = app.validate_function()  # the app's own input checks (files, models, ...)
    if callable(validate):
        validate(config)
    for component in config.components.values():
        resolve_worker_class(component.worker)
    for channel in config.channels.values():
        resolve_policy(channel.policy)
    return flow


def _fail(coordinator: Coordinator, exc: Exception) -> int:
    """Report a failure once and stop every rank; returns the exit code."""
    if isinstance(exc, (WorkerError, CommTimeoutError)):
        log.error("%s", describe_failure(exc))
    else:  # a bug in the flow or in rlinf_hpc: its traceback is the useful part
        log.error("%s", describe_failure(exc), exc_info=exc)
    # After a timeout one rank is known to hang: do not wait long for it to say goodbye.
    hung = isinstance(exc, CommTimeoutError)
    coordinator.shutdown(1, "job failed", timeout=2.0 if hung else None)
    return 1


#: How long a failure waits for the death of a rank it may have come from to show.
DEATH_GRACE_S = 1.0


def _dead_rank_first(watchdog: Any, exc: BaseException, then: str) -> None:
    """A rank of this node that died explains the failure that followed it: name it instead
    (the watchdog ends the job from here). A killed rank's link fails at once — on the
    coordinator, or on a peer whose call then fails — a moment before its exit is visible
    (under srun and load, longer than MPI's own errors take): every failure waits up to
    `DEATH_GRACE_S` for a death before it is named itself."""
    if watchdog is None:
        return
    deadline = time.monotonic() + DEATH_GRACE_S
    while True:
        watchdog.fail_if_dead(then)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _interrupted(
    coordinator: Coordinator,
    watchdog: Any,
    signal: JobInterrupted | WorkerInterrupted,
    who: str,
    conclude: Callable[[], None],
) -> int:
    """A signal ends the job (``who`` received it): name a rank of this node that died before
    it, else ``conclude`` (name ``who``) and stop every rank; returns the exit code (128 + the
    signal)."""
    ignore_interrupts()  # the launcher's SIGTERM to rank 0 follows a worker's: it adds nothing
    if watchdog is not None:  # srun ends a step whose task died with SIGTERM to the rest:
        watchdog.fail_if_dead(f"then {who} received {signal.signal_name}")  # name it, at once
    conclude()  # before the shutdown: a rank busy in a call makes it end in an abort
    log.warning("%s received %s: stopping every rank", who, signal.signal_name)
    coordinator.shutdown(signal.exit_code, signal.signal_name, timeout=5.0)
    return signal.exit_code


def _summary(outcome: str, started: float, result: Any) -> dict[str, Any]:
    summary = {
        "outcome": outcome,
        "wall_seconds": round(time.monotonic() - started, 3),
        "flow_result": result,
    }
    if isinstance(result, dict) and isinstance(result.get("summary"), dict):
        summary = {**result["summary"], **summary}  # the flow's headline figures on top
    return summary


def culprit_of(exc: BaseException, run_dir: Path) -> dict[str, Any]:
    """Who failed, for the ``end`` event and the summary (the host from the rank's heartbeat)."""
    if isinstance(exc, WorkerError):
        host = (read_heartbeat(run_dir / HEARTBEATS / f"rank-{exc.rank}.json") or {}).get("host")
        if isinstance(exc, WorkerInterrupted):
            return culprit_record(exc.rank, exc.component, "signal", f"received {exc.signal_name}", host)
        return culprit_record(exc.rank, exc.component, "exception", exc.error, host, method=exc.method)
    if isinstance(exc, CommTimeoutError):
        return culprit_record(None, None, "timeout", str(exc))
    if isinstance(exc, UserError):
        return culprit_record(0, "coordinator", "configuration", str(exc), socket.gethostname())
    if isinstance(exc, disk.DiskFull):
        return culprit_record(0, "coordinator", "disk_full", str(exc), socket.gethostname(),
                              path=str(exc.path), free_bytes=exc.free)  # fmt: skip
    error = f"{type(exc).__name__}: {exc}"
    return culprit_record(0, "coordinator", "exception", error, socket.gethostname())


def describe_failure(exc: BaseException) -> str:
    """One message for the console, naming rank, component and error where known."""
    if isinstance(exc, WorkerError):
        text = f"job failed: {exc}"
        if exc.remote_traceback:
            text += f"\n  remote traceback (rank {exc.rank}):\n    "
            text += exc.remote_traceback.rstrip().replace("\n", "\n    ")
        return text
    if isinstance(exc, CommTimeoutError):
        return f"job failed: {exc}"
    return f"job failed on rank 0 (coordinator): {type(exc).__name__}: {exc}"
