"""Was a rank that died killed by the kernel's OOM killer? The evidence a dead process leaves.

A rank the OOM killer ends gets SIGKILL: to the job it looks like any ``kill -9`` ("died ...
killed, or a crash below Python"), and the user is left to guess — the most common cause of a
dead rank in RL post-training, and the one with the clearest fix. Nothing of the process is
left to ask once it is gone, so its heartbeat carries what is needed (`cgroup_state`: its
memory cgroup and the cgroup's OOM-kill count at each beat, ``boot_s``: when it started on the
kernel's clock), and at its death `death_cause` looks for:

1. the kernel log's record of the kill (``/dev/kmsg``: "Killed process PID", with the
   constraint — the cgroup's limit or the whole node — and the RSS at the kill), readable by root
   or where ``kernel.dmesg_restrict = 0``; matched on the pid and on a time after the rank's start,
   so a recycled pid is not taken for it;
2. else the memory cgroup's own count (cgroup v2 ``memory.events``, v1 ``memory.oom_control``:
   ``oom_kill N``) risen since the rank's last beat: readable by anyone, but shared by every
   process of the cgroup (a SLURM step's ranks share one), so said as "most likely".

Before it comes to that, `PressureWatch` warns when a memory cgroup's working set or a node's
memory in use nears its limit, naming the ranks that hold most.

No library does this (psutil reads neither file); it is ~100 lines of parsing, kept apart from
the watch that uses it. Ranks on other nodes are not judged: their files are not on this one.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any

#: "Killed process 6152 (python3) total-vm:221404kB, anon-rss:211200kB, ..." (every kernel since 2.6)
_KILLED = re.compile(r"Killed process (\d+) \(([^)]*)\).*?anon-rss:(\d+)kB")
#: "oom-kill:constraint=CONSTRAINT_MEMCG,...,pid=6152,uid=0" (kernels since 4.19)
_CONSTRAINT = re.compile(r"oom-kill:constraint=(\w+),.*?[,]pid=(\d+)")
#: (usage file, its inactive file cache in memory.stat): cgroup v2, v1
_USAGE = (("memory.current", "inactive_file"), ("memory.usage_in_bytes", "total_inactive_file"))
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def memory_cgroup(proc_cgroup: str, mountinfo: str) -> Path | None:
    """The directory of the memory cgroup described by ``/proc/PID/cgroup``'s text, given
    ``/proc/self/mountinfo``'s: the v1 ``memory`` hierarchy where one is mounted, else cgroup v2
    (the unified one, where the memory controller then is)."""
    v1: dict[str, tuple[str, str]] = {}
    v2: tuple[str, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split(" - ", 1)
        if len(fields) != 2:
            continue
        before, after = fields[0].split(), fields[1].split()
        if len(before) < 5 or len(after) < 3:
            continue
        root, mount, fstype = before[3], before[4], after[0]
        if fstype == "cgroup2" and v2 is None:
            v2 = (root, mount)
        elif fstype == "cgroup":
            for option in after[2].split(","):
                v1[option] = (root, mount)
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts[0], parts[1].split(","), parts[2]
        if "memory" in controllers and "memory" in v1:
            root, mount = v1["memory"]
        elif hierarchy == "0" and controllers == [""] and "memory" not in v1 and v2 is not None:
            root, mount = v2
        else:
            continue
        if root != "/" and path.startswith(root):
            path = path[len(root) :]  # a container's view: the mount's root is its own cgroup
        return Path(mount + path.rstrip("/")) if path != "/" else Path(mount)
    return None


def oom_kills(cgroup: Path) -> int | None:
    """The cgroup's count of processes the OOM killer ended (None: not readable here)."""
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        with contextlib.suppress(OSError, ValueError):
            for line in (cgroup / name).read_text(encoding="ascii").splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return None


def memory_limit_mb(cgroup: Path) -> float | None:
    for name in ("memory.max", "memory.limit_in_bytes"):  # v2, v1
        with contextlib.suppress(OSError, ValueError):
            text = (cgroup / name).read_text(encoding="ascii").strip()
            if text == "max" or int(text) >= _UNLIMITED:
                return None
            return int(text) / 2**20
    return None


