"""Hypothesis properties of the pools (theory section 1) and of the sequence level (theory section 2).

Teachers are drawn from a seed, with K up to 16, n up to 64, probabilities down to 1e-300 and exact
zeros (-inf log-probs) on all tokens but a shared one, so that supports always intersect.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.special import logsumexp, xlogy
from scipy.stats import chisquare

import aggregation as ag
from aggregation import _reference, examples

pytestmark = pytest.mark.nojit


@st.composite
def teachers(draw, max_k=16, max_n=64, rows=3):
    """(log_probs (K, m, n), weights (K,)) with near-degenerate options."""
    K = draw(st.integers(1, max_k))
    n = draw(st.integers(2, max_n))
    m = draw(st.integers(1, rows))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    conc = draw(st.sampled_from([0.05, 0.5, 1.0, 10.0]))
    probs = rng.dirichlet(np.full(n, conc), size=(K, m))
    if draw(st.booleans()):                      # exact zeros, token 0 kept
        zero = rng.random(probs.shape) < 0.3
        zero[..., 0] = False
        probs = np.where(zero, 0.0, probs)
    if draw(st.booleans()):                      # one tiny entry per row
        col = rng.integers(1, n, size=(K, m))
        np.put_along_axis(probs, col[..., None], draw(st.sampled_from([1e-300, 1e-150, 1e-20])), -1)
    probs = np.maximum(probs, 0.0)
    probs /= probs.sum(-1, keepdims=True)
    w = rng.dirichlet(np.ones(K))
    if K > 1 and draw(st.booleans()):            # a weight-0 teacher
        w[0] = 0.0
        w /= w.sum()
    with np.errstate(divide="ignore"):
        return np.log(probs), w


def kl(p, q):
    """KL(p || q) over the last axis, 0 log 0 = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sum(xlogy(p, p) - xlogy(p, q), axis=-1)


def wsum(w, per_teacher):
    """sum_k w_k x_k over the positive-weight teachers (weight-0 teachers are left out: 0 * inf)."""
    keep = w > 0
    return np.tensordot(w[keep], per_teacher[keep], axes=1)


def entropy(p):
    return -np.sum(xlogy(p, p), axis=-1)


@given(teachers(), st.integers(0, 2**31))
def test_fkl_identity(tw, seed):
    """sum_k w_k KL(p_k || q) = sum_k w_k KL(p_k || A) + KL(A || q)."""
    lp, w = tw
    p = np.exp(lp)
    A = np.exp(ag.log_arithmetic_pool(lp, w))
    q = np.random.default_rng(seed).dirichlet(np.ones(lp.shape[-1]), size=lp.shape[1])
    lhs = wsum(w, kl(p, q))
    rhs = wsum(w, kl(p, A)) + kl(A, q)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-9, atol=1e-9)


@given(teachers(), st.integers(0, 2**31))
def test_rkl_identity(tw, seed):
    """sum_k w_k KL(q || p_k) = KL(q || G) - ln Z for q supported on supp G."""
    lp, w = tw
    lg = ag.log_geometric_pool(lp, w)
    lz = ag.log_partition(lp, w)
    q = np.random.default_rng(seed).dirichlet(np.ones(lp.shape[-1]), size=lp.shape[1]) * (lg > -np.inf)
    q /= q.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        per_teacher = np.sum(xlogy(q, q)[None] - np.where(q[None] > 0, q[None] * lp, 0.0), axis=-1)
    lhs = wsum(w, per_teacher)
    rhs = np.sum(xlogy(q, q) - np.where(q > 0, q * lg, 0.0), axis=-1) - lz
    np.testing.assert_allclose(lhs, rhs, rtol=1e-9, atol=1e-7)


@given(teachers())
def test_partition_at_most_one(tw):
    lp, w = tw
    assert np.all(ag.log_partition(lp, w) <= 1e-12)


