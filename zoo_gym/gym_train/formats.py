"""User training data: alpaca or sharegpt records in JSON (an array) or JSONL (one record a line).

Everything is normalised to the alpaca form the built-in tasks use:
``{"instruction": str, "input": str, "output": str}`` plus optional ``"system": str`` and
``"history": [[user, assistant], ...]`` (earlier turns, the LLaMA-Factory alpaca convention).
A malformed record is refused with a :class:`DataError` naming the file, the line (JSONL) or record
index (JSON) and the field.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable

_USER_ROLES = {"human", "user"}
_ASSISTANT_ROLES = {"gpt", "assistant", "model"}


class DataError(ValueError):
    """A training record cannot be used; the message names file, line (or record index) and field."""

    def __init__(self, file: str, where: str, field: str, problem: str):
        self.file, self.where, self.field, self.problem = file, where, field, problem
        super().__init__(f"{file}: {where}: field {field!r}: {problem}")


def _need_str(rec: dict, key: str, *, file: str, where: str, required: bool = True, prefix: str = "") -> str:
    if key not in rec or rec[key] is None:
        if required:
            raise DataError(file, where, prefix + key, "missing (every record needs it)")
        return ""
    v = rec[key]
    if not isinstance(v, str):
        raise DataError(file, where, prefix + key, f"must be a string, got {type(v).__name__}")
    return v


def _alpaca(rec: dict, *, file: str, where: str) -> dict:
    out = {
        "instruction": _need_str(rec, "instruction", file=file, where=where),
        "input": _need_str(rec, "input", file=file, where=where, required=False),
        "output": _need_str(rec, "output", file=file, where=where),
    }
    if not out["instruction"].strip():
        raise DataError(file, where, "instruction", "is empty")
    if not out["output"].strip():
        raise DataError(file, where, "output", "is empty (nothing to learn from)")
    system = _need_str(rec, "system", file=file, where=where, required=False)
    if system:
        out["system"] = system
    if rec.get("history"):
        hist = rec["history"]
        ok = isinstance(hist, list) and all(
            isinstance(h, list | tuple) and len(h) == 2 and all(isinstance(x, str) for x in h) for h in hist
        )
        if not ok:
            raise DataError(file, where, "history", "must be a list of [user, assistant] string pairs")
        out["history"] = [list(h) for h in hist]
    return out


def _sharegpt(rec: dict, *, file: str, where: str) -> dict:
    key = "conversations" if "conversations" in rec else "messages"
    turns = rec[key]
    if not isinstance(turns, list) or not turns:
        raise DataError(file, where, key, "must be a non-empty list of turns")
    system, pairs, pending = "", [], None
    for i, t in enumerate(turns):
        f = f"{key}[{i}]"
        if not isinstance(t, dict):
            raise DataError(file, where, f, f"must be an object, got {type(t).__name__}")
        role = t.get("from", t.get("role"))
        text = t.get("value", t.get("content"))
        if not isinstance(role, str):
            raise DataError(file, where, f + ".from", "missing or not a string ('human', 'gpt' or 'system')")
        if not isinstance(text, str):
            raise DataError(file, where, f + ".value", "missing or not a string")
        role = role.lower()
        if role == "system":
            if i != 0:
                raise DataError(file, where, f + ".from", "a 'system' turn may only come first")
            system = text
        elif role in _USER_ROLES:
            if pending is not None:
                raise DataError(file, where, f + ".from", "two user turns in a row; turns must alternate")
            pending = text
        elif role in _ASSISTANT_ROLES:
            if pending is None:
                raise DataError(file, where, f + ".from", "an assistant turn must follow a user turn")
            pairs.append([pending, text])
            pending = None
        else:
            raise DataError(file, where, f + ".from", f"unknown role {role!r} (use human, gpt or system)")
    if pending is not None or not pairs:
        raise DataError(file, where, key, "must end with an assistant ('gpt') turn")
    user, answer = pairs[-1]
    if not user.strip():
        raise DataError(file, where, key, "the last user turn is empty")
    if not answer.strip():
        raise DataError(file, where, key, "the last assistant turn is empty (nothing to learn from)")
    out = {"instruction": user, "input": "", "output": answer}
    if system:
        out["system"] = system
    if len(pairs) > 1:
        out["history"] = pairs[:-1]
    return out


def normalise_record(rec: object, *, file: str = "<memory>", where: str = "record 0") -> dict:
    """One alpaca or sharegpt record -> the normalised alpaca dict (raises :class:`DataError`)."""
    if not isinstance(rec, dict):
        raise DataError(file, where, "<record>", f"must be a JSON object, got {type(rec).__name__}")
    if "conversations" in rec or "messages" in rec:
        return _sharegpt(rec, file=file, where=where)
    if "instruction" in rec or "output" in rec:
        return _alpaca(rec, file=file, where=where)
    raise DataError(
        file, where, "instruction",
        "missing: a record needs alpaca fields (instruction, input, output) or sharegpt 'conversations'",
    )


def _records(path: pathlib.Path) -> Iterable[tuple[str, object]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".jsonl":
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                yield f"line {n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(str(path), f"line {n}", "<json>", f"not valid JSON ({e.msg} at column {e.colno})")
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(str(path), f"line {e.lineno}", "<json>", f"not valid JSON ({e.msg} at column {e.colno})")
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(str(path), "line 1", "<json>", "a .json file must hold an array of records (or use .jsonl)")
    for i, rec in enumerate(data):
        yield f"record {i}", rec


def load_examples(path: str | pathlib.Path) -> list[dict]:
    """Read alpaca or sharegpt records from ``.json`` or ``.jsonl``; return normalised alpaca dicts."""
    p = pathlib.Path(path)
    if p.suffix.lower() not in (".json", ".jsonl"):
        raise DataError(str(p), "line 1", "<file>", "unsupported file type; use .json or .jsonl")
    if not p.is_file():
        raise DataError(str(p), "line 1", "<file>", "no such file")
    out = [normalise_record(rec, file=str(p), where=where) for where, rec in _records(p)]
    if not out:
        raise DataError(str(p), "line 1", "<file>", "holds no records")
    return out
