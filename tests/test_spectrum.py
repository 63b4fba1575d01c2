"""The empirical study in simulation, part 1 (SPEC 4-5; claims E1, E2, E5): the tabular student's fixed points
under every objective, the SFT fixed point as a function of alpha against a brute-force enumeration, the
k1-on-teacher-samples divergence, the estimators' exact moments against closed forms and Monte Carlo through
llm_bridge.losses, and the two scripts end to end.

Tolerances. The candidate targets of the tree task (K = 2) are at least 0.029 nats per position apart
(A, l, g and the mixture's conditionals, measured by sequence_kl on each other's rollouts): a learner within
TOL = 0.01 of its named target and more than 2 TOL from the others has reached that target and no other.
The learners run 300 Adam steps (lr 0.05, 64 sequences a step); their noise floor, from the learning rate
and the batch, is a few 1e-3 nats per position on this task, under TOL.
"""

import itertools
import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import assert_usage_error, run_script
from scipy.special import logsumexp

import aggregation as ag
from llm_bridge.losses import kl_estimator_loss
from distillation import evaluation, fixed_points, tasks, training
from distillation import moments

TOL = 0.01


# ------------------------------------------------------------------------------------------------
# the SFT fixed point against a brute-force enumeration of responses
# ------------------------------------------------------------------------------------------------
def brute_sft(task, alpha):
    """The labels' distribution at every (step, state) by enumerating every response prefix (not by the
    occupancy recursion): teacher k ~ w writes with prob 1 - alpha and labels its own tokens; the student
    (the fixed point itself, solved step by step) writes with prob alpha and a teacher k ~ w labels."""
    t, w, H = task.teachers, task.weights, task.horizon
    p = np.exp(t.log_probs)
    A = np.tensordot(w, p, axes=1)
    q = np.full((H, t.S, t.n), np.nan)
    for h in range(H):
        mass = np.zeros((t.S, t.n))
        for prefix in itertools.product(range(t.n), repeat=h):
            s, pk, pq = t.start, w.copy(), 1.0
            for j, a in enumerate(prefix):
                pk, pq, s = pk * p[:, s, a], pq * math.exp(q[j, s, a]), t.next_state[s, a]
                if s < 0:
                    break
            if s < 0:
                continue
            mass[s] += (1 - alpha) * pk @ p[:, s] + alpha * pq * A[s]
        seen = mass.sum(1) > 0
        q[h, seen] = np.log(mass[seen] / mass[seen].sum(1, keepdims=True))
        q[h, ~seen] = np.log(A[~seen])
    return q


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_sft_fixed_point_equals_the_enumerated_label_distribution(alpha):
    task = tasks.make_task("tree", K=2, seed=3)
    np.testing.assert_allclose(fixed_points.sft_fixed_point(task, alpha), brute_sft(task, alpha), atol=1e-12)


def test_sft_fixed_point_is_the_mixture_at_alpha_0_and_A_at_alpha_1_and_moves_between():
    task = tasks.make_task("tree", K=2, seed=0)
    t, w = task.teachers, task.weights
    at0 = fixed_points.sft_fixed_point(task, 0.0)
    for path in itertools.product(range(t.n), repeat=task.horizon):     # every state of the tree, once
        mix = ag.mixture_conditionals(t, w, list(path))
        s = t.start
        for h, a in enumerate(path):
            np.testing.assert_allclose(at0[h, s], mix[h], atol=1e-12)
            s = t.next_state[s, a]
    np.testing.assert_allclose(fixed_points.sft_fixed_point(task, 1.0), fixed_points.target_table(task, "arithmetic"), atol=1e-12)
    theory = [ag.sequence_kl(t, w, task.horizon, fixed_points.sft_fixed_point(task, a), target=fixed_points.target_table(task, "arithmetic"))
              for a in np.linspace(0, 1, 11)]
    assert theory[0] > 0.05 and theory[-1] == pytest.approx(0.0, abs=1e-12)
    assert np.all(np.diff(theory) < 0)                        # it moves monotonically from the mixture to A
    one = tasks.make_task("tree", K=1, seed=0)                     # one teacher: nothing to move
    np.testing.assert_allclose(fixed_points.sft_fixed_point(one, 0.0), fixed_points.sft_fixed_point(one, 1.0), atol=1e-12)


