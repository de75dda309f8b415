"""StoredDeltas over blob paths (issue 51): the same rows, factors, bits and norms as over the payloads' bytes,
one shared layout per way of encoding (not a parsed manifest per contributor), and no file left open."""

from __future__ import annotations

import os

import pytest

import torch

from zoo_gym import codec
from zoo_gym.codec import LoraFactors
from zoo_gym.server.rounds.stored_deltas import StoredDeltas

SHAPES = {"a.weight": (48, 32), "b.weight": (32, 64), "norm.weight": (32,)}


def _payload(i: int, kind: str) -> bytes:
    g = torch.Generator().manual_seed(i)
    meta = {"who": "x" * (i * 7)}  # headers of different lengths: the layout is relative to the body
    if kind == "lora":
        return codec.encode({k: LoraFactors(A=torch.randn(4, s[1], generator=g), B=torch.randn(s[0], 4, generator=g))
                             for k, s in SHAPES.items() if len(s) == 2}, codec="lora", metadata=meta)
    return codec.encode({k: torch.randn(s, generator=g) for k, s in SHAPES.items()}, codec=kind, metadata=meta)


def test_paths_read_the_same_numbers_as_the_bytes_and_share_layouts(tmp_path):
    payloads = [_payload(i, kind) for i, kind in enumerate(["lora", "bitdelta", "lora", "bitdelta", "int8"] * 4)]
    paths = []
    for i, p in enumerate(payloads):
        paths.append(tmp_path / f"{i}.zgd")
        paths[-1].write_bytes(p)
    ids = [str(i) for i in range(len(payloads))]
    fds = len(os.listdir("/proc/self/fd"))
    files, held = StoredDeltas(paths, ids, SHAPES, cache_bytes=0), StoredDeltas(payloads, ids, SHAPES, cache_bytes=0)
    assert len(files._layouts.layouts) == 3  # 20 payloads, three ways of encoding them
    for name in files.names():
        whole = torch.stack([codec.decode(p)[name].reshape(-1).float() if name in codec.read_manifest(p).names
                             else torch.zeros(files.stacked(name).shape[1]) for p in payloads])
        assert torch.equal(files.stacked(name), whole) and torch.equal(held.stacked(name), whole)
        assert torch.equal(files.stacked_block(name, 3, 17), whole[:, 3:17])
        assert all(torch.equal(files.stacked_one(i, name).reshape(-1), whole[i]) for i in range(len(ids)))
    bits = StoredDeltas([paths[1], paths[3]], ["x", "y"], SHAPES, cache_bytes=0).packed("a.weight")
    assert [b.signs.shape for b in bits] == [torch.Size([48, 4])] * 2
    lora = StoredDeltas([paths[0], paths[2]], ["x", "y"], SHAPES, cache_bytes=0)
    norms, numel = lora.sq_norms("a.weight")
    assert numel == 48 * 32 and torch.allclose(norms, lora.stacked("a.weight").double().square().sum(1), rtol=1e-5)
    assert [f.B.shape for f in lora.factors("a.weight")] == [torch.Size([48, 4])] * 2
    assert len(os.listdir("/proc/self/fd")) == fds  # nothing held open between reads


def test_the_scoring_tap_keeps_only_rows_the_source_cached(tmp_path):
    """SlopeTap's references for the exact checks cost nothing: rows decoded for one pass (past the source's
    cache budget) are not held for the round (they were, up to 512 MB more, at a few hundred contributors)."""
    from zoo_gym.rewards import SlopeTap

    payloads = [_payload(i, "bitdelta") for i in range(4)]
    one = 4 * 48 * 32 * 4  # bytes of a.weight's (4, 1536) rows: the cache holds that tensor and no other
    stored = StoredDeltas(payloads, ["w", "x", "y", "z"], SHAPES, cache_bytes=one)
    tap = SlopeTap(stored, {k: torch.ones(s) for k, s in SHAPES.items()}, keep_bytes=1 << 30)
    for name in stored.names():
        tap.stacked(name)
    assert set(tap._kept) == set(stored._cache) == {"a.weight"}
    assert torch.equal(tap.delta_of(2)["b.weight"], stored.stacked("b.weight")[2].reshape(32, 64))