@given(teachers(), st.integers(0, 2**31))
def test_geometric_pool_invariant_to_rescaling_a_teacher(tw, seed):
    """G is unchanged when a teacher's row is scaled before normalising, even by e^-800."""
    lp, w = tw
    shift = np.random.default_rng(seed).choice([-800.0, -30.0, -1e-3], size=lp.shape[:-1] + (1,))
    np.testing.assert_allclose(ag.log_geometric_pool(lp + shift, w), ag.log_geometric_pool(lp, w),
                               rtol=1e-9, atol=1e-9)


@given(teachers(), st.integers(2, 8))
def test_unanimity(tw, K):
    lp, _ = tw
    same = np.repeat(lp[:1], K, axis=0)
    w = np.random.default_rng(K).dirichlet(np.ones(K))
    np.testing.assert_allclose(np.exp(ag.log_geometric_pool(same, w)), np.exp(lp[0]), atol=1e-12)
    np.testing.assert_allclose(np.exp(ag.log_arithmetic_pool(same, w)), np.exp(lp[0]), atol=1e-12)
    np.testing.assert_allclose(ag.log_partition(same, w), 0.0, atol=1e-12)


@given(teachers(), st.data())
def test_one_hot_weights(tw, data):
    """One-hot weights give that teacher, whatever zeros the weight-0 teachers hold."""
    lp, _ = tw
    K = lp.shape[0]
    k = data.draw(st.integers(0, K - 1))
    w = np.eye(K)[k]
    np.testing.assert_allclose(np.exp(ag.log_geometric_pool(lp, w)), np.exp(lp[k]), atol=1e-12)
    np.testing.assert_allclose(np.exp(ag.log_arithmetic_pool(lp, w)), np.exp(lp[k]), atol=1e-12)


@given(teachers(), st.integers(0, 2**31))
def test_permutation_equivariance(tw, seed):
    lp, w = tw
    perm = np.random.default_rng(seed).permutation(lp.shape[0])
    np.testing.assert_allclose(ag.log_geometric_pool(lp[perm], w[perm]), ag.log_geometric_pool(lp, w),
                               rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(ag.log_arithmetic_pool(lp[perm], w[perm]),
                               ag.log_arithmetic_pool(lp, w), rtol=1e-10, atol=1e-10)


def _positive_weights(seed, K):
    return np.random.default_rng(seed).dirichlet(np.ones(K))


@given(teachers(max_k=8), st.integers(0, 2**31))
def test_log_partition_convex_in_weights(tw, seed):
    lp, _ = tw
    K = lp.shape[0]
    w1, w2 = _positive_weights(seed, K), _positive_weights(seed + 1, K)
    mid = ag.log_partition(lp, 0.5 * (w1 + w2))
    assert np.all(mid <= 0.5 * (ag.log_partition(lp, w1) + ag.log_partition(lp, w2)) + 1e-9)


@given(teachers(max_k=8), st.integers(0, 2**31))
def test_log_partition_gradient(tw, seed):
    """d/dt ln Z(w + t (e_i - e_j)) = E_G[ln p_i - ln p_j] (gradient E_G[ln p_k])."""
    lp, _ = tw
    K = lp.shape[0]
    if K < 2:
        return
    w = _positive_weights(seed, K)
    G = np.exp(ag.log_geometric_pool(lp, w))
    grad = np.array([np.sum(np.where(G > 0, G * lp[k], 0.0), axis=-1) for k in range(K)])
    i, j = 0, K - 1
    t = 1e-6 * min(w[i], w[j])
    d = np.zeros(K)
    d[i], d[j] = 1.0, -1.0
    fd = (ag.log_partition(lp, w + t * d) - ag.log_partition(lp, w - t * d)) / (2 * t)
    scale = 1 + np.abs(lp[[i, j]][np.isfinite(lp[[i, j]])]).max()
    np.testing.assert_allclose(fd, grad[i] - grad[j], atol=1e-5 * scale, rtol=1e-5)


@given(teachers(), st.integers(0, 2**31))
def test_external_bayesianity_geometric(tw, seed):
    """Updating every teacher by one likelihood, then pooling = pooling, then updating (G)."""
    lp, w = tw
    loglik = np.log(np.random.default_rng(seed).uniform(0.01, 1.0, size=lp.shape[1:]))
    updated = lp + loglik
    updated -= logsumexp(updated, axis=-1, keepdims=True)
    lhs = ag.log_geometric_pool(updated, w)
    rhs = ag.log_geometric_pool(lp, w) + loglik
    rhs -= logsumexp(rhs, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.exp(lhs), np.exp(rhs), atol=1e-10)


def test_external_bayesianity_fails_for_mixture():
    p = np.log(np.array([[0.9, 0.1], [0.1, 0.9]]))
    w = np.array([0.5, 0.5])
    loglik = np.log(np.array([0.9, 0.1]))
    updated = p + loglik
    updated -= logsumexp(updated, axis=-1, keepdims=True)
    lhs = ag.log_arithmetic_pool(updated, w)
    rhs = ag.log_arithmetic_pool(p, w) + loglik
    rhs -= logsumexp(rhs)
    assert abs(np.exp(lhs[0]) - np.exp(rhs[0])) > 0.1


def _merge01(p):
    """Merge tokens 0 and 1 of a probability array (last axis)."""
    return np.concatenate([p[..., :1] + p[..., 1:2], p[..., 2:]], axis=-1)


@given(teachers())
def test_marginalisation_arithmetic(tw):
    lp, w = tw
    p = np.exp(lp)
    # merging two tokens of a row can round its sum to 1 + 2^-52: clip that ln(1 + eps) back to 0
    merged = np.exp(ag.log_arithmetic_pool(np.minimum(np.log(_merge01(p)), 0.0), w))
    np.testing.assert_allclose(merged, _merge01(np.exp(ag.log_arithmetic_pool(lp, w))), atol=1e-12)


def test_marginalisation_fails_for_geometric():
    p = np.array([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1]])
    w = np.array([0.5, 0.5])
    pooled_then_merged = _merge01(ag.geometric_pool(p, w))
    merged_then_pooled = ag.geometric_pool(_merge01(p), w)
    assert abs(pooled_then_merged[0] - merged_then_pooled[0]) > 0.02   # 0.850 vs 0.900


