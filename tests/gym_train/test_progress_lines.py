"""What a contributor sees while training with output not a terminal: a step/loss/ETA line at least every
interval from a real tiny training run (the interval shortened from 10 s so the test stays short), and no raw
log dicts, no FutureWarning and no "share your model on huggingface.co" line."""

from __future__ import annotations

import contextlib
import io
import re
import warnings

from zoo_gym.gym_train import TrainConfig, builtin_examples, tiny_model_dir, train
from zoo_gym.gym_train import heartbeat


def test_heartbeat_lines_without_a_terminal(monkeypatch):
    monkeypatch.setattr(heartbeat, "HEARTBEAT_SECONDS", 0.01)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        train(tiny_model_dir(), builtin_examples()[:64], TrainConfig(method="lora", max_steps=30, batch_size=4,
                                                                     warmup_steps=0, seed=0),
              base_sha256="0" * 64, progress=False)
    lines = [line for line in err.getvalue().splitlines() if line.startswith("training: ")]
    beats = [line for line in lines if re.fullmatch(r"training: step \d+/30, loss \S+, \d+ s elapsed, ETA .+", line)]
    assert len(beats) >= 2, err.getvalue()[-2000:]
    assert any(re.search(r"loss \d+\.\d{4}, .*ETA \d+ s$", line) for line in beats)
    assert re.fullmatch(r"training: step 30/30, loss \d+\.\d{4}, \d+ s elapsed, done", lines[-1])
    printed = out.getvalue() + err.getvalue()
    assert "{'loss'" not in printed and "share your model" not in printed
    assert not [x for x in w if issubclass(x.category, FutureWarning)], [str(x.message) for x in w]
