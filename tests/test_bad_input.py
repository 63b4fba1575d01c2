"""theory section 7: each bad input raises ValueError naming the argument and the first bad index."""

import numpy as np
import pytest

import aggregation as ag
from aggregation import examples

pytestmark = pytest.mark.nojit
W2 = np.array([0.5, 0.5])
P = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])


def _probs_with(idx, value):
    p = P.copy()
    p[idx] = value
    return p


@pytest.mark.parametrize("pool", [ag.arithmetic_pool, ag.geometric_pool])
@pytest.mark.parametrize("value, match", [(np.nan, r"probs\[\(1, 2\)\] = nan is not finite"),
                                          (np.inf, r"probs\[\(1, 2\)\] = inf is not finite"),
                                          (-0.1, r"probs\[\(1, 2\)\] = -0.1 is negative")])
def test_bad_probabilities(pool, value, match):
    with pytest.raises(ValueError, match=match):
        pool(_probs_with((1, 2), value), W2)


@pytest.mark.parametrize("pool", [ag.arithmetic_pool, ag.geometric_pool])
def test_rows_not_summing_to_one(pool):
    with pytest.raises(ValueError, match=r"probs\[1\] sums to 1\.1"):
        pool(_probs_with((1, 2), 0.9), W2)
    pool(P * (1 + 5e-7), W2)          # within the 1e-6 relative tolerance


@pytest.mark.parametrize("pool", [ag.log_arithmetic_pool, ag.log_geometric_pool, ag.log_partition])
def test_bad_log_probabilities(pool):
    lp = np.log(P)
    lp[1, 0] = 0.3
    with pytest.raises(ValueError, match=r"log_probs\[\(1, 0\)\] = 0.3 > 0"):
        pool(lp, W2)
    lp[0, 2] = np.nan
    with pytest.raises(ValueError, match=r"log_probs\[\(0, 2\)\] is NaN"):
        pool(lp, W2)


@pytest.mark.parametrize("pool", [ag.log_arithmetic_pool, ag.log_geometric_pool])
def test_bad_log_probabilities_in_a_large_middle_axis(pool):
    lp = np.log(np.full((3, 50, 7, 4), 0.25))
    lp[2, 31, 5, 1] = 1e-3
    with pytest.raises(ValueError, match=r"log_probs\[\(2, 31, 5, 1\)\]"):
        pool(lp, np.full(3, 1 / 3))


@pytest.mark.parametrize("weights, match", [
    ([0.5, 0.3, 0.2], r"weights has length 3 but the teacher axis \(axis 0\)"),
    ([1.5, -0.5], r"weights\[1\] = -0.5 is negative"),
    ([0.5, np.nan], r"weights\[1\] = nan is not finite"),
    ([0.5, 0.4], r"weights sum to 0.9"),
    ([[0.5, 0.5]], r"weights must be 1-D"),
])
@pytest.mark.parametrize("pool", [ag.arithmetic_pool, ag.geometric_pool])
def test_bad_weights(pool, weights, match):
    with pytest.raises(ValueError, match=match):
        pool(P, weights)


