"""A real client population against one `gym-server serve` (issue 51): N contributors driven from one process.

Starts the server as an operator would (`init --base-model tiny`, `tls-cert`, `invite --count --json`, `serve`
over TLS with `--admission invite` and the dashboard on), then N contributors, each with its own Ed25519 key, its
own asyncio gRPC channel, an invitation, a signed RoundInfo check and its own payload (rank-4 LoRA factors or a
BitDelta of the whole tiny model, distinct per contributor), all through the client library's own request builders
(`zoo_gym.client.upload`) and "server busy" retries as gym-client's `with_retries` does. A share is hostile or
refused: norm outliers (refused at aggregation), wrong shapes, forged signatures, second uploads and Sybils without
an invitation (refused at the door). Reports acceptances, refusals by reason, retries, the server's VmHWM and CPU
seconds, the time from the last acknowledgement to the publish, bytes on disk, and the time of `status`, `ledger
verify`, the dashboard's pages and `gym-client rewards --verify` afterwards. Prints JSON; asserts nothing.

    python benchmarks/population.py --n 100 [--mode sync|async] [--hostile 0.05] [--out FILE.json]
    python benchmarks/population.py --n 10000 --merge-into benchmarks/results/population.json --plot FILE.png

`--merge-into` puts this invocation's runs into a results file (replacing a run of the same mode and N), keeps its
other keys and recomputes `targets`; `--plot` draws the server's peak and the publish time against N from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: scale.py's disk count
from scale import state_bytes  # noqa: E402

from zoo_gym import codec
from zoo_gym.client.connection import RETRYABLE
from zoo_gym.client.server_signatures import verify_round_info
from zoo_gym.client.upload import build_header, get_round_request, register_request, request_stream
from zoo_gym.codec import LoraFactors
from zoo_gym.proto import gym_pb2, gym_pb2_grpc, signing
from zoo_gym.proto.busy import is_busy
from zoo_gym.proto.tls import channel_credentials

GiB = 1 << 30
# the server and the CLI with the threads torch picks, as an operator runs them; the population itself keeps to one
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Hostile roles, in turn: where each is refused and what the benchmark expects to see
HOSTILE = ("outlier", "wrong-shape", "forged", "twice", "sybil")
ACCEPTED_AT_UPLOAD = ("honest", "outlier", "twice")  # their (first) upload is stored, so it counts for the quorum


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "zoo_gym.server", *args]


# ----------------------------------------------------------------------------------------------- payloads

class Payloads:
    """Each contributor's own delta of the tiny base, made on demand from its index (nothing held for N)."""

    def __init__(self, model_file: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(model_file), framework="pt") as f:
            self.shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        self.linear = [k for k in self.shapes if k.split(".")[-2] in LINEAR]

    def make(self, i: int, *, kind: str, scale: float = 1.0, wrong_shape: bool = False) -> bytes:
        g = torch.Generator().manual_seed(51_000 + i)
        norm = 0.5 * (1.0 + 0.2 * float(torch.rand((), generator=g))) * scale  # honest norms within 20%
        if kind == "lora":
            delta: dict = {}
            for k in self.linear:
                out, inp = self.shapes[k]
                delta[k] = LoraFactors(A=torch.randn(4, inp + (8 if wrong_shape else 0), generator=g) / 2,
                                       B=torch.randn(out, 4, generator=g) * 0.01)
            total = sum(float(f.merged().square().sum()) for f in delta.values()) ** 0.5
            delta = {k: LoraFactors(A=f.A, B=f.B * (norm / total)) for k, f in delta.items()}
            return codec.encode(delta, codec="lora", metadata={"method": "lora", "bench": "population"})
        shapes = dict(self.shapes)
        if wrong_shape:
            first = self.linear[0]
            shapes[first] = (shapes[first][0], shapes[first][1] + 8)
        dense = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
        total = sum(float(t.square().sum()) for t in dense.values()) ** 0.5
        dense = {k: t * (norm / total) for k, t in dense.items()}
        return codec.encode(dense, codec="bitdelta", group_size=128,
                            metadata={"method": "full", "bench": "population"})


