"""The statistics of analysis/: slope fits and the balanced-factorial variance shares on synthetic data with
known answers."""

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

import analysis
from analysis import verdicts
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


def test_fit_windows_include_both_ends_and_match_polyfit():
    """The fitted window is [t_max / 10^decades, t_max] (or ``window``), both ends included: checked
    against numpy's polyfit on the same points, with spikes at the window's ends and beyond it so that
    a window one point too wide or too narrow moves the slope."""
    t = np.arange(1, 1001)
    rng = np.random.default_rng(3)
    r = 0.7 * np.log(t) + 0.05 * rng.normal(size=t.size)
    r[[9, 99, 199, 999]] += (3.0, -2.0, 1.5, 2.5)                     # t = 10, 100, 200, 1000

    def ref(lo, hi, y=r):
        keep = (t >= lo) & (t <= hi)
        return np.polyfit(np.log(t[keep]), y[keep], 1)[0]
    assert analysis.fit_slope(t, r)[0] == pytest.approx(ref(10, 1000), abs=1e-10)
    assert analysis.fit_slope(t, r, decades=1.0)[0] == pytest.approx(ref(100, 1000), abs=1e-10)
    assert analysis.fit_slope(t, r, window=(10, 100))[0] == pytest.approx(ref(10, 100), abs=1e-10)
    assert analysis.fit_slope(t, r[None].repeat(2, 0) + [[0.0], [5.0]])[0] == pytest.approx(ref(10, 1000), abs=1e-10)
    pos = np.exp(r)
    assert analysis.fit_exponent(t, pos, window=(10, 200))[0] == pytest.approx(ref(10, 200, np.log(pos)), abs=1e-10)
    assert analysis.fit_exponent(t, pos)[0] == pytest.approx(ref(10, 1000, np.log(pos)), abs=1e-10)
    # two points are enough for a slope, one is not
    assert analysis.fit_slope(t, r, window=(10, 11))[0] == pytest.approx((r[10] - r[9]) / np.log(1.1), rel=1e-9)
    with pytest.raises(ValueError, match="at least two grid points"):
        analysis.fit_slope(t, r, window=(10, 10.5))


def test_log_grid_and_cell_seeds():
    g = analysis.log_grid(1000)
    assert g[0] == 1 and g[-1] == 1000 and np.all(np.diff(g) > 0)
    assert analysis.log_grid(1234)[-1] == 1234
    assert g.dtype == np.int64 and analysis.log_grid(1).tolist() == [1]               # rounds are integers
    assert analysis.log_grid(100, 2).tolist() == [1, 3, 10, 32, 100]                 # round(10^0.5) = 3
    with pytest.raises(ValueError, match=r"n_rounds = 0 must be an integer >= 1"):
        analysis.log_grid(0)
    a, b = cell_seeds(0, "x", 3), cell_seeds(0, "x", 5)
    assert np.array_equal(a, b[:3]) and len(set(b.tolist())) == 5
    assert not np.array_equal(cell_seeds(0, "y", 3), a)


# ------------------------------------------------------------------------------------------------
# verdicts from stated rules, on inputs with known answers
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lo, hi, sign, margin, expected", [
    (0.1, 0.3, 1, 0.0, "reproduces"),
    (-0.1, 0.3, 1, 0.0, "inconclusive"),                 # the interval holds 0 and large effects
    (-0.3, -0.1, 1, 0.0, "does not reproduce"),          # the opposite sign
    (0.01, 0.04, 1, 0.05, "does not reproduce"),         # real but below the smallest effect that matters
    (-0.02, 0.04, 1, 0.05, "does not reproduce"),        # equivalence: every effect that matters excluded
    (-0.02, 0.06, 1, 0.05, "inconclusive"),
    (-0.3, -0.1, -1, 0.0, "reproduces"),                 # a claimed negative effect
    (0.1, 0.3, -1, 0.0, "does not reproduce"),
])
def test_effect_verdicts(lo, hi, sign, margin, expected):
    assert verdicts.effect_verdict(lo, hi, sign, margin) == expected


@pytest.mark.parametrize("lo, hi, at_most, expected", [
    (0.001, 0.008, True, "reproduces"), (0.005, 0.02, True, "inconclusive"), (0.02, 0.03, True, "does not reproduce"),
    (0.02, 0.03, False, "reproduces"), (0.001, 0.008, False, "does not reproduce"), (0.005, 0.02, False, "inconclusive"),
])
def test_bound_verdicts_against_a_tolerance_of_0_01(lo, hi, at_most, expected):
    assert verdicts.bound_verdict(lo, hi, 0.01, at_most) == expected


def test_verdict_rules_refuse_bad_intervals_and_rows_refuse_unknown_verdicts():
    for call in (lambda: verdicts.effect_verdict(0.3, 0.1), lambda: verdicts.bound_verdict(float("nan"), 1, 0),
                 lambda: verdicts.effect_verdict(0, 1, sign=0), lambda: verdicts.effect_verdict(0, 1, margin=-1)):
        with pytest.raises(ValueError):
            call()
    row = verdicts.verdict_row("E4", "log-linear", "edge", 0.01, -0.01, 0.03, "effect > 0", "inconclusive")
    assert list(row) == list(verdicts.COLUMNS)
    with pytest.raises(ValueError, match="verdict"):
        verdicts.verdict_row("E4", "", "edge", 0, 0, 0, "", "holds")


def test_mde_power_and_tost_against_their_closed_forms():
    from scipy import stats
    assert verdicts.mde_80(1.0) == pytest.approx(stats.norm.ppf(0.975) + stats.norm.ppf(0.8), rel=1e-12)
    assert verdicts.mde_80(0.5) == pytest.approx(1.4008, abs=1e-4)
    assert verdicts.power(verdicts.mde_80(0.3), 0.3) == pytest.approx(0.8, abs=1e-5)   # + the far tail, ~1e-6
    assert verdicts.power(0.0, 1.0) == pytest.approx(0.05, rel=1e-12)
    assert verdicts.mde_80(0.0) == 0.0                             # an exact estimate detects any effect
    with pytest.raises(ValueError, match="must be > 0"):
        verdicts.power(0.1, 0.0)
    p, eq = verdicts.tost(0.0, 1.0, 3.0)
    assert p == pytest.approx(stats.norm.sf(3.0), rel=1e-12) and eq
    p, eq = verdicts.tost(0.5, 1.0, 1.0, df=10)
    assert p == pytest.approx(stats.t(10).sf(0.5), rel=1e-12) and not eq


# ------------------------------------------------------------------------------------------------
# decidability per draw (issue 28): a draw counts only where the design can tell the targets apart
# ------------------------------------------------------------------------------------------------
def test_decide_draws_needs_separation_and_low_noise():
    t = verdicts.decide_draws([0.005, 0.005, 0.02, 0.02, 0.005], 0.01, separation=[0.03, 0.029, 0.05, 0.05, np.nan],
                              noise=[0.001, 0.001, 0.0099, 0.01, np.nan])
    # 0.03 >= 3 x 0.01 decides, 0.029 does not; noise 0.0099 < 0.01 decides, 0.01 does not; NaN checks nothing
    assert t.decidable.tolist() == [True, False, True, False, True]
    assert t.held.tolist()[0] == 1.0 and np.isnan(t.held[1]) and t.held[2] == 0.0 and t.held[4] == 1.0
    above = verdicts.decide_draws([0.005, 0.02], 0.01, at_most=False)
    assert above.held.tolist() == [0.0, 1.0]                                  # "> tolerance" claims
    assert verdicts.decide_draws([0.01], 0.01).held[0] == 1.0                  # the tolerance itself meets "<="
    assert verdicts.decide_draws([0.01], 0.01, at_most=False).held[0] == 0.0
    assert verdicts.decide_draws([0.005], 0.01, separation=[0.05], multiple=6).decidable[0] == bool(0)
    with pytest.raises(ValueError, match="tolerance"):
        verdicts.decide_draws([0.1], 0.0, separation=[1.0])


def test_separating_condition_finds_a_threshold_or_none():
    held = np.array([True, True, False, False])
    assert verdicts.separating_condition(held, {"sep": [0.5, 0.4, 0.1, 0.2]}) == "sep > 0.3"
    assert verdicts.separating_condition(held, {"sep": [0.1, 0.2, 0.5, 0.4]}) == "sep <= 0.3"
    assert verdicts.separating_condition(held, {"a": [0.1, 0.5, 0.2, 0.4], "b": [1, 1, 0, 0]}) == "b > 0.5"
    assert verdicts.separating_condition(held, {"a": [0.1, 0.5, 0.2, 0.4]}) is None
    assert verdicts.separating_condition(held, {"a": [0.5, 0.4, np.nan, 0.2]}) is None
    assert verdicts.separating_condition(np.array([True, True]), {"a": [1, 2]}) is None


