"""How full a rank's memory is: the device's on GPU ranks, the node's host memory on CPU ranks."""

from __future__ import annotations

import sys
from pathlib import Path


def host_memory_fraction(meminfo: Path = Path("/proc/meminfo")) -> float:
    """1 - MemAvailable / MemTotal of this node (0.0 where /proc/meminfo is not readable)."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        total = float(fields["MemTotal"].split()[0])
        available = float(fields["MemAvailable"].split()[0])
    except (OSError, KeyError, ValueError):
        return 0.0
    return 1.0 - available / total if total > 0 else 0.0


def device_memory_fraction(device: str) -> float:
    """Fraction of ``device``'s memory in use by anyone (``cuda:N``), else of host memory."""
    if device.startswith("cuda") and "torch" in sys.modules:
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return 1.0 - free / total
    return host_memory_fraction()
