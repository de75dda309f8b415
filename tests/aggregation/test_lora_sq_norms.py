"""LoRA factors used as they are: `LoraFactors.merged_sq_norm`, `StoredDeltas.sq_norms` and DeltaSoup's use of
them must give the decoded rows' norms and leave the aggregate bit for bit unchanged; the plain mean is
one matmul of the concatenated factors (`StoredDeltas.factors`), equal to the mean of the decoded rows up
to float32 rounding, with no row decoded."""

import math

import pytest
import torch

from zoo_gym import codec
from zoo_gym.aggregation import DeltaSoup, SoupConfig
from zoo_gym.codec.lora import LoraFactors
from zoo_gym.server.rounds.publish import StoredDeltas

SHAPES = {"a.weight": (48, 32), "b.weight": (32, 64), "norm.weight": (32,)}


def _factors(out: int, inp: int, seed: int, r: int = 4) -> LoraFactors:
    g = torch.Generator().manual_seed(seed)
    return LoraFactors(A=torch.randn(r, inp, generator=g), B=torch.randn(out, r, generator=g) * 1e-3)


def _payloads(*, drop_b_for_second: bool = False) -> list[bytes]:
    out = []
    for i in range(2):
        d = {k: _factors(*s, seed=10 * i + j) for j, (k, s) in enumerate(SHAPES.items()) if len(s) == 2}
        if drop_b_for_second and i == 1:
            del d["b.weight"]
        out.append(codec.encode(d, codec="lora"))
    return out


def test_merged_sq_norm_is_the_decoded_norm():
    f = _factors(48, 32, seed=1)
    exact = float(torch.linalg.vector_norm(f.merged().double()) ** 2)
    assert f.merged_sq_norm() == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("case", ["cancel", "overflow", "nan"])
def test_merged_sq_norm_refuses_what_it_cannot_vouch_for(case):
    a = torch.arange(16.0).reshape(1, 16) - 8  # integers: every product below is exact
    if case == "cancel":  # B @ A == 0 exactly from large factors: the Gram sum would be rounding noise
        f = LoraFactors(A=torch.cat([a, a]) * 1e3, B=torch.cat([torch.ones(8, 1), -torch.ones(8, 1)], 1) * 1e3)
        assert float(f.merged().abs().max()) == 0.0
    elif case == "overflow":  # finite factors whose float32 product is not
        f = LoraFactors(A=torch.full((2, 4), 1e20), B=torch.full((3, 2), 1e20))
        assert not bool(torch.isfinite(f.merged()).all())
    else:
        f = LoraFactors(A=torch.full((2, 4), float("nan")), B=torch.ones(3, 2))
    assert f.merged_sq_norm() is None


def test_zero_factor_is_a_zero_norm():
    assert LoraFactors(A=torch.zeros(2, 4), B=torch.ones(3, 2)).merged_sq_norm() == 0.0


def test_stored_deltas_sq_norms_match_stacked_rows():
    stored = StoredDeltas(_payloads(drop_b_for_second=True), ["x", "y"], SHAPES)
    for name in ("a.weight", "b.weight"):
        sq, numel = stored.sq_norms(name)
        rows = StoredDeltas(_payloads(drop_b_for_second=True), ["x", "y"], SHAPES).stacked(name)
        assert numel == rows.shape[1]
        ref = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64) ** 2
        assert torch.allclose(sq, ref, rtol=1e-6, atol=0.0)
    assert stored.sq_norms("b.weight")[0][1] == 0.0  # the second contributor did not send it


def test_stored_deltas_sq_norms_none_for_other_codecs():
    payloads = [codec.encode({"a.weight": torch.randn(48, 32)}, codec="int8") for _ in range(2)]
    assert StoredDeltas(payloads, ["x", "y"], {"a.weight": (48, 32)}).sq_norms("a.weight") is None


class _NoFastPath:
    """The same source without `sq_norms`: pass 1 decodes."""

    def __init__(self, inner):
        self.contributors = inner.contributors
        self._inner = inner

    def names(self):
        return self._inner.names()

    def stacked(self, name):
        return self._inner.stacked(name)

    def packed(self, name):
        return None


@pytest.mark.parametrize("config", [{"aggregator": "mean"}, {"aggregator": "trimmed-mean", "trim_beta": 0.0},
                                    {"aggregator": "mean", "max_delta_norm": 1e9}])
