"""numba kernels: plain contiguous arrays in, arrays out, log space, no validation.

Every kernel has a slow NumPy twin in ``_reference.py``; the tests compare the two. The public
wrappers in ``pools.py`` and ``sequence.py`` validate their arguments and mask out weight-0 teachers
before any of these run.
The vectorised exp / log and the soft backward step they build on are in ``jit.py``.
"""

import numpy as np
from numba import get_num_threads, njit, prange

from .jit import FASTMATH as _FM
from .jit import (EXP7_C, EXP_C, atomic_add, exp_below, exp_below32, exp_inplace, fetch_add_one, ln, ln32_normal,
                  ln_normal, log_inplace, soft_value, yield_cpu)
from .validate import read_only


@njit(cache=True, error_model="numpy")
def exp_kernel(x):
    """Vectorised exp of a 1-D array (the building block, exposed for its accuracy test)."""
    out = x.copy()
    a = np.empty(x.shape[0], np.int64)
    b = np.empty(x.shape[0], np.int64)
    exp_inplace(out, a, b)
    return out


@njit(cache=True, error_model="numpy")
def log_kernel(x):
    """Vectorised ln of a 1-D array (the building block, exposed for its accuracy test)."""
    out = x.copy()
    log_inplace(out)
    return out


# ----------------------------------------------------------------------------------- token pools
#
# dtypes and accuracy. The pools read float32 or float64 and write the input's dtype; every value is
# widened to float64 in registers, and the sums, exps and logs run in float64 on L1-sized tiles. That is
# what the error analysis asks for, not a habit: a log-probability near 0 (a token of probability
# near 1) is the difference of two numbers of size |ln Z| (or the log of a sum near 1), so a float32
# exp or a float32 sum would leave an absolute error ~1e-7 there, thousands of float32 ulps of the
# result. In float64 the result is the exact value for the given inputs and weights up to the float64
# rounding of the terms, rounded to the output dtype once (the mixture) or twice by at most half an ulp of the
# result each (the geometric pool, which keeps s minus a running maximum in the output row in between):
#     |out - exact| <= 1 ulp of the output dtype at exact + (8 + N) u (|s| + |ln Z| + 1),   u = 2^-53,
# with N = n for the geometric pool (a float64 sum of n positive terms is within (n - 1) u of exact) and
# N = K for the mixture (scale max_k |ln p_k| + 1 in place of |s| + |ln Z| + 1); ln Z itself is within
# (8 + n) u (|ln Z| + 1). For float32 outputs the second term is below the first unless |out| is
# below (8 + N) 2^-29 times the scale: float32 results are within 1 ulp of the exact value rounded
# except for log-probabilities within ~1e-4 of 0 at n = 152k. tests/test_aggregation_dtypes.py checks
# the bound for both dtypes against an extended-precision (long double) reference.
# The geometric pool's sum of exps is shifted by the row's maximum (a running maximum, tile by tile), so its
# largest term is exactly 1 and every other term's error counts relative to Z e^-max - 1 = e^(ln Z - max s) - 1.
# That is what lets a float32 result take cheaper terms: a degree-7 exp, each term within 1e-8 of itself
# (``jit.exp_below`` with ``EXP7_C``), moves ln Z and out by at most 1e-8 (ln Z - max s), a sixth of a float32
# ulp of the most probable token's log-probability -(ln Z - max s) and less of every other; without the shift
# it would be 1e-8 absolute, thousands of ulps near 0. float64 results keep the exact terms.
# The float32 mixture goes further: out = ln S, S = sum_k w_k e^x_k, is a log, so a relative error of S is an
# absolute error of out, and away from 0 a float32 ulp of out is large. A tile whose sums all lie in [2^-80, 2^-6]
# (out in [-55.5, -4.16]: the bulk of a vocabulary) runs in float32 arithmetic, twice the lanes: terms within 1.5
# float32 ulps, 3 2^-24 relative (``jit.exp_below32``), the weights and each product rounded once, K - 1 roundings
# in the sum, so S is within (K + 4) 2^-24 relative, and ``jit.ln32_normal`` within 1 ulp of ln of it:
#     |out - exact| <= 1 ulp of out + (K + 4) 2^-24,   at most 1 + (K + 4) / 8 ulps of out (|out| >= 4.16).
# Other tiles (a token of mixture probability above 1/64, or sums below 2^-80, where the terms' clamp at e^-87
# would count: a token below ~e^-55 under every teacher, -inf included) are redone in float64 (at most 63 tiles a row
# for the first reason), and so is a tile with a bad input, which that path flags.
# Bandwidth: 4 bytes a value read and written for float32, as the data.
#
# Scheduling. Work is cut into many more items than threads (rows, or blocks of the vocabulary when
# there are fewer than 4 rows a worker), and ``n_workers`` workers take items one at a time from an
# atomic counter (``jit.fetch_add_one``): a worker whose core is busy takes fewer items instead of
# stalling the others, and a single row still uses every core.