def working_set_mb(cgroup: Path) -> float | None:
    """What the cgroup's processes hold that the kernel cannot simply drop: its usage less its
    inactive file cache (the kubelet's "working set"). Usage alone counts the page cache, which
    fills any limit on a job that reads data and is reclaimed before the OOM killer acts."""
    for usage_name, inactive_key in _USAGE:
        try:
            usage = int((cgroup / usage_name).read_text(encoding="ascii"))
        except (OSError, ValueError):
            continue
        inactive = 0
        with contextlib.suppress(OSError, ValueError):
            for line in (cgroup / "memory.stat").read_text(encoding="ascii").splitlines():
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
        return max(usage - inactive, 0) / 2**20
    return None


def node_memory_mb() -> tuple[float, float] | None:
    """This node's (total, available) memory: /proc/meminfo's MemTotal and MemAvailable."""
    found = {}
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                found[key] = int(value.split()[0]) / 1024
    if len(found) < 2:
        return None
    return found["MemTotal"], found["MemAvailable"]


def cgroup_state() -> dict[str, Any]:
    """For the heartbeat: this process's memory cgroup, its OOM-kill count, its working set
    and limit when it has one, and the node's memory."""
    out: dict[str, Any] = {}
    node = node_memory_mb()
    if node is not None:
        out["node_total_mb"], out["node_available_mb"] = round(node[0], 1), round(node[1], 1)
    try:
        with open("/proc/self/cgroup", encoding="ascii") as own, open("/proc/self/mountinfo") as mounts:
            cgroup = memory_cgroup(own.read(), mounts.read())
    except OSError:
        return out
    if cgroup is None:
        return out
    out.update(cgroup=str(cgroup), oom_kills=oom_kills(cgroup))
    limit = memory_limit_mb(cgroup)
    used = working_set_mb(cgroup) if limit is not None else None
    if limit is not None and used is not None:
        out["cgroup_used_mb"], out["cgroup_limit_mb"] = round(used, 1), round(limit, 1)
    return out


class PressureWatch:
    """Rank 0's warning before the OOM killer: a memory cgroup (a SLURM step's, with ``--mem``)
    whose working set, or a node whose memory in use, reaches ``fraction`` of its limit is
    reported once, with the ranks there that hold most; again only after it fell 5 points below."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self._raised: set[tuple[str, str]] = set()

    def scan(self, records: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        """New warnings from the ranks' heartbeat ``records``: ``{"host", "scope", "used_mb",
        "limit_mb", "ranks": [(rank, roles, rss_mb), ...]}`` (scope: the cgroup or "node")."""
        places: dict[tuple[str, str], tuple[float, float, list[int]]] = {}
        for rank, record in sorted(records.items()):
            host = str(record.get("host"))
            if record.get("cgroup_limit_mb") and record.get("cgroup_used_mb") is not None:
                key = (host, str(record.get("cgroup")))
                places.setdefault(
                    key, (float(record["cgroup_used_mb"]), float(record["cgroup_limit_mb"]), [])
                )
                places[key][2].append(rank)
            if record.get("node_total_mb") and record.get("node_available_mb") is not None:
                total = float(record["node_total_mb"])
                places.setdefault((host, "node"), (total - float(record["node_available_mb"]), total, []))
                places[(host, "node")][2].append(rank)
        out = []
        for key, (used, limit, ranks) in places.items():
            share = used / limit
            if key in self._raised:
                if share < self.fraction - 0.05:
                    self._raised.discard(key)
                continue
            if share >= self.fraction:
                self._raised.add(key)
                top = sorted(ranks, key=lambda r: -float(records[r].get("rss_mb") or 0.0))[:3]
                named = [
                    (r, records[r].get("roles") or "-", float(records[r].get("rss_mb") or 0.0)) for r in top
                ]
                out.append({"host": key[0], "scope": key[1], "used_mb": round(used, 1),
                            "limit_mb": round(limit, 1), "ranks": named})  # fmt: skip
        return out


def describe_pressure(warning: dict[str, Any]) -> str:
    where = (
        f"node {warning['host']}'s memory"
        if warning["scope"] == "node"
        else f"the memory cgroup {warning['scope']} on {warning['host']}"
    )
    holders = ", ".join(f"rank {r} ({roles}) {rss:.0f} MB" for r, roles, rss in warning["ranks"])
    return (
        f"{where} is {warning['used_mb'] / warning['limit_mb']:.0%} full ({warning['used_mb']:.0f} of "
        f"{warning['limit_mb']:.0f} MB): the kernel's OOM killer ends a rank at 100%; holding most: "
        f"{holders}"
    )


def boot_seconds() -> float:
    """Now on the clock of the kernel log's timestamps (seconds since boot)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def kernel_kill_record(kmsg: str, pid: int, after_s: float) -> dict[str, Any] | None:
    """The OOM killer's record of killing ``pid`` at or after ``after_s`` (seconds since boot),
    from ``/dev/kmsg``'s text (``PRIO,SEQ,USEC,FLAGS;MESSAGE`` per line); None if it has none."""
    constraints: dict[int, str] = {}
    found = None
    for line in kmsg.splitlines():
        head, _, message = line.partition(";")
        fields = head.split(",")
        if len(fields) < 3 or not fields[2].isdigit():
            continue
        at = int(fields[2]) / 1e6
        constraint = _CONSTRAINT.search(message)
        if constraint:
            constraints[int(constraint.group(2))] = constraint.group(1)
        killed = _KILLED.search(message)
        if killed and int(killed.group(1)) == pid and at >= after_s:
            found = {"at_s": at, "name": killed.group(2), "rss_mb": int(killed.group(3)) / 1024}
    if found is not None:
        found["constraint"] = constraints.get(pid, "")
    return found