# ----------------------------------------------------------------------------------------------- contributors

@dataclass
class Outcome:
    role: str
    kind: str
    stage: str = ""  # "accepted" or where it was refused: register / upload / second-upload / error
    code: str = ""
    reason: str = ""
    retries: int = 0
    acked_at: float = 0.0
    contributor_id: str = ""
    key_pem: bytes = b""


@dataclass
class Plan:
    n: int
    hostile: float
    kinds: str
    roles: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        every = max(2, round(1 / self.hostile)) if self.hostile > 0 else 0
        self.roles = [HOSTILE[(i // every) % len(HOSTILE)] if every and i % every == every - 1 else "honest"
                      for i in range(self.n)]

    def kind(self, i: int) -> str:
        return self.kinds if self.kinds != "mixed" else ("lora" if i % 2 == 0 else "bitdelta")

    @property
    def stored(self) -> int:
        """Uploads the server will store (its quorum / buffer)."""
        return sum(r in ACCEPTED_AT_UPLOAD for r in self.roles)

    @property
    def invited(self) -> int:
        return sum(r != "sybil" for r in self.roles)


def _reason(details: str) -> str:
    """A refusal's reason without what varies per contributor (ids, numbers), to count by."""
    text = re.sub(r"[0-9a-f]{32,64}", "<id>", details or "")
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "<n>", text)[:120]


async def _retrying(call, out: Outcome, *, max_wait: float = 600.0, base_delay: float = 0.5, max_delay: float = 15.0):
    """`call()` with gym-client's retry policy (zoo_gym.client.connection.with_retries): busy or unavailable
    answers retried with jittered exponential backoff up to `max_wait` s; any other answer raised."""
    deadline = time.monotonic() + max_wait
    delay = base_delay
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if (exc.code() not in RETRYABLE and not is_busy(exc)) or time.monotonic() > deadline:
                raise
            out.retries += 1
            await asyncio.sleep(min(delay * (1 + random.random() * 0.25), max_delay))
            delay = min(delay * 2, max_delay)


async def contributor(i: int, plan: Plan, *, address: str, creds, invite: str, payloads: Payloads,
                      server_key: bytes, pool: ThreadPoolExecutor) -> Outcome:
    role, kind = plan.roles[i], plan.kind(i)
    out = Outcome(role=role, kind=kind)
    key = Ed25519PrivateKey.generate()
    loop = asyncio.get_running_loop()
    async with grpc.aio.secure_channel(address, creds) as channel:
        stub = gym_pb2_grpc.GymStub(channel)
        stage = "register"
        try:
            reg = await _retrying(lambda: stub.Register(register_request(key, f"pop{i}", invite=invite), timeout=60),
                                  out)
            out.contributor_id = reg.contributor_id
            stage = "round"
            info = await _retrying(lambda: stub.GetRound(get_round_request(key, reg.contributor_id), timeout=60), out)
            verify_round_info(info, server_key=server_key, address=address)  # as join does before training
            payload = await loop.run_in_executor(pool, lambda: payloads.make(
                i, kind=kind, scale=1000.0 if role == "outlier" else 1.0, wrong_shape=role == "wrong-shape"))
            signer = Ed25519PrivateKey.generate() if role == "forged" else key

            def upload():
                header = build_header(key=signer, contributor_id=reg.contributor_id, round_id=info.round_id,
                                      base_sha256=info.base_sha256, payload=payload, metadata={"i": i})
                return stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 20), timeout=600)

            stage = "upload"
            await _retrying(upload, out)
            out.acked_at = time.monotonic()
            if role == "twice":
                stage = "second-upload"
                await _retrying(upload, out)
            out.stage = "accepted"
        except grpc.aio.AioRpcError as exc:
            out.stage, out.code, out.reason = stage, exc.code().name, _reason(exc.details())
        except Exception as exc:  # noqa: BLE001 - counted, never hidden
            out.stage, out.code, out.reason = "error", type(exc).__name__, str(exc)[:200]
    if i == 0:  # one contributor's key, for `gym-client rewards --verify` afterwards
        out.key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
    return out


