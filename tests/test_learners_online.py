"""The online learners (learners/online.py) against closed forms and brute force, and their numba kernels
against the NumPy twins (learners/_kernels.py, learners/_reference.py)."""

import math

import numpy as np
import pytest
from scipy.special import gammaln, logsumexp

import aggregation as ag
import analysis
from aggregation import examples
from aggregation.validate import read_only
from learners import _kernels, _reference, closed_forms, online


# ------------------------------------------------------------------------------------------------
# off-policy: add-beta against closed forms
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_kt_and_laplace_constant_sequence_equal_closed_forms(n):
    T = 100_000
    uniform = np.full((1, n), 1.0 / n)
    kt = online.add_beta_tabular(uniform, [1.0], 0.5, T, [0], sequence="constant")
    np.testing.assert_allclose(kt["regret"][0], closed_forms.kt_worst_case(kt["grid"], n), rtol=1e-12, atol=1e-8)
    lap = online.add_beta_tabular(uniform, [1.0], 1.0, T, [0], sequence="constant")
    t = lap["grid"].astype(float)
    ln_binom = gammaln(t + n) - gammaln(n) - gammaln(t + 1)        # ln binom(T+n-1, n-1)
    np.testing.assert_allclose(lap["regret"][0], ln_binom, rtol=1e-12, atol=1e-8)
    if n == 2:
        np.testing.assert_allclose(lap["regret"][0], np.log(t + 1), atol=1e-8)


@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_add_beta_round_robin_closed_form_and_slopes(beta):
    n, T = 3, 30_000
    res = online.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, T, [0], sequence="round-robin")
    np.testing.assert_allclose(res["regret"][0], closed_forms.add_beta_round_robin(res["grid"], n, beta), atol=1e-8)
    const = online.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, T, [0], sequence="constant")
    # worst-case slope (n-1) max(beta, 1/2): the round-robin attains (n-1)/2, the constant (n-1) beta
    worst = max(analysis.fit_slope(res["grid"], res["regret"])[0], analysis.fit_slope(const["grid"], const["regret"])[0])
    assert worst == pytest.approx((n - 1) * max(beta, 0.5), rel=0.02)


def test_add_beta_regret_is_realised_loss_minus_hindsight_brute_force():
    """An explicit token sequence: the learner's log loss minus the empirical-frequency log loss."""
    seq = np.array([0, 1, 1, 2, 1, 0, 2, 2, 2])
    n, beta = 3, 0.5
    loss, counts, want = 0.0, np.zeros(n), []
    for t, y in enumerate(seq):
        loss -= math.log((counts[y] + beta) / (t + n * beta))
        counts[y] += 1
        seen = counts[counts > 0]
        want.append(loss + float(np.sum(seen * np.log(seen / (t + 1)))))
    res = online.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, len(seq), [0], sequence=seq,
                             grid=np.arange(1, len(seq) + 1))
    np.testing.assert_allclose(res["regret"][0], want, rtol=0, atol=1e-12)


def test_add_beta_sample_feedback_slope_and_pseudo_regret():
    n = 4
    probs = np.random.default_rng(3).dirichlet(np.ones(n), size=3)
    res = online.add_beta_tabular(probs, [0.5, 0.3, 0.2], 0.5, 100_000, np.arange(8))
    slope = analysis.fit_slope(res["grid"], res["regret"])[0]
    assert slope == pytest.approx((n - 1) / 2, rel=0.01)          # realised regret: nearly deterministic
    assert np.all(np.diff(res["pseudo"], axis=1) >= 0)           # a sum of KLs
    # E KL(A || q_t) = (n-1)/(2t) + O(1/t^2): the pseudo-regret's slope is (n-1)/2 as well; per seed
    # it is a noisy sum (s.d. of the fitted slope about 1.2), so over 256 seeds the 95% interval is
    # about +-0.15 and must hold (n-1)/2
    more = online.add_beta_tabular(probs, [0.5, 0.3, 0.2], 0.5, 100_000, np.arange(256))
    mean, lo, hi = analysis.fit_slope(more["grid"], more["pseudo"])
    assert lo <= (n - 1) / 2 <= hi and hi - lo < 0.4, (mean, lo, hi)


