"""`benchmarks/async.py` on a setting small enough to check by hand: 4 contributors with compute
times 1, 1, 2.5 and 7, no jitter, no dropout, buffers of K = 2, real LoRA training on the tiny model.

The async clock, worked out by hand (A, B, C, D = contributors 0..3, all start on version 0; at
equal times the lower id goes first, and a submitter fetches the newest version right after it):
  t=1    A submits (base 0) and restarts on version 0; B submits (base 0) -> version 1, B on v1
  t=2    A submits (base 0, staleness 1), restarts on v1; B (base 1, s 0) -> version 2, B on v2
  t=2.5  C submits (base 0): staleness 2          -> accepted if max_staleness >= 2, else refused
  t=3    A submits (base 1, staleness 1)          -> with C: version 3 = v2 + lr x mean(w(2) dC, w(1) dA)
The sync round lasts 7 (D): A and B wait 6 each, C 4.5, D 0 -> 16.5 of 28 contributor-time units.
"""

from __future__ import annotations

import pytest
import torch

from benchmark_loader import load_benchmark

bench = load_benchmark("async.py", "async_bench")
# same_base="retrain": the clocks above, where a contributor starts again on the version it just trained on
TINY = dict(n=4, f=0, speeds=(1.0, 1.0, 2.5, 7.0), jitter=0.0, dropout=0.0, rounds=1, buffer_size=2,
            max_versions=3, staleness_exponent=0.5, steps=1, warmup_steps=0, batch_size=4, validation_examples=8,
            rules=("mean",), attacks=("none",), same_base="retrain")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    cfg = bench.BenchConfig(**TINY, max_staleness=2, server_lr=0.5)
    cache_dir = tmp_path_factory.mktemp("async-cache")
    threads = torch.get_num_threads()
    try:
        doc, trajs = bench.run(cfg, workers=1, cache_dir=cache_dir, log=lambda *a, **k: None)
    finally:
        torch.set_num_threads(threads)
    return cfg, cache_dir, doc, {t.name: t for t in trajs}


@pytest.mark.slow
def test_a_stale_delta_is_weighted_by_its_staleness_and_the_server_lr(tiny_run) -> None:
    cfg, cache_dir, doc, trajs = tiny_run
    t = trajs["async/mean/none"]
    last = t.schedule.publishes[2]
    # Prepare: the third publish merges C's delta trained on version 0 with A's on version 1
    assert [(s.contributor, s.base, s.staleness) for s in last.submissions] == [(2, 0, 2), (0, 1, 1)]
    assert t.times == [0.0, 1.0, 2.0, 3.0]
    w_c, w_a = 3 ** -0.5, 2 ** -0.5
    assert doc["runs"]["async/mean/none"]["staleness_weights"] == [[1.0, 1.0], [round(w_a, 4), 1.0],
                                                                  [round(w_c, 4), round(w_a, 4)]]
    # Execute: what the published version moved by, against the cached real deltas
    cache = bench.DeltaCache(cache_dir, cfg, {}, workers=1)
    d_c, d_a = cache.load(t.shas[0], 2), cache.load(t.shas[1], 0)
    assert any(bool((d_c[k] != d_a[k]).any()) for k in d_c)  # the weighting is observable
    # Assert: v3 - v2 = server_lr x the staleness-weighted average of dC and dA (the mean of the weighted rows
    # x K / sum of the weights, the server's step_scale), tensor by tensor
    for k in d_c:
        moved = t.versions[3][k] - t.versions[2][k]
        expected = 0.5 * (w_c * d_c[k] + w_a * d_a[k]) / (w_c + w_a)
        torch.testing.assert_close(moved, expected, rtol=1e-4, atol=1e-6)
    assert t.losses[-1] < t.losses[0]  # real training: the held-out loss went down


@pytest.mark.slow
def test_waste_counts_sync_waiting_and_nothing_when_async_refuses_nothing(tiny_run) -> None:
    _, _, doc, _ = tiny_run
    assert doc["runs"]["sync/mean/none"]["wasted_compute_share"] == round(16.5 / 28, 4)
    assert doc["runs"]["async/mean/none"]["wasted_compute_share"] == 0.0
    assert doc["runs"]["async/mean/none"]["refused_stale"] == 0
    # async reached sync's one-round loss: its time share is async's time over sync's 7
    share = doc["runs"]["async/mean/none"]["time_share_of_sync"]
    assert share is None or share in (round(1 / 7, 4), round(2 / 7, 4), round(3 / 7, 4))


def test_a_delta_older_than_max_staleness_is_refused_and_its_compute_wasted() -> None:
    cfg = bench.BenchConfig(**TINY, max_staleness=1)
    sched = bench.async_schedule(cfg, bench.base_times(cfg), until=100.0)
    merged = [(s.contributor, s.base) for p in sched.publishes for s in p.submissions]
    assert (2, 0) not in merged  # C's staleness-2 delta never reaches a buffer
    assert sched.refused == 1
    # A and B ran 3 units each into publishes; C's 2.5 were refused; D is still running
    assert sched.compute_used == pytest.approx(6.0)
    assert sched.compute_wasted == pytest.approx(2.5)
    assert sched.waste_share == pytest.approx(2.5 / 8.5)