NAN = float("nan")


@pytest.mark.parametrize("values, sep, expected", [
    ([0.001] * 4, [1.0] * 4, ("reproduces", 4, 4, "", NAN)),
    ([0.5] * 4, [1.0] * 4, ("does not reproduce", 4, 0, "", NAN)),
    # sep separates 2 of 4, but 2 of the C(4, 2) = 6 labellings are separated by any ordering: p = 1/3
    ([0.001, 0.001, 0.5, 0.5], [1.0, 0.9, 0.1, 0.2], ("mixed", 4, 2, "sep > 0.55", 1 / 3)),
    ([0.001, 0.5, 0.001, 0.5], [1.0, 0.9, 0.1, 0.2], ("mixed", 4, 2, "", NAN)),
    ([0.001, 0.001, 0.5, 0.5], [1.0, 1.0, 0.01, 0.01], ("inconclusive", 2, 2, "", NAN)),     # 2 of 4 decide: too few
    ([0.001, 0.001, 0.001, 0.5], [1.0, 1.0, 1.0, 0.01], ("reproduces", 3, 3, "", NAN)),     # the failure cannot decide
    # 3 of 8 hold, separated by sep: p = 2 / C(8, 3) = 2/56 <= 0.05 and 3 and 5 per side: stated
    ([0.001] * 3 + [0.5] * 5, [1.0, 0.9, 0.8, 0.5, 0.4, 0.3, 0.2, 0.1],
     ("reproduces under stated conditions", 8, 3, "sep > 0.65", 2 / 56)),
    # 2 of 8: p = 2 / C(8, 2) = 2/28 > 0.05: mixed, the condition reported
    ([0.001] * 2 + [0.5] * 6, [1.0, 0.9, 0.8, 0.5, 0.4, 0.3, 0.2, 0.1], ("mixed", 8, 2, "sep > 0.85", 2 / 28)),
    # 1 of 12: p = 2/12 and one unit on a side: mixed
    ([0.001] + [0.5] * 11, list(np.linspace(1.0, 0.1, 12)), ("mixed", 12, 1, "sep > 0.959", 2 / 12)),
])
def test_draw_verdict_counts_only_decidable_draws(values, sep, expected):
    table = verdicts.decide_draws(values, 0.01, separation=sep)
    got = verdicts.draw_verdict(table, {"sep": sep})
    assert got[:4] == expected[:4] and got[4] == pytest.approx(expected[4], nan_ok=True)


def test_a_condition_is_stated_only_with_enough_units_per_side_and_a_small_permutation_p():
    """The minimum per side and the p-value bind separately: 2 of 10 holding (p = 2/45 <= 0.05, 2 per side)
    is stated, 1 of 40 (p = 2/40 = 0.05, 1 on a side) is not; with min_side = 1 it is; alpha = 0.01
    refuses 2/45; and E5's case, 1 of 3 decidable draws, is separated by chance with p = 2/3."""
    def verdict(k, n, **kw):
        table = verdicts.decide_draws([0.001] * k + [0.5] * (n - k), 0.01)
        return verdicts.draw_verdict(table, {"p": np.arange(n, 0, -1.0)}, **kw)
    assert verdict(2, 10)[0] == "reproduces under stated conditions" and verdict(2, 10)[4] == pytest.approx(2 / 45)
    assert verdict(1, 40)[0] == "mixed" and verdict(1, 40, min_side=1)[0] == "reproduces under stated conditions"
    assert verdict(2, 10, alpha=0.01)[0] == "mixed"
    assert verdict(1, 3)[:4] == ("mixed", 3, 1, "p > 2.5") and verdict(1, 3)[4] == pytest.approx(2 / 3)


def test_separation_p_is_the_exact_share_of_relabellings_some_property_separates():
    """Against brute force over every labelling with the same counts, for random properties with ties,
    one or two properties, and a property with a NaN skipped; held must be booleans."""
    import itertools
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(3, 9))
        k = int(rng.integers(1, n))
        props = {f"x{i}": rng.integers(0, 4, n).astype(float) for i in range(int(rng.integers(1, 3)))}
        props["skipped"] = np.r_[np.nan, np.zeros(n - 1)]
        held = np.zeros(n, bool)
        held[rng.choice(n, k, replace=False)] = True
        hits = 0
        for ones in itertools.combinations(range(n), k):
            mask = np.zeros(n, bool)
            mask[list(ones)] = True
            hits += verdicts.separating_condition(mask, props) is not None
        assert verdicts.separation_p(held, props) == pytest.approx(hits / math.comb(n, k))
    assert np.isnan(verdicts.separation_p(np.ones(3, bool), {"a": [1, 2, 3]}))
    for bad in ([1, 1, 0, 0], [1.0, 0.0], np.array([2, 0])):
        for f in (verdicts.separating_condition, verdicts.separation_p):
            with pytest.raises(ValueError, match="booleans"):
                f(bad, {"a": [1.0] * len(bad)})


def test_draw_row_states_counts_rule_condition_and_sensitivity():
    values, sep = [0.003, 0.004, 0.006, 0.015, 0.03], [0.2, 0.2, 0.2, 0.2, 0.01]
    row, table = verdicts.draw_row("c", "cond", "KL", values, 0.01, separation=sep, noise=[0.001] * 5,
                                   properties={"sep": sep})
    assert (row["n_draws"], row["n_decidable"], row["n_hold"]) == (5, 4, 3)
    assert row["verdict"] == "mixed" and row["stated_condition"] == ""          # sep does not separate 0.015
    assert (row["estimate"], row["lo"], row["hi"]) == (pytest.approx(0.005), 0.003, 0.015)   # decidable draws only
    assert "3 of 4 decidable task draws <= 0.01 (5 task draws)" in row["statistic"]
    assert ">= 3 x 0.01 apart" in row["rule"] and "s.d. < 0.01" in row["rule"]
    # half the tolerance (0.005): 2 of 5 hold, and the draw 0.006 fails; twice (0.02): separation 0.2 >= 0.06
    assert row["verdict_half_tolerance"] == "mixed" and row["verdict_twice_tolerance"] == "reproduces"
    assert table.decidable.tolist() == [True] * 4 + [False] and (table.tolerance == 0.01).all()
    quick, _ = verdicts.draw_row("c", "cond", "KL", values, 0.01, separation=sep, quick=True)
    assert quick["verdict"] == quick["verdict_half_tolerance"] == verdicts.QUICK
    assert verdicts.verdict_row("c", "", "", 0, 0, 0, "", verdicts.QUICK)["verdict"] == verdicts.QUICK
    empty, _ = verdicts.draw_row("c", "cond", "KL", [0.5, 0.5], 0.01, separation=[0.0, 0.0])
    assert empty["verdict"] == "inconclusive" and empty["estimate"] == 0.5        # shown over all draws


def test_verdict_edges_defaults_and_tost_scaling():
    """The edges the rules state: a bound met at the tolerance itself, an interval starting at it not
    wholly beyond it; the defaults (a positive claim, margin 0, 'at most'); TOST's statistics divide by the
    standard error, reject only below alpha, and refuse a zero s.e. or margin; a row keeps its labels."""
    assert verdicts.bound_verdict(0.001, 0.01, 0.01) == "reproduces"                 # hi == tolerance
    assert verdicts.bound_verdict(0.01, 0.02, 0.01) == "inconclusive"                # lo == tolerance
    assert verdicts.bound_verdict(0.02, 0.03, 0.01) == "does not reproduce"
    assert verdicts.effect_verdict(1e-4, 2e-4) == "reproduces"                      # sign +1, margin 0
    assert verdicts.effect_verdict(-2e-4, -1e-4) == "does not reproduce"
    p, eq = verdicts.tost(0.0, 0.5, 1.0)                                             # z = (0 + 1) / 0.5 = 2
    assert p == pytest.approx(0.022750131948179, rel=1e-12) and eq
    p, eq = verdicts.tost(0.5, 0.5, 1.0)                                             # the upper test: z = -1
    assert p == pytest.approx(0.158655253931457, rel=1e-12) and not eq
    p, _ = verdicts.tost(0.2, 0.4, 1.0)
    assert verdicts.tost(0.2, 0.4, 1.0, alpha=p)[1] is False                         # p < alpha, strictly
    for se, margin in ((0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)):
        with pytest.raises(ValueError):
            verdicts.tost(0.0, se, margin)
    row = verdicts.verdict_row("my claim", "my condition", "s", 1, 0, 2, "r", "inconclusive")
    assert (row["claim"], row["condition"], row["statistic"], row["rule"]) == ("my claim", "my condition", "s", "r")


