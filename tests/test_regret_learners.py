"""Regret learners (SPEC 3): closed forms, the FTL identity, slopes, kernel vs NumPy twin, bad input."""

import math

import numpy as np
import pytest
from scipy.special import gammaln, logsumexp

import aggregation as ag
from aggregation import examples
from sims import _regret_kernels as K
from sims import _regret_reference as R
from harness import cell_seeds
from sims import analysis, theory
from sims import learners as L


# ------------------------------------------------------------------------------------------------
# theory values pinned from SPEC 3
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, T, value", [(2, 10, 1.7362), (2, 1000, 4.0264), (3, 1000, 7.6014), (4, 300, 9.1318)])
def test_kt_worst_case_spec_values(n, T, value):
    assert theory.kt_worst_case(T, n) == pytest.approx(value, abs=5e-5)


@pytest.mark.parametrize("n, T, value", [(2, 1000, 3.6964), (3, 1000, 6.9473)])
def test_shtarkov_spec_values_and_kt_gap(n, T, value):
    log_c = theory.shtarkov_log_complexity(T, n)
    assert log_c == pytest.approx(value, abs=5e-5)
    gap = theory.kt_worst_case(T, n) - log_c                     # KT is minimax up to (n-1)/2 ln 2
    assert 0 < gap < (n - 1) / 2 * math.log(2)


@pytest.mark.parametrize("e, c", [(0.1, 0.6035), (1e-2, 2.6394), (1e-3, 5.963), (1e-4, 10.604), (1e-6, 23.859)])
def test_alternating_constant_spec_values(e, c):
    assert theory.alternating_constant(e) == pytest.approx(c, abs=6e-4)
    lp = np.log([[1 - e, e], [e, 1 - e]])
    assert theory.ftl_constant(lp, [0.5, 0.5]) == pytest.approx(theory.alternating_constant(e), rel=1e-12)


# ------------------------------------------------------------------------------------------------
# off-policy: add-beta against closed forms
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_kt_and_laplace_constant_sequence_equal_closed_forms(n):
    T = 100_000
    uniform = np.full((1, n), 1.0 / n)
    kt = L.add_beta_tabular(uniform, [1.0], 0.5, T, [0], sequence="constant")
    np.testing.assert_allclose(kt["regret"][0], theory.kt_worst_case(kt["grid"], n), rtol=1e-12, atol=1e-8)
    lap = L.add_beta_tabular(uniform, [1.0], 1.0, T, [0], sequence="constant")
    t = lap["grid"].astype(float)
    ln_binom = gammaln(t + n) - gammaln(n) - gammaln(t + 1)        # ln binom(T+n-1, n-1)
    np.testing.assert_allclose(lap["regret"][0], ln_binom, rtol=1e-12, atol=1e-8)
    if n == 2:
        np.testing.assert_allclose(lap["regret"][0], np.log(t + 1), atol=1e-8)


@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_add_beta_round_robin_closed_form_and_slopes(beta):
    n, T = 3, 30_000
    res = L.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, T, [0], sequence="round-robin")
    np.testing.assert_allclose(res["regret"][0], theory.add_beta_round_robin(res["grid"], n, beta), atol=1e-8)
    const = L.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, T, [0], sequence="constant")
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
    res = L.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, len(seq), [0], sequence=seq,
                             grid=np.arange(1, len(seq) + 1))
    np.testing.assert_allclose(res["regret"][0], want, rtol=0, atol=1e-12)


def test_add_beta_sample_feedback_slope_and_pseudo_regret():
    n = 4
    probs = np.random.default_rng(3).dirichlet(np.ones(n), size=3)
    res = L.add_beta_tabular(probs, [0.5, 0.3, 0.2], 0.5, 100_000, np.arange(8))
    slope = analysis.fit_slope(res["grid"], res["regret"])[0]
    assert slope == pytest.approx((n - 1) / 2, rel=0.01)          # realised regret: nearly deterministic
    assert np.all(np.diff(res["pseudo"], axis=1) >= 0)           # a sum of KLs
    assert res["pseudo"][:, -1].mean() == pytest.approx(1.5 * math.log(1e5), rel=0.35)