@given(teachers())
def test_log_odds_linearity(tw):
    """ln G(a) - ln G(0) = sum_k w_k (ln p_k(a) - ln p_k(0)) on the support of G."""
    lp, w = tw
    lg = ag.log_geometric_pool(lp, w)
    keep = w > 0
    odds = np.tensordot(w[keep], lp[keep] - lp[keep][..., :1], axes=1)
    fin = np.isfinite(lg)
    np.testing.assert_allclose((lg - lg[..., :1])[fin], odds[fin], atol=1e-8, rtol=1e-10)
    assert np.all(np.isneginf(odds[~fin]))


@given(teachers())
def test_jensen_shannon_bounds(tw):
    """0 <= H(A) - sum_k w_k H(p_k) <= H(w)."""
    lp, w = tw
    p = np.exp(lp)
    A = np.exp(ag.log_arithmetic_pool(lp, w))
    js = entropy(A) - wsum(w, entropy(p))
    assert np.all(js >= -1e-10)
    assert np.all(js <= entropy(w) + 1e-10)


@st.composite
def trees(draw):
    """Small prefix trees (some responses end early) and weights, for brute-force enumeration."""
    K = draw(st.integers(1, 4))
    n = draw(st.integers(2, 3))
    depth = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31))
    t = examples.prefix_tree(K, depth, n, seed, concentration=draw(st.sampled_from([0.3, 1.0])),
                             zero_fraction=draw(st.sampled_from([0.0, 0.3])),
                             tiny=draw(st.sampled_from([None, 1e-300])), end_prob=0.2)
    w = np.random.default_rng(seed).dirichlet(np.ones(K))
    return t, w, depth


