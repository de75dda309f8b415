"""The streamed checkpoint: the archive's bytes equal `archive.pack`'s, the hand-written safetensors load
with the library, and publishing into a bf16 base keeps what rounding drops in a float32 master, stored as
the low halves the published bf16 weights lack."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sqlmodel import select

from zoo_gym import codec
from zoo_gym.proto import archive
from zoo_gym.io.safetensors_reader import SafetensorsReader, tensor_bytes
from zoo_gym.server.store.checkpoint_writer import CheckpointWriter, SafetensorsLayout, master_path
from zoo_gym.server.store.master_weights import join_low16, master_of, needs_master, split_low16
from zoo_gym.server.config import build_config
from zoo_gym.server.store.models import Checkpoint, Round, Submission
from zoo_gym.server.rounds.publish import publish_round
from zoo_gym.server.genesis import init_state

from stored_rounds import store_submissions, tiny_bf16


def test_tar_stream_equals_pack(tmp_path):
    # Prepare: a directory of a few files, one of them streamed in pieces
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.json").write_text("{}\n")
    (d / archive.WEIGHTS).write_bytes(bytes(range(256)) * 41)
    (d / "z.txt").write_text("x" * 513)
    want = io.BytesIO()
    archive.pack(d, want)
    # Execute
    got = io.BytesIO()
    t = archive.TarStream(got)
    t.add_bytes("a.json", (d / "a.json").read_bytes())
    data = (d / archive.WEIGHTS).read_bytes()
    t.begin(archive.WEIGHTS, len(data))
    t.write(data[:1000])
    t.write(memoryview(data)[1000:])
    t.end()
    t.add_bytes("z.txt", (d / "z.txt").read_bytes())
    t.close()
    # Assert
    assert got.getvalue() == want.getvalue()
    with pytest.raises(archive.CheckpointError):
        archive.TarStream(io.BytesIO()).begin("../x", 1)


def test_streamed_safetensors_load_with_the_library(tmp_path):
    tensors = {"b": torch.randn(3, 5).to(torch.bfloat16), "a": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(2, 2)}
    layout = SafetensorsLayout([(k, {torch.bfloat16: "BF16", torch.int64: "I64", torch.float32: "F32"}[v.dtype],
                                 tuple(v.shape)) for k, v in tensors.items()], metadata={"format": "pt"})
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        f.write(layout.header)
        for v in tensors.values():
            f.write(tensor_bytes(v))
    assert path.stat().st_size == layout.total
    back = load_file(str(path))
    for k, v in tensors.items():
        assert torch.equal(back[k], v)
    with SafetensorsReader(path) as r:
        assert all(torch.equal(r.read(k), v) for k, v in tensors.items())


def _write_round(base_tar: Path, master: Path | None, agg: dict[str, torch.Tensor], out_tar: Path,
                 master_out: Path) -> int:
    """Publish `agg` onto `base_tar` (and its `master`); returns the tensors whose inputs were read ahead."""
    with open(out_tar, "wb") as ck, open(master_out, "wb") as mb:
        reader = SafetensorsReader(master) if master is not None else None
        w = CheckpointWriter(base_tar, master=reader, changed=list(agg), ckpt_blob=ck, master_blob=mb)
        for name, a in agg.items():
            w.sink(name, a.reshape(-1))
        w.finish_weights()
        w.finish({"round": 1})
        w.close()
        if reader is not None:
            reader.close()
    return w.reads_ahead


def _pack(model_dir: Path, out: Path) -> Path:
    with open(out, "wb") as f:
        archive.pack(model_dir, f)
    return out


def _masters(published: Path, master: Path) -> dict[str, torch.Tensor]:
    """Every tensor's float32 master, as the next publish reads it."""
    with SafetensorsReader.in_archive(published) as pub, SafetensorsReader(master) as m:
        return {k: master_of(pub.read(k), m, k) for k in pub.names()}