_TILE = 512          # entries of a float64 tile of the recursion's passes (4 KB; a worker's tiles stay in L1)
_POOL_TILE = 64      # vocabulary entries of a pool's tile: each teacher's row is read in bursts of this many
_BLOCK = 8192        # vocabulary entries of a work item when rows are split
_ROWS_PER_WORKER = 4  # with at least this many rows per worker a row is one item


@njit(cache=True, inline="always", fastmath=_FM, error_model="numpy")
def _pooled_tile(log_probs, weights, m, a0, t, e):
    """e[:t] = sum_k w_k log_probs[k, m, a0:a0 + t] (float64). Returns (sum of max(x, 0) over the inputs, sum
    of e[:t], max of e[:t]): the first > 0 iff some input is > 0, the second NaN iff one is NaN.
    Rows are read as 1-D slices: an index into the 3-D array makes LLVM gather instead of load. Two teachers a
    pass over e (half its loads and stores), the first one alone when K is odd."""
    K = log_probs.shape[0]
    pos = 0.0
    odd = K % 2 == 1                     # the first teacher alone, then two a pass
    w0 = weights[0]
    xs = log_probs[0, m, a0:a0 + t]
    if odd:
        for i in range(t):
            x = np.float64(xs[i])
            pos += max(x, 0.0)
            e[i] = w0 * x
    else:
        w1 = weights[1]
        xb = log_probs[1, m, a0:a0 + t]
        for i in range(t):
            a = np.float64(xs[i])
            b = np.float64(xb[i])
            pos += max(a, 0.0) + max(b, 0.0)
            e[i] = w0 * a + w1 * b
    for k in range(1 if odd else 2, K, 2):
        wa, wb = weights[k], weights[k + 1]
        xa = log_probs[k, m, a0:a0 + t]
        xb = log_probs[k + 1, m, a0:a0 + t]
        for i in range(t):
            a = np.float64(xa[i])
            b = np.float64(xb[i])
            pos += max(a, 0.0) + max(b, 0.0)
            e[i] += wa * a + wb * b
    chk = 0.0
    top = -np.inf
    for i in range(t):
        v = e[i]
        chk += v
        top = v if v > top else top
    return pos, chk, top


@njit(cache=True, inline="always", fastmath=_FM, error_model="numpy")
def _geometric_part(log_probs, weights, m, a0, a1, orow, tshift, e, fast):
    """s = sum_k w_k log_probs[k, m, a0:a1] in one pass, tile by tile, with the sum of exp(s) shifted by the
    running maximum (a tile whose maximum is larger rescales the sum so far). Each tile is written to
    orow[a0:a1] (the output row) as s - shift, with the shift it used in tshift[j] (j: the tile's index from
    a0; 0 while every s so far is -inf, which then stays -inf): out = that - (ln Z - tshift[j]) later.
    Returns (sum exp(s - shift), shift = max s (-inf when every s is -inf), pos, chk)."""
    T = e.shape[0]
    tot = 0.0
    shift = -np.inf
    pos = 0.0
    chk = 0.0
    for j, b0 in enumerate(range(a0, a1, T)):
        t = min(T, a1 - b0)
        p, c, top = _pooled_tile(log_probs, weights, m, b0, t, e)
        pos += p
        chk += c
        if top > shift:
            tot *= np.exp(shift - top)                 # 0 while shift is -inf
            shift = top
        o = orow[b0:b0 + t]
        if shift == -np.inf:
            tshift[j] = 0.0
            for i in range(t):
                o[i] = e[i]
        else:
            tshift[j] = shift
            tot += _shifted_out(e[:t], shift, o, EXP7_C) if fast else _shifted_out(e[:t], shift, o, EXP_C)
    return tot, shift, pos, chk


@njit(cache=True, inline="always", fastmath=_FM, error_model="numpy")
def _shifted_out(e, shift, o, coefficients):
    """o[i] = e[i] - shift (e[i] <= shift), returning sum_i exp(e[i] - shift) (``jit.exp_below``'s terms)."""
    tot = 0.0
    for i in range(e.shape[0]):
        d = e[i] - shift
        o[i] = d
        tot += exp_below(d, coefficients)
    return tot


