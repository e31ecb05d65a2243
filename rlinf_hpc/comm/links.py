"""Two-rank torch.distributed links (NCCL for GPU tensors, gloo for CPU), created on first use.

A link is *directional*: the link A->B carries A's sends to B, so two ranks that start sending
to each other at the same moment never race to create the same link. The sender picks a
private MPI tag for the link's rendezvous store (`MPIStore`: keys travel as MPI messages over
the data communicator, so no TCP store listens for anyone to reach), puts it in the message
envelope, and both sides build a two-rank process group from it while the envelope's payload
waits; after that, every large leaf on that route goes over the link, in message order.

If a link cannot be set up (no route to the store, NCCL init error, timeout) both sides notice
— setup is a rendezvous — and the message's leaves travel the host path instead; the pair is
marked so that later messages do not retry, and one warning says why. Links of ranks whose place
in the job changes are released on every peer when the new directory arrives.
"""

from __future__ import annotations

import datetime
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from rlinf_hpc.comm.interfaces import pin_socket_interfaces
from rlinf_hpc.comm.routing import GLOO, NCCL
from rlinf_hpc.log import get_logger

log = get_logger("comm.links")


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


#: Link rendezvous stores use MPI tags from here on (the data plane's own tags are below).
_LINK_TAG_BASE = 1000


class LinkWork:
    """A send or receive on a link, completed by a helper thread.

    gloo's point-to-point work objects report completion only through ``wait()`` (neither
    ``is_completed()`` nor futures track it), so a thread waits (GIL released) and the data
    plane polls `is_completed` like an MPI request.
    """

    def __init__(self, work: Any) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True, name="rlinf-link-work")
        self._thread.start()

    def _run(self, work: Any) -> None:
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self._error = exc

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"link transfer failed: {self._error}") from self._error


@dataclass
class Link:
    """One direction of a two-rank process group."""

    peer: int
    backend: str
    link_id: str
    group: Any = None
    store: Any = None
    works: list[Any] = field(default_factory=list)

    def send(self, tensor: Any) -> LinkWork:
        return LinkWork(self.group.send([tensor], 1, 0))

    def recv(self, tensor: Any) -> LinkWork:
        return LinkWork(self.group.recv([tensor], 0, 0))

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - closing a broken link must not raise
                log.debug("shutdown of link %s failed", self.link_id)
        self.group = None
        self.store = None


def _make_group(backend: str, store: Any, rank: int, timeout: datetime.timedelta) -> Any:
    dist = _dist()
    pin_socket_interfaces()
    if backend == GLOO:
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if backend == NCCL:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    raise ValueError(f"unknown link backend {backend!r}")


class Links:
    """This rank's links, outgoing and incoming, by (peer, backend)."""

    def __init__(self, rank: int, timeout_s: float, comm: Any = None) -> None:
        self.rank = rank
        #: The data communicator; link rendezvous stores send their keys over it.
        self.comm = comm
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._outgoing: dict[tuple[int, str], Link] = {}
        self._incoming: dict[tuple[int, str], Link] = {}
        self._broken: set[tuple[int, str]] = set()
        self._counter = itertools.count()
        self.created = 0
        #: Test hook: advertise a store tag the sender does not use (exercises the fallback path).
        self.fault_bad_address = False

    # -- sender ----------------------------------------------------------------------------
    def outgoing(self, peer: int, backend: str) -> tuple[Link | None, tuple | None]:
        """(link, setup): an established link; or a new one whose ``setup`` must ride in the
        envelope and which `establish` then completes; or (None, None) if the pair is broken."""
        key = (peer, backend)
        if key in self._broken:
            return None, None
        link = self._outgoing.get(key)
        if link is not None:
            return link, None
        number = next(self._counter)
        link_id = f"{self.rank}>{peer}/{backend}/{number}"
        # Tags of the two directions of a pair differ in parity, so their stores never mix.
        tag = _LINK_TAG_BASE + 2 * number + (self.rank < peer)
        link = Link(peer, backend, link_id, store=self._store(peer, tag))
        advertised = tag + 2 * 1_000_000 if self.fault_bad_address else tag
        return link, (backend, advertised, link_id)

    def establish(self, link: Link) -> bool:
        """Sender side of the rendezvous; False (and the pair marked broken) on failure."""
        try:
            prefixed = _dist().PrefixStore(link.link_id, link.store)
            link.group = _make_group(link.backend, prefixed, 0, self.timeout)
        except Exception as exc:  # noqa: BLE001 - any setup error: fall back to host
            link.close()
            self._give_up((link.peer, link.backend), _first_line(exc))
            return False
        self._outgoing[(link.peer, link.backend)] = link
        self.created += 1
        return True

    # -- receiver --------------------------------------------------------------------------
    def incoming(self, peer: int, backend: str, setup: tuple | None) -> Link | None:
        """The link from ``peer`` for this message, built from ``setup`` when the envelope
        carries one (replacing an older link of the same pair)."""
        key = (peer, backend)
        if setup is None:
            return self._incoming.get(key)
        old = self._incoming.pop(key, None)
        if old is not None:
            old.close()
        _, tag, link_id = setup
        link = Link(peer, backend, link_id)
        try:
            link.store = self._store(peer, tag)
            link.group = _make_group(backend, _dist().PrefixStore(link_id, link.store), 1, self.timeout)
        except Exception as exc:  # noqa: BLE001 - the sender sees the same failure
            link.close()
            log.warning(
                "link %s from rank %d over %s could not be set up (%s): using the MPI host path",
                link_id,
                peer,
                backend,
                _first_line(exc),
            )
            return None
        self._incoming[key] = link
        return link

    def _store(self, peer: int, tag: int) -> Any:
        """The rendezvous store of one link: this rank and ``peer``, MPI messages on ``tag``."""
        from rlinf_hpc.comm.store import MPIStore  # imports torch: only once a link is wanted

        return MPIStore(self.comm, [self.rank, peer], tag, self.timeout.total_seconds())

    # -- lifecycle -------------------------------------------------------------------------
    def _give_up(self, key: tuple[int, str], reason: str) -> None:
        self._broken.add(key)
        log.warning(
            "link rank %d -> rank %d over %s failed (%s): falling back to the MPI host path for this pair",
            self.rank,
            key[0],
            key[1],
            reason,
        )

    def release(self, peers: set[int]) -> int:
        """Close every link to or from ``peers`` (their place in the job changed)."""
        released = 0
        for table in (self._outgoing, self._incoming):
            for key in [k for k in table if k[0] in peers]:
                table.pop(key).close()
                released += 1
        self._broken = {k for k in self._broken if k[0] not in peers}
        return released

    def live(self) -> int:
        """Number of links (either direction) currently open on this rank."""
        return len(self._outgoing) + len(self._incoming)