async def population(plan: Plan, *, address: str, ca: Path, invites: list[str], payloads: Payloads,
                     server_key: bytes, concurrency: int) -> list[Outcome]:
    creds = channel_credentials(str(ca))
    gate = asyncio.Semaphore(concurrency)
    tokens = iter(invites)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="payload") as pool:
        async def one(i: int) -> Outcome:
            async with gate:
                invite = "" if plan.roles[i] == "sybil" else next(tokens)
                return await contributor(i, plan, address=address, creds=creds, invite=invite, payloads=payloads,
                                         server_key=server_key, pool=pool)

        return list(await asyncio.gather(*(one(i) for i in range(plan.n))))


# ----------------------------------------------------------------------------------------------- the server

class Watch:
    """The server's /proc figures: VmRSS sampled every `period` s, VmHWM and CPU seconds read on demand."""

    def __init__(self, pid: int, period: float = 0.05) -> None:
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, int]] = []
        self.last = {"hwm": 0, "cpu_s": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def read(self) -> dict:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                st = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            tick = os.sysconf("SC_CLK_TCK")
            now = {"hwm": int(st["VmHWM"].split()[0]) * 1024, "rss": int(st["VmRSS"].split()[0]) * 1024,
                   "cpu_s": (int(fields[11]) + int(fields[12])) / tick}
        except (OSError, KeyError, IndexError):  # gone (a zombie has no VmHWM): its last figures
            return self.last
        self.last = now
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            r = self.read()
            if "rss" in r:
                self.samples.append((time.monotonic(), r["rss"]))

    def peak_between(self, t0: float, t1: float) -> int:
        return max((b for t, b in self.samples if t0 <= t <= t1), default=0)

    def stop(self) -> None:
        self._stop.set()


class Logs:
    """The server's stderr, kept in a file and scanned for lines (time of arrival, text)."""

    def __init__(self, stream, echo: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self._echo = echo.open("w")
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append((time.monotonic(), line))
            self._echo.write(line + "\n")
            self._echo.flush()

    def wait_for(self, pattern: str, *, timeout: float, proc: subprocess.Popen) -> float:
        rx, seen, deadline = re.compile(pattern), 0, time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in self.lines[seen:]:
                if rx.search(line):
                    return t
            seen = len(self.lines)
            if proc.poll() is not None:
                raise RuntimeError(f"gym-server exited with {proc.returncode} while waiting for {pattern!r}")
            time.sleep(0.1)
        raise TimeoutError(f"no server log line matched {pattern!r} within {timeout:.0f} s")

    def phases(self, round_id: int, end: float) -> list[tuple[str, float, float]]:
        """(phase, start, stop) of a round's publish from its `round N phase=X` lines, the last ending at `end`."""
        rx = re.compile(rf"round {round_id} phase=([\w-]+)")
        marks = [(m.group(1), t) for t, line in self.lines if (m := rx.search(line))]
        return [(ph, t0, nxt[1]) for (ph, t0), nxt in zip(marks, marks[1:] + [("", end)])]

    def count(self, pattern: str) -> int:
        rx = re.compile(pattern)
        return sum(1 for _, line in self.lines if rx.search(line))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(cmd: list[str], **kw) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, **kw)
    return time.monotonic() - t0, done


def setup(work: Path, plan: Plan) -> dict:
    """init, tls-cert and the invitations, as an operator runs them; the seconds of each."""
    state = work / "state"
    took = {}
    for name, cmd in (("init", _cli("init", "--state-dir", str(state), "--base-model", "tiny")),
                      ("tls_cert", _cli("tls-cert", "--out", str(work / "tls"), "--host", "127.0.0.1"))):
        took[name], done = _timed(cmd)
        if done.returncode != 0:
            raise RuntimeError(f"gym-server {name}: {done.stderr or done.stdout}")
    took["invite"], done = _timed(_cli("invite", "--state-dir", str(state), "--count", str(plan.invited), "--json"))
    if done.returncode != 0:
        raise RuntimeError(f"gym-server invite: {done.stderr or done.stdout}")
    return {"state": state, "invites": json.loads(done.stdout)["invites"], "seconds": took}


def serve(work: Path, state: Path, plan: Plan, *, mode: str, dashboard_port: int,
          extra: tuple[str, ...] = ()) -> subprocess.Popen:
    n = plan.stored
    args = ["serve", "--state-dir", str(state), "--port", "0", "--port-file", str(work / "port"),
            "--ssl-certfile", str(work / "tls" / "server.pem"), "--ssl-keyfile", str(work / "tls" / "server.key"),
            "--admission", "invite", "--round-timeout", "7200", "--dashboard-port", str(dashboard_port)]
    if mode == "sync":
        args += ["--min-contributors", str(n), "--quorum", str(n)]
    else:
        args += ["--mode", "async", "--buffer-size", str(n), "--max-staleness", "4"]
    return subprocess.Popen(_cli(*args, *extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)


# ----------------------------------------------------------------------------------------------- afterwards

def _get(url: str, ca: Path) -> tuple[float, int]:
    ctx = ssl.create_default_context(cafile=str(ca))
    t0 = time.monotonic()
    with urllib.request.urlopen(url, context=ctx, timeout=600) as r:
        size = len(r.read())
    return time.monotonic() - t0, size


def surfaces(work: Path, state: Path, *, port: int, dashboard_port: int, key_pem: bytes) -> dict:
    """The seconds each operator and contributor surface takes on the state the round left."""
    out: dict = {}
    t, done = _timed(_cli("status", "--state-dir", str(state), "--json"))
    out["status_s"], out["status_bytes"] = t, len(done.stdout)
    t, done = _timed(_cli("ledger", "verify", "--state-dir", str(state), "--json"))
    verdict = json.loads(done.stdout) if done.stdout.strip() else {"ok": False, "reason": done.stderr[-300:]}
    out["ledger_verify"] = {"seconds": t, "ok": verdict.get("ok"), "entries": verdict.get("checked")}
    ca = work / "tls" / "ca.pem"
    pages = {}
    for path in ("/", "/api/summary", "/api/rounds", "/api/ledger", "/api/leaderboard", "/api/checkpoints",
                 "/metrics"):
        try:
            seconds, size = _get(f"https://127.0.0.1:{dashboard_port}{path}", ca)
            pages[path] = {"seconds": seconds, "bytes": size}
        except OSError as exc:
            pages[path] = {"error": str(exc)[:200]}
    out["dashboard"] = pages
    key = work / "contributor0.pem"
    key.write_bytes(key_pem)
    key.chmod(0o600)
    t, done = _timed([sys.executable, "-m", "zoo_gym.client", "rewards", "--server", f"127.0.0.1:{port}",
                      "--root-certificates", str(ca), "--key", str(key), "--verify", "--json"])
    doc = json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else {}
    out["rewards_verify"] = {"seconds": t, "ok": doc.get("verification", {}).get("ok"),
                             "error": "" if doc else (done.stderr or done.stdout)[-300:]}
    return out


def soup_fates(state: Path) -> dict[str, dict]:
    """contributor -> its fate in the published round's report (accepted, reason), from `gym-server status`."""
    done = subprocess.run(_cli("status", "--state-dir", str(state), "--json"), capture_output=True, text=True,
                          env=ENV, check=True)
    rounds = [r for r in json.loads(done.stdout)["rounds"] if r["state"] == "published"]
    if not rounds:
        return {}
    return {c["contributor"]: c for c in rounds[0]["report"].get("soup", {}).get("contributors", [])}


def summarise(plan: Plan, outcomes: list[Outcome], fates: dict[str, dict]) -> dict:
    by_role: dict[str, Counter] = {}
    refusals: Counter = Counter()
    for o in outcomes:
        fate = fates.get(o.contributor_id)
        final = o.stage
        if o.stage == "accepted" and fate is not None and not fate.get("accepted", True):
            final = "refused-at-aggregation"
            refusals[f"aggregation: {_reason(fate.get('reason') or '')}"] += 1
        elif o.stage != "accepted":
            refusals[f"{o.stage}: {o.code}: {o.reason}"] += 1
        by_role.setdefault(o.role, Counter())[final] += 1
    honest = [o for o in outcomes if o.role == "honest"]
    accepted = sum(1 for o in honest if o.stage == "accepted" and fates.get(o.contributor_id, {}).get("accepted", True))
    return {"by_role": {r: dict(c) for r, c in by_role.items()}, "refusals": dict(refusals.most_common()),
            "honest": len(honest), "honest_accepted": accepted,
            "accepted": sum(1 for o in outcomes if o.stage == "accepted"
                            and fates.get(o.contributor_id, {}).get("accepted", True)),
            "retries": sum(o.retries for o in outcomes), "retried_contributors": sum(o.retries > 0 for o in outcomes)}


def run(n: int, *, mode: str, hostile: float, kinds: str, concurrency: int, work: Path,
        timeout: float = 3600.0, serve_args: tuple[str, ...] = ()) -> dict:
    plan = Plan(n=n, hostile=hostile, kinds=kinds)
    made = setup(work, plan)
    state = made["state"]
    dashboard_port = _free_port()
    proc = serve(work, state, plan, mode=mode, dashboard_port=dashboard_port, extra=serve_args)
    watch, logs = Watch(proc.pid), Logs(proc.stderr, work / "server.log")
    try:
        logs.wait_for(r"listening on", timeout=300, proc=proc)
        logs.wait_for(r"dashboard at", timeout=60, proc=proc)
        port = int((work / "port").read_text())
        address = f"127.0.0.1:{port}"
        with grpc.secure_channel(address, channel_credentials(str(work / "tls" / "ca.pem"))) as ch:
            server_key = bytes(gym_pb2_grpc.GymStub(ch).GetRound(gym_pb2.GetRoundRequest(), timeout=60)
                               .server_public_key)  # pinned on first contact, as join does
        idle = watch.read()
        from zoo_gym.gym_train import tiny_model_dir

        payloads = Payloads(tiny_model_dir() / "model.safetensors")  # the base `init --base-model tiny` wrote
        t0 = time.monotonic()
        outcomes = asyncio.run(population(plan, address=address, ca=work / "tls" / "ca.pem",
                                          invites=made["invites"], payloads=payloads, server_key=server_key,
                                          concurrency=concurrency))
        t_last_ack = max((o.acked_at for o in outcomes if o.acked_at), default=time.monotonic())
        at_ack = watch.read()
        t_pub = logs.wait_for(r"round 1: (published|REOPENED|HALTED)", timeout=timeout, proc=proc)
        outcome = next(line for _, line in logs.lines if re.search(r"round 1: (published|REOPENED|HALTED)", line))
        time.sleep(0.5)
        at_pub = watch.read()
        disk = state_bytes(state)
        after = surfaces(work, state, port=port, dashboard_port=dashboard_port,
                         key_pem=next(o.key_pem for o in outcomes if o.key_pem))
        fates = soup_fates(state)
        phases = {ph: {"seconds": t1 - t0, "peak_rss_gib": watch.peak_between(t0, t1) / GiB}
                  for ph, t0, t1 in logs.phases(1, t_pub)}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        watch.stop()
    return {
        "n": n, "mode": mode, "kinds": kinds, "hostile_share": hostile, "concurrency": concurrency,
        "stored_uploads_expected": plan.stored, "roles": dict(Counter(plan.roles)),
        **summarise(plan, outcomes, fates),
        "outcome": re.sub(r"^.*?round 1: ", "", outcome)[:200],
        "setup_s": made["seconds"],
        "uploads_s": t_last_ack - t0, "publish_after_last_ack_s": t_pub - t_last_ack,
        "server": {"peak_gib": at_pub["hwm"] / GiB, "idle_rss_gib": idle.get("rss", 0) / GiB,
                   "peak_during_uploads_gib": watch.peak_between(t0, t_last_ack) / GiB,
                   "peak_at_last_ack_gib": at_ack["hwm"] / GiB,
                   "cpu_s": at_pub["cpu_s"], "cpu_s_uploads": at_ack["cpu_s"] - idle["cpu_s"],
                   "cpu_s_publish": at_pub["cpu_s"] - at_ack["cpu_s"]},
        "publish_phases": phases,
        "log_lines": len(logs.lines),
        "disk_bytes": disk, "surfaces": after,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, action="append", help="contributors (repeat for several runs)")
    ap.add_argument("--mode", choices=("sync", "async"), action="append")
    ap.add_argument("--hostile", type=float, default=0.05, help="share of hostile or refused contributors")
    ap.add_argument("--kinds", choices=("lora", "bitdelta", "mixed"), default="mixed")
    ap.add_argument("--concurrency", type=int, default=32, help="contributors in flight at once")
    ap.add_argument("--work", type=Path, help="keep the state directories here (default: a temporary one)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="one more flag for gym-server serve (repeat; e.g. --serve-arg=--register-burst-per-peer=100000 "
                         "to measure a release whose invitations still take bucket tokens)")
    ap.add_argument("--merge-into", type=Path, help="merge the runs into this results file (see the module)")
    ap.add_argument("--plot", type=Path, help="plot the (merged) runs against N into this PNG")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the population's payloads and signatures: the other core is the server's
    runs = []
    for mode in args.mode or ["sync"]:
        for n in args.n or [100]:
            with tempfile.TemporaryDirectory(prefix=f"population-{mode}-{n}-") as tmp:
                work = (args.work / f"{mode}-{n}") if args.work else Path(tmp)
                work.mkdir(parents=True, exist_ok=True)
                runs.append(run(n, mode=mode, hostile=args.hostile, kinds=args.kinds,
                                concurrency=args.concurrency, work=work, serve_args=tuple(args.serve_arg)))
                runs[-1]["commit"] = _commit()
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    doc = {"runs": runs, "targets": targets(runs)}
    if args.merge_into:
        doc = merged(json.loads(args.merge_into.read_text()) if args.merge_into.exists() else {}, runs)
        args.merge_into.write_text(json.dumps(doc, indent=2) + "\n")
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.plot:
        plot(doc["runs"], args.plot)


def _commit() -> str | None:
    got = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return got.stdout.strip() or None


def merged(doc: dict, runs: list[dict]) -> dict:
    """`doc` with `runs` in place of its runs of the same (mode, n), sorted by mode and N, `targets` recomputed."""
    new = {(r["mode"], r["n"]) for r in runs}
    kept = [r for r in doc.get("runs", []) if (r["mode"], r["n"]) not in new]
    doc = {**doc, "runs": sorted(kept + runs, key=lambda r: (r["mode"], r["n"]))}
    doc["targets"] = targets(doc["runs"])
    return doc


def plot(runs: list[dict], path: Path) -> None:
    """The server's peak RSS and the publish time after the last acknowledgement against N, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (peak, publish) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in (("sync", "o"), ("async", "s")):
        rs = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["n"])
        if rs:
            ns = [r["n"] for r in rs]
            peak.plot(ns, [r["server"]["peak_gib"] for r in rs], marker=marker, label=mode)
            publish.plot(ns, [r["publish_after_last_ack_s"] for r in rs], marker=marker, label=mode)
    peak.axhline(2.0, color="grey", linestyle="--", label="target 2 GiB")
    publish.axhline(300.0, color="grey", linestyle="--", label="target 5 min")
    for ax, title in ((peak, "server peak RSS (GiB)"), (publish, "publish after the last ack (s)")):
        ax.set_xscale("log")
        ax.set_xlabel("contributors N")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def targets(runs: list[dict]) -> dict:
    sync = [r for r in runs if r["mode"] == "sync"]
    asyn = [r for r in runs if r["mode"] == "async"]
    big = max(sync, key=lambda r: r["n"], default=None)
    big_async = max(asyn, key=lambda r: r["n"], default=None)
    peaks = [r["server"]["peak_gib"] for r in sync]
    return {"n": big and big["n"], "accepted": big and big["accepted"], "honest": big and big["honest"],
            "server_peak_gib": big and big["server"]["peak_gib"],
            "publish_after_last_ack_s": big and big["publish_after_last_ack_s"],
            "peak_ratio_max_over_min_n": (max(peaks) / min(peaks)) if len(peaks) > 1 else None,
            "async_n": big_async and big_async["n"], "async_accepted": big_async and big_async["accepted"]}


if __name__ == "__main__":
    main()
