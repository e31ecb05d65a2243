"""Rank-prefixed logging: one line per event, each written with a single write call.

Several ranks share the job's stdout; a line written in one call does not interleave with
another rank's. Every record carries the world rank and the rank's role (``coord`` or a
component name).
"""

from __future__ import annotations

import logging
import sys
import time

_LOGGER_NAME = "rlinf_hpc"
_state = {"rank": "?", "role": "init"}


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        millis = int(record.msecs)
        prefix = f"{stamp}.{millis:03d} [r{_state['rank']} {_state['role']}]"
        level = "" if record.levelno == logging.INFO else f" {record.levelname}"
        text = f"{prefix}{level} {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _SingleWriteHandler(logging.StreamHandler):
    """Writes record + newline in one call and flushes, so lines from ranks do not interleave."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + "\n")
            self.flush()
        except Exception:  # noqa: BLE001 - logging must never kill a rank
            self.handleError(record)


def setup_logging(rank: int | str, role: str, level: str = "info") -> logging.Logger:
    """Configure the package logger for this rank. Safe to call again to change role or level."""
    _state["rank"] = str(rank)
    _state["role"] = role
    logger = logging.getLogger(_LOGGER_NAME)
    logger.setLevel(level.upper())
    if not any(isinstance(h, _SingleWriteHandler) for h in logger.handlers):
        handler = _SingleWriteHandler(sys.stderr)
        handler.setFormatter(_RankFormatter())
        logger.addHandler(handler)
    logger.propagate = False
    return logger


def set_role(role: str) -> None:
    """Change the role shown in this rank's log prefix (e.g. after it joins a component)."""
    _state["role"] = role


def get_logger(name: str | None = None) -> logging.Logger:
    """The package logger, or a child of it (``get_logger("comm")``)."""
    return logging.getLogger(_LOGGER_NAME if not name else f"{_LOGGER_NAME}.{name}")


def is_primary_rank() -> bool:
    """True on world rank 0, and before the rank is known (so early errors are printed)."""
    return _state["rank"] in ("?", "0")
