"""Reading a settings file (TOML or YAML) for `gym-server serve --config` and `gym-client join --config`.

One parser for both sides, so both accept the same files and word their errors the same way; each
caller flattens sections and checks keys by its own rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class SettingsFileError(ValueError):
    """The file is missing, of another kind, or not valid TOML/YAML; the message names the file and where."""


def read_settings_file(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a .toml, .yaml or .yml file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if path.suffix == ".toml":
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsFileError(f"{path}: not valid TOML ({exc})") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:  # keep its first line and where
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise SettingsFileError(f"{path}: not valid YAML ({what}{where})") from None
    else:
        raise SettingsFileError(f"{path}: use a .toml, .yaml or .yml file")
    if not isinstance(raw, dict):
        raise SettingsFileError(f"{path}: the top level must hold key: value settings")
    return raw
