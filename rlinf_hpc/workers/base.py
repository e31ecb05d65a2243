"""`Worker`: the base class of every component's per-rank object.

The service loop builds one instance per (rank, component), binds its place in the job, and
then calls ``setup(**options)`` with the component's ``options`` table. After that the
coordinator calls its public methods by name. A minimal worker::

    class Doubler(Worker):
        def setup(self, factor: int = 2) -> None:
            self.factor = factor

        def apply(self, x: int) -> int:
            return self.factor * x
"""

from __future__ import annotations

import logging
import os
import random
import socket
from collections.abc import Callable
from typing import Any

from rlinf_hpc.channel import Channel, channel_for
from rlinf_hpc.comm import DataPlane, GroupComm, live_group_comms
from rlinf_hpc.config import Config
from rlinf_hpc.log import get_logger
from rlinf_hpc.workers.memory import SampleMemory, device_memory_fraction
from rlinf_hpc.workers.stage import StageSpec, run_stage

#: The largest state `Worker.keep_state` copies for ranks that join (`adopt_state`).
ADOPT_LIMIT_BYTES = 1 << 30  # pickled whole through MPI: below its 2 GiB message counts


class Worker:
    """Base class for component workers. Subclass it and add public methods."""

    component: str
    rank: int
    device: str
    seed: int
    #: MPI communicator of this worker's component group (for group-internal collectives).
    group: GroupComm
    #: The rank's data plane: send/recv/collectives to any worker by (component, rank).
    comm: DataPlane
    log: logging.Logger
    #: Seconds the context switch before the current command took (0.0 when none ran).
    last_switch_s: float = 0.0
    #: The whole job's configuration (typed sections such as ``[grpo]``); None in bare tests.
    job_config: Config | None = None
    #: Whether `state_dict` is the same on every rank of the group (data parallelism): then
    #: only group rank 0 writes it, and a resume with any number of ranks loads it.
    replicated_state: bool = True

    def _bind(
        self,
        component: str,
        rank: int,
        device: str,
        seed: int,
        group: GroupComm,
        comm: DataPlane,
        request: Callable[[str, dict[str, Any]], Any],
    ) -> None:
        self._request = request
        #: Elastic micro-batch size per stage method, carried from one pipeline step to the next.
        self.stage_sizes: dict[str, int] = {}
        #: What each stage's elastic controller learnt (per-size costs, floor, ceiling, trial).
        self.elastic_knowledge: dict[tuple[Any, ...], dict[str, Any]] = {}
        #: Device memory per sample of this rank's micro-batches (CUDA ranks; `memory_profile`).
        self.sample_memory = SampleMemory(device)
        self.comm = comm
        self.component = component
        self.rank = rank
        self.device = device
        self.seed = seed
        self.group = group
        self.log = get_logger(f"worker.{component}")

    @property
    def group_rank(self) -> int:
        """This rank's index in its component group (0 .. group_size-1)."""
        return self.group.rank

    @property
    def group_size(self) -> int:
        """Number of ranks in this worker's component group."""
        return self.group.size

    def rank_seed(self) -> int:
        """A seed distinct per world rank and stable across runs of the same config."""
        return random.Random(f"{self.seed}:{self.rank}").getrandbits(31)

    def create_channel(
        self, name: str, producers: list[str] | str, consumers: list[str] | str, **options: Any
    ) -> Channel:
        """Declare a channel from inside a method (validated like ``[channels.NAME]``).

        The coordinator publishes it to every rank; this rank can use it at once, the others
        from their next command on. Raises `UserError` for a bad declaration.
        """
        spec = {"name": name, "producers": producers, "consumers": consumers, **options}
        directory = self._request("create_channel", spec)
        self.comm.set_directory(directory)
        return self.channel(name)

    def channel(self, name: str) -> Channel:
        """This rank's handle on the channel ``name`` declared under ``[channels.NAME]``."""
        return channel_for(self.comm, name)

    # -- hooks -------------------------------------------------------------------------------
    def setup(self, **options: Any) -> None:
        """Called once after the worker joins its group, with the component's ``options``."""
        if options:
            raise TypeError(
                f"{type(self).__name__} takes no options, but the config gives "
                f"{sorted(options)}; define setup(self, ...) to accept them"
            )

    def switch_state(self) -> Any:
        """What a full context switch moves off the device while another component runs on
        this rank: an ``nn.Module``, or ``(module, optimizer)``; None (default) for nothing."""
        return None

    def switch_out(self) -> int | None:
        """A full switch done by the worker itself, for state `switch_state` cannot hand over
        (an inference engine's own sleep mode, an emulated device): move it off the device and
        return the bytes moved. None (default): nothing of its own to move."""
        return None

    def switch_in(self) -> None:
        """Bring back what `switch_out` moved, before this component runs again."""

    def release_caches(self) -> None:
        """Free transient buffers and caches (a light switch); weights stay."""

    def free_memory(self) -> dict[str, float]:
        """Built-in: collect garbage and return cached CUDA blocks (the memory-leak monitor's
        ``free`` action); runs without a time-share switch. Returns the memory in use after."""
        import gc

        from rlinf_hpc.imports import loaded
        from rlinf_hpc.runtime.heartbeat import memory_in_use

        gc.collect()
        torch = loaded("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return memory_in_use()

    def memory_fraction(self) -> float:
        """Fraction of this rank's device memory in use (host memory on CPU ranks); the
        elastic micro-batch grows above ``pipeline.memory_threshold``. Override to report
        what matters to the component (e.g. KV-cache fill)."""
        return device_memory_fraction(self.device)

    def memory_profile(self) -> dict[str, float] | None:
        """What the pipeline bounds this stage's largest micro-batch by
        (`rlinf_hpc.scheduler.elastic.micro_batch_bound`): ``device_bytes``, ``state_bytes``
        (resident model state) and ``bytes_per_sample``. The
        default measures it on CUDA ranks during the stage's micro-batches (peak allocation
        over the samples); None on CPU ranks (no device memory to bound)."""
        meter = getattr(self, "sample_memory", None)  # None before the worker is bound
        return meter.profile() if meter is not None else None

    def on_regroup(self) -> None:
        """Called after a re-partition changed this worker's group (``self.group`` is new)."""

    def teardown(self) -> None:
        """Called when the worker leaves its group or the job ends."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of this worker (tensors, numpy arrays, JSON scalars in dicts,
        lists, tuples — never arbitrary objects); None (default) for nothing. Called at a step
        boundary, while the component may be switched out (its tensors are then host copies).
        State a flow re-derives on resume (e.g. a rollout's weights, synced from the actor)
        need not be saved. RNG states and elastic micro-batch sizes are saved for every rank
        by the runtime."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what `state_dict` returned (tensors arrive on the CPU)."""
        raise NotImplementedError(f"{type(self).__name__} saves state but has no load_state_dict()")

    #: Whether `sharded_state` can be loaded by a group of another size (torch.distributed.
    #: checkpoint re-shards it): a resume onto another width is then allowed.
    reshardable_state: bool = False

    def sharded_state(self) -> dict[str, Any] | None:
        """State held as shards over the group (DTensors, e.g. an FSDP2 model and its
        optimizer), saved by every group rank together through torch.distributed.checkpoint
        beside `state_dict`; None (default) for none."""
        return None

    def load_sharded_state(self, read: Any) -> None:
        """Take back `sharded_state`: build the state to fill, call ``read(state)`` (every group
        rank together; it loads the saved shards into it in place), then apply it."""
        raise NotImplementedError(f"{type(self).__name__} saves sharded state but cannot load it")

    def keep_state(self, limit_bytes: int = ADOPT_LIMIT_BYTES) -> dict[str, Any]:
        """Before ranks join this component (``auto`` moving back to collocated): keep a host
        copy of `state_dict` for `adopt_state` — a joiner's ``setup`` and the regrouped ranks'
        ``on_regroup`` may overwrite this rank's (DDP broadcasts the new group's first rank's
        fresh weights). Returns ``{"state": bool, "bytes": n, "kept": bool}``: a state larger
        than ``limit_bytes`` is not copied (`adopt_state` passes it through the group
        communicator, pickled in host memory: a 7B trainer's weights and Adam moments would be
        ~84 GB per rank), and the caller does not move ranks in."""
        from rlinf_hpc.runtime.checkpoint.state import host_copy, tensor_bytes

        state = self.state_dict()
        size = 0 if state is None else tensor_bytes(state)
        kept = state is not None and size <= limit_bytes
        self._kept_state = host_copy(state) if kept else None
        return {"state": state is not None, "bytes": size, "kept": kept}

    def adopt_state(self, source: int) -> None:
        """Every rank of the group takes the state world rank ``source`` kept (`keep_state`):
        the joiners built theirs afresh. Called on the whole group after the re-partition."""
        kept, self._kept_state = getattr(self, "_kept_state", None), None
        root = self.group.world_ranks.index(source)
        state = self.group.bcast(kept if self.rank == source else None, root=root)
        if state is not None:
            self.load_state_dict(state)

    # -- built-in methods callable from the coordinator -----------------------------------------
    def describe(self) -> dict[str, Any]:
        """Where this worker runs: world rank, group rank/size, host, process id, device."""
        return {
            "component": self.component,
            "rank": self.rank,
            "group_rank": self.group_rank,
            "group_size": self.group_size,
            "group_world_ranks": self.group.world_ranks,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "device": self.device,
        }

    def run_stage(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Run one pipeline stage on this rank (sent by `rlinf_hpc.scheduler.Pipeline`): call
        ``spec["method"]`` on micro-batches from the input channel until it ends."""
        return run_stage(self, StageSpec(**spec))

    def checkpoint_save(self, directory: str, asynchronous: bool = True) -> dict[str, Any]:
        """Snapshot this worker's state to host memory; the files follow in the background
        (`checkpoint_poll`). Sent by the checkpoint manager at a step boundary."""
        return self._checkpointing().save(directory, asynchronous)

    def state_nbytes(self) -> int:
        """Bytes this rank's part of a checkpoint takes: the checkpoint manager's estimate
        before the first save. The default counts `state_dict` where this rank writes it; a
        worker with `sharded_state` counts its shards itself (building them can have effects:
        torch's `get_state_dict` steps an optimizer that has no state yet, to create it)."""
        from rlinf_hpc.runtime.checkpoint.room import state_bytes

        owns = self.group_rank == 0 or not self.replicated_state
        return state_bytes(self.state_dict() if owns else None)

    def checkpoint_poll(self, wait: bool = False) -> list[dict[str, Any]] | None:
        """The files of the last `checkpoint_save` once written (None while writing)."""
        return self._checkpointing().poll(wait)

    def checkpoint_load(self, directory: str) -> dict[str, Any]:
        """Load this worker's state and this rank's RNG and micro-batch sizes."""
        return self._checkpointing().load(directory)

    def _checkpointing(self) -> Any:
        from rlinf_hpc.workers.checkpointing import WorkerCheckpointing

        if getattr(self, "_checkpoint_state", None) is None:
            self._checkpoint_state = WorkerCheckpointing(self)
        return self._checkpoint_state

    def channel_stats(self, name: str) -> dict[str, Any]:
        """`Channel.stats` of channel ``name`` on this rank (for the flow to record)."""
        return self.channel(name).stats()

    def group_check(self) -> dict[str, Any]:
        """Exercise the group communicator: all-reduce and all-gather of world ranks.

        Also reports how many group communicators this rank holds, so a test can tell that a
        re-partition freed the old ones.
        """
        self.group.barrier(timeout=60)
        return {
            "rank": self.rank,
            "rank_sum": self.group.allreduce(self.rank),
            "ranks": self.group.allgather(self.rank),
            "live_group_comms": len(live_group_comms()),
        }