def test_evaluator_kl_matches_a_monte_carlo_of_the_log_ratio_on_the_students_rollouts():
    task = tasks.make_task("tree", K=2, seed=1)
    t, H = task.teachers, task.horizon
    rng = np.random.default_rng(0)
    log_q = np.log(rng.dirichlet(np.ones(t.n), size=(H, t.S)))
    cfg = dict(objective="sft", alpha=0.5, switch=False, importance=False)
    out = evaluation.Evaluator(task)(log_q, cfg)
    tables = {name: fixed_points.target_table(task, name, 0.5) for name in fixed_points.TARGETS + ("sft",)}
    tables["fixed_point"] = fixed_points.fixed_point(task, cfg)
    N = 20000
    logs = {name: np.zeros(N) for name in tables}
    for i in range(N):
        s = t.start
        for h in range(H):
            a = rng.choice(t.n, p=np.exp(log_q[h, s]))
            for name, table in tables.items():
                logs[name][i] += log_q[h, s, a] - table[h, s, a]
            s = t.next_state[s, a]
    for name, v in logs.items():
        assert abs(v.mean() - out[f"kl_{name}"]) < 4 * v.std() / math.sqrt(N), name
    assert out["accuracy"] == pytest.approx(np.exp(log_q[0, t.start, 0]))


# ------------------------------------------------------------------------------------------------
# the tabular student's fixed points
# ------------------------------------------------------------------------------------------------
CONFIGS = [  # (objective, alpha, importance): where it must land, and the competing target it must avoid
    ("fkl", 0.0, False, "arithmetic", "local"), ("fkl", 1.0, False, "arithmetic", "local"),
    ("rkl", 0.0, False, "local", "arithmetic"), ("rkl", 1.0, False, "local", "arithmetic"),
    ("sft", 0.0, False, "mixture", "arithmetic"), ("sft", 1.0, False, "arithmetic", "mixture"),
    ("k2", 1.0, False, "local", "arithmetic"), ("k3", 1.0, False, "local", "arithmetic"),
    ("k3-teacher", 1.0, False, "arithmetic", "local"), ("pg0", 1.0, False, "local", "geometric"),
    ("pg1", 1.0, False, "geometric", "local"), ("pg1", 0.0, True, "geometric", "local"),
    ("k2", 0.0, True, "local", "arithmetic"),
    ("k3-teacher", 0.0, True, "mixture", "arithmetic"),   # routed to the teacher that wrote it: posterior weights
]
NO_CLOSED_FORM = [("k2", 0.0), ("k3", 0.0), ("k3-teacher", 0.0), ("k2", 0.5)]   # unweighted teacher samples


@pytest.fixture(scope="module")
def trained():
    task = tasks.make_task("tree", K=2, seed=0)
    configs = [dict(objective=o, alpha=a, switch=False, importance=i, clip=False) for o, a, i, _, _ in CONFIGS]
    configs += [dict(objective=o, alpha=a, switch=False, importance=False, clip=False)
                for o, a in NO_CLOSED_FORM + [("k1", 0.0), ("k1", 1.0), ("sft", 0.5)]]
    df = training.train_tabular(task, configs, seeds=[0, 1], steps=300, batch=64, lr=0.05, eval_every=300, seed=0)
    last = df[df.step == 300].copy()
    for name in fixed_points.TARGETS + ("sft", "fixed_point"):
        last[f"kl_{name}"] = last[f"kl_{name}"] / task.horizon
    return task, last.groupby(["objective", "alpha", "importance"]).mean(numeric_only=True)


def test_the_candidate_targets_are_far_apart_compared_with_the_tolerance():
    task = tasks.make_task("tree", K=2, seed=0)
    ev = evaluation.Evaluator(task)
    for a, b in itertools.permutations(fixed_points.TARGETS, 2):
        assert ev(fixed_points.target_table(task, a))[f"kl_{b}"] / task.horizon > 2.9 * TOL, (a, b)


