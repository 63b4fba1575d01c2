"""sims/forgetting.py end to end: the quick run, determinism, resume, figures, bad arguments."""

import numpy as np
import pandas as pd
import pytest

from aggregation import examples
from conftest import assert_usage_error, run_script
from distillation import tasks


# ------------------------------------------------------------------------------------------------
# sims/forgetting.py end to end
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_forgetting(quick_run):
    return quick_run("forgetting")


@pytest.mark.integration
def test_forgetting_quick_end_to_end(quick_forgetting):
    from sims import forgetting
    out = quick_forgetting
    for name in ("loglinear.csv", "neural.csv", "precision.csv", "shares.csv", "verdicts.csv", "figures/forgetting.png",
                 "figures/forgetting_shares.png"):
        assert (out / name).exists(), name
    ll = pd.read_csv(out / "loglinear.csv")
    pairs = forgetting.SIZES["pairs"][1]                             # every cell of the grid on every task pair
    assert sorted(ll.pair.unique()) == list(range(pairs))
    assert len(ll) == pairs * len(forgetting.grid(forgetting.QUICK)) * forgetting.SIZES["loglinear_seeds"][1]
    by_lr = ll.groupby("lr").forgetting.mean()
    assert by_lr.iloc[-1] > 10 * by_lr.iloc[0] > 0                  # a larger learning rate forgets more
    bf16 = ll[ll.storage == "bf16"]
    assert (bf16.sparsity_bf16 <= bf16.sparsity + 1e-12).all()
    shares = pd.read_csv(out / "shares.csv")
    sums = shares.groupby(["student", "outcome"]).share.sum()
    assert np.allclose(sums, 1.0, atol=1e-9)
    top = shares[shares.term != "higher order"].sort_values("share").groupby(["student", "outcome"]).tail(1)
    assert (top[top.outcome == "forgetting"].term == "lr").all()
    from analysis.verdicts import QUICK
    v = pd.read_csv(out / "verdicts.csv")
    assert len(v) > 0 and (v.verdict == QUICK).all()                # a quick run decides nothing


@pytest.mark.integration
def test_forgetting_is_deterministic_and_resumes(quick_forgetting, tmp_path):
    run_script("sims/forgetting.py", "--quick", "--only", "loglinear", "--out", tmp_path, "--quiet", "--no-figures")
    assert (tmp_path / "loglinear.csv").read_bytes() == (quick_forgetting / "loglinear.csv").read_bytes()
    proc = run_script("sims/forgetting.py", "--quick", "--out", quick_forgetting, "--resume", "--no-figures")
    assert "resumed)" in proc.stderr and "(0 resumed)" not in proc.stderr


@pytest.mark.integration
def test_forgetting_figures_read_the_csvs(quick_forgetting):
    from figures import forgetting as ff
    figs = ff.figures_from(str(quick_forgetting))
    assert set(figs) == {"forgetting", "forgetting_shares"}
    a = figs["forgetting"].axes[0]
    ll = pd.read_csv(quick_forgetting / "loglinear.csv")
    x, y = a.get_lines()[0].get_data()
    expected = ll[ll.alpha == ll.alpha.min()].groupby("lr").forgetting.mean()
    np.testing.assert_allclose(x, expected.index)
    np.testing.assert_allclose(y, np.maximum(expected.to_numpy(), 1e-6))
    panels = figs["forgetting_shares"].axes[:4]
    assert [ax.get_title() for ax in panels] == list(ff.OUTCOME_LABELS.values())
    precision = pd.read_csv(quick_forgetting / "precision.csv")               # sparsity: every storage, the served copy
    d = figs["forgetting"].axes[2]
    master = precision[precision.storage == "bf16-master"].groupby("lr")
    for column in ("sparsity", "sparsity_bf16"):
        assert any(np.allclose(line.get_ydata(), master[column].mean().to_numpy()) for line in d.get_lines())
    assert len(d.get_lines()) == len(ff.STORAGE_STYLES)


