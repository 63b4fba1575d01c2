"""Each numba kernel against its NumPy twin in _reference.py, the vectorised exp/log accuracy, and
the linear-space recursion's fallback to log space."""

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import aggregation as ag
from aggregation import _kernels, _reference, examples
from aggregation.sequence import _reward
from aggregation.validate import read_only

pytestmark = pytest.mark.nojit


def test_exp_accuracy_over_the_float64_range():
    x = np.concatenate([np.linspace(-760.0, 709.7, 200_001), [-np.inf, 0.0, -745.2, -745.0, -708.5, 709.78]])
    got = _kernels.exp_kernel(x)
    ref = np.exp(x)
    normal = ref >= np.finfo(float).tiny
    rel = np.abs(got[normal] - ref[normal]) / ref[normal]
    assert rel.max() < 5e-14
    sub = (ref > 0) & ~normal                     # subnormal results: within a few ulps of 5e-324
    assert np.all(np.abs(got[sub] - ref[sub]) <= 4 * 5e-324 + 5e-14 * ref[sub])
    assert np.all(got[x < -745.2] == 0.0)
    assert got[-6] == 0.0 and got[-5] == 1.0
    assert not np.isnan(got).any()
    assert _kernels.exp_kernel(np.array([710.0]))[0] == np.inf


def test_log_accuracy():
    x = np.concatenate([np.exp(np.linspace(-700, 700, 100_001)), [1.0, 2.0, np.sqrt(2.0), 16.0]])
    err = np.abs(_kernels.log_kernel(x) - np.log(x))
    assert err.max() < 4e-13 and err[-4] == 0.0


@st.composite
def pool_inputs(draw):
    K, m, n = draw(st.integers(1, 16)), draw(st.integers(1, 40)), draw(st.integers(1, 64))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    lp = np.log(rng.dirichlet(np.ones(n), size=(K, m)))
    lp[rng.random(lp.shape) < draw(st.sampled_from([0.0, 0.2]))] = -np.inf
    lp[..., 0] = np.log(0.5)
    return np.ascontiguousarray(lp), rng.dirichlet(np.ones(K)) + 1e-3


@given(pool_inputs(), st.integers(1, 3))
def test_geometric_pool_kernel_vs_twin(inputs, chunks):
    lp, w = inputs
    K, m, n = lp.shape
    out, log_z, status = np.empty((m, n)), np.empty(m), np.empty(m, np.int8)
    _kernels.log_geometric_pool_kernel(read_only(lp), w, out, log_z, status, chunks, 0)
    assert not status.any()
    np.testing.assert_allclose(out, _reference.log_geometric_pool(lp, w), rtol=1e-12, atol=1e-12)


@given(pool_inputs(), st.integers(1, 3))
def test_arithmetic_pool_kernel_vs_twin(inputs, chunks):
    lp, w = inputs
    K, m, n = lp.shape
    out, status = np.empty((m, n)), np.empty(m, np.int8)
    _kernels.log_arithmetic_pool_kernel(read_only(lp), np.log(w), out, status, chunks, 0)
    assert not status.any()
    np.testing.assert_allclose(out, _reference.log_arithmetic_pool(lp, w), rtol=1e-12, atol=1e-12)


def test_pool_kernels_flag_bad_rows():
    lp = np.log(np.full((2, 3, 4), 0.25))
    lp[1, 1, 2] = 0.5
    lp[1, 2, 3] = np.nan
    out, log_z, status = np.empty((3, 4)), np.empty(3), np.empty(3, np.int8)
    _kernels.log_geometric_pool_kernel(read_only(lp), np.array([0.5, 0.5]), out, log_z, status, 2, 0)
    assert list(status) == [0, 1, 1]
    _kernels.log_arithmetic_pool_kernel(read_only(lp), np.log([0.5, 0.5]), out, status, 2, 0)
    assert list(status) == [0, 1, 1]


machines = st.builds(
    lambda K, S, n, seed, end: examples.random_teachers(K, S, n, seed, end_prob=end, zero_fraction=0.2),
    st.integers(1, 5), st.integers(1, 30), st.integers(2, 8), st.integers(0, 2**31),
    st.sampled_from([0.0, 0.1, 0.5]))


