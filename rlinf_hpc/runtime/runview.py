"""A run directory read from outside, by the operator's tools (`monitor`, `profile`, `trace`):
its summary, every rank's heartbeat, its events and metrics — never written to.

>>> import tempfile
>>> RunView.open(Path(tempfile.mkdtemp()) / "missing", "monitor")
Traceback (most recent call last):
...
rlinf_hpc.errors.UserError: monitor: run directory '...missing' does not exist. ...
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import tomllib

from rlinf_hpc.errors import UserError
from rlinf_hpc.runtime.heartbeat import HEARTBEATS, read_heartbeat

_MARKERS = ("summary.json", "events.jsonl", HEARTBEATS)


class JsonlTail:
    """The complete lines appended to a JSONL file since the last `read`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as file:
                file.seek(self.offset)
                chunk = file.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in chunk[:end].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out


class RunView:
    """What a run directory says now."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def open(cls, path: Path, command: str) -> RunView:
        example = f"`rlinf-hpc {command} runs/math-grpo-tiny`"
        if not path.exists():
            raise UserError(
                f"{command}: run directory '{path}' does not exist. Pass the --run-dir of a job "
                f"(running or finished), e.g. {example}."
            )
        if not path.is_dir() or not any((path / m).exists() for m in _MARKERS):
            raise UserError(
                f"{command}: '{path}' is not a run directory (no summary.json, events.jsonl or "
                f"heartbeats/ in it). Pass the --run-dir a job was started with, e.g. {example}."
            )
        return cls(path)

    def summary(self) -> dict[str, Any]:
        return read_heartbeat(self.path / "summary.json") or {}

    def config(self) -> dict[str, Any]:
        try:
            return tomllib.loads((self.path / "config.toml").read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):
            return {}

    def heartbeat_s(self) -> float:
        return float(self.config().get("watchdog", {}).get("heartbeat_s", 2.0))

    def heartbeats(self) -> list[dict[str, Any]]:
        records = [read_heartbeat(p) for p in (self.path / HEARTBEATS).glob("rank-*.json")]
        return sorted((r for r in records if r), key=lambda r: int(r.get("rank", 0)))

    def running(self, now: float | None = None) -> bool:
        """The summary says running and some rank beat recently (a job killed outright leaves
        "running" behind, with beats that age)."""
        now = time.time() if now is None else now
        if self.summary().get("outcome") != "running":
            return False
        fresh = 10 * self.heartbeat_s() + 10
        return any(not r.get("left") and now - float(r.get("time", 0)) < fresh for r in self.heartbeats())

    def ranks_of(self, component: str) -> list[dict[str, Any]]:
        return [
            r
            for r in self.heartbeats()
            if component in str(r.get("roles", "")).split("+") and not r.get("left")
        ]

    def components(self) -> list[str]:
        names = {n for r in self.heartbeats() for n in str(r.get("roles", "")).split("+")}
        return sorted(names - {"", "idle", "coordinator"})