def test_low_half_and_bf16_are_the_float32_master():
    # Prepare: float32 values, with exact bf16 ties both ways, signed zeros, subnormals, both signs
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(1 << 16, generator=gen) * 0.02
    bits = torch.tensor([1.0, 1.0, -1.0, -1.0]).view(torch.int32) + torch.tensor(
        [0x8000, 0x18000, 0x8000, 0x18000], dtype=torch.int32)  # ties: rounded down, up, down, up
    m = torch.cat([m, bits.view(torch.float32), torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.0e38])])
    # Execute
    published, low = split_low16(m)
    back = join_low16(published, low)
    # Assert: published is plain round-to-nearest; the master comes back bit for bit except at a tie that
    # rounded down, which comes back one float32 unit below (rounding to the same bf16)
    assert torch.equal(published, m.to(torch.bfloat16)) and low.dtype == torch.int16
    off = m.view(torch.int32) - back.view(torch.int32)
    ties_down = torch.zeros_like(off, dtype=torch.bool)
    ties_down[(1 << 16) + 0], ties_down[(1 << 16) + 2] = True, True
    assert torch.equal(off[ties_down], torch.ones(2, dtype=torch.int32))
    random_ties = (m.view(torch.int32) & 0x1FFFF) == 0x8000  # in the random part: ties that round down too
    assert bool((off[~ties_down & ~random_ties] == 0).all())
    assert torch.equal(back.to(torch.bfloat16), published)


def test_bf16_publish_keeps_the_aggregate_in_the_master(tmp_path):
    # Prepare: a bf16 model and three rounds of aggregates far below bf16's resolution
    base_dir = tiny_bf16(tmp_path / "base")
    base = load_file(str(base_dir / archive.WEIGHTS))
    with SafetensorsReader(base_dir / archive.WEIGHTS) as r:
        assert needs_master(r.infos)
    names = [k for k, v in base.items() if v.dim() == 2 and "proj" in k]
    gen = torch.Generator().manual_seed(0)
    aggs = [{k: torch.randn(base[k].shape, generator=gen) * 2e-5 for k in names} for _ in range(3)]
    # Execute: publish round after round, each from the previous master
    parent, master = _pack(base_dir, tmp_path / "base.tar"), None
    for r, agg in enumerate(aggs):
        out, mfile = tmp_path / f"r{r}.tar", tmp_path / f"m{r}.safetensors"
        # every changed tensor's base and low half were read ahead of its sink (checkpoint_writer._inputs)
        assert _write_round(parent, master, agg, out, mfile) == len(names)
        parent, master = out, mfile
    # Assert: the published weights are bf16 of the master, and published + carried = sum of aggregates
    # (bit for bit below, so the reads ahead are the same bytes as reads on demand)
    last = archive.unpack(parent, tmp_path / "last")
    published, kept = load_file(str(last / archive.WEIGHTS)), _masters(parent, master)
    assert all(published[k].dtype == torch.bfloat16 for k in names)
    total = {k: sum(a[k].double() for a in aggs) for k in names}
    norm = sum(float((t ** 2).sum()) for t in total.values()) ** 0.5
    err_master = sum(float(((kept[k].double() - base[k].double()) - total[k]).pow(2).sum()) for k in names) ** 0.5
    err_bf16 = sum(float(((published[k].double() - base[k].double()) - total[k]).pow(2).sum())
                   for k in names) ** 0.5
    assert err_bf16 > 0.1 * norm  # the test can fail: bf16 alone loses much of these aggregates
    assert err_master <= 1e-3 * norm  # >= 99.9% kept (published + carried)
    for k in names:
        assert torch.equal(published[k], kept[k].to(torch.bfloat16))
    untouched = [k for k in base if k not in names]
    assert untouched and all(torch.equal(published[k], base[k]) for k in untouched)
    assert all(torch.equal(kept[k], base[k].float()) for k in untouched)
    # the master file holds only the low halves of the changed tensors: half a float32 copy of them
    stored = load_file(str(master))
    assert sorted(stored) == sorted(names) and all(v.dtype == torch.int16 for v in stored.values())
    # and the archive holds exactly the directory's bytes
    want = io.BytesIO()
    archive.pack(last, want)
    assert parent.read_bytes() == want.getvalue()


