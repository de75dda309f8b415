"""A round at a real size: server memory and time on a Qwen3-0.6B-shaped (or 1.7B-shaped) model.

Builds a model with Qwen3-0.6B's exact dimensions (random weights, bf16, the tiny model's tokenizer),
runs `gym-server init` and a real `gym-server serve` process, submits 2 LoRA-factor deltas over gRPC
and samples the server's RSS every 50 ms. Phases come from the server's log lines
(`round N phase=...`, zoo_gym/server/rounds/publish.py). Reported per phase: peak RSS / fp32 model bytes.
Also: aggregation+publish time / (one read + write of the model), scoring time / (one forward +
backward on the scoring set), both baselines measured in this run (the slopes scoring takes from the rows
the aggregation decodes are timed by the server and moved from aggregation to scoring), and how much of the round's
aggregate survives publishing into the bf16 base (item 5). Round 1's base is evaluated while the round waits for
the submissions (the server logs "prepared while open ... in S s"): `prepared_while_open_s` and its ratio to one
forward + backward over the scoring set plus one forward over the rest; its publish then finds them ready.

The deltas are synthetic: rank-8 LoRA factors of every Linear weight, encoded with
zoo_gym.codec (`auto`, as the client sends them), merged entries of RMS `--delta-rms` (a few LoRA
steps' size).

With `--client-steps N` a real `gym-client join` process (the CLI; --data builtin --method lora
--batch-size 2 --max-length 64 --threads 2) trains one LoRA round of N steps on the same base against a
real server (scoring off; the other contributor is one synthetic delta). The client trains in a child
process (zoo_gym/client/train_process.py); the RSS of the client and its children, summed, is sampled every
50 ms; phases come from its stderr lines ("round N: training", the training process's end, "round N:
submitted", "round N published"). Reported: peak RSS / fp32 model bytes while training (the sum, and each
process's VmHWM), RSS while waiting for the publish, the payload / bf16 model bytes, and seconds per LoRA
step (train_seconds / steps of the metadata it signs into its submission). `--server-runs none` runs only
the client part. Child processes are killed when MemAvailable drops under
`--min-free-gb` (3).

The state directory's bytes (all, and its blob store) are reported after init and after each round
(`--rounds R` runs R rounds of the same synthetic deltas; `--keep-checkpoints N` is passed to serve).
`--size 4b` is Qwen3-4B's shape (built in bf16: 8 GB); its client trains with `--client-bf16`.

    python benchmarks/scale.py [--size 0.6b|1.7b|4b|tiny] [--out FILE] [--server-pythonpath DIR]
        [--server-runs both|scoring-on|scoring-off|none] [--client-steps N] [--client-bf16]
        [--rounds R] [--keep-checkpoints N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

SIZES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=48, vocab_size=151936),
}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_model(size: str, out: Path) -> int:
    """A bf16 Qwen3 of `size`'s dimensions with random weights and the tiny tokenizer; returns #params.
    A model of these dimensions already in `out` (a --work directory) is used again."""
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        cfg = json.loads((out / "config.json").read_text())
        if all(cfg.get(k) == v for k, v in SIZES[size].items()):
            from safetensors import safe_open

            with safe_open(str(out / "model.safetensors"), framework="pt") as f:
                return sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from zoo_gym.gym_train import tiny_model_dir

    cfg = Qwen3Config(**SIZES[size], tie_word_embeddings=True, max_position_embeddings=4096,
                      torch_dtype="bfloat16")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a float32 4B would need 16 GB for a moment
    try:
        with torch.device("cpu"):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    tok.save_pretrained(str(out))
    del model
    return n


def lora_deltas(model_dir: Path, *, n: int, rank: int, rms: float) -> list[dict]:
    """n synthetic LoRA deltas {name: LoraFactors} of every Linear weight (merged RMS ~ `rms`)."""
    from safetensors import safe_open

    from zoo_gym.codec.lora import LoraFactors

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    names = [k for k in shapes if k.endswith(".weight") and k.split(".")[-2] in LINEAR]
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + i)
        d = {}
        for k in names:
            o, inp = shapes[k]
            A = torch.randn(rank, inp, generator=g) / rank ** 0.5
            B = torch.randn(o, rank, generator=g) * rms
            d[k] = LoraFactors(A=A, B=B)
        out.append(d)
    return out


class Sampler:
    """Polls /proc/PID/status VmRSS every `period` s; remembers (time, bytes)."""

    def __init__(self, pid: int, period: float = 0.05) -> None:
        self.pid, self.period, self.samples = pid, period, []
        self.last_hwm = 0  # VmHWM at the last sample: survives the process's exit
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            self.last_hwm = int(line.split()[1]) * 1024
                        elif line.startswith("VmRSS:"):
                            self.samples.append((time.monotonic(), int(line.split()[1]) * 1024))
                            break
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(self.period)

    def hwm(self) -> int:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except FileNotFoundError:
            pass
        return 0

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def peak(self, t0: float, t1: float) -> int:
        vals = [b for t, b in self.samples if t0 <= t <= t1]
        return max(vals) if vals else 0


class LogReader:
    """Reads the server's stderr; records (time, line); `wait_for(regex)`."""

    def __init__(self, stream, echo: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self.closed = False
        self._cv = threading.Condition()
        self._echo = open(echo, "w")
        self._t = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._t.start()

    def _run(self, stream) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            self._echo.write(line + "\n")
            self._echo.flush()
            with self._cv:
                self.lines.append((time.monotonic(), line))
                self._cv.notify_all()
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> float:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                for t, line in self.lines:
                    if rx.search(line):
                        return t
                if self.closed:
                    tail = "\n".join(line for _, line in self.lines[-15:])
                    raise RuntimeError(f"the process exited before a log line matching {pattern!r}:\n{tail}")
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no log line matching {pattern!r} in {timeout} s")
                self._cv.wait(left)

    def first(self, pattern: str) -> float | None:
        rx = re.compile(pattern)
        with self._cv:
            return next((t for t, line in self.lines if rx.search(line)), None)

    def number(self, pattern: str) -> float | None:
        """The number group 1 of `pattern` captures in the first line it matches (None: no line does)."""
        rx = re.compile(pattern)
        with self._cv:
            return next((float(m.group(1)) for _, line in self.lines if (m := rx.search(line))), None)


class MemGuard:
    """Kills the benchmark's child processes (and interrupts this one) when the machine's MemAvailable
    drops under `min_free` bytes: a size too big for this machine stops instead of swapping or OOM-killing
    other work. `tripped` holds the lowest MemAvailable seen once it fired."""

    def __init__(self, min_free: int) -> None:
        self.min_free, self.procs, self.tripped = min_free, [], None
        self.lowest = None
        threading.Thread(target=self._run, daemon=True).start()

    def watch(self, p: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(p)
        return p

    def _run(self) -> None:
        import _thread

        while True:
            try:
                with open("/proc/meminfo") as f:
                    avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
            except (OSError, StopIteration):
                return
            self.lowest = avail if self.lowest is None else min(self.lowest, avail)
            if self.min_free and avail < self.min_free and self.tripped is None:
                self.tripped = avail
                print(f"scale.py: MemAvailable {avail / 2**30:.2f} GiB < {self.min_free / 2**30:.2f} GiB; "
                      "stopping", file=sys.stderr, flush=True)
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                _thread.interrupt_main()
            time.sleep(0.25)


GUARD: MemGuard | None = None


def _watch(p: subprocess.Popen) -> subprocess.Popen:
    return GUARD.watch(p) if GUARD is not None else p


def _server_env(pythonpath: str | None) -> dict:
    env = dict(os.environ)
    env.pop("ZOO_GYM_FAULT_AT", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return env


CHILD_CWD = "/"  # `python -c` puts the cwd first on sys.path: from / the --server-pythonpath copy wins


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from zoo_gym.server.cli import app; app()", *args]


def _has_insecure(env: dict, *args: str) -> bool:
    """Whether this copy of zoo_gym's CLI has --insecure (TLS by default): the benchmark runs plaintext."""
    out = subprocess.run(args, env=dict(env, COLUMNS="200"), capture_output=True, text=True, cwd=CHILD_CWD).stdout
    return "--insecure" in out


def _serve_tls_args(env: dict) -> list[str]:
    return ["--insecure"] if _has_insecure(env, *_cli("serve", "--help")) else []


def run_init(state: Path, model_dir: Path, env: dict) -> dict:
    t0 = time.monotonic()
    p = _watch(subprocess.Popen(_cli("init", "--state-dir", str(state), "--base-model", str(model_dir)), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=CHILD_CWD))
    s, tree = Sampler(p.pid), TreeSampler(p.pid)  # the tree: init's checks would count if they ran in children
    out = p.communicate()[0].decode()
    s.stop()
    tree.stop()
    if p.returncode != 0:
        raise RuntimeError(f"gym-server init failed: {out}")
    return {"seconds": time.monotonic() - t0, "peak_rss": max(max((b for _, b in s.samples), default=0), s.last_hwm),
            "peak_tree_rss": max((b for _, b in tree.samples), default=0)}


def submit(port: int, payloads: list[bytes]) -> None:
    import grpc
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from zoo_gym.client.upload import build_header, register_request, request_stream
    from zoo_gym.proto import gym_pb2, gym_pb2_grpc

    opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
        stub = gym_pb2_grpc.GymStub(ch)
        info = stub.GetRound(gym_pb2.GetRoundRequest())
        for i, payload in enumerate(payloads):
            key = Ed25519PrivateKey.generate()
            cid = stub.Register(register_request(key, f"bench{i}")).contributor_id
            header = build_header(key=key, contributor_id=cid, round_id=info.round_id,
                                  base_sha256=info.base_sha256, payload=payload, metadata={"bench": "scale"})
            stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 20))


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server's clean shutdown), SIGKILL after 30 s; nothing if it already ended."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


PHASES = ("load", "scoring-gradient", "aggregation", "scoring", "parent-evaluation", "write", "evaluation", "pack",
          "commit", "retire", "done")  # retire: --keep-checkpoints sweeping older checkpoints, after the commit
AGG_PUBLISH_PHASES = ("load", "aggregation", "write", "pack", "commit")  # "aggregation + publish" of the targets


def state_bytes(state: Path) -> dict:
    """Bytes on disk under the state directory: all of it and its blob store (checkpoints, masters, uploads)."""
    total = blobs = 0
    for root, _, files in os.walk(state):
        for name in files:
            try:
                n = os.stat(os.path.join(root, name)).st_size
            except OSError:
                continue
            total += n
            blobs += n if os.sep + "blobs" + os.sep in root + os.sep else 0
    return {"total": total, "blobs": blobs}


def serve_round(state: Path, payloads: list[bytes], env: dict, work: Path, *, scoring: bool,
                timeout: float, rounds: int = 1, keep_checkpoints: int | None = None) -> dict:
    port_file = work / "port"
    port_file.unlink(missing_ok=True)
    cfg = work / "bench.toml"
    # scoring off: `validation-examples = 0` means no evaluator (no held-out loss, no scoring)
    cfg.write_text("" if scoring else "validation-examples = 0\n")
    args = ["serve", "--state-dir", str(state), "--port", "0", "--port-file", str(port_file),
            "--min-contributors", "2", "--quorum", "2", "--round-timeout", "3600", "--aggregator", "mean", "--config", str(cfg)]
    args += _serve_tls_args(env)
    if keep_checkpoints is not None:
        args += ["--keep-checkpoints", str(keep_checkpoints)]
    disk = [{"after": "init", **state_bytes(state)}]
    p = _watch(subprocess.Popen(_cli(*args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                cwd=CHILD_CWD))
    sampler = Sampler(p.pid)
    logs = LogReader(p.stderr, work / f"server-{'scoring' if scoring else 'noscoring'}.log")
    later: list[dict] = []
    try:
        t_start = time.monotonic()
        logs.wait_for(r"listening on", timeout)
        t_ready = time.monotonic()
        port = int(port_file.read_text())
        time.sleep(1.0)
        t_sub = time.monotonic()
        submit(port, payloads)
        t_closed = logs.wait_for(r"closed with \d+ submissions", timeout)
        t_done = logs.wait_for(r"round 1: (published|REOPENED|HALTED)", timeout)
        outcome = next(line for _, line in logs.lines if re.search(r"round 1: (published|REOPENED|HALTED)", line))
        time.sleep(0.3)
        hwm = sampler.hwm()
        disk.append({"after": "round 1", **state_bytes(state)})
        # round 1's checkpoint and its parent, before a later round's --keep-checkpoints sweeps them
        kept = bf16_kept(state, payloads) if scoring else None
        for k in range(2, rounds + 1):  # more rounds: their phases' seconds and the state directory's bytes
            submit(port, payloads)
            done = logs.wait_for(rf"round {k}: (published|REOPENED|HALTED)", timeout)
            time.sleep(0.3)
            disk.append({"after": f"round {k}", **state_bytes(state)})
            later.append({"round": k, "phases": _phase_seconds(logs, k, done), "tap_s": _tap_seconds(logs, k)})
    finally:
        _stop(p)
        sampler.stop()
    marks = {ph: logs.first(rf"round 1 phase={re.escape(ph)}$") for ph in PHASES}
    seq = [(ph, t) for ph, t in marks.items() if t is not None]
    seq.sort(key=lambda x: x[1])
    phases = {"serve-start": (t_start, t_ready), "serve-idle": (t_ready, t_sub),
              "submissions": (t_sub, seq[0][1] if seq else t_closed)}
    for (ph, t0), nxt in zip(seq, seq[1:] + [(None, t_done)]):
        phases[ph] = (t0, nxt[1])
    return {"outcome": outcome.split(": ", 2)[-1], "phases": phases, "sampler": sampler, "hwm": hwm,
            "state_bytes": disk, "later_rounds": later, "tap_s": _tap_seconds(logs, 1), "bf16_publish": kept,
            "prepared_s": logs.number(r"round 1 base \w+ prepared while open \(.*\) in ([0-9.]+) s")}


def _tap_seconds(logs: "LogReader", k: int) -> float:
    """Seconds round `k`'s scoring took inside the aggregation phase (the slopes taken from the rows it
    decodes: the server logs them); 0 without scoring. Scoring's, not aggregation's."""
    return logs.number(rf"round {k} scoring slopes taken during aggregation in ([0-9.]+) s") or 0.0


def _scoring_seconds(seconds: dict[str, float], tap_s: float) -> float:
    """A round's scoring: its gradient phase (the evaluator's build included), the scores' phase and the
    slopes its tap took inside the aggregation."""
    return seconds.get("scoring-gradient", 0.0) + seconds.get("scoring", 0.0) + tap_s


def _phase_seconds(logs: "LogReader", k: int, done: float) -> dict[str, float]:
    """Seconds of each phase of round `k` (from its first phase mark to `done`, the round's outcome line).
    From round 2 on the base's evaluator and scoring gradient come from the publish before: the steady state."""
    marks = sorted((t, ph) for ph in PHASES if (t := logs.first(rf"round {k} phase={re.escape(ph)}$")) is not None)
    return {ph: t1 - t0 for (t0, ph), (t1, _) in zip(marks, marks[1:] + [(done, None)])}


# The real `gym-client` CLI, with the end of its training process (zoo_gym/client/train_process.py) observed:
# it prints the joining process's own VmRSS once the child that trained and encoded has returned.
CLIENT_WRAPPER = """
import sys
import zoo_gym.client.contribute as j
def _rss():
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmRSS:'))
_real = j.run_in_child
def _observed(*args, **kwargs):
    out = _real(*args, **kwargs)
    print(f'scale-bench training process done: parent_rss={_rss()}', file=sys.stderr, flush=True)
    return out
j.run_in_child = _observed
from zoo_gym.client.cli import app
app(prog_name='gym-client')
"""


class TreeSampler:
    """Polls VmRSS of a process and its descendants every `period` s; remembers (time, summed bytes), each
    process's last VmHWM (its own peak RSS, kept by the kernel) and, every 10th poll, the summed PSS
    (shared pages such as libtorch's, mapped by parent and child, counted once)."""

    def __init__(self, pid: int, period: float = 0.05) -> None:
        self.pid, self.period, self.samples, self.hwm, self.pss = pid, period, [], {}, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _tree(self, pid: int) -> list[int]:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            return [pid]
        return [pid] + [d for k in kids for d in self._tree(k)]

    def _run(self) -> None:
        while not self._stop.is_set() and os.path.exists(f"/proc/{self.pid}"):
            total = 0
            for pid in self._tree(self.pid):
                try:
                    with open(f"/proc/{pid}/status") as f:
                        st = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM", "Name")))
                except (OSError, ValueError):
                    continue
                if "VmRSS" in st:
                    total += int(st["VmRSS"].split()[0]) * 1024
                    self.hwm[pid] = int(st["VmHWM"].split()[0]) * 1024
            self.samples.append((time.monotonic(), total))
            if len(self.samples) % 10 == 1:
                self.pss.append((time.monotonic(), sum(map(self._pss, self._tree(self.pid)))))
            time.sleep(self.period)

    @staticmethod
    def _pss(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            return 0

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def _median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2] if values else 0


def client_round(model_dir: Path, env: dict, work: Path, *, steps: int, other_payload: bytes,
                 n_params: int, timeout: float, threads: int = 2, bf16: bool = False) -> dict:
    """One LoRA round of a real `gym-client join` process against a real `gym-server serve` (scoring off,
    2 contributors: the client and one synthetic LoRA delta submitted before it starts). Samples the RSS
    of the client and its training process every 50 ms; phases come from its stderr lines."""
    tag = "child"
    state, cdir = work / f"state-client-{tag}", work / f"client-{tag}"
    for d in (state, cdir):
        shutil.rmtree(d, ignore_errors=True)
    cdir.mkdir(parents=True)
    init = run_init(state, model_dir, env)
    port_file = work / "port"
    port_file.unlink(missing_ok=True)
    cfg = work / "bench-client.toml"
    cfg.write_text("validation-examples = 0\n")
    srv = _watch(subprocess.Popen(
        _cli("serve", "--state-dir", str(state), "--port", "0", "--port-file", str(port_file),
             "--min-contributors", "2", "--quorum", "2", "--round-timeout", "3600", "--aggregator", "mean",
             "--config", str(cfg), *_serve_tls_args(env)), env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, cwd=CHILD_CWD))
    slogs = LogReader(srv.stderr, work / f"server-client-{tag}.log")
    cli = None
    try:
        slogs.wait_for(r"listening on", timeout)
        port = int(port_file.read_text())
        submit(port, [other_payload])
        cenv = env
        cmd = [sys.executable, "-c", CLIENT_WRAPPER, "join", "--server", f"127.0.0.1:{port}", "--data", "builtin",
               "--method", "lora", "--max-steps", str(steps), "--warmup-steps", "0", "--batch-size", "2",
               "--max-length", "64", "--rounds", "1", "--threads", str(threads), "--quiet", "--json",
               "--workdir", str(cdir), "--key", str(cdir / "contributor.pem"), "--name", "scale-bench"]
        if bf16:
            cmd.append("--bf16")
        if _has_insecure(cenv, sys.executable, "-m", "zoo_gym.client", "join", "--help"):  # a client that speaks TLS by default: this server is plaintext
            cmd.append("--insecure")
        t_start = time.monotonic()
        cli = _watch(subprocess.Popen(cmd, env=cenv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=CHILD_CWD))
        sampler = TreeSampler(cli.pid)
        clogs = LogReader(cli.stderr, work / f"client-{tag}.log")
        t_train = clogs.wait_for(r"round \d+: training", timeout)
        t_rel = clogs.wait_for(r"scale-bench training process done:", timeout)
        t_sub = clogs.wait_for(r"round \d+: submitted", timeout)
        t_pub = clogs.wait_for(r"round \d+ published", timeout)
        out = cli.stdout.read().decode()
        cli.wait(timeout=120)
        t_end = time.monotonic()
        sampler.stop()
        hwm = dict(sampler.hwm)  # pid -> VmHWM as last sampled (the processes are gone)
        outcome = next((line.split(": ", 2)[-1] for _, line in slogs.lines
                        if re.search(r"round 1: (published|REOPENED|HALTED)", line)), None)
    finally:
        for proc in (cli, srv):
            if proc is not None:
                _stop(proc)
    if cli.returncode != 0:
        raise RuntimeError(f"gym-client join exited {cli.returncode}")
    summary = json.loads(out)[0]
    rel = next(line for _, line in clogs.lines if "scale-bench training process done:" in line)
    parent_rss_after_training = int(rel.rsplit("=", 1)[1])
    meta = _submission_metadata(state, summary["contributor"])
    fp32, bf16 = 4 * n_params, 2 * n_params
    phases = {"start-download": (t_start, t_train), "train-encode": (t_train, t_rel), "upload": (t_rel, t_sub),
              "wait-for-publish": (t_sub, t_pub), "exit": (t_pub, t_end)}
    per_phase = {}
    for ph, (a, b) in phases.items():
        vals = [v for t, v in sampler.samples if a <= t <= b]
        per_phase[ph] = {"seconds": b - a, "peak_rss_bytes": max(vals, default=0),
                         "median_rss_bytes": sorted(vals)[len(vals) // 2] if vals else 0,
                         "peak_rss_over_fp32": max(vals, default=0) / fp32, "samples": len(vals)}
    wait = per_phase["wait-for-publish"]
    steps_done = int(meta.get("steps") or steps)
    res = {
        "trains_in": "a child process (zoo_gym/client/train_process.py); RSS figures are the client's and its "
                     "children's, summed",
        "outcome": outcome,
        "init": {"seconds": init["seconds"], "peak_rss_over_fp32": init["peak_rss"] / fp32},
        "phases": per_phase,
        "train_peak_rss_over_fp32": per_phase["train-encode"]["peak_rss_over_fp32"],
        "train_peak_rss_bytes": per_phase["train-encode"]["peak_rss_bytes"],
        "train_peak_pss_bytes": max((v for t, v in sampler.pss if t_train <= t <= t_rel), default=0),
        "wait_median_pss_bytes": _median([v for t, v in sampler.pss if t_sub <= t <= t_pub]),
        "parent_rss_after_training_bytes": parent_rss_after_training,
        "wait_peak_rss_bytes": wait["peak_rss_bytes"], "wait_median_rss_bytes": wait["median_rss_bytes"],
        "wait_seconds": wait["seconds"],
        "payload_bytes": summary["payload_bytes"], "payload_codecs": summary["codecs"],
        "upload_over_bf16": summary["payload_bytes"] / bf16,
        "steps": steps_done, "train_seconds": meta.get("train_seconds"),
        "seconds_per_step": (meta["train_seconds"] / steps_done) if meta.get("train_seconds") else None,
        "seconds_per_step_source": ("train_seconds / steps from the submission's metadata (zoo_gym.gym_train.train: "
                                    "the SFTTrainer's construction + train(), no model load, no evaluation)"),
        "training_line_to_training_process_end_s": t_rel - t_train,
        "loss_before": summary["loss_before"], "loss_after": summary["loss_after"],
        "rss_timeline_s_bytes": [(round(t - t_start, 1), v) for i, (t, v) in enumerate(sampler.samples) if i % 20 == 0],
        "vm_hwm_parent_bytes": hwm.get(cli.pid, 0),
        "vm_hwm_children_bytes": {str(pid): b for pid, b in hwm.items() if pid != cli.pid},
        "vm_hwm_children_max_over_fp32": max((b for pid, b in hwm.items() if pid != cli.pid), default=0) / fp32,
    }
    return res


def _submission_metadata(state: Path, contributor: str) -> dict:
    """The training metadata the client signed into its submission (steps, train_seconds ...)."""
    from sqlmodel import select

    from zoo_gym.server.store.models import Submission
    from zoo_gym.server.store.state import open_state

    st = open_state(state)
    try:
        with st.session() as s:
            sub = s.exec(select(Submission).where(Submission.contributor_id == contributor)).first()
            return json.loads(sub.metadata_json) if sub is not None else {}
    finally:
        st.engine.dispose()


def read_write_seconds(model_file: Path, work: Path, *, cold: bool = False) -> float:
    """One read + write of the model file (safetensors load_file + save_file + fsync), best of 2. `cold`: its
    pages dropped from the page cache first, as a publish finds its base (written past the cache, O_DIRECT)."""
    from safetensors.torch import load_file, save_file

    from zoo_gym.io.page_cache import drop_file_cache

    best = float("inf")
    for _ in range(2):
        if cold:
            drop_file_cache(model_file)
        t0 = time.perf_counter()
        w = load_file(str(model_file))
        out = work / "rw.safetensors"
        save_file(w, str(out), metadata={"format": "pt"})
        with open(out, "rb+") as f:
            os.fsync(f.fileno())
        best = min(best, time.perf_counter() - t0)
        del w
        out.unlink()
    return best


def forward_backward_seconds(model_dir: Path, scoring_examples: int = 32,
                             dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """One forward + backward of the fp32 model on the server's scoring set (packed): (best of 2, the first).

    The first pass runs as the server's scoring pass does, once, on memory the process has not touched
    yet (on this VM, 2.3-2.4 s/GiB: benchmarks/fresh_memory.py); the best is the warm figure."""
    from zoo_gym import gym_train
    from zoo_gym.evaluation.evaluate import load_model, load_tokenizer, tokenize_examples
    from zoo_gym.evaluation.packed_batch import pack_shared_prefix, packed_loss_sum

    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype=dtype, attn_implementation="sdpa")
    examples = gym_train.default_validation_examples(n=scoring_examples)
    batch = pack_shared_prefix(tokenize_examples(tok, examples), pad_id=tok.pad_token_id or 0)
    times = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss, k = packed_loss_sum(model, batch)
        (loss / k).backward()
        times.append(time.perf_counter() - t0)
    rest = gym_train.default_validation_examples(n=128)[scoring_examples:]  # the held-out loss's no-grad part
    rest_batch = pack_shared_prefix(tokenize_examples(tok, rest), pad_id=tok.pad_token_id or 0)
    fwd = []
    for _ in range(2):
        t0 = time.perf_counter()
        with torch.no_grad():
            packed_loss_sum(model, rest_batch)
        fwd.append(time.perf_counter() - t0)
    FORWARD["rest_s"], FORWARD["rest_first_s"] = min(fwd), fwd[0]
    del model
    return min(times), times[0]


FORWARD: dict = {}  # forward_backward_seconds's plain no-grad forward over validation examples 32..127


def bf16_kept(state: Path, payloads: list[bytes]) -> dict:
    """Share of the round's aggregate (the mean of the submitted deltas, as the server decodes them) that the
    published bf16 checkpoint holds, and with the server's float32 master (if there is one) what published
    + carried holds."""
    from zoo_gym import codec
    from zoo_gym.io.safetensors_reader import SafetensorsReader
    from zoo_gym.server.store.checkpoint_writer import master_path
    from zoo_gym.server.store.master_weights import master_of
    from zoo_gym.server.store.models import Round
    from zoo_gym.server.store.state import open_state

    st = open_state(state)
    with st.session() as s:
        r = s.get(Round, 1)
        parent, child = r.base_sha256, r.published_sha256
    dot = agg_sq = err_sq = pub_sq = 0.0
    master_err_sq = 0.0
    mp, cp = master_path(st, parent), master_path(st, child)  # the genesis base has none: its own master
    with SafetensorsReader.in_archive(st.blobs.path(parent)) as fp, \
            SafetensorsReader.in_archive(st.blobs.path(child)) as fc:
        mpr = SafetensorsReader(mp) if mp is not None else None
        mcr = SafetensorsReader(cp) if cp is not None else None
        for name in [e.name for e in codec.read_manifest(payloads[0]).entries]:
            agg = sum(codec.decode_tensor(p, name).double() for p in payloads) / len(payloads)
            p_old, p_new = fp.read(name), fc.read(name)
            pub = p_new.double() - p_old.double()
            dot += float((pub * agg).sum())
            agg_sq += float((agg * agg).sum())
            pub_sq += float((pub * pub).sum())
            err_sq += float(((pub - agg) ** 2).sum())
            if mcr is not None:
                carried = master_of(p_new, mcr, name).double() - master_of(p_old, mpr, name).double()
                master_err_sq += float(((carried - agg) ** 2).sum())
        for reader in (mpr, mcr):
            if reader is not None:
                reader.close()
    out = {"aggregate_norm": agg_sq ** 0.5, "published_norm": pub_sq ** 0.5,
           "published_projection_share": dot / agg_sq,
           "published_relative_error": (err_sq / agg_sq) ** 0.5}
    if mcr is not None:
        out["master_relative_error"] = (master_err_sq / agg_sq) ** 0.5
        out["master_kept_share"] = 1.0 - (master_err_sq / agg_sq) ** 0.5
    st.engine.dispose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="0.6b")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--delta-rms", type=float, default=2e-5)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-scoring-run", action="store_true", help="skip the second round (scoring off)")
    ap.add_argument("--server-runs", choices=("both", "scoring-on", "scoring-off", "none"), default="both",
                    help="which synthetic-delta server rounds to run (none: only the client measurement)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="server rounds per run (the same synthetic deltas each round); phases are round 1's, later rounds' in "
                         "`later_rounds` (the steady state: evaluator and gradient ready from the publish before); the "
                         "state directory's bytes are reported after each")
    ap.add_argument("--keep-checkpoints", type=int, help="gym-server serve --keep-checkpoints (default: unset, all)")
    ap.add_argument("--client-bf16", action="store_true",
                    help="the client trains with --bf16 (LoRA on a bfloat16 base: the way a 4B fits this machine)")
    ap.add_argument("--baseline-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the whole model's dtype for the forward + backward baseline (scoring on); bfloat16 at 4B, "
                         "whose float32 model (16 GB) does not fit beside the rest on 24 GB")
    ap.add_argument("--client-steps", type=int, default=0,
                    help="also run a real `gym-client join` LoRA round of this many steps (0: no client run)")
    ap.add_argument("--min-free-gb", type=float, default=3.0,
                    help="stop (kill the child processes) when MemAvailable drops under this")
    ap.add_argument("--server-pythonpath", help="run the server from this copy of zoo_gym (before/after)")
    ap.add_argument("--work", type=Path, help="keep files here (default: a temporary directory)")
    args = ap.parse_args()
    global GUARD
    GUARD = MemGuard(int(args.min_free_gb * 2**30))
    if args.no_scoring_run:
        args.server_runs = "scoring-on"
    work = (args.work or Path(tempfile.mkdtemp(prefix="zoo-scale-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = _server_env(args.server_pythonpath)
    from zoo_gym import codec

    res: dict = {"size": args.size, "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                 "deltas": (f"synthetic: 2 contributors, rank-{args.rank} LoRA factors of every Linear weight "
                            f"(merged RMS {args.delta_rms:g}), encoded with codec lora (auto's choice for factors); "
                            "no client training")}
    t0 = time.perf_counter()
    model_dir = work / "model"
    n_params = build_model(args.size, model_dir)
    fp32 = 4 * n_params
    res.update(params=n_params, fp32_bytes=fp32, build_s=time.perf_counter() - t0)
    # the client run needs one synthetic contributor beside it; the server runs two
    deltas = lora_deltas(model_dir, n=1 if args.server_runs == "none" else 2, rank=args.rank, rms=args.delta_rms)
    # codec "lora": the encoding `auto` picks for LoRA factors (the smallest, within its error bound), without
    # auto's trial merges of every factor pair (minutes at 4B)
    payloads = [codec.encode(d, codec="lora") for d in deltas]
    res["payload_bytes"] = [len(p) for p in payloads]

    runs = {}
    which = {"both": [True, False], "scoring-on": [True], "scoring-off": [False], "none": []}[args.server_runs]
    for scoring in which:
        state = work / f"state-{'scoring' if scoring else 'noscoring'}"
        shutil.rmtree(state, ignore_errors=True)
        init = run_init(state, model_dir, env)
        r = serve_round(state, payloads, env, work, scoring=scoring, timeout=args.timeout, rounds=args.rounds,
                        keep_checkpoints=args.keep_checkpoints)
        s = r["sampler"]
        phases = {ph: {"seconds": t1 - t0_, "peak_rss_over_fp32": s.peak(t0_, t1) / fp32}
                  for ph, (t0_, t1) in r["phases"].items()}
        phases["init"] = {"seconds": init["seconds"], "peak_rss_over_fp32": init["peak_rss"] / fp32}
        runs["scoring_on" if scoring else "scoring_off"] = {
            "outcome": r["outcome"], "vm_hwm_over_fp32": r["hwm"] / fp32, "vm_hwm_bytes": r["hwm"],
            "init_peak_rss_bytes": init["peak_rss"], "init_peak_tree_rss_bytes": init["peak_tree_rss"],
            "state_bytes": r["state_bytes"], "keep_checkpoints": args.keep_checkpoints, "phases": phases,
            "scoring_slopes_in_aggregation_s": r["tap_s"],
            # the base's evaluator, scoring gradient and held-out loss, computed while round 1 waited for submissions
            "prepared_while_open_s": r["prepared_s"],
            "later_rounds": r["later_rounds"]}
        if scoring:
            res["bf16_publish"] = r["bf16_publish"]
        shutil.rmtree(state, ignore_errors=True)  # a 4B state is ~20 GB: the next run needs the disk
    res["runs"] = runs

    if args.client_steps:
        client = {"train_in_child": client_round(model_dir, env, work, steps=args.client_steps,
                                                 other_payload=payloads[0], n_params=n_params, timeout=args.timeout,
                                                 bf16=args.client_bf16)}
        res["client"] = {
            "setup": (f"real `gym-client join` (--data builtin --method lora --max-steps {args.client_steps} "
                      + ("--bf16 " if args.client_bf16 else "") +
                      "--warmup-steps 0 --batch-size 2 --max-length 64 --threads 2 --rounds 1) against a real "
                      "`gym-server serve` (scoring off, --min-contributors 2: the client + one synthetic delta)"),
            "bf16_bytes": 2 * n_params, "runs": client,
            "targets": {"train_peak_rss_over_fp32": 0.7 if args.client_bf16 else 3.0, "wait_rss_bytes": 0.5e9}}
    rw = read_write_seconds(model_dir / "model.safetensors", work) if runs else None
    rw_cold = read_write_seconds(model_dir / "model.safetensors", work, cold=True) if runs else None
    # the fp32 forward+backward baseline only serves the scoring ratio (and is the biggest in-process step)
    fb, fb_first = (forward_backward_seconds(model_dir, dtype=getattr(torch, args.baseline_dtype))
                    if "scoring_on" in runs else (None, None))
    res["baseline"] = {"read_write_model_s": rw, "read_write_model_cold_s": rw_cold, "forward_backward_dtype": args.baseline_dtype, "forward_backward_scoring_set_s": fb,
                       "forward_backward_scoring_set_first_s": fb_first,
                       "forward_rest_of_validation_s": FORWARD.get("rest_s"),
                       "forward_rest_of_validation_first_s": FORWARD.get("rest_first_s")}
    for key, run in runs.items():
        ph = run["phases"]
        sec = lambda *names: sum(ph[n]["seconds"] for n in names if n in ph)  # noqa: E731
        # the slopes the scoring tap takes inside the aggregation phase count as scoring, not aggregation
        agg_pub = sec(*AGG_PUBLISH_PHASES) - run["scoring_slopes_in_aggregation_s"]
        run["aggregation_publish_s"] = agg_pub
        run["aggregation_publish_over_read_write"] = agg_pub / rw
        run["aggregation_publish_over_cold_read_write"] = agg_pub / rw_cold  # like for like: the publish reads cold
        for later in run.get("later_rounds", []):  # the steady state: the evaluator and gradient come ready
            secs = sum(later["phases"].get(n, 0.0) for n in AGG_PUBLISH_PHASES) - later["tap_s"]
            later["aggregation_publish_s"] = secs
            later["aggregation_publish_over_read_write"] = secs / rw
            later["aggregation_publish_over_cold_read_write"] = secs / rw_cold
            if key == "scoring_on" and fb:
                later["scoring_s"] = _scoring_seconds(later["phases"], later["tap_s"])
                later["scoring_over_forward_backward"] = later["scoring_s"] / fb
        if key == "scoring_on" and fb:
            run["scoring_s"] = _scoring_seconds({n: v["seconds"] for n, v in ph.items()},
                                                run["scoring_slopes_in_aggregation_s"])
            run["scoring_over_forward_backward"] = run["scoring_s"] / fb
            run["scoring_over_first_forward_backward"] = run["scoring_s"] / fb_first  # both cold, both once
            if run["prepared_while_open_s"] is not None:  # the genesis's scoring gradient and held-out forward
                run["prepared_over_forward_backward_plus_forward"] = (
                    run["prepared_while_open_s"] / (fb_first + FORWARD["rest_first_s"]))
            run["evaluation_s"] = sec("parent-evaluation", "evaluation")  # genesis's loss (round 1 only), new model's
            # the genesis's held-out loss past the scoring set: the same no-grad forward as FORWARD's
            run["parent_evaluation_over_forward"] = sec("parent-evaluation") / FORWARD["rest_s"]
            run["parent_evaluation_over_first_forward"] = sec("parent-evaluation") / FORWARD["rest_first_s"]
            # the new checkpoint's: its scoring gradient (forward + backward) and that same forward
            run["new_evaluation_over_forward_backward_plus_forward"] = (
                sec("evaluation") / (fb_first + FORWARD["rest_first_s"]))
    res["targets"] = {"peak_rss_over_fp32_scoring_on": 2.5, "peak_rss_over_fp32_scoring_off": 1.0,
                      "aggregation_publish_over_read_write": 2.0, "scoring_over_forward_backward": 1.3,
                      "bf16_kept_share_min": 0.999,
                      # issue 29: server peak with scoring on, and init's, by size
                      "issue29_peak_rss_over_fp32": {"0.6b": 0.5, "1.7b": 0.35, "4b": 0.25}.get(args.size)}
    res["lowest_mem_available_bytes"] = GUARD.lowest
    text = json.dumps(res, indent=2, sort_keys=True)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