def test_add_beta_sequence_matches_per_state_theory():
    """Realised regret of per-state KT grows like (sum over the 7 states of (n-1)/2) ln T = 3.5 ln T.
    At T = 2e5 with 16 seeds the fitted slope lands within 1% (losing one state gives 3.0, 14% off);
    Laplace's slope is still below (n-1)/2 per state at this T (a finite-T effect: paper_repro T3)."""
    teachers = examples.prefix_tree(3, 3, 2, seed=9)
    res = online.add_beta_sequence(teachers, [0.5, 0.3, 0.2], 3, 0.5, 200_000, np.arange(16))
    assert res["visited"] == 7
    slope, lo, hi = analysis.fit_slope(res["grid"], res["regret"])
    assert slope == pytest.approx(3.5, rel=0.01) and hi - lo < 0.1
    assert np.all(np.diff(res["pseudo"], axis=1) >= -1e-9)


def test_add_beta_sequence_regret_against_enumerated_hindsight():
    """On a prefix tree every distribution over complete responses factorises per node, so the best
    fixed predictor in hindsight is the empirical distribution of whole responses: regret = learner
    loss - sum_y N(y) ln(T / N(y)). Both sides computed here by enumeration, independently of the
    kernel's per-state counts; the responses are replayed from the same random stream."""
    teachers = examples.prefix_tree(2, 3, 2, seed=4)
    w, H, beta, T = np.array([0.6, 0.4]), 3, 0.5, 40
    res = online.add_beta_sequence(teachers, w, H, beta, T, [5], grid=np.arange(1, T + 1))
    stream, cdf = _reference.Stream(online._seeds([5])[0]), np.cumsum(w)
    prob, index = online.alias_tables(np.exp(teachers.log_probs))
    seen, loss, want = {}, 0.0, []
    for t in range(T):
        k = _reference._pick(cdf, stream.uniform()) if len(w) > 1 else 0
        s, path, q = teachers.start, [], 1.0
        for h in range(H):
            a = _reference._alias_pick(prob[k, s], index[k, s], stream.uniform())
            # the learner's q_t(a | prefix): add-beta on the earlier responses that share the prefix
            num = sum(c for y, c in seen.items() if y[:h] == tuple(path) and y[h] == a)
            den = sum(c for y, c in seen.items() if y[:h] == tuple(path))
            q *= (num + beta) / (den + 2 * beta)
            path.append(a)
            s = teachers.next_state[s, a]
            if s < 0:
                break
        loss -= math.log(q)
        seen[tuple(path)] = seen.get(tuple(path), 0) + 1
        want.append(loss - sum(c * math.log((t + 1) / c) for c in seen.values()))
    np.testing.assert_allclose(res["regret"][0], want, rtol=1e-10, atol=1e-10)


def test_tiny_probabilities_stay_finite():
    probs = np.array([[1 - 1e-300, 1e-300], [0.5, 0.5]])
    res = online.add_beta_tabular(probs, [0.5, 0.5], 0.5, 1000, [0, 1])
    assert np.all(np.isfinite(res["regret"])) and np.all(np.isfinite(res["pseudo"]))
    lp = np.log([[1 - 1e-300, 1e-300], [1e-300, 1 - 1e-300]])
    on = online.rkl_tabular(lp, [0.5, 0.5], "alternating", "1/t", 1000, [0])
    assert np.all(np.isfinite(on["regret"])) and on["regret"][0, -1] > 0