def test_empty_support_intersection():
    p = np.array([[1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match="empty support intersection"):
        ag.geometric_pool(p, W2)
    with pytest.raises(ValueError, match=r"empty support intersection at middle index \(1,\)"):
        ag.log_geometric_pool(np.log(np.stack([[[0.5, 0.5], [1.0, 0.0]], [[0.5, 0.5], [0.0, 1.0]]])), W2)


def test_weight_zero_teacher_with_zeros_is_finite_and_exact():
    p = np.array([[1.0, 0.0], [0.0, 1.0], [0.3, 0.7]])
    w = np.array([0.0, 0.5, 0.5])
    np.testing.assert_allclose(ag.geometric_pool(p, w), [0.0, 1.0])
    np.testing.assert_allclose(ag.arithmetic_pool(p, w), [0.15, 0.85])
    w = np.array([0.0, 0.0, 1.0])
    np.testing.assert_allclose(ag.geometric_pool(p, w), p[2])
    assert ag.log_partition(np.log(p[[0, 2]]), [0.0, 1.0]) == pytest.approx(0.0, abs=1e-14)


def test_vocabulary_and_teacher_axes():
    with pytest.raises(ValueError, match="at least 2 axes"):
        ag.log_geometric_pool(np.log([0.5, 0.5]), [1.0])
    with pytest.raises(ValueError, match="empty vocabulary axis"):
        ag.log_geometric_pool(np.zeros((2, 3, 0)), W2)


def _machine():
    return np.array([[1, -1], [1, 0]]), np.log(np.full((2, 2, 2), 0.5))


def test_finite_state_teachers_validation():
    ns, lp = _machine()
    ag.FiniteStateTeachers(ns, lp)
    bad = ns.copy()
    bad[1, 0] = 2
    with pytest.raises(ValueError, match=r"next_state\[\(1, 0\)\] = 2 is out of range \[-1, 2\)"):
        ag.FiniteStateTeachers(bad, lp)
    bad[1, 0] = -2
    with pytest.raises(ValueError, match=r"next_state\[\(1, 0\)\] = -2"):
        ag.FiniteStateTeachers(bad, lp)
    with pytest.raises(ValueError, match="integer array"):
        ag.FiniteStateTeachers(ns.astype(float), lp)
    with pytest.raises(ValueError, match=r"log_probs axis 1 \(states\) has 3 entries but next_state axis 0 has 2"):
        ag.FiniteStateTeachers(ns, np.log(np.full((2, 3, 2), 0.5)))
    with pytest.raises(ValueError, match=r"log_probs axis 2 \(vocabulary\) has 3"):
        ag.FiniteStateTeachers(ns, np.log(np.full((2, 2, 3), 1 / 3)))
    unnorm = lp.copy()
    unnorm[1, 1, 0] = np.log(0.6)
    with pytest.raises(ValueError, match=r"log_probs\[\(1, 1\)\] sums to 1\.1"):
        ag.FiniteStateTeachers(ns, unnorm)
    with pytest.raises(ValueError, match=r"start = 5"):
        ag.FiniteStateTeachers(ns, lp, start=5)


def test_sequence_functions_validate():
    t = ag.FiniteStateTeachers(*_machine())
    with pytest.raises(ValueError, match="horizon = -1 is negative"):
        ag.sequence_log_partition(t, W2, -1)
    with pytest.raises(ValueError, match="horizon = -3 is negative"):
        ag.sequence_geometric_conditionals(t, W2, -3)
    with pytest.raises(ValueError, match="weights has length 3"):
        ag.sequence_log_partition(t, [0.2, 0.3, 0.5], 2)
    with pytest.raises(ValueError, match=r"path\[1\] = 7 is outside the vocabulary"):
        ag.mixture_conditionals(t, W2, [0, 7])
    with pytest.raises(ValueError, match=r"path\[0\] = 1 ends the response but the path goes on"):
        ag.sequence_log_prob(t, [1, 0])
    with pytest.raises(ValueError, match="target = 'nope'"):
        ag.sample_paths(t, W2, 3, 10, seed=0, target="nope")
    with pytest.raises(ValueError, match="target = 2 is not a teacher index"):
        ag.state_occupancy(t, W2, 3, target=2)
    with pytest.raises(ValueError, match="n_samples = -1"):
        ag.sample_paths(t, W2, 3, -1, seed=0)
    with pytest.raises(ValueError, match="must be a FiniteStateTeachers"):
        ag.sequence_log_partition(np.zeros((2, 2)), W2, 1)


def test_sequence_level_empty_support():
    """Every teacher has a response, but no response has positive weight under both: Z_seq = 0."""
    ns = np.array([[1, 2], [-1, -1], [-1, -1]])
    probs = np.array([[[0.5, 0.5], [1.0, 0.0], [0.0, 1.0]],
                      [[0.5, 0.5], [0.0, 1.0], [1.0, 0.0]]])
    t = ag.FiniteStateTeachers.from_probs(ns, probs)
    with pytest.raises(ValueError, match="empty support intersection at the sequence level"):
        ag.sequence_log_partition(t, W2, 2)
    # with one of them at weight 0 the target is that teacher, finite and exact
    g = ag.sequence_geometric_conditionals(t, [1.0, 0.0], 2)
    np.testing.assert_allclose(np.exp(g[0, 0]), [0.5, 0.5])
    with pytest.raises(ValueError, match="empty support intersection"):
        ag.local_geometric_conditionals(t, W2)


def test_mixture_path_with_zero_probability():
    t = examples.prefix_bias_teachers([1.0, 1.0], [[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(ValueError, match=r"path\[0\] = 1: the prefix has probability 0"):
        ag.mixture_conditionals(t, W2, [1, 0])
