"""Weight sync between workers: the actor's parameters (and persistent buffers) to
rollout/inference ranks over the data plane, received in place into the destination's
parameters (no allocation in steady state).

The copies spread over a binomial tree: the actor sends to ceil(log2(N + 1)) destinations, each
of which passes what it received on to the part of the tree below it, so a sync to N ranks
costs about log2 N transfer times, not N. Each destination first gets a small route message
from the actor (where its copy comes from, whom to pass it to), then the weights from its parent.

A destination on the sender's own rank (collocated components) gets a copy through a process-
local mailbox instead: the rank runs its commands in order, so the push has run before the pull.
The same holds inside the tree: a node whose child is another component on its own rank leaves
the copy in the mailbox (a send to itself would wait for a pull queued behind its own), which
needs the pulls issued in target order — as `apps.math.flow.sync_weights` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from rlinf_hpc.comm import DataPlane, WorkHandle
from rlinf_hpc.comm.collectives import tree_children, tree_parent

_mailbox: dict[Any, dict[str, torch.Tensor]] = {}
_ROUTE = "weights-route"


def parameters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> parameter data (tied weights once), then the persistent buffers (running
    statistics such as an observation normalizer's: part of what the model computes; the
    non-persistent ones, such as rotary tables, every rank builds itself)."""
    state = model.state_dict(keep_vars=True)  # persistent buffers only, no copies
    params = {name: p.data for name, p in model.named_parameters()}
    buffers = {name: b.data for name, b in model.named_buffers() if name in state}
    return params | buffers


def full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`parameters_of` whole, one tensor at a time: an FSDP2 model's shards are all-gathered
    per tensor (every rank of its group must iterate in step), others' are yielded as they are."""
    for name, tensor in parameters_of(model).items():
        yield name, (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor)


def send_weights(plane: DataPlane, model: torch.nn.Module, targets: list[tuple[int, Any]]) -> int:
    """Send ``model``'s parameters to every ``(world rank, tag)`` in ``targets`` (a rank that
    hosts two receiving components gets one message per tag), over a binomial tree of the
    remote targets; returns bytes per target."""
    return send_tensors(plane, parameters_of(model), targets)


def send_tensors(plane: DataPlane, params: dict[str, torch.Tensor], targets: list[tuple[int, Any]]) -> int:
    """`send_weights` of a name -> tensor dict (e.g. gathered from a sharded model)."""
    remote: list[tuple[int, Any]] = []
    for rank, tag in targets:
        if rank == plane.rank:
            _mailbox[tag] = {name: t.detach().clone() for name, t in params.items()}
        else:
            remote.append((rank, tag))
    nodes: list[tuple[int, Any]] = [(plane.rank, None), *remote]
    for index, (rank, tag) in enumerate(remote, start=1):  # small, coalesced: one batch per rank
        parent = nodes[tree_parent(index)][0]
        children = [nodes[child] for child in tree_children(index, len(nodes))]
        plane.isend((parent, children), rank, (_ROUTE, tag))
    plane.flush()
    _forward(plane, params, [nodes[child] for child in tree_children(0, len(nodes))])
    return sum(t.numel() * t.element_size() for t in params.values())


def _forward(plane: DataPlane, params: dict[str, torch.Tensor], children: list[tuple[int, Any]]) -> None:
    """Send to each child; a child on this very rank (another component here) gets a copy in
    the mailbox — a send to oneself would wait for a pull that runs only after this one."""
    for rank, tag in children:
        if rank == plane.rank:
            _mailbox[tag] = {name: t.detach().clone() for name, t in params.items()}
    handles: list[WorkHandle] = [
        plane.isend(params, rank, tag) for rank, tag in children if rank != plane.rank
    ]
    plane.flush()
    for handle in handles:
        handle.wait()


def take_weights(plane: DataPlane, source: int, tag: Any) -> dict[str, torch.Tensor]:
    """The parameters sent by `send_weights` from world rank ``source``, as a new dict (for
    engines that load weights themselves, e.g. vLLM); passed on to this rank's subtree."""
    if source == plane.rank:
        state = _mailbox.pop(tag, None)
        if state is None:
            raise RuntimeError("no weights were pushed on this rank before the pull")
        return state
    parent, children = plane.recv(source, (_ROUTE, tag))
    state = _mailbox.pop(tag) if parent == plane.rank else plane.recv(parent, tag)
    _forward(plane, state, children)
    return state


def receive_weights(plane: DataPlane, model: torch.nn.Module, source: int, tag: Any) -> int:
    """Receive parameters sent by `send_weights` from world rank ``source`` into ``model``
    (in place: from another rank the bytes land directly in the parameters), and pass them on
    to this rank's part of the tree."""
    params = parameters_of(model)
    if source == plane.rank:
        received = take_weights(plane, source, tag)
    else:
        parent, children = plane.recv(source, (_ROUTE, tag))
        # parent == this rank: a component pulled here before this one passed it on
        received = _mailbox.pop(tag) if parent == plane.rank else plane.recv(parent, tag, out=params)
        _forward(plane, params, children)
    if any(received[name] is not tensor for name, tensor in params.items()):  # a copy to write back
        with torch.no_grad():
            for name, tensor in params.items():
                tensor.copy_(received[name])
    return sum(t.numel() * t.element_size() for t in params.values())
