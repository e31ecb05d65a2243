"""Data channels between components, with load balancing across consumers."""

from rlinf_hpc.channel.channel import Channel, ChannelFull, EndOfStream, LostItemsError
from rlinf_hpc.channel.policies import (
    ConsumerView,
    ItemInfo,
    LoadBalancePolicy,
    PerformanceAware,
    ShortestQueue,
    WeightedRoundRobin,
    resolve_policy,
)
from rlinf_hpc.channel.registry import attach_channels, channel_for

__all__ = [
    "Channel",
    "ChannelFull",
    "ConsumerView",
    "EndOfStream",
    "LostItemsError",
    "ItemInfo",
    "LoadBalancePolicy",
    "PerformanceAware",
    "ShortestQueue",
    "WeightedRoundRobin",
    "attach_channels",
    "channel_for",
    "resolve_policy",
]
