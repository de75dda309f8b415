"""`gym-demo`: a whole federation on this machine -- one gym-server and N gym-client processes.

Each contributor trains LoRA on its own shard of the built-in data; each round the server merges the
deltas and publishes the next checkpoint. A table per round shows who took part and the held-out loss
of the published checkpoint, which should go down round after round. With a real base
(``--base smollm2-135m``) the contributors learn two-digit arithmetic, and after every round the demo also
exports the checkpoint and prints its exact match on held-out questions, with a few of them answered by the
base and by the new checkpoint side by side.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

from zoo_gym.cli_help import Typer

app = Typer(add_completion=False, pretty_exceptions_enable=False)


def _server_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "zoo_gym.server", *args]


def _client_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "zoo_gym.client", *args]


def _status(state_dir: Path) -> dict:
    out = subprocess.run(_server_cmd("status", "--state-dir", str(state_dir), "--json"), check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def _wait_port(port_file: Path, server: subprocess.Popen, log: Path, timeout: float = 120.0) -> int:
    """The port gym-server serves on; if it exits first, end the demo with its one-line reason."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        if server.poll() is not None:
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
            reason = lines[-1] if lines else f"exit code {server.returncode}"
            typer.echo(f"error: gym-server did not start: {reason.removeprefix('error: ')}", err=True)
            raise typer.Exit(2)
        time.sleep(0.2)
    typer.echo(f"error: gym-server did not start within {timeout:.0f} s; see {log}", err=True)
    raise typer.Exit(2)


# (header, width, right-aligned): the table's one definition, so rows line up with the header
COLUMNS = (("round", 5, True), ("contributors", 12, True), ("accepted", 8, True), ("parent loss", 11, True),
           ("held-out loss", 13, True), ("change", 8, True), ("checkpoint", 12, False))


def _line(cells) -> str:
    return "| " + " | ".join(f"{c:>{w}}" if right else f"{c:<{w}}"
                             for c, (_, w, right) in zip(cells, COLUMNS)) + " |"


def table_header() -> tuple[str, str]:
    """The header line and the Markdown alignment rule under it."""
    rule = "|" + "|".join("-" * (w + 1) + ":" if right else "-" * (w + 2) for _, w, right in COLUMNS) + "|"
    return _line(name for name, _, _ in COLUMNS), rule


def _number(x: float | None, width: int, fmt: str = "{:.4f}") -> str:
    if x is None or math.isnan(x):
        return "-"
    text = fmt.format(x)
    short = ("{:+.2g}" if "+" in fmt else "{:.3g}").format(x).replace("e+0", "e").replace("e-0", "e-")
    return text if len(text) <= width else short


def round_row(status: dict, round_id: int) -> str:
    """The table row of a published round, from `gym-server status --json`."""
    ckpts = {c["round"]: c for c in status["checkpoints"]}
    rnd = next(r for r in status["rounds"] if r["id"] == round_id)
    contributors = rnd["report"].get("soup", {}).get("contributors", [])
    accepted = sum(1 for c in contributors if c.get("accepted"))
    loss, parent = ckpts[round_id]["heldout_loss"], ckpts[round_id - 1]["heldout_loss"]
    change = (loss - parent) / parent * 100 if parent and loss is not None else None
    change_text = "-" if change is None else _number(change, 7, "{:+.1f}") + "%"
    return _line((round_id, len(contributors), accepted, _number(parent, 11), _number(loss, 13), change_text,
                  ckpts[round_id]["sha256"][:12]))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_until_interrupted(server: subprocess.Popen, dashboard_port: int) -> None:
    where = f"; dashboard at https://127.0.0.1:{dashboard_port}/" if dashboard_port else ""
    typer.echo(f"the server keeps serving{where}; Ctrl-C stops it")
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started in the background (SIGINT ignored there)
        signal.signal(sig, lambda *_: stop.set())
    while server.poll() is None and not stop.wait(1.0):
        pass
    typer.echo("stopping")


class AnswerBoard:
    """Exact match of each published checkpoint on held-out questions, and a few answers beside the base's."""

    SHOWN = 4

    def __init__(self, base_dir: Path, examples: list[dict]) -> None:
        from zoo_gym.gym_train.exact_match import exact_match, load_for_eval

        self.examples = examples
        model, tok = load_for_eval(base_dir)
        self.base = exact_match(model, tok, examples, max_new_tokens=8)

    def after_round(self, state_dir: Path, round_id: int) -> str:
        from zoo_gym.gym_train.exact_match import exact_match, load_for_eval

        out = state_dir.parent / "exports" / f"round{round_id}"
        if not out.exists():
            subprocess.run(_server_cmd("export", str(out), "--round", str(round_id), "--state-dir", str(state_dir)),
                           check=True, capture_output=True)
        model, tok = load_for_eval(out)
        em = exact_match(model, tok, self.examples, max_new_tokens=8)
        lines = [f"  round {round_id}: exact match {em.accuracy:.0%} on {em.n} held-out questions "
                 f"(base {self.base.accuracy:.0%})"]
        for ex, before, after in list(zip(self.examples, self.base.answers, em.answers))[:self.SHOWN]:
            mark = "right" if after.strip() == ex["output"] else f"wrong, {ex['output']}"
            lines.append(f"    {ex['instruction']}  base: {before.strip()[:24]!r}  round {round_id}: "
                         f"{after.strip()[:24]!r} ({mark})")
        return "\n".join(lines)