@njit(cache=True, inline="always", fastmath=_FM, error_model="numpy")
def _finish_part(orow, tshift, lse, a0, a1, T):
    """out = (s - tshift[j]) - (ln Z - tshift[j]) over orow[a0:a1], tile j of T entries (in float64)."""
    for j, b0 in enumerate(range(a0, a1, T)):
        c = lse - tshift[j]
        o = orow[b0:min(a1, b0 + T)]
        for i in range(o.shape[0]):
            o[i] = np.float64(o[i]) - c


@njit(cache=True, inline="always", fastmath=_FM, error_model="numpy")
def _row_status(tot, shift, pos, chk):
    """(status, ln Z) of a row from its pass: 1 = an entry > 0 or NaN, 2 = empty support (every s is -inf)."""
    if not (pos == 0.0) or chk != chk:
        return 1, 0.0
    if shift == -np.inf:
        return 2, 0.0
    return 0, shift + np.log(tot)


@njit(parallel=True, cache=True, fastmath=_FM, error_model="numpy")
def log_geometric_pool_kernel(log_probs, weights, out, log_z, status, n_workers, block):
    """out[m] = s - ln Z, ln Z = log_z[m] = logsumexp(s), s = sum_k w_k log_probs[k, m]   (theory section 1).

    log_probs: (K, M, n) float32 or float64, weights: (K,) float64 all positive, out: (M, n) of the same
    dtype as log_probs (or float64), log_z: (M,) float64, status: (M,) int8. n_workers: the worker count
    (the thread count). block: vocabulary entries per item when rows are split (0: 8192; rounded up to whole
    tiles of 64).
    One read of the input: a pass forms s tile by tile (float64 tiles in L1), sums exp(s - max s) with a running
    maximum and writes s minus that running maximum into out itself (no scratch row); a second pass over out
    subtracts ln Z minus the tile's shift. The status of each row is a by-product of the pass (a separate NumPy
    validation pass costs as much as the pool): 1 = some entry > 0 or NaN, 2 = empty support (every token -inf
    under some teacher). The wrapper raises on a non-zero status; out is then not valid for that row.
    Accuracy (float64 arithmetic, see above): |out - exact| <= 1 ulp of out's dtype + (8 + n) 2^-53 (|s| + |ln Z| + 1),
    plus, for a float32 out (whose sum of exps takes ``jit.exp_below``'s fast terms, ``EXP7_C``), 1e-8 (ln Z - max s)
    in out and in ln Z. out is rounded twice, each time by at most half an ulp of out: the first rounding is of
    s minus a running maximum that lies between s and ln Z, so of a number no larger than |out|.
    """
    K, M, n = log_probs.shape
    T = _POOL_TILE
    workers = max(1, min(n_workers, M * n))
    if block <= 0:
        block = _BLOCK
    block = (block + T - 1) // T * T
    fast = out.itemsize == 4
    counter = np.zeros(1, np.int64)
    nt = (n + T - 1) // T
    if M >= _ROWS_PER_WORKER * workers:
        # one row per item: the second pass while the row is in cache
        for wk in prange(workers):
            e = np.empty(T)
            tshift = np.empty(nt)
            while True:
                m = fetch_add_one(counter)
                if m >= M:
                    break
                tot, shift, pos, chk = _geometric_part(log_probs, weights, m, 0, n, out[m], tshift, e, fast)
                st, lse = _row_status(tot, shift, pos, chk)
                status[m] = st
                if st != 0:
                    continue
                log_z[m] = lse
                _finish_part(out[m], tshift, lse, 0, n, T)
        return
    # few rows: blocks of the vocabulary, partial sums per block (each shifted by its own maximum), then the
    # rows' ln Z, then the second pass
    nb = (n + block - 1) // block
    items = M * nb
    tshifts = np.empty((M, nt))
    part = np.empty((items, 4))
    for wk in prange(workers):
        e = np.empty(T)
        while True:
            it = fetch_add_one(counter)
            if it >= items:
                break
            m = it // nb
            a0 = (it % nb) * block
            tot, shift, pos, chk = _geometric_part(log_probs, weights, m, a0, min(n, a0 + block), out[m],
                                                   tshifts[m, a0 // T:], e, fast)
            part[it, 0] = tot
            part[it, 1] = shift
            part[it, 2] = pos
            part[it, 3] = chk
    for m in range(M):
        shift = -np.inf
        pos = 0.0
        chk = 0.0
        for it in range(m * nb, (m + 1) * nb):
            shift = max(shift, part[it, 1])
            pos += part[it, 2]
            chk += part[it, 3]
        tot = 0.0
        if shift > -np.inf:
            for it in range(m * nb, (m + 1) * nb):
                if part[it, 1] > -np.inf:
                    tot += part[it, 0] * np.exp(part[it, 1] - shift)
        st, lse = _row_status(tot, shift, pos, chk)
        status[m] = st
        log_z[m] = lse
    counter2 = np.zeros(1, np.int64)
    for wk in prange(workers):
        while True:
            it = fetch_add_one(counter2)
            if it >= items:
                break
            m = it // nb
            if status[m] != 0:
                continue
            a0 = (it % nb) * block
            _finish_part(out[m], tshifts[m, a0 // T:], log_z[m], a0, min(n, a0 + block), T)


@njit(cache=True, inline="always", fastmath=_FM, error_model="numpy")
def _mixture_tile(log_probs, log_weights, m, a0, t, mx, sm, o):
    """o[:t] <- logsumexp_k (ln w_k + x_k) = mx + ln sm over log_probs[:, m, a0:a0 + t]: a streaming logsumexp
    over k keeps (max, sum), so the first teacher costs no exp and each later one a single exp(-|d|).
    Returns the number of inputs that are > 0 or NaN. Rows are read as 1-D slices (an index into the 3-D
    array makes LLVM gather)."""
    K = log_probs.shape[0]
    bad = 0.0
    lw = log_weights[0]
    xs = log_probs[0, m, a0:a0 + t]
    for i in range(t):
        x = np.float64(xs[i])
        bad += 0.0 if x <= 0.0 else 1.0
        mx[i] = lw + x
        sm[i] = 1.0
    for k in range(1, K):
        lw = log_weights[k]
        xs = log_probs[k, m, a0:a0 + t]
        for i in range(t):
            x = np.float64(xs[i])
            bad += 0.0 if x <= 0.0 else 1.0
            tk = lw + x
            diff = tk - mx[i]
            # both -inf: diff is NaN and the term is 0 (e^-700)
            di = exp_below(-abs(diff) if diff == diff else -np.inf, EXP_C)
            up = tk > mx[i]
            sm[i] = sm[i] * di + 1.0 if up else sm[i] + di
            mx[i] = tk if up else mx[i]
    for i in range(t):
        o[i] = mx[i] + ln_normal(sm[i])      # sm >= 1 (or meaningless with a bad input, which is flagged)
    return bad


@njit(cache=True, inline="always", fastmath=_FM, error_model="numpy")
def _mixture_tile_linear(log_probs, weights, m, a0, t, sm, o):
    """o[:t] <- ln sum_k w_k exp(x_k) over log_probs[:, m, a0:a0 + t] in linear space: K exps of
    log-probabilities (arguments <= 0: no overflow, no maximum to track) and one log an entry, with
    ``jit.exp_below``'s exact terms. Returns (the number of inputs that are > 0 or NaN, the least sum); o is
    written only when the least sum is at least 1e-280: below (every x_k there below about -645, or -inf) the
    tile is for :func:`_mixture_tile` (``exp_below`` takes an argument below -700 as -700, so a term of at most
    1e-304 is off by at most that: 1e-24 of a sum >= 1e-280)."""
    K = log_probs.shape[0]
    bad = 0.0
    wk = weights[0]
    xs = log_probs[0, m, a0:a0 + t]
    for i in range(t):
        x = np.float64(xs[i])
        bad += 0.0 if x <= 0.0 else 1.0
        sm[i] = wk * exp_below(x, EXP_C)
    for k in range(1, K):
        wk = weights[k]
        xs = log_probs[k, m, a0:a0 + t]
        for i in range(t):
            x = np.float64(xs[i])
            bad += 0.0 if x <= 0.0 else 1.0
            sm[i] += wk * exp_below(x, EXP_C)
    low = np.inf
    for i in range(t):
        low = min(low, sm[i])
    if low >= 1e-280:
        for i in range(t):
            o[i] = ln_normal(sm[i])        # >= 1e-280 (or a bad input's, which is flagged)
    return bad, low


_MIX32_LOW = np.float32(2.0**-80)     # a float32 tile's sums lie in [2^-80, 2^-6]: below, terms clamped at e^-87
_MIX32_HIGH = np.float32(2.0**-6)     # would count; above, (K + 4) 2^-24 would be more than (K + 4) / 8 ulps of out


@njit(cache=True, inline="always", fastmath=_FM, error_model="numpy")
def _mixture_tile32(log_probs, weights32, m, a0, t, sm, o):
    """o[:t] <- ln sum_k w_k exp(x_k) over float32 log_probs[:, m, a0:a0 + t] in float32 arithmetic (sm: a float32
    tile): ``jit.exp_below32`` terms and ``jit.ln32_normal``, twice the lanes of :func:`_mixture_tile_linear`.
    Returns whether o was written: only when no input is > 0 or NaN and every sum lies in [``_MIX32_LOW``,
    ``_MIX32_HIGH``], where the error analysis allows float32 arithmetic; otherwise the tile is for the float64
    path (which flags bad inputs)."""
    K = log_probs.shape[0]
    zero, one = np.float32(0.0), np.float32(1.0)
    bad = zero
    wk = weights32[0]
    xs = log_probs[0, m, a0:a0 + t]
    for i in range(t):
        x = np.float32(xs[i])
        bad += zero if x <= zero else one
        sm[i] = wk * exp_below32(x)
    for k in range(1, K):
        wk = weights32[k]
        xs = log_probs[k, m, a0:a0 + t]
        for i in range(t):
            x = np.float32(xs[i])
            bad += zero if x <= zero else one
            sm[i] += wk * exp_below32(x)
    low = sm[0]
    high = sm[0]
    for i in range(t):
        low = min(low, sm[i])
        high = max(high, sm[i])
    ok = bad == zero and low >= _MIX32_LOW and high <= _MIX32_HIGH
    if ok:
        for i in range(t):
            o[i] = ln32_normal(sm[i])
    return ok


@njit(parallel=True, cache=True, fastmath=_FM, error_model="numpy")
def log_arithmetic_pool_kernel(log_probs, log_weights, out, status, n_workers, block):
    """out[m, a] = logsumexp_k (ln w_k + log_probs[k, m, a])   (theory section 1).

    log_probs: (K, M, n) float32 or float64, log_weights: (K,) float64 finite, out: (M, n) of the input's
    dtype (or float64), status: (M,) int8 (1 = entry > 0 or NaN). Elementwise over (m, a), so the items are
    blocks of ``block`` entries (0: 4096) of every row, taken by ``n_workers`` workers; in float64 tiles in
    linear space (K exps and one log an entry, :func:`_mixture_tile_linear`: at K = 2 too, where it costs less
    than one exp and a running maximum's bookkeeping), a tile with a sum below 1e-280 redone with a streaming
    maximum (K - 1 exps, :func:`_mixture_tile`).
    float32 in and out: a tile whose sums all lie in [2^-80, 2^-6] runs in float32 arithmetic
    (:func:`_mixture_tile32`), the others as float64 ones.
    Accuracy (float64 arithmetic, see above): |out - exact| <= 1 ulp of out's dtype + (8 + K) 2^-53 (max_k |x_k| + 1)
    (linear space: each term within 2 float64 roundings and an exp's ulp, the sum within K - 1 more, the log
    within one: (K + 5) 2^-53 absolute); a float32 tile: 1 ulp of out + (K + 4) 2^-24, at most 1 + (K + 4) / 8
    float32 ulps of out there (see above).
    """
    K, M, n = log_probs.shape
    workers = max(1, min(n_workers, M * n))
    if block <= 0:
        block = _BLOCK // 2
    nb = (n + block - 1) // block
    items = M * nb
    flags = np.zeros(items, np.int8)
    counter = np.zeros(1, np.int64)
    weights = np.exp(log_weights)
    weights32 = weights.astype(np.float32)
    fast = log_probs.itemsize == 4 and out.itemsize == 4
    for wk in prange(workers):
        mx = np.empty(_POOL_TILE)
        sm = np.empty(_POOL_TILE)
        sm32 = np.empty(_POOL_TILE, np.float32)
        while True:
            it = fetch_add_one(counter)
            if it >= items:
                break
            m = it // nb
            a0 = (it % nb) * block
            a1 = min(n, a0 + block)
            for b0 in range(a0, a1, _POOL_TILE):
                t = min(_POOL_TILE, a1 - b0)
                o = out[m, b0:b0 + t]
                bad = 0.0
                if not (fast and _mixture_tile32(log_probs, weights32, m, b0, t, sm32, o)):
                    bad, low = _mixture_tile_linear(log_probs, weights, m, b0, t, sm, o)
                    if low < 1e-280:
                        bad = _mixture_tile(log_probs, log_weights, m, b0, t, mx, sm, o)
                if bad > 0.0:
                    flags[it] = 1
    for m in range(M):
        st = 0
        for it in range(m * nb, (m + 1) * nb):
            st = max(st, flags[it])
        status[m] = st


# ------------------------------------------------------------------------- finite-state machines

@njit(parallel=True, cache=True)
def pooled_weights_kernel(log_probs, weights):
    """r[s, a] = sum_k w_k log_probs[k, s, a] (the per-token RKL reward, theory section 2); (K, S, n) -> (S, n)."""
    K, S, n = log_probs.shape
    r = np.empty((S, n))
    for s in prange(S):
        for a in range(n):
            acc = 0.0
            for k in range(K):
                acc += weights[k] * log_probs[k, s, a]
            r[s, a] = acc
    return r


_ITEM_WORK = 1 << 14   # (state, token) pairs of one work item of the recursion
_DBL_MIN = 2.2250738585072014e-308             # the least normal float64
_LN_DBL_MIN = -708.3964185322641               # ln DBL_MIN: a pooled log-weight below it has a subnormal exp


@njit(parallel=True, cache=True, fastmath=_FM, error_model="numpy")
def pooled_exp_kernel(log_probs, teachers, weights, weight, tiny, n_workers):
    """weight[s, a] = exp(sum_j weights[j] log_probs[teachers[j], s, a]): the pooled probabilities of the
    linear recursion in one pass, fused (no copy of the positive-weight teachers' table, no reward
    table, no separate finiteness pass). teachers: int64 indices of the positive-weight teachers.
    tiny (S,) int64 <- per state, how many pooled log-weights are finite and below ln DBL_MIN (their exp is
    subnormal or 0, so off by up to DBL_MIN: :func:`linear_recursion_kernel` bounds what they can move)."""
    K2 = teachers.shape[0]
    S, n = weight.shape
    rows = max(1, _ITEM_WORK // n)
    items = (S + rows - 1) // rows
    flat = log_probs.reshape((log_probs.shape[0], S * n))
    out = weight.reshape(S * n)
    counter = np.zeros(1, np.int64)
    for wk in prange(max(1, min(n_workers, items))):
        e = np.zeros(_TILE)
        ba = np.empty(_TILE, np.int64)
        bb = np.empty(_TILE, np.int64)
        while True:
            it = fetch_add_one(counter)
            if it >= items:
                break
            for s in range(it * rows, min(S, (it + 1) * rows)):
                tiny[s] = 0
            # tiles over the item's (state, token) entries as one flat range: a short row (n = 6) costs
            # n exps, not a tile's
            f1 = min(S, (it + 1) * rows) * n
            for b0 in range(it * rows * n, f1, _TILE):
                t = min(_TILE, f1 - b0)
                k0 = teachers[0]
                w0 = weights[0]
                for i in range(t):
                    e[i] = w0 * flat[k0, b0 + i]
                for j in range(1, K2):
                    kj = teachers[j]
                    wj = weights[j]
                    for i in range(t):
                        e[i] += wj * flat[kj, b0 + i]
                for i in range(t):
                    v = e[i]
                    if v < _LN_DBL_MIN and v > -np.inf:
                        tiny[(b0 + i) // n] += 1
                exp_inplace(e[:t], ba[:t], bb[:t])
                for i in range(t):
                    out[b0 + i] = e[i]


@njit(cache=True, inline="always", fastmath=_FM, error_model="numpy")
def _recursion_item(weight, transitions, ends, tiny, z, row_sum, part_max, item_done, done, bad, h, horizon, it,
                    items, rows, inv, slack, end):
    """One item of :func:`linear_recursion_kernel`'s step h: z[h, s] for its states, their maximum, the
    underflow checks; counted in done[h] by the first worker to finish it."""
    S, n = weight.shape
    zn = z[h + 1]
    mx = 0.0
    ok = end < 1e280
    for s in range(it * rows, min(S, (it + 1) * rows)):
        if ends[s] and h < horizon - 1:
            acc = row_sum[s] * zn[S]
        else:
            acc = 0.0
            for a in range(n):
                acc += weight[s, a] * zn[np.uint32(transitions[s, a])]    # unsigned: no wraparound code
            row_sum[s] = acc              # read only where ends[s], from the first step on (zn = 1)
        v = acc * inv
        z[h, s] = v
        mx = max(mx, v)
        if tiny[s] > 0 and acc < tiny[s] * slack:
            ok = False
        elif v == 0.0:
            for a in range(n):
                if weight[s, a] > 0.0 and zn[np.uint32(transitions[s, a])] > 0.0:
                    ok = False
        elif v < 1e-280:
            ok = False
    part_max[h, it] = mx
    if not ok:
        atomic_add(bad, 0, 1)
    if atomic_add(item_done, h * items + it, 1) == 0:
        atomic_add(done, h, 1)


@njit(parallel=True, cache=True, fastmath=_FM, error_model="numpy")
def linear_recursion_kernel(weight, transitions, ends, tiny, horizon, out, n_workers):
    """Backward recursion for ln Z in linear space   (theory section 2).

    Z_h(s) = sum_a weight[s, a] Z_{h+1}(t(s, a)), Z_H = 1, Z = 1 after an end. weight = exp(r): (S, n);
    transitions: (S, n) int32 with S standing for "ended"; out: (H + 1, S) <- ln Z.
    ends (S,) bool: every token of state s ends (a prefix tree's leaves, most of its states). Such a state's
    value is its row sum times the (scaled) value of an end at every step: the row is summed at the first
    step only (the end's value is 1 there, so the sum is the same loop) and then multiplied, one rounding
    apart from the loop (the same bound).
    One parallel region for all steps: the states are cut into items of ~2^14 (state, token) pairs, each
    step's items are taken from an atomic counter, and a worker starts step h - 1 once every item of step h
    is done (it waits on the items, never on another worker; a worker that finds no item left to take does
    the items taken but not yet done itself, so that a worker whose core is busy holds up nothing: an item
    writes the same values whoever does it, and the first to finish it counts it). The values of step h are
    divided by the largest value of step h + 1 (each worker reduces the items' maxima itself) and the logs of
    the scales are summed.
    tiny (S,): per state, how many of its weights are below DBL_MIN though their pooled log-weight is finite
    (:func:`pooled_exp_kernel`): each is off by at most DBL_MIN, times a continuation value at most
    max(z_{h+1}), so a state whose value is at least 2^52 times that bound keeps its float64 accuracy
    (such weights are e^-708 or less of a row whose other entries carry the mass: an LLM-like machine's
    heavy-tailed log-probabilities reach -1,000 without mattering).
    Returns False when a state with a positive Z underflowed (a scaled value below 1e-280, or 0 although
    some continuation has positive weight), its tiny weights could move it by more than 2^-52 of itself, or
    the scale of an end overflowed: out is then not valid and the caller falls back to the log-space kernel.
    """
    S, n = weight.shape
    rows = max(1, _ITEM_WORK // n)
    items = (S + rows - 1) // rows
    z = np.empty((horizon + 1, S + 1))
    z[horizon, :] = 1.0
    log_scale = np.zeros(horizon + 1)
    part_max = np.empty((horizon + 1, items))
    part_max[horizon, :] = 1.0
    taken = np.zeros(horizon + 1, np.int64)
    done = np.zeros(horizon + 1, np.int64)
    done[horizon] = items
    bad = np.zeros(1, np.int64)
    row_sum = np.empty(S)
    item_done = np.zeros((horizon + 1) * items, np.int64)
    for wk in prange(max(1, min(n_workers, items))):
        ls = 0.0
        for h in range(horizon - 1, -1, -1):
            spins = 0
            while atomic_add(done, h + 1, 0) < items:
                spins += 1
                if spins > 1000:
                    yield_cpu()     # the worker holding the last item may be waiting for this core
            if atomic_add(bad, 0, 0) != 0:
                break
            c = 0.0
            for it in range(items):
                c = max(c, part_max[h + 1, it])
            slack = max(c, z[h + 1, S]) * _DBL_MIN * 2.0 ** 52       # a tiny weight moves acc by < this
            if c == 0.0:
                c = 1.0
            ls += np.log(c)
            log_scale[h] = ls
            end = np.exp(-ls)
            z[h, S] = end
            inv = 1.0 / c
            while True:
                it = atomic_add(taken, h, 1)
                if it >= items:
                    break
                _recursion_item(weight, transitions, ends, tiny, z, row_sum, part_max, item_done, done, bad, h,
                                horizon, it, items, rows, inv, slack, end)
            # items taken by a worker that has not finished them (its core may be busy): done here too, the
            # same values written twice, so that no step waits for a thread the OS has set aside
            if atomic_add(done, h, 0) < items:
                for it in range(items):
                    if atomic_add(item_done, h * items + it, 0) == 0:
                        _recursion_item(weight, transitions, ends, tiny, z, row_sum, part_max, item_done, done, bad,
                                        h, horizon, it, items, rows, inv, slack, end)
    # read through the atomic: numba does not see the intrinsic write to ``bad`` and would fold a plain
    # read of the freshly zeroed array to 0
    if atomic_add(bad, 0, 0) != 0:
        return False
    nt = (S + _TILE - 1) // _TILE
    counter = np.zeros(1, np.int64)
    for wk in prange(max(1, min(n_workers, (horizon + 1) * nt))):      # tiles from a queue, as the steps
        while True:
            it = fetch_add_one(counter)
            if it >= (horizon + 1) * nt:
                break
            h = it // nt
            a0 = (it % nt) * _TILE
            ls = log_scale[h]
            zh = z[h, a0:min(S, a0 + _TILE)]
            oh = out[h, a0:min(S, a0 + _TILE)]
            for i in range(zh.shape[0]):
                oh[i] = ln(zh[i]) + ls          # ln 0 = -inf
    return True


@njit(cache=True)
def end_transitions(next_state):
    """next_state (S, n) with -1 for an end -> int32 transitions with S for an end (half the bytes a step reads)."""
    S, n = next_state.shape
    t = np.empty((S, n), np.int32)
    for s in range(S):
        for a in range(n):
            v = next_state[s, a]
            t[s, a] = S if v < 0 else v
    return t


def every_token_ends(next_state):
    """(S,) bool: the states whose every token ends (next_state -1 throughout the row; a prefix tree's leaves):
    the recursion sums such a row once (:func:`linear_recursion_kernel`'s ``ends``)."""
    return (next_state < 0).all(axis=1)


def sequence_log_partition_linear_kernel(next_state, reward, horizon, out):
    """The linear-space recursion from a reward table r (S, n) and next_state with -1 for an end:
    ``linear_recursion_kernel`` on exp(r), with the transitions read-only as FiniteStateTeachers holds them (one
    compiled kernel). Returns False on underflow."""
    tiny = (np.isfinite(reward) & (reward < _LN_DBL_MIN)).sum(axis=1).astype(np.int64)
    return linear_recursion_kernel(np.exp(reward), read_only(end_transitions(next_state)),
                                   read_only(every_token_ends(next_state)), tiny, horizon, out, get_num_threads())


@njit(parallel=True, cache=True)
def sequence_log_partition_log_kernel(next_state, reward, horizon, out):
    """The same recursion in log space: ln Z_h(s) = logsumexp_a (r[s, a] + ln Z_{h+1}(next))."""
    S = reward.shape[0]
    out[horizon, :] = 0.0
    for h in range(horizon - 1, -1, -1):
        for s in prange(S):
            out[h, s] = soft_value(next_state, reward, out[h + 1], s)


@njit(parallel=True, cache=True)
def geometric_conditionals_kernel(next_state, reward, log_partition, out):
    """ln g[h, s, a] = r[s, a] + ln Z_{h+1}(next) - ln Z_h(s); -inf where Z_h(s) = 0   (theory section 2)."""
    H, S, n = out.shape
    for hs in prange(H * S):
        h = hs // S
        s = hs % S
        lz = log_partition[h, s]
        for a in range(n):
            t = next_state[s, a]
            if lz == -np.inf:
                out[h, s, a] = -np.inf
            else:
                out[h, s, a] = reward[s, a] + (0.0 if t < 0 else log_partition[h + 1, t]) - lz


@njit(parallel=True, cache=True)
def sample_paths_kernel(next_state, cdf, table, step, start, uniforms, out):
    """Inverse-CDF sampling of token paths through the machine.

    cdf: (T, S, n) cumulative probabilities; sample i at step h uses table table[i] + step * h.
    uniforms: (N, H) in [0, 1); out: (N, H) int64 tokens, -1 after the response ends.
    """
    N, H = uniforms.shape
    n = cdf.shape[2]
    for i in prange(N):
        s = start
        for h in range(H):
            if s < 0:
                out[i, h] = -1
                continue
            row = cdf[table[i] + step * h, s]
            x = uniforms[i, h] * row[n - 1]
            a = 0
            while a < n - 1 and row[a] <= x:
                a += 1
            out[i, h] = a
            s = next_state[s, a]


@njit(cache=True)
def state_occupancy_kernel(next_state, probs, step, start, horizon, out):
    """Forward recursion: out[h + 1, next(s, a)] += out[h, s] P_h(a | s); out: (H + 1, S) zeroed.

    probs: (T, S, n); step 1 uses probs[h] at step h, step 0 uses probs[0] throughout.
    """
    S, n = next_state.shape
    out[0, start] = 1.0
    for h in range(horizon):
        p = probs[step * h]
        for s in range(S):
            o = out[h, s]
            if o == 0.0:
                continue
            for a in range(n):
                t = next_state[s, a]
                if t >= 0:
                    out[h + 1, t] += o * p[s, a]
