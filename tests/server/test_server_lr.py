"""A synchronous round's server learning rate (`--server-lr`): the published base is base + eta x the aggregate.

eta is recorded with the round when it closes (a redo publishes the same bytes whatever the flag says later),
signed into RoundInfo when it is not 1 (a man in the middle cannot change it), shown by `status`, and written
into the checkpoint's lineage. At eta = 1 RoundInfo's signed bytes are those of a server without the setting.
The contributors' learning-rate schedule (`--client-lr-decay`) is signed into each round's RoundInfo the same way.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from zoo_gym import codec
from zoo_gym.proto import gym_pb2
from zoo_gym.server.rounds.async_rounds import describe_mode, recorded_mode
from zoo_gym.server.store.models import Checkpoint, RoundInputs


def _weights(fed, sha: str) -> dict[str, torch.Tensor]:
    return load_file(str(fed.state.checkpoint_dir(sha) / "model.safetensors"))


def test_a_sync_round_publishes_base_plus_server_lr_times_the_mean(federation_with, sign):
    lr = 2.5
    fed = federation_with(validation_examples=0, server_lr=lr, reputation_weighting=False)
    info = fed.round()
    assert (info.mode, info.server_lr) == ("sync", lr)
    sign.verify(bytes(info.server_public_key), bytes(info.signature), sign.round_info_bytes(info))
    forged = gym_pb2.RoundInfo()
    forged.CopyFrom(info)
    forged.server_lr = 1.0  # hiding the extrapolation from the contributors: the signature no longer verifies
    with pytest.raises(sign.SignatureError):
        sign.verify(bytes(info.server_public_key), bytes(forged.signature), sign.round_info_bytes(forged))

    (ka, ca), (kb, cb) = fed.register(), fed.register()
    da, db = fed.small_delta(seed=1, scale=1e-2), fed.small_delta(seed=2, scale=1e-2)
    base = _weights(fed, info.base_sha256)
    fed.submit(ka, ca, codec.encode(da, codec="fp32"), round_id=1)
    fed.submit(kb, cb, codec.encode(db, codec="fp32"), round_id=1)
    new = _weights(fed, fed.wait_published(1).published_sha256)
    for name in da:
        mean = (da[name] + db[name]) / 2
        assert torch.allclose(new[name].float(), base[name].float() + lr * mean, atol=1e-6), name
        assert not torch.allclose(new[name].float(), base[name].float() + mean, atol=1e-6)  # eta mattered
    with fed.state.session() as s:
        assert s.get(RoundInputs, 1).server_lr == lr
        row = s.get(Checkpoint, fed.round().base_sha256)
        line = describe_mode(recorded_mode(s))
    assert json.loads(row.manifest_json).get("server_lr") == lr
    assert line.startswith(f"mode: sync, server lr {lr:g}"), line


def test_at_server_lr_1_round_info_signs_the_bytes_of_before(federation, sign):
    info = federation.round()
    assert info.server_lr == 0.0  # not set: nothing new on the wire
    bare = gym_pb2.RoundInfo()
    bare.CopyFrom(info)
    bare.ClearField("server_lr")
    assert sign.round_info_bytes(info) == sign.round_info_bytes(bare)
    assert b"server_lr" not in sign.round_info_bytes(info)
    assert info.client_lr_scale == 0.0 and b"client_lr_scale" not in sign.round_info_bytes(info)  # no schedule


def test_client_lr_decay_signs_each_rounds_scale_into_round_info(federation_with, sign):
    """--client-lr-decay d: round r's RoundInfo asks for lr x 1 / (1 + d (r - 1)), signed, so a man in the middle
    cannot make contributors train at another rate; round 1's factor is 1, the bytes of a server without it."""
    from zoo_gym.client.contribute import lr_scale_of

    fed = federation_with(validation_examples=0, client_lr_decay=1.0, reputation_weighting=False)
    first = fed.round()
    assert lr_scale_of(first) == 1.0 and b"client_lr_scale" not in sign.round_info_bytes(first)
    (ka, ca), (kb, cb) = fed.register(), fed.register()
    fed.submit(ka, ca, codec.encode(fed.small_delta(seed=1, scale=1e-2), codec="fp32"), round_id=1)
    fed.submit(kb, cb, codec.encode(fed.small_delta(seed=2, scale=1e-2), codec="fp32"), round_id=1)
    fed.wait_published(1)
    info = fed.round()
    assert info.round_id == 2 and info.client_lr_scale == 0.5 and lr_scale_of(info) == 0.5
    sign.verify(bytes(info.server_public_key), bytes(info.signature), sign.round_info_bytes(info))
    forged = gym_pb2.RoundInfo()
    forged.CopyFrom(info)
    forged.client_lr_scale = 4.0  # a man in the middle speeding every contributor up 8x: refused
    with pytest.raises(sign.SignatureError):
        sign.verify(bytes(info.server_public_key), bytes(forged.signature), sign.round_info_bytes(forged))
    assert lr_scale_of(gym_pb2.RoundInfo()) == 1.0  # a server from before the field: the contributor's own rate