@pytest.mark.parametrize("refused", [False, True])
def test_rows_read_in_blocks_give_the_same_aggregate(tmp_path, monkeypatch, refused):
    """A tensor whose n rows pass ROW_BLOCK_BYTES is validated, tapped for slopes, sketched and aggregated a block
    of its rows at a time, each decoded from those rows only (issue 51: 10,000 rows of a 128 x 384 tensor are
    1.97 GB whole), into buffers lent from block to block (with a refused row, its accepted rows copied into a
    second): the published aggregate is the same bits, the norms, shares and slopes the same up to float64
    rounding of sums taken in another order."""
    import importlib

    from zoo_gym.aggregation import DeltaSoup, SoupConfig
    from zoo_gym.rewards import SlopeTap

    streaming = importlib.import_module("zoo_gym.aggregation.streaming")
    n = 24
    payloads = [_payload(i, ["lora", "bitdelta", "int8"][i % 3]) for i in range(n)]
    if refused:  # a norm outlier, refused by max_norm_ratio
        payloads[4] = codec.encode({k: 1e4 * torch.randn(s) for k, s in SHAPES.items()}, codec="fp32")
    paths = []
    for i, p in enumerate(payloads):
        paths.append(tmp_path / f"{i}.zgd")
        paths[-1].write_bytes(p)
    grad = {k: torch.randn(s, generator=torch.Generator().manual_seed(5)) for k, s in SHAPES.items()}

    def run(budget: int):
        monkeypatch.setattr(streaming, "ROW_BLOCK_BYTES", budget)
        stored = StoredDeltas(paths, [str(i) for i in range(n)], SHAPES, cache_bytes=0)
        tap, got = SlopeTap(stored, grad), {}
        report = DeltaSoup(SoupConfig(aggregator="trimmed-mean")).run(
            tap, lambda name, agg: got.__setitem__(name, agg.clone()), lend_aggregates=True)
        return got, report, tap.result(scales=[1.0] * n)

    (whole, rep_w, slopes_w), (blocks, rep_b, slopes_b) = run(64 << 20), run(n * 32 * 4 * 5)  # 5 rows a block
    assert all(torch.equal(whole[k], blocks[k]) for k in SHAPES)
    assert [c.accepted for c in rep_b.contributors].count(False) == int(refused)
    for w, b in zip(rep_w.contributors, rep_b.contributors):
        assert w.accepted == b.accepted and w.norm == pytest.approx(b.norm, rel=1e-12)
        assert w.trimmed_share == pytest.approx(b.trimmed_share, rel=1e-12)
    assert slopes_w[0] == pytest.approx(slopes_b[0], rel=1e-12) and slopes_w[1] == pytest.approx(slopes_b[1], rel=1e-12)


def test_whole_row_blocks_of_dense_codecs_decode_those_rows_alone(tmp_path, monkeypatch):
    """A row block of an fp16, int8 or int4 upload is decoded from its rows' bytes (codec.decode_rows), never the
    whole tensor per block (issue 50: a Ray task held one decoded tensor besides its block and decoded it again for
    every block); the same numbers as the whole decode."""
    payloads = [_payload(i, kind) for i, kind in enumerate(["fp16", "int8", "int4", "bf16", "bitdelta", "lora"])]
    paths = []
    for i, p in enumerate(payloads):
        paths.append(tmp_path / f"{i}.zgd")
        paths[-1].write_bytes(p)
    stored = StoredDeltas(paths, [str(i) for i in range(len(paths))], SHAPES, cache_bytes=0)
    whole = {name: stored.stacked(name).clone() for name in ("a.weight", "b.weight")}

    def whole_decode(*_args, **_kw):
        raise AssertionError("a whole tensor was decoded for a row block")

    monkeypatch.setattr(StoredDeltas, "_decode_row", whole_decode)
    for name, cols in (("a.weight", 32), ("b.weight", 64)):
        for r0, r1 in ((0, 3), (5, 6), (7, 32)):
            assert torch.equal(stored.stacked_block(name, r0 * cols, r1 * cols), whole[name][:, r0 * cols:r1 * cols])


def test_bitdelta_rows_unpacked_on_several_cores_are_the_whole_decodes(monkeypatch):
    """Enough BitDelta rows in a block are unpacked in chunks on every core, each contributor's straight into its
    row of the block, beside LoRA and int8 rows: the whole decode's numbers (issue 51)."""
    from zoo_gym.aggregation import packed_kernels

    shapes = {"w": (512, 256)}
    g = torch.Generator().manual_seed(0)

    def make(kind: str) -> bytes:
        if kind == "lora":
            factors = LoraFactors(A=torch.randn(4, 256, generator=g), B=torch.randn(512, 4, generator=g))
            return codec.encode({"w": factors}, codec="lora")
        return codec.encode({"w": torch.randn(512, 256, generator=g)}, codec=kind,
                            **({"group_size": 64} if kind == "bitdelta" else {}))

    payloads = [make(kind) for kind in ["bitdelta", "bitdelta", "lora", "int8"] * 10]
    stored = StoredDeltas(payloads, [str(i) for i in range(len(payloads))], shapes, cache_bytes=0)
    whole = stored.stacked("w").clone()
    from zoo_gym.server.rounds import stored_deltas

    monkeypatch.setattr(packed_kernels.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(stored_deltas, "_MIN_UNPACK_PER_CHUNK", 1)  # 8 chunks of the 20 BitDelta contributors
    assert torch.equal(stored.stacked_block("w", 0, 512 * 256), whole)
    assert torch.equal(stored.stacked_block("w", 100 * 256, 101 * 256), whole[:, 100 * 256:101 * 256])