def test_add_beta_sequence_matches_per_state_theory():
    teachers = examples.prefix_tree(3, 3, 2, seed=9)
    res = L.add_beta_sequence(teachers, [0.5, 0.3, 0.2], 3, 0.5, 20_000, np.arange(4))
    assert res["visited"] == 7
    slope, lo, hi = analysis.fit_slope(res["grid"], res["regret"])
    assert 0.8 * 3.5 < slope < 1.1 * 3.5                          # sum over 7 states of (n-1)/2
    assert np.all(np.diff(res["pseudo"], axis=1) >= -1e-9)


def test_tiny_probabilities_stay_finite():
    probs = np.array([[1 - 1e-300, 1e-300], [0.5, 0.5]])
    res = L.add_beta_tabular(probs, [0.5, 0.5], 0.5, 1000, [0, 1])
    assert np.all(np.isfinite(res["regret"])) and np.all(np.isfinite(res["pseudo"]))
    lp = np.log([[1 - 1e-300, 1e-300], [1e-300, 1 - 1e-300]])
    on = L.rkl_tabular(lp, [0.5, 0.5], "alternating", "1/t", 1000, [0])
    assert np.all(np.isfinite(on["regret"])) and on["regret"][0, -1] > 0


# ------------------------------------------------------------------------------------------------
# on-policy: FTL
# ------------------------------------------------------------------------------------------------
def test_ftl_per_round_regret_equals_the_exact_identity():
    """R_T = sum_t t KL(q_t || q_{t+1}) for FTL on f_t = KL(. || p_{k_t}) (F_t(q) = t KL(q||q_{t+1}) + const)."""
    lp = np.log(np.random.default_rng(5).dirichlet(np.ones(3), size=4))
    w = np.array([0.1, 0.2, 0.3, 0.4])
    T = 300
    res = L.rkl_tabular(lp, w, "sample", "1/t", T, [7], grid=np.arange(1, T + 1))
    # replay the same teacher draws from the same stream, then the identity in NumPy
    stream, cdf = R.Stream(L._seeds([7])[0]), np.cumsum(w)
    ks = [R._pick(cdf, stream.uniform()) for _ in range(T)]
    means = np.cumsum(lp[ks], axis=0) / np.arange(1, T + 1)[:, None]
    log_q = np.vstack([np.full(3, -np.log(3)), means - logsumexp(means, axis=1, keepdims=True)])
    kl = np.sum(np.exp(log_q[:-1]) * (log_q[:-1] - log_q[1:]), axis=1)
    np.testing.assert_allclose(res["regret"][0], np.cumsum(np.arange(1, T + 1) * kl), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("e", [0.1, 1e-2, 1e-3, 1e-4])
def test_alternating_teachers_slope_within_two_percent(e):
    lp = np.log([[1 - e, e], [e, 1 - e]])
    res = L.rkl_tabular(lp, [0.5, 0.5], "alternating", "1/t", 100_000, [0])
    slope = analysis.fit_slope(res["grid"], res["regret"])[0]
    assert slope == pytest.approx(theory.alternating_constant(e), rel=0.02)


def test_ftl_full_feedback_has_constant_regret_and_constant_step_is_linear():
    lp = np.log(np.random.default_rng(1).dirichlet(np.ones(3), size=3))
    w = [0.5, 0.3, 0.2]
    full = L.rkl_tabular(lp, w, "full", "1/t", 10_000, [0])
    r = w @ lp
    log_g = r - logsumexp(r)
    kl_uniform = float(np.mean(-np.log(3) - log_g))              # after round 1 FTL plays G exactly:
    np.testing.assert_allclose(full["regret"][0], kl_uniform, atol=1e-7)   # R_T = KL(q_1 || G)
    const = L.rkl_tabular(lp, w, "sample", "constant", 10_000, [0, 1], eta0=0.1)
    ftl = L.rkl_tabular(lp, w, "sample", "1/t", 10_000, [0, 1])
    assert const["pseudo"][:, -1].mean() > 20 * ftl["pseudo"][:, -1].mean()


# ------------------------------------------------------------------------------------------------
# on-policy, sequence level: which target the learner reaches
# ------------------------------------------------------------------------------------------------
def test_per_token_learner_is_linear_against_g_and_sequence_learner_is_not():
    teachers = examples.prefix_bias_teachers([0.9, 0.9], [[0.9, 0.1], [0.1, 0.9]])
    w, H, T = [0.5, 0.5], 5, 4000
    gap = ag.sequence_kl(teachers, w, H, ag.local_geometric_conditionals(teachers, w))
    assert gap > 0.05
    tok = L.rkl_sequence(teachers, w, H, "token", T, np.arange(4))
    seq = L.rkl_sequence(teachers, w, H, "sequence", T, np.arange(4))
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
def test_loglinear_ogd_regret_below_hak_bound_and_comparator_is_optimal():
    rng = np.random.default_rng(0)
    phi = rng.normal(size=(4, 3, 3))
    probs = rng.dirichlet(np.ones(3), size=(2, 4))
    res = L.loglinear(phi, probs, [0.5, 0.5], "OGD", 0.5, 2000, [0, 1])
    assert np.all(res["regret"][:, -1] <= theory.hak_bound(2000, res["G"], 0.5))
    assert np.all(res["regret"][:, -1] > 0)
    counts = rng.integers(0, 50, size=(4, 3))
    t = int(counts.sum())
    best = L.loglinear_comparator(phi, counts, 0.5, t)
    for _ in range(5):                                              # no random theta does better
        theta = rng.normal(size=3)
        assert L._loglinear_objective(theta, phi, counts.astype(float), 0.5, t, None, False)[0] >= best - 1e-9


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


# ------------------------------------------------------------------------------------------------
# kernels vs their NumPy twins
# ------------------------------------------------------------------------------------------------
@pytest.mark.nojit
@pytest.mark.parametrize("forced", [False, True])
def test_add_beta_kernel_matches_reference_tabular(forced):
    n, T = 4, 200
    probs = np.random.default_rng(2).dirichlet(np.ones(n), size=3)
    w = np.array([0.2, 0.3, 0.5])
    mix = w @ probs
    prob, index = L.alias_tables(mix[None, None])
    tokens = np.random.default_rng(3).integers(0, n, T) if forced else np.zeros(0, np.int64)
    args = (np.full((1, n), -1, np.int64), 0, 1, prob, index, np.ones(1), mix[None].copy(),
            float(mix @ np.log(mix)))
    seeds, grid = L._seeds([1, 2]), analysis.log_grid(T)
    out = np.zeros((2, 2, grid.size))
    log_num, log_den = L._log_tables(0.5, n, T)
    K.add_beta_kernel(*args, log_num, log_den, tokens, seeds, grid, out[0], out[1])
    ref = R.add_beta(*args, 0.5, tokens, seeds, grid)
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-10, atol=1e-10)


