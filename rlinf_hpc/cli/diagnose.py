"""`rlinf-hpc diagnose env | comm | memory` (and ``tools/diagnose``): what an operator checks
before blaming the job.

- ``env``: Python, MPI library, torch/CUDA/NCCL versions, the job environment, every
  ``NCCL_*``/``TORCH_*``/``SLURM_*``/``CUDA_*``/MPI variable set, each GPU's health through NVML
  (temperature, memory, ECC, remapped rows, throttling) and ``nvidia-smi topo -m``.
- ``comm``: inside a job of N ranks (``--np N`` starts one), every pair's latency and bandwidth
  and an all-reduce check (`rlinf_hpc.comm.linkcheck`); slow and failing links flagged against
  the median; table, JSON and a heatmap PNG. Exit 1 when a link fails or the sum is wrong.
- ``memory``: calls a function (``package.module:function``) or a worker method
  (``package.module:WorkerClass.method``, the worker set up on its own) N times; growth per
  call and the top allocation sites (`rlinf_hpc.runtime.memcheck`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlinf_hpc.errors import UserError

_VARIABLE_PREFIXES = ("NCCL_", "TORCH_", "SLURM_", "CUDA_", "OMP_", "MPICH_", "HYDRA_", "PMI_", "OMPI_",
                      "I_MPI_", "UCX_", "FI_", "RLINF_HPC_", "MASTER_", "GLOO_")  # fmt: skip


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    diagnose = commands.add_parser(
        "diagnose",
        parents=[common],
        help="check the environment, the links between ranks, or a function's memory growth",
        description="env: versions, variables, GPU health; comm: pairwise latency/bandwidth and an "
        "all-reduce check among N ranks; memory: growth per call of a function or worker method.",
    )
    what = diagnose.add_subparsers(dest="diagnose_command", required=True, metavar="WHAT")
    env = what.add_parser("env", parents=[common], help="versions, job variables, GPU health and topology")
    env.add_argument("--json", metavar="PATH", help="also write the report as JSON")

    comm = what.add_parser("comm", parents=[common], help="latency/bandwidth matrix and all-reduce check")
    comm.add_argument("--np", type=int, help="start this many ranks (outside srun/mpiexec); default 2")
    comm.add_argument("--backend", choices=["auto", "mpi", "gloo", "nccl"], default="auto",
                      help="auto (default): NCCL when the ranks have GPUs, else MPI (host)")  # fmt: skip
    comm.add_argument("--size-mb", type=float, default=16.0, help="bytes per transfer (default 16 MB)")
    comm.add_argument("--iters", type=int, default=5, help="transfers per direction and pair (default 5)")
    comm.add_argument("--timeout-s", type=float, default=30.0, help="a transfer slower than this fails")
    comm.add_argument("--out", default="diagnose-comm", help="directory of the JSON and the heatmap")

    memory = what.add_parser("memory", parents=[common], help="memory growth per call, top allocation sites")
    memory.add_argument("target", help="package.module:function or package.module:WorkerClass.method")
    memory.add_argument("--kwargs", default="{}", help="keyword arguments of each call (JSON object)")
    memory.add_argument("--options", default="{}", help="a worker's setup options (JSON object)")
    memory.add_argument("--iterations", type=int, default=20, help="measured calls (default 20)")
    memory.add_argument("--warmup", type=int, default=2, help="calls before measuring (default 2)")
    memory.add_argument("--top", type=int, default=10, help="allocation sites to show (default 10)")
    memory.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    memory.add_argument("--cuda-snapshot", metavar="PATH", help="with CUDA: write torch's memory snapshot")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.diagnose_command == "env":
        return _env(args)
    if args.diagnose_command == "comm":
        return _comm(args, argv)
    return _memory(args)


# -- env ---------------------------------------------------------------------------------------


def environment_report() -> dict[str, Any]:
    """Versions, variables, job environment and GPUs of this process."""
    import rlinf_hpc
    from rlinf_hpc.cluster import detect_environment
    from rlinf_hpc.comm import library_version

    report: dict[str, Any] = {
        "rlinf_hpc": rlinf_hpc.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "job_environment": detect_environment().describe(),
        "mpi_library": library_version(),
    }
    try:
        import mpi4py

        report["mpi4py"] = mpi4py.__version__
    except ImportError:
        pass
    try:
        import torch

        report["torch"] = torch.__version__
        report["cuda_available"] = torch.cuda.is_available()
        report["cuda_version"] = torch.version.cuda
        if torch.cuda.is_available():
            report["nccl_version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
            report["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        report["torch"] = None
    report["variables"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_VARIABLE_PREFIXES)}
    report["gpus"], report["nvml"] = _gpu_health()
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            topo = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20)
            report["gpu_topology"] = topo.stdout.strip() or topo.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            report["gpu_topology"] = f"nvidia-smi topo -m failed: {exc}"
    report["notes"] = _notes(report)
    return report


def _gpu_health(nvml: Any = None) -> tuple[list[dict[str, Any]], str]:
    """One NVML reading of every GPU of this node: figures and standing alarms."""
    from rlinf_hpc.runtime.gpu_health import GpuGuard

    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
    except ImportError:
        return [], "off (nvidia-ml-py is not installed)"
    except Exception as exc:  # noqa: BLE001 - NVMLError: no driver, no GPU
        return [], f"off ({exc})"
    gpus = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            guard = GpuGuard(nvml, index)
            alarms = guard.poll(force=True)
            name = nvml.nvmlDeviceGetName(guard.handle)
            gpus.append({"name": name.decode() if isinstance(name, bytes) else str(name), **guard.figures,
                         "alarms": [a.message for a in alarms]})  # fmt: skip
            guard.close()
        return gpus, "ok"
    finally:
        nvml.nvmlShutdown()


def _notes(report: dict[str, Any]) -> list[str]:
    notes = []
    variables = report["variables"]
    if "OMP_NUM_THREADS" not in variables:
        notes.append("OMP_NUM_THREADS is not set: each rank's torch takes every core; rlinf-hpc's own "
                     "launcher sets 1, set it yourself under srun (export OMP_NUM_THREADS=1)")  # fmt: skip
    if "CUDA_VISIBLE_DEVICES" in variables and not report.get("cuda_available"):
        notes.append(f"CUDA_VISIBLE_DEVICES={variables['CUDA_VISIBLE_DEVICES']} but torch sees no GPU")
    for gpu in report["gpus"]:
        notes.extend(f"GPU {gpu['index']}: {alarm}" for alarm in gpu["alarms"])
    return notes


def _env(args: argparse.Namespace) -> int:
    from rlinf_hpc.runtime.console import print_table

    report = environment_report()
    scalars = [
        (k, str(v)) for k, v in report.items() if not isinstance(v, (dict, list)) and k != "gpu_topology"
    ]
    print_table("environment", ["what", "value"], scalars)
    print_table("variables", ["name", "value"], list(report["variables"].items()) or [("(none set)", "")])
    if report["gpus"]:
        columns = ["index", "name", "temp_c", "mem_used_mb", "util_pct", "throttle", "alarms"]
        rows = [[_cell(gpu.get(c)) for c in columns] for gpu in report["gpus"]]
        print_table(f"GPUs (NVML {report['nvml']})", columns, rows)
    else:
        sys.stdout.write(f"GPUs: none (NVML {report['nvml']})\n")
    if report.get("gpu_topology"):
        sys.stdout.write(f"GPU topology (nvidia-smi topo -m):\n{report['gpu_topology']}\n")
    for note in report["notes"]:
        sys.stdout.write(f"note: {note}\n")
    _write_json(args.json, report)
    return 0


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.0f}"
    if isinstance(value, list):
        return "; ".join(str(v) for v in value) or "-"
    return "-" if value is None else str(value)


def _write_json(path: str | None, report: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
        sys.stdout.write(f"report: {path}\n")


# -- comm --------------------------------------------------------------------------------------


def _comm(args: argparse.Namespace, argv: list[str]) -> int:
    from rlinf_hpc.cluster import detect_environment

    if args.size_mb <= 0 or args.iters < 1 or args.timeout_s <= 0:
        raise UserError("diagnose comm: --size-mb and --timeout-s must be > 0 and --iters >= 1.")
    environment = detect_environment()
    if environment.needs_launch:
        num = args.np or 2
        if num < 2:
            raise UserError("diagnose comm needs at least 2 ranks (--np 2 or more).")
        from rlinf_hpc.cli.launch import launch_ranks

        launch_ranks(num, environment, argv)
    from rlinf_hpc.comm.linkcheck import check_links, open_transport
    from rlinf_hpc.log import setup_logging

    try:
        comm, transport = open_transport(args.backend, args.timeout_s)
    except ValueError as exc:
        raise UserError(f"diagnose comm: {exc}") from None
    rank, size, backend = comm.Get_rank(), comm.Get_size(), transport.name
    setup_logging(rank, "diagnose")

    def progress(line: str) -> None:
        sys.stdout.write(f"[diagnose] {line}\n")
        sys.stdout.flush()

    if rank == 0:
        progress(f"{size} ranks, backend {backend}, {args.size_mb:g} MB x {args.iters} per direction")
    report = check_links(comm, transport, int(args.size_mb * 2**20), args.iters, progress=progress)
    if hasattr(transport, "close"):
        transport.close()
    if report is None:
        return 0
    return _print_link_report(report.as_dict(), Path(args.out))


def _print_link_report(report: dict[str, Any], out: Path) -> int:
    from rlinf_hpc.runtime.console import print_table

    n = len(report["hosts"])
    header = ["from \\ to", *[str(j) for j in range(n)]]

    def matrix(values: list[list[float | None]], fmt: str) -> list[list[str]]:
        return [[f"{i} ({report['hosts'][i]})", *["-" if v is None else fmt.format(v) for v in row]]
                for i, row in enumerate(values)]  # fmt: skip

    print_table("bandwidth GB/s (row sends to column)", header, matrix(report["bandwidth_gbs"], "{:.2f}"))
    print_table("latency us (half a round trip)", header, matrix(report["latency_us"], "{:.1f}"))
    allreduce = report["allreduce"]
    if allreduce.get("seconds"):
        verdict = "correct" if allreduce["ok"] else "WRONG"
        sys.stdout.write(
            f"all-reduce {report['size_bytes'] / 2**20:g} MB on {n} ranks: sum {verdict}, "
            f"{allreduce['seconds'] * 1e3:.2f} ms, algbw {allreduce['algbw_gbs']:.2f} GB/s, "
            f"busbw {allreduce['busbw_gbs']:.2f} GB/s (nccl-tests' formula)\n"
        )
    else:
        sys.stdout.write(f"all-reduce FAILED: {allreduce.get('error')}\n")
    for flag in report["flags"]:
        if flag["kind"] == "failing":
            sys.stdout.write(f"FAILING link rank {flag['src']} -> rank {flag['dst']}: {flag['what']}\n")
        else:
            sys.stdout.write(f"slow link rank {flag['src']} -> rank {flag['dst']}: {flag['what']} "
                             f"{flag['value']:.2f} vs median {flag['median']:.2f}\n")  # fmt: skip
    if not report["flags"]:
        sys.stdout.write("no slow or failing links\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnose_comm.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    _heatmap(report, out / "comm_heatmap.png")
    sys.stdout.write(f"report: {out / 'diagnose_comm.json'}, heatmap: {out / 'comm_heatmap.png'}\n")
    failing = any(f["kind"] == "failing" for f in report["flags"])
    return 1 if failing or not allreduce.get("ok") else 0


def _heatmap(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, key, title in (
        (axes[0], "bandwidth_gbs", "bandwidth GB/s"),
        (axes[1], "latency_us", "latency us"),
    ):
        values = np.array([[np.nan if v is None else v for v in row] for row in report[key]], dtype=float)
        image = ax.imshow(values, cmap="viridis" if key == "bandwidth_gbs" else "viridis_r")
        ax.set_title(title)
        ax.set_xlabel("to rank")
        ax.set_ylabel("from rank")
        figure.colorbar(image, ax=ax, shrink=0.8)
    figure.suptitle(f"rlinf-hpc diagnose comm ({report['backend']}, {len(report['hosts'])} ranks)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# -- memory ------------------------------------------------------------------------------------


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag} is not JSON ({exc}): give an object, e.g. {flag} '{{\"n\": 3}}'.") from None
    if not isinstance(value, dict):
        raise UserError(f"{flag} must be a JSON object (keyword arguments), got {type(value).__name__}.")
    return value


def _memory_target(target: str, options: dict[str, Any]) -> Any:
    """The callable to measure: a function, or a method of a worker set up on its own."""
    from rlinf_hpc.imports import import_path
    from rlinf_hpc.workers import Worker

    module, _, name = target.partition(":")
    owner, dot, method = name.partition(".")
    obj = import_path(f"{module}:{owner}", "diagnose memory target")
    if not dot:
        if not callable(obj):
            raise UserError(f"diagnose memory target '{target}' is not callable.")
        return obj
    if not (isinstance(obj, type) and issubclass(obj, Worker)):
        raise UserError(f"diagnose memory target '{target}': '{owner}' is not a rlinf_hpc Worker subclass.")
    worker = standalone_worker(obj, options)
    bound = getattr(worker, method, None)
    if bound is None or not callable(bound):
        raise UserError(f"diagnose memory target '{target}': {owner} has no method '{method}'.")
    return bound


def standalone_worker(cls: type, options: dict[str, Any]) -> Any:
    """A worker of its own one-rank group, outside any job (no coordinator to ask)."""
    from rlinf_hpc.comm import DataPlane, create_group_comm

    def no_coordinator(what: str, payload: dict[str, Any]) -> Any:
        raise RuntimeError(f"{what}: a worker measured by `diagnose memory` has no coordinator")

    device = "cpu"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        device = "cuda:0"
    worker = cls()
    worker._bind(
        "diagnose", 0, device, 0, create_group_comm("diagnose", [0], 7_202), DataPlane(), no_coordinator
    )
    worker.setup(**options)
    return worker


def _memory(args: argparse.Namespace) -> int:
    from rlinf_hpc.runtime.console import print_table
    from rlinf_hpc.runtime.memcheck import measure_growth

    if args.iterations < 3 or args.warmup < 0 or args.top < 0:
        raise UserError("diagnose memory: --iterations must be >= 3 (a slope needs points), --warmup >= 0.")
    kwargs = _json_object(args.kwargs, "--kwargs")
    step = _memory_target(args.target, _json_object(args.options, "--options"))
    sys.stdout.write(f"[diagnose] calling {args.target} {args.warmup} + {args.iterations} times\n")
    report = measure_growth(
        lambda: step(**kwargs),
        args.iterations,
        args.warmup,
        args.top,
        cuda_snapshot=Path(args.cuda_snapshot) if args.cuda_snapshot else None,
    ).as_dict()
    device = report["device_mb_per_iter"]
    rss = report["rss_mb"]
    rows = [
        ("host RSS", f"{report['rss_mb_per_iter']:.3f} MB/call", f"{rss[0]:.0f} -> {rss[-1]:.0f} MB"),
        ("Python heap (tracemalloc)", f"{report['python_kb_per_iter']:.1f} KB/call",
         f"{report['python_mb'][0]:.1f} -> {report['python_mb'][-1]:.1f} MB"),
    ]  # fmt: skip
    if device is not None:
        rows.append(("CUDA allocated", f"{device:.3f} MB/call", f"{report['device_mb'][-1]:.0f} MB"))
    each = report["seconds_per_iter"] * 1e3
    print_table(f"memory growth over {args.iterations} calls ({each:.1f} ms each)",
                ["what", "growth", "first -> last"], rows)  # fmt: skip
    sites = [
        (s["site"], f"{s['kb_per_iter']:.1f}", str(s["blocks"]), f"{s['total_kb']:.0f}")
        for s in report["top_sites"]
    ]
    print_table("top allocation sites (growth since the warm-up)", ["site", "KB/call", "blocks", "total KB"],
                sites or [("(none grew)", "", "", "")])  # fmt: skip
    if report["cuda_snapshot"]:
        sys.stdout.write(
            f"CUDA memory snapshot: {report['cuda_snapshot']} (open at pytorch.org/memory_viz)\n"
        )
    _write_json(args.json, report)
    return 0
