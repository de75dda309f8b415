"""`--aggregation-engine ray` (issue 50 items 1, 2 and 5): a real Ray cluster on this machine, a head and two worker
nodes (`ray.cluster_utils.Cluster`, each with its own raylet and object store, one CPU each), publishes every rule's
round with the same bytes as the local engine, DP noise included: the same state copied twice, one round published
by each, the archives (lineage and signature included) and the masters compared byte for byte. A worker node removed, or one
task's worker process killed, while the tasks run still gives those bytes (Ray retries the tasks it lost); so does
the coordinator's redo after it was killed. Storage a node cannot read, Ray missing or unreachable: one line.
Faults hit at a known step: tasks wait at a gate (ZOO_GYM_RAY_TASK_GATE, zoo_gym/server/rounds/faults.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from sqlmodel import select

from zoo_gym import codec
from zoo_gym.server.config import ConfigError, build_config
from zoo_gym.server.genesis import init_state
from zoo_gym.server.rounds.faults import TASK_GATE_ENV
from zoo_gym.server.rounds.publish import publish_round
from zoo_gym.server.rounds.ray_engine import RayEngineError
from zoo_gym.server.store.checkpoint_writer import master_path
from zoo_gym.server.store.models import Checkpoint, Round, RoundState, Submission
from zoo_gym.server.store.state import open_state

from stored_rounds import store_submissions, tiny_bf16

# CI installs the dev extras, which bring Ray: there a missing Ray fails instead of skipping
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(importlib.util.find_spec("ray") is None and not os.environ.get("CI"),
                                 reason="needs the ray extra")]
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
# The head schedules nothing and has no dashboard; its agent's port is picked free (a head takes Ray's fixed default,
# which another test's cluster or Flower's simulation on the other pytest worker may hold at the same time).
HEAD = {"num_cpus": 0, "include_dashboard": False, "dashboard_agent_listen_port": None}
CODECS = ("fp16", "int8", "fp16", "bitdelta", "fp16", "int8")


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={**NODE, **HEAD})
    workers = [c.add_node(**NODE) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c, workers
    ray.shutdown()
    c.shutdown()


def _submit(state, *, lora: bool = False) -> None:
    """Six submissions to round 1 (one far off: what robust rules drop), written as the servicer stores them."""
    from zoo_gym.io.safetensors_reader import SafetensorsReader

    with state.session() as s:
        rnd = s.get(Round, 1)
    with SafetensorsReader.in_archive(state.blobs.path(rnd.base_sha256)) as r:
        shapes = r.shapes()
    names = [k for k, v in shapes.items() if len(v) == 2][:4] + [k for k, v in shapes.items() if len(v) == 1][:1]
    gen = torch.Generator().manual_seed(7)
    subs = []
    for i, method in enumerate(CODECS):
        scale = 1e-2 if i == 5 else 1e-3
        if lora:
            delta = {k: codec.LoraFactors(A=torch.randn(4, shapes[k][1], generator=gen),
                                          B=torch.randn(shapes[k][0], 4, generator=gen) * scale)
                     for k in names if len(shapes[k]) == 2}
            payload = codec.encode(delta, codec="lora", lora_codec="fp32")
        else:
            delta = {k: torch.randn(shapes[k], generator=gen) * scale for k in names}
            payload = codec.encode(delta, codec=method)
        subs.append((f"{i:032x}", payload, "lora" if lora else method))
    store_submissions(state, 1, subs)


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """State directories with round 1 open and six submissions in: full deltas, and LoRA factors."""
    root = tmp_path_factory.mktemp("ray-templates")
    base = tiny_bf16(root / "base")
    out = {}
    for kind in ("full", "lora"):
        state = init_state(root / kind, base_model=str(base), check=False)
        _submit(state, lora=kind == "lora")
        state.engine.dispose()
        out[kind] = root / kind
    return out


def _publish(template: Path, where: Path, **flags) -> tuple[bytes, bytes | None, dict]:
    """Round 1 published from a copy of `template`: (archive bytes, master bytes, the round's report)."""
    shutil.copytree(template, where)
    return publish_in(where, **flags)


def publish_in(where: Path, **flags) -> tuple[bytes, bytes | None, dict]:
    """Round 1 of the state directory `where` published (a redo when it was begun)."""
    import json

    state = open_state(where)
    try:
        cfg = build_config({}, **{"validation_examples": 0, "min_contributors": 3, **flags})
        with state.session() as s:
            rnd = s.get(Round, 1)
            subs = list(s.exec(select(Submission).where(Submission.round_id == 1).order_by(Submission.id)))
        outcome = publish_round(state, cfg, rnd, subs)
        assert outcome.startswith("published"), outcome
        with state.session() as s:
            row = s.exec(select(Checkpoint).where(Checkpoint.round_id == 1)).one()
            report = json.loads(s.get(Round, 1).report_json)
        mp = master_path(state, row.sha256)
        return state.blobs.path(row.sha256).read_bytes(), mp.read_bytes() if mp else None, report
    finally:
        state.engine.dispose()


DP = {"dp_noise_multiplier": 1.0, "dp_clip": 0.05, "dp_expected_contributors": 6}
RULES = [("mean", "full", {}), ("mean", "lora", {}), ("trimmed-mean", "lora", {}), ("trimmed-mean", "full", {}), ("median", "full", {}),
         ("krum", "full", {"byzantine_f": 1}), ("multi-krum", "full", {"byzantine_f": 1}),
         ("geometric-median", "full", {}), ("median", "full", {"server_lr": 0.5}),
         ("trimmed-mean", "full", {"mode": "async", "buffer_size": 6, "server_lr": 2.0}),
         ("mean", "full", DP), ("mean", "lora", DP)]  # DP noise: the round's one stream, drawn as the local pass does


@pytest.mark.parametrize("rule,kind,extra", RULES, ids=[f"{r}-{k}" + "".join(f"-{v}" for v in e.values()) for r, k, e in RULES])
def test_every_rule_publishes_the_local_engines_bytes(cluster, templates, tmp_path, rule, kind, extra, caplog,
                                                      monkeypatch):
    """A pairwise rule's distances come from the tasks too: the coordinator's own whole-tensor pass is broken."""
    from zoo_gym.aggregation.streaming import ClippedRows

    caplog.set_level("INFO", logger="zoo_gym.server")
    flags = {"aggregator": rule, **extra}
    local_ckpt, local_master, local_report = _publish(templates[kind], tmp_path / "local", **flags)

    def on_the_coordinator(self):
        raise AssertionError("the coordinator computed a tensor x contributors' distances itself")

    monkeypatch.setattr(ClippedRows, "pairwise_sq_distances", on_the_coordinator)
    ray_ckpt, ray_master, ray_report = _publish(templates[kind], tmp_path / "ray", aggregation_engine="ray",
                                                ray_address=cluster[0].address, ray_block_rows=16, **flags)
    tasks = [r.getMessage() for r in caplog.records if "Ray tasks" in r.getMessage()]
    assert len(tasks) == 1 and " 0 Ray tasks" not in tasks[0] or kind == "lora", tasks
    assert ray_ckpt == local_ckpt  # archive bytes, lineage and signature included: the same content address
    assert local_master is not None and ray_master == local_master
    if "dp_noise_multiplier" in extra:  # noised: not the round without DP
        monkeypatch.undo()
        assert ray_report["soup"]["noise_std"] > 0
        assert ray_ckpt != _publish(templates[kind], tmp_path / "plain", aggregator=rule)[0]
    for a, b in zip(local_report["soup"]["contributors"], ray_report["soup"]["contributors"]):
        assert (a["accepted"], a["selected"]) == (b["accepted"], b["selected"])
        for key in ("weight", "trimmed_share", "score"):  # summed per block instead of per tensor
            assert (a[key] is None and b[key] is None) or a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12)