@given(machines, st.integers(0, 40))
def test_sequence_kernels_vs_twin(t, horizon):
    w = np.random.default_rng(t.S).dirichlet(np.ones(t.K))
    reward = _reward(t, w)
    np.testing.assert_allclose(reward, _reference.pooled_weights(t.log_probs, w), rtol=1e-14)
    ref = _reference.sequence_log_partition(t.next_state, reward, horizon)
    lin, log = np.empty_like(ref), np.empty_like(ref)
    assert _kernels.sequence_log_partition_linear_kernel(t.next_state, reward, horizon, lin)
    _kernels.sequence_log_partition_log_kernel(t.next_state, reward, horizon, log)
    np.testing.assert_allclose(lin, ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(log, ref, rtol=1e-12, atol=1e-12)
    cond = np.empty((horizon, t.S, t.n))
    _kernels.geometric_conditionals_kernel(t.next_state, reward, ref, cond)
    np.testing.assert_allclose(cond, _reference.geometric_conditionals(t.next_state, reward, ref),
                               rtol=1e-12, atol=1e-12)


@given(machines, st.integers(0, 12), st.integers(0, 2**31))
def test_sampling_and_occupancy_kernels_vs_twin(t, horizon, seed):
    rng = np.random.default_rng(seed)
    probs = np.exp(t.log_probs)
    cdf = np.ascontiguousarray(np.cumsum(probs, axis=-1))
    table = rng.integers(0, t.K, size=50)
    uniforms = rng.random((50, horizon))
    out = np.empty((50, horizon), np.int64)
    _kernels.sample_paths_kernel(t.next_state, cdf, table, 0, t.start, uniforms, out)
    np.testing.assert_array_equal(out, _reference.sample_paths(t.next_state, cdf, table, 0, t.start, uniforms))
    occ = np.zeros((horizon + 1, t.S))
    _kernels.state_occupancy_kernel(t.next_state, probs[:1], 0, t.start, horizon, occ)
    np.testing.assert_allclose(occ, _reference.state_occupancy(t.next_state, probs[:1], 0, t.start, horizon),
                               rtol=1e-12, atol=1e-15)


def test_linear_recursion_falls_back_to_log_space_on_underflow():
    """H = 2000 with a sharply disagreeing branch: Z(C) = 0.6^1999 ~ 1e-443 next to Z(I) = 1."""
    t = examples.prefix_bias_teachers([0.9, 0.9], [[0.9, 0.1], [0.1, 0.9]])
    w = np.array([0.5, 0.5])
    H = 2000
    with pytest.warns(ag.NumericalFallbackWarning):
        log_z = ag.sequence_log_partition(t, w, H)
    assert log_z[1, 1] == pytest.approx((H - 1) * np.log(0.6), rel=1e-12)
    assert log_z[1, 2] == pytest.approx(0.0, abs=1e-12)
    out = np.empty_like(log_z)
    assert not _kernels.sequence_log_partition_linear_kernel(t.next_state, _reward(t, w), H, out)
    with pytest.warns(ag.NumericalFallbackWarning):
        g = np.exp(ag.sequence_geometric_conditionals(t, w, H)[0, 0])
    # g(C) = l(C) rho^(H-1) / (l(C) rho^(H-1) + l(I)) with l(C) = 0.9 -> astronomically small
    assert g[0] == pytest.approx(np.exp(np.log(9) + (H - 1) * np.log(0.6)), rel=1e-9)
    assert g[1] == pytest.approx(1.0, abs=1e-15)


def test_no_fallback_warning_in_the_ordinary_case():
    t = examples.random_teachers(4, 200, 16, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ag.NumericalFallbackWarning)
        ag.sequence_log_partition(t, np.full(4, 0.25), 256)


def test_tiny_pooled_weights_stay_linear_where_they_cannot_matter():
    """Pooled log-weights below ln DBL_MIN = -708.4 (their exp subnormal or 0) beside entries that carry the
    row: the linear recursion keeps float64 accuracy (no fallback), equal to the log-space twin; the pooled
    weights here reach -1,000 and -1,400, as an LLM's heavy-tailed log-probabilities do."""
    lp = np.array([[[0.0, -2000.0, -2800.0]], [[-10.0, 0.0, 0.0]]])
    lp[1] -= np.logaddexp.reduce(lp[1], axis=-1, keepdims=True)
    t = ag.FiniteStateTeachers(np.array([[0, 0, -1]]), lp)
    w = np.array([0.5, 0.5])
    reward = _reward(t, w)
    assert reward[0, 1] < -990 and reward[0, 2] < -1390 and reward[0, 0] > -6
    with warnings.catch_warnings():
        warnings.simplefilter("error", ag.NumericalFallbackWarning)
        log_z = ag.sequence_log_partition(t, w, 40)
    np.testing.assert_allclose(log_z, _reference.sequence_log_partition(t.next_state, reward, 40), rtol=1e-12,
                               atol=0)


def test_tiny_pooled_weights_that_carry_a_row_use_log_space():
    """A row whose every pooled weight is below DBL_MIN (e^-1000 each, so Z = 2 e^-1000, 0 in linear space;
    and e^-720 each, subnormal): the linear recursion refuses it and the log-space kernel gives it exactly."""
    for low in (-2000.0, -1440.0):
        t = ag.FiniteStateTeachers(np.array([[-1, -1]]), np.array([[[0.0, low]], [[low, 0.0]]]))
        w = np.array([0.5, 0.5])
        with pytest.warns(ag.NumericalFallbackWarning):
            log_z = ag.sequence_log_partition(t, w, 3)
        assert log_z[0, 0] == pytest.approx(low / 2 + np.log(2.0), rel=1e-13)
        out = np.empty_like(log_z)
        assert not _kernels.sequence_log_partition_linear_kernel(t.next_state, _reward(t, w), 3, out)
