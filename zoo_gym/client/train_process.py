"""Run the model-sized work (load the base, train, encode) in a child process, so that the process that
then uploads and waits for the publish never holds the model.

A freed model does not leave a process: glibc and torch keep part of the heap (on a Qwen3-0.6B-shaped
model `gym-client join` still held 0.68 GB after `release_memory()`, 2.3x its size before the load), and
a contributor waits minutes per round. The child is started with multiprocessing's "spawn" (a fresh
interpreter: no copy of the parent's heap or gRPC threads) and sends back only a small result (paths,
metadata); its memory goes back to the system when it exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any


class TrainingProcessDied(RuntimeError):
    """The child ended without a result (killed, e.g. by the kernel's out-of-memory killer)."""


def run_in_child(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a fresh child process; its return value, or its exception raised here.

    ``fn`` and its arguments must pickle (a module-level function; no lambdas). The child inherits
    stdout/stderr (its progress bars show as before), the environment, torch's thread count and the
    root logger's level. The exception keeps its type and message (the nearest built-in base class
    when it does not pickle), with the child's traceback as a note. Ctrl-C here stops the child; a
    child whose parent is gone exits.
    """
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(send, _settings(), fn, args, kwargs), name="gym-client-train")
    child.start()
    send.close()
    try:
        # a timed wait, not a blocking recv(): Ctrl-C often lands on one of gRPC's threads, and Python raises
        # KeyboardInterrupt only when the main thread runs again
        while not multiprocessing.connection.wait([receive, child.sentinel], timeout=0.5):
            pass
        try:
            ok, value = receive.recv()
        except EOFError:
            child.join()
            killed = " (killed: most likely out of memory)" if child.exitcode == -signal.SIGKILL else ""
            raise TrainingProcessDied(f"the training process ended without a result, exit code "
                                      f"{child.exitcode}{killed}") from None
        child.join()
    finally:
        receive.close()
        if child.is_alive():  # Ctrl-C or any error here: the child must not train on alone
            child.terminate()
            child.join()
    if ok:
        return value
    exc, child_traceback = value
    exc.add_note(f"(raised in the training process)\n{child_traceback}")
    raise exc


def _settings() -> dict:
    """What a spawned child does not inherit but the parent's CLI has set."""
    torch = sys.modules.get("torch")
    root = logging.getLogger()
    fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None), None)
    return {"threads": torch.get_num_threads() if torch is not None else None, "log_level": root.level,
            "log_format": fmt}


def _child_main(send, settings: dict, fn, args, kwargs) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops this process
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    if settings["threads"]:
        import torch

        torch.set_num_threads(settings["threads"])
    if settings["log_format"] is not None:
        logging.basicConfig(level=settings["log_level"], stream=sys.stderr, format=settings["log_format"])
        if settings["log_level"] <= logging.INFO:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity(settings["log_level"])
    try:
        result = (True, fn(*args, **kwargs))
    except Exception as exc:
        result = (False, (_picklable(exc), traceback.format_exc()))
    try:
        send.send(result)
    except BrokenPipeError:  # the parent stopped waiting (Ctrl-C): nobody to tell
        pass


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()  # returns once the parent is gone (killed without a chance to stop this process)
        os._exit(1)


def _picklable(exc: Exception) -> Exception:
    """``exc`` when it survives pickling, else the nearest base class that does, with the same message."""
    for cls in type(exc).__mro__:
        try:
            candidate = exc if cls is type(exc) else cls(str(exc))
            pickle.loads(pickle.dumps(candidate))
            return candidate
        except Exception:
            continue
    return RuntimeError(str(exc))