# ------------------------------------------------------------------------------------------------
# on-policy: FTL
# ------------------------------------------------------------------------------------------------
def test_ftl_per_round_regret_equals_the_exact_identity():
    """R_T = sum_t t KL(q_t || q_{t+1}) for FTL on f_t = KL(. || p_{k_t}) (F_t(q) = t KL(q||q_{t+1}) + const)."""
    lp = np.log(np.random.default_rng(5).dirichlet(np.ones(3), size=4))
    w = np.array([0.1, 0.2, 0.3, 0.4])
    T = 300
    res = online.rkl_tabular(lp, w, "sample", "1/t", T, [7], grid=np.arange(1, T + 1))
    # replay the same teacher draws from the same stream, then the identity in NumPy
    stream, cdf = _reference.Stream(online._seeds([7])[0]), np.cumsum(w)
    ks = [_reference._pick(cdf, stream.uniform()) for _ in range(T)]
    means = np.cumsum(lp[ks], axis=0) / np.arange(1, T + 1)[:, None]
    log_q = np.vstack([np.full(3, -np.log(3)), means - logsumexp(means, axis=1, keepdims=True)])
    kl = np.sum(np.exp(log_q[:-1]) * (log_q[:-1] - log_q[1:]), axis=1)
    np.testing.assert_allclose(res["regret"][0], np.cumsum(np.arange(1, T + 1) * kl), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("e", [0.1, 1e-2, 1e-3, 1e-4])
def test_alternating_teachers_slope_matches_the_constant(e):
    """Deterministic (no sampling): R_T = c ln T + b + O(1/T), so the slope fitted on [1e4, 1e6] is c up
    to O(1e-5) relative (measured 2e-5); asserted to 1e-4."""
    lp = np.log([[1 - e, e], [e, 1 - e]])
    res = online.rkl_tabular(lp, [0.5, 0.5], "alternating", "1/t", 1_000_000, [0])
    slope = analysis.fit_slope(res["grid"], res["regret"])[0]
    assert slope == pytest.approx(closed_forms.alternating_constant(e), rel=1e-4)


def test_ftl_constant_matches_simulation_for_an_asymmetric_pool():
    """c = 1/2 sum_k w_k Var_G(ln p_k - r) for i.i.d. teachers with unequal weights and rows (the
    symmetric alternating pair is not a test of the formula's weights)."""
    lp = np.log(np.random.default_rng(11).dirichlet(np.full(3, 0.7), size=3))
    w = np.array([0.6, 0.3, 0.1])
    c = closed_forms.ftl_constant(lp, w)
    res = online.rkl_tabular(lp, w, "sample", "1/t", 200_000, np.arange(24))
    mean, lo, hi = analysis.fit_slope(res["grid"], res["regret"])
    assert lo <= c <= hi and hi - lo < 0.1 * c, (mean, lo, hi, c)
    assert abs(closed_forms.ftl_constant(lp, w[::-1]) - c) > 10 * (hi - lo)   # the weights matter


def test_full_feedback_regret_closed_form_for_every_schedule():
    lp = np.log(np.random.default_rng(2).dirichlet(np.ones(4), size=2))
    w = [0.7, 0.3]
    for schedule, eta0 in (("1/t", 1.0), ("1/(t+1)", 1.0), ("1/sqrt(t)", 1.0), ("constant", 0.1)):
        res = online.rkl_tabular(lp, w, "full", schedule, 2000, [0], eta0=eta0)
        exact = closed_forms.full_feedback_regret(lp, w, schedule, 2000, eta0)[res["grid"] - 1]
        # the kernel forms R_T as the difference of two O(T) sums: rounding error ~ T x 1e-14
        np.testing.assert_allclose(res["regret"][0], exact, rtol=0, atol=2000 * 1e-13)


def test_ftl_full_feedback_has_constant_regret_and_constant_step_is_linear():
    lp = np.log(np.random.default_rng(1).dirichlet(np.ones(3), size=3))
    w = [0.5, 0.3, 0.2]
    full = online.rkl_tabular(lp, w, "full", "1/t", 10_000, [0])
    r = w @ lp
    log_g = r - logsumexp(r)
    kl_uniform = float(np.mean(-np.log(3) - log_g))              # after round 1 FTL plays G exactly:
    np.testing.assert_allclose(full["regret"][0], kl_uniform, atol=1e-7)   # R_T = KL(q_1 || G)
    const = online.rkl_tabular(lp, w, "sample", "constant", 10_000, [0, 1], eta0=0.1)
    ftl = online.rkl_tabular(lp, w, "sample", "1/t", 10_000, [0, 1])
    assert const["pseudo"][:, -1].mean() > 20 * ftl["pseudo"][:, -1].mean()


# ------------------------------------------------------------------------------------------------
# on-policy, sequence level: which target the learner reaches
# ------------------------------------------------------------------------------------------------
def test_per_token_learner_is_linear_against_g_and_sequence_learner_is_not():
    teachers = examples.prefix_bias_teachers([0.9, 0.9], [[0.9, 0.1], [0.1, 0.9]])
    w, H, T = [0.5, 0.5], 5, 4000
    gap = ag.sequence_kl(teachers, w, H, ag.local_geometric_conditionals(teachers, w))
    assert gap > 0.05
    tok = online.rkl_sequence(teachers, w, H, "token", T, np.arange(4))
    seq = online.rkl_sequence(teachers, w, H, "sequence", T, np.arange(4))
    g = list(tok["grid"])
    i, j = g.index(1000), len(g) - 1
    rate = (tok["pseudo"][:, j] - tok["pseudo"][:, i]).mean() / (g[j] - g[i])
    assert rate == pytest.approx(gap, rel=0.1)                      # converges to l: KL(l||G) per round
    assert seq["pseudo"][:, -1].mean() < 0.1 * tok["pseudo"][:, -1].mean()
    assert tok["token"][:, -1].mean() < 0.1 * tok["pseudo"][:, -1].mean()   # small per-token regret
    for r in (tok, seq):
        assert np.all(np.diff(r["pseudo"], axis=1) >= -1e-9)


# ------------------------------------------------------------------------------------------------
# function approximation
# ------------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_loglinear_regret_is_logarithmic_decade_by_decade_and_frozen_is_linear():
    """Logarithmic regret, with checks a linear learner fails: the slope of R_t on ln t agrees on the
    decades [1e3, 1e4] and [1e4, 1e5] (overlapping 95% intervals) and R_t / ln t does not grow; the
    frozen student and OGD with a constant step have R_t ∝ t (exponent 1) on the same problem."""
    rng = np.random.default_rng(2024)
    phi, probs = rng.normal(size=(5, 3, 4)), rng.dirichlet(np.ones(3), size=(2, 5))
    T, seeds, grid = 100_000, np.arange(8), analysis.log_grid(100_000, 4)
    for method in ("OGD", "Newton-style", "OGD-RKL"):
        res = online.loglinear(phi, probs, [0.5, 0.5], method, 0.1, T, seeds, grid=grid)
        dec = analysis.decade_slopes(res["grid"], res["regret"])
        (m1, lo1, hi1), (m2, lo2, hi2) = dec[(1e3, 1e4)], dec[(1e4, 1e5)]
        assert lo1 <= hi2 and lo2 <= hi1, (method, dec)
        per_log = res["regret"].mean(axis=0) / np.log(np.maximum(res["grid"], 2))
        g = list(res["grid"])
        assert per_log[g.index(100_000)] <= per_log[g.index(1000)], method
        assert analysis.growth(res["grid"], res["regret"])[0] == "logarithmic"
    for method in ("frozen", "constant step", "frozen-RKL"):
        res = online.loglinear(phi, probs, [0.5, 0.5], method, 0.1, T, seeds, grid=grid)
        label, _, (p, lo, hi) = analysis.growth(res["grid"], res["regret"])
        assert label == "power" and abs(p - 1) < 0.1, (method, p, lo, hi)


def test_loglinear_comparator_is_the_minimiser():
    """Off-policy the objective is strongly convex: the returned theta has zero gradient (KKT) and no
    other optimiser start does better. On-policy (not convex) the multi-start value is the best of 40
    independent L-BFGS runs from random points."""
    rng = np.random.default_rng(0)
    phi = rng.normal(size=(4, 3, 3))
    lp = np.log(rng.dirichlet(np.ones(3), size=(2, 4)))
    pooled = 0.5 * lp[0] + 0.5 * lp[1]
    counts = rng.integers(0, 50, size=(4, 3))
    t = int(counts.sum())
    best, theta = online.loglinear_comparator(phi, counts, 0.5, t)
    grad = online._loglinear_objective(theta, phi, counts.astype(float), 0.5, t, None, False)[1]
    assert np.linalg.norm(grad) < 1e-6 * t
    from scipy import optimize
    for _ in range(10):
        other = optimize.minimize(lambda x: online._loglinear_objective(x, phi, counts.astype(float), 0.5, t, None,
                                                                   False)[0], rng.normal(scale=3, size=3),
                                  method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000})
        assert other.fun >= best - 1e-7 * abs(best)
    on, _ = online.loglinear_comparator(phi, counts, 0.05, t, pooled, starts=rng.normal(scale=5, size=(4, 3)))
    runs = [online.loglinear_comparator(phi, counts, 0.05, t, pooled, starts=[x])[0] for x in rng.normal(scale=5, size=(40, 3))]
    assert on <= min(runs) + 1e-9 * abs(on)


