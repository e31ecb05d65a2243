"""One `Channel` object per (rank, channel name), kept in step with placement changes.

`attach_channels` runs on every rank at start-up: from then on each placement change reaches
every channel this rank takes part in (creating the object if the rank never used it, so that a
consumer leaving a channel still hands over what was sent to it).
"""

from __future__ import annotations

import weakref

from rlinf_hpc.channel.channel import Channel
from rlinf_hpc.comm import DataPlane, Directory

_registries: weakref.WeakKeyDictionary[DataPlane, dict[str, Channel]] = weakref.WeakKeyDictionary()


def attach_channels(plane: DataPlane) -> None:
    """Start following placement changes on this rank (idempotent)."""
    if plane in _registries:
        return
    _registries[plane] = {}
    plane.add_directory_listener(lambda old, new: _follow(plane, old, new))


def channel_for(plane: DataPlane, name: str) -> Channel:
    """This rank's handle on channel ``name`` (ValueError naming the channels if unknown)."""
    attach_channels(plane)
    channels = _registries[plane]
    if name not in channels:
        channels[name] = Channel(plane, name)
    return channels[name]


def _follow(plane: DataPlane, old: Directory, new: Directory) -> None:
    for name in sorted(set(old.channels) | set(new.channels)):
        before, after = old.channels.get(name), new.channels.get(name)
        members = set()
        for spec in (before, after):
            if spec is not None:
                members |= set(spec.producers) | set(spec.consumers)
        if plane.rank not in members:
            continue
        channels = _registries[plane]
        if name not in channels and after is None:
            continue  # never used here and gone now
        if name not in channels:
            channels[name] = Channel(plane, name)
            if before is None:
                continue  # created from the new directory already
        channels[name].on_directory_change(before, after)
        if after is None:  # removed from the job (e.g. a finished pipeline step's stream)
            channels.pop(name).retire()
