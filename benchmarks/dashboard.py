"""Dashboard cost. Prints one JSON document.

1. Render: a real server state with `--rounds` published rounds (report, checkpoint row, held-out loss,
   epsilon) and `--ledger` signed ledger entries inserted directly (the Ledger's own append, so the chain
   verifies). We time the dashboard page `/` in-process through its ASGI app (server time: queries,
   templates, charts; no network): the first load (which runs the whole ledger verification, as
   `gym-server ledger verify` does) and the median of the next loads (the verification is reused until the
   ledger changes), plus the JSON endpoints. Target: page <= 300 ms.
2. Overhead: real in-process rounds (3 contributors, tiny model, fp16 deltas over gRPC on 127.0.0.1):
   server time from the first upload to the round's publication, alternating a bare server (no metrics
   interceptor, no dashboard) with the full one (interceptor, dashboard on its port, a browser reloading
   the page and a scraper reading /metrics every --poll-seconds, from the first upload on: at 1 s harsher
   than the page's 5 s refresh and a 15 s Prometheus interval), wall and CPU time of this process.
   Target: <= 2 % more.

    python benchmarks/dashboard.py [--rounds 1000] [--ledger 10000] [--repeats 6] [--poll-seconds 1] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from fastapi.testclient import TestClient
from sqlmodel import Session

from zoo_gym import codec
from zoo_gym.dashboard import DashboardServer, create_app
from zoo_gym.rewards.ledger import Ledger, NewEntry
from zoo_gym.server.store.models import Checkpoint, Contributor, Round, RoundState
from zoo_gym.server.genesis import init_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))


def _fill(state, *, rounds: int, ledger: int, contributors: int = 10) -> None:
    """Synthetic history: `rounds` published rounds and `ledger` signed entries spread over them."""
    import json as _json

    ids = [f"{i:032x}" for i in range(1, contributors + 1)]
    with state.write_lock, state.session() as s:
        genesis = s.get(Round, 1)
        base = genesis.base_sha256
        s.delete(genesis)
        s.flush()
        for cid in ids:
            s.add(Contributor(id=cid, public_key="00" * 32, display_name=f"bench-{cid[-2:]}"))
        parent = base
        for r in range(1, rounds + 1):
            sha = f"{r:064x}"
            report = {"soup": {"contributors": [
                {"contributor": cid, "accepted": j != 0, "reason": None if j else "delta L2 norm too large"}
                for j, cid in enumerate(ids[:3])]}}
            s.add(Round(id=r, state=RoundState.PUBLISHED, base_sha256=parent, published_sha256=sha,
                        aggregator="trimmed-mean", report_json=_json.dumps(report), dp_epsilon_round=0.01,
                        dp_epsilon_total=0.01 * r, deadline_unix=time.time()))
            s.add(Checkpoint(sha256=sha, round_id=r, parent_sha256=parent, size=1 << 20, heldout_loss=5.0 / (1 + r)))
            parent = sha
        s.add(Round(id=rounds + 1, state=RoundState.OPEN, base_sha256=parent, deadline_unix=time.time() + 600))
        s.commit()
    book = Ledger(lambda: Session(state.engine, expire_on_commit=False), state.key)
    per_round = max(1, ledger // rounds)
    batch: list[NewEntry] = []
    for n in range(ledger):
        r = min(rounds, n // per_round + 1)
        batch.append(NewEntry(round_id=r, contributor=ids[n % contributors], kind="reward", amount=n % 97,
                              score=0.01, reputation_after=0.5, reason="bench"))
        if len(batch) == 1000:
            book.append(batch)
            batch = []
    if batch:
        book.append(batch)


def _timed(client: TestClient, path: str) -> float:
    t = time.perf_counter()
    r = client.get(path)
    elapsed = time.perf_counter() - t
    assert r.status_code == 200, (path, r.status_code)
    return elapsed * 1000


def render(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        state = init_state(Path(tmp) / "state", base_model="tiny")
        t = time.perf_counter()
        _fill(state, rounds=args.rounds, ledger=args.ledger)
        fill_s = time.perf_counter() - t
        client = TestClient(create_app(state, dp_target_epsilon=20.0))
        first = _timed(client, "/")
        page = [_timed(client, "/") for _ in range(args.loads)]
        api = {p: statistics.median(_timed(client, p) for _ in range(5)) for p in
               ("/api/summary", "/api/rounds", "/api/loss", "/api/privacy", "/api/leaderboard", "/api/ledger",
                "/api/checkpoints", f"/api/contributors/{1:032x}")}
        ok = client.get("/api/ledger").json()["verification"]
        state.engine.dispose()
    return {"rounds": args.rounds, "ledger_entries": args.ledger, "fill_seconds": round(fill_s, 1),
            "ledger_verified": ok["ok"] and ok["checked"] == args.ledger,
            "page_first_ms": round(first, 1), "page_median_ms": round(statistics.median(page), 1),
            "page_max_ms": round(max(page), 1), "loads": args.loads,
            "api_median_ms": {k: round(v, 1) for k, v in api.items()}, "target_ms": 300,
            "meets_target": statistics.median(page) <= 300}


@contextlib.contextmanager
def _bare_grpc():
    """build_server without the metrics interceptor (the bare arm of the comparison)."""
    import grpc

    real = grpc.server

    def server(*a, **kw):
        kw.pop("interceptors", None)
        return real(*a, **kw)

    grpc.server = server
    try:
        yield
    finally:
        grpc.server = real


def _poll(url: str, stop: threading.Event, counts: dict, every: float) -> None:
    with httpx.Client(timeout=30) as http:
        while True:
            for path in ("", "metrics"):
                http.get(url + path).raise_for_status()
                counts[path or "page"] = counts.get(path or "page", 0) + 1
            if stop.wait(every):
                return


def one_round(tmp: Path, *, full: bool, poll: float) -> tuple[float, float]:
    from conftest import start_federation

    with (contextlib.nullcontext() if full else _bare_grpc()):
        fed = start_federation(tmp, min_contributors=3, aggregator="mean")
    stop, counts, dash, poller = threading.Event(), {}, None, None
    try:
        if full:
            dash = DashboardServer(create_app(fed.state, registry=fed.rounds.metrics.registry), host="127.0.0.1",
                                   port=0)
            dash.start()
            poller = threading.Thread(target=_poll, args=(dash.url, stop, counts, poll), daemon=True)
            poller.start()
        people = [fed.register() for _ in range(3)]
        payloads = [codec.encode(fed.small_delta(seed=i, names=12), codec="fp16") for i in range(3)]
        t, cpu = time.perf_counter(), time.process_time()
        for (key, cid), payload in zip(people, payloads):
            fed.submit(key, cid, payload)
        deadline = time.monotonic() + 300
        while fed.round().round_id < 2:
            assert time.monotonic() < deadline, "round not published in 300 s"
            time.sleep(0.02)
        return time.perf_counter() - t, time.process_time() - cpu
    finally:
        stop.set()
        if poller is not None:
            poller.join(10)
        if dash is not None:
            dash.stop()
        fed.stop()


def overhead(args) -> dict:
    bare, full = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):  # alternate, so drift on a shared machine hits both arms alike
            bare.append(one_round(Path(tmp) / f"bare{i}", full=False, poll=args.poll_seconds))
            full.append(one_round(Path(tmp) / f"full{i}", full=True, poll=args.poll_seconds))
    out = {"repeats": args.repeats, "poll_seconds": args.poll_seconds, "target_pct": 2.0}
    for i, what in enumerate(("wall", "cpu")):  # cpu: this process (server, dashboard, pollers, the 3 uploads)
        b, f = [x[i] for x in bare], [x[i] for x in full]
        mb, mf = statistics.median(b), statistics.median(f)
        out[what] = {"bare_s": [round(x, 3) for x in b], "full_s": [round(x, 3) for x in f],
                     "bare_median_s": round(mb, 3), "full_median_s": round(mf, 3),
                     "overhead_pct": round((mf / mb - 1) * 100, 2)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--ledger", type=int, default=10_000)
    p.add_argument("--loads", type=int, default=20)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--poll-seconds", type=float, default=1.0, help="a page load and a /metrics scrape this often "
                   "during the full arm's rounds (the page refreshes itself every 5 s)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--quick", action="store_true", help="100 rounds, 1000 entries, 2 repeats")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.ledger, args.repeats, args.loads = 100, 1000, 2, 5
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    log_file = Path(tempfile.gettempdir()) / f"dashboard-bench-{os.getpid()}.log"
    logging.basicConfig(filename=log_file, level=logging.INFO)  # both arms log as a server does
    out = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "load_1min": os.getloadavg()[0]},
           "render": render(args), "overhead": overhead(args)}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
