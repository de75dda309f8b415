"""Aggregation beyond one box, measured (issue 50 item 6): prints JSON and writes benchmarks/results/scale_out.json
(`--size 0.6b`; other sizes: scale_out-SIZE.json).

One stored round: a Qwen3-shaped bf16 base of `--size` (benchmarks/scale.py's builder), `--contributors` synthetic
rank-8 LoRA deltas of every Linear weight (scale.py's), the default rule (trimmed mean), scoring off. On a real Ray
cluster on this machine (`ray.cluster_utils.Cluster`: a head with no CPUs and one worker node of this machine's
cores, its own raylet and object store):

(a) the round published by the local engine and by the ray engine (`publish_round` in this process, on copies of
    the same state; the ray engine's first round, which starts the workers, is reported apart): the time ratio,
    and whether the checkpoint and master sha256 are the same;
(b) the worker processes' peak RSS (VmHWM, read from /proc) less a worker's fixed floor (its VmHWM after a ray
    round of a 64-wide model, run first) against the bound `block rows x width x contributors x 16 bytes` of the
    largest block, and against the engine's task model (`ray_engine.task_bytes`: + 20 bytes an element; a block's
    rows are decoded alone);
(c) `--kill-trials N` ray rounds, alternately with the worker node removed (then a fresh one added) and with the
    coordinator (a child process) SIGKILLed while the tasks wait at the gate (ZOO_GYM_RAY_TASK_GATE,
    zoo_gym/server/rounds/faults.py), then redone: each must publish round 1 once, with the local engine's bytes,
    every submission still stored;
(d) the published checkpoint downloaded from an HTTP mirror on 127.0.0.1 (the client's own code,
    client/mirrors.py, hash check included) against the server's DownloadCheckpoint over gRPC (client/download.py,
    an in-process server, plaintext), both on loopback; a corrupt mirror and a dead one must not yield bytes;
(e) benchmarks/capacity.py's model with the measured overhead: rounds sharded over 1, 4 and 16 nodes of this
    machine's size, and the largest contributor count per model size that publishes within the hour.

    python benchmarks/scale_out.py [--size tiny|0.6b] [--contributors 4] [--kill-trials 2] [--repeats 2]
        [--block-rows 4096] [--work DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import http.server
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "server"))
import capacity  # noqa: E402
from scale import SIZES, build_model, lora_deltas  # noqa: E402
from stored_rounds import store_submissions  # noqa: E402

from zoo_gym.server.rounds.faults import TASK_GATE_ENV  # noqa: E402

RULE = "trimmed-mean"
NODES = (1, 4, 16)
GB = 1 << 30


def _vm(pid: int | str, key: str = "VmHWM") -> int:
    """A /proc/PID/status figure in bytes (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[1]) == pid:
                out.append(int(p.name))
    return out


def _workers(node) -> list[int]:
    """PIDs of the Python worker processes a node's raylet started."""
    raylet = node.all_processes["raylet"][0].process.pid
    pids = []
    for pid in _children(raylet):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except FileNotFoundError:
            continue
        if "default_worker" in cmd or cmd.startswith("ray::"):
            pids.append(pid)
    return pids


# ---- the stored round ------------------------------------------------------------------------------------------

def stored_round(model: Path, where: Path, contributors: int) -> dict:
    """A state directory `where` on base `model` with round 1 open and `contributors` LoRA submissions stored;
    returns the changed tensors' shapes."""
    from zoo_gym import codec
    from zoo_gym.server.genesis import init_state

    shutil.rmtree(where, ignore_errors=True)
    state = init_state(where, base_model=str(model), check=False)
    deltas = lora_deltas(model, n=contributors, rank=8, rms=2e-5)
    store_submissions(state, 1, [(f"{i:032x}", codec.encode(d, codec="lora"), "lora") for i, d in enumerate(deltas)])
    state.engine.dispose()
    return {k: (f.B.shape[0], f.A.shape[1]) for k, f in deltas[0].items()}


