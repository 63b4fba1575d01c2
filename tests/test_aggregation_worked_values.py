"""Every worked value of docs/theory.md sections 1 and 2, pinned to 1e-3 or better."""

import numpy as np
import pytest

import aggregation as ag
from aggregation import examples

pytestmark = pytest.mark.nojit
HALF = np.array([0.5, 0.5])


@pytest.mark.parametrize("d, top_a, top_g", [
    (0.05, 0.6167, 0.6796), (1e-2, 0.6567, 0.8319), (1e-4, 0.6666, 0.9804), (1e-8, 0.6667, 0.9998)])
def test_confident_expert_table(d, top_a, top_g):
    p = examples.confident_expert(d)
    assert ag.arithmetic_pool(p, HALF).max() == pytest.approx(top_a, abs=1e-4)
    assert ag.geometric_pool(p, HALF).max() == pytest.approx(top_g, abs=1e-4)
    # log-space entry points agree with the probability-space ones
    np.testing.assert_allclose(np.exp(ag.log_geometric_pool(np.log(p), HALF)), ag.geometric_pool(p, HALF))
    np.testing.assert_allclose(np.exp(ag.log_arithmetic_pool(np.log(p), HALF)), ag.arithmetic_pool(p, HALF))


@pytest.mark.parametrize("K, top_g, top_a", [(2, 0.980, 0.667), (5, 0.759, 0.467), (10, 0.557, 0.400),
                                             (50, 0.375, 0.347)])
def test_confident_expert_many_uniform(K, top_g, top_a):
    p = examples.confident_expert(1e-4, n_uniform=K - 1)
    w = np.full(K, 1.0 / K)
    assert ag.geometric_pool(p, w).max() == pytest.approx(top_g, abs=1e-3)
    assert ag.arithmetic_pool(p, w).max() == pytest.approx(top_a, abs=1e-3)


@pytest.mark.parametrize("e, g0", [(0.1, 0.675), (0.02, 0.542), (0.01, 0.483), (1e-3, 0.302),
                                   (1e-6, 0.0415), (0.0, 0.0)])
def test_low_probability_table(e, g0):
    p = examples.low_probability_teachers(e)
    w = np.full(3, 1 / 3)
    G = ag.geometric_pool(p, w)
    assert G[0] == pytest.approx(g0, abs=1e-3 if e else 0)
    if e:
        closed = 1 / (1 + (0.01 * (1 - e) / (0.81 * e)) ** (1 / 3))
        assert G[0] == pytest.approx(closed, rel=1e-10)
    assert 0.600 - 1e-9 <= ag.arithmetic_pool(p, w)[0] <= 0.6334


def test_low_probability_threshold():
    w = np.full(3, 1 / 3)
    e_star = 1 / 82
    g = lambda e: ag.geometric_pool(examples.low_probability_teachers(e), w)[0]
    assert g(e_star) == pytest.approx(0.5, abs=1e-12)
    assert g(e_star * 1.001) > 0.5 > g(e_star * 0.999)


PREFIX_ROWS = [
    # p, A_k, w, rho, H*, first flipped H, g(C) at H - 1, g(C) at H
    ((.9, .9), ((.9, .1), (.1, .9)), (.5, .5), 0.6, 4.301, 5, .538, .412),
    ((.9, .9), ((.8, .2), (.2, .8)), (.5, .5), 0.8, 9.847, 10, .547, .491),
    ((.99, .8), ((.8, .2), (.2, .8)), (.5, .5), 0.8, 13.40, 14, .522, .467),
    ((.9, .9), ((.8, .2), (.2, .8)), (.8, .2), 0.8702, 15.80, 16, .528, .493),
]


def g_correct(teachers, w, H):
    """g(C) after the first token when H more tokens follow."""
    return np.exp(ag.sequence_geometric_conditionals(teachers, w, H + 1)[0, 0, 0])


@pytest.mark.parametrize("p, A, w, rho, h_star, h_flip, g_before, g_after", PREFIX_ROWS)
def test_prefix_bias_rows(p, A, w, rho, h_star, h_flip, g_before, g_after):
    t = examples.prefix_bias_teachers(p, A)
    w = np.array(w)
    # rho = sum_a prod_k A_k(a)^{w_k} = Z of the continuation pool; ln Z(C) = H ln rho
    assert np.exp(ag.log_partition(np.log(np.array(A)), w)) == pytest.approx(rho, abs=1e-4)
    log_z = ag.sequence_log_partition(t, w, 8)
    exact_rho = np.exp(ag.log_partition(np.log(np.array(A)), w))
    assert log_z[1, 1] == pytest.approx(7 * np.log(exact_rho), rel=1e-13)   # ln Z(C) = 7 ln rho, exactly
    assert log_z[1, 2] == pytest.approx(0.0, abs=1e-12)
    p = np.array(p)
    assert np.sum(w * np.log(p / (1 - p))) / -np.log(rho) == pytest.approx(h_star, rel=5e-4)  # docs/theory.md prints 4 digits
    gs = np.array([g_correct(t, w, H) for H in range(h_flip + 1)])
    assert np.all(gs[:h_flip] > 0.5) and gs[h_flip] < 0.5
    assert gs[h_flip - 1] == pytest.approx(g_before, abs=1e-3)
    assert gs[h_flip] == pytest.approx(g_after, abs=1e-3)
    # only the sequence-level geometric flips: the local pool and the mixture marginal stay put
    local = np.exp(ag.local_geometric_conditionals(t, w)[0, 0])
    assert gs[0] == pytest.approx(local, rel=1e-12)
    mix = np.exp(ag.mixture_conditionals(t, w, [])[0, 0])
    assert mix == pytest.approx(np.dot(w, p), rel=1e-12)


def test_prefix_bias_local_at_zero_horizon():
    for p, A, w, *_ in PREFIX_ROWS[:2] + PREFIX_ROWS[3:]:
        t = examples.prefix_bias_teachers(p, A)
        assert g_correct(t, np.array(w), 0) == pytest.approx(0.9, abs=1e-12)


def test_target_log_probs_names_the_three_targets_of_a_loss():
    """aggregation.target_log_probs (the finite-state targets the sims' fixed points and the bridge's
    TabularLM read): the mixture, l and g of theory section 1-2 at every position, and a ValueError for anything else."""
    teachers, w, horizon = examples.prefix_bias_teachers([0.9, 0.9], [[0.9, 0.1], [0.1, 0.9]]), np.array([0.5, 0.5]), 4
    arithmetic = ag.target_log_probs(teachers, w, horizon, "arithmetic")
    assert arithmetic.shape == (horizon, teachers.S, teachers.n)
    np.testing.assert_allclose(arithmetic[2], ag.log_arithmetic_pool(teachers.log_probs, w), atol=1e-12)
    np.testing.assert_allclose(ag.target_log_probs(teachers, w, horizon, "local")[0],
                               ag.local_geometric_conditionals(teachers, w), atol=1e-12)
    np.testing.assert_allclose(ag.target_log_probs(teachers, w, horizon, "geometric"),
                               ag.sequence_geometric_conditionals(teachers, w, horizon), atol=1e-12)
    with pytest.raises(ValueError, match="target = 'mixture' must be one of"):
        ag.target_log_probs(teachers, w, horizon, "mixture")
    with pytest.raises(ValueError, match="horizon"):
        ag.target_log_probs(teachers, w, 0, "local")
    with pytest.raises(ValueError, match="weights"):
        ag.target_log_probs(teachers, [1.0], horizon, "local")
