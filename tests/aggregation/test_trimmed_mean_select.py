"""The trimmed mean selects each coordinate's kept values instead of sorting them (issue 51: the sort was most of a
1,000-contributor round). What it keeps is what a stable sort keeps, ties by row; the sums are exact here (values on
a grid), so the aggregate and every diagnostic must be the sort's very numbers; hostile columns included."""

import numpy as np
import pytest
import torch

from zoo_gym.aggregation import select_kernels
from zoo_gym.aggregation.errors import InvalidDeltaError
from zoo_gym.aggregation.trimmed_mean import trim_count, trimmed_mean


def by_sorting(x: torch.Tensor, beta: float, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(aggregate, values kept per row) from a stable sort of every column: the definition."""
    n, d = x.shape
    k = trim_count(n=n, beta=beta)
    values, rows = x.double().sort(dim=0, stable=True)
    values, rows = values[k:n - k], rows[k:n - k]
    kept = torch.bincount(rows.flatten(), minlength=n)
    if w is None:
        return (values.sum(0) / (n - 2 * k)).float(), kept
    kw = w.double()[rows]
    return ((kw * values).sum(0) / kw.sum(0)).float(), kept


def grid(n: int, d: int, seed: int, levels: int = 7) -> torch.Tensor:
    """Values on a coarse grid (many ties, float64 sums exact in any order)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-levels, levels + 1, (n, d), generator=g) * 0.125).float()