# ------------------------------------------------------------------------------------------------
# the test a row uses: t over clusters, Fieller, margins
# ------------------------------------------------------------------------------------------------
def _t_rejections(mu, n, reps=40_000, seed=0, level=0.95):
    """The share of two-sided one-sample t-tests (n draws of N(mu, 1), at ``level``) that reject 0."""
    from scipy import stats
    x = np.random.default_rng(seed).normal(mu, 1.0, size=(reps, n))
    t = x.mean(1) / (x.std(1, ddof=1) / np.sqrt(n))
    return float((np.abs(t) > stats.t.ppf(0.5 + level / 2, n - 1)).mean())


@pytest.mark.parametrize("n", [4, 8])
def test_t_power_and_mde_match_simulated_t_tests_where_the_z_test_overstates_them(n):
    """Against simulated t-tests over n clusters (se = 1 / sqrt(n), df = n - 1): the power at an effect,
    and 80% power at the t MDE; the z-test's MDE is smaller (1.17x at 8 clusters, 1.52x at 4) and a t-test
    at it has power well below 0.8."""
    se, df = 1 / np.sqrt(n), n - 1
    assert verdicts.t_power(0.9, se, df) == pytest.approx(_t_rejections(0.9, n), abs=0.01)
    mde = verdicts.t_mde_80(se, df)
    assert verdicts.t_power(mde, se, df) == pytest.approx(0.8, abs=1e-9)
    assert _t_rejections(mde, n, seed=1) == pytest.approx(0.8, abs=0.01)
    assert mde / verdicts.mde_80(se) == pytest.approx({8: 1.1671, 4: 1.5191}[n], abs=1e-3)
    assert _t_rejections(verdicts.mde_80(se), n, seed=2) < 0.75
    assert verdicts.t_power(0.0, se, df) == pytest.approx(0.05, abs=1e-12)
    assert verdicts.t_power(-0.9, se, df) == verdicts.t_power(0.9, se, df)


def test_t_mde_tends_to_the_z_mde_with_many_clusters_and_refuses_bad_input():
    assert verdicts.t_mde_80(1.0, 1e7) == pytest.approx(verdicts.mde_80(1.0), rel=1e-5)
    assert verdicts.t_mde_80(0.0, 7) == 0.0
    for call, name in ((lambda: verdicts.t_mde_80(1.0, 0), "df"), (lambda: verdicts.t_power(1.0, 0.0, 7), "se"),
                       (lambda: verdicts.t_power(1.0, 1.0, float("inf")), "df")):
        with pytest.raises(ValueError, match=name):
            call()


def test_t_mde_at_another_level_and_power_and_its_range():
    """At level 0.9 the simulated t-test at the MDE rejects 80% of the time; a low power target (0.1) gives
    an MDE below one se; the MDE scales with se; a power target at or below the test's size (its power at
    effect 0) or at or above 1 is refused."""
    se = 1 / np.sqrt(8)
    mde = verdicts.t_mde_80(se, 7, level=0.9)
    assert _t_rejections(mde, 8, seed=4, level=0.9) == pytest.approx(0.8, abs=0.01)
    assert mde < verdicts.t_mde_80(se, 7)
    low = verdicts.t_mde_80(1.0, 7, power_target=0.1)
    assert 0 < low < 1 and verdicts.t_power(low, 1.0, 7) == pytest.approx(0.1, abs=1e-9)
    assert verdicts.t_mde_80(3.0, 7) == pytest.approx(3 * verdicts.t_mde_80(1.0, 7), rel=1e-9)
    assert verdicts.t_mde_80(1.0, 7, power_target=0.06) < low
    for target, level in ((0.5, 0.5), (0.04, 0.95), (1.0, 0.95), (1.5, 0.95)):      # 1 - 0.5 is exact in floats
        with pytest.raises(ValueError, match="power_target"):
            verdicts.t_mde_80(1.0, 7, level=level, power_target=target)
    assert verdicts.effect_verdict(0.2, 0.2) == "reproduces"                   # a point interval is an interval


def _fieller_by_inversion(num, den, se_num, se_den, cov, q, grid):
    """The ratios of ``grid`` that the t-test of num - r den = 0 does not reject (Fieller's set by brute force)."""
    var = se_num ** 2 - 2 * grid * cov + grid ** 2 * se_den ** 2
    return grid[(num - grid * den) ** 2 <= q ** 2 * var]


@pytest.mark.parametrize("num, den, se_num, se_den, cov, kind", [
    (2.0, 4.0, 0.3, 0.5, 0.05, "interval"),
    (0.5, 1.0, 0.3, 0.3, -0.04, "interval"),
    (1.0, 0.3, 0.1, 0.4, 0.0, "two rays"),
    (0.3, 0.3, 0.5, 0.4, 0.0, "whole line"),
])
def test_fieller_sets_equal_the_inverted_t_test(num, den, se_num, se_den, cov, kind):
    from scipy import stats
    df = 7
    q = stats.t.ppf(0.975, df)
    est, lo, hi, got = verdicts.fieller(num, den, se_num, se_den, cov, df=df)
    assert got == kind and est == pytest.approx(num / den)
    grid = np.linspace(-50, 50, 200_001)
    inside = _fieller_by_inversion(num, den, se_num, se_den, cov, q, grid)
    step = grid[1] - grid[0]
    if kind == "interval":
        assert lo <= est <= hi
        assert inside.min() == pytest.approx(lo, abs=step) and inside.max() == pytest.approx(hi, abs=step)
    elif kind == "two rays":
        assert inside.min() == grid[0] and inside.max() == grid[-1]
        gap = grid[(grid > lo) & (grid < hi)]
        assert gap.size and not np.isin(gap, inside).any()
        assert np.isin(grid[(grid <= lo - step) | (grid >= hi + step)], inside).all()
    else:
        assert (lo, hi) == (-np.inf, np.inf) and inside.size == grid.size


def test_fieller_with_an_exact_denominator_is_the_numerators_interval_scaled():
    from scipy import stats
    q = stats.norm.ppf(0.975)
    _, lo, hi, kind = verdicts.fieller(3.0, 2.0, 0.5, 0.0)
    assert kind == "interval" and (lo, hi) == pytest.approx(((3 - q * 0.5) / 2, (3 + q * 0.5) / 2), rel=1e-12)


@pytest.mark.parametrize("lo, hi, kind, resolved", [
    (0.2, 0.8, "interval", True), (-0.1, 0.8, "interval", True), (0.3, 1.4, "interval", True),
    (-0.1, 1.2, "interval", False), (0.0, 1.0, "interval", False),
    (-0.5, 2.0, "two rays", False), (-np.inf, np.inf, "whole line", False),
])
def test_a_share_is_resolved_only_by_a_bounded_set_that_does_not_hold_both_0_and_1(lo, hi, kind, resolved):
    assert verdicts.ratio_resolved(lo, hi, kind) is resolved


def test_margins_must_lie_below_the_effect_under_test():
    assert verdicts.check_margin(0.005, 0.01) == 0.005
    assert verdicts.check_margin(0.005, -0.01) == 0.005                # the size of the effect, either sign
    for margin, effect in ((0.01, 0.01), (0.02, 0.01), (0.0, 0.01), (-0.001, 0.01), (0.001, 0.0)):
        with pytest.raises(ValueError, match="margin"):
            verdicts.check_margin(margin, effect)


def test_clusters_for_power_is_the_first_count_with_80_percent_power():
    sd, effect = 0.02, 0.01
    power = lambda n: verdicts.t_power(effect, sd / np.sqrt(n), n - 1)            # noqa: E731
    brute = next(n for n in range(2, 1000) if power(n) >= 0.8)
    assert verdicts.clusters_for_power(sd, effect) == brute == verdicts.clusters_for_power(sd, -effect)
    assert power(brute - 1) < 0.8 <= power(brute)
    assert brute > (2.8016 * sd / effect) ** 2                                  # the z-test's count is too small
    assert verdicts.clusters_for_power(sd, 0.0) is None and verdicts.clusters_for_power(1.0, 1e-9, most=100) is None
    assert verdicts.clusters_for_power(0.01, 1.0) == 2


