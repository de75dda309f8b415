"""The server's evaluator reads each checkpoint's weights in place from its archive blob (issue 29): a round
with evaluation and scoring on leaves no model-sized copy under work/, and measures exactly what an unpacked
copy of the same checkpoint gives."""

from __future__ import annotations

import tarfile

import pytest

from zoo_gym import codec
from zoo_gym.gym_train import default_validation_examples
from zoo_gym.proto import archive
from zoo_gym.evaluation.streamed_model import compute_dtype, load_streamed
from zoo_gym.io.safetensors_reader import SafetensorsReader, WeightsFile
from zoo_gym.evaluation.server_evaluator import ServerEvaluator
from zoo_gym.server.store.models import Checkpoint


def _small_delta(fed, sha: str, seed: int) -> dict:
    import torch

    with SafetensorsReader.in_archive(fed.state.blobs.path(sha)) as r:  # not fed.small_delta: it unpacks
        shapes = r.shapes()
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * 1e-3 for k, s in list(shapes.items()) if len(s) == 2}


def test_a_round_evaluates_in_place_no_unpacked_weights_and_the_loss_a_copy_gives(federation_with):
    fed = federation_with(validation_examples=16)
    genesis = fed.round().base_sha256
    for seed in range(2):  # min_contributors = 2
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(_small_delta(fed, genesis, seed), codec="bitdelta"))
    published = fed.wait_published(1).published_sha256
    with fed.state.session() as s:
        measured = s.get(Checkpoint, published).heldout_loss

    # Assert: both evaluated checkpoints (the genesis scored, the new one measured) have a directory of
    # small files and no weights; all of work/ is far below one checkpoint.
    dirs = {p.name: p for p in (fed.state.work_dir / "checkpoints").iterdir() if p.is_dir()}
    assert {genesis, published} <= set(dirs)
    assert all((d / "config.json").is_file() and not (d / archive.WEIGHTS).exists() for d in dirs.values())
    work_bytes = sum(f.stat().st_size for f in fed.state.work_dir.rglob("*") if f.is_file())
    assert work_bytes < 0.2 * fed.state.blobs.size(published)

    # Assert: the held-out loss from the full unpack (checkpoint_dir, weights included) is the same number.
    assert measured is not None
    copy = ServerEvaluator(fed.state.checkpoint_dir(published), list(default_validation_examples(n=16)),
                           dtype=compute_dtype(fed.config.evaluation_dtype))  # in the server's dtype
    assert (dirs[published] / archive.WEIGHTS).is_file()  # the unpack replaced the small directory
    assert copy.heldout_loss() == pytest.approx(measured, rel=1e-6)


def test_a_streamed_model_reads_the_same_weights_from_the_archive_as_from_the_file(tmp_path):
    import torch

    from zoo_gym.gym_train import tiny_model_dir

    blob = tmp_path / "ckpt.tar"
    with open(blob, "wb") as f:
        archive.pack(tiny_model_dir(), f)
    small = archive.unpack(blob, tmp_path / "small", skip=frozenset({archive.WEIGHTS}))
    assert not (small / archive.WEIGHTS).exists()
    ids = torch.arange(1, 17).reshape(2, 8)
    in_place = load_streamed(small, WeightsFile.in_archive(blob))(input_ids=ids).logits
    from_file = load_streamed(tiny_model_dir())(input_ids=ids).logits
    assert torch.equal(in_place, from_file)


def test_an_archive_without_weights_is_refused_even_when_they_would_be_skipped(tmp_path):
    from zoo_gym.gym_train import tiny_model_dir

    blob = tmp_path / "no-weights.tar"
    with tarfile.open(blob, "w") as tar:
        tar.add(tiny_model_dir() / "config.json", arcname="config.json")
    with pytest.raises(archive.CheckpointError, match="no model.safetensors"):
        archive.unpack(blob, tmp_path / "out", skip=frozenset({archive.WEIGHTS}))
    assert not (tmp_path / "out").exists()
