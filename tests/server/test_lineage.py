"""Every published checkpoint carries its lineage: base model, times, each submission's method, the
held-out loss, and the rounds before it (so a pulled checkpoint's model card shows the whole chain)."""

from __future__ import annotations

import json
import time

from zoo_gym import codec
from zoo_gym.proto import archive
from zoo_gym.proto.model_card import write_model_card_from_dir
from zoo_gym.server.store.models import Checkpoint


def _round(fed, round_id: int, methods: list[str]) -> None:
    for seed, method in enumerate(methods):
        key, cid = fed.register()
        info = fed.round()
        from zoo_gym.client.upload import build_header, request_stream

        payload = codec.encode(fed.small_delta(seed=10 * round_id + seed), codec="fp16")
        header = build_header(key=key, contributor_id=cid, round_id=info.round_id, base_sha256=info.base_sha256,
                              payload=payload, metadata={"method": method})
        fed.stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 16))
    deadline = time.monotonic() + 120
    while fed.round().round_id == round_id:
        assert time.monotonic() < deadline, f"round {round_id} was not published"
        time.sleep(0.2)


def test_two_rounds_of_lineage_reach_the_archive_and_the_card(federation, tmp_path):
    _round(federation, 1, ["lora", "sft"])
    _round(federation, 2, ["grpo", "lora"])
    sha = federation.round().base_sha256
    with federation.state.session() as s:
        row = s.get(Checkpoint, sha)
    manifest = json.loads(row.manifest_json)
    assert manifest["base_model"] == "tiny" and manifest["round"] == 2
    assert manifest["opened_at"] < manifest["closed_at"]  # in the row; the archive holds no times
    assert sorted(x["method"] for x in manifest["submissions"]) == ["grpo", "lora"]
    assert manifest["heldout_loss"] == row.heldout_loss is not None
    model_dir = archive.unpack(federation.state.blobs.path(sha), tmp_path / "ckpt")
    inside = json.loads((model_dir / archive.LINEAGE).read_text())
    assert [h["round"] for h in inside["history"]] == [0, 1]  # genesis, then round 1
    assert all(h["heldout_loss"] is not None for h in inside["history"])
    card = write_model_card_from_dir(model_dir, sha256=sha).read_text()
    assert "grpo" in card and "sft" in card  # methods of both rounds
    assert "opened_at" not in inside and all("opened_at" not in h for h in inside["history"])
