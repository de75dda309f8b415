"""The DP noise must be unpredictable to everyone but the server: otherwise anyone subtracts it again.

Everything a round's noise could be derived from in public (the base checkpoint, the submissions) is the
same for two servers below; only their keys differ. Their published weights must differ, while a redo on
one server (tests/e2e/test_crash_recovery.py) still publishes the same checkpoint.
"""

from __future__ import annotations

import time

import torch
from safetensors.torch import load_file

from zoo_gym import codec

DP = dict(aggregator="mean", min_contributors=2, dp_noise_multiplier=1.0, dp_clip=0.05, dp_target_epsilon=1000.0,
          dp_expected_contributors=2)


def _published_weights(fed) -> dict[str, torch.Tensor]:
    for seed in range(2):
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=seed), codec="fp16"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and fed.round().round_id == 1:
        time.sleep(0.2)
    info = fed.round()
    assert info.round_id == 2, info.message
    return load_file(str(fed.state.checkpoint_dir(info.base_sha256) / "model.safetensors"))


def test_two_servers_with_the_same_public_inputs_draw_different_noise(federation_with):
    a, b = federation_with(**DP), federation_with(**DP)
    assert a.round().base_sha256 == b.round().base_sha256  # the same genesis: the same public seed material
    wa, wb = _published_weights(a), _published_weights(b)
    changed = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert changed  # the noise is keyed by the server's secret, not by the public base sha256 alone
