"""Typed job configuration loaded from TOML."""

from rlinf_hpc.config.loader import config_from_dict, config_to_toml, load_config, parse_override
from rlinf_hpc.config.scheduling import PipelineConfig, PlacementConfig
from rlinf_hpc.config.schema import (
    ChannelConfig,
    ComponentConfig,
    Config,
    FlowConfig,
    JobConfig,
)

__all__ = [
    "ChannelConfig",
    "ComponentConfig",
    "Config",
    "FlowConfig",
    "JobConfig",
    "PipelineConfig",
    "PlacementConfig",
    "config_from_dict",
    "config_to_toml",
    "load_config",
    "parse_override",
]