def read_kernel_log() -> str | None:
    """The kernel log's records still in its ring buffer (None: not readable by this user)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    chunks = []
    try:
        while True:
            try:
                chunks.append(os.read(fd, 8192).decode("utf-8", "replace"))
            except BlockingIOError:
                break  # the end of the buffer
            except BrokenPipeError:
                continue  # records overwritten while reading: go on from the next one
            except OSError:
                break
    finally:
        os.close(fd)
    return "".join(chunks)


def death_cause(record: dict[str, Any], kmsg: str | None = None) -> dict[str, Any] | None:
    """Why the rank of heartbeat ``record`` died, if its node says (``{"kind": "oom_kill",
    "detail": ...}``); None when nothing here says. Call it on the rank's node only."""
    pid, cgroup = record.get("pid"), record.get("cgroup")
    limit = memory_limit_mb(Path(cgroup)) if cgroup else None
    limit_said = f" ({limit:.0f} MB)" if limit is not None else ""
    fix = (
        "give it more memory (sbatch --mem / --mem-per-cpu, or fewer ranks per node), or lower what "
        "it holds (batch or micro-batch sizes, offload)"
    )
    kmsg = read_kernel_log() if kmsg is None else kmsg
    if isinstance(pid, int) and kmsg:
        kill = kernel_kill_record(kmsg, pid, float(record.get("boot_s", 0.0)) - 1.0)
        if kill is not None:
            constraint = kill["constraint"]
            if constraint == "CONSTRAINT_MEMCG":
                where = f"its memory cgroup's limit{limit_said} was reached"
            elif constraint in ("CONSTRAINT_NONE", ""):
                where = "the node ran out of memory"
            else:  # a cpuset's or a memory policy's nodes ran out
                where = f"its allowed memory ran out ({constraint})"
            return {
                "kind": "oom_kill",
                "detail": f"killed by the kernel's OOM killer: {where}, {kill['rss_mb']:.0f} MB resident "
                f"at the kill (kernel log); {fix}",
                "rss_mb": round(kill["rss_mb"], 1),
                "certain": True,  # the kernel says it killed this very process
            }
    before = record.get("oom_kills")
    if cgroup and isinstance(before, int):
        now = oom_kills(Path(cgroup))
        if now is not None and now > before:
            return {
                "kind": "oom_kill",
                "detail": f"most likely killed by the kernel's OOM killer: its memory cgroup{limit_said} "
                f"counted {now - before} OOM kill(s) since its last heartbeat ({cgroup}); {fix}",
            }
    return None
