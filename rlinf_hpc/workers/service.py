"""The worker service loop: execute the coordinator's commands until told to stop.

Idle ranks sleep between probes (see `rlinf_hpc.comm.waiting`), so a waiting job costs almost
no CPU. A worker method's exception goes back to the coordinator with its traceback; the loop
itself survives it. SIGINT/SIGTERM or an internal error make the rank say `Bye` and leave.
"""

from __future__ import annotations

import traceback
from typing import Any

from rlinf_hpc.comm import Backoff, ControlPlane, DataPlane, create_group_comm
from rlinf_hpc.config import Config
from rlinf_hpc.errors import JobInterrupted, UserError
from rlinf_hpc.imports import import_subclass
from rlinf_hpc.log import get_logger, set_role
from rlinf_hpc.runtime.gpu_health import open_guard
from rlinf_hpc.runtime.timeline import Timeline
from rlinf_hpc.scheduler.protocol import Bye, Call, Join, Leave, Reply, Request, SetDirectory, Shutdown
from rlinf_hpc.workers.base import Worker
from rlinf_hpc.workers.timeshare import DeviceTimeShare

log = get_logger("service")

#: How long a worker waits for the coordinator to answer a request (it answers inside its waits).
_REQUEST_TIMEOUT_S = 600.0


#: Built-in methods that run without switching their component in (checkpoint saves), and
#: whether they read the component's state (then a switched-out one is read off its host copy).
_IN_PLACE_METHODS = {"checkpoint_save": True, "checkpoint_poll": False, "free_memory": False}


def resolve_worker_class(path: str) -> type[Worker]:
    """Import ``package.module:ClassName`` and check it is a `Worker` subclass."""
    return import_subclass(path, Worker, "worker", " Fix the component's `worker` key.")


