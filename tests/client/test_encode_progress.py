"""The encode phase has its own progress bar, and encoding through it gives the very same payload."""

import torch

from zoo_gym import codec
from zoo_gym.client.contribute import EncodeProgress


def test_encode_through_the_progress_bar_gives_the_same_payload_and_shows_an_encode_bar(capsys):
    g = torch.Generator().manual_seed(0)
    delta = {f"layer.{i}.weight": torch.randn(16, 64, generator=g) for i in range(5)}
    plain = codec.encode(delta, codec="bitdelta", group_size=64)
    shown = codec.encode(EncodeProgress(delta, progress=True), codec="bitdelta", group_size=64)
    assert shown == plain
    err = capsys.readouterr().err
    assert "encode:" in err and "/5 [" in err  # one bar over the 5 tensors


def test_no_bar_when_progress_is_off(capsys):
    delta = {"w": torch.ones(8, 8)}
    codec.encode(EncodeProgress(delta, progress=False), codec="fp16")
    assert "encode" not in capsys.readouterr().err
