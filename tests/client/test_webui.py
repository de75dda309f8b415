"""gym-client webui's API (FastAPI's TestClient; the browser test is tests/e2e/test_webui_browser.py): the Join
form is join's own options with TrainConfig's defaults, its values go back to join as flags click accepts,
the preview is `join --dry-run`'s own answer (its one error line with row and field), uploads are bounded,
a second start is refused while one runs, errors are one line, other Host names are refused, and the
contributor's private key never appears in any response."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from fastapi.testclient import TestClient

from zoo_gym.client.cli import app as cli_app
from zoo_gym.client.train_settings import train_leaves
from zoo_gym.client.webui.app import create_app
from zoo_gym.client.webui.fields import argv
from zoo_gym.proto import signing

JOIN = typer.main.get_command(cli_app).commands["join"]


@pytest.fixture
def console(tmp_path):
    app = create_app(JOIN, directory=tmp_path / "console", default_home=tmp_path / "home", max_upload_bytes=4096,
                     allowed_hosts=("testserver",))
    with TestClient(app) as client:
        yield client
    child = app.state.console.join.child
    if child is not None and child.running:
        child.process.kill()
        child.process.wait(30)


def test_the_form_is_joins_options_with_trainconfigs_defaults(console):
    fields = {f["name"]: f for f in console.get("/api/fields").json()["fields"]}
    options = {p.name for p in JOIN.params if p.name not in ("as_json", "quiet", "dry_run", "help")}
    assert set(fields) == options  # a setting added to join or to TrainConfig appears on the page
    for leaf in train_leaves():
        if leaf.key == "method":  # join's own --method (deprecated) stands for it
            assert "method" in fields
            continue
        f = fields["train__" + leaf.key]
        assert (f["flag"], f["default"], f["help"]) == (leaf.flag, leaf.default, leaf.help)
    assert fields["train__stage"]["choices"][0] == "sft" and fields["server"]["panel"] == "Join"
    assert fields["train__lora_rank" if "train__lora_rank" in fields else "train__lora_r"]["when"] == \
        {"finetuning_type": ["lora"]}


def test_the_pages_values_are_flags_join_accepts():
    values = {"server": "127.0.0.1:5", "train__learning_rate": "0.001", "train__bf16": True, "insecure": True,
              "train__stage": "sft", "rounds": 2, "train__max_steps": "150", "data": ""}
    flags = argv(JOIN, values)
    assert flags == ["--server", "127.0.0.1:5", "--learning-rate", "0.001", "--bf16", "--insecure", "--stage", "sft",
                     "--rounds", "2", "--max-steps", "150"]  # a value typed is given, even the default's
    ctx = JOIN.make_context("join", list(flags))
    assert ctx.params["train__learning_rate"] == 0.001 and ctx.params["train__bf16"] is True
    assert ctx.params["rounds"] == 2 and ctx.params["insecure"] is True


def _dry_run_line(data: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "zoo_gym.client", "join", "--server", "127.0.0.1:5", "--data",
                           str(data), "--dry-run"], capture_output=True, text=True, timeout=300)
    return [line for line in done.stderr.splitlines() if line.startswith("error: ")][-1]


def test_a_bad_file_shows_the_dry_runs_row_and_field(console, tmp_path):
    bad = tmp_path / "bad.jsonl"
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(6)]
    rows[3] = {"instruction": "q3", "output": 7}
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = console.post("/api/preview", json={"values": {"server": "127.0.0.1:5", "data": str(bad)}}).json()
    assert doc["ok"] is False and doc["resolved"] is None
    assert doc["error"] == _dry_run_line(bad)  # exactly as --dry-run reports it
    assert "line 4" in doc["error"] and "output" in doc["error"]
    assert doc["records"][0] == {"where": "line 1", "record": rows[0]}
    assert doc["command"] == ["gym-client", "join", "--server", "127.0.0.1:5", "--data", str(bad)]


def test_a_good_upload_previews_its_format_and_counts(console):
    body = "".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(20)).encode()
    up = console.put("/api/data", params={"name": "../../mine.jsonl"}, content=body).json()
    path = Path(up["path"])
    assert up["bytes"] == len(body) and path.read_bytes() == body and path.parent.name == "uploads"
    doc = console.post("/api/preview", json={"values": {"server": "127.0.0.1:5", "data": str(path),
                                                        "train__max_steps": 8}}).json()
    assert doc["ok"] and doc["error"] is None, doc
    assert doc["resolved"]["data"]["format"] == "alpaca" and doc["resolved"]["data"]["examples"] == 20
    assert doc["resolved"]["training"]["max_steps"] == 8 and len(doc["records"]) == 3


def test_uploads_are_bounded_and_named(console, tmp_path):
    r = console.put("/api/data", params={"name": "big.jsonl"}, content=b"x" * 5000)
    assert r.status_code == 413 and r.json() == {"detail": "big.jsonl is larger than the console's upload limit "
                                                           "of 4096 bytes"}
    assert not list((tmp_path / "console" / "uploads").glob("*"))
    r = console.put("/api/data", params={"name": "run.sh"}, content=b"echo")
    assert r.status_code == 400 and "\n" not in r.json()["detail"]


@pytest.fixture
def sigint_as_under_uvicorn():
    """The console serves under uvicorn, which handles SIGINT, so the joins it starts get SIGINT's default action.
    A test process started as a background job of a non-interactive shell (CI run with `&`) ignores SIGINT, and
    an ignored signal stays ignored across exec: its joins would never see Ctrl-C. Handled here, as uvicorn does."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_one_start_at_a_time_and_stop_is_ctrl_c(console, sigint_as_under_uvicorn):
    values = {"server": "127.0.0.1:9", "insecure": True, "connect_timeout": 120, "key": "k.pem"}
    first = console.post("/api/join", json={"values": values})
    assert first.status_code == 201 and first.json()["command"][-1] == "--json"
    second = console.post("/api/join", json={"values": values})
    assert second.status_code == 409 and second.json()["detail"].startswith("a join is already running")
    assert console.post("/api/join/stop").json() == {"stopping": True}
    deadline = time.monotonic() + 120
    while console.get("/api/join").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.5)
    view = console.get("/api/join").json()
    assert view["running"] is False and view["exit_code"] != 0
    assert console.post("/api/join/stop").status_code == 409