def hostile_columns(n: int) -> torch.Tensor:
    """Columns built against quickselect: sorted, reversed, all equal, organ pipe, two values, sawtooth."""
    up = torch.arange(n, dtype=torch.float32)
    signed_zeros = torch.where(up % 3 == 0, -0.0, 0.0)  # -0.0 and +0.0 are one value: ties go by row
    cols = [up, up.flip(0), torch.zeros(n), torch.minimum(up, up.flip(0)), (up % 2), up % 5,
            torch.cat([up[n // 2:], up[:n // 2]]), signed_zeros, sample_trap(n)]
    return torch.stack(cols, dim=1) * 0.5


def sample_trap(n: int) -> torch.Tensor:
    """A column whose values at the rows the selection samples are all lower than the rest, so that its
    brackets hold neither rank and it must select over the whole column."""
    col = torch.ones(n)
    s = max(64, int(n ** (2.0 / 3.0)))
    col[(torch.arange(s) * n) // s] = -1.0
    return col


@pytest.mark.parametrize("n", [3, 7, 50, 301, 2000])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("beta", [0.1, 0.4])
def test_keeps_what_a_stable_sort_keeps(n, weighted, beta):
    x = torch.cat([grid(n, 300, n), hostile_columns(n)], dim=1)
    w = (torch.rand(n, generator=torch.Generator().manual_seed(1)) * 4).round() / 4 + 0.25 if weighted else None
    got = trimmed_mean(x, beta=beta, weights=w)
    want, kept = by_sorting(x, beta, w)
    assert torch.equal(got.aggregate, want)
    d = x.shape[1]
    assert torch.equal(got.diagnostics.trimmed_share, 1.0 - kept.double() / d)
    assert torch.equal(got.diagnostics.selected, kept > 0)


def test_the_same_bits_on_any_number_of_cores(monkeypatch):
    """The columns are shared among the cores in chunks (packed_kernels.in_chunks): any split, the same numbers."""
    from zoo_gym.aggregation import packed_kernels

    x = torch.randn(400, 20_000, generator=torch.Generator().manual_seed(4))
    results = []
    for cores in (1, 2, 3):
        monkeypatch.setattr(packed_kernels.os, "sched_getaffinity", lambda _pid, c=cores: set(range(c)))
        results.append(trimmed_mean(x, beta=0.2))
    for r in results[1:]:
        assert torch.equal(r.aggregate, results[0].aggregate)
        assert torch.equal(r.diagnostics.trimmed_share, results[0].diagnostics.trimmed_share)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_rank_the_same_values(dtype):
    x = grid(31, 200, 9)
    got = trimmed_mean(x.to(dtype), beta=0.2).aggregate
    assert got.dtype == dtype
    assert torch.equal(got.float(), by_sorting(x, 0.2, None)[0].to(dtype).float())


@pytest.mark.parametrize("copies", [False, True])
def test_nan_or_inf_is_refused_naming_the_rows(copies):
    x = torch.randn(9, 50)
    x[4, 7], x[6, 0] = float("nan"), float("inf")
    groups = torch.tensor([0, 0, 2, 3, 4, 5, 6, 7, 8]) if copies else None
    with pytest.raises(InvalidDeltaError, match=r"rows \[4, 6\] contain NaN or inf"):
        trimmed_mean(x, beta=0.2, groups=groups)


@pytest.mark.parametrize("pattern", ["random", "sorted", "reversed", "equal", "two"])
def test_select_puts_the_rank_in_place(pattern):
    """The selection's invariant on its own, every target rank, including segments it finishes by sorting."""
    n = 200
    rng = np.random.default_rng(0)
    values = {"random": rng.integers(0, 20, n), "sorted": np.arange(n), "reversed": np.arange(n)[::-1],
              "equal": np.zeros(n), "two": np.arange(n) % 2}[pattern].astype(np.float32)
    for t in range(0, n, 7):
        v, r = values.copy(), np.arange(n, dtype=np.int64)
        select_kernels._select(v, r, 0, n, t)
        keys = list(zip(v.tolist(), r.tolist()))
        assert sorted(keys)[t] == keys[t]
        assert all(key < keys[t] for key in keys[:t]) and all(key > keys[t] for key in keys[t + 1:])
    v, r = values.copy(), np.arange(n, dtype=np.int64)
    select_kernels._sort(v, r, 0, n)
    assert list(zip(v.tolist(), r.tolist())) == sorted(zip(values.tolist(), range(n)))


@pytest.mark.parametrize("n", [5, 40, 120])
@pytest.mark.parametrize("weighted", [False, True])
def test_counting_ranks_and_selecting_give_the_same_bits(n, weighted):
    """A few rows have their ranks counted, more are selected (RANK_MAX): the same values summed in the same
    order, so the same numbers whichever way a column goes, on values whose sums round."""
    x = torch.randn(n, 999, generator=torch.Generator().manual_seed(n)).numpy()
    x[:, :100] = np.round(x[:, :100])  # ties
    weights = np.random.default_rng(n).random(n) + 0.5 if weighted else np.zeros(0)
    k = trim_count(n=n, beta=0.2)
    out = []
    for rank_max in (0, 10 ** 6):
        acc, den, kept = np.zeros(999), np.zeros(999 if weighted else 0), np.zeros(n, dtype=np.int64)
        assert select_kernels.trimmed_columns(x, k, weights, 0, 999, acc, den, kept, rank_max) == 0
        out.append((acc, den, kept))
    for a, b in zip(*out):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("n", [600, 2000, 10_000])
@pytest.mark.parametrize("beta", [0.05, 0.1, 0.4])
def test_the_sampled_brackets_keep_what_a_stable_sort_keeps(n, beta):
    """From SAMPLE_MIN rows a float32 column is bracketed by a sample (one bracket or two) and only the candidates
    are selected; a column that traps the sample falls back to the whole column's selection."""
    k = trim_count(n=n, beta=beta)
    g = torch.Generator().manual_seed(n)
    columns = {"normal": torch.randn(n, generator=g), "ties": torch.randint(-3, 4, (n,), generator=g) * 0.5,
               "signed zeros": torch.where(torch.arange(n) % 2 == 0, -0.0, 0.0), "trap": sample_trap(n)}
    for name, col in columns.items():
        rows = col.double().sort(stable=True).indices[k:n - k]
        want = torch.zeros(n, dtype=torch.bool)
        want[rows] = True
        keep, keys = np.zeros(n, dtype=np.bool_), np.zeros(n, dtype=np.int64)
        took = select_kernels._keep_by_sample(col.numpy().view(np.int32), k, keep, keys)
        assert took == (name != "trap"), name
        if took:
            assert np.array_equal(keep, want.numpy()), name
    x = torch.stack(list(columns.values()), dim=1)
    assert torch.equal(trimmed_mean(x, beta=beta).aggregate, by_sorting(x, beta, None)[0])


def test_the_packed_key_orders_as_value_then_row():
    values = np.array([-np.inf, -3.5, -1e-40, -0.0, 0.0, 1e-40, 2.0, 2.0, np.inf], dtype=np.float32)
    rows = np.array([5, 1, 7, 3, 2, 0, 4, 6, 8])
    keys = [select_kernels._key(b, r) for b, r in zip(values.view(np.int32), rows)]
    want = sorted(range(len(values)), key=lambda i: (values[i], rows[i]))  # -0.0 == 0.0: their rows decide
    assert sorted(range(len(values)), key=lambda i: keys[i]) == want