@pytest.mark.nojit
def test_add_beta_kernel_matches_reference_sequence():
    teachers = examples.prefix_tree(2, 3, 3, seed=4)
    w = np.array([0.6, 0.4])
    joint = L.mixture_joint(teachers, w, 3)
    mass = joint.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        neg = float(np.sum(np.where(joint > 0, joint * np.log(joint / mass), 0.0)))
    prob, index = L.alias_tables(np.exp(teachers.log_probs))
    args = (teachers.next_state, 0, 3, prob, index, np.cumsum(w), joint, neg)
    seeds, grid = L._seeds([5, 6]), analysis.log_grid(150)
    out = np.zeros((2, 2, grid.size))
    log_num, log_den = L._log_tables(1.0, 3, 150 * 3)
    K.add_beta_kernel(*args, log_num, log_den, np.zeros(0, np.int64), seeds, grid, out[0], out[1])
    ref = R.add_beta(*args, 1.0, np.zeros(0, np.int64), seeds, grid)
    np.testing.assert_allclose(out, np.stack(ref), rtol=1e-10, atol=1e-10)


def test_alias_tables_reproduce_the_distribution():
    p = np.array([0.5, 0.25, 0.125, 0.125, 0.0])
    prob, index = L.alias_tables(p)
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
    seeds, grid = L._seeds([3, 4]), analysis.log_grid(120)
    out = np.zeros((2, 2, grid.size))
    K.rkl_tabular_kernel(lp, np.cumsum(w), pooled, log_target, feedback, schedule, 0.3, seeds, grid, out[0], out[1])
    ref = R.rkl_tabular(lp, np.cumsum(w), pooled, log_target, feedback, schedule, 0.3, seeds, grid)
    np.testing.assert_allclose(out, np.stack(ref), rtol=1e-9, atol=1e-9)