def test_the_server_field_takes_several_addresses(console):
    """The page sends a list (or comma-separated text); join gets one --server each; the Rounds view asks them
    in turn, and when none answers says so in one line naming the first."""
    for given in (["127.0.0.1:5", "127.0.0.1:6"], "127.0.0.1:5, 127.0.0.1:6"):
        flags = argv(JOIN, {"server": given})
        assert flags == ["--server", "127.0.0.1:5", "--server", "127.0.0.1:6"]
        assert JOIN.make_context("join", list(flags)).params["server"] == ("127.0.0.1:5", "127.0.0.1:6")
    r = console.post("/api/round", json={"values": {"server": ["127.0.0.1:9", "127.0.0.1:8"], "insecure": True}})
    assert r.status_code == 502 and r.json()["detail"].startswith("error: the server at 127.0.0.1:9 answered ")


def test_errors_are_one_line_and_other_hosts_are_refused(console, tmp_path):
    r = console.post("/api/preview", json={"values": {"nope": 1}})
    assert r.status_code == 400 and r.json() == {"detail": "'nope' is no setting of gym-client join"}
    r = console.post("/api/preview", json={"values": {"rounds": "two"}})
    assert r.status_code == 400 and r.json() == {"detail": "--rounds must be an integer, got 'two'"}
    r = console.post("/api/round", json={"values": {"server": "127.0.0.1:9", "insecure": True}})
    assert r.status_code == 502 and r.json()["detail"].startswith("error: the server at 127.0.0.1:9 answered ")
    assert "Traceback" not in r.text and "\n" not in r.json()["detail"]
    assert console.get("/", headers={"host": "attacker.example"}).status_code == 400
    page = console.get("/")
    assert "script-src 'self'" in page.headers["content-security-policy"] and "<script src=" in page.text


def test_the_private_key_never_reaches_the_page(console, tmp_path):
    key_path = tmp_path / "home" / "contributor.pem"
    signing.load_or_create_key(key_path)
    secret = [line for line in key_path.read_text().splitlines() if line and not line.startswith("-----")]
    values = {"server": "127.0.0.1:9", "insecure": True, "key": str(key_path), "connect_timeout": 1}
    answers = [console.get("/api/fields"), console.post("/api/preview", json={"values": values}),
               console.post("/api/rewards", json={"values": values}),
               console.post("/api/rewards", json={"values": {k: v for k, v in values.items() if k != "key"}}),
               console.post("/api/round", json={"values": values}), console.post("/api/join", json={"values": values})]
    deadline = time.monotonic() + 120
    while console.get("/api/join").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.5)
    answers += [console.get("/api/join"), console.get("/api/join?since=0"), console.get("/api/pull"),
                console.get("/api/serve"), console.get("/")]
    assert answers[2].status_code == 502
    for r in answers:
        assert not any(s in r.text for s in secret), r.request.url