@pytest.mark.integration
def test_forgetting_figure_draws_each_objectives_frontier_for_both_students(quick_forgetting):
    """E3's frontier per objective (issue 29): a panel per student, a step line per (objective, alpha 0 / 1),
    each the running minimum of forgetting over that objective's own quality."""
    from analysis import lower_frontier
    from figures import forgetting as ff
    fig = ff.figures_from(str(quick_forgetting))["forgetting"]
    for ax, name in ((fig.axes[3], "loglinear"), (fig.axes[4], "neural")):
        df = pd.read_csv(quick_forgetting / f"{name}.csv")
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {f"{o.upper()}, alpha = {a}" for o in set(df.objective) for a in (0, 1)}
        keys = ["lr", "schedule", "warmup", "alpha", "objective", "clip", "storage"]
        pts = df.groupby(keys, as_index=False)[["forgetting", "quality"]].mean()
        own = pts[(pts.objective == "fkl") & (pts.alpha == 1)]
        q, best = lower_frontier(np.maximum(own.quality, ff.FLOOR), np.maximum(own.forgetting, ff.FLOOR))
        x, y = lines["FKL, alpha = 1"].get_data()
        np.testing.assert_allclose(x, q)
        np.testing.assert_allclose(y, best)


@pytest.mark.parametrize("bad", [["--seeds", "0"], ["--only", "nope"], ["--full"], ["--executor", "mpi"]])
def test_forgetting_bad_arguments_exit_2_with_one_line(bad, tmp_path):
    proc = run_script("sims/forgetting.py", *bad, "--quick", "--out", tmp_path, check=False, timeout=60)
    assert_usage_error(proc)


def test_make_pair_rejects_trees_of_different_shapes(monkeypatch):
    real = tasks.make_task

    def other_shape(kind, K, seed):
        task = real(kind, K=K, seed=seed)
        if K == 2:
            base = examples.prefix_tree(K, 2, 3, seed=seed, concentration=0.5)
            return tasks.Task(base, task.weights, 2)
        return task
    monkeypatch.setattr(tasks, "make_task", other_shape)
    with pytest.raises(ValueError, match="shape"):
        tasks.make_pair(0)


def test_e3_verdicts_compare_the_full_design_with_the_rates_that_learn_b():
    """A synthetic balanced design: forgetting = lr at the two rates that do not learn B (a decade per
    level) and 0.05 (1 + 4 alpha) at the two that do (quality below LEARNED only there). The learning rate
    governs the full design; among the rates that learn B, alpha does."""
    from sims import forgetting
    rows = []
    rng = np.random.default_rng(0)
    for seed in range(3):
        for lr in (1e-4, 1e-3, 1e-2, 1e-1):
            for alpha in (0.0, 1.0):
                for objective in ("fkl", "rkl"):
                    learned = lr >= 1e-2
                    f = (0.05 * (1.0 + 4.0 * alpha) if learned else lr) * (1 + 0.01 * rng.normal())
                    rows.append(dict(lr=lr, schedule="constant", warmup=False, alpha=alpha, objective=objective,
                                     clip=False, storage="float32", pair=seed, seed=0, forgetting=f,
                                     quality=0.001 if learned else 0.2, sparsity=0.5, sparsity_bf16=0.5))
    v = pd.DataFrame(forgetting.verdicts(pd.DataFrame(rows), "loglinear")).set_index(["claim", "condition"]).verdict
    assert forgetting.learning_rates_that_learn(pd.DataFrame(rows)) == [1e-2, 1e-1]
    lr_claim = "E3 the learning rate governs forgetting (share >= 0.5)"
    alpha_claim = "E3 the rollouts (alpha) do not govern forgetting (share <= 0.05)"
    learned = "loglinear, learning rates that learn B (mean quality < 0.01: 0.01, 0.1)"
    assert v[(lr_claim, "loglinear, full design")] == "reproduces"
    assert v[(lr_claim, learned)] == "does not reproduce" and v[(alpha_claim, learned)] == "does not reproduce"
    at_rate = "E3 alpha leaves forgetting unchanged at a fixed learning rate (within 5%)"
    assert v[(at_rate, "loglinear, lr = 0.0001")] == "reproduces"               # alpha does nothing there
    assert v[(at_rate, "loglinear, lr = 0.1")] == "does not reproduce"          # x5 where B is learned
    ratio = pd.DataFrame(forgetting.alpha_rows(pd.DataFrame(rows), "loglinear")).set_index("condition").estimate
    assert ratio["loglinear, lr = 0.1"] == pytest.approx(5.0, rel=0.02)


