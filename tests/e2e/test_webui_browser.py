"""The contributor's console in a real browser: a real `gym-server serve` (tiny, TLS, three per round), two
`gym-client join` processes from the shell and a third contributor joining from `gym-client webui`, driven by
headless Chromium (Debian's `chromium`) over the DevTools protocol, typing and clicking as a person would: a
dropped bad file shows the dry run's row and field, the resolved settings show before the start, the round
publishes on the page with its loss curve and the payment line the ledger gives, the ledger verifies from the
page, and the pulled checkpoint and the join's kept variant (--keep-variant) answer side by side, each through
its own gym-serve, both ended by the page's stop button and by the console's exit. Each view's screenshot is
saved (ZOO_GYM_WEBUI_SHOTS=DIR: copied there; docs/images/webui-*.png were made so).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from e2e_processes import ENV, chromium, client, server_cmd, stop, tls_server, wait_for

websockets_sync = pytest.importorskip("websockets.sync.client")
STEPS = os.environ.get("ZOO_GYM_E2E_STEPS_WEBUI", "8")


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol (a websocket)."""

    def __init__(self, chromium: str, profile: Path) -> None:
        self.proc = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      f"--user-data-dir={profile}", "--remote-debugging-port=0",
                                      "--window-size=1400,1100", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        active = profile / "DevToolsActivePort"
        port = wait_for(lambda: active.exists() and active.read_text().split("\n")[0].strip().isdigit()
                        and int(active.read_text().split("\n")[0]), timeout=60, what="chromium", procs=[self.proc])
        page = next(t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
                    if t["type"] == "page")
        self.ws = websockets_sync.connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self.ids = itertools.count(1)

    def call(self, method: str, **params):
        n = next(self.ids)
        self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=300))
            if msg.get("id") == n:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click (Input.dispatchMouseEvent) at the centre of the element's box, scrolled into view."""
        x, y, w, h = self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                             "e.scrollIntoView({block: 'center'}); const b = e.getBoundingClientRect(); "
                             "return [b.x + b.width / 2, b.y + b.height / 2, b.width, b.height]; })()")
        assert w > 0 and h > 0, f"{selector} is not drawn"
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type_into(self, selector: str, text: str) -> None:
        """Click the field, then type `text` into it as a keyboard would (Input.insertText)."""
        self.click(selector)
        assert self.js(f"document.activeElement === document.querySelector({json.dumps(selector)})")
        self.call("Input.insertText", text=text)

    def until(self, expression: str, *, timeout: float, what: str, procs=()):
        return wait_for(lambda: self.js(expression), timeout=timeout, what=what, procs=procs)

    def shot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        target = os.environ.get("ZOO_GYM_WEBUI_SHOTS")
        if target:
            shutil.copy(path, Path(target) / path.name)

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    browser = chromium()
    root = tmp_path_factory.mktemp("webui")
    state_dir, server, port = tls_server(root, "min-contributors = 3\nround-timeout = 900\n")
    env = {**ENV, "ZOO_GYM_HOME": str(root / "home")}
    console = subprocess.Popen([sys.executable, "-m", "zoo_gym.client", "webui", "--port", "0", "--workdir",
                                str(root / "console")], stderr=open(root / "console.log", "w"), env=env)
    clients = [client(root, name, port, rounds=1, steps=STEPS, shard=i) for i, name in enumerate(("ada", "bob"))]
    try:
        url = wait_for(lambda: (m := re.search(r"console at (http://\S+)", (root / "console.log").read_text()))
                       and m[1], timeout=120, what="the console", procs=[console])
        yield {"root": root, "port": port, "url": url, "state_dir": state_dir, "chromium": browser,
               "procs": [server, console, *clients]}
    finally:
        for path in ("api/join/stop", "api/serve/stop"):  # the console's children outlive it, as a shell's would
            try:
                httpx.post(url + path, timeout=10)
            except Exception:  # noqa: BLE001 - nothing to stop, or the console is gone
                pass
        stop([console, *clients, server])


def _fill(page: Browser, values: dict) -> None:
    for name, value in values.items():
        prop = "checked" if isinstance(value, bool) else "value"
        page.js(f"document.getElementById('f-{name}').{prop} = {json.dumps(value)}")


def _join_from_the_page(page: Browser, fed: dict, shots: Path) -> None:
    root = fed["root"]
    page.call("Page.navigate", url=fed["url"])
    page.until("document.body && document.body.dataset.ready === '1'", timeout=60, what="the page")
    page.type_into("#f-server", f"127.0.0.1:{fed['port']}")
    assert page.js("document.getElementById('f-server').value") == f"127.0.0.1:{fed['port']}"
    assert page.js("document.getElementById('f-keep_variant').type") == "checkbox"  # join's --keep-variant
    _fill(page, {"root_certificates": str(root / "tls" / "ca.pem"), "keep_variant": True, "rounds": "1",
                 "workdir": str(root / "page"), "key": str(root / "page" / "key.pem"), "train__max_steps": STEPS,
                 "shard": "2", "n_shards": "8", "threads": "1", "name": "page"})
    bad = "\\n".join(json.dumps(json.dumps(r))[1:-1] for r in
                     [{"instruction": "2+2", "output": "4"}, {"instruction": "3+3", "output": 6}])
    page.js(f"upload(new File([\"{bad}\\n\"], 'mine.jsonl'))")  # what a drop on the page calls
    error = page.until("document.getElementById('data-error')?.textContent", timeout=300, what="the dry run's error")
    assert error.startswith("error: ") and "line 2" in error and "output" in error
    page.shot(shots / "webui-join-error.png")
    _fill(page, {"data": "builtin"})
    page.js("preview()")
    summary = page.until("document.getElementById('data-summary')?.textContent", timeout=300, what="the preview")
    assert summary.startswith("builtin: format builtin")
    assert page.js("document.getElementById('command').textContent").startswith("gym-client join --server ")
    page.js("window.scrollTo(0, 0)")
    page.shot(shots / "webui-join.png")
    page.click("#start")


