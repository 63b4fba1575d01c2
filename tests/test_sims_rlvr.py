"""sims/rlvr.py: the E4 and E6 tables on synthetic curves with known answers, and the script end to end."""

import itertools

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from conftest import assert_usage_error, run_script


# ------------------------------------------------------------------------------------------------
# the E4 and E6 tables on synthetic curves with known answers
# ------------------------------------------------------------------------------------------------
def _synthetic_curves(edge_distil, edge_rl, n=12, tasks=2, noise_sd=0.005):
    rng = np.random.default_rng(0)
    rows = []
    for condition in ("shared", "unshared"):
        for task_id, seed in itertools.product(range(tasks), range(n // tasks)):
            base = 0.3 + 0.1 * rng.normal(size=2)
            for method in ("offline FKL", "on-policy FKL", "offline RKL", "on-policy RKL"):
                on = method.startswith("on")
                noise = noise_sd * rng.normal(size=2)
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
    (0.0, 0.05, "inconclusive"),              # too noisy to tell: report the MDE
])
def test_e4_verdicts_by_rule_with_task_clusters(edge_rl, noise_sd, verdict):
    from sims import rlvr
    v = rlvr.verdicts(_synthetic_curves(0.1, edge_rl, n=12, tasks=6, noise_sd=noise_sd))
    edge, survive = v[v.claim.str.contains("exists")], v[v.claim.str.contains("survive")]
    assert len(edge) == len(survive) == 4 and (edge.verdict == "reproduces").all()
    assert (survive.verdict == verdict).all(), survive[["condition", "estimate", "lo", "hi", "verdict"]]
    assert edge.statistic.str.contains("mean of 6 task means").all()
    assert survive.statistic.str.contains("80% power").all() and survive.statistic.str.contains("TOST p").all()


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
    assert len(v[v.claim.str.contains("control")]) == 8


def test_e6_table_on_curves_with_known_crossings():
    from sims import rlvr
    rows = []
    for seed in range(3):
        for step in range(0, 11):                  # offline: cost 1000 from the start, KL 1 / (1 + step)
            rows.append(dict(student="loglinear", condition="shared", task=0, seed=seed, method="offline FKL",
                             objective="fkl", stage="distil",
                             step=step, teacher_tokens=1000, student_tokens=0, kl_arithmetic=1 / (1 + step),
                             kl_local=1.0, id_accuracy=0.5))
            # on-policy: 300 tokens a step, KL 2 / (1 + step): KL at cost 1000 (step 3) = 0.5, reaches 1/11 at step 21
            rows.append(dict(student="loglinear", condition="shared", task=0, seed=seed, method="on-policy FKL",
                             objective="fkl",
                             stage="distil", step=step, teacher_tokens=200 * step, student_tokens=100 * step,
                             kl_arithmetic=2 / (1 + step), kl_local=1.0, id_accuracy=0.05 * step))
        rows.append(dict(rows[-2], method="offline RKL", objective="rkl", kl_local=0.1))
    e6 = rlvr.e6_table(pd.DataFrame(rows)).set_index("method")
    on = e6.loc["on-policy FKL"]
    assert on.cost == 3000 and on.kl_at_offline_cost == pytest.approx(0.5) and np.isnan(on.cost_to_offline_kl)
    assert on.reached_offline_kl == "0/3"
    # ID accuracy 0.05 step reaches the offline 0.5 (within 0.001) at step 10: cost 3000, 3x the offline arm's
    assert on.cost_to_offline_accuracy == 3000 and on.reached_offline_accuracy == "3/3"
    v = rlvr.verdicts(pd.DataFrame(rows).assign(ood_accuracy=0.1)).set_index("claim")
    parity = v.loc["E6 offline traces reach parity with on-policy distillation at a lower cost "
                   "(final ID accuracy (within 0.001))"]
    assert parity.estimate == pytest.approx(3.0) and parity.verdict == "reproduces"
    kl = v.loc["E6 offline traces reach parity with on-policy distillation at a lower cost (final KL to the target)"]
    assert kl.estimate == pytest.approx(3.0) and "reached in 0 of 3 runs" in kl.statistic     # never: its whole budget
    off = e6.loc["offline FKL"]
    assert off.cost == 1000 and off.kl_target == pytest.approx(1 / 11) and off.cost_to_offline_kl == 1000


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
    assert set(v.verdict) <= {"reproduces", "does not reproduce", "inconclusive"}
    e4_rows, e6_rows = v[v.claim.str.startswith("E4")], v[v.claim.str.startswith("E6")]
    assert len(e4_rows) == 2 * 2 * 2 * 4                      # students x conditions x objectives x claims
    assert len(e4_rows[e4_rows.claim.str.contains("control")]) == 16
    for pool, n in (("256", 4), ("1,024", 16), ("4,096", 4)):   # E6 against each pool; the neural student: 1,024
        assert e6_rows.condition.str.contains(f"({pool} traces)", regex=False).sum() == n, pool
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


@pytest.mark.parametrize("bad", [["--seeds", "0"], ["--only", "nope"], ["--full"], ["--executor", "mpi"]])
def test_rlvr_bad_arguments_exit_2_with_one_line(bad, tmp_path):
    proc = run_script("sims/rlvr.py", *bad, "--quick", "--out", tmp_path, check=False, timeout=60)
    assert_usage_error(proc)