def test_frontier_is_the_least_forgetting_at_or_below_each_quality():
    from sims.forgetting import frontier
    got = frontier([0.3, 0.1, 0.2, 0.05, 0.15], [1.0, 5.0, 2.0, 9.0, 0.5], [0.04, 0.05, 0.12, 0.25, 1.0])
    np.testing.assert_array_equal(got, [np.nan, 9.0, 5.0, 0.5, 0.5])        # 0.5 at 0.15 beats 2 and 1 after it


def _frontier_design(alpha1):
    """Three seeds, three learning rates: alpha = 0 runs at (quality, forgetting) (0.009, 1e-4), (0.005,
    1e-3), (0.001, 1e-2); the alpha = 1 runs at ``alpha1`` (one pair per learning rate)."""
    alpha0 = [(0.009, 1e-4), (0.005, 1e-3), (0.001, 1e-2)]
    return pd.DataFrame([dict(lr=lr, schedule="constant", warmup=False, alpha=a, objective="fkl", clip=False,
                              storage="float32", pair=seed, seed=0, quality=q, forgetting=f * (1 + 0.001 * seed),
                              sparsity=0.5, sparsity_bf16=0.5)
                         for seed in range(3) for a, pts in ((0.0, alpha0), (1.0, alpha1))
                         for lr, (q, f) in zip((1e-3, 1e-2, 1e-1), pts)])


def test_forgetting_at_equal_quality_reads_the_frontiers_not_the_learning_rates():
    """The same (quality, forgetting) points reached at other learning rates: alpha changes forgetting 10x
    at a fixed rate but not at all at equal quality; doubling every alpha = 1 forgetting doubles the
    frontier ratio."""
    from sims import forgetting
    same = _frontier_design([(0.005, 1e-3), (0.001, 1e-2), (0.009, 1e-4)])
    (row,) = forgetting.frontier_rows(same, "loglinear")
    assert row["estimate"] == pytest.approx(1.0) and row["verdict"] == "reproduces"
    at_rate = pd.DataFrame(forgetting.alpha_rows(same, "loglinear")).set_index("condition")
    assert at_rate.loc["loglinear, lr = 0.001", "estimate"] == pytest.approx(10.0, rel=1e-3)
    double = _frontier_design([(0.009, 2e-4), (0.005, 2e-3), (0.001, 2e-2)])
    (row,) = forgetting.frontier_rows(double, "loglinear")
    assert row["estimate"] == pytest.approx(2.0, rel=1e-3) and row["verdict"] == "does not reproduce"


def test_the_frontier_is_read_per_objective_each_against_its_own_target():
    """FKL runs whose alpha = 1 frontier equals alpha = 0's and RKL runs whose alpha = 1 forgetting is
    doubled and whose qualities (KL to another target) are 10x smaller: one row per objective, 1 and 2;
    pooled, the RKL runs' small KLs would set the whole frontier."""
    from sims import forgetting
    fkl = _frontier_design([(0.005, 1e-3), (0.001, 1e-2), (0.009, 1e-4)])
    rkl = _frontier_design([(0.009, 2e-4), (0.005, 2e-3), (0.001, 2e-2)]).assign(
        objective="rkl", quality=lambda d: d.quality / 10)
    rows = pd.DataFrame(forgetting.frontier_rows(pd.concat([fkl, rkl], ignore_index=True), "neural"))
    assert list(rows.condition.str.split(",").str[1].str.strip()) == ["FKL", "RKL"]
    assert rows.estimate.to_numpy() == pytest.approx([1.0, 2.0], rel=1e-3)
    assert list(rows.verdict) == ["reproduces", "does not reproduce"]
    assert rows.condition.str.contains("KL to the FKL target").iloc[0]