def test_a_second_delta_waits_for_the_flush_and_its_wait_is_wasted() -> None:
    # A (t=1) finishes twice before B (t=3) fills the first buffer of K=2: its second delta waits
    # from t=2 to t=3, goes into the next buffer with staleness 1, and A restarts only then
    cfg = bench.BenchConfig(**{**TINY, "speeds": (1.0, 3.0, 3.5, 10.0), "max_versions": 2},
                            max_staleness=4)
    sched = bench.async_schedule(cfg, bench.base_times(cfg), until=100.0)
    assert [[(s.contributor, s.base, s.staleness) for s in p.submissions] for p in sched.publishes] == \
        [[(0, 0, 0), (1, 0, 0)], [(0, 0, 1), (2, 0, 1)]]
    assert [p.time for p in sched.publishes] == [3.0, 3.5]
    assert sched.waiting == pytest.approx(1.0)
    # merged compute: A 1 + 1, B 3, C 3.5; wasted: A's 1 idle
    assert sched.waste_share == pytest.approx(1.0 / 9.5)


def test_same_base_wait_never_trains_twice_on_one_version_and_counts_the_idle_time() -> None:
    # as `gym-client join` does: A (t=1) has trained on version 0 and idles until B (t=3) makes version 1,
    # so its next delta is trained on version 1 (no second copy of its version-0 delta in the next buffer)
    cfg = bench.BenchConfig(**{**TINY, "speeds": (1.0, 3.0, 3.5, 10.0), "max_versions": 2, "same_base": "wait"},
                            max_staleness=4)
    sched = bench.async_schedule(cfg, bench.base_times(cfg), until=100.0)
    assert [[(s.contributor, s.base, s.staleness) for s in p.submissions] for p in sched.publishes] == \
        [[(0, 0, 0), (1, 0, 0)], [(2, 0, 1), (0, 1, 0)]]
    assert [p.time for p in sched.publishes] == [3.0, 4.0]
    assert sched.waiting == pytest.approx(2.0)  # A idle from t=1 to t=3
    assert sched.waste_share == pytest.approx(2.0 / (8.5 + 2.0))  # merged: A 1 + 1, B 3, C 3.5


def test_same_base_fresh_trains_a_new_draw_of_the_shard() -> None:
    cfg = bench.BenchConfig(**{**TINY, "speeds": (1.0, 3.0, 3.5, 10.0), "max_versions": 2, "same_base": "fresh"},
                            max_staleness=4)
    sched = bench.async_schedule(cfg, bench.base_times(cfg), until=100.0)
    assert [(s.contributor, s.base, s.draw) for s in sched.publishes[1].submissions] == [(0, 0, 1), (2, 0, 0)]


def test_a_buffer_the_rule_refused_stays_open_for_one_more_delta() -> None:
    cfg = bench.BenchConfig(**TINY, max_staleness=4)
    clock = bench.AsyncClock(cfg, bench.base_times(cfg), until=100.0)
    first = clock.next_buffer()
    assert [s.contributor for s in first.submissions] == [0, 1]
    clock.flushed(False)  # e.g. validation refused rows and Krum's n >= 2f + 3 failed
    again = clock.next_buffer()
    # A's and B's second deltas (t=2) wait: the buffer holds theirs; C's (t=2.5) joins
    assert [s.contributor for s in again.submissions] == [0, 1, 2]
    assert again.version == 1 and again.time == 2.5 and clock.reopened == 1
    clock.flushed(True)
    assert clock.version == 1 and [p.time for p in clock.publishes] == [2.5]
    # the held pair submit at the flush, one version stale, and fill the next buffer at once
    nxt = clock.next_buffer()
    assert [(s.contributor, s.base, s.staleness, s.end) for s in nxt.submissions] == \
        [(0, 0, 1, 2.5), (1, 0, 1, 2.5)]
    assert clock.idle == pytest.approx(1.0)


def test_liars_claim_the_newest_base_and_are_never_refused() -> None:
    cfg = bench.BenchConfig(**TINY, max_staleness=1)
    sched = bench.async_schedule(cfg, bench.base_times(cfg), until=100.0, liars=frozenset({2}))
    assert (2, 0, 0) in [(s.contributor, s.base, s.staleness) for p in sched.publishes
                         for s in p.submissions]
    assert sched.refused == 0


def test_staleness_weight_is_polynomial() -> None:
    assert bench.staleness_weight(0, exponent=0.5) == 1.0
    assert bench.staleness_weight(3, exponent=0.5) == pytest.approx(0.5)
    assert bench.staleness_weight(3, exponent=0.0) == 1.0


def test_bench_config_names_the_field() -> None:
    with pytest.raises(bench.BenchConfigError, match="`rules`"):
        bench.BenchConfig(rules=("krum",))
    with pytest.raises(bench.BenchConfigError, match="`warmup_steps`"):
        bench.BenchConfig(steps=2, warmup_steps=2)
    with pytest.raises(bench.BenchConfigError, match="`speeds`"):
        bench.BenchConfig(n=3, f=1, speeds=(1.0, 2.0))