@pytest.mark.nojit
def test_a_norm_projection_is_the_constrained_minimiser():
    """The generalised projection of ONS against a direct constrained minimisation (scipy SLSQP)."""
    from scipy import optimize
    rng = np.random.default_rng(1)
    for _ in range(20):
        m = rng.normal(size=(3, 3))
        a = m @ m.T + 0.1 * np.eye(3)
        y = rng.normal(scale=4, size=3)
        radius = 1.5
        got = np.empty(3)
        _kernels.project_a_norm(a, y, radius, got)
        direct = optimize.minimize(lambda x: (x - y) @ a @ (x - y), np.zeros(3), method="SLSQP",
                                   constraints=[{"type": "ineq", "fun": lambda x: radius ** 2 - x @ x}],
                                   options={"ftol": 1e-14, "maxiter": 500}).x
        np.testing.assert_allclose(got, direct, atol=1e-5)
        np.testing.assert_allclose(got, _reference.project_a_norm(a, y, radius), atol=1e-10)
        assert np.linalg.norm(got) <= radius * (1 + 1e-12)


# ------------------------------------------------------------------------------------------------
# kernels vs their NumPy twins
# ------------------------------------------------------------------------------------------------
def no_track(seeds, grid):
    """The kernels' (track, track_out) arguments when nothing is tracked: no tokens."""
    return np.zeros(0, np.int64), np.zeros((seeds.size, grid.size, 0))


