"""A `gym-client join` (or pull) that the console started: one child process, its lines, its progress.

The child writes to files in the console's directory (not pipes), in a session of its own: closing the page or
stopping the console leaves it running, as a join started in a shell would be; `stop` sends it SIGINT, the
CLI's Ctrl-C. `progress` reads the CLI's own lines: the phase (download, training, encode and upload,
waiting for the publish), the heartbeat's step/loss points (a curve) and each round's payment line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

_STEP = re.compile(r"^training: step (\d+)/(\d+), loss ([0-9.eE+-]+)")
_PAY = re.compile(r"^round (\d+): (paid |not paid|reward |refusal |penalty )")
_PHASES = ((re.compile(r"^training data: "), "download"), (re.compile(r"^round (\d+): training "), "training"),
           (re.compile(r"^training: step .*, done$"), "encode and upload"),
           (re.compile(r"^round (\d+): submitted "), "waiting for the publish"),
           (re.compile(r"^round (\d+) published"), "published"),
           (re.compile(r"^round (\d+) is not open for us yet"), "waiting for a round"))


class Busy(RuntimeError):
    """Another child is running: one start at a time."""


def progress(lines: list[str]) -> dict:
    """What the CLI's lines say so far: {phase, round, loss: [[step, loss]...], steps, payments, error}."""
    state = {"phase": "starting", "round": None, "loss": [], "steps": None, "payments": [], "submitted": [],
             "error": None}
    for line in lines:
        if m := _STEP.match(line):
            step, state["steps"] = int(m[1]), int(m[2])
            if not state["loss"] or state["loss"][-1][0] != step:
                state["loss"].append([step, float(m[3])])
        if m := _PAY.match(line):
            state["payments"].append({"round": int(m[1]), "line": line})
        if line.startswith("error: "):
            state["error"] = line
        for pattern, phase in _PHASES:
            if m := pattern.match(line):
                state["phase"] = phase
                if m.groups():
                    state["round"] = int(m[1])
                if phase == "training":
                    state["loss"] = []
                if phase == "waiting for the publish":
                    state["submitted"].append(line)
    return state


class Child:
    """One child process with its stdout and stderr in `directory`."""

    def __init__(self, argv: list[str], directory: Path, *, env: dict[str, str], what: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.argv, self.what, self.directory = argv, what, directory
        self.stdout, self.stderr = directory / "stdout", directory / "stderr.log"
        with open(self.stdout, "wb") as out, open(self.stderr, "wb") as err:
            self.process = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)
        self.started = time.time()

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def lines(self) -> list[str]:
        text = self.stderr.read_text(errors="replace") if self.stderr.exists() else ""
        return [line.rstrip() for line in re.split(r"[\r\n]+", text) if line.strip()]

    def result(self):
        """The --json document on stdout once the child exited 0, else None."""
        if self.running or self.process.returncode != 0:
            return None
        try:
            return json.loads(self.stdout.read_text() or "null")
        except ValueError:
            return None

    def stop(self) -> None:
        if self.running:
            os.killpg(self.process.pid, signal.SIGINT)

    def end(self, grace: float) -> None:
        """Stop and wait: SIGINT, then SIGKILL to its process group after `grace` seconds."""
        self.stop()
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)

    def view(self, since: int = 0) -> dict:
        lines = self.lines()
        code = self.process.poll()
        return {"what": self.what, "running": code is None, "exit_code": code, "lines": lines[since:],
                "line_count": len(lines), "progress": progress(lines), "result": self.result()}


class Slot:
    """At most one running child of a kind (a join, a pull): a second start is Busy, in one line."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.child: Child | None = None
        self._lock = threading.Lock()

    def start(self, argv: list[str], directory: Path, *, env: dict[str, str], what: str) -> Child:
        with self._lock:
            if self.child is not None and self.child.running:
                raise Busy(f"a {self.kind} is already running ({self.child.what}); stop it or wait for it to end")
            self.child = Child(argv, directory, env=env, what=what)
            return self.child
