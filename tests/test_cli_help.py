"""Every --help line says what it means: typer renders help with rich markup, so an unescaped
"[default: ...]" (or any "[...]") in a help text is swallowed as a markup tag and leaves a stray " .".
At 80 columns every command's help shows every option name whole (rich cut names it could not fit with
"…", so --max-pending-headers and --max-pending-headers-per-peer read the same) within 80 columns."""

import re

import click
import pytest
import typer
from typer.testing import CliRunner

from zoo_gym.client.cli import app as client_app
from zoo_gym.demo import app as demo_app
from zoo_gym.server.cli import app as server_app
from zoo_gym.serving.cli import app as serve_app

UNESCAPED = re.compile(r"(?<!\\)\[[a-zA-Z/]")  # "[default: ..." or "[bold]" that rich would eat


def _commands(cmd: click.Command, path: str):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, f"{path} {name}")


@pytest.mark.parametrize("name, app", [("gym-server", server_app), ("gym-client", client_app),
                                       ("gym-demo", demo_app), ("gym-serve", serve_app)])
def test_no_help_text_holds_markup_rich_would_swallow(name, app):
    swallowed = []
    for path, cmd in _commands(typer.main.get_command(app), name):
        texts = [("(command)", cmd.help or "")] + [(p.name, getattr(p, "help", None) or "") for p in cmd.params]
        swallowed += [f"{path} {param}: {text!r}" for param, text in texts if UNESCAPED.search(text)]
    assert swallowed == [], "escape '[' as '\\\\[' in these help texts:\n" + "\n".join(swallowed)


APPS = [("gym-server", server_app), ("gym-client", client_app), ("gym-demo", demo_app), ("gym-serve", serve_app)]
ENTRY = re.compile(r"^(?:\u2502)?\s{1,5}(?:\*\s+)?(-{1,2}[\w-]+)")  # an option's row: rich's table or click's list


@pytest.mark.parametrize("name, app", APPS)
def test_every_help_shows_every_option_whole_at_80_columns(name, app):
    problems = []
    for path, cmd in _commands(typer.main.get_command(app), name):
        args = path.split()[1:]
        res = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": None})
        text = res.output
        if res.exit_code != 0 or "Usage:" not in text:
            problems.append(f"{path} --help: exit {res.exit_code}: {text[-300:]!r}")
            continue
        problems += [f"{path}: cut with '…': {line.strip()!r}" for line in text.splitlines() if "…" in line]
        problems += [f"{path}: {len(line)} columns: {line!r}" for line in text.splitlines() if len(line) > 80]
        problems += [f"{path}: a markup escape shows: {line.strip()!r}" for line in text.splitlines() if "\\[" in line]
        options = [p for p in cmd.params if isinstance(p, click.Option) and not p.hidden]
        for flag in [f for p in options for f in (*p.opts, *p.secondary_opts)]:
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                problems.append(f"{path}: {flag} is not shown whole")
        rows = [m.group(1) for line in text.splitlines() if (m := ENTRY.match(line))]
        problems += [f"{path}: two options render as {row}" for row in sorted(set(rows)) if rows.count(row) > 1]
    assert problems == [], "\n".join(problems)