def test_precision_rows_read_each_storage_and_the_served_copy():
    """float32 moves the same share at every rate; bf16 storage moves 0.1 at the lowest rate and 0.6 at
    the highest; mixed precision's master moves like float32 and its served copy like bf16 storage."""
    from sims import forgetting
    rows = []
    for seed in range(3):
        for lr in (1e-4, 1e-1):
            low = lr == 1e-4
            for storage, sparsity, served in (("float32", 0.6, 0.6), ("bf16", 0.1 if low else 0.6, 0.1 if low else 0.6),
                                              ("bf16-master", 0.6, 0.1 if low else 0.6)):
                rows.append(dict(lr=lr, storage=storage, pair=seed, seed=0, alpha=0.0, sparsity=sparsity + 0.01 * seed,
                                 sparsity_bf16=served + 0.01 * seed))
    v = pd.DataFrame(forgetting.precision_rows(pd.DataFrame(rows))).set_index("condition")
    assert v.loc["loglinear, float32", "verdict"] == "does not reproduce"
    assert v.loc["loglinear, bf16 storage (no master weights)", "estimate"] == pytest.approx(0.5)
    assert v.loc["loglinear, bf16 storage (no master weights)", "verdict"] == "reproduces"
    assert v.loc["loglinear, mixed precision: the float32 master weights", "verdict"] == "does not reproduce"
    assert v.loc["loglinear, mixed precision: the bf16 copy it serves", "verdict"] == "reproduces"


# ------------------------------------------------------------------------------------------------
# the verdict helpers on hand-built tables (issues 28, 29: mutation testing)
# ------------------------------------------------------------------------------------------------
def _committed_rows(student):
    """The rows of the committed default run (docs/verdicts/forgetting.csv, from which the docs are
    generated) for ``student``, in their order."""
    from conftest import ROOT
    doc = pd.read_csv(ROOT / "docs" / "verdicts" / "forgetting.csv")
    return doc[doc.condition.str.startswith(f"{student}, ")].reset_index(drop=True)


def _masked(statistic):
    """A statistic with its data-dependent two-decimal means (the sparsity at each rate) masked."""
    import re
    return re.sub(r"\b\d+\.\d\d\b", "#", statistic)


def _default_design(seeds=8):
    """The default loglinear design's learning rates, alpha at 0 and 1 and the three objectives (in
    FACTORS' order), the other factors fixed; quality on B falls with the learning rate, its mean below
    LEARNED at 0.1 only (as in the committed run over 8 task pairs), and the gamma = 1 policy gradient never
    reaches it on the last pair (7 of 8 pairs on its frontier); forgetting grows with the rate. Every number
    is made up: only the texts are compared."""
    from sims import forgetting
    rng = np.random.default_rng(1)
    quality = dict(zip(forgetting.FACTORS["lr"], (0.5, 0.2, 0.05, 0.02, 0.001)))
    return pd.DataFrame([dict(lr=lr, schedule="constant", warmup=False, alpha=alpha, objective=objective, clip=False,
                              storage="float32", pair=seed, seed=0,
                              quality=quality[lr] * (1 + 0.1 * rng.random()) * (100 if (objective, seed) == ("pg1", 7)
                                                                                  else 1),
                              forgetting=lr * (1 + 0.1 * alpha) * (1 + 0.05 * rng.random()), sparsity=0.5,
                              sparsity_bf16=0.5)
                         for seed in range(seeds) for lr in forgetting.FACTORS["lr"] for alpha in (0.0, 1.0)
                         for objective in forgetting.FACTORS["objective"]])


def test_e3_verdict_rows_state_the_committed_claims_conditions_statistics_and_rules():
    """On the default design's factors over eight task pairs (one seed each), verdicts() writes the rows of the committed run,
    in its order (objectives as the design lists them, FKL, RKL, PG1), with its claim, condition,
    statistic and rule texts word for word."""
    from sims import forgetting
    got = pd.DataFrame(forgetting.verdicts(_default_design(), "loglinear"))
    doc = _committed_rows("loglinear")
    doc = doc[~doc.statistic.str.startswith("share of parameters moved")].reset_index(drop=True)
    for column in ("claim", "condition", "statistic", "rule"):
        assert list(got[column]) == list(doc[column]), column


