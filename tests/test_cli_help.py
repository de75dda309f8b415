"""Every --help line says what it means: typer renders help with rich markup, so an unescaped
"[default: ...]" (or any "[...]") in a help text is swallowed as a markup tag and leaves a stray " ."."""

import re

import click
import pytest
import typer

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
