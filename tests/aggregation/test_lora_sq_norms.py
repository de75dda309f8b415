"""Pass 1 from LoRA factors: `LoraFactors.merged_sq_norm`, `StoredDeltas.sq_norms` and DeltaSoup's use of
them must give the decoded rows' norms and leave the aggregate bit for bit unchanged."""

import math

import pytest
import torch

from zoo_gym import codec
from zoo_gym.aggregation import DeltaSoup, SoupConfig
from zoo_gym.codec.lora import LoraFactors
from zoo_gym.server.publish import StoredDeltas

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
        assert torch.equal(got_fast[k], got_slow[k])
    for a, b in zip(rep_fast.contributors, rep_slow.contributors):
        assert a.accepted and b.accepted and a.weight == b.weight
        assert math.isclose(a.norm, b.norm, rel_tol=1e-6)


def test_soup_under_dp_decodes_for_the_norms():
    fast = StoredDeltas(_payloads(), ["x", "y"], SHAPES)
    fast.sq_norms = lambda name: pytest.fail("sq_norms must not be used under DP")
    cfg = SoupConfig.from_mapping({"aggregator": "mean", "dp_clip": 1.0, "dp_noise_multiplier": 1.0})
    DeltaSoup(cfg).run(fast, lambda k, v: None, generator=torch.Generator().manual_seed(0))