def test_t_power_with_one_df_matches_simulated_t_tests_where_scipys_nct_fails(monkeypatch):
    """Two clusters (df = 1): scipy's noncentral t is NaN near the 80%-power effect; the chi-square
    integral takes over and agrees with simulation, and with the noncentral t where that is finite."""
    from scipy import stats
    se = 1 / np.sqrt(2)
    mde = verdicts.t_mde_80(se, 1)
    assert _t_rejections(mde, 2, seed=3) == pytest.approx(0.8, abs=0.01)
    exact = {df: verdicts.t_power(3 * se, se, df) for df in (1, 7)}
    monkeypatch.setattr(stats.nct, "sf", lambda *a: np.nan)
    for df, p in exact.items():
        assert verdicts.t_power(3 * se, se, df) == pytest.approx(p, abs=1e-7)


@pytest.mark.parametrize("df", [100, 388, 10_000])
def test_t_power_at_many_df_and_a_large_noncentrality_where_scipys_far_tail_is_nan(df, monkeypatch):
    """At 389 clusters and an effect 39 se away scipy's nct.cdf(-crit) is NaN; the power is then ~1 (the
    z-test's power, which the t-test's approaches at many df), not ~0 (the old fallback's quadrature over
    (0, inf) missed the chi-square's mass near df). The fallback alone agrees with the noncentral t where
    that is finite, and the power rises with the effect up to 1."""
    from scipy import stats
    assert verdicts.t_power(0.02, 0.01 / np.sqrt(389), 388) == pytest.approx(1.0, abs=1e-12)
    for nc in (3.0, 39.4, 100.0):
        assert verdicts.t_power(nc, 1.0, df) == pytest.approx(verdicts.power(nc, 1.0), abs=0.01)
    grid = np.linspace(0.0, 60.0, 121)
    powers = np.array([verdicts.t_power(nc, 1.0, df) for nc in grid])
    assert np.all(np.diff(powers) >= -1e-12) and powers[-1] == pytest.approx(1.0, abs=1e-12)
    exact = {nc: verdicts.t_power(nc, 1.0, df) for nc in (0.0, 0.5, 2.0, 3.0, 5.0)}
    monkeypatch.setattr(stats.nct, "sf", lambda *a: np.nan)
    for nc, p in exact.items():
        assert verdicts.t_power(nc, 1.0, df) == pytest.approx(p, abs=1e-8)


def test_tost_rejects_at_5_percent_per_side():
    """TOST at alpha = 0.05 is two one-sided 5% tests (a 90% interval inside +-margin): a p of 0.04, between
    2.5% and 5%, is equivalent at the default and not at alpha = 0.025; the normal and the t alike."""
    p, eq = verdicts.tost(0.0, 1 / 1.7507, 1.0)                                # z = 1.7507: p = 0.0400
    assert p == pytest.approx(0.0400, abs=1e-4) and eq is True and verdicts.tost(0.0, 1 / 1.7507, 1.0, alpha=0.025)[1] is False
    p, eq = verdicts.tost(0.0, 0.125 / np.sqrt(3), 0.25, df=2)
    assert 0.025 <= p < 0.05 and eq is True


def _simulated_tost(sd, margin, n, reps=20000, seed=0):
    from scipy import stats
    x = np.random.default_rng(seed).normal(0.0, sd, (reps, n))
    m, se = x.mean(axis=1), x.std(axis=1, ddof=1) / np.sqrt(n)
    t = stats.t.ppf(0.95, n - 1)
    return float(np.mean((m - t * se > -margin) & (m + t * se < margin)))


@pytest.mark.parametrize("sd, margin, n", [(1.0, 0.5, 36), (1.0, 1.0, 12), (0.3, 0.25, 8)])
def test_tost_power_and_the_clusters_it_needs_against_simulated_tosts(sd, margin, n):
    """TOST's power at a true effect of 0 against 20,000 simulated TOSTs (3.5 binomial s.e. <= 0.012),
    tost_clusters_for_power the first n with 80%, tost_se_for_power the s.e. where it is 80%."""
    assert verdicts.tost_power(sd, margin, n) == pytest.approx(_simulated_tost(sd, margin, n), abs=0.012)
    se = verdicts.tost_se_for_power(margin, n)
    assert verdicts.tost_power(se * np.sqrt(n), margin, n) == pytest.approx(0.8, abs=1e-9)
    assert (verdicts.tost_power(sd, margin, n) >= 0.8) == (sd / np.sqrt(n) <= se)
    need = verdicts.tost_clusters_for_power(sd, margin)
    brute = next(k for k in range(2, 10_000) if verdicts.tost_power(sd, margin, k) >= 0.8)
    assert need == brute and _simulated_tost(sd, margin, need, seed=1) >= 0.8 - 0.012
    assert need == 2 or _simulated_tost(sd, margin, need - 1, seed=2) < 0.8 + 0.012
    assert verdicts.tost_clusters_for_power(sd, 1e-6 * margin, most=1000) is None
    with pytest.raises(ValueError, match="sd = "):
        verdicts.tost_clusters_for_power(0.0, margin)
    with pytest.raises(ValueError, match="n = "):
        verdicts.tost_power(sd, margin, 1)


def test_median_lower_bound_is_the_sign_tests_order_statistic_and_covers():
    """The k-th smallest, k the largest with P(Binomial(n, 1/2) <= k - 1) <= 0.05: none below 5 values, the
    smallest of 5-7, the 2nd of 8-10, the 3rd of 11; its confidence; a simulated coverage of the median of
    an exponential (skewed) within 3 s.e. of the stated confidence."""
    for n, k in ((3, 0), (4, 0), (5, 1), (7, 1), (8, 2), (10, 2), (11, 3), (20, 6)):
        bound, got, conf = verdicts.median_lower_bound(np.arange(n, 0, -1.0))
        assert got == k
        if k:
            assert bound == k and conf == pytest.approx(1 - sum(math.comb(n, j) for j in range(k)) / 2 ** n)
            assert conf >= 0.95 and 1 - sum(math.comb(n, j) for j in range(k + 1)) / 2 ** n < 0.95
        else:
            assert np.isnan(bound) and np.isnan(conf)
    rng = np.random.default_rng(0)
    for n in (5, 8, 12):
        x = rng.exponential(1.0, (4000, n))
        _, k, conf = verdicts.median_lower_bound(x[0])
        bounds = np.sort(x, axis=1)[:, k - 1]
        assert all(verdicts.median_lower_bound(row)[0] == b for row, b in zip(x[:50], bounds))
        covered = np.mean(bounds <= np.log(2))
        assert covered == pytest.approx(conf, abs=3 * np.sqrt(conf * (1 - conf) / 4000))
    with pytest.raises(ValueError, match="NaN"):
        verdicts.median_lower_bound([1.0, np.nan])
    with pytest.raises(ValueError, match="level"):
        verdicts.median_lower_bound([1.0] * 5, level=1.0)


@given(st.lists(st.floats(-5, 5), min_size=1, max_size=16), st.data())
def test_median_lower_bound_is_conservative_under_censoring(true, data):
    """Values censored at a budget (recorded min(true, budget) with the budget at or below the truth for some):
    the bound from the recorded values never exceeds the bound from the true ones (an order statistic does not
    fall when a value rises), and raising one value never lowers it. A one-sided t bound has neither property."""
    true = np.array(true)
    budgets = np.array(data.draw(st.lists(st.floats(-5, 5), min_size=len(true), max_size=len(true))))
    recorded = np.minimum(true, budgets)
    lo_rec, k, _ = verdicts.median_lower_bound(recorded)
    lo_true = verdicts.median_lower_bound(true)[0]
    assert (k == 0 and np.isnan(lo_true)) or lo_rec <= lo_true
    i = data.draw(st.integers(0, len(true) - 1))
    raised = true.copy()
    raised[i] += data.draw(st.floats(0, 10))
    assert (k == 0) or verdicts.median_lower_bound(raised)[0] >= lo_true