def _payment_line(fed: dict, contributor: str) -> str:
    from zoo_gym.client.rewards import payout

    out = subprocess.run(server_cmd("ledger", "show", "--state-dir", str(fed["state_dir"]), "--json"),
                         capture_output=True, text=True, check=True, env=ENV)
    mine = [e for e in json.loads(out.stdout) if e["contributor_id"] == contributor and e["round_id"] == 1]
    return payout(1, mine)[1]


def test_a_contributor_joins_a_round_from_the_page(federation, tmp_path):
    fed, page = federation, Browser(federation["chromium"], tmp_path / "profile")
    try:
        _join_from_the_page(page, fed, tmp_path)
        paid = page.until("document.querySelector('#rounds-table tr[data-round=\"1\"] .payment')?.textContent",
                          timeout=1200, what="round 1's payment line on the page", procs=fed["procs"])
        page.until("document.getElementById('round').dataset.round === '2'", timeout=60, what="round 2 on the page")
        steps = page.js("[...document.querySelectorAll('#loss circle')].map(c => c instanceof SVGCircleElement "
                        "&& c.getBBox().width > 0 && +c.dataset.step)")
        assert steps == list(range(1, int(STEPS) + 1))  # one drawn point per logged loss (logging every step)
        log = page.js("document.getElementById('log').textContent")
        cid = re.search(r"contributor ([0-9a-f]{32}) registered", log)[1]
        assert paid == _payment_line(fed, cid)
        assert "round 1 published" in log
        page.shot(tmp_path / "webui-rounds.png")

        page.js("show('rewards'); verify()")
        verified = page.until("document.querySelector('#verified.ok')?.textContent", timeout=120, what="the ledger")
        assert verified.startswith("verified: every entry's hash and server signature")
        assert page.js("document.querySelectorAll('#ledger tbody tr').length") >= 1
        page.shot(tmp_path / "webui-rewards.png")

        _try_it(page, fed, tmp_path, cid)
        _the_console_exit_stops_both(page, fed)
    finally:
        page.close()


def _try_it(page: Browser, fed: dict, shots: Path, cid: str) -> None:
    """The join kept its round's delta as a variant (--keep-variant, distilled once its one round is done): the
    left pane chats with the pulled checkpoint, the right with that variant over the base it trained on."""
    page.until("document.getElementById('status').textContent === 'join finished'", timeout=600,
               what="the join's end (its variant distilled)", procs=fed["procs"])
    (variant,) = [p.name.removesuffix(".zgd") for p in (fed["root"] / "page" / "variants").glob("*.zgd")]
    assert variant == f"{cid[:8]}-round1" and "kept variant " in page.js("document.getElementById('log').textContent")
    page.js("show('try'); pull()")
    page.until("/^pulled round 1 /.test(document.getElementById('model-status').textContent)", timeout=600,
               what="the pull")
    page.click("#serve")
    page.until("document.querySelectorAll('#model-a option').length > 0 && "
               "document.querySelectorAll('#model-b option').length > 0", timeout=600, what="both gym-serves")
    assert page.js("document.getElementById('label-a').textContent") == "checkpoint round 1"
    label = page.js("document.getElementById('label-b').textContent")
    assert re.fullmatch(r"your variant of round 1 over base [0-9a-f]{12}", label)
    assert page.js("document.getElementById('model-b').value") == variant
    page.click("#ask")
    answered = "document.querySelector('#chat-SIDE .reply')?.dataset.model"
    for side, model in (("a", "checkpoint-round-1"), ("b", variant)):  # the model gym-serve says answered
        assert page.until(answered.replace("SIDE", side), timeout=300, what=f"pane {side}'s reply") == model
        reply = page.js(f"document.querySelector('#chat-{side} .reply').textContent")
        assert reply.startswith(f"{model}: ") and len(reply) > len(f"{model}: ")
    assert not page.js("document.querySelector('#view-try .error')")
    page.shot(shots / "webui-try.png")
    page.click("#serve-stop")
    page.until("document.getElementById('model-status').textContent === 'gym-serve stopped'", timeout=60,
               what="the stop")
    assert httpx.get(fed["url"] + "api/serve", timeout=10).json()["running"] is False
    assert not _gym_serves(fed["root"])


def _gym_serves(root: Path) -> list[int]:
    """The pids of the gym-serve processes the console started (over ROOT/page/variants), zombies left out."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"zoo_gym.serving" in argv and str(root / "page" / "variants").encode() in argv and state != "Z":
            pids.append(int(proc.name))
    return pids


def _the_console_exit_stops_both(page: Browser, fed: dict) -> None:
    """Serve again, then end the console as Ctrl-C or a service manager would: its two gym-serves end with it."""
    page.click("#serve")
    page.until("document.querySelectorAll('#model-b option').length > 0", timeout=600, what="both gym-serves again")
    assert len(_gym_serves(fed["root"])) == 2
    console = fed["procs"][1]
    console.terminate()
    console.wait(timeout=120)
    wait_for(lambda: not _gym_serves(fed["root"]), timeout=60, what="the gym-serves to end with the console")
