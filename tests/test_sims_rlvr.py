"""sims/rlvr.py: the E4 and E6 tables on synthetic curves with known answers, and the script end to end."""

import itertools
import pathlib
import re

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis import verdicts
from conftest import assert_usage_error, run_script


# ------------------------------------------------------------------------------------------------
# the E4 and E6 tables on synthetic curves with known answers
# ------------------------------------------------------------------------------------------------
def _synthetic_curves(edge_distil, edge_rl, n=12, tasks=2, noise_sd=0.005, rl_noise_sd=None,
                      conditions=("shared", "unshared")):
    rng = np.random.default_rng(0)
    rows = []
    for condition in conditions:
        for task_id, seed in itertools.product(range(tasks), range(n // tasks)):
            base = 0.3 + 0.1 * rng.normal(size=2)
            for method in ("offline FKL", "on-policy FKL", "offline RKL", "on-policy RKL"):
                on = method.startswith("on")
                noise = np.array([noise_sd, noise_sd if rl_noise_sd is None else rl_noise_sd]) * rng.normal(size=2)
                for stage, b, edge, e in (("distil", base[0], edge_distil, noise[0]), ("rl", base[1], edge_rl, noise[1])):
                    rows.append(dict(student="loglinear", condition=condition, task=task_id, method=method, seed=seed,
                                     stage=stage, step=10, ood_accuracy=b + (edge if on else 0.0) + e, id_accuracy=0.5))
    return pd.DataFrame(rows)


@pytest.mark.parametrize("edge_distil, edge_rl, verdict", [
    (0.1, 0.0, "edge does not survive RL (after RL: includes 0)"),
    (0.1, 0.05, "edge survives RL"),
    (0.0, 0.1, "no edge after distillation (includes 0)"),
    (0.1, -0.05, "edge does not survive RL (after RL: below 0)"),
])
def test_e4_table_verdicts(edge_distil, edge_rl, verdict):
    from sims import rlvr
    e4 = rlvr.e4_table(_synthetic_curves(edge_distil, edge_rl, tasks=6))
    diffs = e4[e4.comparison.str.contains(" - ")]
    assert len(diffs) == 8 and (diffs.verdict == verdict).all()
    d = diffs[diffs.stage == "distil"].ood_accuracy.to_numpy()
    np.testing.assert_allclose(d, edge_distil, atol=0.01)


@pytest.mark.parametrize("edge_rl, noise_sd, verdict", [
    (0.0, 0.005, "reproduces"),               # equivalent to 0 within the margin: the edge is gone
    (0.05, 0.005, "does not reproduce"),      # the edge survives RL
    (0.1, 0.005, "does not reproduce"),       # the whole pre-RL edge, measured precisely: not "no edge"
    (0.0, 0.2, "inconclusive"),               # too noisy to tell: report the MDE
])
def test_e4_verdicts_by_rule_with_task_clusters(edge_rl, noise_sd, verdict):
    from sims import rlvr
    v = rlvr.verdicts(_synthetic_curves(0.1, edge_rl, n=12, tasks=6, rl_noise_sd=noise_sd))
    edge, survive = v[v.claim.str.contains("exists")], v[v.claim.str.contains("survive")]
    assert len(edge) == len(survive) == 4 and (edge.verdict == "reproduces").all()
    assert (survive.verdict == verdict).all(), survive[["condition", "estimate", "lo", "hi", "verdict"]]
    assert edge.statistic.str.contains("mean of 6 task means").all()
    assert survive.statistic.str.contains("80% power").all() and survive.statistic.str.contains("TOST p").all()
    assert (survive.df == 5).all() and (edge.df == 5).all()
    # the margin is half the measured pre-RL edge, below it, written in the column and in the rule
    np.testing.assert_allclose(survive.margin.to_numpy(), 0.5 * edge.estimate.to_numpy(), rtol=1e-12)
    assert all(f"+-{m:.2g} " in r for m, r in zip(survive.margin, survive.rule))
    # the MDE and power are the noncentral t's with 5 df, from the standard error of the 6 task means
    se = (survive.hi - survive.lo) / (2 * stats.t.ppf(0.975, 5))
    np.testing.assert_allclose(survive.mde_80, [verdicts.t_mde_80(s, 5) for s in se], rtol=1e-6)
    np.testing.assert_allclose(survive.power, [verdicts.t_power(e, s, 5) for e, s in zip(edge.estimate, se)], rtol=1e-6)


def test_e4_refuses_to_test_survival_without_a_positive_edge():
    from sims import rlvr
    v = rlvr.verdicts(_synthetic_curves(-0.05, 0.0, n=12, tasks=6))
    survive = v[v.claim.str.contains("survive")]
    assert (survive.verdict == "inconclusive").all() and survive.margin.isna().all()
    assert survive.statistic.str.contains("no positive pre-RL edge").all()
    with pytest.raises(ValueError, match="margin"):
        verdicts.check_margin(rlvr.MARGIN_SHARE * 0.02 * 2, 0.02)          # a margin equal to the edge


def test_task_clustered_interval_and_standard_error():
    from sims import rlvr
    diff = np.array([1.0, 3.0, 10.0, 10.0, 4.0, 6.0])                    # task means 2, 10, 5
    est, lo, hi, se, n = rlvr.task_clustered(diff, np.array([0, 0, 1, 1, 2, 2]))
    assert n == 3 and est == pytest.approx(17 / 3) and se == pytest.approx(np.std([2, 10, 5], ddof=1) / np.sqrt(3))
    half = stats.t.ppf(0.975, 2) * se                                      # Student-t over the 3 task means
    assert (lo, hi) == pytest.approx((est - half, est + half))


@pytest.mark.parametrize("fresh, freshness, beyond", [
    (0.1, "reproduces", "does not reproduce"),          # fresh teacher data carries the whole edge
    (0.0, "does not reproduce", "reproduces"),          # fresh data adds nothing: the edge is on-policy sampling
])
def test_the_fresh_teacher_control_splits_the_edge(fresh, freshness, beyond):
    from sims import rlvr
    curves = _synthetic_curves(0.1, 0.0, n=12, tasks=6)
    control = curves[curves.method.str.startswith("offline")].assign(
        method=lambda d: d.method.str.replace("offline", "fresh-teacher"),
        ood_accuracy=lambda d: d.ood_accuracy + np.where(d.stage == "distil", fresh, 0.0))
    v = rlvr.verdicts(pd.concat([curves, control], ignore_index=True))
    assert (v[v.claim.str.contains("data freshness")].verdict == freshness).all()
    assert (v[v.claim.str.contains("beyond fresh")].verdict == beyond).all()
    assert len(v[v.claim.str.contains("control")]) == 12
    share = v[v.claim.str.contains("share")]
    assert len(share) == 4 and (share.estimate.to_numpy() == pytest.approx(fresh / 0.1, abs=0.05))
    assert (share.verdict == freshness).all() and share.statistic.str.contains(": resolved").all()
    assert ((share.lo <= share.estimate) & (share.estimate <= share.hi)).all()


def test_the_freshness_share_is_not_resolved_when_the_edge_is_noise():
    """An edge whose t-statistic is small: the share's Fieller set is unbounded, the verdict inconclusive."""
    from sims import rlvr
    curves = _synthetic_curves(0.002, 0.0, n=12, tasks=6, noise_sd=0.05)
    control = curves[curves.method.str.startswith("offline")].assign(
        method=lambda d: d.method.str.replace("offline", "fresh-teacher"))
    v = rlvr.verdicts(pd.concat([curves, control], ignore_index=True))
    share = v[v.claim.str.contains("share")]
    assert (share.verdict == "inconclusive").all() and share.statistic.str.contains("not resolved").all()


def _e6_curves(kl_scale=(2.0, 2.0, 2.0)):
    """Three tasks, one seed each, 10 steps. Offline: 1000 teacher tokens up front, KL 1 / (1 + step), ID
    accuracy 0.5. On-policy: 50 teacher and 100 student tokens a step, KL c / (1 + step) (c = 2 never reaches
    1/11 within 10 steps; c = 0.5 crosses it between steps 4 and 5), ID accuracy 0.05 step (reaches
    0.5 - 0.001 between steps 9 and 10)."""
    rows = []
    for task, c in enumerate(kl_scale):
        for step in range(0, 11):
            rows.append(dict(student="loglinear", condition="shared", task=task, seed=0, method="offline FKL",
                             objective="fkl", stage="distil", step=step, teacher_tokens=1000, student_tokens=0,
                             kl_arithmetic=1 / (1 + step), kl_local=1.0, id_accuracy=0.5))
            rows.append(dict(student="loglinear", condition="shared", task=task, seed=0, method="on-policy FKL",
                             objective="fkl", stage="distil", step=step, teacher_tokens=50 * step,
                             student_tokens=100 * step, kl_arithmetic=c / (1 + step), kl_local=1.0,
                             id_accuracy=0.05 * step))
    return pd.DataFrame(rows)


def _log_linear_crossing(c0, c1, v0, v1, threshold):
    return float(np.exp(np.log(c0) + (v0 - threshold) / (v0 - v1) * (np.log(c1) - np.log(c0))))


def test_crossing_cost_interpolates_log_linearly_to_a_known_crossing():
    """value = 3 - 0.5 ln(cost) on log-spaced checkpoints falls to 1 at cost e^4 exactly; the first
    checkpoint below it costs more (the grid overstates the cost), and a curve that never gets there is NaN."""
    from analysis import log_grid
    from sims import rlvr
    cost = log_grid(1000).astype(float)
    value = 3 - 0.5 * np.log(cost)
    assert rlvr.crossing_cost(cost, value, 1.0) == pytest.approx(np.exp(4), rel=1e-12)
    assert cost[np.argmax(value <= 1.0)] > 1.05 * np.exp(4)
    assert np.isnan(rlvr.crossing_cost(cost, value, -1.0))
    assert rlvr.crossing_cost([0.0, 10.0, 20.0], [1.0, 0.2, 0.1], 0.5) == 10.0   # from a cost of 0: the checkpoint
    assert rlvr.crossing_cost([5.0, 10.0], [0.1, 0.0], 0.5) == 5.0                # already there


@pytest.mark.parametrize("f, ratio, verdict", [
    (0.0, 0.05 * 9, "does not reproduce"),   # the teacher's compute alone: on-policy is cheaper
    (1.0, 0.15 * 9, "reproduces"),
    (3.0, 0.35 * 9, "reproduces"),
])
def test_e6_verdicts_per_student_token_price(f, ratio, verdict):
    """The ID-accuracy parity at price f: the crossing between steps 9 and 10, interpolated, over the
    offline arm's 1000 tokens; the verdict flips with f. The KL is never reached: 'at least' the budget
    ratio, a one-sided bound, inconclusive. The offline arm reaches the on-policy arm's final KL: always."""
    from sims import rlvr
    v = rlvr.verdicts(_e6_curves().assign(ood_accuracy=0.1))
    at = v[v.student_token_cost == f]
    acc = at[at.claim.str.contains("final ID accuracy")].iloc[0]
    crossing = _log_linear_crossing(ratio * 1000, ratio * 1000 * 10 / 9, -0.45, -0.5, -0.499) / 1000
    assert acc.estimate == pytest.approx(crossing, rel=1e-9) and acc.verdict == verdict and acc.df == 2
    assert f"f = {f:g}," in acc.condition
    kl = at[at.claim.str.contains("to reach the offline arm's final KL")].iloc[0]
    assert kl.estimate == pytest.approx(ratio * 10 / 9, rel=1e-9)                  # its whole budget
    assert kl.statistic.startswith("at least") and "reached in 0 of 3 runs" in kl.statistic
    assert kl.hi == np.inf and kl.verdict == "inconclusive"                      # censored runs alone decide nothing
    reverse = v[v.claim.str.contains("offline arm reaches")]
    assert len(reverse) == 1 and reverse.verdict.iloc[0] == "reproduces" and "always" in reverse.statistic.iloc[0]
    assert set(v.student_token_cost.dropna()) == {0.0, 1.0, 3.0}


def test_e6_censored_runs_make_a_lower_bound_and_never_is_a_result():
    """Two tasks reach the offline KL (between steps 4 and 5), one never: the estimate is at least the
    median task mean with the censored run at its budget; 3 tasks are too few for the sign test's 95% bound
    (P(all 3 below the median) = 1/8): no bound, inconclusive; the offline arm never reaches the final KL of
    the tasks whose on-policy arm ends below 1/11: some runs, mixed (no condition is stated)."""
    from sims import rlvr
    v = rlvr.verdicts(_e6_curves((0.5, 0.5, 2.0)).assign(ood_accuracy=0.1))
    kl = v[v.claim.str.contains("to reach the offline arm's final KL") & (v.student_token_cost == 1.0)].iloc[0]
    reached = _log_linear_crossing(600, 750, 0.5 / 5, 0.5 / 6, 1 / 11) / 1000
    assert kl.estimate == pytest.approx(reached, rel=1e-9) and np.isnan(kl.lo)        # the median of 3
    assert kl.statistic.startswith("at least") and "reached in 2 of 3 runs" in kl.statistic
    assert kl.statistic.endswith("median of 3 task means, too few for a 95% order-statistic lower bound on the "
                                 "median (>= 5 tasks)")
    assert kl.verdict == "inconclusive" and kl.hi == np.inf
    reverse = v[v.claim.str.contains("offline arm reaches")].iloc[0]
    assert reverse.verdict == "mixed" and "1 of 3 runs" in reverse.statistic and reverse.rule.endswith("some: mixed")


def _censored_design(scales):
    """_e6_curves at 500 teacher tokens and no student tokens a step: a task of scale c reaches the offline
    arm's final KL 1/11 where c / (1 + step) <= 1/11 (between steps 3 and 4 for 0.4; never for 2)."""
    curves = _e6_curves(scales)
    on = curves.method == "on-policy FKL"
    curves.loc[on, "teacher_tokens"] = 500 * curves.loc[on, "step"]
    curves.loc[on, "student_tokens"] = 0
    return curves.assign(ood_accuracy=0.1)


def test_e6_censored_lower_bound_is_the_sign_tests_order_statistic_of_the_task_means():
    """Eight tasks, two censored at their budget (5000 / 1000): the estimate is the median task ratio and lo
    the 2nd smallest (P(Binomial(8, 1/2) <= 1) = 9/256: a 96.5% bound), here the task of scale 0.4, whose
    crossing lies between steps 3 and 4; above 1: reproduces."""
    from sims import rlvr
    scales = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 2.0, 2.0)
    v = rlvr.verdicts(_censored_design(scales))
    kl = v[v.claim.str.contains("to reach the offline arm's final KL") & (v.student_token_cost == 1.0)].iloc[0]
    ratios = []
    for c in scales[:6]:
        s0 = np.floor(11 * c - 1)                                     # the last step above 1/11
        ratios.append(_log_linear_crossing(500 * s0, 500 * (s0 + 1), c / (1 + s0), c / (2 + s0), 1 / 11) / 1000)
    ratios = sorted(ratios) + [5.0, 5.0]
    assert kl.lo == pytest.approx(ratios[1], rel=1e-9) and kl.estimate == pytest.approx(
        np.exp(np.median(np.log(ratios))), rel=1e-9)
    assert kl.verdict == "reproduces" and kl.hi == np.inf and "reached in 6 of 8 runs" in kl.statistic
    assert kl.statistic.endswith("median of 8 task means, the 2nd smallest as a 96.5% lower bound on the median "
                                 "(sign test; a censored run's true cost can only raise it)")


def test_e6_table_reads_the_cost_at_its_price():
    from sims import rlvr
    curves = _e6_curves()
    e6 = rlvr.e6_table(curves).set_index("method")
    on = e6.loc["on-policy FKL"]
    assert on.cost == 1500 and on.kl_at_offline_cost == pytest.approx(2 / 7) and np.isnan(on.cost_to_offline_kl)
    assert on.reached_offline_kl == "0/3" and on.reached_offline_accuracy == "3/3"
    assert rlvr.e6_table(curves, student_token_cost=0.0).set_index("method").loc["on-policy FKL", "cost"] == 500
    off = e6.loc["offline FKL"]
    assert off.cost == 1000 and off.kl_target == pytest.approx(1 / 11) and off.cost_to_offline_kl == 1000
    with pytest.raises(ValueError, match="student_token_cost"):
        rlvr.e6_runs(curves, student_token_cost=-1.0)


# ------------------------------------------------------------------------------------------------
# sims/rlvr.py end to end
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_rlvr(quick_run):
    return quick_run("rlvr")


@pytest.mark.integration
def test_rlvr_quick_end_to_end(quick_rlvr):
    from sims import rlvr
    out = quick_rlvr
    for name in ("curves.csv", "teachers.csv", "e4.csv", "e6.csv", "figures/rlvr.png", "figures/rlvr_cost.png"):
        assert (out / name).exists(), name
    curves = pd.read_csv(out / "curves.csv", keep_default_na=False, na_values=[""])
    assert set(curves.method) == {m.method for m in rlvr.METHODS} and set(curves.stage) == {"distil", "rl"}
    assert set(curves.student) == {"loglinear", "neural"}
    rl = curves[curves.stage == "rl"]
    assert (rl.groupby(["student", "condition", "task", "method", "seed"]).teacher_tokens.nunique() == 1).all()
    e4 = pd.read_csv(out / "e4.csv")
    assert e4.verdict.dropna().str.contains("edge").all() and len(e4.verdict.dropna()) == 16
    v = pd.read_csv(out / "verdicts.csv")
    assert (v.verdict == verdicts.QUICK).all()                # 2 tasks and 30 steps decide nothing
    e4_rows, e6_rows = v[v.claim.str.startswith("E4")], v[v.claim.str.startswith("E6")]
    assert len(e4_rows) == 2 * 2 * 2 * 5                      # students x conditions x objectives x claims
    assert len(e4_rows[e4_rows.claim.str.contains("control")]) == 24
    assert list(v.columns) == list(rlvr.VERDICT_COLUMNS) and e4_rows.df.dropna().isin([1]).all()
    # E6 against each pool (the neural student: 1,024): runs x 2 end points x 3 prices, and the reverse
    for pool, n in (("256", 2), ("1,024", 8), ("4,096", 2)):
        assert e6_rows.condition.str.contains(f"({pool} traces)", regex=False).sum() == n * (2 * 3 + 1), pool
    assert set(e6_rows.student_token_cost.dropna()) == set(rlvr.STUDENT_TOKEN_COSTS)
    one_task = v[v.condition.str.startswith("neural") & v.claim.str.contains("survive")]
    assert one_task.statistic.str.contains("one task").all()
    assert (rlvr.verdicts(curves).query("condition.str.startswith('neural') and claim.str.contains('survive')")
            .verdict == "inconclusive").all()                 # what the rule says where the run is not quick
    e6 = pd.read_csv(out / "e6.csv")
    assert set(e6.method) == {m.method for m in rlvr.METHODS if m.objective}
    teachers = pd.read_csv(out / "teachers.csv")
    assert (teachers[teachers.policy.str.startswith("A")].kl_arithmetic.abs() < 1e-12).all()


@pytest.mark.integration
def test_rlvr_is_deterministic_and_resumes(quick_rlvr, tmp_path):
    run_script("sims/rlvr.py", "--quick", "--only", "shared", "--out", tmp_path, "--quiet", "--no-figures")
    a = pd.read_csv(tmp_path / "curves.csv", keep_default_na=False, na_values=[""])
    b = pd.read_csv(quick_rlvr / "curves.csv", keep_default_na=False, na_values=[""])
    pd.testing.assert_frame_equal(a, b[b.condition == "shared"].reset_index(drop=True))
    proc = run_script("sims/rlvr.py", "--quick", "--out", quick_rlvr, "--resume", "--no-figures")
    assert "(6 resumed)" in proc.stderr


@pytest.mark.integration
def test_rlvr_figures_read_the_csvs(quick_rlvr):
    from figures import rlvr as fr
    figs = fr.figures_from(str(quick_rlvr))
    assert set(figs) == {"rlvr", "rlvr_cost"}
    e4 = pd.read_csv(quick_rlvr / "e4.csv")
    for ax, student in ((figs["rlvr"].axes[2], "loglinear"), (figs["rlvr"].axes[5], "neural")):
        diffs = e4[e4.comparison.str.contains(" - ") & (e4.student == student)]
        assert len(ax.get_yticklabels()) == len(diffs) == 8
    fkl = figs["rlvr_cost"].axes[0]
    assert fkl.get_xscale() == "log" and len(fkl.get_lines()) >= 2 * 4        # a line and an end marker per method


@pytest.mark.parametrize("bad", [["--seeds", "0"], ["--only", "nope"], ["--full"], ["--executor", "mpi"],
                                 ["--student-token-cost", "-1"], ["--student-token-cost", "nan"]])
def test_rlvr_bad_arguments_exit_2_with_one_line(bad, tmp_path):
    proc = run_script("sims/rlvr.py", *bad, "--quick", "--out", tmp_path, check=False, timeout=60)
    assert_usage_error(proc)


def test_a_share_whose_fieller_set_is_two_rays_decides_nothing():
    """Task means whose denominator is not resolved: Fieller's set is (-inf, 0.83] and [2.41, inf), both
    roots above 0.5, yet the share is not resolved (a bound on the roots would call it 'reproduces')."""
    from sims import rlvr
    num = [-0.0003, -0.0021, 0.0102, 0.0312, -0.0107, 0.0159]
    den = [-0.0049, -0.0084, 0.0008, 0.0144, -0.0102, 0.0058]
    row = rlvr._share_row(num, den, np.arange(6), "w", "fresh", "on", "off")
    assert "(-inf, 0.83] and [2.41, inf): not resolved" in row["statistic"]
    assert row["verdict"] == "inconclusive" and (row["lo"], row["hi"]) == (-np.inf, np.inf) and row["df"] == 5


def test_the_reverse_direction_asks_whether_the_offline_arm_ever_reaches_the_on_policy_kl():
    """An offline arm that dips to KL 0.05 and ends at 0.2 reaches an on-policy final KL of 0.1 within its
    budget (at some checkpoint, not only at its end); one that never gets below 0.15 does not."""
    from sims import rlvr
    rows = []
    for task, dip in enumerate((0.05, 0.15)):
        for step, (off, on) in enumerate(((1.0, 1.0), (dip, 0.5), (0.2, 0.1))):
            for method, kl, teacher, student in (("offline FKL", off, 1000, 0), ("on-policy FKL", on, 500 * step,
                                                                                  250 * step)):
                rows.append(dict(student="loglinear", condition="shared", task=task, seed=0, method=method,
                                 objective="fkl", stage="distil", step=step, teacher_tokens=teacher,
                                 student_tokens=student, kl_arithmetic=kl, kl_local=1.0, id_accuracy=0.5))
    runs = rlvr.e6_runs(pd.DataFrame(rows)).set_index(["task", "method"])
    assert runs.loc[(0, "on-policy FKL"), "offline_reaches_kl"] and not runs.loc[(1, "on-policy FKL"), "offline_reaches_kl"]


# ------------------------------------------------------------------------------------------------
# the verdict code's texts, columns, order and branches on hand-built curves (issue 29)
# ------------------------------------------------------------------------------------------------
_NUMBER = re.compile(r"[-+]?(?:inf|\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)")


def _template(text):
    """A statistic or rule with its numbers replaced by '#' and its objective by 'KL' (the committed run shows some
    kinds of statistic for one objective only): what a run's numbers cannot change."""
    return _NUMBER.sub("#", re.sub(r"\b[FR]KL\b", "KL", text))


@pytest.fixture(scope="module")
def committed_verdicts():
    return pd.read_csv(pathlib.Path(__file__).resolve().parents[1] / "docs" / "verdicts" / "rlvr.csv")


def _with_fresh(curves, fresh):
    """The fresh-teacher control arms: the offline arms' curves with ``fresh`` added after distillation."""
    control = curves[curves.method.str.startswith("offline")].assign(
        method=lambda d: d.method.str.replace("offline", "fresh-teacher"),
        ood_accuracy=lambda d: d.ood_accuracy + np.where(d.stage == "distil", fresh, 0.0))
    return pd.concat([curves, control], ignore_index=True)


def _arm(method, objective, teacher, student_tokens, kl, acc, task=0, seed=0, condition="shared",
         student="loglinear", other_kl=9.0):
    """One run's distillation curve, a checkpoint per entry: tokens, the KL to its objective's target (the other
    KL column holds ``other_kl``, which no row may read) and the ID accuracy."""
    fkl = objective == "fkl"
    return [dict(student=student, condition=condition, task=task, seed=seed, method=method, objective=objective,
                 stage="distil", step=step, teacher_tokens=t, student_tokens=s, kl_arithmetic=k if fkl else other_kl,
                 kl_local=other_kl if fkl else k, id_accuracy=a, ood_accuracy=0.1)
            for step, (t, s, k, a) in enumerate(zip(teacher, student_tokens, kl, acc))]


def test_verdict_texts_are_those_of_the_committed_run(committed_verdicts):
    """The study page and gallery are generated from docs/verdicts/rlvr.csv: every (claim, condition) that
    verdicts() writes must be one of its pairs, every rule and statistic one of its texts up to the numbers."""
    from sims import rlvr
    frames = [rlvr.verdicts(_with_fresh(_synthetic_curves(0.1, 0.0, n=12, tasks=6, rl_noise_sd=0.2), 0.1)),
              rlvr.verdicts(_with_fresh(_synthetic_curves(-0.05, 0.0, n=12, tasks=6), 0.0)),
              rlvr.verdicts(_e6_curves((0.5, 0.5, 2.0)).assign(ood_accuracy=0.1)).query("claim.str.startswith('E6')")]
    share = rlvr._share_row([-0.0003, -0.0021, 0.0102, 0.0312, -0.0107, 0.0159],
                            [-0.0049, -0.0084, 0.0008, 0.0144, -0.0102, 0.0058], np.arange(6),
                            "loglinear, shared, FKL", "fresh-teacher FKL", "on-policy FKL", "offline FKL")
    v = pd.concat(frames + [pd.DataFrame([share])], ignore_index=True)
    pairs = set(zip(committed_verdicts.claim, committed_verdicts.condition))
    rules = set(committed_verdicts.rule.map(_template))
    statistics = set(committed_verdicts.statistic.map(_template))
    assert len(v) > 40
    for row in v.itertuples():
        assert (row.claim, row.condition) in pairs, (row.claim, row.condition)
        assert isinstance(row.rule, str) and _template(row.rule) in rules, row.rule
        assert isinstance(row.statistic, str) and _template(row.statistic) in statistics, row.statistic
    assert list(v.columns) == list(rlvr.VERDICT_COLUMNS)


def _task_means(curves, condition, on, off, stage):
    """The per-task means of on minus off OOD accuracy at the last step of ``stage``, from the curves."""
    c = curves[(curves.condition == condition) & (curves.stage == stage)]
    c = c[c.step == c.step.max()].set_index(["task", "seed", "method"]).ood_accuracy.unstack("method")
    return (c[on] - c[off]).groupby(level="task").mean()


def test_e4_verdicts_state_the_design_the_tost_and_the_tests_of_each_row():
    """The edge row's between-task s.d. and the tasks 80% power needs, the survival row's TOST p with tasks - 1
    df, and the margin, df and MDE of every E4 row, each from the task means computed here."""
    from sims import rlvr
    curves = _with_fresh(_synthetic_curves(0.1, 0.0, n=12, tasks=6, noise_sd=0.05, rl_noise_sd=0.08), 0.05)
    v = rlvr.verdicts(curves)
    t975 = stats.t.ppf(0.975, 5)
    for condition in ("shared", "unshared"):
        for objective, (on, off) in rlvr.PAIRS.items():
            where = f"loglinear, {condition}, {objective.upper()}"
            rows = v[v.condition == where].set_index("claim")
            edge = rows.loc["E4 an on-policy edge in OOD accuracy exists after distillation"]
            m = _task_means(curves, condition, on, off, "distil")
            sd, est = m.std(ddof=1), m.mean()
            assert edge.estimate == pytest.approx(est, rel=1e-9)
            need = verdicts.clusters_for_power(sd, est)
            assert edge.statistic.endswith(f"; between-task s.d. of the task means {sd:.3f}: 80% power at this edge "
                                           f"needs {need:,} tasks at 2 seeds each"), edge.statistic
            assert edge.margin == 0.0 and edge.df == 5
            assert edge.mde_80 == pytest.approx(verdicts.t_mde_80(sd / np.sqrt(6), 5), rel=1e-6)
            survive = rows.loc["E4 the edge does not survive RL"]
            r = _task_means(curves, condition, on, off, "rl")
            se, margin = r.std(ddof=1) / np.sqrt(6), 0.5 * est
            p = max(stats.t.sf((r.mean() + margin) / se, 5), stats.t.cdf((r.mean() - margin) / se, 5))
            assert f"TOST p = {p:.2g}; t-test with 5 df: " in survive.statistic, (p, survive.statistic)
            assert survive.verdict == ("reproduces" if p < 0.05 else "does not reproduce"
                                       if survive.lo > 0 else "inconclusive")
            assert (survive.hi - survive.lo) / 2 == pytest.approx(t975 * se, rel=1e-9)
            for claim in ("E4 control: fresh teacher traces carry an OOD edge over the pool (data freshness)",
                          "E4 control: on-policy sampling carries an OOD edge beyond fresh teacher data"):
                control = rows.loc[claim]
                assert control.margin == pytest.approx(margin, rel=1e-12) and control.df == 5
                half = (control.hi - control.lo) / 2
                assert control.mde_80 == pytest.approx(verdicts.t_mde_80(half / t975, 5), rel=1e-6)
                assert control.rule == (f"interval above 0: reproduces; below +{margin:.2g} (0.5 x the edge "
                                        f"{est:+.3f}) throughout: does not; else inconclusive")


def test_e4_controls_without_a_positive_edge_have_margin_zero():
    from sims import rlvr
    curves = _with_fresh(_synthetic_curves(-0.05, 0.0, n=12, tasks=6), 0.0)
    v = rlvr.verdicts(curves)
    controls = v[v.claim.str.startswith("E4 control") & ~v.claim.str.contains("share")]
    assert len(controls) == 8 and (controls.margin == 0.0).all()
    edges = v[v.claim.str.contains("exists")].estimate.repeat(2).to_numpy()
    assert list(controls.rule) == [f"interval above 0: reproduces; below +0 (no positive edge: {e:+.3f}) throughout: "
                                   f"does not; else inconclusive" for e in edges]


def test_e4_with_one_task_decides_nothing_and_with_two_tasks_tests():
    """One task: no between-task spread, so no interval, test, power or Fieller set: every E4 row inconclusive,
    its df NaN. Two tasks: the same rows with 1 df."""
    from sims import rlvr
    one = rlvr.verdicts(_with_fresh(_synthetic_curves(0.1, 0.0, n=2, tasks=1), 0.1))
    assert len(one) == 2 * 2 * 5 and (one.verdict == "inconclusive").all() and one.df.isna().all()
    assert one.mde_80.isna().all()
    survive = one[one.claim.str.contains("survive")]
    assert (survive.statistic == "the same difference after RL; one task: no task-level interval, power or TOST").all()
    assert (survive.rule == "TOST within +-margin: reproduces; interval above 0: does not; else inconclusive").all()
    edge = one[one.claim.str.contains("exists")]
    assert (edge.statistic == "on-policy minus offline OOD accuracy, mean of 1 task means, 95% t-interval over "
                              "tasks").all()
    assert ((edge.lo == edge.estimate) & (edge.hi == edge.estimate) & (edge.estimate > 0.05)).all()
    share = one[one.claim.str.contains("share")]
    assert share.statistic.str.endswith("; one task: no Fieller set").all() and share.estimate.isna().all()
    two = rlvr.verdicts(_with_fresh(_synthetic_curves(0.1, 0.0, n=4, tasks=2), 0.1))
    assert (two.df == 1).all() and two.mde_80[~two.claim.str.contains("share")].notna().all()
    assert (two[two.claim.str.contains("exists")].verdict == "reproduces").all()
    assert two[two.claim.str.contains("exists")].statistic.str.contains("between-task s.d.").all()
    assert two[two.claim.str.contains("survive")].statistic.str.contains("TOST p = ").all()
    assert (two[two.claim.str.contains("data freshness")].verdict == "reproduces").all()
    assert two[two.claim.str.contains("share")].statistic.str.contains("Fieller 95% set").all()


def _exact_e4_curves(on_distil, on_rl, tasks=2, seeds=2):
    """Offline arms at OOD accuracy 0.25, on-policy at 0.25 + on_*[task]: binary fractions, so the differences
    are exact."""
    rows = []
    for task, seed, (method, on) in itertools.product(range(tasks), range(seeds), (
            ("offline FKL", False), ("on-policy FKL", True), ("offline RKL", False), ("on-policy RKL", True))):
        for stage, edge in (("distil", on_distil[task]), ("rl", on_rl[task])):
            rows.append(dict(student="loglinear", condition="shared", task=task, seed=seed, method=method,
                             stage=stage, step=10, ood_accuracy=0.25 + (edge if on else 0.0), id_accuracy=0.5))
    return pd.DataFrame(rows)


def test_e4_tost_decides_at_5_percent_per_side_and_the_row_states_what_the_design_needs():
    """Pre-RL edges 0.5 on each of 3 tasks (margin 0.25); after RL -0.125, 0, +0.125: TOST p = t_2.sf(0.25 /
    (0.125 / sqrt 3)) = 0.037, in [0.025, 0.05): equivalent at the 5% per side that TOST uses (a 90% interval
    inside +-margin), so 'reproduces' (a 2.5% per side test would not). The row states the s.e. TOST needs and,
    where the design falls short, the tasks it needs (from analysis.verdicts.tost_clusters_for_power)."""
    from sims import rlvr
    v = rlvr.verdicts(_exact_e4_curves([0.5, 0.5, 0.5], [-0.125, 0.0, 0.125], tasks=3))
    survive = v[v.claim.str.contains("survive")].iloc[0]
    p = stats.t.sf(0.25 / (0.125 / np.sqrt(3)), 2)
    assert 0.025 <= p < 0.05 and f"TOST p = {p:.2g};" in survive.statistic and survive.verdict == "reproduces"
    target = verdicts.tost_se_for_power(0.25, 3)
    assert verdicts.tost_power(target * np.sqrt(3), 0.25, 3) == pytest.approx(0.8, abs=1e-9)
    assert survive.statistic.endswith(f"TOST has 80% power at a true difference of 0 with 3 tasks only if the s.e. "
                                      f"is <= {target:.3g}, {0.125 / np.sqrt(3) / target:.2g}x smaller than the "
                                      f"{0.125 / np.sqrt(3):.3g} measured: this design cannot show 'no effect'; at the "
                                      f"measured between-task s.d. 0.125 that needs 4 tasks (1.33x the 3)")
    assert verdicts.tost_power(0.125, 0.25, 4) >= 0.8 > verdicts.tost_power(0.125, 0.25, 3)
    tight = rlvr.verdicts(_exact_e4_curves([0.5] * 3, [-0.0625, 0.0, 0.0625], tasks=3))
    assert tight[tight.claim.str.contains("survive")].statistic.iloc[0].endswith(
        "(measured 0.0361: the design can show 'no effect')")


def test_e4_rows_when_the_task_means_do_not_spread_or_cancel():
    """Identical task means: se = 0, no t-test (df and MDE NaN) and no power design; task means +-0.125: an edge
    of exactly 0, which no number of tasks detects; an interval [0, 0] neither above nor below 0."""
    from sims import rlvr
    same = rlvr.verdicts(_exact_e4_curves([0.125, 0.125], [0.0, 0.0]))
    edge = same[same.claim.str.contains("exists")]
    assert (edge.estimate == 0.125).all() and (edge.lo == 0.125).all() and edge.df.isna().all()
    assert edge.mde_80.isna().all() and edge.statistic.str.endswith("95% t-interval over tasks").all()
    cancel = rlvr.verdicts(_exact_e4_curves([0.125, -0.125], [0.0, 0.0]))
    edge = cancel[cancel.claim.str.contains("exists")]
    assert (edge.estimate == 0.0).all() and edge.statistic.str.endswith(
        "80% power at this edge needs more than 10^6 tasks at 2 seeds each").all()
    e4 = rlvr.e4_table(_exact_e4_curves([0.0, 0.0], [0.0, 0.0]))
    diffs = e4[e4.comparison.str.contains(" - ")]
    assert (diffs.lo == 0).all() and (diffs.hi == 0).all()
    assert (diffs.verdict == "no edge after distillation (includes 0)").all()


def test_verdicts_skip_an_objective_without_both_arms_and_keep_the_columns():
    from sims import rlvr
    curves = _synthetic_curves(0.1, 0.0, n=4, tasks=2)
    rkl = rlvr.verdicts(curves[curves.method != "on-policy FKL"])
    assert len(rkl) == 2 * 2 and rkl.condition.str.endswith(", RKL").all()
    fkl = rlvr.verdicts(curves[curves.method != "offline RKL"])
    assert len(fkl) == 2 * 2 and fkl.condition.str.endswith(", FKL").all()
    for none in (curves[curves.method == "offline FKL"],
                 _e6_curves().assign(ood_accuracy=0.1).query("method == 'offline FKL'")):
        v = rlvr.verdicts(none)
        assert v.empty and list(v.columns) == list(rlvr.VERDICT_COLUMNS)


def test_the_tables_and_verdicts_keep_the_order_of_the_curves():
    """Rows follow the order in which students, conditions and methods first appear in the curves, not the
    alphabet."""
    from sims import rlvr
    curves = _synthetic_curves(0.1, 0.0, n=4, tasks=2, conditions=("unshared", "shared"))
    curves = pd.concat([curves[curves.method == m] for m in
                        ("on-policy RKL", "offline RKL", "on-policy FKL", "offline FKL")], ignore_index=True)
    curves = curves.sort_values("condition", ascending=False, kind="stable")
    e4 = rlvr.e4_table(curves)
    per_method = e4[~e4.comparison.str.contains(" - ")]
    assert list(per_method.condition.unique()) == ["unshared", "shared"]
    assert list(per_method.comparison.unique()) == ["on-policy RKL", "offline RKL", "on-policy FKL", "offline FKL"]
    assert list(e4[e4.comparison.str.contains(" - ")].condition.unique()) == ["unshared", "shared"]
    v = rlvr.verdicts(curves)
    assert [c.split(", ")[1] for c in v.condition.unique()] == ["unshared"] * 2 + ["shared"] * 2
    e6 = []
    for condition in ("unshared", "shared"):
        for task in (1, 0):
            for method, objective in (("on-policy RKL", "rkl"), ("offline RKL", "rkl"), ("on-policy FKL", "fkl"),
                                      ("offline FKL", "fkl")):
                off = method.startswith("off")
                e6 += _arm(method, objective, [1000] * 3 if off else [0, 500, 1000], [0] * 3 if off else [0, 100, 200],
                           [1.0, 0.5, 0.25] if off else [1.0, 0.4, 0.2], [0.5] * 3 if off else [0.1, 0.3, 0.6],
                           task=task, condition=condition)
    e6 = pd.DataFrame(e6)
    runs = rlvr.e6_runs(e6)
    assert list(zip(runs.condition, runs.task, runs.method)) == [
        (c, t, m) for c in ("unshared", "shared") for t in (1, 0)
        for m in ("on-policy RKL", "offline RKL", "on-policy FKL", "offline FKL")]
    table = rlvr.e6_table(e6)
    assert list(zip(table.condition, table.method)) == [
        (c, m) for c in ("unshared", "shared")
        for m in ("on-policy RKL", "offline RKL", "on-policy FKL", "offline FKL")]
    v = rlvr.verdicts(e6)
    e6_rows = v[v.claim.str.startswith("E6")]
    arms = e6_rows.condition.str.extract(r"^loglinear, (\w+), .*(on-policy [FR]KL)")
    assert list(dict.fromkeys(zip(arms[0], arms[1]))) == [
        (c, m) for c in ("unshared", "shared") for m in ("on-policy RKL", "on-policy FKL")]
    reverse = e6_rows[e6_rows.claim.str.contains("offline arm reaches")]
    assert list(reverse.condition) == [f"loglinear, {c}, {m}'s offline arm (1,024 traces)" for c in
                                       ("unshared", "shared") for m in ("on-policy RKL", "on-policy FKL")]


def test_e4_table_columns_and_intervals_from_the_runs():
    """Per method and stage, the mean and 95% t-interval over its runs; per pair, the task-clustered difference."""
    from sims import rlvr
    curves = _synthetic_curves(0.1, 0.05, n=4, tasks=2, noise_sd=0.05)
    e4 = rlvr.e4_table(curves)
    assert list(e4.columns) == ["student", "condition", "comparison", "stage", "ood_accuracy", "lo", "hi", "runs",
                                "tasks", "verdict"]
    expected = []
    for condition in ("shared", "unshared"):
        for method in ("offline FKL", "on-policy FKL", "offline RKL", "on-policy RKL"):
            for stage in ("distil", "rl"):
                x = curves[(curves.condition == condition) & (curves.method == method) & (curves.stage == stage)]
                half = stats.t.ppf(0.975, len(x) - 1) * x.ood_accuracy.std(ddof=1) / np.sqrt(len(x))
                expected.append(("loglinear", condition, method, stage, x.ood_accuracy.mean(), half, len(x)))
    per_method = e4[~e4.comparison.str.contains(" - ")]
    assert len(per_method) == len(expected)
    for row, (student, condition, method, stage, mean, half, runs) in zip(per_method.itertuples(), expected):
        assert (row.student, row.condition, row.comparison, row.stage, row.runs) == (student, condition, method,
                                                                                     stage, runs)
        assert (row.ood_accuracy, row.lo, row.hi) == pytest.approx((mean, mean - half, mean + half), rel=1e-9)
        assert np.isnan(row.tasks)
    diffs = e4[e4.comparison.str.contains(" - ")]
    expected = [(c, f"{on} - {off}", stage, _task_means(curves, c, on, off, stage))
                for c in ("shared", "unshared") for on, off in rlvr.PAIRS.values() for stage in ("distil", "rl")]
    assert len(diffs) == len(expected)
    for row, (condition, comparison, stage, m) in zip(diffs.itertuples(), expected):
        half = stats.t.ppf(0.975, 1) * m.std(ddof=1) / np.sqrt(2)
        assert (row.student, row.condition, row.comparison, row.stage, row.runs, row.tasks) == (
            "loglinear", condition, comparison, stage, 4, 2)
        assert (row.ood_accuracy, row.lo, row.hi) == pytest.approx((m.mean(), m.mean() - half, m.mean() + half),
                                                                   rel=1e-9)


def test_e6_runs_columns_read_the_end_of_distillation_only():
    """One row per distilled run with its own end point; RL checkpoints (after distillation) change nothing; RKL
    reads kl_local; an offline arm whose KL equals the run's final KL at a checkpoint reaches it."""
    from sims import rlvr
    rows = (_arm("offline FKL", "fkl", [1000] * 3, [0] * 3, [1.0, 0.5, 0.25], [0.5] * 3)
            + _arm("on-policy FKL", "fkl", [0, 400, 800], [0, 100, 200], [1.0, 0.5, 0.25], [0.1, 0.3, 0.6])
            + _arm("offline RKL", "rkl", [1000] * 3, [0] * 3, [1.0, 0.5, 0.3], [0.5] * 3, seed=3)
            + _arm("on-policy RKL", "rkl", [0, 400, 800], [0, 100, 200], [1.0, 0.5, 0.2], [0.1, 0.3, 0.6], seed=3))
    distil = pd.DataFrame(rows)
    rl = distil.assign(stage="rl", step=distil.step + 3, student_tokens=distil.student_tokens + 5000,
                       kl_arithmetic=0.001, kl_local=0.001, id_accuracy=0.9)
    runs = rlvr.e6_runs(pd.concat([distil, rl], ignore_index=True), student_token_cost=3.0)
    assert list(runs.columns) == [
        "student", "condition", "task", "seed", "method", "objective", "cost", "teacher_tokens", "student_tokens",
        "kl_target", "id_accuracy", "kl_at_offline_cost", "cost_to_offline_kl", "cost_to_offline_accuracy",
        "offline_cost", "offline_reaches_kl", "offline_id_accuracy", "student_token_cost"]
    runs = runs.set_index("method")
    on, rkl = runs.loc["on-policy FKL"], runs.loc["on-policy RKL"]
    assert (on.seed, on.objective, on.teacher_tokens, on.student_tokens, on.cost) == (0, "fkl", 800, 200, 1400)
    assert (on.kl_target, on.id_accuracy, on.student_token_cost, on.offline_cost) == (0.25, 0.6, 3.0, 1000)
    assert on.offline_reaches_kl                                   # the offline arm's 0.25 equals it: reached
    assert (rkl.seed, rkl.objective, rkl.kl_target) == (3, "rkl", 0.2) and not rkl.offline_reaches_kl
    assert runs.loc["offline RKL", "kl_target"] == 0.3
    assert (runs.offline_id_accuracy == 0.5).all()                 # the offline arm's own, not the run's


def test_e6_table_columns_with_one_run_per_method():
    from sims import rlvr
    rows = (_arm("offline RKL", "rkl", [1000] * 3, [0] * 3, [1.0, 0.5, 0.25], [0.5] * 3)
            + _arm("on-policy RKL", "rkl", [0, 400, 800], [0, 100, 200], [1.0, 0.5, 0.2], [0.1, 0.3, 0.6]))
    table = rlvr.e6_table(pd.DataFrame(rows), student_token_cost=0.5)
    cols = ["cost", "teacher_tokens", "student_tokens", "kl_target", "id_accuracy", "kl_at_offline_cost",
            "cost_to_offline_kl", "cost_to_offline_accuracy"]
    expected = ["student", "condition", "method", "objective", "runs", "student_token_cost"]
    for col in cols:
        expected += [col, f"{col}_lo", f"{col}_hi"] + (
            ["reached_offline_kl"] if col == "cost_to_offline_kl" else
            ["reached_offline_accuracy"] if col == "cost_to_offline_accuracy" else [])
    assert list(table.columns) == expected
    on = table.set_index("method").loc["on-policy RKL"]
    assert (on.student, on.condition, on.objective, on.runs, on.student_token_cost) == ("loglinear", "shared", "rkl",
                                                                                        1, 0.5)
    assert (on.cost, on.cost_lo, on.cost_hi) == (900, 900, 900)
    assert on.reached_offline_kl == "1/1" and on.reached_offline_accuracy == "1/1"


def test_e6_verdicts_against_each_pool_use_that_pool():
    """A second offline arm of 4,096 traces that costs 4x the first: the on-policy arm's cost ratios against it are
    a quarter of those against the 1,024-trace arm; its KL (0.01, never reached by the on-policy arm) leaves the
    KL claim censored in every run, which decides nothing, and it reaches the on-policy arm's final KL in every run
    (always) while the 1,024-trace arm never does."""
    from sims import rlvr
    curves = _e6_curves((0.5, 0.5, 0.5))
    big = curves[curves.method == "offline FKL"].assign(method="offline FKL, 4096 traces", teacher_tokens=4000,
                                                        kl_arithmetic=0.01)
    v = rlvr.verdicts(pd.concat([curves, big], ignore_index=True).assign(ood_accuracy=0.1))
    for f in (0.0, 1.0, 3.0):
        at = v[v.student_token_cost == f]
        acc = at[at.claim.str.contains("final ID accuracy")].set_index("condition").estimate
        small = acc[f"loglinear, shared, f = {f:g}, on-policy FKL against its offline arm (1,024 traces)"]
        assert acc[f"loglinear, shared, f = {f:g}, on-policy FKL against its offline arm (4,096 traces)"] == \
            pytest.approx(small / 4, rel=1e-12)
    kl = v[v.claim.str.contains("to reach the offline arm's final KL") & v.condition.str.contains("4,096")]
    assert len(kl) == 3 and (kl.verdict == "inconclusive").all() and (kl.hi == np.inf).all()
    assert kl.statistic.str.endswith("(the other 3 at their budget, a lower bound on their cost: the estimate is at "
                                     "least the median shown; never reached: the verdict may not rest on censored "
                                     "runs alone); median of 3 task means, too few for a 95% order-statistic lower "
                                     "bound on the median (>= 5 tasks)").all()
    reverse = v[v.claim.str.contains("offline arm reaches")].set_index("condition")
    always = reverse.loc["loglinear, shared, on-policy FKL's offline arm (4,096 traces)"]
    never = reverse.loc["loglinear, shared, on-policy FKL's offline arm (1,024 traces)"]
    assert always.verdict == "reproduces" and "3 of 3 runs (always);" in always.statistic
    assert never.verdict == "does not reproduce" and "0 of 3 runs (never);" in never.statistic
    assert (always.estimate, always.lo, always.hi, never.estimate, never.lo, never.hi) == (1, 1, 1, 0, 0, 0)


def test_e6_censored_bound_is_taken_over_task_means_not_runs():
    """Five tasks, two seeds each: on tasks 0 and 1 one seed reaches the offline KL early (scale 0.3, ratio about
    1.2) and the other never (its budget, 5); on tasks 2-4 both reach it at scale 0.5 (about 2.2). The task means
    put tasks 0 and 1 at sqrt(1.2 x 5) > 2.2, so the bound (the smallest of 5 task means) is the 0.5 tasks' ratio;
    over the 10 runs it would be the 2nd smallest run, about 1.2."""
    from sims import rlvr
    first = _censored_design((0.3, 0.3, 0.5, 0.5, 0.5))
    second = _censored_design((2.0, 2.0, 0.5, 0.5, 0.5)).assign(seed=1)
    v = rlvr.verdicts(pd.concat([first, second], ignore_index=True))
    kl = v[v.claim.str.contains("to reach the offline arm's final KL") & (v.student_token_cost == 1.0)].iloc[0]
    half = _log_linear_crossing(2000, 2500, 0.5 / 5, 0.5 / 6, 1 / 11) / 1000
    early = _log_linear_crossing(1000, 1500, 0.3 / 3, 0.3 / 4, 1 / 11) / 1000
    assert early < half < np.sqrt(early * 5.0)
    assert kl.lo == pytest.approx(half, rel=1e-9) and "median of 5 task means" in kl.statistic
    assert "reached in 8 of 10 runs" in kl.statistic and kl.verdict == "reproduces"


def test_e6_censored_runs_reproduce_when_the_lower_bound_clears_1_with_a_run_reached():
    """Five tasks (the fewest with a 95% sign-test bound: the smallest of 5, 96.9%): four reach the offline KL
    between steps 4 and 5 (ratio about 2.2), one never (its budget, 5000 / 1000): the smallest task ratio is
    above 1: reproduces. With none reached the same bound decides nothing."""
    from sims import rlvr
    v = rlvr.verdicts(_censored_design((0.5, 0.5, 0.5, 0.5, 2.0)))
    kl = v[v.claim.str.contains("to reach the offline arm's final KL") & (v.student_token_cost == 1.0)].iloc[0]
    reached = _log_linear_crossing(2000, 2500, 0.5 / 5, 0.5 / 6, 1 / 11) / 1000
    assert 1 < reached < 5 and kl.lo == pytest.approx(reached, rel=1e-9) and kl.hi == np.inf
    assert kl.estimate == pytest.approx(reached, rel=1e-9)
    assert kl.verdict == "reproduces" and "reached in 4 of 5 runs (the other 1 at their budget" in kl.statistic
    assert "the 1st smallest as a 96.9% lower bound" in kl.statistic
    never = rlvr.verdicts(_censored_design((2.0,) * 5))
    kl = never[never.claim.str.contains("to reach the offline arm's final KL") & (never.student_token_cost == 1.0)]
    assert kl.lo.iloc[0] == pytest.approx(5.0) and kl.verdict.iloc[0] == "inconclusive"


def test_e6_a_ratio_of_exactly_1_is_not_a_higher_cost():
    """Five tasks: three reach the offline arm's final KL at their checkpoint costing exactly the offline arm's
    1000 tokens, two never do and their budget is 1000: every log ratio is 0, the lower bound 0, not above."""
    from sims import rlvr
    rows = []
    for task in range(5):
        rows += _arm("offline FKL", "fkl", [1000] * 3, [0] * 3, [1.0, 0.5, 0.25], [0.5] * 3, task=task)
        rows += (_arm("on-policy FKL", "fkl", [0, 1000, 2000], [0] * 3, [1.0, 0.25, 0.2], [0.1, 0.5, 0.6], task=task)
                 if task % 2 == 0 else
                 _arm("on-policy FKL", "fkl", [0, 500, 1000], [0] * 3, [1.0, 0.5, 0.3], [0.1, 0.5, 0.6], task=task))
    v = rlvr.verdicts(pd.DataFrame(rows))
    kl = v[v.claim.str.contains("to reach the offline arm's final KL") & (v.student_token_cost == 1.0)].iloc[0]
    assert (kl.estimate, kl.lo, kl.hi) == (1.0, 1.0, np.inf) and kl.verdict == "inconclusive"


def test_e6_with_one_task_decides_nothing_and_two_tasks_make_an_interval():
    from sims import rlvr
    one = rlvr.verdicts(_e6_curves((0.5,)).assign(ood_accuracy=0.1))
    e6 = one[one.claim.str.startswith("E6") & one.student_token_cost.notna()]
    assert len(e6) == 6 and (e6.verdict == "inconclusive").all() and e6.df.isna().all()
    assert e6.lo.isna().all() and e6.hi.isna().all() and e6.statistic.str.endswith("; one task: no interval").all()
    two = rlvr.verdicts(_e6_curves((0.5, 0.5)).assign(ood_accuracy=0.1))
    e6 = two[two.claim.str.startswith("E6") & two.student_token_cost.notna()]
    assert len(e6) == 6 and (e6.df == 1).all() and np.isfinite(e6.lo).all() and np.isfinite(e6.hi).all()
    assert e6.statistic.str.endswith("; geometric mean of 2 task means, 95% t-interval over tasks").all()


def test_e6_a_run_at_its_target_from_no_cost_has_no_interval():
    """Two tasks, one with a run at the offline arm's final KL already at its first checkpoint, which costs
    nothing: a ratio of 0, an infinite log ratio, no interval: inconclusive (and not for want of tasks)."""
    from sims import rlvr
    curves = _e6_curves((0.5, 0.5))
    first = (curves.method == "on-policy FKL") & (curves.task == 0)
    curves.loc[first, "kl_arithmetic"] = 0.01
    with np.errstate(divide="ignore", invalid="ignore"):
        v = rlvr.verdicts(curves.assign(ood_accuracy=0.1))
    kl = v[v.claim.str.contains("to reach the offline arm's final KL")]
    assert len(kl) == 3 and (kl.verdict == "inconclusive").all() and kl.lo.isna().all() and kl.hi.isna().all()
    assert kl.statistic.str.endswith("; a target reached at no cost makes a log ratio infinite: no interval").all()
    assert (kl.df == 1).all() and (kl.estimate == 0).all()


def test_crossing_cost_interpolates_from_the_first_checkpoint_and_the_last_value_within_budget():
    from sims import rlvr
    # from cost 0.5 (value 1) to cost 2 (value 0): 0.5 is reached halfway in log cost, at cost 1
    assert rlvr.crossing_cost([0.5, 2.0, 8.0], [1.0, 0.0, -1.0], 0.5) == pytest.approx(1.0, rel=1e-12)
    assert rlvr.crossing_cost([2.0, 8.0, 32.0], [1.0, 0.0, -1.0], 0.5) == pytest.approx(4.0, rel=1e-12)
    assert rlvr._last_at_most([3.0, 2.0, 1.0], [0.0, 10.0, 20.0], 10.0) == 2.0          # a checkpoint at the budget
    assert np.isnan(rlvr._last_at_most([3.0, 2.0], [5.0, 10.0], 4.0))                   # even the first costs more


def test_the_freshness_share_of_one_task_or_a_whole_line_decides_nothing_and_a_resolved_set_is_its_interval():
    from sims import rlvr
    one = rlvr._share_row([0.1, 0.2], [0.2, 0.2], [0, 0], "w", "fresh", "on", "off")
    assert one["statistic"].endswith("; one task: no Fieller set") and one["verdict"] == "inconclusive"
    full = rlvr._share_row([0.1, 0.2], [0.2, 0.3], [0, 1], "w", "fresh", "on", "off")
    assert (one["claim"], one["condition"], one["rule"]) == (full["claim"], "w", full["rule"])
    assert one["claim"].startswith("E4 control: data freshness") and full["rule"].startswith("Fieller 95% set")
    assert np.isnan(one["estimate"]) and np.isnan(one["df"])
    line = rlvr._share_row([0.0035, 0.0082, 0.0033, -0.013], [0.0091, 0.0045, -0.0054, 0.0058], np.arange(4), "w",
                           "fresh", "on", "off")
    assert line["statistic"].endswith("; Fieller 95% set the whole line: not resolved")
    assert line["verdict"] == "inconclusive" and (line["lo"], line["hi"]) == (-np.inf, np.inf)
    num, den = np.array([0.06, 0.08, 0.07, 0.09]), np.array([0.1, 0.12, 0.09, 0.11])
    two = rlvr._share_row(np.repeat(num[:2], 2), np.repeat(den[:2], 2), [0, 0, 1, 1], "w", "f", "on", "off")
    assert "Fieller 95% set" in two["statistic"] and two["df"] == 1
    row = rlvr._share_row(num, den, np.arange(4), "w", "fresh", "on", "off")
    se = lambda x: x.std(ddof=1) / 2                                               # noqa: E731
    est, lo, hi, kind = verdicts.fieller(num.mean(), den.mean(), se(num), se(den), np.cov(num, den)[0, 1] / 4, df=3)
    assert kind == "interval" and (row["estimate"], row["lo"], row["hi"]) == pytest.approx((est, lo, hi))
    assert row["verdict"] == ("reproduces" if lo > 0.5 else "does not reproduce" if hi < 0.5 else "inconclusive")