def _real_base_setup(base: str, root: Path) -> tuple[Path, "AnswerBoard", list[str]]:
    """For a real base: the validation file the server scores on (the arithmetic task's held-out split), the
    answer board, and the init arguments."""
    from zoo_gym.gym_train import builtin_examples
    from zoo_gym.gym_train.bases import resolve_base

    base_dir = resolve_base(base)
    held = builtin_examples(REAL_TASK, split="validation", n=64, seed=0)
    validation = root / "validation.jsonl"
    validation.write_text("".join(json.dumps(ex) + "\n" for ex in held))
    typer.echo(f"base {base}: {base_dir}; contributors learn the built-in {REAL_TASK!r} task "
               f"(e.g. {held[0]['instruction']!r})")
    return validation, AnswerBoard(base_dir, held), ["--validation-data", str(validation)]


REAL_TASK = "arithmetic"


def _join_args(i: int, *, port: int, ca: Path, rounds: int, stage: str, finetuning_type: str, clients: int,
               root: Path, max_steps: Optional[int], task: Optional[str] = None) -> list[str]:
    """`gym join` arguments of demo contributor ``i``."""
    args = ["join", "--server", f"127.0.0.1:{port}", "--root-certificates", str(ca),
            "--rounds", str(rounds), "--stage", stage, "--finetuning-type", finetuning_type,
            "--shard", str(i), "--n-shards", str(max(clients, 8)), "--workdir", str(root / f"client{i}"),
            "--key", str(root / f"client{i}" / "key.pem"), "--threads", "1", "--quiet", "--json",
            "--name", f"demo-{i}"]
    if task:  # a real base: FFA-LoRA, whose averaged deltas keep what each contributor learned (learning.md)
        args += ["--task", task, *(("--lora-freeze-a",) if finetuning_type == "lora" else ())]
    if max_steps:
        args += ["--max-steps", str(max_steps)]
        if max_steps <= 5:  # the default warm-up (5 steps) would leave no step at a learning rate > 0
            args += ["--warmup-steps", "0"]
    return args


def round_probe(port: int, ca: Path) -> tuple[int, int] | None:
    """(id, state) of the server's current round by GetRound: milliseconds, where `gym-server status` starts a
    process that imports the server (about a CPU second, taken from the contributors training beside it)."""
    import grpc

    from zoo_gym.proto import gym_pb2, gym_pb2_grpc
    from zoo_gym.proto.tls import channel_credentials

    with grpc.secure_channel(f"127.0.0.1:{port}", channel_credentials(ca)) as ch:
        try:
            info = gym_pb2_grpc.GymStub(ch).GetRound(gym_pb2.GetRoundRequest(), timeout=10)
        except grpc.RpcError:
            return None
    return info.round_id, info.state


def _print_rounds_as_published(state_dir: Path, rounds: int, *, procs, server, logs: Path, port: int, ca: Path,
                               answers: "AnswerBoard | None" = None, recheck_s: float = 30.0) -> None:
    """One table row per round as it is published (and, with a real base, its answers); raises when a client
    or the server failed. Reads `gym-server status` only when the round probe changed (or every `recheck_s`)."""
    shown, seen, read_at = 0, None, -math.inf
    while shown < rounds:
        probe = round_probe(port, ca)
        if probe != seen or probe is None or time.monotonic() - read_at >= recheck_s:
            seen, read_at = probe, time.monotonic()
            status = _status(state_dir)
            published = [r["id"] for r in status["rounds"] if r["state"] == "published"]
            while shown < rounds and shown + 1 in published:
                shown += 1
                typer.echo(round_row(status, shown))
                if answers is not None:
                    typer.echo(answers.after_round(state_dir, shown))
        failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed or server.poll() is not None:
            raise RuntimeError(f"a process failed (clients {failed}, server rc {server.poll()}); see {logs}")
        if shown < rounds:
            time.sleep(1.0)


def _start_server(state_dir: Path, port_file: Path, tls, *, clients: int, aggregator: str | None,
                  dashboard_port: int, log: Path, env: dict, real: bool = False) -> subprocess.Popen:
    """`gym-server serve` over TLS for `clients` contributors (the plain mean below 3: the robust default trims one
    delta from each side); a real base also halves, then thirds, the contributors' learning rate in rounds 2 and 3
    (--client-lr-decay 1; what it changes: docs/measurements/learning.md)."""
    if aggregator is None and clients < 3:
        aggregator = "mean"
        typer.echo(f"{clients} contributor(s): too few for the robust default (trimmed-mean needs 3); merging with "
                   "the plain mean")
    return subprocess.Popen(
        _server_cmd("serve", "--state-dir", str(state_dir), "--port", "0", "--port-file", str(port_file),
                    "--min-contributors", str(clients), "--round-timeout", "600",
                    "--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key),
                    "--dashboard-port", str(dashboard_port), *(("--aggregator", aggregator) if aggregator else ()),
                    *(("--client-lr-decay", "1") if real else ())),
        stderr=open(log, "w"), env=env)