def publish(where: Path, **flags) -> dict:
    """Round 1 of the state directory `where` published (a redo when begun): seconds, sha256s, rows."""
    from sqlmodel import func, select

    from zoo_gym.server.config import build_config
    from zoo_gym.server.rounds.publish import publish_round
    from zoo_gym.server.store.checkpoint_writer import master_path
    from zoo_gym.server.store.models import Checkpoint, Round, Submission
    from zoo_gym.server.store.state import open_state

    state = open_state(where)
    try:
        cfg = build_config({}, validation_examples=0, min_contributors=3, aggregator=RULE, **flags)
        with state.session() as s:
            rnd = s.get(Round, 1)
            subs = list(s.exec(select(Submission).where(Submission.round_id == 1).order_by(Submission.id)))
        t0 = time.perf_counter()
        outcome = publish_round(state, cfg, rnd, subs)
        seconds = time.perf_counter() - t0
        with state.session() as s:
            rows = list(s.exec(select(Checkpoint).where(Checkpoint.round_id == 1)))
            stored = int(s.exec(select(func.count()).select_from(Submission).where(Submission.round_id == 1)).one())
        mp = master_path(state, rows[0].sha256) if rows else None
        return {"seconds": seconds, "outcome": outcome, "sha256": rows[0].sha256 if rows else None,
                "master_sha256": mp.name if mp else None, "checkpoint_rows": len(rows), "submissions": stored}
    finally:
        state.engine.dispose()


def _copy(template: Path, where: Path) -> Path:
    shutil.rmtree(where, ignore_errors=True)
    shutil.copytree(template, where)
    return where


# ---- (a) time and bytes, (b) worker memory ---------------------------------------------------------------------

def _idle_floor(cpus: int) -> int:
    """The VmHWM of a worker that imported the engine (torch, zoo_gym) and did nothing else: the largest of `cpus`."""
    import ray

    @ray.remote(num_cpus=1)
    def idle() -> int:
        import zoo_gym.server.rounds.ray_engine  # noqa: F401

        time.sleep(0.5)  # one task a worker: the others start on other workers meanwhile
        return _vm("self")

    return max(ray.get([idle.remote() for _ in range(cpus)]))


def worker_floor(node, work: Path, cpus: int, ray_flags: dict) -> dict:
    """A worker's fixed floor: the workers' VmHWM after a ray round of a 64-wide model (tests/server/stored_rounds.py's
    tiny base: every block a few KB), i.e. the engine's code run once, its buffers and allocator warmed; and the
    VmHWM of a worker that only imported the engine. Run before any other round, on the same workers."""
    from stored_rounds import tiny_bf16

    idle = _idle_floor(cpus)
    where = work / "floor"
    stored_round(tiny_bf16(work / "floor-model"), where, 3)
    out = publish(where, **ray_flags)
    shutil.rmtree(where)
    return {"idle_worker_bytes": idle, "floor_bytes": max((_vm(pid) for pid in _workers(node)), default=idle),
            "floor_round_outcome": out["outcome"]}


def engines(template: Path, work: Path, *, repeats: int, ray_flags: dict) -> dict:
    """(a): the local and the ray engine on copies of the template, alternately, `repeats` times each."""
    first = publish(_copy(template, work / "ray-first"), **ray_flags)
    shutil.rmtree(work / "ray-first")
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    for _ in range(repeats):
        for engine, flags in (("local", {}), ("ray", ray_flags)):
            runs[engine].append(publish(_copy(template, work / engine), **flags))
    local_s = min(r["seconds"] for r in runs["local"])
    ray_s = min(r["seconds"] for r in runs["ray"])
    same = len({(r["sha256"], r["master_sha256"]) for r in runs["local"] + runs["ray"] + [first]}) == 1
    return {"local_s": [r["seconds"] for r in runs["local"]], "ray_s": [r["seconds"] for r in runs["ray"]],
            "ray_first_round_s": first["seconds"], "one_node_over_single_box": ray_s / local_s,
            "same_bytes": same, "sha256": runs["local"][0]["sha256"],
            "master_sha256": runs["local"][0]["master_sha256"], "published": work / "local"}


