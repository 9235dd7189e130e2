"""The CLI's tables, whole at any width, and its JSON for scripts.

Rich shrinks a table that is wider than the console by cutting its cells ("r…"): at 80 columns, or in a pipe
(Rich then assumes 80 unless COLUMNS says otherwise), a wide table became unreadable. ``fit`` keeps every cell
whole, on one line, and picks the first layout that fits the width:

1. the table as it is;
2. each column as wide as its longest cell, its header wrapped between words; a column made with
   ``overflow="fold"`` holds prose (a reason, an address list) and wraps between words too;
3. the same without the table's frame and column rules (spaces between the columns, a rule under the header);
4. transposed: a line per column, a column per row (a few rows of many figures: a benchmark's levels);
5. one block per row, each cell after its column's name (many rows of many columns).

Commands print through ``show`` and offer ``--json`` through ``emit_json``; what they print is theirs.
"""

from __future__ import annotations

import json
from typing import Any

import typer
from rich import box
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

#: wide enough that measuring never wraps anything
_UNBOUNDED = 10_000


def show(console: Console, table: Table) -> None:
    """Print ``table`` whole at ``console``'s width."""
    console.print(fit(table, console))


def fit(table: Table, console: Console) -> RenderableType:
    """The first of the layouts above in which every cell of ``table`` is whole at ``console``'s width."""
    width = console.width
    if _width(table, console) <= width:
        return table
    natural = ([column.width for column in table.columns], table.box, table.show_edge, table.pad_edge)
    for frameless in (False, True):
        if frameless:
            table.box, table.show_edge, table.pad_edge = box.SIMPLE_HEAD, False, False
        _narrow(table, console, width)
        if _width(table, console) <= width:
            return table
    widths, table.box, table.show_edge, table.pad_edge = natural
    for column, was in zip(table.columns, widths, strict=True):
        column.width = was
    turned = transposed(table)
    if _width(turned, console) <= width:
        return turned
    return records(table)


def transposed(table: Table) -> Table:
    """A line per column (its name, then its cell in each row), a column per row."""
    out = Table(title=table.title, show_header=False, box=table.box)
    out.add_column(style="bold", no_wrap=True)
    for _ in range(table.row_count):
        out.add_column(justify="right", no_wrap=True)
    for column in table.columns:
        out.add_row(column.header, *column.cells)
    return out


def records(table: Table) -> Group:
    """One block per row: each cell on a line of its own, after its column's name."""
    parts: list[RenderableType] = []
    if table.title:
        parts.append(Text.from_markup(table.title, style="italic") if isinstance(table.title, str) else table.title)
    columns = table.columns
    for row in range(table.row_count):
        block = Table.grid(padding=(0, 2))
        block.add_column(style="bold", no_wrap=True)
        block.add_column(overflow="fold")
        for column in columns:
            block.add_row(column.header, list(column.cells)[row])
        parts += [Text(""), block]
    return Group(*parts)


def emit_json(data: Any) -> None:
    """``data`` as JSON on stdout, nothing else there: what a script parses (dates and decimals as strings)."""
    typer.echo(json.dumps(data, indent=2, default=str))


def _width(table: Table, console: Console) -> int:
    return Measurement.get(console, console.options.update_width(_UNBOUNDED), table).maximum


def _narrow(table: Table, console: Console, width: int) -> None:
    """Each column as wide as its longest cell (prose: its longest word); what the width leaves goes to prose
    columns first (a line less in every row), then to headers that would wrap."""
    options = console.options.update_width(_UNBOUNDED)
    wanted = []
    for column in table.columns:
        header = Measurement.get(console, options, column.header)
        cells = [Measurement.get(console, options, cell) for cell in column.cells]
        prose = column.overflow == "fold"
        longest = max((c.minimum if prose else c.maximum for c in cells), default=0)
        column.width = max(header.minimum, longest, 1)
        wanted.append(max([header.maximum, *(c.maximum for c in cells)]) if prose else header.maximum)
    spare = max(0, width - _width(table, console))
    by_need = sorted(zip(table.columns, wanted, strict=True), key=lambda cw: cw[0].overflow != "fold")
    for column, want in by_need:
        assert column.width is not None
        grow = min(spare, max(0, want - column.width))
        column.width += grow
        spare -= grow
