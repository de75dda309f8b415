"""Any dataset a Hugging Face user has: files, save_to_disk directories, cached Hub ids; every record format."""

import json
import os
import shutil

import pytest

from zoo_gym.gym_train import DataError, load_examples

ROWS = [{"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "Add", "input": "1+1", "output": "2"}]


def _refused(source, where, field, **kw):
    with pytest.raises(DataError) as e:
        load_examples(source, **kw)
    assert e.value.where == where and e.value.field == field, str(e.value)
    assert str(source) in str(e.value) and where in str(e.value) and repr(field) in str(e.value)
    return e.value


def test_parquet_csv_and_save_to_disk_directories(tmp_path):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.to_csv(str(tmp_path / "a.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "one"))
    DatasetDict(train=ds, test=ds.select([0])).save_to_disk(str(tmp_path / "dict"))
    for source in ("a.parquet", "a.csv", "one", "dict"):
        assert load_examples(tmp_path / source) == ROWS, source


def test_bad_rows_in_tables_name_file_row_and_field(tmp_path):
    from datasets import Dataset

    rows = [*ROWS, {"instruction": "x", "input": "", "output": None}]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "bad.parquet"))
    _refused(tmp_path / "bad.parquet", "row 2", "output")
    (tmp_path / "bad.csv").write_text('conversations\n"[{""from"": ""gpt"", ""value"": ""a""}]"\n"[oops"\n')
    _refused(tmp_path / "bad.csv", "row 0", "conversations[0].from")
    (tmp_path / "bad2.csv").write_text('messages\n"[{""role"": ""user"", ""content"": ""q""}, '
                                       '{""role"": ""assistant"", ""content"": ""a""}]"\n"[oops"\n')
    _refused(tmp_path / "bad2.csv", "row 1", "messages")
    _refused(tmp_path / "missing.parquet", "row 0", "<file>")


def test_messages_prompt_completion_and_text_records(tmp_path):
    recs = [
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": "a"}]},
        {"prompt": "Say hi", "completion": "hi"},
        {"prompt": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                    {"role": "user", "content": "q2"}],
         "completion": [{"role": "assistant", "content": "a2"}]},
    ]
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs))
    assert load_examples(p) == [
        {"instruction": "q", "input": "", "output": "a", "system": "sys"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "q2", "input": "", "output": "a2", "history": [["q1", "a1"]]},
    ]
    t = tmp_path / "t.jsonl"
    t.write_text('{"text": "once upon a time"}\n{"text": ""}\n')
    _refused(t, "line 1", "text")  # instruction data only, unless the caller accepts text
    _refused(t, "line 2", "text", allow_text=True)
    t.write_text('{"text": "once upon a time"}\n')
    assert load_examples(t, allow_text=True) == [{"text": "once upon a time"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]}\n'
                   '{"prompt": "q"}\n')
    _refused(bad, "line 1", "messages[1].content")
    bad.write_text('{"prompt": "q", "completion": "a"}\n{"prompt": "q"}\n')
    _refused(bad, "line 2", "completion")


def _fake_hub_cache(datasets_cache, repo_id: str, rows: list[dict], tmp_path) -> None:
    """Lay out `datasets_cache` exactly as `load_dataset(repo_id)` leaves it after an online load
    (<namespace>___<name>/<config>/<version>/<hash>/ with dataset_info.json and <name>-train.arrow),
    built offline with the packaged JSON builder."""
    from datasets.packaged_modules.json.json import Json

    src = tmp_path / "src.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    name = repo_id.split("/")[-1]
    builder = Json(cache_dir=str(tmp_path / "build"), data_files={"train": str(src)}, dataset_name=name,
                   config_name="default", hash="0123abcd")
    builder.download_and_prepare()
    shutil.copytree(builder.cache_dir, os.path.join(datasets_cache, repo_id.replace("/", "___"), "default",
                                                    "0.0.0", "0123abcd"))


def test_a_hub_id_loads_from_the_local_cache_and_is_never_downloaded(tmp_path, monkeypatch):
    import huggingface_hub.constants

    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _fake_hub_cache(str(home / "datasets"), "someone/tiny_alpaca", ROWS, tmp_path)
    assert load_examples("someone/tiny_alpaca") == ROWS
    e = _refused("someone/not_cached", "row 0", "<dataset>")
    assert "not in the local Hugging Face cache" in str(e)
    assert os.environ.get("HF_HUB_OFFLINE") is None and not huggingface_hub.constants.HF_HUB_OFFLINE