def memory(node, floor: dict, shapes: dict, k: int, block_rows: int) -> dict:
    """(b): the worker processes' VmHWM less the floor, against the block bound and the engine's task model."""
    from zoo_gym.server.rounds.ray_engine import task_bytes

    peaks = {pid: _vm(pid) for pid in _workers(node)}
    peak = max(peaks.values(), default=0)
    block = max(min(block_rows, s[0]) * math.prod(s[1:]) for s in shapes.values())
    bound = block * k * 16
    model = max(task_bytes(s, min(block_rows, s[0]), k) for s in shapes.values())
    base = floor["floor_bytes"]
    return {"worker_vm_hwm_bytes": sorted(peaks.values(), reverse=True), **floor, "largest_block_elements": block,
            "bound_bytes": bound, "task_model_bytes": model,
            "worker_peak_over_bound": (peak - base) / bound if bound else None,
            "worker_peak_over_task_model": (peak - base) / model if model else None}


# ---- (c) faults ------------------------------------------------------------------------------------------------

class Gate:
    """The directory ZOO_GYM_RAY_TASK_GATE names (faults.task_gate): open (DIR/go exists) but during a fault."""

    def __init__(self, path: Path) -> None:
        self.dir = path
        path.mkdir(parents=True, exist_ok=True)
        self.open()

    def open(self) -> None:
        (self.dir / "go").touch()

    def close(self) -> None:
        for p in self.dir.iterdir():
            p.unlink()

    def held(self, *, timeout: float = 900.0, proc: subprocess.Popen | None = None) -> None:
        """Return once a task waits at the gate; RuntimeError when `proc` exits first or time runs out."""
        deadline = time.monotonic() + timeout
        while not any(self.dir.glob("task.*")):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited with {proc.returncode} before its tasks started")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no task reached the gate within {timeout:.0f} s")
            time.sleep(0.05)


