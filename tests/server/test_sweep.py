"""The start-up sweep removes what a crash left behind and nothing that a row references."""

from __future__ import annotations

import os

from zoo_gym import codec
from zoo_gym.server.store.state import open_state
from zoo_gym.server.store.sweep import sweep_storage


def test_sweep_removes_unreferenced_blobs_and_scratch_but_keeps_every_referenced_blob(federation):
    key, cid = federation.register()
    accepted = federation.submit(key, cid, codec.encode(federation.small_delta(), codec="fp16")).payload_sha256
    state = federation.state
    base = federation.round().base_sha256
    state.checkpoint_dir(base)  # the unpacked base is a cache worth keeping
    # What a crash leaves: a checkpoint blob written before its publish committed, a refused payload's
    # blob, a half-written temporary file, a publish's scratch directory, an unpacked unknown checkpoint.
    orphans = []
    for content in (b"orphaned checkpoint", b"refused payload"):
        with state.blobs.writer() as w:
            w.write(content)
            orphans.append(w.commit())
    (state.blobs.tmp_dir / "blob-halfwritten").write_bytes(b"x" * 100)
    scratch = state.work_dir / "tmpcrash"
    (scratch / "ckpt").mkdir(parents=True)
    (scratch / "ckpt" / "model.safetensors").write_bytes(b"partial")
    (state.work_dir / "checkpoints" / ("ab" * 32)).mkdir(parents=True)

    # A float32 master kept beside a bf16 checkpoint is referenced by that checkpoint's manifest only.
    import json

    from zoo_gym.server.store.models import Checkpoint

    with state.blobs.writer() as w:
        w.write(b"float32 master")
        master = w.commit()
    with state.session() as s:
        row = s.get(Checkpoint, base)
        row.manifest_json = json.dumps({**json.loads(row.manifest_json), "master_sha256": master})
        s.add(row)
        s.commit()

    report = sweep_storage(open_state(state.root))

    assert report.blobs == 2 and report.blob_bytes == sum(len(c) for c in (b"orphaned checkpoint", b"refused payload"))
    assert report.scratch == 3
    assert not any(state.blobs.exists(sha) for sha in orphans)
    assert state.blobs.exists(accepted) and state.blobs.exists(base) and state.blobs.exists(master)
    assert os.listdir(state.blobs.tmp_dir) == [] and not scratch.exists()
    assert sorted(os.listdir(state.work_dir / "checkpoints")) == [base]
    assert sweep_storage(state).blobs == 0  # idempotent