def _enumerated(t, w, horizon):
    responses = _reference.enumerate_responses(t, horizon)
    log_p = np.array([lp for _, lp in responses])                  # (R, K)
    keep = w > 0
    log_geo = log_p[:, keep] @ w[keep]
    log_mix = logsumexp(log_p + np.log(np.where(keep, w, 1.0)), axis=1, b=keep.astype(float))
    return responses, log_geo, log_mix


@given(trees())
def test_backward_recursion_vs_enumeration(twd):
    t, w, depth = twd
    _, log_geo, _ = _enumerated(t, w, depth)
    log_z = ag.sequence_log_partition(t, w, depth)
    assert log_z[0, t.start] == pytest.approx(logsumexp(log_geo), rel=1e-10, abs=1e-10)


@given(st.integers(0, 2**31), st.integers(1, 6))
def test_backward_recursion_vs_enumeration_with_cycles(seed, horizon):
    """A machine with cycles unrolled to the horizon: ln Z(start) = ln sum_y prod_k p_k(y)^{w_k}."""
    t = examples.random_teachers(3, 4, 3, seed, end_prob=0.2)
    w = np.random.default_rng(seed).dirichlet(np.ones(3))
    _, log_geo, _ = _enumerated(t, w, horizon)
    assert ag.sequence_log_partition(t, w, horizon)[0, t.start] == pytest.approx(logsumexp(log_geo), rel=1e-10)


@given(trees())
def test_chain_rule_geometric(twd):
    """prod_h g(y_h | y_<h) = G_seq(y) for every response y."""
    t, w, depth = twd
    responses, log_geo, _ = _enumerated(t, w, depth)
    log_g = ag.sequence_geometric_conditionals(t, w, depth)
    lz = logsumexp(log_geo)
    for (tokens, _), lg in zip(responses, log_geo):
        s, total = t.start, 0.0
        for h, a in enumerate(tokens):
            total += log_g[h, s, a]
            s = t.next_state[s, a]
        if np.isfinite(lg):
            assert total == pytest.approx(lg - lz, rel=1e-9, abs=1e-9)
        else:
            assert total == -np.inf


@given(trees())
def test_chain_rule_mixture(twd):
    """prod_h A(y_h | y_<h) = A_seq(y), the conditionals carrying posterior weights."""
    t, w, depth = twd
    responses, _, log_mix = _enumerated(t, w, depth)
    for (tokens, _), lm in zip(responses, log_mix):
        if not np.isfinite(lm):
            continue
        cond = ag.mixture_conditionals(t, w, list(tokens))
        total = sum(cond[h, a] for h, a in enumerate(tokens))
        assert total == pytest.approx(lm, rel=1e-9, abs=1e-9)


def test_sampling_frequencies_match_exact_probabilities():
    """Chi-square test (fixed seed) of sampled responses against the exact G_seq, A_seq, l and p_k."""
    t = examples.prefix_tree(3, 3, 2, seed=7, end_prob=0.3)
    w = np.array([0.5, 0.3, 0.2])
    responses, log_geo, log_mix = _enumerated(t, w, 3)
    local = ag.local_geometric_conditionals(t, w)
    index = {tokens: i for i, (tokens, _) in enumerate(responses)}

    def exact_local(tokens):
        s, total = t.start, 0.0
        for a in tokens:
            total += local[s, a]
            s = t.next_state[s, a]
        return total

    cases = {
        "geometric": np.exp(log_geo - logsumexp(log_geo)),
        "mixture": np.exp(log_mix),
        "local": np.exp([exact_local(tok) for tok, _ in responses]),
        1: np.exp([lp[1] for _, lp in responses]),
    }
    N = 40_000
    for target, probs in cases.items():
        paths = ag.sample_paths(t, w, 3, N, seed=123, target=target)
        counts = np.zeros(len(responses))
        for row in paths:
            counts[index[tuple(int(a) for a in row if a >= 0)]] += 1
        pos = probs > 0
        assert counts[~pos].sum() == 0
        assert probs.sum() == pytest.approx(1.0, abs=1e-9)
        _, pval = chisquare(counts[pos], N * probs[pos] / probs[pos].sum())
        assert pval > 1e-3, (target, pval)