def _node_removed(c, node, node_args: dict, gate: Gate, where: Path, ray_flags: dict):
    """A ray round whose worker node is removed while its tasks wait at the gate; a fresh node is added."""
    got: dict = {}

    def run() -> None:
        try:
            got.update(publish(where, **ray_flags))
        except Exception as exc:  # noqa: BLE001 - reported in the trial
            got["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run)
    thread.start()
    gate.held()
    c.remove_node(node)
    node = c.add_node(**node_args)
    gate.open()
    thread.join(timeout=3600)
    return got, node


def _coordinator_killed(c, gate: Gate, where: Path, ray_flags: dict) -> dict:
    """A coordinator (this script, --coordinator) SIGKILLed while its tasks wait at the gate, then the redo here."""
    proc = subprocess.Popen([sys.executable, __file__, "--coordinator", str(where), "--flags", json.dumps(ray_flags)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        gate.held(proc=proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
    gate.open()
    out = publish(where, **ray_flags)  # the restarted server's redo
    out["coordinator_exit"] = proc.returncode
    return out


def kill_trials(n: int, template: Path, work: Path, c, node, node_args: dict, gate: Gate, want: tuple,
                ray_flags: dict, k: int):
    """(c): `n` trials, alternately a worker node removed and the coordinator killed; each must publish once, with
    `want` (checkpoint and master sha256), every submission kept. Returns (trials, the worker node now)."""
    trials = []
    for i in range(n):
        kind = "worker-node-removed" if i % 2 == 0 else "coordinator-killed"
        where = _copy(template, work / "kill")
        gate.close()
        t0 = time.perf_counter()
        if kind == "worker-node-removed":
            out, node = _node_removed(c, node, node_args, gate, where, ray_flags)
        else:
            out = _coordinator_killed(c, gate, where, ray_flags)
        ok = (out.get("checkpoint_rows") == 1 and (out.get("sha256"), out.get("master_sha256")) == want
              and out.get("submissions") == k)
        trials.append({"trial": i, "fault": kind, "published_once_same_bytes": ok, "seconds": time.perf_counter() - t0,
                       **{key: out.get(key) for key in ("sha256", "checkpoint_rows", "submissions", "error")}})
        shutil.rmtree(where, ignore_errors=True)
    gate.open()
    return trials, node


# ---- (d) mirrors -----------------------------------------------------------------------------------------------

class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _http(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(directory)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def mirrors(published: Path, sha: str, work: Path) -> dict:
    """(d): mirror download (client/mirrors.py) against the server's DownloadCheckpoint; corrupt and dead mirrors."""
    import grpc

    from zoo_gym.client.download import _from_server
    from zoo_gym.client.mirrors import MirrorPolicy, from_mirrors
    from zoo_gym.proto import gym_pb2_grpc
    from zoo_gym.server.config import build_config
    from zoo_gym.server.store.state import open_state
    from zoo_gym.server.transport.servicer import build_server

    state = open_state(published)
    blob = state.blobs.path(sha)
    size = blob.stat().st_size
    good, bad = work / "mirror-good", work / "mirror-corrupt"
    for d in (good, bad):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    shutil.copyfile(blob, good / sha)
    shutil.copyfile(blob, bad / sha)
    with open(bad / sha, "r+b") as f:  # one byte flipped in the middle: same size, other bytes
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    partial = work / "download.partial"
    partial.unlink(missing_ok=True)
    (httpd, url), (httpd_bad, url_bad) = _http(good), _http(bad)
    lines: list[str] = []
    try:
        mirror_s, source = _timed(lambda: from_mirrors([url], sha, size, partial, policy=MirrorPolicy(), say=lines.append))
        mirror_ok = source == url and hashlib.sha256(partial.read_bytes()).hexdigest() == sha
        partial.unlink(missing_ok=True)
        corrupt = from_mirrors([url_bad], sha, size, partial, policy=MirrorPolicy(), say=lines.append)
        corrupt_refused = corrupt is None and (not partial.exists() or partial.stat().st_size == 0)
        partial.unlink(missing_ok=True)
        dead_port = _free_port()
        dead_s, dead = _timed(lambda: from_mirrors([f"http://127.0.0.1:{dead_port}"], sha, size, partial,
                                                   policy=MirrorPolicy(timeout=5), say=lines.append))
    finally:
        httpd.shutdown()
        httpd_bad.shutdown()
    server, port, _ = build_server(state, build_config({}, host="127.0.0.1", port=0, insecure=True))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            partial.unlink(missing_ok=True)
            server_s, _ = _timed(lambda: _from_server(gym_pb2_grpc.GymStub(ch), sha, size, partial, progress=False,
                                                      retry=None))
    finally:
        server.stop(grace=None)
        state.engine.dispose()
        partial.unlink(missing_ok=True)
    return {"checkpoint_bytes": size, "mirror_s": mirror_s, "mirror_MBps": size / mirror_s / 1e6,
            "mirror_verified": mirror_ok, "server_grpc_s": server_s, "server_grpc_MBps": size / server_s / 1e6,
            "mirror_over_server_throughput": server_s / mirror_s, "mirror_corrupt_refused": corrupt_refused,
            "mirror_dead_fell_back": dead is None, "mirror_dead_s": dead_s, "client_lines": lines}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- (e) capacity ----------------------------------------------------------------------------------------------

def _largest(size: str, kind: str) -> tuple[int, int]:
    """(rows, width) of the largest changed tensor with the widest rows: down_proj (h x inter) for LoRA deltas,
    the embedding (vocab x h) for 1-bit full deltas."""
    h, inter, _, _, _, _, vocab, _ = capacity.SHAPES[size]
    return (h, inter) if kind == "lora-r16" else (vocab, h)


def _worker_node_bytes(rows: int, width: int, block_rows: int, n: int, floor: int, cores: int) -> int:
    """One task per core, each: the floor + the engine's task model (`ray_engine.task_bytes`)."""
    from zoo_gym.server.rounds.ray_engine import task_bytes

    return cores * (floor + task_bytes((rows, width), min(block_rows, rows), n))


def _fitting_rows(rows: int, width: int, n: int, floor: int, box: dict) -> int:
    """The largest of 4096, 2048, ..., 1 rows a block whose tasks fit a worker node's RAM (0: not even one row)."""
    for r in (4096 >> i for i in range(13)):
        if _worker_node_bytes(rows, width, r, n, floor, box["cores"]) <= box["ram_bytes"]:
            return r
    return 0


def sharded(co: dict, m: dict, size: str, n: int, kind: str, nodes: int, sizing: dict) -> dict:
    """capacity.predict's round on this box with its decode and rule spread over `nodes` worker nodes of this box's
    size, blocks of the rows that fit a node's RAM (each block decodes its own rows: codec.decode_rows), plus the
    measured overhead; RAM on the coordinator and on one worker node."""
    box = capacity.BOXES["2-core/24GB (this box)"]
    one = capacity.predict(co, m, size, n, kind, box)
    rows, width = _largest(size, kind)
    block_rows = _fitting_rows(rows, width, n, sizing["worker_floor_bytes"], box)
    terms = dict(one["terms_s"])
    terms["decode_s"] /= nodes  # every block decodes its rows alone (codec.decode_rows)
    terms["aggregate_s"] /= nodes
    terms["ray_overhead_s"] = sizing["overhead_s_per_param"] * one["params"]
    coordinator = co["server_ram_bytes"]["a"] + co["server_ram_bytes"]["b_per_param"] * one["params"] + \
        n * 4 * rows * width
    round_s = sum(terms.values())
    why = [w for w, bad in (("round > 1 h", round_s > capacity.HOUR),
                            ("coordinator RAM", coordinator > box["ram_bytes"]), ("worker RAM", not block_rows),
                            ("disk", one["disk_bytes_keep_1"] > box["disk_bytes"])) if bad]
    return {"box": f"{nodes} node{'s' if nodes > 1 else ''} of 2-core/24GB", "size": size, "contributors": n,
            "delta": kind, "round_s": round_s, "terms_s": terms, "block_rows": block_rows,
            "coordinator_ram_bytes": coordinator,
            "worker_node_ram_bytes": _worker_node_bytes(rows, width, max(block_rows, 1), n,
                                                        sizing["worker_floor_bytes"], box["cores"]),
            "publishes_within_hour": not why, "limited_by": why}


CAPACITY_MODEL = {
    "round_s": "capacity.py's terms on this box, with aggregate_s divided by the worker nodes (tasks per tensor row "
               "block are independent), decode_s too (each block decodes its own rows: codec.decode_rows), plus "
               "ray_overhead_s: (the ray "
               "engine's round - the local engine's) / params measured here on one worker node (dispatch, the "
               "layout file's extra sequential copy), assumed to scale with params only; ingest and publish stay "
               "on the one coordinator",
    "block_rows": "the largest of 4096 (the default), 2048, ... rows whose tasks, one per core, fit a worker node's "
                  "RAM (what --ray-task-memory-mb's refusal advises); 0: not even one row (limited by worker RAM)",
    "coordinator_ram_bytes": "capacity.py's a + b x params + contributors x 4 bytes x the largest changed tensor: "
                             "validation still stacks one tensor x contributors there (the distances are Ray tasks)",
    "worker_node_ram_bytes": "cores x (a worker's floor measured here + the block x (16 contributors + 20) bytes, "
                             "ray_engine.task_bytes: each block decoded from its rows alone): one task per core",
    "not_modelled": "several ingest processes, object-store range reads",
}


def capacity_refit(overhead_s_per_param: float, worker_floor: int) -> dict:
    """(e): the table for 1, 4 and 16 nodes of this machine's size."""
    m = capacity.measured(ROOT / "benchmarks" / "results")
    co = capacity.fit(m)
    sizing = {"overhead_s_per_param": max(0.0, overhead_s_per_param), "worker_floor_bytes": worker_floor}
    rows = [sharded(co, m, size, n, kind, nodes, sizing) for nodes in NODES for kind in ("lora-r16", "bitdelta-1bit-full")
            for size in capacity.SHAPES for n in capacity.CONTRIBUTORS]
    lim = capacity.limits(rows)
    return {"model": CAPACITY_MODEL, "sizing": sizing, "limits": lim, "headline": capacity.headline(lim),
            "table_markdown": capacity.text_table(lim)}


# ---- main ------------------------------------------------------------------------------------------------------

def _cluster(cpus: int):
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 128 << 20,
                                                       "include_dashboard": False, "dashboard_agent_listen_port": None})
    node_args = {"num_cpus": cpus, "object_store_memory": 256 << 20}
    node = c.add_node(**node_args)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    return c, node, node_args


def run(args, work: Path) -> dict:
    import ray

    gate = Gate(work / "gate")
    os.environ[TASK_GATE_ENV] = str(gate.dir)  # the worker nodes' raylets, hence their workers, see it
    params = build_model(args.size, work / f"model-{args.size}")
    template = work / "template"
    shapes = stored_round(work / f"model-{args.size}", template, args.contributors)
    cpus = os.cpu_count() or 1
    c, node, node_args = _cluster(cpus)
    ray_flags = {"aggregation_engine": "ray", "ray_address": c.address, "ray_block_rows": args.block_rows}
    try:
        floor = worker_floor(node, work, cpus, ray_flags)
        a = engines(template, work, repeats=args.repeats, ray_flags=ray_flags)
        b = memory(node, floor, shapes, args.contributors, args.block_rows)
        trials, node = kill_trials(args.kill_trials, template, work, c, node, node_args, gate,
                                   (a["sha256"], a["master_sha256"]), ray_flags, args.contributors)
    finally:
        ray.shutdown()
        c.shutdown()
    d = mirrors(a.pop("published"), a["sha256"], work)
    overhead = (min(a["ray_s"]) - min(a["local_s"])) / params
    e = capacity_refit(overhead, floor["floor_bytes"])
    return {"params": params, "aggregation": a, "worker_memory": b, "kill_trials": trials, "mirrors": d, "capacity": e}


def targets(res: dict) -> dict:
    a, b, trials, d = res["aggregation"], res["worker_memory"], res["kill_trials"], res["mirrors"]
    ok = sum(t["published_once_same_bytes"] for t in trials)
    return {"one_node_over_single_box": {"value": a["one_node_over_single_box"], "target": "<= 1.3",
                                         "same_bytes": a["same_bytes"]},
            "worker_peak_over_bound": {"value": b["worker_peak_over_bound"], "target": "<= 1.5",
                                       "over_task_model": b["worker_peak_over_task_model"]},
            "kill_trials": {"published_once_same_bytes": ok, "of": len(trials), "target": "all"},
            "mirror_corrupt_refused": d["mirror_corrupt_refused"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--contributors", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="rounds per engine (the fastest counts)")
    ap.add_argument("--kill-trials", type=int, default=2)
    ap.add_argument("--block-rows", type=int, default=4096, help="--ray-block-rows (the server's default)")
    ap.add_argument("--work", type=Path, help="keep files here (default: a temporary directory, removed)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--coordinator", type=Path, help=argparse.SUPPRESS)  # (c): publish this state dir, then exit
    ap.add_argument("--flags", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.contributors < 3:
        ap.error("--contributors must be >= 3 (the trimmed mean's minimum)")
    if args.coordinator:
        publish(args.coordinator, **json.loads(args.flags))
        return
    import ray
    import torch

    work = args.work or Path(tempfile.mkdtemp(prefix="scale-out-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        res = run(args, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    out = {"benchmark": "scale_out", "size": args.size, "contributors": args.contributors, "rule": RULE,
           "block_rows": args.block_rows, "repeats": args.repeats,
           "machine": {"cpus": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                       "platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__, "ray": ray.__version__},
           "wall_s": time.time() - t0, **res}
    out["targets"] = targets(res)
    text = json.dumps(out, indent=2, default=str)
    print(text)
    path = args.out or ROOT / "benchmarks" / "results" / ("scale_out.json" if args.size == "0.6b"
                                                          else f"scale_out-{args.size}.json")
    path.write_text(text + "\n")


if __name__ == "__main__":
    main()
