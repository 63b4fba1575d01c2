"""The engine's building blocks and pools at the bit level: exp and log against NumPy in ulps over the
whole float64 range (0, subnormals, +-inf, NaN), the pools' float32 / float64 results against an
extended-precision (x87 long double) reference within the bounds their docstrings state, dtype
preservation, ``out=``, and the work queue (any worker count and block size gives the same result)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import numba
from numba import njit

import aggregation as ag
from aggregation import _kernels, _reference, jit
from aggregation.validate import read_only

pytestmark = pytest.mark.nojit

U64 = np.finfo(np.float64).eps / 2
LONG = np.longdouble


def ulps(got, ref):
    """|got - ref| in units of the spacing of got's dtype at ref (ref may be long double); 0 where both
    are equal or both NaN."""
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(got.astype(LONG) - ref.astype(LONG)) / np.spacing(np.abs(ref).astype(got.dtype)).astype(LONG)
    return np.where(same, 0.0, d)


SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, 1.0, 2.0, np.sqrt(2.0), 0.5, 5e-324, 1e-310,
                    2.2250738585072014e-308, 2.225073858507201e-308, 1.7976931348623157e308, -5e-324])


def test_exp_within_one_ulp_of_numpy_over_the_whole_range():
    x = np.concatenate([np.linspace(-760.0, 709.78, 100_001), SPECIAL, -SPECIAL,
                        [-745.13, -745.2, -744.4, -708.4, -708.39, 709.782712893384, 709.7827128933841, 710.0]])
    with np.errstate(all="ignore"):
        got, ref = _kernels.exp_kernel(x), np.exp(x)
    assert ulps(got, ref).max() <= 1.0
    # the specials exactly: -inf -> 0, +inf -> inf, NaN -> NaN, 0 and subnormals -> 1, overflow -> inf
    np.testing.assert_array_equal(got[np.isnan(x) | np.isinf(x) | (np.abs(x) < 1e-300) | (x > 709.8)],
                                  ref[np.isnan(x) | np.isinf(x) | (np.abs(x) < 1e-300) | (x > 709.8)])


def exp7_twin(d):
    """The fast terms of ``jit.exp_below`` (``EXP7_C``) in NumPy: exp(d) = 2^k P7(r), d = k ln2 + r, d >= -700."""
    d = np.maximum(d, -700.0)
    k = np.floor(d * 1.4426950408889634 + 0.5)
    r = (d - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10
    p = sum(r ** j / float(np.prod(np.arange(1, j + 1))) for j in range(8))
    return p * 2.0 ** k


@njit(error_model="numpy")
def exp_below_kernel(d, coefficients):
    out = np.empty_like(d)
    for i in range(d.shape[0]):
        out[i] = jit.exp_below(d[i], coefficients)
    return out


def test_fast_exp_terms_are_within_1e8_of_each_term_and_are_their_twin():
    """``exp_below(EXP7_C)`` term by term: within 1e-8 of NumPy's exp (relative) on [-700, 0], the polynomial's
    truncation at |r| = ln2 / 2 (7e-9) and nothing else; -inf gives 1e-304; the terms equal the NumPy twin's;
    the exact terms (``EXP_C``) are NumPy's exp to 1 ulp."""
    d = np.concatenate([np.linspace(-700.0, 0.0, 200_001), [-np.inf, -750.0, -0.34657, 0.0]])
    fast = exp_below_kernel(d, jit.EXP7_C)
    np.testing.assert_allclose(fast, exp7_twin(d), rtol=1e-15)
    with np.errstate(under="ignore"):
        ref = np.exp(np.maximum(d, -700.0))
    rel = np.abs(fast - ref) / ref
    assert rel.max() <= 1e-8 and rel.max() > 1e-9                 # the fast terms are not the exact ones
    terms = exp_below_kernel(d, jit.EXP_C)                        # the exact terms one by one
    assert ulps(terms, ref).max() <= 1.0


def test_float32_pools_sum_the_fast_terms_and_float64_pools_the_exact_ones():
    """The float32 pool's ln Z is the shifted log of the fast terms' sum (the twin), the float64 pool's that of
    NumPy's exp: on a row where the two differ by more than float64 rounding (one tile of the kernel: longer rows
    rescale each tile's sum as the running maximum grows)."""
    rng = np.random.default_rng(3)
    n = _kernels._POOL_TILE
    lp = np.log(rng.dirichlet(np.full(n, 0.3), size=(2, 1)))
    w = np.array([0.4, 0.6])
    s = np.tensordot(w, lp, axes=1)[0]
    top = s.max()
    lz_fast, lz_exact = top + np.log(exp7_twin(s - top).sum()), top + np.log(np.exp(s - top).sum())
    assert abs(lz_fast - lz_exact) > 1e-12
    for dtype, want in ((np.float32, lz_fast), (np.float64, lz_exact)):
        out, log_z, status = np.empty((1, n), dtype), np.empty(1), np.empty(1, np.int8)
        _kernels.log_geometric_pool_kernel(read_only(lp.astype(dtype)), w, out, log_z, status, 1, 0)
        s_d = np.tensordot(w, lp.astype(dtype).astype(np.float64), axes=1)[0]
        t_d = s_d.max()
        want = t_d + np.log((exp7_twin(s_d - t_d) if dtype == np.float32 else np.exp(s_d - t_d)).sum())
        assert abs(log_z[0] - want) < 1e-13, dtype