@pytest.mark.nojit
@pytest.mark.parametrize("forced", [False, True])
def test_add_beta_kernel_matches_reference_tabular(forced):
    n, T = 4, 200
    probs = np.random.default_rng(2).dirichlet(np.ones(n), size=3)
    w = np.array([0.2, 0.3, 0.5])
    mix = w @ probs
    prob, index = online.alias_tables(mix[None, None])
    tokens = np.random.default_rng(3).integers(0, n, T) if forced else np.zeros(0, np.int64)
    args = (read_only(np.full((1, n), -1, np.int64)), 0, 1, prob, index, np.ones(1), mix[None].copy(),
            float(mix @ np.log(mix)))
    seeds, grid = online._seeds([1, 2]), analysis.log_grid(T)
    out = np.zeros((2, 2, grid.size))
    log_num, log_den = online._log_tables(0.5, n, T)
    _kernels.add_beta_kernel(*args, log_num, log_den, tokens, seeds, grid, out[0], out[1], *no_track(seeds, grid))
    ref = _reference.add_beta(*args, 0.5, tokens, seeds, grid)
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-10, atol=1e-10)


@pytest.mark.nojit
def test_add_beta_kernel_matches_reference_sequence():
    teachers = examples.prefix_tree(2, 3, 3, seed=4)
    w = np.array([0.6, 0.4])
    joint = online.mixture_joint(teachers, w, 3)
    mass = joint.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        neg = float(np.sum(np.where(joint > 0, joint * np.log(joint / mass), 0.0)))
    prob, index = online.alias_tables(np.exp(teachers.log_probs))
    args = (teachers.next_state, 0, 3, prob, index, np.cumsum(w), joint, neg)
    seeds, grid = online._seeds([5, 6]), analysis.log_grid(150)
    out = np.zeros((2, 2, grid.size))
    log_num, log_den = online._log_tables(1.0, 3, 150 * 3)
    _kernels.add_beta_kernel(*args, log_num, log_den, np.zeros(0, np.int64), seeds, grid, out[0], out[1],
                             *no_track(seeds, grid))
    ref = _reference.add_beta(*args, 1.0, np.zeros(0, np.int64), seeds, grid)
    np.testing.assert_allclose(out, np.stack(ref), rtol=1e-10, atol=1e-10)


def test_alias_tables_reproduce_the_distribution():
    p = np.array([0.5, 0.25, 0.125, 0.125, 0.0])
    prob, index = online.alias_tables(p)
    recon = prob / p.size
    for j in range(p.size):
        recon[index[j]] += (1 - prob[j]) / p.size
    np.testing.assert_allclose(recon, p, atol=1e-15)


@pytest.mark.nojit
@pytest.mark.parametrize("feedback, schedule", [(0, 0), (1, 1), (1, 2), (2, 3)])
def test_rkl_tabular_kernel_matches_reference(feedback, schedule):
    lp = np.log(np.random.default_rng(8).dirichlet(np.ones(3), size=3))
    w = np.array([0.5, 0.3, 0.2])
    pooled = w @ lp
    log_target = pooled - logsumexp(pooled)
    seeds, grid = online._seeds([3, 4]), analysis.log_grid(120)
    out = np.zeros((2, 2, grid.size))
    _kernels.rkl_tabular_kernel(lp, np.cumsum(w), pooled, log_target, feedback, schedule, 0.3, seeds, grid, out[0], out[1],
                                *no_track(seeds, grid))
    ref = _reference.rkl_tabular(lp, np.cumsum(w), pooled, log_target, feedback, schedule, 0.3, seeds, grid)
    np.testing.assert_allclose(out, np.stack(ref), rtol=1e-9, atol=1e-9)


