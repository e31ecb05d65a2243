"""NCCL's failure reports: the variables every rank gets (a user's own win), and rank 0's watch
over NCCL's warning files, which names the rank that wrote each line."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from rlinf_hpc.runtime.nccl import NcclLogWatch, configure, settings
from rlinf_hpc.runtime.watchdog import rank_of_process


def test_configure_sets_what_is_missing_and_keeps_the_users_values(tmp_path: Path) -> None:
    env = {"NCCL_DEBUG": "INFO"}
    added = configure(tmp_path, env)
    assert env["NCCL_DEBUG"] == "INFO" and "NCCL_DEBUG" not in added
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl" / "nccl.%h.%p.log")
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl" / "trace_rank_")
    assert (tmp_path / "nccl").is_dir() and set(added) == set(settings(tmp_path)) - {"NCCL_DEBUG"}


def test_configure_without_a_writable_run_dir_sets_no_files(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    env: dict[str, str] = {}
    configure(blocker / "run", env)
    assert set(env) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG"}


def test_new_warning_lines_are_read_once_and_named_by_rank(tmp_path: Path) -> None:
    host = socket.gethostname()
    beats = tmp_path / "heartbeats"
    beats.mkdir()
    (beats / "rank-3.json").write_text(json.dumps({"rank": 3, "pid": 4242, "host": host}))
    (tmp_path / "nccl").mkdir()
    log = tmp_path / "nccl" / f"nccl.{host}.4242.log"
    log.write_text(f"{host}:4242:4300 [0] NCCL INFO Bootstrap\n{host}:4242:4300 [0] NCCL WARN NET/IB : "
                   "Got completion from peer 10.0.0.2<40007> with error 12\npartial")  # fmt: skip
    watch = NcclLogWatch(tmp_path, lambda h, pid: rank_of_process(tmp_path, h, pid))
    found = watch.scan()
    assert [(f["rank"], f["pid"], f["host"]) for f in found] == [(3, 4242, host)]
    assert "Got completion from peer 10.0.0.2" in found[0]["line"]
    assert watch.scan() == []  # nothing new
    with log.open("a") as file:
        file.write(" line NCCL WARN Call to ibv_modify_qp failed\n")
    (tmp_path / "nccl" / f"nccl.{host}.999.log").write_text("x NCCL WARN unknown process\n")
    later = watch.scan()
    assert [(f["rank"], f["pid"]) for f in later] == [(3, 4242), (None, 999)]
    assert later[0]["line"].startswith("partial line NCCL WARN")
    assert os.path.exists(log)