def test_precision_rows_state_the_committed_texts():
    """The sparsity rows: the committed claim, condition and rule texts, and its statistic up to the
    two-decimal sparsities it quotes."""
    from sims import forgetting
    rows = [dict(lr=lr, storage=storage, pair=seed, seed=0, alpha=alpha, sparsity=0.5, sparsity_bf16=0.4)
            for seed in range(8) for lr in (1e-4, 1e-1) for alpha in (0.0, 1.0)
            for storage in ("float32", "bf16", "bf16-master")]
    got = pd.DataFrame(forgetting.precision_rows(pd.DataFrame(rows)))
    doc = _committed_rows("loglinear")
    doc = doc[doc.statistic.str.startswith("share of parameters moved")].reset_index(drop=True)
    for column in ("claim", "condition", "rule"):
        assert list(got[column]) == list(doc[column]), column
    assert list(got.statistic.map(_masked)) == list(doc.statistic.map(_masked))


def test_e3_verdicts_skip_what_the_design_does_not_vary():
    """alpha fixed at 1: no share row for alpha (it is not a factor of the design) and no alpha-ratio or
    frontier rows (they need runs at alpha = 0 and at alpha = 1)."""
    from sims import forgetting
    df = _default_design()
    rows = forgetting.verdicts(df[df.alpha == 1.0], "loglinear")
    assert {r["claim"] for r in rows} == {"E3 the learning rate governs forgetting (share >= 0.5)"}
    assert len(rows) == 2                                           # the full design and the rates that learn B
    # one learning rate: no share row for lr, and the alpha share row after it is still written
    one = forgetting.verdicts(df[df.lr == forgetting.FACTORS["lr"][-1]], "loglinear")
    alpha_share = "E3 the rollouts (alpha) do not govern forgetting (share <= 0.05)"
    assert [r["claim"] for r in one if r["statistic"].startswith("share of the variance")] == [alpha_share]


def test_shares_read_log10_outcomes_on_the_log_scale_and_fractions_as_they_are():
    """A 2 x 2 design over lr (i = 0, 1) and alpha (j = 0, 1): forgetting = 10^(i + j) and quality =
    10^-(2 + i + 2j) are additive in log10 (shares 1/2, 1/2 and 1/5, 4/5, no interaction); sparsity
    = 0.1 + 0.2 i + 0.4 j is additive as it is (1/5, 4/5). Only the varied factors are terms; each row is
    labelled with its student, outcome and scale; one index over all outcomes."""
    from sims import forgetting
    rows = [dict(lr=lr, schedule="constant", warmup=False, alpha=alpha, objective="fkl", clip=False,
                 storage="float32", pair=seed, seed=0, forgetting=10.0 ** (i + j), quality=10.0 ** -(2 + i + 2 * j),
                 sparsity=0.1 + 0.2 * i + 0.4 * j, sparsity_bf16=0.1 + 0.3 * i + 0.3 * j)
            for seed in range(2) for i, lr in enumerate((1e-3, 1e-1)) for j, alpha in enumerate((0.0, 1.0))]
    table = forgetting.shares(pd.DataFrame(rows), forgetting.FACTORS, "neural")
    assert list(table.index) == list(range(len(table)))
    assert (table.student == "neural").all()
    assert dict(zip(table.outcome, table.scale)) == forgetting.OUTCOMES
    assert set(table.term) == {"lr", "alpha", "lr x alpha", "higher order"}
    share = table.set_index(["outcome", "term"]).share
    expected = {"forgetting": (0.5, 0.5), "quality": (0.2, 0.8), "sparsity": (0.2, 0.8), "sparsity_bf16": (0.5, 0.5)}
    for outcome, (lr, alpha) in expected.items():
        assert share[(outcome, "lr")] == pytest.approx(lr, abs=1e-12), outcome
        assert share[(outcome, "alpha")] == pytest.approx(alpha, abs=1e-12), outcome
        assert share[(outcome, "lr x alpha")] == pytest.approx(0.0, abs=1e-12), outcome


def test_learning_rates_that_learn_b_have_mean_quality_strictly_below_learned():
    from sims import forgetting
    df = pd.DataFrame(dict(lr=[1e-3, 1e-3, 1e-2, 1e-2, 1e-1], quality=[0.01, 0.01, 0.001, 0.003, 0.5]))
    assert forgetting.learning_rates_that_learn(df) == [1e-2]           # a mean of exactly LEARNED does not learn