@pytest.mark.nojit
@pytest.mark.parametrize("mode", [0, 1])
def test_rkl_sequence_kernel_matches_reference(mode):
    teachers = examples.prefix_bias_teachers([0.9, 0.8], [[0.8, 0.2], [0.3, 0.7]])
    w, H = np.array([0.5, 0.5]), 4
    log_g = ag.sequence_geometric_conditionals(teachers, w, H)
    log_l = ag.local_geometric_conditionals(teachers, w)
    seeds, grid = L._seeds([1, 9]), analysis.log_grid(40)
    out = np.zeros((3, 2, grid.size))
    args = (teachers.next_state, 0, H, np.ascontiguousarray(teachers.log_probs), np.cumsum(w), log_g, log_l, mode)
    K.rkl_sequence_kernel(*args, seeds, grid, out[0], out[1], out[2])
    ref = R.rkl_sequence(*args, seeds, grid)
    np.testing.assert_allclose(out, np.stack(ref), rtol=1e-8, atol=1e-8)


@pytest.mark.nojit
@pytest.mark.parametrize("method", [0, 1, 2])
def test_loglinear_kernel_matches_reference(method):
    rng = np.random.default_rng(6)
    phi = rng.normal(size=(3, 3, 2))
    lp = np.log(rng.dirichlet(np.ones(3), size=(2, 3)))
    w = np.array([0.5, 0.5])
    pooled = np.tensordot(w, lp, axes=1)
    seeds, grid = L._seeds([2, 3]), analysis.log_grid(60)
    loss = np.zeros((2, grid.size))
    counts = np.zeros((2, grid.size, 3, 3), np.int64)
    args = (phi, lp, np.cumsum(w), pooled, method, 0.5, 3.0, 1.0, 0.5)
    K.loglinear_kernel(*args, seeds, grid, loss, counts)
    ref_loss, ref_counts = R.loglinear(*args, seeds, grid)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(counts, ref_counts)


