"""The attack suite on REAL deltas: one federated round of `benchmarks/robustness.py` on the tiny
model (n=5 contributors, f=1 Byzantine, LoRA trained by gym_train), checked against what the
attacks' definitions imply exactly; and the label flip's derangement property.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmark_loader import load_benchmark

bench = load_benchmark("robustness.py", "robustness_bench")


@settings(max_examples=50, deadline=None)
@given(n=st.integers(min_value=2, max_value=40), seed=st.integers(min_value=0, max_value=2**31))
def test_label_flip_gives_every_example_another_examples_output(n: int, seed: int) -> None:
    # Prepare: distinct outputs so "another example's output" is observable
    examples = [{"instruction": "Reverse the digits.", "input": str(i), "output": f"o{i}"}
                for i in range(n)]
    before = [dict(ex) for ex in examples]
    # Execute
    flipped = bench.label_flip(examples, generator=torch.Generator().manual_seed(seed))
    again = bench.label_flip(examples, generator=torch.Generator().manual_seed(seed))
    # Assert: a permutation of the outputs with no fixed point, prompts kept, input untouched
    assert examples == before
    assert flipped == again
    assert sorted(ex["output"] for ex in flipped) == sorted(ex["output"] for ex in examples)
    assert all(f["output"] != e["output"] for f, e in zip(flipped, examples))
    assert [(f["instruction"], f["input"]) for f in flipped] == \
        [(e["instruction"], e["input"]) for e in examples]


def test_bench_config_names_the_field() -> None:
    with pytest.raises(bench.BenchConfigError, match="`f`"):
        bench.BenchConfig(n=4, f=2)
    with pytest.raises(bench.BenchConfigError, match="`attacks`"):
        bench.BenchConfig(attacks=("sign_flip",))


@pytest.fixture(scope="module")
def one_round() -> dict:
    """One real round: 4 honest LoRA deltas + 1 label-flipped one (+ the clean 5th), every attack."""
    threads = torch.get_num_threads()
    cfg = bench.BenchConfig(n=5, f=1, rounds=1, steps=3, batch_size=8, trim_beta=0.2,
                            validation_examples=16, aggregators=("mean", "multi-krum", "trimmed-mean"))
    try:
        doc = bench.run(cfg, log=lambda *a, **k: None)
    finally:
        torch.set_num_threads(threads)
    return doc


def test_round_one_shares_the_training_work(one_round: dict) -> None:
    # all trajectories start from the same base: 5 honest + 1 label-flipped training, no more
    assert one_round["distinct_bases_per_round"] == [1]
    assert one_round["trainings"] == 6


def test_clean_fedavg_learns(one_round: dict) -> None:
    assert one_round["no_attack_fedavg_loss"] < one_round["base_loss"] - 0.05


def test_fedavg_under_sign_flip_at_scale_4_publishes_nothing(one_round: dict) -> None:
    # mean of 4 honest h_i and one -4 * mean(h): (4 h - 4 h) / 5 = 0, so the base is unchanged
    cell = one_round["results"]["mean"]["sign_flip"]
    assert cell["final_loss"] == pytest.approx(one_round["base_loss"], abs=1e-4)
    assert cell["byzantine_weight_per_round"] == [pytest.approx(0.2)]
    assert cell["ratio_same_aggregator"] > 1.0


def test_multi_krum_drops_far_attackers_and_the_result_is_the_honest_mean(one_round: dict) -> None:
    # n=5, f=1: Multi-Krum averages m = 4; far attackers leave exactly the 4 honest deltas, which is
    # what FedAvg publishes when the zero free rider is refused (validation) and leaves 4 honest
    res = one_round["results"]
    honest_mean = res["mean"]["free_rider_zero"]
    assert res["mean"]["free_rider_zero"]["byzantine_f_used"] == [1]
    assert res["multi-krum"]["free_rider_zero"]["byzantine_f_used"] == [0]
    for attack in ("sign_flip", "scaling", "gaussian", "free_rider_zero"):
        cell = res["multi-krum"][attack]
        assert cell["byzantine_weight_per_round"] == [0.0], attack
        # the same four honest deltas, averaged with coefficients that may differ in the last bit
        assert cell["final_loss"] == pytest.approx(honest_mean["final_loss"], rel=1e-6), attack
        clean = res["multi-krum"]["none"]["final_loss"]
        assert cell["within_tolerance"] is (cell["final_loss"] <= 1.05 * clean)


def test_ratios_are_against_the_right_runs(one_round: dict) -> None:
    res = one_round["results"]
    fedavg = one_round["no_attack_fedavg_loss"]
    for agg, row in res.items():
        clean = row["none"]["final_loss"]
        assert row["none"]["ratio_same_aggregator"] == 1.0
        for attack, cell in row.items():
            assert cell["ratio_same_aggregator"] == pytest.approx(cell["final_loss"] / clean, abs=1e-4)
            assert cell["ratio_fedavg_clean"] == pytest.approx(cell["final_loss"] / fedavg, abs=1e-4)
    assert set(one_round["targets"]["robust_within_tolerance"]) == {"multi-krum", "trimmed-mean"}
    for attack, verdict in one_round["targets"]["fedavg_broken"].items():
        assert verdict["broken"] is (res["mean"][attack]["ratio_same_aggregator"] >= 1.25)


def test_bulyan_is_reported_impossible_at_n10_f3() -> None:
    doc = bench.report(bench.BenchConfig(aggregators=("mean",), attacks=("none",)), [],
                       base_loss=1.0, trainings=0, distinct=[], train_seconds=0.0, seconds=0.0)
    assert "n >= 4f + 3 = 15" in doc["not_run"]["bulyan"]