@njit(fastmath=jit.FASTMATH, error_model="numpy")
def float32_blocks_kernel(x, log):
    """jit.exp_below32 (or jit.ln32_normal) over x, inlined into a loop with the kernels' fastmath flags."""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = jit.ln32_normal(x[i]) if log else jit.exp_below32(x[i])
    return out


def test_float32_exp_and_log_within_their_ulp_bounds_of_the_exact_value():
    """exp_below32 on [-87, 0] within 1.5 ulps and ln32_normal on the positive normal float32 numbers (every binade,
    the ends, near 1) within 1, against long double; exp's clamp: below -87, -inf and NaN give e^-87 (a term the
    mixture's low threshold keeps out of its float32 sums), 0 and above give 1."""
    rng = np.random.default_rng(4)
    d = np.concatenate([np.linspace(-87.0, 0.0, 200_001), -rng.uniform(0.0, 87.0, 200_000),
                        -np.exp(rng.uniform(-100.0, np.log(87.0), 100_000)), [-0.34657, -0.0, 0.0]]).astype(np.float32)
    assert ulps(float32_blocks_kernel(d, False), np.exp(d.astype(LONG))).max() <= 1.5
    floor = float32_blocks_kernel(np.array([-87.0], np.float32), False)[0]
    clamped = np.array([-87.5, -100.0, -1e30, -np.inf, np.nan], np.float32)
    np.testing.assert_array_equal(float32_blocks_kernel(clamped, False), floor)
    np.testing.assert_array_equal(float32_blocks_kernel(np.array([1e-30, 0.5, 3.0], np.float32), False), 1.0)
    bits = rng.integers(0x00800000, 0x7F800000, 300_000).astype(np.int32)
    x = np.concatenate([bits.view(np.float32), np.float32(1.0) + np.linspace(-1e-3, 1e-3, 20_001, dtype=np.float32),
                        np.array([1.1754944e-38, 0.70710677, 0.7071068, 1.4142135, 1.4142137, 1.0, 2.0,
                                  3.4028235e38], np.float32)])
    exact = np.log(x.astype(LONG))
    got = float32_blocks_kernel(x, True)
    assert ulps(got, exact).max() <= 1.0
    assert got[x == 1.0].max() == 0.0


def mixture_sums(x, w):
    """S = sum_k w_k e^x_k of float32 log-probabilities x (K, m), in long double."""
    return (w[:, None].astype(LONG) * np.exp(x.astype(LONG))).sum(axis=0)


def rounds_clearly(v):
    """(v rounded to float32, whether v is more than 1e-3 float32 ulp from the rounding midpoints around it)."""
    f = v.astype(np.float32)
    mid = np.abs(v - f.astype(LONG)) / np.spacing(np.abs(f)).astype(LONG)
    return f, np.abs(mid - 0.5) > 1e-3


def test_float32_mixture_tiles_take_float32_arithmetic_only_where_every_sum_is_in_range():
    """A float32 mixture tile whose sums all lie in [2^-80, 2^-6] is computed in float32 arithmetic: within its
    bound, but not always the exact value correctly rounded; a tile with one sum just above 2^-6, or one just
    below 2^-80, is computed in float64, and every entry is the exact value correctly rounded (away from a
    rounding midpoint). 20 tiles of each kind, K = 8."""
    rng = np.random.default_rng(6)
    K, T, tiles = 8, _kernels._POOL_TILE, 20
    w = rng.dirichlet(np.ones(K))

    def draw(centre, low, high, count):            # entries whose sums lie in (low, high)
        x = (centre + rng.uniform(-0.3, 0.3, (K, 20 * count))).astype(np.float32)
        s = mixture_sums(x, w)
        keep = np.flatnonzero((s > low) & (s < high))[:count]
        assert keep.size == count
        return x[:, keep]
    inside = draw(-4.6, 2.0**-7, 0.99 * 2.0**-6, 3 * tiles * T)
    above = draw(-4.1, 1.01 * 2.0**-6, 2.0**-5, tiles)
    below = draw(-56.0, 2.0**-84, 0.99 * 2.0**-80, tiles)
    parts = []
    for j in range(tiles):
        parts.append(inside[:, j * T:(j + 1) * T])                                              # float32
        parts.append(np.concatenate([above[:, j:j + 1], inside[:, (tiles + j) * T + 1:(tiles + j + 1) * T]], 1))
        parts.append(np.concatenate([inside[:, (2 * tiles + j) * T + 1:(2 * tiles + j + 1) * T], below[:, j:j + 1]], 1))
    lp = np.ascontiguousarray(np.concatenate(parts, axis=1)[:, None, :])
    out, status = np.empty(lp.shape[1:], np.float32), np.empty(1, np.int8)
    _kernels.log_arithmetic_pool_kernel(read_only(lp), np.log(w), out, status, 1, 0)
    assert not status.any()
    exact = np.log(mixture_sums(lp[:, 0], w))
    f, clear = rounds_clearly(exact)
    kind = np.arange(lp.shape[-1]) // T % 3                       # 0: float32 tile, 1 and 2: float64 tiles
    right = (out[0] == f) | ~clear
    assert right[kind > 0].all()
    assert (~right[kind == 0]).sum() > 0.05 * (kind == 0).sum()
    err = np.abs(out[0].astype(LONG) - exact)
    assert np.all(err <= np.spacing(np.abs(exact).astype(np.float32)).astype(LONG) + (K + 4) * 2.0**-24)