@pytest.mark.nojit
@pytest.mark.parametrize("mode", [0, 1])
def test_rkl_sequence_kernel_matches_reference(mode):
    teachers = examples.prefix_bias_teachers([0.9, 0.8], [[0.8, 0.2], [0.3, 0.7]])
    w, H = np.array([0.5, 0.5]), 4
    log_g = ag.sequence_geometric_conditionals(teachers, w, H)
    log_l = ag.local_geometric_conditionals(teachers, w)
    seeds, grid = online._seeds([1, 9]), analysis.log_grid(40)
    out = np.zeros((3, 2, grid.size))
    args = (teachers.next_state, 0, H, np.ascontiguousarray(teachers.log_probs), np.cumsum(w), log_g, log_l, mode)
    _kernels.rkl_sequence_kernel(*args, seeds, grid, out[0], out[1], out[2], *no_track(seeds, grid))
    ref = _reference.rkl_sequence(*args, seeds, grid)
    np.testing.assert_allclose(out, np.stack(ref), rtol=1e-8, atol=1e-8)


@pytest.mark.nojit
@pytest.mark.parametrize("on_policy, update", [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 3)])
def test_loglinear_kernel_matches_reference(on_policy, update):
    rng = np.random.default_rng(6)
    phi = rng.normal(size=(3, 3, 2))
    lp = np.log(rng.dirichlet(np.ones(3), size=(2, 3)))
    w = np.array([0.5, 0.5])
    pooled = np.tensordot(w, lp, axes=1)
    seeds, grid = online._seeds([2, 3]), analysis.log_grid(60)
    loss = np.zeros((2, grid.size))
    counts = np.zeros((2, grid.size, 3, 3), np.int64)
    theta = np.zeros((2, grid.size, 2))
    # ONS with a small eps takes long first steps, so the generalised projection is exercised
    gamma, radius, eps = (0.05, 1.0, 0.1) if update == 1 else (1.0, 3.0, 0.5)
    args = (phi, lp, np.cumsum(w), pooled, on_policy, update, 0.5, 0.1, radius, gamma, eps)
    _kernels.loglinear_kernel(*args, seeds, grid, loss, counts, theta)
    ref_loss, ref_counts, ref_theta = _reference.loglinear(*args, seeds, grid)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(counts, ref_counts)
    np.testing.assert_allclose(theta, ref_theta, rtol=1e-8, atol=1e-9)
    if update == 1:
        assert np.isclose(np.linalg.norm(theta, axis=2), radius).any()  # the projection was exercised
    if update == 3:
        assert np.all(theta == 0)


