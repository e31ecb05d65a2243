"""Weight sync between workers: the actor's parameters to rollout/inference ranks over the data
plane, received in place into the destination's parameters (no allocation in steady state).

A destination on the sender's own rank (collocated components) gets a copy through a process-
local mailbox instead: the rank runs its commands in order, so the push has run before the pull.
"""

from __future__ import annotations

from typing import Any

import torch

from rlinf_hpc.comm import DataPlane, WorkHandle

_mailbox: dict[Any, dict[str, torch.Tensor]] = {}


def parameters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> parameter data (tied weights once)."""
    return {name: p.data for name, p in model.named_parameters()}


def send_weights(plane: DataPlane, model: torch.nn.Module, targets: list[tuple[int, Any]]) -> int:
    """Send ``model``'s parameters to every ``(world rank, tag)`` in ``targets`` (a rank that
    hosts two receiving components gets one message per tag); returns bytes per target."""
    params = parameters_of(model)
    handles: list[WorkHandle] = []
    for rank, tag in targets:
        if rank == plane.rank:
            _mailbox[tag] = {name: t.detach().clone() for name, t in params.items()}
        else:
            handles.append(plane.isend(params, rank, tag))
    plane.flush()
    for handle in handles:
        handle.wait()
    return sum(t.numel() * t.element_size() for t in params.values())


def take_weights(plane: DataPlane, source: int, tag: Any) -> dict[str, torch.Tensor]:
    """The parameters sent by `send_weights` from world rank ``source``, as a new dict (for
    engines that load weights themselves, e.g. vLLM)."""
    if source == plane.rank:
        state = _mailbox.pop(tag, None)
        if state is None:
            raise RuntimeError("no weights were pushed on this rank before the pull")
        return state
    return plane.recv(source, tag)


def receive_weights(plane: DataPlane, model: torch.nn.Module, source: int, tag: Any) -> int:
    """Receive parameters sent by `send_weights` from world rank ``source`` into ``model``
    (in place: from another rank the bytes land directly in the parameters)."""
    params = parameters_of(model)
    if source == plane.rank:
        received = take_weights(plane, source, tag)
    else:
        received = plane.recv(source, tag, out=params)
    if any(received[name] is not tensor for name, tensor in params.items()):  # a copy to write back
        with torch.no_grad():
            for name, tensor in params.items():
                tensor.copy_(received[name])
    return sum(t.numel() * t.element_size() for t in params.values())
