"""A torch.distributed key-value store carried by MPI messages: no TCP server, no open port.

gloo and NCCL need a store to rendezvous (each rank publishes its address, the others read
it). torch's `TCPStore` listens on a port for the whole job with no authentication: anyone who
reaches the node can read or write the keys. The members of a process group here already
share an MPI communicator, so every ``set``/``add`` is sent to the other members as an MPI
message on a private tag, and every read is served from the rank's own copy once the writes it
waits for have arrived. Waits pump the tag and time out naming the missing keys.

Consistency: a key set once (the rendezvous pattern) reads the same everywhere; ``add``
counters converge once every member's increments have arrived (what store-based barriers need).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from rlinf_hpc.comm.waiting import Backoff

#: Tag of store messages on the communicator given to `MPIStore` (keep it private to stores).
STORE_TAG = 31_337


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class MPIStore(dist.Store):
    """A `torch.distributed.Store` shared by ``members`` (ranks of ``comm``) over MPI.

    Every member constructs one (same members, same ``tag``); it can then be passed as
    ``store=`` to `torch.distributed.init_process_group` or a process group constructor.
    """

    def __init__(
        self, comm: Any, members: Sequence[int] | None = None, tag: int = STORE_TAG, timeout_s: float = 300.0
    ) -> None:
        super().__init__()
        self._comm = comm
        self._rank = comm.Get_rank()
        self._members = list(range(comm.Get_size())) if members is None else list(members)
        self._peers = [m for m in self._members if m != self._rank]
        self._tag = tag
        self._timeout_s = timeout_s
        self._values: dict[str, bytes] = {}
        self._counters: dict[str, int] = {}
        self._sends: list[Any] = []

    # -- messages ----------------------------------------------------------------------------
    def _publish(self, message: tuple) -> None:
        self._sends = [r for r in self._sends if not r.Test()]
        self._sends += [self._comm.isend(message, dest=peer, tag=self._tag) for peer in self._peers]

    def _pump(self) -> bool:
        got = False
        for peer in self._peers:  # only members: other stores may share the tag with other ranks
            while self._comm.iprobe(source=peer, tag=self._tag):
                self._apply(self._comm.recv(source=peer, tag=self._tag))
                got = True
        return got

    def _apply(self, message: tuple) -> None:
        op, key, value = message
        if op == "set":
            self._values[key] = value
        elif op == "add":
            self._counters[key] = self._counters.get(key, 0) + value
            self._values[key] = str(self._counters[key]).encode()
        elif op == "delete":
            self._values.pop(key, None)
            self._counters.pop(key, None)

    def _wait_for(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        limit = self._timeout_s if timeout is None else timeout.total_seconds()
        start = time.monotonic()
        backoff = Backoff(spin=1e-3)
        while True:
            self._pump()
            missing = [k for k in keys if k not in self._values]
            if not missing:
                return
            if time.monotonic() - start > limit:
                raise RuntimeError(
                    f"MPIStore on rank {self._rank}: keys {missing} were not set by any of ranks "
                    f"{self._peers} within {limit:.0f} s"
                )
            backoff.sleep()

    # -- the Store interface -----------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        data = _as_bytes(value)
        self._apply(("set", key, data))
        self._publish(("set", key, data))

    def get(self, key: str) -> bytes:
        self._wait_for([key])
        return self._values[key]

    def add(self, key: str, value: int) -> int:
        self._pump()
        self._apply(("add", key, int(value)))
        if value:
            self._publish(("add", key, int(value)))
        return self._counters[key]

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._pump()
        current = self._values.get(key)
        if (current is None and not _as_bytes(expected)) or current == _as_bytes(expected):
            self.set(key, desired)
            return _as_bytes(desired)
        return current if current is not None else _as_bytes(expected)

    def check(self, keys: list[str]) -> bool:
        self._pump()
        return all(k in self._values for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait_for(keys, timeout)

    def delete_key(self, key: str) -> bool:
        self._pump()
        present = key in self._values
        self._apply(("delete", key, None))
        self._publish(("delete", key, None))
        return present

    def num_keys(self) -> int:
        self._pump()
        return len(self._values)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
