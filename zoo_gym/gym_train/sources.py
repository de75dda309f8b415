"""Where training records come from: a file, a ``save_to_disk`` directory or a cached Hub dataset id.

``iter_records(source)`` yields ``(where, record)`` pairs, ``where`` naming the line (JSONL), record
index (JSON array) or row (every table source), so a bad record is refused with its place. Sources:
``.jsonl`` / ``.json`` (read here), ``.parquet`` / ``.csv`` (``datasets``' builders), a
``save_to_disk`` directory, or ``namespace/name`` loaded from the local cache only, with the Hub switched
off: nothing is downloaded at run time. A ``DatasetDict`` gives its ``train`` split, or its only split.
Details: docs/design/training.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
from collections.abc import Iterable, Iterator

from .errors import DataError

FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# columns that CSV can only hold as JSON text
_NESTED = ("conversations", "messages", "history", "prompt", "completion", "chosen", "rejected")


def looks_like_hub_id(source: str) -> bool:
    return bool(_HUB_ID.match(source)) and pathlib.Path(source).suffix.lower() not in FILE_SUFFIXES


def iter_records(source: str | pathlib.Path) -> Iterator[tuple[str, object]]:
    """``(where, record)`` for every record of ``source``; raises :class:`DataError` naming the source."""
    p = pathlib.Path(source)
    suffix = p.suffix.lower()
    if p.is_dir():
        yield from _rows(str(p), _load_from_disk(p))
    elif suffix in (".json", ".jsonl"):
        if not p.is_file():
            raise DataError(str(p), "line 1", "<file>", "no such file")
        yield from _json_records(p)
    elif suffix in (".parquet", ".csv"):
        if not p.is_file():
            raise DataError(str(p), "row 0", "<file>", "no such file")
        yield from _rows(str(p), _load_table(p, suffix[1:]), csv=suffix == ".csv")
    elif looks_like_hub_id(str(source)) and not p.exists():
        yield from _rows(str(source), _load_cached_hub(str(source)))
    else:
        raise DataError(str(p), "line 1", "<file>",
                        "no such file, or an unsupported type: use .json, .jsonl, .parquet, .csv, a "
                        "save_to_disk directory or a dataset id in your Hugging Face cache")


def _json_records(path: pathlib.Path) -> Iterable[tuple[str, object]]:
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


def _one_split(name: str, ds):
    """A Dataset from a Dataset or DatasetDict (its 'train' split, or its only one)."""
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            return ds["train"]
        if len(ds) == 1:
            return next(iter(ds.values()))
        raise DataError(name, "row 0", "<split>", f"has splits {sorted(ds)} and none is 'train'")
    return ds


def _quiet_datasets():
    import datasets

    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def _load_from_disk(path: pathlib.Path):
    import datasets

    _quiet_datasets()
    try:
        return _one_split(str(path), datasets.load_from_disk(str(path), keep_in_memory=True))
    except FileNotFoundError as exc:
        raise DataError(str(path), "row 0", "<directory>",
                        f"not a datasets save_to_disk directory ({exc})") from None


def _load_table(path: pathlib.Path, builder: str):
    import datasets

    _quiet_datasets()
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=True)
    except Exception as exc:  # pyarrow / pandas parse errors carry the detail
        raise DataError(str(path), "row 0", "<file>", f"cannot be read as {builder} ({exc})") from None


def datasets_cache_dir() -> str:
    """The datasets cache as the environment names it now (HF_DATASETS_CACHE, else HF_HOME/datasets)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.path.expanduser(os.environ["HF_DATASETS_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "datasets")


@contextlib.contextmanager
def hub_offline():
    """HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 for the duration, also for already-imported libraries."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _load_cached_hub(dataset_id: str):
    import datasets

    _quiet_datasets()
    cache = datasets_cache_dir()
    with hub_offline():
        try:
            ds = datasets.load_dataset(dataset_id, cache_dir=cache, download_mode="reuse_cache_if_exists",
                                       keep_in_memory=True)
        except (ConnectionError, FileNotFoundError, ValueError) as exc:
            raise DataError(dataset_id, "row 0", "<dataset>",
                            f"is not a file and not in the local Hugging Face cache ({cache}); nothing is "
                            f"downloaded at run time: load it once online with datasets.load_dataset, or "
                            f"save_to_disk it and pass the directory ({type(exc).__name__})") from None
    return _one_split(dataset_id, ds)


def _rows(name: str, ds, *, csv: bool = False) -> Iterator[tuple[str, object]]:
    for i, rec in enumerate(ds):
        if csv:
            rec = _csv_nested(rec, name=name, where=f"row {i}")
        yield f"row {i}", rec


def _csv_nested(rec: dict, *, name: str, where: str) -> dict:
    """CSV cells are text: a nested column (conversations, messages, ...) is read as JSON when it is a list."""
    out = dict(rec)
    for key in _NESTED:
        v = out.get(key)
        if isinstance(v, str) and v.lstrip().startswith("["):
            try:
                out[key] = json.loads(v)
            except json.JSONDecodeError as e:
                raise DataError(name, where, key, f"not valid JSON in a CSV cell ({e.msg} at column {e.colno})")
    return out