def test_a_t_bound_is_not_conservative_under_censoring():
    """Why E6 does not use a t bound on censored values: raising one value (its true cost above the budget)
    raises the s.d. and can lower the one-sided t bound below the one computed from the budget."""
    from scipy import stats
    def t_lower(x):
        return x.mean() - stats.t.ppf(0.95, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
    recorded = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.2])
    true = recorded.copy()
    true[-1] = 5.0
    assert t_lower(true) < t_lower(recorded)
    assert verdicts.median_lower_bound(true)[0] >= verdicts.median_lower_bound(recorded)[0]


def test_the_separating_property_is_read_on_the_decidable_draws_not_the_first_ones():
    """Two undecidable draws first (their candidates 0.01 apart), then eight decidable ones of which the three
    with the largest property hold: the condition is 'p > 4.5' read on the decidable draws; the first eight
    draws' property values would not separate the same mask (mixed), or would state another condition."""
    values = [0.5, 0.5] + [0.001] * 3 + [0.5] * 5
    sep = [0.01, 0.01] + [1.0] * 8
    prop = [0.0, 0.0, 10.0, 9.0, 8.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    table = verdicts.decide_draws(values, 0.01, separation=sep)
    verdict, n, hold, cond, p = verdicts.draw_verdict(table, {"p": prop})
    assert (verdict, n, hold, cond) == ("reproduces under stated conditions", 8, 3, "p > 4.5")
    assert p == pytest.approx(1 / 56)                   # the 3 smallest of 8 tie with the rest: one split only
    flipped = [9.0, 9.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0, 5.0]            # now the holding draws are the lowest
    assert verdicts.draw_verdict(table, {"p": flipped})[3] == "p <= 2.5"


def test_the_seed_noise_is_compared_with_the_statistics_tolerance_not_the_separations():
    """A step-count statistic (tolerance 1000 steps) whose candidates are told apart at 0.01 nats: a seed s.d.
    of 50 steps is below 1000 and decides; compared with 0.01 it would not (a k1-like row would go from
    'reproduces, 8 decidable' to 'inconclusive, 0')."""
    table = verdicts.decide_draws([500.0] * 8, 1000.0, separation=[0.1] * 8, noise=[50.0] * 8,
                                  separation_tolerance=0.01)
    assert table.decidable.all()
    row, _ = verdicts.draw_row("c", "x", "steps", [500.0] * 8, 1000.0, separation=[0.1] * 8, noise=[50.0] * 8,
                               separation_tolerance=0.01)
    assert (row["verdict"], row["n_decidable"]) == ("reproduces", 8)
    assert "the candidate targets are >= 3 x 0.01 apart and the seed s.d. < 1000" in row["rule"]
    noisy = verdicts.decide_draws([500.0], 1000.0, separation=[0.1], noise=[1000.0], separation_tolerance=0.01)
    assert not noisy.decidable[0]


def test_rule_texts_print_only_the_clauses_a_row_applies():
    """No separation given: no 'candidate targets' clause; no noise: no 'seed s.d.' clause (a row with
    tolerance 0 printed 'seed s.d. < 0'); neither: every draw with a value decides."""
    both = verdicts.draw_row("c", "x", "s", [0.1] * 3, 0.0, at_most=False, separation=[1.0] * 3, noise=[0.1] * 3,
                             separation_tolerance=0.01)[0]["rule"]
    assert "apart" in both and "seed s.d." in both
    only_sep = verdicts.draw_row("c", "x", "s", [0.1] * 3, 0.0, at_most=False, separation=[1.0] * 3,
                                 separation_tolerance=0.01)[0]["rule"]
    assert "apart" in only_sep and "seed s.d." not in only_sep
    neither = verdicts.draw_row("c", "x", "s", [0.1] * 3, 0.0, at_most=False)[0]
    assert neither["rule"].startswith("every task draw with a value decides") and neither["verdict"] == "reproduces"
    assert "x 0 apart" not in neither["rule"] and "s.d. < 0" not in neither["rule"]


def test_separating_condition_reads_masks_skips_nan_properties_and_rows_state_their_side():
    held = [True, True, False, False]                          # a mask, not indices
    assert verdicts.separating_condition(held, {"sep": [0.5, 0.4, 0.1, 0.2]}) == "sep > 0.3"
    # a property with a missing value is skipped, the next one still tried
    assert verdicts.separating_condition(np.array(held, bool), {"a": [np.nan, 1, 0, 0], "b": [3, 3, 1, 1]}) == "b > 2"
    row, _ = verdicts.draw_row("c", "", "KL", [0.5, 0.5, 0.5], 0.01, at_most=False)
    assert "3 of 3 decidable task draws > 0.01" in row["statistic"] and "every one > 0.01" in row["rule"]
    with pytest.raises(ValueError, match="both numbers"):
        verdicts.effect_verdict(np.nan, 1.0)
    with pytest.raises(ValueError, match="both numbers"):
        verdicts.bound_verdict(0.0, np.nan, 0.01)


def test_count_verdict_closed_cases():
    from analysis.verdicts import count_verdict
    assert count_verdict([0.001, 0.002], 0.01) == ("reproduces", 2)
    assert count_verdict([0.1, 0.002], 0.01) == ("mixed", 1)          # some: no condition is stated
    assert count_verdict([0.1, 0.2], 0.01) == ("does not reproduce", 0)
    assert count_verdict([0.1, 0.2], 0.01, at_most=False) == ("reproduces", 2)
    assert count_verdict([0.01], 0.01) == ("reproduces", 1)              # the tolerance itself
    assert count_verdict([0.01, 0.02], 0.01, at_most=False) == ("mixed", 1)


# ------------------------------------------------------------------------------------------------
# survivors of the mutation run (issue 28 item 6): each test pins a meaning a mutant broke
# ------------------------------------------------------------------------------------------------
def test_fit_slope_interval_is_scipys_t_interval_over_seeds_at_two_and_three_seeds():
    """The interval over seeds is Student's t with n - 1 df on the per-seed polyfit slopes (sample s.d.,
    ddof = 1): scipy's t.interval, at two seeds (df = 1, the smallest that has an interval) and three."""
    from scipy import stats
    t = np.arange(1, 101)
    rng = np.random.default_rng(5)
    for n, level in ((2, 0.95), (3, 0.95), (3, 0.8)):
        r = (1.0 + 0.3 * rng.normal(size=(n, 1))) * np.log(t) + 0.02 * rng.normal(size=(n, t.size))
        slopes = np.array([np.polyfit(np.log(t), row, 1)[0] for row in r])       # t_max / 10^2 = 1: every point
        lo, hi = stats.t.interval(level, n - 1, loc=slopes.mean(), scale=stats.sem(slopes))
        assert analysis.fit_slope(t, r, level=level) == pytest.approx((slopes.mean(), lo, hi), rel=1e-9)


def test_fit_window_ends_count_within_a_relative_1e_12():
    """A grid point within a relative 1e-12 of a window end lies inside it (window ends computed as
    t_max / 10^decades are not exactly on the grid): the points 10 and 20 count for the window
    (10 / (1 - 1e-12), 20 / (1 + 1e-12)), whose tolerance-widened ends fall exactly on them."""
    t = np.arange(1.0, 31.0)
    r = np.log(t) ** 2
    lo, hi = 10.0 / (1 - 1e-12), 20.0 / (1 + 1e-12)
    assert lo * (1 - 1e-12) == 10.0 and hi * (1 + 1e-12) == 20.0               # the edge is representable
    ref = np.polyfit(np.log(t[9:20]), r[9:20], 1)[0]                           # t = 10..20, both ends
    assert analysis.fit_slope(t, r, window=(lo, hi))[0] == pytest.approx(ref, rel=1e-12)


def test_variance_shares_ignore_the_grand_mean_and_handle_one_seed_constants_and_clipping():
    """Shares are invariant to a constant added to the outcome (the interaction term removes each main
    effect about the grand mean); one seed gives its shares with lo = hi; a constant outcome has no
    variance to explain (every factor 0, all 'higher order'); the interval is clipped to [0, 1]."""
    base = analysis.variance_shares(_design(), ["a", "b", "c"], "y").set_index("term")
    shifted = _design().assign(y=lambda d: d.y + 5.0)
    moved = analysis.variance_shares(shifted, ["a", "b", "c"], "y").set_index("term")
    assert moved.share.to_numpy() == pytest.approx(base.share.to_numpy(), abs=1e-12)
    assert moved.loc["a x b", "share"] == pytest.approx(2 / 22.5, abs=1e-12)
    one = analysis.variance_shares(_design(seeds=1), ["a", "b", "c"], "y").set_index("term")
    assert one.loc["b", "share"] == one.loc["b", "lo"] == one.loc["b", "hi"] == pytest.approx(12 / 22.5)
    assert (one.seeds == 1).all()
    const = analysis.variance_shares(_design().assign(y=1.0), ["a", "b", "c"], "y").set_index("term")
    assert (const.drop(index="higher order").share == 0.0).all() and const.loc["higher order", "share"] == 1.0
    # seed 0: y = a exactly (share of a = 1); seed 1: a and b both matter (share of a = 0.5)
    rows = [dict(seed=s, a=a, b=b, y=a + (b if s else 0)) for s in (0, 1) for a in (0, 1) for b in (0, 1)]
    clip = analysis.variance_shares(pd.DataFrame(rows), ["a", "b"], "y").set_index("term")
    assert clip.loc["a", "share"] == pytest.approx(0.75) and clip.loc["a", "hi"] == 1.0
    assert clip.loc["a", "lo"] == 0.0


def test_tost_and_margins_name_what_they_refuse():
    with pytest.raises(ValueError, match=r"se = 0.0 and margin = 1.0 must be > 0"):
        verdicts.tost(0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"^margin = 0.02 must be > 0 and below"):
        verdicts.check_margin(0.02, 0.01)
    with pytest.raises(ValueError, match=r"^eq_margin = 0.02"):
        verdicts.check_margin(0.02, 0.01, name="eq_margin")


def test_fieller_refuses_negative_errors_and_handles_a_zero_denominator_and_the_boundary():
    """Either standard error negative is refused; a zero denominator's estimate is +-inf by the
    numerator's sign (NaN for 0 / 0); where a = den^2 - q^2 se_den^2 is exactly 0 (den just not significant)
    the set is unbounded; where the quadratic has a double root with a < 0 the 'two rays' touch: the
    whole line (checked against the inverted test)."""
    from scipy import stats
    for se_num, se_den in ((-0.1, 0.5), (0.5, -0.1)):
        with pytest.raises(ValueError, match="must be >= 0"):
            verdicts.fieller(1.0, 2.0, se_num, se_den)
    assert verdicts.fieller(2.0, 0.0, 0.1, 0.1)[0] == np.inf
    assert verdicts.fieller(-2.0, 0.0, 0.1, 0.1)[0] == -np.inf
    assert np.isnan(verdicts.fieller(0.0, 0.0, 0.1, 0.1)[0])
    q = stats.norm.ppf(0.975)
    den = 2.0
    assert den ** 2 - q ** 2 * (den / q) ** 2 == 0.0                              # a = 0 exactly
    est, lo, hi, kind = verdicts.fieller(1.0, den, 0.1, den / q)
    assert est == 0.5 and kind != "interval" and (lo, hi) == (-np.inf, np.inf)
    est, lo, hi, kind = verdicts.fieller(0.0, 0.1, 0.0, 1.0)                     # a < 0, b = c = 0: disc = 0
    grid = np.linspace(-50, 50, 1001)
    assert _fieller_by_inversion(0.0, 0.1, 0.0, 1.0, 0.0, q, grid).size == grid.size
    assert (kind, lo, hi) == ("whole line", -np.inf, np.inf)


def test_clusters_for_power_searches_for_the_first_count_exactly_and_briefly(monkeypatch):
    """The search returns the first n (an int) whose power is >= the target (equality counts), for any
    threshold, in few power evaluations (doubling, then bisection); against brute force with the real
    t_power at small and large counts and another level; refuses a non-positive or infinite spread."""
    real = verdicts.t_power
    for first in (2, 3, 4, 5, 6, 7, 9, 16, 17, 100, 1000):
        calls = []

        def stub(effect, se, df, level=0.95, first=first):
            calls.append(df)
            assert len(calls) < 100, "the search does not end"
            return 0.8 if df + 1 >= first else 0.5                               # exactly the target from `first` on
        monkeypatch.setattr(verdicts, "t_power", stub)
        assert verdicts.clusters_for_power(1.0, 1.0) == first
    # the default cap is a million clusters: a first count above it is None
    monkeypatch.setattr(verdicts, "t_power", lambda effect, se, df, level=0.95: 0.8 if df + 1 >= 10 ** 6 else 0.5)
    assert verdicts.clusters_for_power(1.0, 1.0) == 10 ** 6
    monkeypatch.setattr(verdicts, "t_power", lambda effect, se, df, level=0.95: 0.8 if df + 1 > 10 ** 6 else 0.5)
    assert verdicts.clusters_for_power(1.0, 1.0) is None
    monkeypatch.setattr(verdicts, "t_power", real)
    for sd, effect, level in ((1.0, 2.0, 0.95), (1.0, 1.2, 0.95), (1.0, 0.7, 0.95), (1.0, 0.7, 0.99), (1.0, 1.5, 0.9)):
        power = lambda n: real(effect, sd / np.sqrt(n), n - 1, level)            # noqa: E731
        brute = next(n for n in range(2, 1000) if power(n) >= 0.8)
        got = verdicts.clusters_for_power(sd, effect, level=level)
        assert got == brute and type(got) is int, (sd, effect, level)
    for sd in (0.0, -1.0, np.inf, np.nan):
        with pytest.raises(ValueError, match="sd = "):
            verdicts.clusters_for_power(sd, 1.0)


def test_draw_row_sensitivity_uses_the_same_noise_separation_tolerance_properties_and_minimum():
    """The verdicts at half and twice the tolerance are the same rule with everything else kept: the
    seed noise, the separation's own tolerance, the properties that may separate the draws and the
    minimum number of decidable draws."""
    def row(values, **kw):
        return verdicts.draw_row("c", "x", "s", values, 0.01, **kw)[0]
    sep, low = [0.2] * 4, [0.001] * 4
    # twice the tolerance (0.02): five of eight hold, a property separates them (p = 2/56; not 3x: all would
    # hold); with the last three at 1, 2, 2 the property does not separate: mixed
    sep8, low8 = [0.2] * 8, [0.001] * 8
    r = row([0.015] * 5 + [0.025] * 3, separation=sep8, noise=low8, properties={"p": [1.0] * 5 + [2.0] * 3})
    assert (r["verdict"], r["verdict_half_tolerance"]) == ("does not reproduce", "does not reproduce")
    assert r["verdict_twice_tolerance"] == "reproduces under stated conditions"
    r = row([0.015] * 5 + [0.025] * 3, separation=sep8, noise=low8, properties={"p": [1.0] * 6 + [2.0] * 2})
    assert r["verdict_twice_tolerance"] == "mixed"
    # the noise counts at twice the tolerance too: the noisy fourth draw cannot decide there
    r = row([0.015, 0.015, 0.015, 0.025], separation=sep, noise=[0.001, 0.001, 0.001, 0.03])
    assert r["verdict_twice_tolerance"] == "reproduces"
    # a ratio statistic (tolerance 1) whose candidates are told apart at 0.01: half of that decides
    r = verdicts.draw_row("c", "x", "s", [0.5] * 4, 1.0, separation=[0.04] * 4, separation_tolerance=0.01)[0]
    assert (r["verdict"], r["verdict_half_tolerance"]) == ("reproduces", "reproduces") and r["n_decidable"] == 4
    # the minimum number of decidable draws holds at every tolerance
    r = row([0.001, 0.001], separation=[0.2, 0.2], min_decidable=2)
    assert (r["verdict"], r["verdict_half_tolerance"]) == ("reproduces", "reproduces")
    # nothing to show: NaN, not an error
    r = row([np.nan, np.nan], separation=[0.2, 0.2])
    assert np.isnan(r["estimate"]) and np.isnan(r["lo"]) and r["verdict"] == "inconclusive"


def test_decide_draws_returns_its_inputs_and_effect_verdict_edges():
    table = verdicts.decide_draws([0.001, 0.02], 0.01, separation=[0.1, 0.1], noise=[0.002, 0.003])
    assert table.noise.tolist() == [0.002, 0.003] and table.separation.tolist() == [0.1, 0.1]
    assert table.decidable.tolist() == [True, True] and table.held.tolist() == [1.0, 0.0]
    # an interval that ends exactly at the margin still holds effects that matter; one starting at 0 holds 0
    assert verdicts.effect_verdict(-1.0, 0.5, 1, 0.5) == "inconclusive"
    assert verdicts.effect_verdict(0.0, 1.0) == "inconclusive"
    with pytest.raises(ValueError, match="sign = 2 must be"):
        verdicts.effect_verdict(0.0, 1.0, sign=2)


def test_fit_exponent_of_exact_power_laws_and_its_seed_interval():
    """Two seeds of exact power laws R = c T^k (k = 1/2 and 1, c = 1e-3 so that every R < 1): the exponents
    exactly, their mean and the Student-t interval over the two seeds (scipy's, 1 df) at the default
    level; a regret of 0 in the window (no logarithm) gives NaN."""
    from scipy import stats
    t = np.arange(1, 1001)
    regret = 1e-3 * np.stack([t ** 0.5, t ** 1.0])
    assert analysis.fit_exponent(t, regret[0]) == pytest.approx((0.5, 0.5, 0.5), abs=1e-12)
    lo, hi = stats.t.interval(0.95, 1, loc=0.75, scale=stats.sem([0.5, 1.0]))
    assert analysis.fit_exponent(t, regret) == pytest.approx((0.75, lo, hi), abs=1e-10)
    zero = regret.copy()
    zero[1, -1] = 0.0
    assert np.isnan(analysis.fit_exponent(t, zero)).all()


def test_mean_interval_is_scipys_t_interval_per_column():
    """Two seeds (the fewest with an interval) and two columns of different spread: per column the mean
    and scipy's Student-t interval with 1 df; one seed: the mean thrice."""
    from scipy import stats
    values = np.array([[1.0, 10.0], [3.0, 40.0]])
    mean, lo, hi = analysis.mean_interval(values)
    ref = [stats.t.interval(0.95, 1, loc=v.mean(), scale=stats.sem(v)) for v in values.T]
    np.testing.assert_allclose(mean, [2.0, 25.0], rtol=1e-12)
    np.testing.assert_allclose(np.stack([lo, hi], axis=1), ref, rtol=1e-12)
    for got in analysis.mean_interval(values[:1]):
        np.testing.assert_array_equal(got, [1.0, 10.0])


def test_t_mde_80_names_the_admissible_power_targets():
    """The refusal states the open range (size, 1): (0.05, 1) at level 0.95."""
    with pytest.raises(ValueError, match=r"must lie in \(0\.05, 1\)"):
        verdicts.t_mde_80(1.0, 7, power_target=0.04)


def test_growth_labels_exact_regret_curves_over_the_last_two_decades():
    """growth on curves with known answers, over its default window [t_max / 100, t_max]: c ln t + b is
    logarithmic with slope c; sqrt t a power (exponent 1/2 exactly); t^0.25 has an exponent below 0.3,
    so it is not called a power; a constant and c - 1/t (increments that shrink like 1/t) are bounded."""
    from scipy import stats
    t = analysis.log_grid(10_000)
    seeds = np.stack([(3.0 + 0.1 * s) * np.log(t) + 1.0 for s in range(3)])        # slopes 3.0, 3.1, 3.2
    label, slope, exponent = analysis.growth(t, seeds)
    half = stats.t.ppf(0.975, 2) * np.std([3.0, 3.1, 3.2], ddof=1) / np.sqrt(3)
    assert label == "logarithmic" and slope == pytest.approx((3.1, 3.1 - half, 3.1 + half), rel=1e-9)
    assert exponent == analysis.fit_exponent(t, seeds, window=(100, 10_000))
    label, slope, exponent = analysis.growth(t, np.sqrt(t))
    assert label == "power" and exponent == pytest.approx((0.5, 0.5, 0.5), rel=1e-9)
    assert slope == analysis.fit_slope(t, np.sqrt(t), window=(100, 10_000))          # not (10, 10^4)
    assert analysis.growth(t, t ** 0.25)[0] == "logarithmic"
    assert analysis.growth(t, np.full(t.shape, 5.0))[0] == "bounded"
    assert analysis.growth(t, 5.0 - 1.0 / t)[0] == "bounded"
    assert analysis.growth(t, np.sqrt(t), decades=3.0)[1] == analysis.fit_slope(t, np.sqrt(t), window=(10, 10_000))


def test_decade_slopes_are_the_slopes_on_each_full_decade():
    """One entry per full decade [10^j, 10^(j+1)] that the grid covers from its start, each fit_slope's
    95% interval there: on c ln t the same slope on every decade, on sqrt t a growing one."""
    t = analysis.log_grid(10_000)
    seeds = np.stack([(3.0 + 0.1 * s) * np.log(t) for s in range(3)])
    out = analysis.decade_slopes(t, seeds)
    assert list(out) == [(1.0, 10.0), (10.0, 100.0), (100.0, 1000.0), (1000.0, 10000.0)]
    for (lo, hi), triple in out.items():
        assert triple == analysis.fit_slope(t, seeds, level=0.95, window=(lo, hi))
        assert triple[0] == pytest.approx(3.1, rel=1e-9) and triple[1] < 3.1 < triple[2]
    assert analysis.decade_slopes(t, seeds, level=0.5)[(1.0, 10.0)] == analysis.fit_slope(t, seeds, level=0.5,
                                                                                        window=(1, 10))
    late = analysis.decade_slopes(t[t >= 5], np.sqrt(t[t >= 5]))                   # starts inside the first decade
    assert list(late) == [(10.0, 100.0), (100.0, 1000.0), (1000.0, 10000.0)]
    assert np.all(np.diff([v[0] for v in late.values()]) > 0)


def _growth_rule(t, r, decades=2.0):
    """growth's documented rule, step by step from fit_slope / fit_exponent on explicit windows."""
    t, r = np.asarray(t, dtype=float), np.atleast_2d(r)
    lo, top = t.max() / 10 ** decades, t.max()
    window = (t >= lo * (1 - 1e-12)) & (t <= top * (1 + 1e-12))
    mean = r[:, window].mean(0)
    exponent = analysis.fit_exponent(t, r, window=(lo, top))
    early = analysis.fit_slope(t, r.mean(0), window=(lo, top / 10))[0]
    late = analysis.fit_slope(t, r.mean(0), window=(top / 10, top))[0]
    if abs(mean[-1] - mean[0]) <= 1e-6 * (1 + abs(mean[-1])) or (
            early > 0 and late < early / 4 and exponent[2] < 0.05):
        return "bounded"
    return "power" if exponent[1] > analysis.POWER_EXPONENT else "logarithmic"


def test_growth_rule_at_its_boundaries():
    """Curves built to sit on each side of growth's thresholds: the flat test |R_end - R_start| <= 1e-6 (1 +
    |R_end|) over the window's two ends, exactly at and just past it; a large offset (exponent under 0.05
    but the slope does not fall: logarithmic); the slope falling by more and by less than 4x on the last
    decade (R = 1000 + ln t, then slope 0.2 or 0.3); a curve that saturates with an exponent above 0.05;
    and two seeds with exponents 0.2 and 0.5, whose lower bound is under 0.3 (logarithmic)."""
    t = analysis.log_grid(10_000)
    w = t >= 100
    spike = np.where(w, 0.0, 3.0)
    spike[np.flatnonzero(w)[0]], spike[-1] = 1000.0 - 5e-4, 1000.0        # the ends agree to 5e-7; inside: 0
    assert analysis.growth(t, spike)[0] == "bounded"
    at_edge = -1e-6 * np.log(10_000 / t) / np.log(100)                       # -1e-6 at t = 100, 0 at the end
    assert at_edge[w][0] == -1e-6 and analysis.growth(t, at_edge)[0] == "bounded"
    assert analysis.growth(t, 1.5 * at_edge)[0] == "logarithmic"               # 1.5e-6 > 1e-6 (1 + 0)
    assert analysis.growth(t, 1000.0 + 0.3 * np.log(t))[0] == "logarithmic"   # exponent ~3e-4, yet growing
    for late, label in ((0.2, "bounded"), (0.3, "logarithmic")):
        kinked = 1000.0 + np.log(np.minimum(t, 1000)) + late * np.log(np.maximum(t, 1000) / 1000)
        assert analysis.growth(t, kinked)[0] == label
    dense = np.arange(1, 10_001)                              # flat below 100: the early window starts at 100
    hinge = 1000.0 + np.log(np.clip(dense, 100, 1000) / 100) + 0.249 * np.log(np.maximum(dense, 1000) / 1000)
    assert analysis.growth(dense, hinge)[0] == "bounded"      # 0.249 < 1 / 4 (from 83: slope 0.992 / 4 < 0.249)
    saturating = np.sqrt(np.minimum(t, 1000))
    assert analysis.growth(t, saturating)[0] == "logarithmic" and analysis.growth(t, saturating)[2][2] > 0.05
    two = np.stack([t ** 0.2, t ** 0.5])
    _, _, (p, p_lo, p_hi) = analysis.growth(t, two)
    assert p == pytest.approx(0.35) and p_lo < 0.3 < p_hi and analysis.growth(t, two)[0] == "logarithmic"
    _, _, exponent = analysis.growth(t, np.sqrt(t) + 10.0, decades=3.0)
    assert exponent == analysis.fit_exponent(t, np.sqrt(t) + 10.0, window=(10, 10_000))


def test_growth_follows_its_rule_on_random_curves_on_a_dense_grid():
    """On a dense grid (every round 1..10^4) and random curves mixing a constant, c ln t, a power and a
    kink, growth's label is its documented rule (windows [t_max / 100, t_max / 10] and [t_max / 10, t_max]);
    every label occurs, and many curves sit near the 4x and exponent thresholds."""
    rng = np.random.default_rng(0)
    t = np.arange(1, 10_001)
    labels = []
    for _ in range(150):
        a, b, p = rng.uniform(0, 1000), rng.uniform(0, 2), rng.uniform(0, 0.8)
        kink, after = 10 ** rng.uniform(2.5, 3.5), rng.uniform(0, 0.4)
        r = a + b * np.log(np.minimum(t, kink)) + after * b * np.log(np.maximum(t, kink) / kink) \
            + rng.uniform(0, 1) * t ** p * (rng.uniform() < 0.5)
        labels.append(analysis.growth(t, r)[0])
        assert labels[-1] == _growth_rule(t, r), (a, b, p, kink, after)
    assert set(labels) == {"bounded", "logarithmic", "power"}


def test_decade_slopes_skip_a_first_decade_the_grid_starts_inside():
    t = analysis.log_grid(10_000)
    assert list(analysis.decade_slopes(t[t >= 15], np.log(t[t >= 15]))) == [(100.0, 1000.0), (1000.0, 10000.0)]
    assert list(analysis.decade_slopes(t[t >= 10], np.log(t[t >= 10])))[0] == (10.0, 100.0)


def test_a_condition_with_too_few_failing_units_is_not_stated():
    """The minimum per side binds on the failing side too: 39 of 40 holding (one failure, p = 2/40 = 0.05)
    is 'mixed', as 1 of 40 is."""
    table = verdicts.decide_draws([0.001] * 39 + [0.5], 0.01)
    assert verdicts.draw_verdict(table, {"p": np.arange(40, 0, -1.0)})[:3] == ("mixed", 40, 39)
    assert verdicts.draw_verdict(table, {"p": np.arange(40, 0, -1.0)}, min_side=1)[0] == \
        "reproduces under stated conditions"


def test_median_lower_bound_at_a_dyadic_level_and_its_refusals():
    """At level 1 - 2^-5 with 5 values the smallest is a bound exactly at the level (P(all above) = 2^-5 =
    1 - level: "at most" includes it), confidence 31/32; a level of 0 or a missing value is refused by name."""
    assert verdicts.median_lower_bound([5.0, 1.0, 3.0, 2.0, 4.0], level=1 - 2 ** -5) == (1.0, 1, 31 / 32)
    assert math.isnan(verdicts.median_lower_bound([5.0, 1.0, 3.0, 2.0, 4.0], level=0.97)[0])
    with pytest.raises(ValueError, match=r"^level = 0 must lie in \(0, 1\)$"):
        verdicts.median_lower_bound([1.0, 2.0], level=0)
    with pytest.raises(ValueError, match=r"^values must be a 1-d array of numbers without NaN$"):
        verdicts.median_lower_bound([1.0, None, 3.0])


def test_a_property_with_missing_values_is_skipped_not_fatal():
    """A property read from an object column with None where a value is missing is skipped, as one with
    NaN, by separating_condition and separation_p (the next property decides)."""
    held = np.array([True, True, True, False, False, False, False, False])
    props = {"gap": [1.0, None, 0.8, 0.5, 0.4, 0.3, 0.2, 0.1], "sep": [1.0, 0.9, 0.8, 0.5, 0.4, 0.3, 0.2, 0.1]}
    assert verdicts.separating_condition(held, props) == "sep > 0.65"
    assert verdicts.separation_p(held, props) == pytest.approx(2 / 56)


def _tost_power_by_quadrature(sd, margin, n, alpha=0.05):
    """TOST's power at a true effect of 0 by adaptive quadrature over s = the sample s.d. / sd (V = (n - 1)
    s^2 ~ chi2(n - 1)), independent of tost_power's normal-score Gauss-Legendre rule."""
    from scipy import stats
    from scipy.integrate import quad
    df = n - 1
    t = stats.t.ppf(1 - alpha, df)
    se = sd / math.sqrt(n)
    edge = (margin / (t * se)) ** 2 * df                     # V beyond which |mean| < margin - t s.e. is empty
    f = lambda v: max(0.0, 2 * stats.norm.cdf((margin - t * se * math.sqrt(v / df)) / se) - 1) \
        * stats.chi2.pdf(v, df)                                                            # noqa: E731
    return quad(f, 0, edge, limit=500, epsabs=1e-12, epsrel=1e-10)[0]


@pytest.mark.parametrize("sd, margin, n", [(1.0, 0.5, 30), (1.0, 1.0, 5), (0.3, 0.2, 8), (2.0, 0.5, 200),
                                           (1.0, 3.0, 3), (0.5, 0.1, 40)])
def test_tost_power_equals_adaptive_quadrature(sd, margin, n):
    """tost_power against an independent integral (to 1e-7: its 96-node rule is stated at 1e-8), at designs
    with powers from near 0 to near 1, where the upper end of the integral (chi2's quantile at
    df (d / t)^2) sits at different places; alpha is the one given."""
    assert verdicts.tost_power(sd, margin, n) == pytest.approx(_tost_power_by_quadrature(sd, margin, n), abs=1e-7)
    assert verdicts.tost_power(sd, margin, n, alpha=0.1) == \
        pytest.approx(_tost_power_by_quadrature(sd, margin, n, alpha=0.1), abs=1e-7)


def test_tost_power_never_exceeds_one_and_its_inverses_keep_alpha_and_refuse_by_name():
    """Where the power is 1 to rounding the quadrature sums to a few ulps above 1: the power is clamped.
    tost_se_for_power and tost_clusters_for_power pass alpha on (their answers are the designs at which
    tost_power at that alpha is the target, to 1e-9 at a margin of 1e-6 as of 1), and refuse bad input
    by their own messages."""
    powers = [verdicts.tost_power(sd, m, n) for sd in (0.01, 0.1, 0.5, 1.0, 2.0) for m in (0.05, 0.2, 1.0, 3.0)
              for n in (2, 3, 4, 8, 30, 200)]
    assert max(powers) <= 1.0 and max(powers) > 1 - 1e-12
    for margin in (1e-6, 1.0, 1e3):
        se = verdicts.tost_se_for_power(margin, 10, alpha=0.1)
        assert verdicts.tost_power(se * math.sqrt(10), margin, 10, alpha=0.1) == pytest.approx(0.8, abs=1e-9)
        assert se != pytest.approx(verdicts.tost_se_for_power(margin, 10), rel=1e-3)
    n = verdicts.tost_clusters_for_power(1.0, 0.5, alpha=0.1)
    assert verdicts.tost_power(1.0, 0.5, n, alpha=0.1) >= 0.8 > verdicts.tost_power(1.0, 0.5, n - 1, alpha=0.1)
    assert n < verdicts.tost_clusters_for_power(1.0, 0.5)
    for kw in (dict(margin=0.0, n=5), dict(margin=1.0, n=1), dict(margin=1.0, n=5, power_target=0.0),
               dict(margin=1.0, n=5, power_target=1.0), dict(margin=1.0, n=5, power_target=1.5)):
        with pytest.raises(ValueError, match=r"must be > 0, n = .* >= 2 and power_target in \(0, 1\)$"):
            verdicts.tost_se_for_power(**kw)
    for sd in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match=r"^sd = .* must be a finite number > 0$"):
            verdicts.tost_clusters_for_power(sd, 0.5)
    for sd, margin in ((0.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError, match=r"must be > 0 and n = 5 >= 2$"):
            verdicts.tost_power(sd, margin, 5)