# ------------------------------------------------------------------------------------------------
# tracked probabilities (the learned curves of sims/mechanisms.py): kernel vs twin, outputs unchanged
# ------------------------------------------------------------------------------------------------
@pytest.mark.nojit
def test_add_beta_kernel_tracking_matches_reference_and_changes_nothing_else():
    teachers = examples.prefix_tree(2, 3, 2, seed=4)       # a tree: no state repeats within a response
    w, H, beta = np.array([0.5, 0.5]), 3, 0.5
    joint = online.mixture_joint(teachers, w, H)
    prob, index = online.alias_tables(np.exp(teachers.log_probs))
    log_num, log_den = online._log_tables(beta, 2, 40 * H)
    seeds, grid, track = online._seeds([1, 9]), analysis.log_grid(40), np.array([0, 1])
    args = (teachers.next_state, 0, H, prob, index, np.cumsum(w), joint, -0.3)
    plain, tracked = np.zeros((2, 2, grid.size)), np.zeros((2, 2, grid.size))
    track_out = np.zeros((2, grid.size, 2))
    _kernels.add_beta_kernel(*args, log_num, log_den, np.zeros(0, np.int64), seeds, grid, plain[0], plain[1],
                             *no_track(seeds, grid))
    _kernels.add_beta_kernel(*args, log_num, log_den, np.zeros(0, np.int64), seeds, grid, tracked[0], tracked[1],
                      track, track_out)
    np.testing.assert_array_equal(plain, tracked)
    ref = _reference.add_beta(*args, beta, np.zeros(0, np.int64), seeds, grid, track=track)
    np.testing.assert_allclose(tracked, np.stack(ref[:2]), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(track_out, ref[2], rtol=1e-12)
    np.testing.assert_allclose(track_out.sum(axis=2), 1.0, rtol=1e-12)
    assert np.all(track_out[:, 0] == 0.5)                       # q_1 is uniform


@pytest.mark.nojit
@pytest.mark.parametrize("feedback, schedule", [(0, 0), (1, 0), (1, 2), (2, 3)])
def test_rkl_tabular_kernel_tracking_matches_reference(feedback, schedule):
    lp = np.log(np.random.default_rng(8).dirichlet(np.ones(5), size=3))     # n >= 4: the vectorised exp
    w = np.array([0.5, 0.3, 0.2])
    pooled = w @ lp
    log_target = pooled - logsumexp(pooled)
    seeds, grid, track = online._seeds([3, 4]), analysis.log_grid(120), np.array([4, 0])
    plain, tracked = np.zeros((2, 2, grid.size)), np.zeros((2, 2, grid.size))
    track_out = np.zeros((2, grid.size, 2))
    args = (lp, np.cumsum(w), pooled, log_target, feedback, schedule, 0.3, seeds, grid)
    _kernels.rkl_tabular_kernel(*args, plain[0], plain[1], *no_track(seeds, grid))
    _kernels.rkl_tabular_kernel(*args, tracked[0], tracked[1], track, track_out)
    np.testing.assert_array_equal(plain, tracked)
    ref = _reference.rkl_tabular(*args, track=track)
    np.testing.assert_allclose(tracked, np.stack(ref[:2]), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(track_out, ref[2], rtol=1e-9, atol=1e-15)


@pytest.mark.nojit
@pytest.mark.parametrize("mode", [0, 1])
def test_rkl_sequence_kernel_tracking_matches_reference(mode):
    teachers = examples.prefix_bias_teachers([0.9, 0.8], [[0.8, 0.2], [0.3, 0.7]])
    w, H = np.array([0.5, 0.5]), 4
    log_g = ag.sequence_geometric_conditionals(teachers, w, H)
    log_l = ag.local_geometric_conditionals(teachers, w)
    seeds, grid, track = online._seeds([1, 9]), analysis.log_grid(40), np.array([0])
    args = (teachers.next_state, 0, H, np.ascontiguousarray(teachers.log_probs), np.cumsum(w), log_g, log_l, mode,
            seeds, grid)
    plain, tracked = np.zeros((3, 2, grid.size)), np.zeros((3, 2, grid.size))
    track_out = np.zeros((2, grid.size, 1))
    _kernels.rkl_sequence_kernel(*args, plain[0], plain[1], plain[2], *no_track(seeds, grid))
    _kernels.rkl_sequence_kernel(*args, tracked[0], tracked[1], tracked[2], track, track_out)
    np.testing.assert_array_equal(plain, tracked)
    ref = _reference.rkl_sequence(*args, track=track)
    np.testing.assert_allclose(tracked, np.stack(ref[:3]), rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(track_out, ref[3], rtol=1e-9)


def test_public_tracking_closed_forms_and_unchanged_results():
    """add-beta tracks (N_{t-1}(a) + beta) / (t - 1 + n beta); FTL with full feedback plays G from round 2."""
    seq = np.array([0, 1, 1, 2, 1, 0, 2, 2, 2])
    n, beta, grid = 3, 0.5, np.arange(1, len(seq) + 1)
    kw = dict(sequence=seq, grid=grid)
    res = online.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, len(seq), [0], track=[0, 2], **kw)
    counts = np.vstack([np.zeros(n), np.cumsum(np.eye(n)[seq], axis=0)[:-1]])
    want = (counts[:, [0, 2]] + beta) / (np.arange(len(seq))[:, None] + n * beta)
    np.testing.assert_allclose(res["track"][0], want, rtol=1e-12)
    plain = online.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, len(seq), [0], **kw)
    assert "track" not in plain
    np.testing.assert_array_equal(plain["regret"], res["regret"])
    lp = np.log(np.random.default_rng(1).dirichlet(np.ones(3), size=3))
    w = np.array([0.5, 0.3, 0.2])
    full = online.rkl_tabular(lp, w, "full", "1/t", 50, [0], track=[0, 1, 2])
    np.testing.assert_allclose(full["track"][0, 0], 1 / 3, rtol=1e-12)
    np.testing.assert_allclose(full["track"][0, 1:], np.broadcast_to(ag.geometric_pool(np.exp(lp), w),
                                                                     (full["grid"].size - 1, 3)), rtol=1e-9)
    with pytest.raises(ValueError, match="track"):
        online.rkl_tabular(lp, w, "full", "1/t", 50, [0], track=[3])


# ------------------------------------------------------------------------------------------------
# bad input (theory section 7)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda: online.add_beta_tabular([[0.5, 0.5]], [1.0], 0.5, 0, [0]), "n_rounds"),
    (lambda: online.add_beta_tabular([[0.5, 0.5]], [1.0], -1.0, 10, [0]), "beta"),
    (lambda: online.add_beta_tabular([[0.5, 0.6]], [1.0], 0.5, 10, [0]), "probs"),
    (lambda: online.add_beta_tabular([[0.5, 0.5]], [0.5], 0.5, 10, [0]), "weights"),
    (lambda: online.add_beta_tabular([[0.5, 0.5]], [1.0], 0.5, 10, [-1]), "seeds"),
    (lambda: online.rkl_tabular(np.log([[0.5, 0.5]]), [1.0], "bandit", "1/t", 10, [0]), "feedback"),
    (lambda: online.rkl_tabular(np.log([[0.5, 0.5]]), [1.0], "full", "1/t^2", 10, [0]), "schedule"),
    (lambda: online.rkl_tabular(np.array([[0.0, -np.inf]]), [1.0], "full", "1/t", 10, [0]), "log_probs"),
    (lambda: online.rkl_sequence("x", [1.0], 3, "sequence", 10, [0]), "teachers"),
    (lambda: analysis.fit_slope([1, 2], [[0.0, 1.0]], decades=0.01), "two grid points"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_seeds_may_be_an_int_meaning_range_n():
    """``seeds=3`` is ``seeds=[0, 1, 2]``, for every learner that runs seeds (issue 34 item 9)."""
    p, w = np.array([[0.9, 0.1], [0.2, 0.8]]), [0.5, 0.5]
    for call in (lambda s: online.add_beta_tabular(p, w, 0.5, 200, s),
                 lambda s: online.rkl_tabular(np.log(p), w, "sample", "1/t", 200, s),
                 lambda s: online.add_beta_sequence(examples.prefix_bias_teachers([0.9, 0.9], [[0.9, 0.1], [0.1, 0.9]]), [0.5, 0.5], 3, 0.5, 200, s),
                 lambda s: online.rkl_sequence(examples.prefix_bias_teachers([0.9, 0.9], [[0.9, 0.1], [0.1, 0.9]]), [0.5, 0.5], 3, "sequence", 200, s)):
        np.testing.assert_array_equal(call(3)["regret"], call(np.arange(3))["regret"])
        assert call(np.int64(2))["regret"].shape[0] == 2
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="seeds"):
            online.add_beta_tabular(p, w, 0.5, 10, bad)


def test_probabilities_and_log_probabilities_each_name_the_convention_expected():
    """add_beta_tabular takes probabilities, rkl_tabular log-probabilities: the other convention is refused
    with a message saying which one the function expects."""
    p, w = np.array([[0.9, 0.1], [0.2, 0.8]]), [0.5, 0.5]
    with pytest.raises(ValueError, match=r"^rkl_tabular expects log-probabilities; got rows that sum to 1 "
                                         r"\(probabilities\?"):
        online.rkl_tabular(p, w, "sample", "1/t", 10, 2)
    with pytest.raises(ValueError, match=r"^add_beta_tabular expects probabilities; got rows whose exp sums to 1 "
                                         r"\(log-probabilities\?"):
        online.add_beta_tabular(np.log(p), w, 0.5, 10, 2)
    features = np.random.default_rng(0).normal(size=(1, 2, 2))
    with pytest.raises(ValueError, match="^loglinear expects probabilities"):
        online.loglinear(features, np.log(p)[:, None, :], w, "ogd", 0.1, 10, 2)


def test_a_transposed_table_is_named_with_the_teacher_axis():
    """An (n, K) table where (K, n) is expected: the error says it looks transposed and which axis holds
    the teachers, not only that a row sums to 1.33."""
    p = np.array([[0.5, 0.2, 0.3], [0.1, 0.1, 0.8]]).T          # 2 teachers x 3 tokens, transposed
    w = [0.5, 0.5]
    with pytest.raises(ValueError, match=r"probs\[0\] sums to 0\.6.*looks transposed.*the teacher axis is axis 0, \(K, n\)"):
        online.add_beta_tabular(p, w, 0.5, 10, 2)
    with pytest.raises(ValueError, match=r"looks transposed.*the teacher axis is axis 0"):
        online.rkl_tabular(np.log(p), w, "sample", "1/t", 10, 2)
    with pytest.raises(ValueError, match=r"looks transposed.*the teacher axis is axis 0"):
        ag.arithmetic_pool(p, w)