# ------------------------------------------------------------------------------------------------
# tracked probabilities (the learned curves of sims/mechanisms.py): kernel vs twin, outputs unchanged
# ------------------------------------------------------------------------------------------------
@pytest.mark.nojit
def test_add_beta_kernel_tracking_matches_reference_and_changes_nothing_else():
    teachers = examples.prefix_tree(2, 3, 2, seed=4)       # a tree: no state repeats within a response
    w, H, beta = np.array([0.5, 0.5]), 3, 0.5
    joint = L.mixture_joint(teachers, w, H)
    prob, index = L.alias_tables(np.exp(teachers.log_probs))
    log_num, log_den = L._log_tables(beta, 2, 40 * H)
    seeds, grid, track = L._seeds([1, 9]), analysis.log_grid(40), np.array([0, 1])
    args = (teachers.next_state, 0, H, prob, index, np.cumsum(w), joint, -0.3)
    plain, tracked = np.zeros((2, 2, grid.size)), np.zeros((2, 2, grid.size))
    track_out = np.zeros((2, grid.size, 2))
    K.add_beta_kernel(*args, log_num, log_den, np.zeros(0, np.int64), seeds, grid, plain[0], plain[1])
    K.add_beta_kernel(*args, log_num, log_den, np.zeros(0, np.int64), seeds, grid, tracked[0], tracked[1],
                      track, track_out)
    np.testing.assert_array_equal(plain, tracked)
    ref = R.add_beta(*args, beta, np.zeros(0, np.int64), seeds, grid, track=track)
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
    seeds, grid, track = L._seeds([3, 4]), analysis.log_grid(120), np.array([4, 0])
    plain, tracked = np.zeros((2, 2, grid.size)), np.zeros((2, 2, grid.size))
    track_out = np.zeros((2, grid.size, 2))
    args = (lp, np.cumsum(w), pooled, log_target, feedback, schedule, 0.3, seeds, grid)
    K.rkl_tabular_kernel(*args, plain[0], plain[1])
    K.rkl_tabular_kernel(*args, tracked[0], tracked[1], track, track_out)
    # a separate specialisation; fastmath reassociation may round the sums differently in the last bit
    np.testing.assert_allclose(plain, tracked, rtol=1e-13, atol=1e-14)
    ref = R.rkl_tabular(*args, track=track)
    np.testing.assert_allclose(tracked, np.stack(ref[:2]), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(track_out, ref[2], rtol=1e-9, atol=1e-15)


@pytest.mark.nojit
@pytest.mark.parametrize("mode", [0, 1])
def test_rkl_sequence_kernel_tracking_matches_reference(mode):
    teachers = examples.prefix_bias_teachers([0.9, 0.8], [[0.8, 0.2], [0.3, 0.7]])
    w, H = np.array([0.5, 0.5]), 4
    log_g = ag.sequence_geometric_conditionals(teachers, w, H)
    log_l = ag.local_geometric_conditionals(teachers, w)
    seeds, grid, track = L._seeds([1, 9]), analysis.log_grid(40), np.array([0])
    args = (teachers.next_state, 0, H, np.ascontiguousarray(teachers.log_probs), np.cumsum(w), log_g, log_l, mode,
            seeds, grid)
    plain, tracked = np.zeros((3, 2, grid.size)), np.zeros((3, 2, grid.size))
    track_out = np.zeros((2, grid.size, 1))
    K.rkl_sequence_kernel(*args, plain[0], plain[1], plain[2])
    K.rkl_sequence_kernel(*args, tracked[0], tracked[1], tracked[2], track, track_out)
    np.testing.assert_array_equal(plain, tracked)
    ref = R.rkl_sequence(*args, track=track)
    np.testing.assert_allclose(tracked, np.stack(ref[:3]), rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(track_out, ref[3], rtol=1e-9)


def test_public_tracking_closed_forms_and_unchanged_results():
    """add-beta tracks (N_{t-1}(a) + beta) / (t - 1 + n beta); FTL with full feedback plays G from round 2."""
    seq = np.array([0, 1, 1, 2, 1, 0, 2, 2, 2])
    n, beta, grid = 3, 0.5, np.arange(1, len(seq) + 1)
    kw = dict(sequence=seq, grid=grid)
    res = L.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, len(seq), [0], track=[0, 2], **kw)
    counts = np.vstack([np.zeros(n), np.cumsum(np.eye(n)[seq], axis=0)[:-1]])
    want = (counts[:, [0, 2]] + beta) / (np.arange(len(seq))[:, None] + n * beta)
    np.testing.assert_allclose(res["track"][0], want, rtol=1e-12)
    plain = L.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, len(seq), [0], **kw)
    assert "track" not in plain
    np.testing.assert_array_equal(plain["regret"], res["regret"])
    lp = np.log(np.random.default_rng(1).dirichlet(np.ones(3), size=3))
    w = np.array([0.5, 0.3, 0.2])
    full = L.rkl_tabular(lp, w, "full", "1/t", 50, [0], track=[0, 1, 2])
    np.testing.assert_allclose(full["track"][0, 0], 1 / 3, rtol=1e-12)
    np.testing.assert_allclose(full["track"][0, 1:], np.broadcast_to(ag.geometric_pool(np.exp(lp), w),
                                                                     (full["grid"].size - 1, 3)), rtol=1e-9)
    with pytest.raises(ValueError, match="track"):
        L.rkl_tabular(lp, w, "full", "1/t", 50, [0], track=[3])


# ------------------------------------------------------------------------------------------------
# bad input (SPEC 7)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda: L.add_beta_tabular([[0.5, 0.5]], [1.0], 0.5, 0, [0]), "n_rounds"),
    (lambda: L.add_beta_tabular([[0.5, 0.5]], [1.0], -1.0, 10, [0]), "beta"),
    (lambda: L.add_beta_tabular([[0.5, 0.6]], [1.0], 0.5, 10, [0]), "probs"),
    (lambda: L.add_beta_tabular([[0.5, 0.5]], [0.5], 0.5, 10, [0]), "weights"),
    (lambda: L.add_beta_tabular([[0.5, 0.5]], [1.0], 0.5, 10, [-1]), "seeds"),
    (lambda: L.rkl_tabular(np.log([[0.5, 0.5]]), [1.0], "bandit", "1/t", 10, [0]), "feedback"),
    (lambda: L.rkl_tabular(np.log([[0.5, 0.5]]), [1.0], "full", "1/t^2", 10, [0]), "schedule"),
    (lambda: L.rkl_tabular(np.array([[0.0, -np.inf]]), [1.0], "full", "1/t", 10, [0]), "log_probs"),
    (lambda: L.rkl_sequence("x", [1.0], 3, "sequence", 10, [0]), "teachers"),
    (lambda: analysis.fit_slope([1, 2], [[0.0, 1.0]], decades=0.01), "two grid points"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
