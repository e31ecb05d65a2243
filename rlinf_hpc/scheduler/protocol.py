"""Messages between the coordinator and the worker service loops (pickled on the control plane).

Commands flow coordinator -> worker; every command but `Shutdown` gets exactly one `Reply`.
Errors travel as text (type, message, traceback) so that any exception can cross ranks even
when its class cannot be unpickled on the coordinator.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Call:
    """Run ``component``'s ``method(*args, **kwargs)`` on the receiving rank."""

    call_id: int
    component: str
    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Join:
    """Become (or stay) a member of ``component`` whose ranks are now ``world_ranks``.

    A rank that already hosts the component keeps its worker object and only swaps its
    group communicator; a new member builds the worker and calls its ``setup``.
    """

    call_id: int
    component: str
    worker_path: str
    world_ranks: tuple[int, ...]
    tag: int
    options: dict[str, Any]
    device: str
    seed: int
    switch: str = "full"
    offload: str = "none"


@dataclass(frozen=True)
class SetDirectory:
    """The placement changed: here is the data plane's new directory."""

    call_id: int
    directory: Any
    component: str = "-"


@dataclass(frozen=True)
class Leave:
    """Stop hosting ``component``: call the worker's ``teardown`` and free its communicator."""

    call_id: int
    component: str


@dataclass(frozen=True)
class Shutdown:
    """Leave the service loop and exit. Acknowledged with a `Bye`.

    Workers then exit with status 0 and the coordinator carries the job's status: a worker
    leaving with a non-zero status makes mpiexec (Hydra) kill the remaining ranks at once,
    including a coordinator still waiting for the others to acknowledge.
    """

    reason: str


@dataclass(frozen=True)
class Reply:
    """The outcome of one command on one rank."""

    call_id: int
    rank: int
    component: str
    ok: bool
    value: Any = None
    error: str = ""
    traceback: str = ""


@dataclass(frozen=True)
class Bye:
    """A worker leaves the job (after `Shutdown`, on a signal, or on an internal error)."""

    rank: int
    reason: str
    error: str = ""
    traceback: str = ""
    #: The rank's timeline spans (see `rlinf_hpc.runtime.timeline`).
    spans: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Request:
    """Worker -> coordinator, from inside a method: ask the coordinator to do something for the
    whole job (``kind``: ``create_channel``). Answered with an `Answer` on its own tag."""

    rank: int
    kind: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class Answer:
    """Coordinator -> worker: the outcome of a `Request`."""

    ok: bool
    value: Any = None
    error: str = ""


@dataclass(frozen=True)
class StageSpec:
    """What one stage does on every rank of its component (sent by `Pipeline`)."""

    method: str
    source: str
    sink: str | None = None
    #: Worker method called once after the input ended; its value is returned.
    finish: str | None = None
    micro_batch: int = 32
    min_micro_batch: int = 8
    max_micro_batch: int = 256
    elastic: bool = True
    wait_threshold_s: float = 0.05
    memory_threshold: float = 0.85
    #: Item weight for the output channel: a key of dict outputs holding a number or a
    #: sequence (its length), or None for weight 1.
    weight_key: str | None = None
    #: Whether the next stage runs on other ranks at the same time (its waiting on this one is
    #: latency worth shrinking for); False when it shares ranks and can only start after this.
    downstream_apart: bool = True
    #: Run ``method(feed)`` once per step, admitting items as it has room (an engine with its
    #: own continuous batching; `rlinf_hpc.workers.continuous`), instead of per micro-batch.
    continuous: bool = False
    #: An elastic stage's first micro-batch size this step, instead of the one its ranks
    #: carried from the step before (`Pipeline.first_sizes`: ``auto`` just moved the ranks, and
    #: sizes learnt on the old placement say nothing of the new one).
    first_size: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
