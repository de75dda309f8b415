"""A training heartbeat for logs: one `step i/N, loss, ETA` line at least every 10 s when no bar is drawn.

A contributor whose output goes to a file or a service manager otherwise sees nothing for minutes. The
line comes from a thread, so a step slower than the interval still gets its line. ``ZOO_GYM_HEARTBEAT_SECONDS``
sets the interval; 0 gives one line per logged loss instead (gym-client webui's live loss curve)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from transformers import TrainerCallback

HEARTBEAT_SECONDS = 10.0


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Heartbeat(TrainerCallback):
    def __init__(self, *, interval: float | None = None, say: Callable[[str], None] = _say) -> None:
        if interval is None:
            interval = float(os.environ.get("ZOO_GYM_HEARTBEAT_SECONDS") or HEARTBEAT_SECONDS)
        self.interval = interval
        self.say = say
        self._step = self._total = 0
        self._loss: float | None = None
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0

    def line(self) -> str:
        elapsed = time.monotonic() - self._start
        eta = elapsed / self._step * (self._total - self._step) if self._step else None
        loss = f"{self._loss:.4f}" if self._loss is not None else "-"
        return (f"training: step {self._step}/{self._total}, loss {loss}, {elapsed:.0f} s elapsed, "
                f"ETA {f'{eta:.0f} s' if eta is not None else 'after the first step'}")

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self._beats += 1
            self.say(self.line())

    def on_train_begin(self, args, state, control, **kwargs):
        self._start, self._total, self._step = time.monotonic(), state.max_steps, state.global_step
        self._stop.clear()
        if self.interval <= 0:  # a line per logged loss (on_log), no thread
            return
        self._thread = threading.Thread(target=self._beat, name="training-heartbeat", daemon=True)
        self._thread.start()

    def on_step_end(self, args, state, control, **kwargs):
        self._step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._loss = float(logs["loss"])
            if self.interval <= 0:
                self._step = state.global_step
                self._beats += 1
                self.say(self.line())

    def on_train_end(self, args, state, control, **kwargs):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._step = state.global_step
        if self._beats:  # a run shorter than one interval (init's one-step check) stays silent
            self.say(self.line().split(", ETA")[0] + ", done")


def training_bar():
    """transformers' ProgressCallback with the loss on the bar instead of a raw log dict written under it."""
    from transformers.trainer_callback import ProgressCallback

    class TrainingBar(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
                self.training_bar.set_postfix(loss=f"{float(logs['loss']):.4f}", refresh=False)

    return TrainingBar()
