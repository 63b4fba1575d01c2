"""The statistics of analysis/: slope fits and the balanced-factorial variance shares on synthetic data with
known answers."""

import itertools

import numpy as np
import pandas as pd
import pytest

import analysis
from harness import cell_seeds


# ------------------------------------------------------------------------------------------------
# the variance decomposition
# ------------------------------------------------------------------------------------------------
def _design(noise=0.0, seeds=3):
    """y = alpha_a + beta_b + 0.5 alpha_a beta_b + 0.25 alpha_a beta_b gamma_c over a 3 x 2 x 2 design; the
    effects are centred, so the terms are orthogonal: SS_a = 8, SS_b = 12, SS_ab = 2, SS_abc = 0.5 (sums over
    the 12 cells) and the factor c alone explains nothing."""
    alpha, beta, gamma = {0: -1.0, 1: 0.0, 2: 1.0}, {0: -1.0, 1: 1.0}, {0: -1.0, 1: 1.0}
    rng = np.random.default_rng(0)
    rows = []
    for seed in range(seeds):
        for a, b, c in itertools.product(alpha, beta, gamma):
            y = alpha[a] + beta[b] + 0.5 * alpha[a] * beta[b] + 0.25 * alpha[a] * beta[b] * gamma[c]
            for _ in range(2):                                  # two replicates per cell
                rows.append(dict(seed=seed, a=a, b=b, c=c, y=y + noise * rng.normal()))
    return pd.DataFrame(rows)


def test_variance_shares_recover_known_shares():
    table = analysis.variance_shares(_design(), ["a", "b", "c"], "y").set_index("term")
    total = 8 + 12 + 2 + 0.5
    expected = {"a": 8 / total, "b": 12 / total, "a x b": 2 / total, "c": 0.0, "a x c": 0.0, "b x c": 0.0,
                "higher order": 0.5 / total}
    for term, share in expected.items():
        assert table.loc[term, "share"] == pytest.approx(share, abs=1e-12), term
        assert table.loc[term, "lo"] == pytest.approx(share, abs=1e-12)
    assert table.share.sum() == pytest.approx(1.0, abs=1e-12)


def test_variance_shares_intervals_cover_the_truth_under_noise_and_reject_unbalanced_designs():
    table = analysis.variance_shares(_design(noise=0.05, seeds=8), ["a", "b", "c"], "y").set_index("term")
    assert table.loc["b", "lo"] < 12 / 22.5 < table.loc["b", "hi"] + 0.01
    assert table.loc["b", "hi"] - table.loc["b", "lo"] < 0.05
    df = _design()
    with pytest.raises(ValueError, match="balanced"):
        analysis.variance_shares(df.drop(index=[0, 1]), ["a", "b", "c"], "y")


# ------------------------------------------------------------------------------------------------
# slope fit
# ------------------------------------------------------------------------------------------------
def test_fit_slope_on_synthetic_data():
    t = analysis.log_grid(10**6)
    exact = 3.0 + 1.25 * np.log(t)
    s, lo, hi = analysis.fit_slope(t, exact)
    assert s == pytest.approx(1.25, abs=1e-12) and lo == hi == s
    rng = np.random.default_rng(0)
    slopes = 1.25 + 0.1 * rng.normal(size=30)
    noisy = 2.0 + slopes[:, None] * np.log(t)[None] + 0.01 * rng.normal(size=(30, t.size))
    s, lo, hi = analysis.fit_slope(t, noisy)
    assert lo < 1.25 < hi and hi - lo < 0.2
    # only the last two decades count: a kink before 1e4 does not move the fit
    kinked = np.where(t < 1e4, 10 * np.log(t), 10 * np.log(1e4) + 0.5 * (np.log(t) - np.log(1e4)))
    assert analysis.fit_slope(t, kinked)[0] == pytest.approx(0.5, abs=1e-12)


def test_log_grid_and_cell_seeds():
    g = analysis.log_grid(1000)
    assert g[0] == 1 and g[-1] == 1000 and np.all(np.diff(g) > 0)
    assert analysis.log_grid(1234)[-1] == 1234
    a, b = cell_seeds(0, "x", 3), cell_seeds(0, "x", 5)
    assert np.array_equal(a, b[:3]) and len(set(b.tolist())) == 5
    assert not np.array_equal(cell_seeds(0, "y", 3), a)
