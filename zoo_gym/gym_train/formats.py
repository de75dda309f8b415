"""User training data: the record formats Hugging Face users have, normalised to one form.

Detected per record: alpaca, sharegpt (``conversations``), OpenAI / TRL conversational (``messages``), TRL
prompt-completion, preference pairs (TRL's, its implicit prompt, LLaMA-Factory ranking data), KTO's labelled
records, TRL prompt-only (``prompt`` alone, for the RL stages) and plain ``text`` where the caller accepts records
without an answer (``allow_text=True``). Records become ``{"instruction", "input", "output"}`` (+ ``"system"``,
``"history"``); a pair has ``"chosen"``/``"rejected"``, a KTO record ``"label"``; a prompt-only record keeps its
other fields under their own names in ``"columns"`` (reward functions receive them as TRL passes them) and
``"where"``. ``check_stage_data`` refuses what a stage cannot train on. A malformed record is a
:class:`DataError` naming the file, line/record/row and field (docs/design/training.md).
"""

from __future__ import annotations

import pathlib

from .config import PREFERENCE_STAGES, RL_STAGES
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


# the keyword arguments TRL's GRPOTrainer/RLOOTrainer give a reward function themselves: a dataset column of
# one of these names would collide with them (trl/trainer/grpo_trainer.py, _calculate_rewards)
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                    "environments")


