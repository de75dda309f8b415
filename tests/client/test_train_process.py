"""gym-client join trains in a child process: the process that uploads and waits never holds the model
(issue 13 item 7: a client waiting for the publish kept 0.68 GB of a 0.6B model's training), and the child's
errors, output and Ctrl-C behave as if it were the same process."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
import torch

from zoo_gym import gym_train
from zoo_gym.client.train_process import TrainingProcessDied, run_in_child


def _data(path, n=16):
    path.write_text("".join(json.dumps({"instruction": f"Repeat {i}", "output": str(i)}) + "\n" for i in range(n)))
    return path


def test_join_trains_in_a_child_and_never_loads_the_model_itself(tmp_path, monkeypatch):
    from zoo_gym.client.join import JoinOptions, join
    from zoo_gym.server.config import build_config
    from zoo_gym.server.transport.servicer import build_server
    from zoo_gym.server.genesis import init_state

    state = init_state(tmp_path / "state", base_model="tiny")
    # two contributors close the round: it stays open, so this process (the test's server) loads no model either
    config = build_config({}, port=0, insecure=True, min_contributors=2, aggregator="mean", round_timeout=600)
    server, port, rounds = build_server(state, config)

    def train_here(*_a, **_k):
        raise AssertionError("the joining process trained (and loaded the model) itself")

    monkeypatch.setattr(gym_train, "train", train_here)  # the spawned child imports the real one
    server.start()
    rounds.start()
    try:
        opts = JoinOptions(server=f"127.0.0.1:{port}", workdir=tmp_path / "home", key_path=tmp_path / "k.pem",
                           data=str(_data(tmp_path / "mine.jsonl")), max_steps=2, insecure=True,
                           train_overrides={"warmup_steps": 0}, wait_for_publish=False, progress=False, max_wait=60)
        summaries = join(opts, say=lambda _m: None)
    finally:
        server.stop(grace=None)
        rounds.stop()
    assert len(summaries) == 1 and summaries[0]["submissions_in_round"] == 1
    assert summaries[0]["loss_after"] < summaries[0]["loss_before"]
    assert summaries[0]["steps"] == 2 and summaries[0]["train_seconds"] > 0  # what the child's training reported
    assert not list(opts.workdir.glob("payload-*"))  # the payload's hand-over file is gone


def test_the_childs_error_reaches_the_caller_with_its_type_and_message():
    with pytest.raises(gym_train.TrainConfigError) as err:
        run_in_child(gym_train.TrainConfig, method="lora", learning_rate=-1.0)
    with pytest.raises(gym_train.TrainConfigError) as here:
        gym_train.TrainConfig(method="lora", learning_rate=-1.0)
    assert str(err.value) == str(here.value)
    assert "training process" in "".join(err.value.__notes__)  # the child's traceback, for a bug report


def test_an_error_that_does_not_pickle_arrives_as_its_base_class_with_the_same_message(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x"}\n')
    with pytest.raises(gym_train.DataError) as here:
        gym_train.load_examples(bad)
    with pytest.raises(ValueError) as err:  # DataError's constructor takes 4 fields: it does not unpickle
        run_in_child(gym_train.load_examples, bad)
    assert str(err.value) == str(here.value)


def test_the_childs_output_and_settings_reach_the_terminal(capfd):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_in_child(torch.get_num_threads) == 1  # gym-client join --threads 1 holds in the child
    finally:
        torch.set_num_threads(before)
    run_in_child(print, "progress line from the child")
    assert "progress line from the child" in capfd.readouterr().out


def test_a_child_that_dies_is_reported_in_one_line():
    with pytest.raises(TrainingProcessDied) as err:
        run_in_child(os.abort)
    assert "exit code -6" in str(err.value) and "\n" not in str(err.value)


def test_ctrl_c_stops_the_child():
    # Python's own Ctrl-C handler, whatever this process inherited (a job started with `&` from a
    # non-interactive shell ignores SIGINT, and Python then leaves it ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_stops_the_child()
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_stops_the_child():
    me = psutil.Process()
    stopped = []

    def ctrl_c_once_the_child_runs():
        for _ in range(3000):  # up to 300 s: a spawned child can take long to appear on a loaded machine
            kids = [p for p in me.children() if "spawn_main" in " ".join(_cmdline(p))]  # not the resource tracker
            if kids:
                # SIGINT lands on this thread, as Ctrl-C often lands on one of gRPC's: the waiting main thread
                # must still see it
                signal.pthread_kill(threading.get_ident(), signal.SIGINT)
                gone, _alive = psutil.wait_procs(kids, timeout=60)  # a bound far above the 0.5 s poll
                stopped.append(bool(gone))
                return
            time.sleep(0.1)

    helper = threading.Thread(target=ctrl_c_once_the_child_runs, daemon=True)
    helper.start()
    with pytest.raises(KeyboardInterrupt):
        run_in_child(time.sleep, 900)  # far beyond the helper's bound: only Ctrl-C ends it early
    helper.join()
    assert stopped == [True]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):  # it ended while we looked
        return []