def test_learning_rates_that_learn_b_use_the_mean_not_the_median():
    """A rate whose runs mostly learn B (quality 0.001) but one of three fails (0.1): mean 0.034 >= 0.01, median
    0.001: it does not learn B by the stated rule (mean quality < LEARNED)."""
    from sims import forgetting
    df = pd.DataFrame(dict(lr=[1e-2] * 3 + [1e-1] * 3, quality=[0.001, 0.001, 0.1, 0.001, 0.002, 0.003]))
    assert forgetting.learning_rates_that_learn(df) == [1e-1]


def test_e3_rows_among_the_rates_that_learn_b_are_written_when_fewer_than_two_do():
    """Only the highest rate learns B (mean quality < 0.01): no design among the rates that learn B, and its
    two share rows say so (inconclusive, no estimate) instead of vanishing."""
    from sims import forgetting
    df = _default_design()
    df.loc[df.lr == forgetting.FACTORS["lr"][-2], "quality"] = 0.05
    assert forgetting.learning_rates_that_learn(df) == [forgetting.FACTORS["lr"][-1]]
    rows = pd.DataFrame(forgetting.verdicts(df, "loglinear"))
    among = rows[rows.condition == "loglinear, learning rates that learn B (mean quality < 0.01: 0.1)"]
    assert list(among.claim) == [c for _, c, _, _ in forgetting.E3_SHARES]
    assert (among.verdict == "inconclusive").all() and among.estimate.isna().all()
    assert among.statistic.str.startswith("no share: fewer than 2 learning rates learn B (over 8 task pairs)").all()
    df.loc[:, "quality"] = 0.05                                          # no rate learns B: the rows say "none"
    rows = pd.DataFrame(forgetting.verdicts(df, "loglinear"))
    assert (rows.condition == "loglinear, learning rates that learn B (mean quality < 0.01: none)").sum() == 2


def _ratio(log_ratios, margin):
    from sims import forgetting
    return forgetting.ratio_row("claim", "condition", "stat", log_ratios, margin)


def test_ratio_row_maps_the_seed_interval_of_log_ratios_to_a_verdict():
    """Two seeds (the fewest with an interval); the interval [exp lo, exp hi] of the mean log ratio
    (scipy's t-interval, 1 df) within 1 +- margin, ends included: reproduces; wholly outside: does not;
    across either end, or one seed: inconclusive."""
    from scipy import stats
    tight = _ratio([0.001, -0.001], 0.05)
    lo, hi = stats.t.interval(0.95, 1, loc=0.0, scale=stats.sem([0.001, -0.001]))
    assert (tight["estimate"], tight["lo"], tight["hi"]) == pytest.approx((1.0, np.exp(lo), np.exp(hi)), rel=1e-12)
    assert tight["verdict"] == "reproduces"
    assert tight["statistic"] == "stat over 2 task pairs, 95% t-interval"
    assert tight["rule"] == "interval within 1 +- 0.05: reproduces; outside it: does not; else inconclusive"
    assert _ratio([0.0], 0.05)["verdict"] == "inconclusive"                       # one seed: no interval
    assert _ratio([np.log(1.3), np.log(1.31)], 0.05)["verdict"] == "does not reproduce"
    assert _ratio([np.log(0.7), np.log(0.71)], 0.05)["verdict"] == "does not reproduce"
    low = _ratio(np.log([0.93, 0.95, 0.97, 0.99]), 0.05)                           # across 1 - margin only
    assert low["lo"] < 0.95 < low["hi"] < 1.05 and low["verdict"] == "inconclusive"
    high = _ratio(np.log([1.01, 1.03, 1.05, 1.07]), 0.05)                          # across 1 + margin only
    assert 0.95 < high["lo"] < 1.05 < high["hi"] and high["verdict"] == "inconclusive"


