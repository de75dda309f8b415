"""`--keep-checkpoints N` (issue 29 item 3): the state directory keeps the genesis and the N newest published
checkpoints; older ones are swept at publish with the uploads made on them, while their rows, the lineage and
the ledger stay; a pull of a swept checkpoint is answered NOT_FOUND with what to do instead."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from sqlmodel import select
from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.proto import gym_pb2
from zoo_gym.server.cli import app
from zoo_gym.server.config import ConfigError, build_config
from zoo_gym.server.store.checkpoint_writer import master_sha256
from zoo_gym.server.store.models import Checkpoint, Submission


def _publish(fed, round_id: int) -> str:
    for seed in range(2):  # min_contributors = 2
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=10 * round_id + seed), codec="bitdelta"))
    return fed.wait_published(round_id).published_sha256


def _stored(fed) -> set[str]:
    return {p.name for p in (fed.state.blobs.root / "sha256").rglob("*") if p.is_file()}


def _stored_once_swept(fed, expected: set[str], timeout: float = 120.0) -> set[str]:
    """The blob names once they equal `expected` (the sweep runs just after the publish's commit, which is what
    marks the round published), or as they are when `timeout` passes."""
    deadline = time.monotonic() + timeout
    while _stored(fed) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return _stored(fed)


def _download(fed, sha: str) -> bytes:
    return b"".join(c.data for c in fed.stub.DownloadCheckpoint(gym_pb2.DownloadRequest(checkpoint_sha256=sha)))


def test_keep_one_sweeps_older_checkpoints_and_their_uploads_but_keeps_rows_lineage_and_ledger(federation_with):
    fed = federation_with(keep_checkpoints=1)
    genesis = fed.round().base_sha256
    published = [_publish(fed, r) for r in (1, 2, 3)]
    with fed.state.session() as s:
        rows = {c.round_id: c for c in s.exec(select(Checkpoint))}
        subs = s.exec(select(Submission)).all()
    assert sorted(rows) == [0, 1, 2, 3]  # every checkpoint keeps its row
    assert [rows[r].sha256 for r in (1, 2, 3)] == published
    assert rows[3].parent_sha256 == published[1] and rows[1].parent_sha256 == genesis  # lineage intact
    assert len(subs) == 6  # every submission keeps its row

    # Prepare the expected directory: the genesis, the newest checkpoint and its master, nothing else
    # (round 4 is open and empty; rounds 1-3 are published on swept bases or on the genesis).
    expected = {genesis, published[2]} | ({master_sha256(rows[3].manifest_json)} - {None})
    assert _stored_once_swept(fed, expected) == expected
    assert not (fed.state.work_dir / "checkpoints" / published[0]).exists()

    # Execute: pull each checkpoint. Assert: the kept ones download whole, a swept one is NOT_FOUND.
    assert len(_download(fed, published[2])) == rows[3].size
    assert len(_download(fed, genesis)) == rows[0].size
    with pytest.raises(grpc.RpcError) as err:
        _download(fed, published[0])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "--keep-checkpoints" in err.value.details() and "GetRound" in err.value.details()

    # The next round still trains on the kept base and publishes; the ledger still verifies.
    assert fed.round().base_sha256 == published[2]
    _publish(fed, 4)
    res = CliRunner().invoke(app, ["ledger", "verify", "--state-dir", str(fed.state.root), "--json"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["export", "--state-dir", str(fed.state.root), "--round", "1",
                                   str(fed.state.root.parent / "exported")])
    assert res.exit_code == 2 and "no longer stored" in res.output, res.output


def test_unset_keeps_every_checkpoint(federation):
    genesis = federation.round().base_sha256
    sha = _publish(federation, 1)
    assert {genesis, sha} <= _stored(federation)
    assert len(_download(federation, genesis)) > 0


def test_the_setting_is_checked_where_it_is_given(tmp_path):
    assert build_config({"keep-checkpoints": 2}).keep_checkpoints == 2  # the config-file key
    with pytest.raises(ConfigError, match="keep_checkpoints"):
        build_config({}, keep_checkpoints=0)
    with pytest.raises(ConfigError, match=r"max_staleness \+ 1 \(5\)"):
        build_config({}, mode="async", max_staleness=4, keep_checkpoints=3)
    res = CliRunner().invoke(app, ["serve", "--state-dir", str(tmp_path / "s"), "--insecure",
                                   "--keep-checkpoints", "0"])
    assert res.exit_code == 2, res.output
    assert [ln for ln in res.output.splitlines() if ln.strip()] == [
        next(ln for ln in res.output.splitlines() if "keep_checkpoints" in ln)], res.output
    assert json.loads(build_config({}).to_json())["keep_checkpoints"] is None