def test_scoring_pays_the_same_under_the_ray_engine(cluster, templates, tmp_path):
    """First-order scoring takes its slopes from the rows the aggregation decodes: with the last pass on Ray the
    coordinator shows its tap the tensors that pass would have decoded, so the pay and the bytes are the same."""
    flags = {"aggregator": "trimmed-mean", "validation_examples": 8}
    local_ckpt, _, local_report = _publish(templates["lora"], tmp_path / "local", **flags)
    ray_ckpt, _, ray_report = _publish(templates["lora"], tmp_path / "ray", aggregation_engine="ray",
                                       ray_address=cluster[0].address, ray_block_rows=16, **flags)
    assert ray_ckpt == local_ckpt
    pay = lambda report: [(p["contributor"], p["amount"]) for p in report["rewards"]["payouts"]]  # noqa: E731
    assert pay(ray_report) == pay(local_report) and pay(local_report)
    scores = lambda report: [p["score"] for p in report["rewards"]["payouts"]]  # noqa: E731
    assert scores(ray_report) == pytest.approx(scores(local_report), rel=1e-9)


def test_a_worker_node_removed_mid_round_gives_the_same_bytes(cluster, templates, tmp_path):
    c, workers = cluster
    flags = {"aggregator": "trimmed-mean"}
    want, want_master, _ = _publish(templates["full"], tmp_path / "local", **flags)
    got: dict = {}

    def publish() -> None:
        got["out"] = _publish(templates["full"], tmp_path / "ray", aggregation_engine="ray", ray_address=c.address,
                              ray_block_rows=1, **flags)  # one row a task: hundreds of tasks

    thread = threading.Thread(target=publish)
    thread.start()
    work = tmp_path / "ray" / "work" / "ray" / "round-1"
    deadline = time.monotonic() + 120
    while not work.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # tasks are running on both workers
    assert thread.is_alive(), "the round ended before the node could be removed: give it more tasks"
    c.remove_node(workers[0])
    thread.join(timeout=200)
    workers[0] = c.add_node(**NODE)  # the cluster as it was, for what runs after
    assert got["out"][0] == want and got["out"][1] == want_master


