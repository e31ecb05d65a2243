"""How full a rank's memory is: the device's on GPU ranks, the node's host memory on CPU ranks."""

from __future__ import annotations

from pathlib import Path

from rlinf_hpc.imports import loaded


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
    if device.startswith("cuda") and loaded("torch") is not None:
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return 1.0 - free / total
    return host_memory_fraction()


class SampleMemory:
    """Peak device memory per sample of a stage's micro-batches, measured on CUDA ranks
    (``torch.cuda`` peak statistics around each call); nothing on CPU ranks."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.bytes_per_sample = 0.0
        self.state_bytes = 0.0
        self._before = 0

    @property
    def cuda(self) -> bool:
        """Asked at each micro-batch: the worker's setup may initialize CUDA after binding."""
        torch = loaded("torch")
        return self.device.startswith("cuda") and torch is not None and torch.cuda.is_initialized()

    def start(self) -> None:
        if self.cuda:
            import torch

            self._before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self, items: int) -> None:
        if self.cuda and items:
            import torch

            peak = torch.cuda.max_memory_allocated(self.device) - self._before
            self.bytes_per_sample = max(self.bytes_per_sample, peak / items)
            self.state_bytes = max(self.state_bytes, float(self._before))

    def profile(self) -> dict[str, float] | None:
        if not self.cuda or self.bytes_per_sample <= 0:
            return None
        import torch

        total = torch.cuda.get_device_properties(torch.device(self.device)).total_memory
        return {
            "device_bytes": float(total),
            "state_bytes": self.state_bytes,
            "bytes_per_sample": self.bytes_per_sample,
        }