@pytest.mark.parametrize("objective, alpha, importance, target, other", CONFIGS)
def test_each_objective_reaches_its_derived_fixed_point_and_not_the_competing_one(trained, objective, alpha,
                                                                                   importance, target, other):
    _, final = trained
    row = final.loc[(objective, alpha, importance)]
    assert row[f"kl_{target}"] < TOL, row
    assert row[f"kl_{other}"] > 2 * TOL, row


def test_sft_at_an_interior_alpha_reaches_its_own_fixed_point(trained):
    _, final = trained
    row = final.loc[("sft", 0.5, False)]
    assert row.kl_sft < TOL / 2 and row.kl_sft < row.kl_arithmetic and row.kl_sft < row.kl_mixture


@pytest.mark.parametrize("objective, alpha", NO_CLOSED_FORM)
def test_unweighted_teacher_samples_reach_the_solved_fixed_point_and_not_the_nominal_target(trained, objective,
                                                                                           alpha):
    _, final = trained
    row = final.loc[(objective, alpha, False)]
    assert row.kl_fixed_point < TOL, row
    assert row.kl_named > TOL, row                        # the departure the solved point explains


def test_estimator_fixed_point_closed_forms():
    """The solver against the closed forms it must reproduce: l for pooled losses on the student's samples
    or with importance weights, A for k3-teacher on the student's samples, and, routed with weights on the
    teachers' samples, SFT's fixed point (the same label distribution) at every alpha."""
    task = tasks.make_task("tree", K=2, seed=0)
    t = task.teachers
    l, A = fixed_points.target_table(task, "local"), fixed_points.target_table(task, "arithmetic")
    reached = ag.policy_occupancy(t, task.horizon, l)[:-1] > 0        # (step, state) pairs a response visits
    for obj, alpha, imp in (("k2", 1.0, False), ("k3", 1.0, False), ("k2", 0.0, True), ("k3", 0.3, True)):
        np.testing.assert_allclose(fixed_points.estimator_fixed_point(task, obj, alpha, imp)[reached], l[reached], atol=1e-8)
    np.testing.assert_allclose(fixed_points.estimator_fixed_point(task, "k3-teacher", 1.0)[reached], A[reached], atol=1e-8)
    for alpha in (0.0, 0.3, 0.7):
        fp, sft = fixed_points.estimator_fixed_point(task, "k3-teacher", alpha, True), fixed_points.sft_fixed_point(task, alpha)
        np.testing.assert_allclose(fp[reached], sft[reached], atol=1e-8)
    unweighted = fixed_points.estimator_fixed_point(task, "k3", 0.0)
    assert ag.sequence_kl(t, task.weights, task.horizon, unweighted, target=l) / task.horizon > 2 * TOL
    with pytest.raises(ValueError, match="estimator fixed point"):
        fixed_points.estimator_fixed_point(task, "k1", 0.0)


def test_sampled_token_losses_on_unweighted_teacher_samples_miss_l(trained):
    _, final = trained
    for obj in ("k2", "k3"):
        off, on, weighted = (final.loc[(obj, 0.0, False)].kl_local, final.loc[(obj, 1.0, False)].kl_local,
                             final.loc[("k2", 0.0, True)].kl_local)
        assert off > 2 * TOL and on < TOL and weighted < TOL


def test_k1_as_a_loss_diverges_on_teacher_samples_and_does_not_move_on_the_students(trained):
    _, final = trained
    off, on = final.loc[("k1", 0.0, False)], final.loc[("k1", 1.0, False)]
    assert off.max_logit > 0.75 * evaluation.DIVERGED_LOGIT and off.accuracy < 1e-6       # the teacher's tokens pushed down
    assert on.max_logit < 0.2 * evaluation.DIVERGED_LOGIT


def test_divergence_is_flagged():
    task = tasks.make_task("tree", K=2, seed=0)
    cfg = dict(objective="k1", alpha=0.0, switch=False, importance=False, clip=False)
    df = training.train_tabular(task, [cfg], seeds=[0], steps=600, batch=64, lr=0.2, eval_every=600)
    last = df[df.step == 600].iloc[0]
    assert last.diverged and last.max_logit > evaluation.DIVERGED_LOGIT