@pytest.mark.parametrize("K", [2, 4, 8])
def test_float32_mixture_within_its_ulp_claim(K):
    """Wherever the mixture's probability is at most 1/64 a float32 mixture is within 1 + (K + 4) / 8 float32 ulps
    of the exact value, and everywhere within 1 ulp + (K + 4) 2^-24: each tile's log-probabilities around a level
    from 0 to -60, so that the sums span [1e-27, 1] and most tiles take float32 arithmetic."""
    rng = np.random.default_rng(K)
    w = rng.dirichlet(np.ones(K))
    T = _kernels._POOL_TILE
    level = np.repeat(-rng.uniform(0.0, 60.0, (1, 8, 4096 // T)), T, axis=-1)
    lp = np.minimum(level + rng.uniform(-0.5, 0.5, (K, 8, 4096)), 0.0).astype(np.float32)
    out, status = np.empty(lp.shape[1:], np.float32), np.empty(8, np.int8)
    _kernels.log_arithmetic_pool_kernel(read_only(lp), np.log(w), out, status, 2, 0)
    assert not status.any()
    exact = reference_arithmetic(lp, w)
    err = np.abs(out.astype(LONG) - exact)
    spacing = np.spacing(np.abs(exact).astype(np.float32)).astype(LONG)
    assert np.all(err <= spacing + (K + 4) * 2.0**-24)
    small = exact <= np.log(LONG(2.0**-6))
    assert small.mean() > 0.5 and (err / spacing)[small].max() <= 1 + (K + 4) / 8


def test_log_within_one_ulp_of_numpy_and_of_the_exact_value_over_the_whole_range():
    """Random bit patterns cover every binade, the subnormals among them; then the specials."""
    bits = np.random.default_rng(0).integers(0, 0x7FF0000000000000, 20_000, dtype=np.int64)
    sub = np.random.default_rng(1).integers(1, 1 << 52, 2_000, dtype=np.int64)       # subnormals
    x = np.concatenate([bits.view(np.float64), sub.view(np.float64), SPECIAL, -SPECIAL,
                        1.0 + np.linspace(-1e-3, 1e-3, 2001)])
    with np.errstate(all="ignore"):
        got, ref = _kernels.log_kernel(x), np.log(x)
        exact = np.log(x.astype(LONG))
    assert ulps(got, ref).max() <= 1.0
    assert ulps(got, exact).max() <= 1.0                          # near 1 (ln x ~ 1e-3) too
    special = ~np.isfinite(ref) | (x == 1.0)
    np.testing.assert_array_equal(got[special], ref[special])     # 0 -> -inf, inf -> inf, x < 0 or NaN -> NaN
    # inlined into a kernel compiled with the kernels' fastmath flags (reassociation allowed), as the pools do
    with np.errstate(all="ignore"):
        inlined = ln_fastmath_kernel(x)
    assert ulps(inlined, exact).max() <= 1.0
    np.testing.assert_array_equal(inlined[special], ref[special])


@njit(fastmath=jit.FASTMATH, error_model="numpy")
def ln_fastmath_kernel(x, normal=False):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = jit.ln_normal(x[i]) if normal else jit.ln(x[i])
    return out


def test_ln_normal_is_ln_on_positive_normal_numbers():
    """The mixture's ln without special cases: the same bits as ``ln`` from the least normal number to the
    largest (every binade, the ends included)."""
    bits = np.random.default_rng(2).integers(0x0010000000000000, 0x7FF0000000000000, 50_000, dtype=np.int64)
    x = np.concatenate([bits.view(np.float64), [2.2250738585072014e-308, 1e-280, 0.5, 1.0, 1.0 + 2**-52, 2.0,
                                                1.7976931348623157e308], 1.0 + np.linspace(-1e-3, 1e-3, 2001)])
    np.testing.assert_array_equal(ln_fastmath_kernel(x, True), ln_fastmath_kernel(x))


def test_exp_and_log_are_compiled_with_numpys_error_model():
    """The error model is what lets LLVM vectorise the division of log (documented in jit.py)."""
    for f in (jit.exp_inplace, jit.exp_parts, jit.exp_below, jit.ln, jit.ln_normal, jit.log_inplace,
              jit.exp_below32, jit.ln32_normal,
              _kernels.log_geometric_pool_kernel, _kernels.log_arithmetic_pool_kernel):
        assert getattr(f, "targetoptions", {"error_model": "numpy"}).get("error_model") == "numpy"


# ------------------------------------------------------------------------------------------ pools

def reference_geometric(lp, w):
    """(ln G, s, ln Z) in long double from the given (float32 or float64) inputs."""
    s = np.tensordot(w.astype(LONG), lp.astype(LONG), axes=1)
    top = s.max(axis=-1, keepdims=True)
    lz = top + np.log(np.exp(s - top).sum(axis=-1, keepdims=True))
    return s - lz, s, lz


def reference_arithmetic(lp, w):
    t = lp.astype(LONG) + np.log(w.astype(LONG)).reshape((-1,) + (1,) * (lp.ndim - 1))
    top = t.max(axis=0)
    with np.errstate(invalid="ignore"):
        r = top + np.log(np.exp(t - top).sum(axis=0))
    return np.where(np.isneginf(top), -np.inf, r)


@st.composite
def teachers(draw):
    K, M, n = draw(st.integers(1, 8)), draw(st.integers(1, 6)), draw(st.integers(1, 400))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    with np.errstate(divide="ignore"):
        lp = np.log(rng.dirichlet(np.full(n, draw(st.sampled_from([0.01, 0.3, 3.0]))), size=(K, M)))
    lp[rng.random(lp.shape) < draw(st.sampled_from([0.0, 0.3]))] = -np.inf
    lp[..., 0] = np.log(draw(st.sampled_from([0.5, 1e-30, 1.0 - 1e-6])))
    w = rng.dirichlet(np.ones(K)) + 1e-3
    return lp, w / w.sum(), draw(st.integers(1, 3)), draw(st.sampled_from([0, 1, 7, 512, 600]))


def error_bound(ref, dtype, scale, terms):
    """The docstrings' bound: one ulp of the result's dtype, plus (8 + terms) float64 units of the size of
    the terms (a sum of ``terms`` positive numbers in float64 is within (terms - 1) u of exact)."""
    return np.spacing(np.abs(ref).astype(dtype)).astype(LONG) + (8 + terms) * U64 * scale


def assert_within_geometric_bound(out, lp, w):
    """out of the geometric pool of lp against the extended-precision reference: the same finite places, and the
    docstring's bound at them. Returns (ln Z, the float32 fast terms' extra error), both (M, 1)."""
    ref, s, lz = reference_geometric(lp, w)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    fin = np.isfinite(ref)
    err = np.abs(out.astype(LONG)[fin] - ref[fin])
    scale = (np.abs(s) + np.abs(lz) + 1)[fin]
    # a float32 out: the sum of exps takes the fast terms (1e-8 relative), 1e-8 (ln Z - max s) more in out and ln Z
    fast = 1e-8 * (lz - s.max(axis=-1, keepdims=True)) if out.dtype == np.float32 else 0 * lz
    assert np.all(err <= error_bound(ref[fin], out.dtype, scale, lp.shape[-1]) + np.broadcast_to(fast, ref.shape)[fin])
    return lz, fast


@settings(max_examples=25, deadline=None)
@given(teachers(), st.sampled_from([np.float32, np.float64]))
def test_geometric_pool_kernel_within_its_stated_ulp_bound(inputs, dtype):
    lp64, w, workers, block = inputs
    lp = lp64.astype(dtype)
    K, M, n = lp.shape
    out, log_z, status = np.empty((M, n), dtype), np.empty(M), np.empty(M, np.int8)
    _kernels.log_geometric_pool_kernel(read_only(lp), w, out, log_z, status, workers, block)
    assert not status.any()
    lz, fast = assert_within_geometric_bound(out, lp, w)
    assert np.all(np.abs(log_z - lz[:, 0]) <= (8 + n) * U64 * (np.abs(lz[:, 0]) + 1) + fast[:, 0])


@settings(max_examples=25, deadline=None)
@given(teachers(), st.sampled_from([np.float32, np.float64]))
def test_arithmetic_pool_kernel_within_its_stated_ulp_bound(inputs, dtype):
    lp64, w, workers, block = inputs
    lp = lp64.astype(dtype)
    K, M, n = lp.shape
    out, status = np.empty((M, n), dtype), np.empty(M, np.int8)
    _kernels.log_arithmetic_pool_kernel(read_only(lp), np.log(w), out, status, workers, block)
    assert not status.any()
    ref = reference_arithmetic(lp, w)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    fin = np.isfinite(ref)
    err = np.abs(out.astype(LONG)[fin] - ref[fin])
    scale = np.abs(np.where(np.isinf(lp), 0, lp)).max(axis=0).astype(LONG)[fin] + 1
    f32 = (K + 4) * 2.0**-24 if dtype == np.float32 else 0.0          # the float32 tiles' arithmetic
    assert np.all(err <= error_bound(ref[fin], dtype, scale, K) + f32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_arithmetic_pool_below_the_linear_range_keeps_its_bound(dtype):
    """The mixture sums exps in linear space and redoes, with a running maximum, a tile whose least sum is
    below 1e-280; entries whose largest log-probability is near and below that (-600 to -1e4, others up
    to 100 lower: in linear space e^-700 would stand in for each smaller term) stay within the bound."""
    top = np.array([-600.0, -640.0, -650.0, -660.0, -675.0, -690.0, -699.0, -720.0, -800.0, -1e4])
    lower = np.array([0.0, 0.5, 3.0, 20.0, 60.0, 100.0])
    grid = (top[:, None] - lower[None, :]).ravel()
    lp64 = np.full((3, 1, 64 * grid.size), -1.0)            # each case alone in a tile of 64 entries
    lp64[:, 0, ::64] = np.stack([grid, np.roll(grid, 1), np.roll(grid, 7)])
    lp = lp64.astype(dtype)
    w = np.array([0.5, 0.3, 0.2])
    out, status = np.empty(lp.shape[1:], dtype), np.empty(1, np.int8)
    _kernels.log_arithmetic_pool_kernel(read_only(lp), np.log(w), out, status, 2, 0)
    ref = reference_arithmetic(lp, w)
    err = np.abs(out.astype(LONG) - ref)
    assert np.all(err <= error_bound(ref, dtype, np.abs(lp).max(axis=0).astype(LONG) + 1, 3))


def test_float32_pools_are_more_accurate_than_float32_arithmetic():
    """The bound is not vacuous: a token of probability 1 - 1e-6 (ln G ~ -1e-6, ulp 1e-13) under
    teachers whose s is ~ -9 elsewhere is only right to 1 ulp if s - ln Z is taken in float64."""
    n = 4000
    p = np.full((2, 1, n), 1e-6 / (n - 1))
    p[0, 0, 0], p[1, 0, 0] = 1.0 - 1e-6, 1.0 - 2e-6
    p[1, 0, 1:] *= 2.0
    lp = np.log(p).astype(np.float32)
    w = np.array([0.3, 0.7])
    got = ag.log_geometric_pool(lp, w)
    ref, s64, lz = reference_geometric(lp, w)
    assert got.dtype == np.float32
    # the stated bound there: 1 ulp (1.1e-13) + (8 + n) u (|s| + |ln Z| + 1), under 6 ulps in all
    bound = error_bound(ref[0, :1], np.float32, (np.abs(s64) + np.abs(lz) + 1)[0, :1], n)
    assert np.abs(got[0, :1].astype(LONG) - ref[0, :1]) <= bound
    assert bound < 6 * abs(np.spacing(np.float32(ref[0, 0])))
    # the same in float32 arithmetic is off by hundreds of ulps there
    s = (np.float32(0.3) * lp[0] + np.float32(0.7) * lp[1]).astype(np.float32)
    lz32 = np.log(np.exp(s).sum(dtype=np.float32), dtype=np.float32)
    assert ulps((s - lz32)[0, :1], ref[0, :1]).max() > 50


def test_pools_keep_float32_and_give_float64_for_everything_else():
    rng = np.random.default_rng(0)
    lp = np.log(rng.dirichlet(np.ones(50), size=(3, 4)))
    w = np.array([0.2, 0.3, 0.5])
    for x, dtype in ((lp.astype(np.float32), np.float32), (lp, np.float64), (lp.tolist(), np.float64),
                     (lp.astype(np.float16), np.float64)):
        g, lz = ag.log_geometric_pool(x, w, return_log_partition=True)
        a = ag.log_arithmetic_pool(x, w)
        assert g.dtype == dtype and lz.dtype == dtype and a.dtype == dtype
        assert ag.log_partition(x, w).dtype == dtype
        x64 = np.asarray(x, dtype=np.float64) if not isinstance(x, list) else lp
        np.testing.assert_allclose(g, _reference.log_geometric_pool(np.asarray(x64, dtype), w), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(a, _reference.log_arithmetic_pool(np.asarray(x64, dtype), w), rtol=1e-6, atol=1e-6)
    # weight-0 teachers dropped, float32 kept
    w0 = np.array([0.0, 0.5, 0.5])
    assert ag.log_geometric_pool(lp.astype(np.float32), w0).dtype == np.float32


def test_out_is_filled_and_returned_and_checked():
    rng = np.random.default_rng(1)
    lp = np.log(rng.dirichlet(np.ones(30), size=(2, 3, 5))).astype(np.float32)
    w = np.array([0.4, 0.6])
    for pool in (ag.log_geometric_pool, ag.log_arithmetic_pool):
        out = np.full((3, 5, 30), np.nan, np.float32)
        got = pool(lp, w, out=out)
        assert got is out
        np.testing.assert_array_equal(out, pool(lp, w))
        for bad in (np.empty((3, 5, 30)), np.empty((3, 30), np.float32), np.empty((30, 5, 3), np.float32).T,
                    [[0.0] * 30]):
            with pytest.raises(ValueError, match="out"):
                pool(lp, w, out=bad)
    ro = np.empty((3, 5, 30), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        ag.log_arithmetic_pool(lp, w, out=ro)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 5), st.integers(1, 20), st.integers(1, 600), st.integers(0, 2**31))
def test_any_worker_count_and_block_size_gives_the_same_pool(workers, block, n, seed):
    """Rows mode (many rows), split mode (few rows, blocks of the vocabulary), one item per entry."""
    rng = np.random.default_rng(seed)
    for M in (1, 3, 13):
        lp = np.log(rng.dirichlet(np.ones(n), size=(3, M))).astype(np.float32)
        w = rng.dirichlet(np.ones(3))
        base = np.empty((M, n), np.float32), np.empty(M), np.empty(M, np.int8)
        _kernels.log_geometric_pool_kernel(read_only(lp), w, *base, 1, 0)
        got = np.empty((M, n), np.float32), np.empty(M), np.empty(M, np.int8)
        _kernels.log_geometric_pool_kernel(read_only(lp), w, *got, workers, block)
        # the partial sums are added in another order and each block is shifted by its own maximum: ln Z equal
        # within a float64 rounding plus twice the fast terms' 1e-8 (ln Z - max s) of the float32 pool
        fast = 2e-8 * (base[1] - np.tensordot(w, lp.astype(np.float64), axes=1).max(axis=-1))
        np.testing.assert_allclose(got[0], base[0], rtol=0, atol=4e-7 * np.abs(base[0]).max() + 1e-12)
        assert np.all(np.abs(got[1] - base[1]) <= 1e-13 * (1 + np.abs(base[1])) + fast)
        a_base, a_got = np.empty((M, n), np.float32), np.empty((M, n), np.float32)
        st_ = np.empty(M, np.int8)
        _kernels.log_arithmetic_pool_kernel(read_only(lp), np.log(w), a_base, st_, 1, block)
        _kernels.log_arithmetic_pool_kernel(read_only(lp), np.log(w), a_got, st_, workers, block)
        # elementwise, in the same tiles whatever the worker count: bit-identical (the block size moves the tiles,
        # and so which entries take float32 arithmetic: the bound tests run several)
        np.testing.assert_array_equal(a_got, a_base)


@pytest.mark.parametrize("M, workers, block", [(4, 2, 2), (4, 1, 0), (40, 2, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bad_rows_are_flagged_in_every_mode(M, workers, block, dtype):
    lp = np.log(np.full((2, M, 4), 0.25)).astype(dtype)
    lp[1, 1, 2] = 0.5
    lp[0, 2, 3] = np.nan
    lp[:, 0, :] = np.log(0.25)
    lp[0, M - 1, :2] = -np.inf
    lp[1, M - 1, 2:] = -np.inf                                  # empty support in the last row
    out, log_z, status = np.empty((M, 4), dtype), np.empty(M), np.empty(M, np.int8)
    _kernels.log_geometric_pool_kernel(read_only(lp), np.array([0.5, 0.5]), out, log_z, status, workers, block)
    assert list(status[:3]) == [0, 1, 1] and status[M - 1] == 2 and not status[3:M - 1].any()
    _kernels.log_arithmetic_pool_kernel(read_only(lp), np.log([0.5, 0.5]), out, status, workers, block)
    assert list(status[:3]) == [0, 1, 1] and not status[3:].any()
    with pytest.raises(ValueError, match="empty support"):
        ag.log_geometric_pool(np.delete(lp, [1, 2], axis=1), [0.5, 0.5])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_bad_input_under_any_teacher_is_flagged(dtype):
    """The pools read the teachers two at a time (the first alone when K is odd): a positive entry or a NaN under
    each teacher of K = 1..5, in either of a pair's two rows, flags its row and no other."""
    for K in range(1, 6):
        w = np.full(K, 1.0 / K)
        for k in range(K):
            for bad in (1e-3, np.nan):
                lp = np.full((K, 3, 70), np.log(1.0 / 70), dtype)
                lp[k, 1, 66] = bad
                out, log_z, status = np.empty((3, 70), dtype), np.empty(3), np.empty(3, np.int8)
                _kernels.log_geometric_pool_kernel(read_only(lp), w, out, log_z, status, 1, 0)
                assert list(status) == [0, 1, 0], (K, k, bad)
                _kernels.log_arithmetic_pool_kernel(read_only(lp), np.log(w), out, status, 1, 0)
                assert list(status) == [0, 1, 0], (K, k, bad)


def test_float32_mixture_flags_bad_inputs_in_tiles_whose_sums_are_in_range():
    """A positive entry under a teacher of weight 1e-3 (the sum stays below 2^-6), +inf, NaN and -NaN, each in a
    float32 tile whose other sums lie in [2^-80, 2^-6]: the row is flagged, the clean row is not."""
    w = np.array([1e-3, 1.0 - 1e-3])
    bad = np.array([1e-3, np.inf, np.nan, -np.nan], np.float32)
    lp = np.full((2, 1 + bad.size, _kernels._POOL_TILE), -7.0, np.float32)
    lp[0, 1:, 5] = bad
    out, status = np.empty(lp.shape[1:], np.float32), np.empty(lp.shape[1], np.int8)
    _kernels.log_arithmetic_pool_kernel(read_only(lp), np.log(w), out, status, 1, 0)
    assert list(status) == [0, 1, 1, 1, 1]
    assert out[0, 0] == np.float32(np.log(np.exp(LONG(-7.0))))


@pytest.mark.parametrize("M, workers, block", [(8, 2, 0), (1, 2, 64), (1, 2, 100)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_support_that_starts_tiles_late_keeps_its_minus_infinities(M, workers, block, dtype):
    """The first 200 tokens (three whole tiles of 64 and part of a fourth) are -inf under one teacher, so the
    running maximum is still -inf there: those tokens stay -inf (not NaN) and the rest is within the stated
    bound, whether a row is one work item or split into blocks."""
    rng = np.random.default_rng(3)
    lp64 = np.log(rng.dirichlet(np.ones(300), size=(2, M)))
    lp64[0, :, :200] = -np.inf
    lp = lp64.astype(dtype)
    out, log_z, status = np.empty((M, 300), dtype), np.empty(M), np.empty(M, np.int8)
    _kernels.log_geometric_pool_kernel(read_only(lp), np.array([0.5, 0.5]), out, log_z, status, workers, block)
    assert not status.any()
    assert np.all(out[:, :200] == -np.inf)
    assert_within_geometric_bound(out, lp, np.array([0.5, 0.5]))


def test_underflowing_row_is_shifted_in_split_mode():
    """Every s below -745 (exp(s) is 0 in float64): the sums are shifted by each block's maximum, and ln Z is
    right to its stated bound (the float32 pool's fast terms: 1e-8 (ln Z - max s), here 3.7e-9)."""
    lp = np.full((1, 1, 10_000), -800.0, np.float32)
    lp[0, 0, 123] = -790.0
    out, log_z, status = np.empty((1, 10_000), np.float32), np.empty(1), np.empty(1, np.int8)
    _kernels.log_geometric_pool_kernel(read_only(lp), np.array([1.0]), out, log_z, status, 2, 1000)
    assert status[0] == 0
    ref, _, lz = reference_geometric(lp, np.array([1.0]))
    assert abs(log_z[0] - float(lz[0, 0])) < 1e-12 + 1e-8 * float(lz[0, 0] + 790.0)
    assert ulps(out, ref).max() <= 1.0


# ------------------------------------------------------------------------------------ recursion

@settings(max_examples=10, deadline=None)
@given(st.integers(1, 4), st.sampled_from([(700, 64), (3000, 6), (40, 500)]), st.integers(0, 30),
       st.sampled_from([0.0, 0.2]), st.integers(0, 2**31))
def test_one_region_recursion_matches_the_twin_with_many_items(workers, shape, horizon, end, seed):
    """S n above one item (2^14 pairs): several items per step, taken by any number of workers."""
    from aggregation import examples
    S, n = shape
    t = examples.random_teachers(2, S, n, seed, end_prob=end, zero_fraction=0.2)
    w = np.array([0.3, 0.7])
    reward = _reference.pooled_weights(t.log_probs, w)
    weight, tiny = np.empty((S, n)), np.full(S, -1, np.int64)
    _kernels.pooled_exp_kernel(t.log_probs, np.array([0, 1]), w, weight, tiny, workers)
    np.testing.assert_array_equal(tiny, (np.isfinite(reward) & (reward < np.log(np.finfo(float).tiny))).sum(1))
    np.testing.assert_allclose(weight, np.exp(reward), rtol=1e-14, atol=0)    # exp within 1 ulp, r to a few
    out = np.empty((horizon + 1, S))
    assert _kernels.linear_recursion_kernel(weight, t._transitions, t._ends, tiny, horizon, out, workers)
    np.testing.assert_allclose(out, _reference.sequence_log_partition(t.next_state, reward, horizon),
                               rtol=1e-10, atol=1e-10)


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 3), st.integers(0, 9), st.sampled_from([0.0, 0.3]), st.sampled_from([0.0, 0.2]),
       st.integers(0, 2**31))
def test_states_whose_every_token_ends_match_the_twin(workers, horizon, zeros, end, seed):
    """A prefix tree (most states are leaves, whose every token ends: their row is summed once and then
    scaled) over several items, horizons below and above its depth, zero weights (states with Z = 0) and
    ends inside the tree."""
    from aggregation import examples
    t = examples.prefix_tree(2, 6, 6, seed, zero_fraction=zeros, end_prob=end)
    assert t._ends.sum() >= 6 ** 5 and t.S * t.n > 2 * 2 ** 14
    w = np.array([0.4, 0.6])
    reward = _reference.pooled_weights(t.log_probs, w)
    weight, tiny = np.exp(reward), np.zeros(t.S, np.int64)
    out = np.empty((horizon + 1, t.S))
    assert _kernels.linear_recursion_kernel(weight, t._transitions, t._ends, tiny, horizon, out, workers)
    np.testing.assert_allclose(out, _reference.sequence_log_partition(t.next_state, reward, horizon),
                               rtol=1e-12, atol=1e-12)


def test_transitions_are_int32_with_S_for_an_end():
    from aggregation import examples
    t = examples.random_teachers(2, 50, 7, 0, end_prob=0.3)
    assert t._transitions.dtype == np.int32 and not t._transitions.flags.writeable
    np.testing.assert_array_equal(t._transitions, np.where(t.next_state < 0, t.S, t.next_state))


def test_unpickled_teachers_are_read_only():
    """A process pool or dask hands the teachers over pickled, and NumPy's pickles come back writeable: the tables
    are read-only again, as built."""
    import pickle
    from aggregation import examples
    t = examples.random_teachers(2, 30, 4, 2, end_prob=0.2)
    u = pickle.loads(pickle.dumps(t))
    for name in ("next_state", "log_probs", "_transitions", "_ends"):
        assert not getattr(u, name).flags.writeable, name
        np.testing.assert_array_equal(getattr(u, name), getattr(t, name))
    w = np.array([0.4, 0.6])
    np.testing.assert_array_equal(ag.sequence_log_partition(u, w, 5), ag.sequence_log_partition(t, w, 5))


@pytest.mark.skipif(numba.config.DISABLE_JIT, reason="counts compiled kernels")
def test_writeable_and_read_only_input_reach_the_same_compiled_kernels():
    """One compile per dtype: the pools given a caller's writeable array or a read-only one, the recursion given
    teachers as built or unpickled (a second compile of a pool kernel takes 10-20 s)."""
    import pickle
    from aggregation import examples
    lp = np.log(np.random.default_rng(4).dirichlet(np.ones(6), size=(2, 3)))
    frozen = lp.copy()
    frozen.flags.writeable = False
    t = examples.random_teachers(2, 30, 4, 2, end_prob=0.2)
    w = np.array([0.3, 0.7])
    kernels = (_kernels.log_geometric_pool_kernel, _kernels.log_arithmetic_pool_kernel, _kernels.pooled_exp_kernel,
               _kernels.linear_recursion_kernel)
    for pool in (ag.log_geometric_pool, ag.log_arithmetic_pool):
        pool(lp, w)
    ag.sequence_log_partition(t, w, 5)
    compiled = [len(k.signatures) for k in kernels]
    for pool in (ag.log_geometric_pool, ag.log_arithmetic_pool):
        pool(frozen, w)
    ag.sequence_log_partition(pickle.loads(pickle.dumps(t)), w, 5)
    assert [len(k.signatures) for k in kernels] == compiled


def test_weight_zero_teacher_is_skipped_without_a_copy():
    """A weight-0 teacher may have -inf where the others do not: the fused pass never reads it."""
    from aggregation import examples
    t = examples.random_teachers(3, 40, 5, 1, zero_fraction=0.3)
    w = np.array([0.5, 0.0, 0.5])
    got = ag.sequence_log_partition(t, w, 12)
    reward = _reference.pooled_weights(t.log_probs[[0, 2]], w[[0, 2]])
    np.testing.assert_allclose(got, _reference.sequence_log_partition(t.next_state, reward, 12), rtol=1e-10, atol=1e-10)
