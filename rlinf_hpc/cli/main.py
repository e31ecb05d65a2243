"""The `rlinf-hpc` command: run, submit, info, trace, diagnose, monitor, profile, config.

User mistakes end with one paragraph on stderr and exit code 2 (traceback only with --debug).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import textwrap
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlinf_hpc.errors import EXIT_USER_ERROR, JobInterrupted, UserError
from rlinf_hpc.log import is_primary_rank


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    # --debug works before or after the subcommand; SUPPRESS keeps a subcommand's default from
    # overwriting a --debug given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for user errors"
    )
    parser = argparse.ArgumentParser(
        prog="rlinf-hpc",
        parents=[common],
        description="RL post-training as SLURM jobs of MPI ranks. Rank 0 coordinates; the other "
        "ranks form the component groups named in the config.",
        epilog="Examples:\n  rlinf-hpc run configs/hello.toml --np 4\n"
        "  sbatch slurm/single_node.sbatch configs/hello.toml\n  rlinf-hpc config schema",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        parents=[common],
        help="run a job from a TOML config",
        description="Run a job. Outside srun/mpiexec it starts its own ranks with the venv's "
        "mpiexec (--np, default job.num_ranks); inside a SLURM step or an mpiexec it runs in place.",
    )
    run.add_argument("config", help="path of the TOML job config")
    run.add_argument("--np", type=_positive_int, help="ranks to start (default: job.num_ranks)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set job.num_ranks=8 (repeatable)",
    )
    run.add_argument(
        "--run-dir",
        help="directory for this run's config, events, metrics, checkpoints and summary (default: a fresh "
        "runs/JOB_NAME-YYYYmmdd-HHMMSS)",
    )
    run.add_argument(
        "--resume",
        default="auto",
        metavar="auto|never|PATH",
        help="auto (default): continue from the newest complete checkpoint in the checkpoint "
        "directory if there is one; never: start afresh (earlier checkpoints are moved aside); "
        "PATH: a step-N checkpoint directory (or a directory of them)",
    )
    run.add_argument(
        "--force-resume",
        action="store_true",
        help="resume although config keys differ from the checkpoint's (model and task keys "
        "are refused even then)",
    )

    submit = commands.add_parser(
        "submit",
        parents=[common],
        help="write the batch script of a long job (signal, requeue, resume) and sbatch it",
        description="Writes RUN_DIR/job.sbatch for CONFIG (tasks from the placement, GPUs from the "
        "components, SIGUSR2 before the limit, --requeue, --open-mode=append), shows it and "
        "submits it. Extra sbatch flags go after `--`.",
    )
    submit.add_argument("config", help="path of the TOML job config")
    submit.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument("--run-dir", help="run directory (default runs/JOB_NAME)")
    submit.add_argument("--time", default="04:00:00", help="time limit (sbatch --time), default 04:00:00")
    submit.add_argument("--partition", help="SLURM partition")
    submit.add_argument("--nodes", type=_positive_int, default=1, help="nodes (default 1)")
    submit.add_argument(
        "--signal-seconds",
        type=_positive_int,
        help="SIGUSR2 this many seconds before the limit (default checkpoint.signal_seconds)",
    )
    submit.add_argument("--dry-run", action="store_true", help="write and show the script, do not submit")

    info = commands.add_parser(
        "info", parents=[common], help="print job environment, MPI, ranks, devices, NVML status"
    )
    info.add_argument("--np", type=_positive_int, help="start this many ranks and describe them")

    from rlinf_hpc.cli import diagnose, monitor, profile, trace

    trace.add_parser(commands, common)
    diagnose.add_parser(commands, common)
    monitor.add_parser(commands, common)
    profile.add_parser(commands, common)

    config = commands.add_parser("config", parents=[common], help="inspect configs")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="WHAT")
    show = config_commands.add_parser("show", parents=[common], help="print the resolved config")
    show.add_argument("config", help="path of the TOML job config")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    schema = config_commands.add_parser(
        "schema", parents=[common], help="list every config key with type, default and doc"
    )
    schema.add_argument(
        "--app",
        metavar="RUNNER",
        help="only this app's sections: a registered name or an import path package.module:APP "
        "(default: the framework's keys, then every registered app's)",
    )
    return parser


def _cmd_config_show(args: argparse.Namespace) -> int:
    from rlinf_hpc.config import config_to_toml, load_config

    sys.stdout.write(config_to_toml(load_config(args.config, args.overrides)))
    return 0


def _cmd_config_schema(args: argparse.Namespace) -> int:
    from rlinf_hpc.config.apps import registered_apps, resolve_app
    from rlinf_hpc.config.describe import schema_keys

    parts = []
    if args.app:
        parts.append(
            (f"app '{args.app}' ([flow] runner = \"{args.app}\")", schema_keys(resolve_app(args.app)))
        )
    else:
        parts.append(("the framework", schema_keys()))
        for name in registered_apps():
            title = f"app '{name}' ([flow] runner = \"{name}\")"
            try:
                parts.append((title, schema_keys(resolve_app(name))))
            except UserError as exc:  # one broken app does not hide the others
                parts.append((f"{title}: cannot be loaded: {exc}", []))
    width = max((len(k.key) for _, keys in parts for k in keys), default=10)
    for title, keys in parts:
        sys.stdout.write(f"# {title}\n")
        if not keys and "cannot be loaded" not in title:
            sys.stdout.write("  (no sections of its own)\n")
        for key in keys:
            sys.stdout.write(f"{key.key:<{width}}  {key.type}  (default: {key.default})\n")
            for line in textwrap.wrap(key.doc, 90):
                sys.stdout.write(f"{'':<{width}}    {line}\n")
        sys.stdout.write("\n")
    return 0


def _precheck_placement(config_path: str, overrides: list[str], num_ranks: int) -> None:
    """Before starting ranks locally, make sure the config and the rank count can work."""
    from rlinf_hpc.cluster import RankInfo, build_topology, probe_gpus
    from rlinf_hpc.cluster.hetjob import read_het_layout
    from rlinf_hpc.config import load_config
    from rlinf_hpc.scheduler.placement import plan_placement

    config = load_config(config_path, overrides)
    gpus = probe_gpus()
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    host = socket.gethostname()
    layout = read_het_layout()  # a heterogeneous job's parts (RLINF_HPC_HET_TASKS under mpiexec)
    if layout is not None and layout.total != num_ranks:
        raise UserError(
            f"the heterogeneous layout has {layout.total} tasks ({layout.describe()}) but the job "
            f"starts {num_ranks} ranks: make RLINF_HPC_HET_TASKS (or the #SBATCH hetjob parts) add up "
            "to job.num_ranks / --np."
        )
    infos = [
        RankInfo(r, host, 0, r, cpus, gpus, het_group=layout.group_of(r) if layout else None)
        for r in range(num_ranks)
    ]
    plan_placement(config, build_topology(infos))
    _precheck_app(config)


def _precheck_app(config: Any) -> None:
    """The app's own input checks (data files, model directory, environment ids) before any
    rank starts: a mistake costs no launch. Rank 0 runs them again in the job (an in-place
    srun/mpiexec start comes there without this); their warnings are left to it."""
    import logging

    from rlinf_hpc.config.apps import app_of

    validate = app_of(config).validate_function()
    if validate is None:
        return
    logger = logging.getLogger("rlinf_hpc")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        validate(config)
    finally:
        logger.setLevel(level)


def _cmd_run(args: argparse.Namespace, argv: list[str]) -> int:
    from rlinf_hpc.cluster import detect_environment

    environment = detect_environment()
    if environment.needs_launch:
        from rlinf_hpc.cli.launch import launch_ranks
        from rlinf_hpc.config import load_config
        from rlinf_hpc.runtime.rundir import RunDirectory, default_run_dir

        config = load_config(args.config, args.overrides)
        num_ranks = args.np or environment.slurm_num_tasks or config.job.num_ranks
        _precheck_placement(args.config, args.overrides, num_ranks)
        if not args.run_dir:  # chosen here, so that every rank gets the same name
            args.run_dir = str(default_run_dir(config.job.name))
            argv = [*argv, "--run-dir", args.run_dir]
        RunDirectory(Path(args.run_dir)).check_free(environment.slurm_job_id)  # before any rank starts
        launch_ranks(num_ranks, environment, argv)
    from rlinf_hpc.cluster.allocation import run_deferred_requeue
    from rlinf_hpc.comm import finalize
    from rlinf_hpc.runners.job import JobRequest, run_job

    options = (args.run_dir, args.np, args.resume, args.force_resume)
    request = JobRequest(args.config, tuple(args.overrides), *options)
    try:
        end = run_job(request)
    except (UserError, SystemExit):
        raise  # every rank raises it alike (rank 0's verdict is broadcast): none waits for another
    except BaseException as exc:  # past the job's own handling: say it, then leave MPI in bounds
        traceback.print_exc()  # (left to the interpreter, MPI_Finalize came first: mpi4py's atexit
        sys.stderr.flush()  # hook, unbounded, waited for a dead rank until the launcher's SIGKILL)
        if "mpi4py.MPI" in sys.modules:
            finalize(within=FINALIZE_AFTER_FAILURE_S)
        return exc.exit_code if isinstance(exc, JobInterrupted) else 1
    code = end.code
    # after a failure or a signal the job is ending: do not wait long for ranks that are gone
    # (its stacks, if it waits past that, to the run directory: the job has said what failed)
    stacks = end.run_dir / "stacks" if end.run_dir is not None and code else None
    finalize(within=FINALIZE_AFTER_FAILURE_S if code else FINALIZE_S, stacks=stacks)
    run_deferred_requeue()  # after a deadline save in SLURM: MPI is finalized first
    return code


#: How long a rank waits in MPI_Finalize for the others: after a clean end (the coordinator may
#: still be writing its records), and after a failure or a signal (`comm.finalize`).
FINALIZE_S = 120.0
FINALIZE_AFTER_FAILURE_S = 10.0


def _cmd_submit(args: argparse.Namespace) -> int:
    from rlinf_hpc.cli.submit import SubmitOptions, submit
    from rlinf_hpc.config import load_config

    seconds = args.signal_seconds or load_config(args.config, args.overrides).checkpoint.signal_seconds
    options = SubmitOptions(args.time, args.partition, args.nodes, seconds, tuple(args.sbatch_flags))
    return submit(args.config, args.overrides, args.run_dir, options, args.dry_run)


def _cmd_info(args: argparse.Namespace, argv: list[str]) -> int:
    from rlinf_hpc.cluster import detect_environment

    environment = detect_environment()
    if environment.needs_launch and args.np:
        from rlinf_hpc.cli.launch import launch_ranks

        launch_ranks(args.np, environment, argv)
    from rlinf_hpc.cli.info import run_info

    return run_info()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlinf-hpc`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sbatch_flags: list[str] = []
    if argv[:1] == ["submit"] and "--" in argv:  # `submit CONFIG ... -- SBATCH FLAGS`
        cut = argv.index("--")
        argv, sbatch_flags = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    args.sbatch_flags = sbatch_flags
    args.debug = getattr(args, "debug", False)
    try:
        if args.command == "run":
            return _cmd_run(args, argv)
        if args.command == "submit":
            return _cmd_submit(args)
        if args.command == "info":
            return _cmd_info(args, argv)
        if args.command in ("trace", "diagnose", "monitor", "profile"):
            from rlinf_hpc.cli import diagnose, monitor, profile, trace

            if args.command == "diagnose":
                return diagnose.run(args, argv)
            return {"trace": trace, "monitor": monitor, "profile": profile}[args.command].run(args)
        if args.config_command == "show":
            return _cmd_config_show(args)
        return _cmd_config_schema(args)
    except UserError as exc:
        if args.debug:
            raise
        if is_primary_rank():
            sys.stderr.write(f"rlinf-hpc: error: {exc}\n")
            sys.stderr.flush()
        return EXIT_USER_ERROR
