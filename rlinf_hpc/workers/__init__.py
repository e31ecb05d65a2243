"""Worker base class and the per-rank service loop."""

from rlinf_hpc.workers.base import Worker
from rlinf_hpc.workers.service import WorkerService, resolve_worker_class

__all__ = ["Worker", "WorkerService", "resolve_worker_class"]