def _user_traceback(exc: BaseException) -> str:
    """The traceback without this module's own frames (they are the same for every call)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


class WorkerService:
    """The components hosted by one worker rank, and the command loop that drives them."""

    def __init__(
        self, control: ControlPlane, comm: DataPlane, config: Config | None = None, heartbeat: Any = None
    ) -> None:
        self.heartbeat = heartbeat  # `Heartbeat`: what this rank is doing, for the watchdog
        self.config = config
        self.control = control
        self.comm = comm
        self.rank = control.rank
        self.workers: dict[str, Worker] = {}
        self.timeline = Timeline(self.rank)
        self.timeshare = DeviceTimeShare(self.timeline)
        self._switch_settings: dict[str, tuple[str, str]] = {}
        comm.span_hook = self.timeline.add

    def _roles(self) -> str:
        return "+".join(self.workers) or "idle"

    def _join(self, command: Join) -> Any:
        group = create_group_comm(command.component, list(command.world_ranks), command.tag)
        worker = self.workers.get(command.component)
        if worker is not None:  # re-partition: keep state, swap communicator
            worker.group.free()
            worker.group = group
            # what its elastic controllers measured (per-item costs by size) was measured
            # beside other components and ranks: on the new placement it is learnt again
            # (kept, a split started at its smallest micro-batches compared them with sizes
            # the collocated warm-up measured while sharing the cores, and never grew)
            worker.elastic_knowledge.clear()
            worker.on_regroup()
            return None
        try:
            worker = resolve_worker_class(command.worker_path)()
            worker._bind(
                command.component, self.rank, command.device, command.seed, group, self.comm, self._request
            )
            worker.job_config = self.config
            worker.setup(**command.options)
        except BaseException:
            group.free()
            raise
        self.workers[command.component] = worker
        self._switch_settings[command.component] = (command.switch, command.offload)
        set_role(self._roles())
        self._watch_gpu(command.device)
        return None

    def _watch_gpu(self, device: str) -> None:
        """The first component on a GPU starts this rank's GPU health checks (`runtime.gpu_health`)."""
        watch = self.config.watchdog if self.config is not None else None
        if self.heartbeat is None or watch is None or not watch.gpu_health or self.heartbeat.gpu is not None:
            return
        guard = open_guard(device, watch.gpu_temp_c, watch.gpu_poll_s)
        if guard is not None:
            self.heartbeat.watch_gpu(guard)

    def _pause_while_hot(self) -> None:
        """With ``gpu_temp_action = "pause"``, start no call while this rank's GPU is too hot."""
        guard = self.heartbeat.gpu if self.heartbeat is not None else None
        if guard is None or self.config is None or self.config.watchdog.gpu_temp_action != "pause":
            return
        watch = self.config.watchdog
        if not guard.wait_until_cool(watch.gpu_pause_max_s, self.heartbeat.doing):
            limit = watch.gpu_pause_max_s
            guard.note("still_hot", f"GPU {guard.index} still too hot after a {limit:.0f} s pause")

    def _leave(self, command: Leave) -> Any:
        self.timeshare.forget(command.component)  # its state comes back before teardown
        worker = self.workers.pop(command.component)
        self._switch_settings.pop(command.component, None)
        set_role(self._roles())
        try:
            worker.teardown()
        finally:
            worker.group.free()
        return None

    def _request(self, kind: str, payload: dict[str, Any]) -> Any:
        """Ask the coordinator for a job-wide change from inside a method; UserError if refused."""
        answer = self.control.request(
            Request(self.rank, kind, payload),
            timeout=_REQUEST_TIMEOUT_S,
            describe=f"answer its {kind} request",
        )
        if not answer.ok:
            raise UserError(answer.error)
        return answer.value

    def _set_directory(self, command: SetDirectory) -> Any:
        self.comm.set_directory(command.directory)
        return None

    def _call(self, command: Call) -> Any:
        worker = self.workers.get(command.component)
        if worker is None:
            raise RuntimeError(f"rank {self.rank} hosts no component '{command.component}'")
        method = getattr(worker, command.method, None)
        if method is None or not callable(method):
            raise AttributeError(
                f"{type(worker).__name__} (component '{command.component}') has no method '{command.method}'"
            )
        if command.method in _IN_PLACE_METHODS:
            if not _IN_PLACE_METHODS[command.method]:
                return method(*command.args, **command.kwargs)
            with self.timeshare.host_view(command.component):
                return method(*command.args, **command.kwargs)
        mode, offload = self._switch_settings.get(command.component, ("off", "none"))
        worker.last_switch_s = self.timeshare.activate(command.component, self.workers, mode, offload)
        return method(*command.args, **command.kwargs)

    def _execute(self, command: Call | Join | Leave | SetDirectory) -> Reply:
        handler = {Call: self._call, Join: self._join, Leave: self._leave, SetDirectory: self._set_directory}[
            type(command)
        ]
        name = command.method if isinstance(command, Call) else type(command).__name__.lower()
        lane = command.component if command.component != "-" else "service"
        if isinstance(command, Call):
            self._pause_while_hot()
        if self.heartbeat is not None:
            self.heartbeat.doing(f"{lane}.{name}", self._roles())
        try:
            with self.timeline.span(
                f"{lane}.{name}", "call" if isinstance(command, Call) else "control", lane
            ):
                value = handler(command)  # type: ignore[operator]
            if self.heartbeat is not None:
                self.heartbeat.doing(None, self._roles())
            return Reply(command.call_id, self.rank, command.component, True, value)
        except JobInterrupted:
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to rank 0
            return Reply(
                command.call_id,
                self.rank,
                command.component,
                False,
                error=f"{type(exc).__name__}: {exc}",
                traceback=_user_traceback(exc),
            )

    def _teardown_all(self) -> None:
        for name in list(self.workers):
            try:
                self._leave(Leave(0, name))
            except Exception:  # noqa: BLE001 - best effort on the way out
                log.exception("teardown of '%s' failed", name)

    def serve(self) -> int:
        """Run until `Shutdown` (returns 0), a signal (128 + signal) or an internal error (1)."""
        backoff = Backoff()
        try:
            while True:
                command = self._next_command(backoff)
                if isinstance(command, Shutdown):
                    self._teardown_all()
                    self._say_bye("shutdown")
                    return 0  # the coordinator carries the job's exit status (see Shutdown)
                self.control.send_reply(self._execute(command))
                self.comm.progress()  # small async sends a method left behind leave now
        except JobInterrupted as exc:
            log.info("received %s: leaving the job", exc.signal_name)
            self._say_bye(exc.signal_name)
            return exc.exit_code
        except Exception as exc:  # noqa: BLE001 - an internal error: tell rank 0, then leave
            log.exception("worker service loop failed")
            self._say_bye("internal error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
            return 1

    def _next_command(self, backoff: Backoff) -> Any:
        """Wait for a command, sleeping between probes; keeps the data plane's sends moving."""
        while True:
            command = self.control.try_receive_command()
            if command is not None:
                backoff.reset()
                return command
            self.comm.progress()
            backoff.sleep()

    def _say_bye(self, reason: str, error: str = "", trace: str = "") -> None:
        self.control.send_reply(Bye(self.rank, reason, error, trace, self.timeline.drain()))
        try:
            self.control.flush(timeout=5.0, describe="sending Bye to the coordinator")
        except Exception:  # noqa: BLE001 - the coordinator may be gone already
            log.warning("could not deliver Bye to the coordinator")