def test_a_float32_master_written_before_the_low_half_format_is_read_and_carried(tmp_path):
    # Prepare: a bf16 base and a master file in the old format (float32 everywhere), not the base widened
    base_dir = tiny_bf16(tmp_path / "base")
    base = load_file(str(base_dir / archive.WEIGHTS))
    gen = torch.Generator().manual_seed(1)
    old = {k: v.float() + torch.randn(v.shape, generator=gen) * 1e-4 for k, v in base.items()}
    save_file(old, str(tmp_path / "old.safetensors"))
    published = {k: v.to(torch.bfloat16) for k, v in old.items()}
    save_file(published, str(base_dir / archive.WEIGHTS), metadata={"format": "pt"})
    names = [k for k, v in base.items() if v.dim() == 2 and "proj" in k]
    agg = {k: torch.randn(base[k].shape, generator=gen) * 2e-5 for k in names}
    # Execute
    _write_round(_pack(base_dir, tmp_path / "base.tar"), tmp_path / "old.safetensors", agg, tmp_path / "r.tar",
                 tmp_path / "m.safetensors")
    # Assert: changed tensors continue from the old master; untouched ones keep it as stored
    kept = _masters(tmp_path / "r.tar", tmp_path / "m.safetensors")
    for k in names:
        assert torch.allclose(kept[k].double(), old[k].double() + agg[k].double(), rtol=0, atol=1e-7)
    assert all(torch.equal(kept[k], old[k]) for k in base if k not in names)


def _submit_lora(state, round_id: int, base_sha: str, seed: int, n: int = 3) -> list[Submission]:
    with SafetensorsReader.in_archive(state.blobs.path(base_sha)) as r:
        shapes = r.shapes()
    names = [k for k, s in shapes.items() if len(s) == 2 and "proj" in k]
    gen = torch.Generator().manual_seed(seed)
    subs = []
    for i in range(n):
        delta = {k: codec.LoraFactors(A=torch.randn(4, shapes[k][1], generator=gen) * 0.5,
                                      B=torch.randn(shapes[k][0], 4, generator=gen) * 1e-5) for k in names}
        subs.append((f"{seed:016x}{i:016x}", codec.encode(delta, codec="lora", lora_codec="fp32"), "lora"))
    return store_submissions(state, round_id, subs)


def test_publish_round_into_a_bf16_base_keeps_a_master(tmp_path):
    # Prepare: a federation on a bf16 model, no evaluation (validation_examples = 0)
    state = init_state(tmp_path / "state", base_model=str(tiny_bf16(tmp_path / "base")))
    cfg = build_config({}, aggregator="mean", validation_examples=0)
    for r in (1, 2):
        with state.session() as s:
            rnd = s.get(Round, r)
        subs = _submit_lora(state, r, rnd.base_sha256, seed=r)
        # Execute
        outcome = publish_round(state, cfg, rnd, subs)
        assert outcome.startswith("published"), outcome
    # Assert: each checkpoint names a stored master; the published weights round it
    with state.session() as s:
        rows = {c.round_id: c for c in s.exec(select(Checkpoint))}
    # publishing read each base in place and wrote no unpacked copy (the archive and the master only)
    assert not any((state.work_dir / "checkpoints" / rows[r].sha256).exists() for r in (1, 2))
    genesis = load_file(str(state.checkpoint_dir(rows[0].sha256) / archive.WEIGHTS))
    for r in (1, 2):
        lineage = json.loads(rows[r].manifest_json)
        mp = master_path(state, rows[r].sha256)
        assert mp is not None and lineage["master_sha256"] == mp.name
        master = _masters(state.blobs.path(rows[r].sha256), mp)
        pub = load_file(str(state.checkpoint_dir(rows[r].sha256) / archive.WEIGHTS))
        assert all(torch.equal(pub[k], master[k].to(pub[k].dtype)) for k in pub)
        # the blob is the pack of its unpacked directory (content address unchanged by streaming)
        want = io.BytesIO()
        archive.pack(state.checkpoint_dir(rows[r].sha256), want)
        assert state.blobs.path(rows[r].sha256).read_bytes() == want.getvalue()
    assert any(not torch.equal(master[k], genesis[k].float()) for k in master)
