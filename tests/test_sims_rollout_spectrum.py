"""sims/rollout_spectrum.py and sims/estimators.py end to end: quick runs, determinism, resume, bad arguments,
figures."""

import math

import numpy as np
import pandas as pd
import pytest

import aggregation as ag
from conftest import assert_usage_error, run_script
from distillation import evaluation, fixed_points, tasks
from distillation.configs import SpectrumConfig

TOL = 0.01


# ------------------------------------------------------------------------------------------------
# the scripts end to end
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_spectrum(quick_run):
    return quick_run("rollout_spectrum")


@pytest.mark.integration
def test_rollout_spectrum_quick_end_to_end(quick_spectrum):
    out = quick_spectrum
    for name in ("spectrum.csv", "neural.csv", "robustness.csv", "sft_theory.csv", "summary.csv", "conclusions.csv",
                 "figures/spectrum.png", "figures/spectrum_neural.png"):
        assert (out / name).exists(), name
    tab = pd.read_csv(out / "spectrum.csv")
    assert set(tab.objective) == set(fixed_points.OBJECTIVES) and tab.switch.any() and tab.importance.any()
    assert set(pd.read_csv(out / "robustness.csv").H) == {16}
    theory = pd.read_csv(out / "sft_theory.csv")
    assert theory.alpha.nunique() >= 11
    c = pd.read_csv(out / "conclusions.csv")
    flat = c[c.conclusion.str.startswith("E1: FKL") & c.condition.str.startswith("tree")]
    assert flat.holds.all()
    neural = pd.read_csv(out / "neural.csv")
    assert np.isfinite(neural.kl_named).all()


@pytest.mark.integration
def test_rollout_spectrum_is_deterministic_and_resumes(quick_spectrum, tmp_path):
    run_script("sims/rollout_spectrum.py", "--quick", "--only", "tabular", "--out", tmp_path, "--quiet",
               "--no-figures")
    assert (tmp_path / "spectrum.csv").read_bytes() == (quick_spectrum / "spectrum.csv").read_bytes()
    proc = run_script("sims/rollout_spectrum.py", "--quick", "--out", quick_spectrum, "--resume", "--no-figures")
    assert "(8 resumed)" in proc.stderr


@pytest.mark.integration
def test_estimators_quick_end_to_end_and_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run_script("sims/estimators.py", "--quick", "--out", a, "--quiet")
    run_script("sims/estimators.py", "--quick", "--out", b, "--quiet", "--no-figures")
    for name in ("values.csv", "gradients.csv", "is_horizon.csv", "topk.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "figures" / "estimators.png").exists()
    v = pd.read_csv(a / "values.csv")
    tok = v[(v.kind == "token") & v.estimator.isin(["k1", "k2"])]
    assert (np.abs(tok.mc_mean - tok.exact_mean) < 5 * tok.mc_se).all()
    seq = v[(v.kind == "sequence") & (v.estimator == "k1")]
    assert (np.abs(seq.mc_mean - seq.kl) < 5 * seq.mc_se).all()        # E[sum of k1] = KL_seq exactly
    h = pd.read_csv(a / "is_horizon.csv")
    assert (np.diff(h[h.teacher == 0].log_second_moment) > 0).all()
    assert pd.read_csv(a / "topk.csv").identity_error.abs().max() < 1e-10


@pytest.mark.parametrize("script", ["sims/rollout_spectrum.py", "sims/estimators.py"])
@pytest.mark.parametrize("bad", [["--seeds", "0"], ["--only", "nope"], ["--executor", "mpi"]])
def test_bad_arguments_exit_2_with_one_line(script, bad, tmp_path):
    proc = run_script(script, *bad, "--quick", "--out", tmp_path, check=False, timeout=60)
    assert_usage_error(proc)



def test_evaluator_equals_aggregation_sequence_kl():
    task = tasks.make_task("tree", K=2, seed=2)
    t = task.teachers
    rng = np.random.default_rng(1)
    log_q = np.log(rng.dirichlet(np.full(t.n, 0.3), size=(task.horizon, t.S)))
    cfg = SpectrumConfig(objective="k3", alpha=0.3, switch=False, importance=False)
    out = evaluation.Evaluator(task)(log_q, cfg)
    tables = {name: fixed_points.target_table(task, name) for name in fixed_points.TARGETS} | {"fixed_point": fixed_points.fixed_point(task, cfg)}
    for name, table in tables.items():
        ref = ag.sequence_kl(t, task.weights, task.horizon, log_q, target=table)
        assert out[f"kl_{name}"] == pytest.approx(ref, rel=1e-12, abs=1e-14), name
    assert out["kl_local"] == pytest.approx(ag.sequence_kl(t, task.weights, task.horizon, log_q, target="local"),
                                            rel=1e-12)
    assert math.isnan(out["kl_sft"])


@pytest.mark.integration
def test_spectrum_figures_are_built_from_the_csvs(quick_spectrum, tmp_path):
    from figures import spectrum as fs
    from figures.style import TWO_COLUMNS
    figs = fs.figures_from(str(quick_spectrum))
    assert set(figs) == {"spectrum", "spectrum_neural"}
    fig = figs["spectrum"]
    assert fig.get_size_inches()[0] == pytest.approx(TWO_COLUMNS)
    exact, sampled, pg, theory = fig.axes[:4]
    assert len(exact.get_lines()) >= 3 and len(sampled.get_lines()) >= 6 and len(theory.get_lines()) == 2
    alphas, kl_to_a = theory.get_lines()[0].get_data()
    assert kl_to_a[0] > 0.05 and kl_to_a[-1] == pytest.approx(0.0, abs=1e-12)    # SFT's point: mixture -> A
    assert all(ax.get_xlabel() for ax in fig.axes[:4])
