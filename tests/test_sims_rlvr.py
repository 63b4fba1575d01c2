"""sims/rlvr.py: the E4 and E6 tables on synthetic curves with known answers, and the script end to end."""

import itertools

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis import verdicts
from conftest import assert_usage_error, run_script


# ------------------------------------------------------------------------------------------------
# the E4 and E6 tables on synthetic curves with known answers
# ------------------------------------------------------------------------------------------------
def _synthetic_curves(edge_distil, edge_rl, n=12, tasks=2, noise_sd=0.005, rl_noise_sd=None):
    rng = np.random.default_rng(0)
    rows = []
    for condition in ("shared", "unshared"):
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
    geometric mean with the censored run at its budget, lo the one-sided t bound; the offline arm never
    reaches the final KL of the tasks whose on-policy arm ends below 1/11."""
    from sims import rlvr
    v = rlvr.verdicts(_e6_curves((0.5, 0.5, 2.0)).assign(ood_accuracy=0.1))
    kl = v[v.claim.str.contains("to reach the offline arm's final KL") & (v.student_token_cost == 1.0)].iloc[0]
    reached = _log_linear_crossing(600, 750, 0.5 / 5, 0.5 / 6, 1 / 11) / 1000
    logs = np.log([reached, reached, 1.5])
    bound = logs.mean() - stats.t.ppf(0.95, 2) * logs.std(ddof=1) / np.sqrt(3)
    assert kl.estimate == pytest.approx(np.exp(logs.mean()), rel=1e-9) and kl.lo == pytest.approx(np.exp(bound))
    assert kl.statistic.startswith("at least") and "reached in 2 of 3 runs" in kl.statistic
    assert kl.verdict == "inconclusive" and kl.hi == np.inf
    reverse = v[v.claim.str.contains("offline arm reaches")].iloc[0]
    assert reverse.verdict == "reproduces under stated conditions" and "1 of 3 runs" in reverse.statistic


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
    assert set(v.verdict) <= set(verdicts.VERDICTS)
    e4_rows, e6_rows = v[v.claim.str.startswith("E4")], v[v.claim.str.startswith("E6")]
    assert len(e4_rows) == 2 * 2 * 2 * 5                      # students x conditions x objectives x claims
    assert len(e4_rows[e4_rows.claim.str.contains("control")]) == 24
    assert list(v.columns) == list(rlvr.VERDICT_COLUMNS) and e4_rows.df.dropna().isin([1]).all()
    # E6 against each pool (the neural student: 1,024): runs x 2 end points x 3 prices, and the reverse
    for pool, n in (("256", 2), ("1,024", 8), ("4,096", 2)):
        assert e6_rows.condition.str.contains(f"({pool} traces)", regex=False).sum() == n * (2 * 3 + 1), pool
    assert set(e6_rows.student_token_cost.dropna()) == set(rlvr.STUDENT_TOKEN_COSTS)
    one_task = v[v.condition.str.startswith("neural") & v.claim.str.contains("survive")]
    assert (one_task.verdict == "inconclusive").all() and one_task.statistic.str.contains("one task").all()
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