@contextmanager
def _gated(cluster, gate: Path):
    """This process's Ray job with ZOO_GYM_RAY_TASK_GATE=`gate` in its workers' environment: each task of a round
    touches gate/task.<tensor>@<start>.<pid> and waits for gate/go before it reads or writes anything
    (faults.task_gate). The plain job again afterwards."""
    import ray

    gate.mkdir()
    ray.shutdown()
    ray.init(address=cluster[0].address, log_to_driver=False, runtime_env={"env_vars": {TASK_GATE_ENV: str(gate)}})
    try:
        yield gate
    finally:
        (gate / "go").touch()
        ray.shutdown()
        ray.init(address=cluster[0].address, log_to_driver=False)


def _held(gate: Path, timeout: float = 120.0) -> list[tuple[str, int]]:
    """(label, worker pid) of the tasks waiting at the gate, as soon as one is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = [p.name.removeprefix("task.").rsplit(".", 1) for p in gate.glob("task.*")]
        if held:
            return [(label, int(pid)) for label, pid in held]
        time.sleep(0.05)
    raise AssertionError(f"no Ray task reached the gate within {timeout:.0f} s")


def _in_thread(target) -> tuple[threading.Thread, dict]:
    """`target()` running in a thread; the dict gets its result ("out") or exception ("error")."""
    got: dict = {}

    def run() -> None:
        try:
            got["out"] = target()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            got["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def test_a_worker_process_killed_mid_task_is_rerun_to_the_same_bytes(cluster, templates, tmp_path):
    """One task's worker process (not its node) SIGKILLed while the task runs, held at the gate before it has read or
    written anything: Ray runs the task again and the round publishes the local engine's bytes, so that task's rows
    were written by the rerun."""
    flags = {"aggregator": "trimmed-mean"}
    want, want_master, _ = _publish(templates["full"], tmp_path / "local", **flags)
    with _gated(cluster, tmp_path / "gate") as gate:
        thread, got = _in_thread(lambda: _publish(templates["full"], tmp_path / "ray", aggregation_engine="ray",
                                                  ray_address=cluster[0].address, ray_block_rows=16, **flags))
        label, pid = _held(gate)[0]
        os.kill(pid, signal.SIGKILL)
        (gate / "go").touch()
        thread.join(timeout=200)
    assert not thread.is_alive() and "error" not in got, got.get("error")
    assert got["out"][0] == want and got["out"][1] == want_master, f"task {label} killed in worker {pid}"


def test_storage_a_node_cannot_read_fails_the_round_in_one_line_and_publishes_nothing(cluster, templates, tmp_path):
    """An upload gone from the nodes' view of the state directory once the coordinator has mapped it (what a node
    that does not mount it sees): the round ends with one line naming the node and the path, nothing is published,
    and once the storage is back the redo publishes the local engine's bytes."""
    flags = {"aggregator": "median"}
    want, want_master, _ = _publish(templates["full"], tmp_path / "local", **flags)
    where = tmp_path / "ray"
    shutil.copytree(templates["full"], where)
    state = open_state(where)
    with state.session() as s:
        first = s.exec(select(Submission).where(Submission.round_id == 1).order_by(Submission.id)).first()
    payload, aside = state.blobs.path(first.payload_sha256), tmp_path / "aside"
    blobs_before = sorted(p.name for p in (state.blobs.root / "sha256").rglob("*") if p.is_file())
    with _gated(cluster, tmp_path / "gate") as gate:
        thread, got = _in_thread(lambda: publish_in(where, aggregation_engine="ray", ray_address=cluster[0].address,
                                                    ray_block_rows=16, **flags))
        _held(gate)
        payload.rename(aside)
        (gate / "go").touch()
        thread.join(timeout=200)
    assert not thread.is_alive()
    error = got.get("error")
    assert isinstance(error, RayEngineError), got
    line = str(error)
    assert "\n" not in line and str(payload) in line and "every node must mount" in line, line
    assert "not published" in line
    with state.session() as s:
        assert s.exec(select(Checkpoint).where(Checkpoint.round_id == 1)).first() is None
        assert s.get(Round, 1).state != RoundState.PUBLISHED and s.get(Round, 2) is None
    aside.rename(payload)
    assert sorted(p.name for p in (state.blobs.root / "sha256").rglob("*") if p.is_file()) == blobs_before
    assert not (where / "work" / "ray" / "round-1").exists() and not any(state.blobs.tmp_dir.iterdir())
    state.engine.dispose()
    ckpt, master, _ = publish_in(where, aggregation_engine="ray", ray_address=cluster[0].address,
                                 ray_block_rows=16, **flags)  # the storage back: the redo publishes
    assert ckpt == want and master == want_master