def test_training_is_deterministic_and_runs_are_independent_of_their_neighbours():
    task = tasks.make_task("tree", K=2, seed=0)
    a = dict(objective="fkl", alpha=0.5, switch=False, importance=False, clip=True)
    b = dict(objective="rkl", alpha=0.2, switch=True, importance=False, clip=False)
    one = training.train_tabular(task, [a, b], seeds=[0], steps=20, eval_every=10)
    two = training.train_tabular(task, [a, b], seeds=[0], steps=20, eval_every=10)
    pd.testing.assert_frame_equal(one, two)
    assert one.kl_named.iloc[-1] < one.kl_named.iloc[3]                     # it learns


def test_the_neural_student_reads_the_prefix_and_learns_fkl():
    task = tasks.make_task("tree", K=2, seed=0)
    cfg = dict(objective="fkl", alpha=0.5, switch=False, importance=False, clip=True)
    df = training.train_neural(task, cfg, seed=0, steps=40, batch=32, eval_every=40)
    first, last = df.kl_named.iloc[0], df.kl_named.iloc[-1]
    assert last < 0.2 * first


def test_bad_input():
    task = tasks.make_task("tree", K=2, seed=0)
    with pytest.raises(ValueError, match="alpha"):
        fixed_points.sft_fixed_point(task, 1.5)
    with pytest.raises(ValueError, match="target"):
        fixed_points.target_table(task, "median")
    with pytest.raises(ValueError, match="kind"):
        tasks.make_task("ring")


# ------------------------------------------------------------------------------------------------
# estimators: exact moments (closed forms) and Monte Carlo through llm_bridge.losses
# ------------------------------------------------------------------------------------------------
def pair(seed, n=12, spread=1.0):
    rng = np.random.default_rng(seed)
    zq, zp = rng.normal(0, spread, n), rng.normal(0, spread, n)
    return zq - logsumexp(zq), zp - logsumexp(zp)


def test_value_moments_closed_forms_and_monte_carlo():
    lq, lp = pair(0)
    q = np.exp(lq)
    kl = float(q @ (lq - lp))
    m = moments.value_moments(lq, lp)
    assert m["k1"][0] == pytest.approx(kl, abs=1e-14) and m["k3"][0] == pytest.approx(kl, abs=1e-14)
    assert m["k2"][0] == pytest.approx(0.5 * q @ (lq - lp) ** 2)
    rng = np.random.default_rng(1)
    x = rng.choice(lq.size, size=200_000, p=q)
    for name, v in moments.estimator_values(lp[x] - lq[x]).items():
        mean, var = m[name]
        assert abs(v.mean() - mean) < 5 * math.sqrt(var / x.size), name
        assert v.var() == pytest.approx(var, rel=0.05), name


@pytest.mark.parametrize("estimator, source, importance, expected", [
    ("k2", "student", False, "rkl"), ("k3", "student", False, "fkl"), ("k3", "teacher", True, "fkl"),
    ("k2", "teacher", True, "rkl"), ("k1", "student", False, "zero"), ("k1", "teacher", False, "-fkl")])
def test_loss_gradient_expectations_are_the_derived_ones(estimator, source, importance, expected):
    lq, lp = pair(2)
    q, p = np.exp(lq), np.exp(lp)
    ref = {"rkl": q * ((lq - lp) - q @ (lq - lp)), "fkl": q - p, "zero": 0 * q, "-fkl": p - q}[expected]
    mean, _ = moments.gradient_moments(lq, lp, estimator, "loss", source, importance)
    np.testing.assert_allclose(mean, ref, atol=1e-14)


def test_k1_as_a_reward_on_student_samples_is_the_rkl_gradient():
    lq, lp = pair(3)
    q = np.exp(lq)
    mean, _ = moments.gradient_moments(lq, lp, "k1", "reward", "student")
    np.testing.assert_allclose(mean, q * ((lq - lp) - q @ (lq - lp)), atol=1e-14)


@pytest.mark.parametrize("estimator, source, importance", [("k2", "student", False), ("k3", "teacher", True),
                                                           ("k3", "teacher", False), ("k1", "teacher", False)])