@app.command()
def main(
    clients: int = typer.Option(3, min=1, help="Contributor processes."),
    rounds: int = typer.Option(2, min=1, help="Federated rounds."),
    stage: str = typer.Option("sft", help="sft, dpo, kto, orpo, simpo, rloo, grpo or gspo (gym-client's --stage)."),
    finetuning_type: str = typer.Option("lora", "--finetuning-type", help="lora, full, freeze or oft."),
    aggregator: Optional[str] = typer.Option(None, help="DeltaSoup aggregator (trimmed-mean, multi-krum, mean, "
                                                        "...) \\[default: the server's, trimmed-mean]."),
    workdir: Optional[Path] = typer.Option(None, help="Keep state here (default: a temporary directory)."),
    max_steps: Optional[int] = typer.Option(None, help="Training steps per client per round \\[default: the "
                                                       "client's; 30 with a real base]."),
    base: str = typer.Option("tiny", help="tiny (random weights: the mechanics, in seconds) or smollm2-135m (a "
                                          "real instruct model, 538 MB once converted: real learning, minutes per "
                                          "round on a CPU)."),
    dashboard_port: Optional[int] = typer.Option(None, help="Port of the web dashboard; 0 = off \\[default: a "
                                                            "free port]."),
    keep: bool = typer.Option(False, "--keep", help="After the last round, keep the server and its dashboard "
                                                   "running until Ctrl-C."),
) -> None:
    """Run a local federation on a built-in base and print a table per round."""
    root = workdir or Path(tempfile.mkdtemp(prefix="zoo-gym-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    state_dir, logs = root / "server", root / "logs"
    logs.mkdir(exist_ok=True)
    started = time.monotonic()
    board, init_extra, task = None, [], None
    if base != "tiny":
        _, board, init_extra = _real_base_setup(base, root)
        from zoo_gym.gym_train.config import PREFERENCE_STAGES

        task, max_steps = REAL_TASK + ("-pairs" if stage in PREFERENCE_STAGES else ""), max_steps or 30
    subprocess.run(_server_cmd("init", "--state-dir", str(state_dir), "--base-model", base, *init_extra), check=True)
    port_file = root / "port"
    port_file.unlink(missing_ok=True)
    from zoo_gym.proto.tls import make_certificates

    tls = make_certificates(root / "tls", hosts=("127.0.0.1", "localhost"))  # a private CA, as an operator would
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if dashboard_port is None:
        dashboard_port = _free_port()
    server = _start_server(state_dir, port_file, tls, clients=clients, aggregator=aggregator,
                           dashboard_port=dashboard_port, log=logs / "server.log", env=env, real=task is not None)
    procs = []
    try:
        port = _wait_port(port_file, server, logs / "server.log")
        typer.echo(f"gym-server on 127.0.0.1:{port} over TLS (private CA {tls.ca}); starting {clients} "
                   f"contributors for {rounds} rounds "
                   f"({stage}+{finetuning_type}); logs in {logs}")
        if dashboard_port:
            typer.echo(f"dashboard: https://127.0.0.1:{dashboard_port}/ (JSON API under /api, Prometheus metrics at "
                       f"/metrics; its certificate is from the demo's private CA {tls.ca}: tell the browser to "
                       "accept it)")
        for i in range(clients):
            args = _join_args(i, port=port, ca=tls.ca, rounds=rounds, stage=stage, finetuning_type=finetuning_type,
                              clients=clients, root=root, max_steps=max_steps, task=task)
            procs.append(subprocess.Popen(_client_cmd(*args), stdout=subprocess.PIPE,
                                          stderr=open(logs / f"client{i}.log", "w"), env=env, text=True))
        typer.echo("\n".join(table_header()))
        _print_rounds_as_published(state_dir, rounds, procs=procs, server=server, logs=logs, port=port, ca=tls.ca,
                                   answers=board)
        for p in procs:
            p.wait(timeout=600)
        status = _status(state_dir)
        losses = [c["heldout_loss"] for c in status["checkpoints"]]
        typer.echo(f"held-out loss {losses[0]:.4f} -> {losses[-1]:.4f} over {rounds} rounds in "
                   f"{time.monotonic() - started:.0f} s; state in {state_dir}")
        if not losses[-1] < losses[0]:
            typer.echo("the federation did not lower the held-out loss", err=True)
            raise typer.Exit(1)
        if keep:
            _serve_until_interrupted(server, dashboard_port)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        server.terminate()
        server.wait(timeout=30)