def test_soup_with_fast_path_publishes_the_same_bytes(config):
    payloads = _payloads(drop_b_for_second=True)

    def run(source):
        got = {}
        rep = DeltaSoup(SoupConfig.from_mapping(config)).run(source, lambda k, v: got.__setitem__(k, v.clone()))
        return got, rep

    calls = []
    fast = StoredDeltas(payloads, ["x", "y"], SHAPES, cache_bytes=0)
    orig = fast.sq_norms
    fast.sq_norms = lambda name: calls.append(name) or orig(name)
    got_fast, rep_fast = run(fast)
    got_slow, rep_slow = run(_NoFastPath(StoredDeltas(payloads, ["x", "y"], SHAPES, cache_bytes=0)))
    assert calls == ["a.weight", "b.weight"]  # the fast path did run
    assert any(float(v.abs().max()) > 0 for v in got_fast.values())  # the delta changes the output
    assert list(got_fast) == list(got_slow)
    for k in got_fast:
        if config["aggregator"] == "mean":  # from the factors directly: float32 rounding apart
            scale = float(got_slow[k].abs().max())
            assert torch.allclose(got_fast[k], got_slow[k], rtol=1e-5, atol=1e-6 * scale)
        else:
            assert torch.equal(got_fast[k], got_slow[k])
    for a, b in zip(rep_fast.contributors, rep_slow.contributors):
        assert a.accepted and b.accepted and a.weight == b.weight
        assert math.isclose(a.norm, b.norm, rel_tol=1e-6)


def test_soup_under_dp_decodes_for_the_norms():
    fast = StoredDeltas(_payloads(), ["x", "y"], SHAPES)
    fast.sq_norms = lambda name: pytest.fail("sq_norms must not be used under DP")
    cfg = SoupConfig.from_mapping({"aggregator": "mean", "dp_clip": 1.0, "dp_noise_multiplier": 1.0,
                                   "dp_expected_contributors": 3})
    DeltaSoup(cfg).run(fast, lambda k, v: None, generator=torch.Generator().manual_seed(0))


def test_mean_from_factors_decodes_no_row_and_is_the_mean():
    # Prepare: two contributors' LoRA payloads (the second leaves b.weight alone), unequal weights
    payloads = _payloads(drop_b_for_second=True)
    stored = StoredDeltas(payloads, ["x", "y"], SHAPES, cache_bytes=0)
    stored.stacked = lambda name: pytest.fail(f"row of {name} decoded: the mean should use the factors")
    got = {}
    # Execute
    DeltaSoup(SoupConfig.from_mapping({"aggregator": "mean"})).run(
        stored, lambda k, v: got.__setitem__(k, v.clone()), weights=torch.tensor([3.0, 1.0]))
    # Assert: the weighted mean of the merged products, in float64, to float32 rounding
    factors = [codec.decode_factors(p, k) for p in payloads for k in ("a.weight",)]
    want_a = (3 * factors[0].merged().double() + factors[1].merged().double()) / 4
    assert torch.allclose(got["a.weight"].double(), want_a.reshape(-1), rtol=1e-5, atol=1e-7 * float(want_a.abs().max()))
    want_b = 3 * codec.decode_factors(payloads[0], "b.weight").merged().double() / 4  # the second sent no b
    assert torch.allclose(got["b.weight"].double(), want_b.reshape(-1), rtol=1e-5, atol=1e-7 * float(want_b.abs().max()))


@pytest.mark.parametrize("spilled", [False, True])
def test_first_order_slopes_of_a_factored_mean_equal_the_rows_slopes(monkeypatch, tmp_path, spilled):
    """From the factors, a block of the gradient's rows at a time (64 bytes: several blocks per tensor), the
    slopes equal the decoded rows'; spilled (bfloat16, read ahead), they equal the rounded gradient's."""
    from zoo_gym.rewards import first_order
    from zoo_gym.rewards.first_order import SlopeTap, streamed_slopes
    from zoo_gym.evaluation.spill import SpilledTensors

    calls = []
    gram = LoraFactors.merged_sq_norm
    monkeypatch.setattr(LoraFactors, "merged_sq_norm", lambda self: calls.append(1) or gram(self))
    monkeypatch.setattr(first_order, "_BLOCK_BYTES", 64)

    payloads = _payloads()
    grad = {k: torch.randn(s, generator=torch.Generator().manual_seed(7)) for k, s in SHAPES.items()}
    given = grad
    if spilled:
        given = SpilledTensors(tmp_path)
        for k, v in grad.items():
            given.put(k, v)
            given.alias(k, k, v.shape, v.dtype)
        grad = {k: v.to(torch.bfloat16).float() for k, v in grad.items()}  # what the tap reads
    inner = StoredDeltas(payloads, ["x", "y"], SHAPES)
    inner.stacked = lambda name: pytest.fail(f"row of {name} decoded: slopes should come from the factors")
    tap = SlopeTap(inner, given)
    DeltaSoup(SoupConfig.from_mapping({"aggregator": "mean"})).run(tap, lambda k, v: None)
    assert len(calls) == 4  # 2 contributors x 2 tensors: validation's norms serve the tap too
    slopes, norms = tap.result(scales=[1.0, 1.0])
    want, want_norms = streamed_slopes(grad, StoredDeltas(payloads, ["x", "y"], SHAPES), scales=[1.0, 1.0])
    gnorm = sum(float(v.double().pow(2).sum()) for v in grad.values()) ** 0.5
    for got, ref, norm in zip(slopes, want, want_norms):  # float32 products: within 1e-5 of |delta| |g|
        assert abs(got - ref) <= 1e-5 * norm * gnorm
    assert norms == pytest.approx(want_norms, rel=1e-6)