def test_gradient_moments_match_monte_carlo_through_the_loss_code(estimator, source, importance):
    """Per-sample gradients of llm_bridge.losses.kl_estimator_loss (autograd) on sampled tokens: their mean
    and covariance trace against gradient_moments."""
    lq, lp = pair(4, n=8)
    N = 40000
    gen = torch.Generator().manual_seed(0)
    s = torch.as_tensor(np.exp(lq if source == "student" else lp))
    x = torch.multinomial(s, N, replacement=True, generator=gen)
    logits = torch.as_tensor(lq).expand(N, 1, -1).clone().requires_grad_()
    t_tok = torch.as_tensor(lp)[x].view(1, N, 1)
    rho = (torch.as_tensor(lq) - torch.log(s))[x].exp().view(N, 1) if importance else None
    loss, _ = kl_estimator_loss(logits, x.view(N, 1), t_tok, torch.ones(1, dtype=torch.float64), None,
                                estimator=estimator, pool="before", importance_weights=rho, reduction="sum")
    (g,) = torch.autograd.grad(loss, logits)
    g = g[:, 0].numpy()
    mean, trace = moments.gradient_moments(lq, lp, estimator, "loss", source, importance)
    se = np.sqrt(g.var(0) / N)
    assert np.all(np.abs(g.mean(0) - mean) < 5 * se + 1e-12)
    assert g.var(0).sum() == pytest.approx(trace, rel=0.05)


def test_sequence_importance_weight_second_moment_against_enumeration():
    rng = np.random.default_rng(5)
    next_state = rng.integers(0, 4, size=(4, 3))
    lq, lp = np.log(rng.dirichlet(np.ones(3), size=4)), np.log(rng.dirichlet(np.ones(3), size=4))
    exact = moments.sequence_is_second_moment(next_state, 0, 5, lq, lp)
    for H in range(6):
        ref = sum(math.exp(sum(2 * lq[s, a] - lp[s, a] for s, a in walk(next_state, path)))
                  for path in itertools.product(range(3), repeat=H))
        assert exact[H] == pytest.approx(math.log(ref), abs=1e-10)
    assert exact[1] == pytest.approx(logsumexp(2 * lq[0] - lp[0]))                    # sum_x q^2 / p


def walk(next_state, path):
    s = 0
    for a in path:
        yield s, a
        s = next_state[s, a]


def test_importance_weights_on_a_tree_with_ends():
    task = tasks.make_task("tree", K=2, seed=0)
    t = task.teachers
    rng = np.random.default_rng(6)
    lq = np.log(rng.dirichlet(np.ones(t.n), size=t.S))
    lp = np.asarray(t.log_probs[0])
    exact = moments.sequence_is_second_moment(t.next_state, t.start, 5, lq, lp)     # the tree ends after 3 tokens
    ref = sum(math.exp(sum(2 * lq[s, a] - lp[s, a] for s, a in walk(t.next_state, path)))
              for path in itertools.product(range(t.n), repeat=3))
    assert exact[3] == pytest.approx(math.log(ref), abs=1e-10)
    assert exact[5] == pytest.approx(exact[3], abs=1e-10)                     # nothing after the end


def test_topk_k3_bias_identity_and_full_vocabulary():
    lq, lp = pair(7, n=40)
    for k in (1, 5, 20, 40):
        e_k3, kl, tail = moments.topk_k3_bias(lq, lp, k)
        top = np.argsort(-lq)[:k]
        qt = np.exp(lq[top]) / np.exp(lq[top]).sum()
        assert kl == pytest.approx(float(qt @ (np.log(qt) - lp[top])), abs=1e-12)
        assert tail == pytest.approx(1 - np.exp(lp[top]).sum(), abs=1e-12)
        assert e_k3 == pytest.approx(kl - tail, abs=1e-12)
    assert tail == pytest.approx(0.0, abs=1e-12) and e_k3 == pytest.approx(float(np.exp(lq) @ (lq - lp)), abs=1e-12)


def test_samples_needed():
    target = np.array([1.0, 0.0])
    assert moments.samples_needed(target, 2.0, target, rel_error=0.1) == pytest.approx(2.0 / 0.01)
    assert moments.samples_needed(np.array([1.2, 0.0]), 2.0, target, rel_error=0.1) == math.inf    # bias alone too big


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
    cfg = dict(objective="k3", alpha=0.3, switch=False, importance=False)
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
