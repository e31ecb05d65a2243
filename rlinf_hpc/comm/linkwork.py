"""Transfers on a link (NCCL/gloo), and what happens when the link fails during one.

A link's send or receive is a torch.distributed work object that a helper thread waits on
(`LinkWork`). A link can break at run time (a peer's NIC, an NCCL error, a torn socket) after it
was set up; the message in flight must not be lost, nor the job crash, when the bytes can still
travel another way. So a send on a link (`LinkSend`) keeps its tensor until it is done, and if
the link fails it marks the pair broken (later messages take the MPI host path; one warning),
closes the link so the peer's pending receive ends too, and sends the tensor again over MPI on
the retry tag, named by (link, message number on the link, leaf). The receive (`LinkRecv`) ends
when its link delivers, or when that resend arrives (whether or not its own link noticed the
failure; its link is then closed); a receive whose link failed and whose resend does not come
within twice the link timeout raises, naming the link — the one case that cannot be retried is a
sender whose link reported success for bytes the receiver did not get.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from rlinf_hpc.comm.buffers import leaf_from_bytes

if TYPE_CHECKING:
    from rlinf_hpc.comm.links import Link, Links


def from_resend(node: tuple, like: Any, data: bytearray) -> Any:
    """Leaf ``node`` built from its resent bytes, on the device of the link buffer ``like``."""
    return leaf_from_bytes(node, memoryview(data)).to(like.device)


class LinkWork:
    """A send or receive on a link, completed by a helper thread.

    gloo's point-to-point work objects report completion only through ``wait()`` (neither
    ``is_completed()`` nor futures track it), so a thread waits (GIL released) and the data
    plane polls `is_completed` like an MPI request. ``error`` makes a work that failed at once.
    """

    def __init__(self, work: Any, error: BaseException | None = None) -> None:
        self.error: BaseException | None = error
        self._thread: threading.Thread | None = None
        if work is not None:
            self._thread = threading.Thread(
                target=self._run, args=(work,), daemon=True, name="rlinf-link-work"
            )
            self._thread.start()

    def _run(self, work: Any) -> None:
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.error = exc

    def is_completed(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"link transfer failed: {self.error}") from self.error


def _post(link: Link, op: str, tensor: Any) -> LinkWork:
    """``op`` ("send"/"recv") of ``tensor`` on ``link``; a link that refuses it fails at once."""
    try:
        if link.group is None:
            raise RuntimeError("the link is closed")
        if op == "send":
            return LinkWork(link.group.send([tensor], 1, 0))
        return LinkWork(link.group.recv([tensor], 0, 0))
    except Exception as exc:  # noqa: BLE001 - a broken group raises many types
        return LinkWork(None, error=exc)


class LinkSend:
    """One leaf sent on a link, resent over MPI if the link fails (see the module docstring)."""

    def __init__(self, links: Links, link: Link, tensor: Any, seq: int, index: int) -> None:
        self._links, self._link, self._tensor = links, link, tensor
        self.key = (link.link_id, seq, index)
        injected = links.take_injected_fault("send")
        if injected is not None:  # as a link that breaks now: later transfers on it fail too
            links.failed(link, injected)
        self._work = LinkWork(None, error=injected) if injected else _post(link, "send", tensor)
        self._resend: Any = None  # the MPI request of the resend, once the link failed
        self._resend_buffer: Any = None

    def is_completed(self) -> bool:
        if self._resend is None:
            if not self._work.is_completed():
                return False
            if self._work.error is None:
                return True
            self._links.failed(self._link, self._work.error)
            self._resend, self._resend_buffer = self._links.resend(self._link.peer, self.key, self._tensor)
        return bool(self._resend.Test())

    def wait(self) -> None:
        """Raises nothing: a failure of the link was retried over MPI (`is_completed`)."""
        if self._resend is not None:
            self._resend.Wait()


class LinkRecv:
    """One leaf received on a link into ``value``, or from its resend over MPI."""

    def __init__(self, links: Links, link: Link, tensor: Any, node: tuple, seq: int, index: int) -> None:
        self._links, self._link = links, link
        self.value = tensor
        self._node = node
        self.index = index
        self.key = (link.link_id, seq, index)
        # a link known to have failed takes no new receive: the sender resends these bytes
        self._work: LinkWork | None = None
        injected = links.take_injected_fault("recv")
        if injected is not None:
            links.failed(link, injected)
            self._work = LinkWork(None, error=injected)
        elif not link.failed:
            self._work = _post(link, "recv", tensor)
        self._failed_at: float | None = None if self._work is not None else time.monotonic()
        self._done = False
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        if self._done:
            return True
        resent = self._links.resent(self._link.peer, self.key)
        if resent is not None:  # the sender gave up on the link: its bytes came over MPI
            # the link is dead whether or not its own receive noticed yet (a no-op if it did)
            noticed = self._work.error if self._work is not None and self._work.is_completed() else None
            self._links.failed(self._link, noticed or RuntimeError("the sender resent over MPI"))
            self.value = from_resend(self._node, self.value, resent)
            self._done = True
            return True
        if self._failed_at is None:
            assert self._work is not None  # a receive without work starts failed
            if not self._work.is_completed():
                return False
            if self._work.error is None:
                self._done = True
                return True
            self._links.failed(self._link, self._work.error)
            self._failed_at = time.monotonic()
        # the sender notices within its own link timeout (its send fails or times out)
        patience = 2 * self._links.timeout.total_seconds() + 5
        if time.monotonic() - self._failed_at > patience:
            self._error = RuntimeError(
                f"link {self._link.link_id} from rank {self._link.peer} failed during a transfer and "
                f"the sender did not resend it over MPI within {patience:g} s (its side of the link "
                "reported success): the message is lost"
            )
            self._done = True
            return True
        return False

    def wait(self) -> None:
        if self._error is not None:
            raise self._error
