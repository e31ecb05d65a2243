"""Which link a leaf takes from one rank to another: one function, one place.

* ``host``: MPI messages of host bytes. CPU<->CPU, and every mixed pair (a GPU tensor is copied
  to host memory chunk by chunk on the sender; the receiver moves it onto its device).
* ``nccl``: GPU<->GPU, across nodes and within one (NCCL's own P2P transport uses CUDA IPC /
  NVLink between GPUs of one node), over a lazily created two-rank NCCL link.
* ``gloo``: CPU<->CPU over a torch.distributed gloo link — opt-in (``cpu_link = "gloo"``), for
  sites whose MPI is slow between nodes; MPI is faster on one node.

Leaves under ``link_min_bytes`` always go through the host path: a device link costs more to
set up and to synchronise than copying a few kilobytes.

>>> choose_route("cuda:0", "cuda:1", same_node=True, nbytes=64 << 20)
'nccl'
>>> choose_route("cuda:0", "cpu", same_node=True, nbytes=64 << 20)
'host'
>>> choose_route("cpu", "cpu", same_node=False, nbytes=64 << 20, cpu_link="gloo")
'gloo'
>>> choose_route("cuda:0", "cuda:0", same_node=False, nbytes=100)
'host'
"""

from __future__ import annotations

HOST = "host"
#: A small leaf of a large message: copied into the envelope's tail instead of a message of
#: its own (a thousand small leaves must not cost a thousand MPI messages).
INLINE = "inline"
NCCL = "nccl"
GLOO = "gloo"
LINK_ROUTES = (NCCL, GLOO)

#: Default smallest leaf that may use a device/gloo link.
LINK_MIN_BYTES = 1 << 20


def choose_route(
    src_device: str,
    dst_device: str,
    same_node: bool,
    nbytes: int,
    cpu_link: str = HOST,
    link_min_bytes: int = LINK_MIN_BYTES,
) -> str:
    """The route for one leaf of ``nbytes`` on ``src_device`` going to a rank on ``dst_device``."""
    if nbytes < link_min_bytes:
        return HOST
    src_gpu, dst_gpu = src_device.startswith("cuda"), dst_device.startswith("cuda")
    if src_gpu and dst_gpu:
        return NCCL  # same node or not: NCCL picks P2P/IPC inside a node, the network across
    if not src_gpu and not dst_gpu and cpu_link == GLOO:
        return GLOO
    return HOST