def test_ratio_row_includes_the_ends_of_1_pm_margin():
    """An interval ending exactly at 1 - margin or 1 + margin: inside (reproduces) when it is a point
    there, and only touching (inconclusive, not 'does not reproduce') when it reaches beyond the other
    way. 1 - (1 - x) == x exactly for x in [0.5, 2], so the margins are exact."""
    below = _ratio([np.log(0.8)] * 2, 0.05)["lo"]
    assert _ratio([np.log(0.8)] * 2, 1 - below)["verdict"] == "reproduces"
    above = _ratio([np.log(1.2)] * 2, 0.05)["hi"]
    assert _ratio([np.log(1.2)] * 2, above - 1)["verdict"] == "reproduces"
    wide = np.log([0.70, 0.72, 0.74, 0.76])
    wide_below = _ratio(wide, 0.05)
    assert wide_below["lo"] < wide_below["hi"] < 1
    assert _ratio(wide, 1 - wide_below["hi"])["verdict"] == "inconclusive"
    wide = np.log([1.20, 1.22, 1.24, 1.26])
    wide_above = _ratio(wide, 0.05)
    assert 1 < wide_above["lo"] < wide_above["hi"]
    assert _ratio(wide, wide_above["lo"] - 1)["verdict"] == "inconclusive"


def _step_frontiers(alpha1):
    """Two seeds, one objective: alpha = 0 one run at (quality 0.001, forgetting 1); alpha = 1 the runs
    ``alpha1`` (quality, forgetting)."""
    return pd.DataFrame([dict(lr=0.1, schedule="constant", warmup=False, alpha=a, objective="fkl", clip=False,
                              storage="float32", pair=seed, seed=0, quality=q, forgetting=f)
                         for seed in range(2) for a, runs in ((0.0, [(0.001, 1.0)]), (1.0, alpha1))
                         for q, f in runs])


def test_frontier_ratio_is_read_at_nine_log_spaced_qualities_up_to_learned():
    """The alpha = 1 frontier halves at quality 10^(-3 + 7.5/8), between the last two of the nine points
    10^(-3 + k/8), k = 0..8, of geomspace(0.001, LEARNED = 0.01, 9): the geometric mean ratio is
    0.5^(1/9). The best quality both reach at exactly LEARNED: no quality to compare at, a row without an
    estimate (inconclusive), so that whether the row exists never depends on the run."""
    from sims import forgetting
    (row,) = forgetting.frontier_rows(_step_frontiers([(0.001, 1.0), (10 ** (-3 + 7.5 / 8), 0.5)]), "loglinear")
    assert row["estimate"] == pytest.approx(0.5 ** (1 / 9), rel=1e-9)
    (none,) = forgetting.frontier_rows(_step_frontiers([(0.01, 1.0)]), "loglinear")
    assert np.isnan(none["estimate"]) and none["verdict"] == "inconclusive"
    assert "0 of 2 task pairs reach quality < 0.01 at both alphas: no frontier to compare" in none["statistic"]
    assert (none["claim"], none["condition"]) == (row["claim"], row["condition"])    # the same row, undecided
    assert none["rule"] == "interval within 1 +- 0.05: reproduces; outside it: does not; else inconclusive"
    # pair 0 never learns (its best quality both reach is at LEARNED): skipped, the pairs after it still read
    mixed = _step_frontiers([(0.001, 1.0), (10 ** (-3 + 7.5 / 8), 0.5)])
    mixed = pd.concat([mixed[mixed.pair == 0].assign(quality=0.02), mixed.assign(pair=mixed.pair + 1)])
    (row,) = forgetting.frontier_rows(mixed, "loglinear")
    assert row["estimate"] == pytest.approx(0.5 ** (1 / 9), rel=1e-9) and "over 2 task pairs" in row["statistic"]
    assert "2 of 3 task pairs reach quality < 0.01" in row["statistic"]
    # two seeds of one pair: their log ratios are averaged, one cluster (no interval)
    two = _step_frontiers([(0.001, 1.0), (10 ** (-3 + 7.5 / 8), 0.5)]).assign(pair=0)
    two = pd.concat([two.query("seed == 0"), two.query("seed == 0").assign(seed=1, forgetting=lambda d: d.forgetting
                                                                            * np.where(d.alpha == 1.0, 0.5, 1.0))])
    (row,) = forgetting.frontier_rows(two, "loglinear")
    assert row["estimate"] == pytest.approx(np.sqrt(0.5 ** (1 / 9) * 0.5 ** (10 / 9)), rel=1e-9)
    assert row["verdict"] == "inconclusive" and "over 1 task pairs" in row["statistic"]
