"""Rank 0's console summaries (tables) via rich; plain text when stdout is not a terminal."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


def console() -> Console:
    """A console on stdout, 120 columns when not a terminal (job output files)."""
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120, soft_wrap=False)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a titled table in one write so rank-interleaved output cannot split it."""
    table = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    out = console()
    wanted = Measurement.get(out, out.options.update_width(10_000), table).maximum
    if not sys.stdout.isatty() and wanted > out.width:  # a file: whole cells, never "off_polic…"
        out = Console(file=sys.stdout, width=wanted, soft_wrap=False)
    with out.capture() as capture:
        out.print(table)
    sys.stdout.write(capture.get())
    sys.stdout.flush()