# A stand-in gym-serve: says where it listens as gym-serve does, then waits for its Ctrl-C.
FAKE_SERVE = ("import sys, time; sys.stderr.write('listening on http://127.0.0.1:9 (base fake)\\n'); "
              "sys.stderr.flush(); time.sleep(300)")


def _try_view(tmp_path, variant: str | None = None, *, with_base: bool = True):
    """A console whose pull has finished (round 1) and whose gym-serve is FAKE_SERVE; HOME holds `variant`
    (a NAME.zgd kept by join --keep-variant over checkpoint "cd"*32) and, `with_base`, that checkpoint."""
    import torch

    from zoo_gym.client.webui.jobs import Child
    from zoo_gym.serving.variant import encode_variant, write_variant

    home = tmp_path / "home"
    if variant is not None:
        payload = encode_variant({"w": torch.ones(2, 128)}, base_sha256="ab" * 32,
                                 info={"checkpoint_sha256": "cd" * 32})
        write_variant(home / "variants" / f"{variant}.zgd", payload)
        if with_base:
            (home / "checkpoints" / ("cd" * 32)).mkdir(parents=True)
            (home / "checkpoints" / ("cd" * 32) / "model.safetensors").write_bytes(b"")
    app = create_app(JOIN, directory=tmp_path / "console", default_home=home, allowed_hosts=("testserver",))
    c = app.state.console
    pulled = json.dumps({"out": str(tmp_path / "pulled"), "round": 1})
    c.pull.child = Child([sys.executable, "-c", f"print({pulled!r})"], tmp_path / "pull", env=c.env, what="pull")
    c.pull.child.process.wait(60)
    c.serve_argv = lambda base, variants, name: [sys.executable, "-c", FAKE_SERVE, "--base", str(base), name]
    return app, c


def test_without_a_variant_the_right_pane_says_how_to_make_one(tmp_path):
    app, c = _try_view(tmp_path)
    with TestClient(app) as client:
        r = client.post("/api/serve", json={"values": {}})
        assert r.status_code == 201 and c.serve_variant.child is None
        panes = client.get("/api/serve").json()["panes"]
        assert panes["a"]["label"] == "checkpoint round 1" and panes["a"]["model"] == "checkpoint-round-1"
        b = panes["b"]["none"]
        assert "--keep-variant" in b and "Join" in b and "\n" not in b
        r = client.post("/api/chat", json={"pane": "b", "model": "x", "prompt": "hi"})
        assert r.status_code == 409 and r.json() == {"detail": b}
    assert not c.serving()  # the console's exit stopped its gym-serve


def test_a_kept_variant_is_served_over_its_own_base_and_stop_ends_both(tmp_path):
    app, c = _try_view(tmp_path, "abcd1234-round1")
    with TestClient(app) as client:
        panes = client.post("/api/serve", json={"values": {}}).json()["panes"]
        assert panes["b"]["label"] == f"your variant of round 1 over base {'cd' * 6}"
        assert panes["b"]["model"] == "abcd1234-round1"
        argv = c.serve_variant.child.argv
        assert argv[argv.index("--base") + 1] == str(tmp_path / "home" / "checkpoints" / ("cd" * 32))
        deadline = time.monotonic() + 60
        while not client.get("/api/serve").json()["panes"]["b"]["url"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.get("/api/serve").json()["panes"]["b"]["url"] == "http://127.0.0.1:9"
        assert client.post("/api/serve", json={"values": {}}).status_code == 409  # one pair at a time
        assert client.post("/api/serve/stop").json() == {"stopped": True}
        assert not c.serve.child.running and not c.serve_variant.child.running
        assert client.post("/api/serve/stop").status_code == 409
        client.post("/api/serve", json={"values": {}})
        assert c.serving()
    assert not c.serve.child.running and not c.serve_variant.child.running  # the console's exit stopped both


def test_a_variant_whose_base_left_the_cache_is_one_error_line(tmp_path):
    app, c = _try_view(tmp_path, "abcd1234-round1", with_base=False)
    with TestClient(app) as client:
        b = client.post("/api/serve", json={"values": {}}).json()["panes"]["b"]
        assert b["error"].startswith("error: variant abcd1234-round1: its base, checkpoint cdcdcdcdcdcd, is not in")
        assert c.serve_variant.child is None and c.serve.child.running
        r = client.post("/api/chat", json={"pane": "b", "model": "x", "prompt": "hi"})
        assert r.status_code == 409 and r.json()["detail"] == b["error"]