def test_lent_aggregates_are_the_same_bytes_in_one_buffer():
    # Prepare: the LoRA mean over two contributors, the larger tensor first
    shapes = {"big.weight": (64, 48), "small.weight": (32, 16)}
    payloads = [codec.encode({k: _factors(*s, seed=10 * i + j) for j, (k, s) in enumerate(shapes.items())},
                             codec="lora") for i in range(2)]

    def run(lend: bool) -> tuple[dict, set]:
        got, buffers = {}, set()

        def sink(k, v):
            got[k] = v.clone()  # a borrowing sink copies what it keeps
            buffers.add(v.untyped_storage().data_ptr())

        DeltaSoup(SoupConfig.from_mapping({"aggregator": "mean"})).run(
            StoredDeltas(payloads, ["x", "y"], shapes), sink, weights=torch.tensor([3.0, 1.0]), lend_aggregates=lend)
        return got, buffers

    # Execute
    fresh, fresh_buffers = run(False)
    lent, lent_buffers = run(True)
    # Assert: bit for bit what fresh tensors hold, both written into one buffer
    assert list(lent) == list(fresh) == list(shapes)
    assert all(torch.equal(lent[k], fresh[k]) and float(fresh[k].abs().max()) > 0 for k in fresh)
    assert len(lent_buffers) == 1 and len(fresh_buffers) == 2


def _mixed_payloads() -> list[bytes]:
    """Contributor 0 sends LoRA factors, 1 BitDelta of a dense delta (per-group scales), 2 BitDelta with one
    group per row (the issue-51 population's two kinds)."""
    lora = {k: _factors(*s, seed=j) for j, (k, s) in enumerate(SHAPES.items()) if len(s) == 2}
    g = torch.Generator().manual_seed(3)
    dense = {k: torch.randn(s, generator=g) * 1e-3 for k, s in SHAPES.items()}
    return [codec.encode(lora, codec="lora"), codec.encode(dense, codec="bitdelta", group_size=16),
            codec.encode(dense, codec="bitdelta")]


def test_bitdelta_norms_come_from_the_scales_and_match_the_decoded_rows():
    stored = StoredDeltas(_mixed_payloads(), ["x", "y", "z"], SHAPES, cache_bytes=0)
    decoded = StoredDeltas(_mixed_payloads(), ["x", "y", "z"], SHAPES, cache_bytes=0)
    for name in ("a.weight", "b.weight"):
        sq, numel = stored.sq_norms(name)
        rows = decoded.stacked(name)
        assert numel == rows.shape[1]
        ref = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64) ** 2
        assert float(sq[0]) == pytest.approx(float(ref[0]), rel=1e-6)  # LoRA: Gram matrices of float32 factors
        assert torch.allclose(sq[1:], ref[1:], rtol=1e-12, atol=0)  # BitDelta: the decoded numbers exactly
        assert stored.factors(name) is None  # not every row is LoRA: the plain mean decodes
    assert stored.sq_norms("norm.weight") is None  # BitDelta sends a 1-D tensor as fp16: its rows are decoded


def test_a_mixed_round_is_validated_without_decoding_a_row(monkeypatch):
    from zoo_gym.aggregation.validation import validate

    stored = StoredDeltas(_mixed_payloads(), ["x", "y", "z"], SHAPES, cache_bytes=0)
    decoded = []
    monkeypatch.setattr(StoredDeltas, "_decode_row", lambda self, i, name, row: decoded.append(name) or row.zero_())
    checked = validate(stored, stored.names(), 3, max_delta_norm=None, max_norm_ratio=None, private=False)
    assert set(decoded) == {"norm.weight"}  # only the 1-D tensor sent as fp16
    assert checked.reasons == [None, None, None] and bool((checked.norms > 0).all())