@given(trees())
def test_occupancy_vs_enumeration(twd):
    """state_occupancy under a teacher = the probability of the responses' prefixes at each state."""
    t, w, depth = twd
    responses, _, _ = _enumerated(t, w, depth)
    occ = ag.state_occupancy(t, None, depth, target=0)
    expected = np.zeros_like(occ)
    seen = set()
    for tokens, _ in responses:
        s, lp = t.start, 0.0
        for h in range(len(tokens) + 1):
            if (tokens[:h]) not in seen and s >= 0 and h <= depth:
                seen.add(tokens[:h])
                expected[h, s] += np.exp(lp)
            if h < len(tokens):
                lp += t.log_probs[0, s, tokens[h]]
                s = t.next_state[s, tokens[h]]
    np.testing.assert_allclose(occ, expected, atol=1e-12)


@given(teachers(max_k=6, max_n=16), st.integers(0, 2**31))
def test_partition_is_one_iff_the_teachers_agree(tw, seed):
    """theory section 1: Z = 1 iff every positive-weight teacher is the same distribution. Agreeing teachers give
    ln Z = 0 to rounding; teachers that differ by a finite amount give Z bounded away from 1, and for
    nearly equal teachers 1 - Z = w1 w2 chi^2(p1, p2) / 2 + O(delta^3), so strictness is asserted only
    where that second-order gap exceeds the arithmetic's resolution."""
    lp, w = tw
    same = np.broadcast_to(lp[-1:], lp.shape)
    np.testing.assert_allclose(ag.log_partition(same, w), 0.0, atol=1e-12)
    keep = np.flatnonzero(w > 0)
    if keep.size >= 2 and w[keep].min() > 0.05:
        # two teachers 0.05 apart on a token: 1 - Z >= about w1 w2 0.05^2 / 2 > 3e-6
        differ = np.any(np.abs(np.exp(lp[keep]) - np.exp(lp[keep[:1]])) > 0.05, axis=(0, 2))
        lz = ag.log_partition(lp, w)
        assert np.all(lz[differ] < -1e-7)


def test_one_minus_partition_for_nearly_equal_teachers():
    """1 - Z = (w1 w2 / 2) chi^2(p1, p2) + O(delta^3) for two teachers p1 and p2 = p1 (1 + delta h)."""
    rng = np.random.default_rng(7)
    p1 = rng.dirichlet(np.ones(6))
    h = rng.normal(size=6)
    h -= p1 @ h                                             # so that p2 sums to 1
    w = np.array([0.3, 0.7])
    for delta in (1e-2, 1e-3):
        p2 = p1 * (1 + delta * h)
        chi2 = np.sum((p2 - p1) ** 2 / p1)
        one_minus_z = -np.expm1(ag.log_partition(np.log(np.stack([p1, p2])), w))
        assert one_minus_z == pytest.approx(w[0] * w[1] * chi2 / 2, rel=20 * delta)


@given(st.integers(0, 2**31), st.sampled_from([0, 1, -1]), st.sampled_from([0.0, 700.0, -1e4]))
def test_log_softmax_is_the_log_of_the_normalised_exponentials(seed, axis, offset):
    """Rows (or columns) sum to one in probability and equal scipy's log_softmax, also for logits far from 0 (where
    exp alone overflows or underflows to 0)."""
    from scipy.special import log_softmax as scipy_log_softmax
    from aggregation.pools import log_softmax
    z = np.random.default_rng(seed).normal(scale=5, size=(4, 6, 3)) + offset
    got = log_softmax(z, axis=axis)
    np.testing.assert_allclose(got, scipy_log_softmax(z, axis=axis), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.exp(got).sum(axis=axis), 1.0, rtol=1e-13)
