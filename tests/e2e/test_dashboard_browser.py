"""The dashboard in a real browser: a real `gym-server serve --dashboard-port` over TLS, a round with three real
`gym-client join` processes, then headless Chromium (Debian's `chromium`, installed by .ci/run) loads the
page: the round table, the loss chart and the leaderboard show that round's real values. A screenshot is
saved under the test's tmp dir. /metrics, parsed with prometheus_client's parser, counts the same round,
and the server's log has one line per registration and submission and no model-loading progress bars.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e_processes import ENV, chromium, free_port, wait_for
from zoo_gym.proto.tls import make_certificates

STEPS = os.environ.get("ZOO_GYM_E2E_STEPS_DASHBOARD", "8")
NAMES = ("ada", "bob", "cy")


class Tables(HTMLParser):
    """Rows of every <table id=...> (cell texts and the <tr>'s attributes) and every SVG <circle>'s attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[tuple[dict, list[str]]]] = {}
        self.circles: list[dict] = []
        self._table = self._row = self._cell = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = self.tables.setdefault(attrs.get("id", ""), [])
        elif tag == "tr" and self._table is not None:
            self._row = (attrs, [])
            self._table.append(self._row)
        elif tag == "td" and self._row is not None:
            self._cell = []
        elif tag == "circle":
            self.circles.append(attrs)

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self._row[1].append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "table":
            self._table = self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def served_round(tmp_path_factory):
    browser = chromium()
    root = tmp_path_factory.mktemp("dashboard")
    state_dir = root / "server"
    server_cmd = [sys.executable, "-m", "zoo_gym.server"]
    subprocess.run([*server_cmd, "init", "--state-dir", str(state_dir)], check=True, env=ENV, capture_output=True)
    tls = make_certificates(root / "tls", hosts=("127.0.0.1", "localhost"))
    dash_port, port_file, log = free_port(), root / "port", root / "server.log"
    server = subprocess.Popen([*server_cmd, "serve", "--state-dir", str(state_dir), "--port", "0", "--port-file",
                               str(port_file), "--min-contributors", "3", "--round-timeout", "900",
                               "--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key),
                               "--dashboard-port", str(dash_port)], stderr=open(log, "w"), env=ENV)
    clients = []
    try:
        port = wait_for(lambda: port_file.exists() and port_file.read_text().strip() and int(port_file.read_text()),
                        timeout=120, what="the server to listen", procs=[server])
        wait_for(lambda: "dashboard at https://" in log.read_text(), timeout=30, what="the dashboard", procs=[server])
        for shard, name in enumerate(NAMES):
            work = root / name
            work.mkdir()
            clients.append(subprocess.Popen(
                [sys.executable, "-m", "zoo_gym.client", "join", "--server", f"127.0.0.1:{port}",
                 "--root-certificates", str(tls.ca), "--rounds", "1", "--shard", str(shard), "--n-shards", "8",
                 "--workdir", str(work), "--key", str(work / "key.pem"), "--max-steps", STEPS, "--threads", "1",
                 "--quiet", "--json", "--name", name], stdout=subprocess.PIPE, stderr=open(work / "client.log", "w"),
                env=ENV, text=True))
        for name, p in zip(NAMES, clients):
            p.communicate(timeout=900)
            assert p.returncode == 0, (root / name / "client.log").read_text()[-3000:]
        status = json.loads(subprocess.run([*server_cmd, "status", "--state-dir", str(state_dir), "--json"],
                                           check=True, capture_output=True, text=True, env=ENV).stdout)
        ledger = json.loads(subprocess.run([*server_cmd, "ledger", "show", "--state-dir", str(state_dir), "--json"],
                                           check=True, capture_output=True, text=True, env=ENV).stdout)
        from sqlmodel import func, select

        from zoo_gym.server.store.models import Submission
        from zoo_gym.server.store.state import open_state

        reader = open_state(state_dir)
        with reader.session() as s:
            uploaded = int(s.exec(select(func.sum(Submission.payload_size))).one())
        reader.engine.dispose()
        yield {"uploaded_bytes": uploaded, "root": root, "url": f"https://127.0.0.1:{dash_port}/", "ca": tls.ca, "status": status,
               "ledger": ledger, "log": log, "chromium": browser}
    finally:
        for p in clients:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        server.terminate()
        server.wait(timeout=30)


