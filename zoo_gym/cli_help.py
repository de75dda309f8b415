"""`--help` that reads whole at any terminal width, for every zoo-gym command line (typer apps).

Typer draws options in a rich table and, at 80 columns, cuts what does not fit with "…": two flags
(--max-pending-headers, --max-pending-headers-per-peer) then read the same. `Typer` is typer.Typer whose
commands and groups print the rich help when it fits the terminal uncut, else click's plain help (every
name whole, one option per entry, rich's "\\[" escapes undone).
"""

from __future__ import annotations

import contextlib
import io

import click
import typer
from typer.core import TyperCommand, TyperGroup

CUT = "…"  # what rich puts where a cell's text did not fit


def _rich_fits(render) -> bool:
    """Whether `render()` (a rich help, printed to stdout at the terminal's width) prints nothing cut."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        render()
    return CUT not in out.getvalue()


def _readable_help(command: click.Command, rich_help, ctx: click.Context, formatter: click.HelpFormatter) -> None:
    if getattr(command, "rich_markup_mode", None) is not None and _rich_fits(
            lambda: rich_help(ctx, ctx.make_formatter())):
        return rich_help(ctx, formatter)
    plain = ctx.make_formatter()  # the terminal's width (at most 80), as click's own help
    click.Command.format_help(command, ctx, plain)  # usage, text, options (and a group's commands), epilog
    formatter.write(plain.getvalue().replace("\\[", "["))


class ReadableCommand(TyperCommand):
    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _readable_help(self, super().format_help, ctx, formatter)


class ReadableGroup(TyperGroup):
    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _readable_help(self, super().format_help, ctx, formatter)


class Typer(typer.Typer):
    """typer.Typer whose groups and commands are ReadableGroup and ReadableCommand unless given another class."""

    def __init__(self, *args, cls: type[TyperGroup] | None = ReadableGroup, **kwargs) -> None:
        super().__init__(*args, cls=cls, **kwargs)

    def command(self, *args, cls: type[TyperCommand] | None = ReadableCommand, **kwargs):
        return super().command(*args, cls=cls, **kwargs)