def _prompt_only(rec: dict, *, file: str, where: str) -> dict:
    """TRL's prompt-only form (GRPO/RLOO data): ``prompt`` as a string or messages ending with a user turn;
    every other field is kept in ``"columns"`` because TRL hands reward functions each column by its name."""
    prompt = rec["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(file, where, "prompt", "is empty")
        out = {"instruction": prompt, "input": ""}
    elif isinstance(prompt, list) and prompt:
        last = prompt[-1]
        role = last.get("role", last.get("from")) if isinstance(last, dict) else None
        if not (isinstance(role, str) and role.lower() in _USER_ROLES):
            raise DataError(file, where, f"prompt[{len(prompt) - 1}].role", "a prompt-only record must end with a "
                            "user turn (the model writes the answer); give the answer as `completion` to train on it")
        done = _turns(prompt + [{"role": "assistant", "content": "-"}], key="prompt", file=file, where=where)
        out = {k: v for k, v in done.items() if k != "output"}
    else:
        raise DataError(file, where, "prompt", "must be a string or a non-empty list of messages")
    columns = {k: v for k, v in rec.items() if k != "prompt"}
    for name in columns:
        if name in RESERVED_COLUMNS:
            raise DataError(file, where, name, "is the name of an argument TRL gives reward functions itself; "
                                               "rename the column")
    return {**out, "columns": columns, "where": where}  # where: for a stage that needs answers to name it


def _answer(rec: dict, key: str, *, file: str, where: str) -> str:
    """One answer of a pair: a string, a message object (``{"from": "gpt", "value": ...}``) or TRL's list
    of one assistant message."""
    v, f = rec.get(key), key
    if v is None:
        raise DataError(file, where, key, "missing (a preference pair needs both `chosen` and `rejected`)")
    if isinstance(v, list):
        if len(v) != 1:
            raise DataError(file, where, key, "must be one assistant message (a list of exactly one)")
        v, f = v[0], f"{key}[0]"
    if isinstance(v, dict):
        sharegpt = "from" in v or "value" in v
        role, text = v.get("from", v.get("role")), v.get("value", v.get("content"))
        if role is not None and (not isinstance(role, str) or role.lower() not in _ASSISTANT_ROLES):
            raise DataError(file, where, f + (".from" if sharegpt else ".role"),
                            "must be an assistant turn ('gpt' or 'assistant')")
        if not isinstance(text, str):
            raise DataError(file, where, f + (".value" if sharegpt else ".content"), "missing or not a string")
        v = text
    elif not isinstance(v, str):
        raise DataError(file, where, key, f"must be a string or an assistant message, got {type(v).__name__}")
    if not v.strip():
        raise DataError(file, where, f, "is empty (nothing to learn from)")
    return v


def _pair_prompt(rec: dict, *, file: str, where: str) -> dict:
    """The prompt of a pair (``prompt``, sharegpt ``conversations``/``messages`` ending with a user turn,
    or alpaca fields) as a normalised record without an answer."""
    key = next((k for k in ("prompt", "conversations", "messages") if k in rec), None)
    if key is None:
        return {k: v for k, v in _alpaca({**rec, "output": "-"}, file=file, where=where).items() if k != "output"}
    turns = rec[key]
    if key == "prompt" and isinstance(turns, str):
        if not turns.strip():
            raise DataError(file, where, "prompt", "is empty")
        return {"instruction": turns, "input": ""}
    if not isinstance(turns, list) or not turns:
        raise DataError(file, where, key, "must be a string or a non-empty list of turns" if key == "prompt"
                        else "must be a non-empty list of turns")
    last = turns[-1]
    role = last.get("from", last.get("role")) if isinstance(last, dict) else None
    if isinstance(role, str) and role.lower() in _ASSISTANT_ROLES:
        raise DataError(file, where, f"{key}[{len(turns) - 1}]" + (".from" if "from" in last else ".role"),
                        "the prompt must end with a user turn (the answers are `chosen` and `rejected`)")
    done = _turns(turns + [{"role": "assistant", "content": "-"}], key=key, file=file, where=where)
    return {k: v for k, v in done.items() if k != "output"}


def _implicit_prompt(rec: dict) -> bool:
    """Whether a pair's prompt is inside ``chosen`` and ``rejected`` (TRL's implicit-prompt form): no prompt
    field at all, or, as trl.maybe_extract_prompt reads it, a text ``prompt`` beside whole conversations."""
    if rec.keys() & {"conversations", "messages", "instruction", "input"}:
        return False
    prompt, chosen = rec.get("prompt"), rec.get("chosen")
    if prompt is None:
        return True
    first = chosen[0] if isinstance(chosen, list) and chosen else None
    role = first.get("role", first.get("from")) if isinstance(first, dict) else None
    return isinstance(prompt, str) and isinstance(role, str) and role.lower() not in _ASSISTANT_ROLES


def split_shared_prompt(chosen, rejected):
    """(prompt, chosen rest, rejected rest): the longest shared prefix of two texts or message lists, by
    trl.extract_prompt's rule (a text prompt gives its trailing space to the answers)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx > 0 and chosen[idx - 1] == " ":  # (TRL also steps back at idx 0, to chosen[-1])
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _implicit_pair(rec: dict, *, file: str, where: str) -> dict:
    """A pair whose ``chosen`` and ``rejected`` hold the prompt too: both texts, or both message lists that
    share their first turns and end with one assistant message each."""
    chosen, rejected = rec.get("chosen"), rec.get("rejected")
    for key, v in (("chosen", chosen), ("rejected", rejected)):
        if v is None:
            raise DataError(file, where, key, "missing (a preference pair needs both `chosen` and `rejected`)")
    kinds = {type(chosen), type(rejected)}
    if kinds not in ({str}, {list}):
        raise DataError(file, where, "rejected", "must be the same kind as `chosen` (both texts or both message "
                                                 "lists) when the prompt is inside them")
    prompt, *rests = split_shared_prompt(chosen, rejected)
    if not (prompt.strip() if isinstance(prompt, str) else prompt):
        raise DataError(file, where, "prompt", "missing, and `chosen` and `rejected` share no beginning to take "
                                               "it from (TRL's implicit prompt)")
    for key, rest in zip(("chosen", "rejected"), rests):
        if isinstance(rest, list) and len(rest) != 1:
            raise DataError(file, where, key, f"must end with one assistant message after the {len(prompt)} turns "
                                              f"it shares with the other answer (it has {len(rest)})")
    if isinstance(prompt, str):
        out = {"instruction": prompt, "input": ""}
    else:
        done = _turns(prompt + [{"role": "assistant", "content": "-"}], key="chosen", file=file, where=where)
        out = {k: v for k, v in done.items() if k != "output"}
    for key, rest in zip(("chosen", "rejected"), rests):
        try:
            out[key] = _answer({key: rest}, key, file=file, where=where)
        except DataError as exc:  # the answer is turn len(prompt) of the record's list
            raise DataError(file, where, exc.field.replace(f"{key}[0]", f"{key}[{len(prompt)}]"),
                            exc.problem) from None
    return out


def _pair(rec: dict, *, file: str, where: str) -> dict:
    """A preference pair: its prompt plus ``chosen`` and ``rejected`` answer strings."""
    if _implicit_prompt(rec):
        out = _implicit_pair(rec, file=file, where=where)
    else:
        out = _pair_prompt(rec, file=file, where=where)
        out["chosen"] = _answer(rec, "chosen", file=file, where=where)
        out["rejected"] = _answer(rec, "rejected", file=file, where=where)
    if out["chosen"] == out["rejected"]:
        raise DataError(file, where, "rejected", "is the same as `chosen` (no preference to learn)")
    return out


def _labelled(rec: dict, *, file: str, where: str, allow_text: bool = False) -> dict:
    """KTO's unpaired form: an instruction record plus ``label`` (TRL, with ``completion``) or LLaMA-Factory's
    ``kto_tag``, true for a desirable answer and false for an undesirable one."""
    key = "kto_tag" if "kto_tag" in rec else "label"
    if key == "label" and "completion" not in rec:  # `label` means KTO's only in TRL's prompt/completion form
        out = normalise_record({k: v for k, v in rec.items() if k != "label"}, file=file, where=where,
                               allow_text=allow_text)
        if "columns" in out:  # a prompt-only record: `label` is one of its reward columns
            out["columns"]["label"] = rec["label"]
        return out
    label = rec[key]
    if not isinstance(label, bool):
        raise DataError(file, where, key, f"must be true or false (a desirable answer or not), got {label!r}")
    rest = {k: v for k, v in rec.items() if k not in ("label", "kto_tag")}
    return {**normalise_record(rest, file=file, where=where), "label": label}


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
    """One record in any supported format -> the normalised dict (raises :class:`DataError`).

    ``allow_text``: the caller checks each stage's needs itself (``check_stage_data``), so records without an
    answer (plain ``text``, TRL prompt-only) are accepted; the server's validation sets need answers."""
    if not isinstance(rec, dict):
        raise DataError(file, where, "<record>", f"must be a JSON object, got {type(rec).__name__}")
    present = {k for k, v in rec.items() if v is not None}  # table sources hold every column in every row
    if present & {"chosen", "rejected"}:
        return _pair({k: rec[k] for k in present}, file=file, where=where)
    if present & {"label", "kto_tag"}:
        return _labelled({k: rec[k] for k in present}, file=file, where=where, allow_text=allow_text)
    if present & {"conversations", "messages"}:
        return _sharegpt({k: rec[k] for k in present}, file=file, where=where)
    if "prompt" in present and "completion" not in present:
        if not allow_text:
            raise DataError(file, where, "completion", "missing: a prompt-only record (TRL's GRPO/RLOO data) "
                            "trains only the client's RL stages; here every record needs an answer")
        return _prompt_only({k: v for k, v in rec.items() if k in present}, file=file, where=where)
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
    and prompt-only records when ``allow_text``. Raises :class:`DataError` naming the source, line or row, and
    field."""
    name = str(path)
    out = [normalise_record(rec, file=name, where=where, allow_text=allow_text)
           for where, rec in iter_records(path)]
    if not out:
        raise DataError(name, "line 1", "<file>", "holds no records")
    return out


def load_validation(path: pathlib.Path) -> list[dict]:
    """The server's validation file's records, normalised as `load_examples` does, plus preference pairs:
    a record with `chosen` and `rejected` strings beside alpaca (`instruction`/`input`) or `prompt` fields
    becomes the normalised prompt fields with `chosen` and `rejected` (no `output`)."""
    out = []
    for where, rec in iter_records(path):
        if isinstance(rec, dict) and rec.get("chosen") is not None and rec.get("rejected") is not None:
            answers = {k: rec[k] for k in ("chosen", "rejected")}
            for k, v in answers.items():
                if not isinstance(v, str) or not v.strip():
                    raise DataError(str(path), where, k, "must be a non-empty string (a preference pair's answer)")
            prompt = {k: v for k, v in rec.items() if k not in ("chosen", "rejected", "output", "completion")}
            ex = normalise_record({**prompt, "completion" if "prompt" in prompt else "output": answers["chosen"]},
                                  file=str(path), where=where)
            ex.pop("output", None)
            out.append({**ex, **answers})
        else:
            out.append(normalise_record(rec, file=str(path), where=where))
    if not out:
        raise DataError(str(path), "line 1", "<file>", "holds no records")
    return out


def record_kind(ex: dict) -> str:
    """'text', 'pair' (chosen/rejected), 'labelled' (KTO's output + label), 'answer' (one output) or 'prompt'
    (TRL prompt-only: no answer, its columns for reward functions)."""
    if "text" in ex:
        return "text"
    return "pair" if "chosen" in ex else "labelled" if "label" in ex else "answer" if "output" in ex else "prompt"


def check_stage_data(stage: str, examples: list[dict], *, source: str = "the examples") -> None:
    """Refuse, in one line naming the stage and the fields it needs, records ``stage`` cannot train on
    (plain ``text`` records are left to the caller's own check)."""
    kinds = {record_kind(ex) for ex in examples} - {"text"}
    if not kinds:
        return
    if stage in RL_STAGES:
        if not kinds <= {"answer", "prompt"}:
            raise ValueError(f"{source}: stage {stage!r} samples its own answers to one prompt per record (TRL "
                             "prompt-only records, or one answer per prompt); these records are preference data "
                             "(`chosen`/`rejected` or `label`): use --stage dpo, orpo, simpo or kto")
        return
    if "prompt" in kinds:
        i, first = next((i, ex) for i, ex in enumerate(examples) if record_kind(ex) == "prompt")
        raise DataError(source, first.get("where", f"record {i}"), "completion",
                        f"missing: stage {stage!r} needs an answer in every record, and this one is prompt-only "
                        "(TRL's GRPO/RLOO data): use --stage grpo, rloo or gspo with reward functions, or give it "
                        "a `completion`")
    if stage in PREFERENCE_STAGES and stage != "kto" and kinds != {"pair"}:
        why = ("these records are unpaired (`label`/`kto_tag`): use --stage kto" if "labelled" in kinds else
               "these records have one answer each (`output`)")
        raise ValueError(f"{source}: stage {stage!r} needs preference pairs, records with `chosen` and `rejected` "
                         f"answers (TRL prompt/chosen/rejected or LLaMA-Factory ranking data); {why}")
    if stage == "kto":
        if "answer" in kinds:
            raise ValueError(f"{source}: stage 'kto' needs answers marked desirable or not: `chosen`/`rejected` "
                             "pairs, or `prompt`/`completion` with a boolean `label` (or a `kto_tag`); these records "
                             "have one unlabelled answer each (`output`)")
        labels = {ex["label"] for ex in examples if "label" in ex} | ({True, False} if "pair" in kinds else set())
        if len(labels) < 2:
            raise ValueError(f"{source}: stage 'kto' needs both desirable (`label` true) and undesirable (`label` "
                             f"false) answers; every record here has `label` {str(next(iter(labels))).lower()}")
    elif stage not in PREFERENCE_STAGES and kinds != {"answer"}:
        raise ValueError(f"{source}: stage {stage!r} trains on one answer per prompt (`output`); these records are "
                         "preference data (`chosen`/`rejected` or `label`): use --stage dpo, orpo or simpo for "
                         "pairs, kto for labelled answers")