def _browser(chromium: str, root: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium; the server's certificate comes from the test's private CA, which it does not know."""
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--ignore-certificate-errors",
                           f"--user-data-dir={root / 'chromium-profile'}", *args], capture_output=True, text=True,
                          timeout=120, check=True)


def test_the_page_shows_the_round_in_chromium(served_round, tmp_path):
    status, url = served_round["status"], served_round["url"]
    r1 = next(r for r in status["rounds"] if r["id"] == 1)
    assert r1["state"] == "published"
    soup = r1["report"]["soup"]["contributors"]
    accepted = sum(c["accepted"] for c in soup)

    dom = _browser(served_round["chromium"], served_round["root"], "--dump-dom", url).stdout
    page = Tables()
    page.feed(dom)

    rounds = {attrs["data-round"]: cells for attrs, cells in page.tables["rounds"] if "data-round" in attrs}
    assert rounds["1"][1] == "published" and rounds["1"][3] == "3"
    assert rounds["1"][4] == str(accepted) and rounds["1"][5].startswith(str(3 - accepted))
    kinds = [e["kind"] for e in served_round["ledger"] if e["round_id"] == 1]  # paid apart from accepted
    assert rounds["1"][6].startswith(str(kinds.count("reward"))) and rounds["1"][7] == str(kinds.count("refusal"))
    assert rounds["2"][1] == "open"
    loss = next(c["heldout_loss"] for c in status["checkpoints"] if c["round"] == 1)
    assert rounds["1"][11] == f"{loss:.4f}"

    points = {c["data-round"]: float(c["data-value"]) for c in page.circles if "data-round" in c}
    assert set(points) == {"0", "1"} and points["1"] == pytest.approx(loss, rel=1e-5)

    balances: dict[str, int] = {}
    for e in served_round["ledger"]:
        balances[e["contributor_id"]] = balances.get(e["contributor_id"], 0) + e["amount"]
    board = {attrs["data-contributor"]: cells for attrs, cells in page.tables["leaderboard"]
             if "data-contributor" in attrs}
    assert sorted(cells[1] for cells in board.values()) == sorted(NAMES)
    for cid, cells in board.items():
        assert int(cells[3]) == balances.get(cid, 0) and cells[5] == "1"

    shot = tmp_path / "dashboard.png"
    _browser(served_round["chromium"], served_round["root"], f"--screenshot={shot}", "--window-size=1280,1600",
             "--hide-scrollbars", url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_metrics_count_the_round(served_round):
    text = httpx.get(served_round["url"] + "metrics", verify=str(served_round["ca"]), timeout=30).text
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for family in text_string_to_metric_families(text) for s in family.samples}
    status = served_round["status"]
    assert m[("zoo_gym_rpcs_total", (("code", "OK"), ("method", "Register")))] == 3
    assert m[("zoo_gym_submissions_accepted_total", ())] == 3
    assert not any(name == "zoo_gym_submissions_refused_total" for name, _ in m)
    r1 = next(r for r in status["rounds"] if r["id"] == 1)
    assert m[("zoo_gym_rounds_published_total", ())] == 1 and m[("zoo_gym_current_round", ())] == 2
    assert m[("zoo_gym_registered_contributors", ())] == 3
    loss = next(c["heldout_loss"] for c in status["checkpoints"] if c["round"] == 1)
    assert m[("zoo_gym_last_heldout_loss", ())] == pytest.approx(loss)
    assert m[("zoo_gym_received_bytes_total", ())] > served_round["uploaded_bytes"]  # payloads + headers
    checkpoint_bytes = next(c["bytes"] for c in status["checkpoints"] if c["round"] == 0)
    assert m[("zoo_gym_sent_bytes_total", ())] >= 3 * checkpoint_bytes  # each client downloaded the base
    assert m[("zoo_gym_aggregation_seconds_count", ())] == 1 and m[("zoo_gym_publish_seconds_count", ())] == 1


def test_the_server_log_is_an_operators_log(served_round):
    text = served_round["log"].read_text()
    assert "Loading weights" not in text
    assert text.count("registration: contributor") == 3
    assert text.count("submission accepted: contributor") == 3
    assert "round 1 closed with 3 submissions" in text and "round 1: published" in text
