"""User training data: the record formats Hugging Face users have, normalised to one form.

Detected per record: alpaca (``instruction``/``input``/``output``), sharegpt (``conversations``), OpenAI /
TRL conversational (``messages``), TRL prompt-completion (``prompt``/``completion``), and plain ``text``
where the caller accepts it (``allow_text=True``). Instruction records become
``{"instruction": str, "input": str, "output": str}`` plus optional ``"system"`` and ``"history"``
(``[[user, assistant], ...]``); a ``text`` record becomes ``{"text": str}``. Where records come from is
``sources.py``. A malformed record is refused with a :class:`DataError` naming the file, the line
(JSONL), record index (JSON) or row (tables) and the field. Details: docs/design/training.md.
"""

from __future__ import annotations

import pathlib

from .errors import DataError
from .sources import iter_records

_USER_ROLES = {"human", "user"}
_ASSISTANT_ROLES = {"gpt", "assistant", "model"}


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
    return _turns(rec[key], key=key, file=file, where=where)


def _turns(turns: object, *, key: str, file: str, where: str) -> dict:
    role_f, text_f = (".from", ".value") if key == "conversations" else (".role", ".content")
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
            raise DataError(file, where, f + role_f, "missing or not a string ('human', 'gpt' or 'system')")
        if not isinstance(text, str):
            raise DataError(file, where, f + text_f, "missing or not a string")
        role = role.lower()
        if role == "system":
            if i != 0:
                raise DataError(file, where, f + role_f, "a 'system' turn may only come first")
            system = text
        elif role in _USER_ROLES:
            if pending is not None:
                raise DataError(file, where, f + role_f, "two user turns in a row; turns must alternate")
            pending = text
        elif role in _ASSISTANT_ROLES:
            if pending is None:
                raise DataError(file, where, f + role_f, "an assistant turn must follow a user turn")
            pairs.append([pending, text])
            pending = None
        else:
            raise DataError(file, where, f + role_f, f"unknown role {role!r} (use human, gpt or system)")
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


def _prompt_completion(rec: dict, *, file: str, where: str) -> dict:
    """TRL's prompt-completion form: two strings, or two message lists (conversational)."""
    prompt, completion = rec.get("prompt"), rec.get("completion")
    if isinstance(prompt, list) or isinstance(completion, list):
        for key, v in (("prompt", prompt), ("completion", completion)):
            if not isinstance(v, list) or not v:
                raise DataError(file, where, key, "must be a non-empty list of messages (as the other one is)")
        return _turns(prompt + completion, key="messages", file=file, where=where)
    out = {"instruction": _need_str(rec, "prompt", file=file, where=where), "input": "",
           "output": _need_str(rec, "completion", file=file, where=where)}
    if not out["instruction"].strip():
        raise DataError(file, where, "prompt", "is empty")
    if not out["output"].strip():
        raise DataError(file, where, "completion", "is empty (nothing to learn from)")
    return out


def _text(rec: dict, *, file: str, where: str, allow_text: bool) -> dict:
    if not allow_text:
        raise DataError(file, where, "text", "plain text (continued pretraining) cannot be used here: give "
                        "instruction records (alpaca, sharegpt, messages or prompt/completion)")
    text = _need_str(rec, "text", file=file, where=where)
    if not text.strip():
        raise DataError(file, where, "text", "is empty (nothing to learn from)")
    return {"text": text}


def normalise_record(rec: object, *, file: str = "<memory>", where: str = "record 0",
                     allow_text: bool = False) -> dict:
    """One record in any supported format -> the normalised dict (raises :class:`DataError`)."""
    if not isinstance(rec, dict):
        raise DataError(file, where, "<record>", f"must be a JSON object, got {type(rec).__name__}")
    present = {k for k, v in rec.items() if v is not None}  # table sources hold every column in every row
    if present & {"conversations", "messages"}:
        return _sharegpt({k: rec[k] for k in present}, file=file, where=where)
    if "prompt" in present or ("completion" in present and "output" not in present):
        return _prompt_completion(rec, file=file, where=where)
    if present & {"instruction", "output"}:
        return _alpaca(rec, file=file, where=where)
    if "text" in present:
        return _text(rec, file=file, where=where, allow_text=allow_text)
    raise DataError(
        file, where, "instruction",
        "missing: a record needs alpaca fields (instruction, input, output), sharegpt 'conversations', "
        "'messages', 'prompt'/'completion'" + (" or 'text'" if allow_text else ""),
    )


def load_examples(path: str | pathlib.Path, *, allow_text: bool = False) -> list[dict]:
    """Read and normalise every record of ``path`` (a .json/.jsonl/.parquet/.csv file, a ``save_to_disk``
    directory or a dataset id in the local Hugging Face cache); alpaca dicts, plus ``{"text": ...}``
    records when ``allow_text``. Raises :class:`DataError` naming the source, line or row, and field."""
    name = str(path)
    out = [normalise_record(rec, file=name, where=where, allow_text=allow_text)
           for where, rec in iter_records(path)]
    if not out:
        raise DataError(name, "line 1", "<file>", "holds no records")
    return out
