"""ZOO_GYM_HEARTBEAT_SECONDS=0 (what gym-client webui sets): one `training: step i/N, loss X` line per logged loss,
no thread, and the closing `, done` line; the console draws its loss curve from these lines."""

from types import SimpleNamespace

from zoo_gym.gym_train.heartbeat import Heartbeat


def test_zero_seconds_says_a_line_per_logged_loss(monkeypatch):
    monkeypatch.setenv("ZOO_GYM_HEARTBEAT_SECONDS", "0")
    said: list[str] = []
    beat = Heartbeat(say=said.append)
    state = SimpleNamespace(max_steps=4, global_step=0)
    beat.on_train_begin(None, state, None)
    assert beat._thread is None
    for step, loss in ((1, 2.5), (2, 2.0), (3, 1.5)):
        state.global_step = step
        beat.on_step_end(None, state, None)
        beat.on_log(None, state, None, logs={"loss": loss, "learning_rate": 1e-3})
        beat.on_log(None, state, None, logs={"train_runtime": 1.0})  # no loss: no line
    state.global_step = 4
    beat.on_train_end(None, state, None)
    assert [line.split(", ")[:2] for line in said] == [["training: step 1/4", "loss 2.5000"],
                                                        ["training: step 2/4", "loss 2.0000"],
                                                        ["training: step 3/4", "loss 1.5000"],
                                                        ["training: step 4/4", "loss 1.5000"]]
    assert said[-1].endswith(", done")


def test_the_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("ZOO_GYM_HEARTBEAT_SECONDS", "2.5")
    assert Heartbeat().interval == 2.5
    monkeypatch.delenv("ZOO_GYM_HEARTBEAT_SECONDS")
    assert Heartbeat().interval == 10.0 and Heartbeat(interval=1).interval == 1
