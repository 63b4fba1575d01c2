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
    assert len(ll) == len(forgetting.grid(forgetting.QUICK)) * forgetting.SIZES["loglinear_seeds"][1]
    by_lr = ll.groupby("lr").forgetting.mean()
    assert by_lr.iloc[-1] > 10 * by_lr.iloc[0] > 0                  # a larger learning rate forgets more
    bf16 = ll[ll.storage == "bf16"]
    assert (bf16.sparsity_bf16 <= bf16.sparsity + 1e-12).all()
    shares = pd.read_csv(out / "shares.csv")
    sums = shares.groupby(["student", "outcome"]).share.sum()
    assert np.allclose(sums, 1.0, atol=1e-9)
    top = shares[shares.term != "higher order"].sort_values("share").groupby(["student", "outcome"]).tail(1)
    assert (top[top.outcome == "forgetting"].term == "lr").all()


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
                                     clip=False, storage="float32", seed=seed, forgetting=f,
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
                              storage="float32", seed=seed, quality=q, forgetting=f * (1 + 0.001 * seed),
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
                rows.append(dict(lr=lr, storage=storage, seed=seed, alpha=0.0, sparsity=sparsity + 0.01 * seed,
                                 sparsity_bf16=served + 0.01 * seed))
    v = pd.DataFrame(forgetting.precision_rows(pd.DataFrame(rows))).set_index("condition")
    assert v.loc["loglinear, float32", "verdict"] == "does not reproduce"
    assert v.loc["loglinear, bf16 storage (no master weights)", "estimate"] == pytest.approx(0.5)
    assert v.loc["loglinear, bf16 storage (no master weights)", "verdict"] == "reproduces"
    assert v.loc["loglinear, mixed precision: the float32 master weights", "verdict"] == "does not reproduce"
    assert v.loc["loglinear, mixed precision: the bf16 copy it serves", "verdict"] == "reproduces"