@pytest.mark.parametrize("when", ["tasks-running", "aggregated"])
def test_the_coordinator_killed_mid_publish_redoes_the_round_to_the_same_bytes(cluster, templates, tmp_path, when):
    """SIGKILLed while its tasks run (they may still write their blocks: the same bytes) or once they have all
    written theirs (ZOO_GYM_FAULT_AT=aggregated): the restarted server's redo publishes the local engine's bytes."""
    flags = {"aggregator": "multi-krum", "byzantine_f": 1}
    want, want_master, _ = _publish(templates["full"], tmp_path / "local", **flags)
    shutil.copytree(templates["full"], tmp_path / "ray")
    rows = 1 if when == "tasks-running" else 16
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from test_ray_engine import publish_in\n"
            f"publish_in({str(tmp_path / 'ray')!r}, aggregation_engine='ray', ray_address={cluster[0].address!r}, "
            f"ray_block_rows={rows}, **{flags!r})\n")
    env = {**os.environ, **({"ZOO_GYM_FAULT_AT": when} if when == "aggregated" else {})}
    coordinator = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
    if when == "tasks-running":
        work = tmp_path / "ray" / "work" / "ray" / "round-1"
        deadline = time.monotonic() + 120
        while not work.exists() and time.monotonic() < deadline and coordinator.poll() is None:
            time.sleep(0.05)
        time.sleep(1.0)
        assert coordinator.poll() is None, "the round ended before the coordinator could be killed"
        coordinator.kill()
    _, err = coordinator.communicate(timeout=180)
    assert coordinator.returncode == -9, err[-2000:]
    ckpt, master, _ = publish_in(tmp_path / "ray", aggregation_engine="ray", ray_address=cluster[0].address,
                                 ray_block_rows=16, **flags)  # the restarted server's redo
    assert ckpt == want and master == want_master


def test_ray_missing_or_unreachable_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError) as exc:
        build_config({}, aggregation_engine="ray")
    assert "pip install 'zoo-gym[ray]'" in str(exc.value) and "\n" not in str(exc.value)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="ray_address"):
        build_config({}, ray_address="127.0.0.1:6379")
    code = ("from zoo_gym.server.rounds.ray_engine import connect, RayEngineError\n"
            "try:\n    connect('127.0.0.1:1')\nexcept RayEngineError as e:\n    print('ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180).stdout
    lines = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 1 and "127.0.0.1:1" in lines[0], out


def test_a_task_too_large_for_its_memory_is_refused_before_any_runs():
    from zoo_gym.server.rounds.ray_engine import RayEngineError, check_memory

    with pytest.raises(RayEngineError, match="lower --ray-block-rows to 512"):
        check_memory({"w": (4096, 1024)}, 8, block_rows=4096, budget_mb=80)
    check_memory({"w": (4096, 1024)}, 8, block_rows=512, budget_mb=80)
    check_memory({"w": (1 << 20, 64)}, 8, block_rows=1, budget_mb=80)  # rows are decoded alone: a tall tensor fits
    with pytest.raises(RayEngineError, match="even one row does not fit"):
        check_memory({"w": (4, 1 << 20)}, 8, block_rows=1, budget_mb=80)
    with pytest.raises(RayEngineError, match="even one row does not fit"):  # odd width: int4 may decode it whole
        check_memory({"w": (1 << 20, 63)}, 8, block_rows=1, budget_mb=80)
