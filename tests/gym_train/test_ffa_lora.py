"""FFA-LoRA (`lora_freeze_a`): every contributor's A factors are the same fixed init, only B trains, so the
deltas of a round lie in one subspace and their mean is (mean of the B's) x A; the run still learns."""

import pytest
import torch

from zoo_gym.gym_train import (TrainConfig, TrainConfigError, builtin_examples, default_validation_examples,
                               tiny_model_dir, train)

pytestmark = pytest.mark.slow
BASE = tiny_model_dir()


def _run(seed: int, shard: int, freeze: bool):
    cfg = TrainConfig(method="lora", max_steps=12, batch_size=8, learning_rate=1e-2, seed=seed, lora_freeze_a=freeze)
    ex = builtin_examples("default", shard=shard, n_shards=2, n=96, seed=shard)
    return train(BASE, ex, cfg, base_sha256="ab" * 32, eval_examples=default_validation_examples(32))


@pytest.fixture(scope="module")
def runs():
    return [_run(seed=s, shard=s - 1, freeze=True) for s in (1, 2)] + [_run(seed=3, shard=0, freeze=False)]


def test_contributors_share_one_frozen_a_and_their_mean_is_the_mean_of_b(runs):
    a, b, plain = (r.delta for r in runs)
    assert a.keys() == b.keys() and len(a) == 28
    for name in a:
        assert torch.equal(a[name].A, b[name].A)  # two seeds, two shards: one A
        assert not torch.equal(a[name].B, b[name].B)  # B is what each learned
        mean = (a[name].merged() + b[name].merged()) / 2
        shared = ((a[name].B.float() + b[name].B.float()) / 2) @ a[name].A.float()  # the scale is in B
        assert torch.allclose(mean, shared, atol=1e-6), name
        assert not torch.equal(plain[name].A, a[name].A)  # without it, A trains (and starts from the seed's)


def test_ffa_lora_lowers_the_heldout_loss(runs):
    for r in runs[:2]:
        assert r.metadata["loss_after"] < 0.9 * r.metadata["loss_before"]


def test_ffa_lora_is_refused_with_inits_it_cannot_share():
    with pytest.raises(TrainConfigError, match="lora_freeze_a"):
        TrainConfig(method="lora", lora_freeze_a=True, init_lora_weights="pissa")
    with pytest.raises(TrainConfigError, match="lora_freeze_a"):
        TrainConfig(finetuning_type="full", lora_freeze_a=True)
