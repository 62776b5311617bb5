"""Terminal rendering for the CLI (rich): tables, summaries, progress bars."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from datetime import datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

# piped output is not wrapped at 80 columns (lines stay greppable)
console = Console(soft_wrap=not sys.stdout.isatty(), width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, soft_wrap=not sys.stderr.isatty())


def human_bytes(n: float | int | Decimal | None) -> str:
    n = float(n or 0)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def fmt(value: Any, width: int = 80) -> Text:
    """A cell as plain text: data is never Rich markup (``[/INST]`` stays text) and control
    characters (escape sequences, bidi overrides) are shown escaped, never sent to the terminal."""
    if value is None:
        return Text("∅")
    if isinstance(value, datetime):
        return Text(value.isoformat(timespec="seconds"))
    if isinstance(value, Decimal):
        value = int(value) if value == value.to_integral_value() else float(value)
    text = str(value).replace("\n", "⏎").replace("\t", "⇥")
    text = _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)
    return Text(text if len(text) <= width else text[: width - 1] + "…")


def arrow_table(data: pa.Table, title: str | None = None, max_rows: int = 50, max_width: int = 40) -> Table:
    """A query result as a table that stays one line per row: each cell shows at most ``max_width``
    characters (longer ones end with an ellipsis, line breaks shown as ``⏎``), so a wide result
    keeps its columns side by side. ``max_width=0``: whole values, folded."""
    table = Table(title=title, show_lines=False, header_style="bold")
    for name in data.column_names:
        if max_width:
            table.add_column(name, overflow="ellipsis", no_wrap=True, max_width=max(max_width, 4))
        else:
            table.add_column(name, overflow="fold")
    for row in data.slice(0, max_rows).to_pylist():
        table.add_row(*(fmt(v, width=max(max_width, 4) if max_width else 1 << 30) for v in row.values()))
    if data.num_rows > max_rows:
        table.caption = f"{data.num_rows} rows, first {max_rows} shown (use --max-rows or --format/--out)"
    else:
        table.caption = f"{data.num_rows} row{'s' if data.num_rows != 1 else ''}"
    return table


def dict_table(rows: list[dict[str, Any]], title: str | None = None) -> Table:
    table = Table(title=title, header_style="bold")
    if not rows:
        table.add_column("(none)")
        return table
    for name in rows[0]:
        table.add_column(name, overflow="fold", justify="right" if isinstance(rows[0][name], int | float | Decimal) else "left")
    for r in rows:
        table.add_row(*(fmt(v) if k != "bytes" else human_bytes(v) for k, v in r.items()))
    return table


@contextlib.contextmanager
def byte_progress(description: str, total: int) -> Iterator[Any]:
    """A progress bar over bytes; yields ``advance(n)``. Hidden when stderr is not a terminal."""
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=err_console, disable=not sys.stderr.isatty(), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


@contextlib.contextmanager
def count_progress(description: str, total: int | None = None) -> Iterator[Any]:
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=err_console, disable=not sys.stderr.isatty(), transient=True) as progress:
        task = progress.add_task(description, total=total)

        def advance(n: int) -> None:
            progress.advance(task, n)

        advance.set_total = lambda t: progress.update(task, total=t)  # type: ignore[attr-defined]
        advance.describe = lambda text: progress.update(task, description=text)  # type: ignore[attr-defined]
        yield advance
