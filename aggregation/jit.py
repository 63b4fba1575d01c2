"""numba building blocks shared by the project's kernels (this package's and the sims').

Public so that kernels elsewhere (``learners/_kernels.py``) reuse them instead of copying them;
call them only from ``@njit`` code. No validation: plain contiguous arrays in, arrays out.

Vectorised exp and log
----------------------
numba's ``math.exp`` / ``math.log`` are scalar calls here (no SVML), and every pool is bound by them.
``exp_inplace`` and ``log_inplace`` are branch-free loops that LLVM vectorises: a Cody-Waite
reduction plus a polynomial, with the power of two assembled in an int64 buffer viewed as float64.

Soft backward recursion
-----------------------
``soft_value`` is one state of ``ln Z_h(s) = logsumexp_a (r[s, a] + ln Z_{h+1}(next(s, a)))`` (theory section 2):
the sequence-level partition of aggregation and the soft-optimal policy of the on-policy learners
are the same recursion, written once here.

numba caches each kernel by its own source file only: after editing this module, delete the
``__pycache__/*.nbi`` files of the modules whose kernels call it (or set NUMBA_CACHE_DIR), or they
keep the old code.
"""

import math

import numpy as np
from numba import njit

# Reassociation lets LLVM vectorise the sums; no 'nnan' / 'ninf': -inf is a valid log-prob.
FASTMATH = {"reassoc", "contract"}

_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_SQRT2 = 1.4142135623730951
_MANT_MASK = (1 << 52) - 1
_EXP_ONE = 1023 << 52
# 1/k!, k = 11 .. 0, for Horner on |r| <= ln2 / 2 (truncation error 6e-15 relative).
_EXP_C = (
    2.505210838544172e-08, 2.755731922398589e-07, 2.7557319223985893e-06,
    2.48015873015873e-05, 0.0001984126984126984, 0.001388888888888889,
    0.008333333333333333, 0.041666666666666664, 0.16666666666666666, 0.5, 1.0, 1.0,
)


@njit(cache=True, fastmath=FASTMATH)
def exp_inplace(x, bits_a, bits_b):
    """x[i] <- exp(x[i]) for a 1-D buffer; bits_a, bits_b: int64 scratch of len(x).

    exp(x) = 2^k1 2^k2 P(r) with x = k ln2 + r, k = k1 + k2 split in two so that subnormal results
    come out right; x is clamped to [-746, 710], so -inf gives 0 and x > 709.78 gives inf.
    """
    exp_parts(x, bits_a, bits_b)
    fa = bits_a.view(np.float64)
    fb = bits_b.view(np.float64)
    for i in range(x.shape[0]):
        x[i] = x[i] * fa[i] * fb[i]


@njit(cache=True, fastmath=FASTMATH, inline="always")
def exp_parts(x, bits_a, bits_b):
    """The first pass of ``exp_inplace``, for callers in a hot loop: x[i] <- P(r_i), and the bits
    of 2^k1, 2^k2 into bits_a, bits_b; exp(x[i]) is then x[i] * fa[i] * fb[i], with fa, fb the
    float64 views of bits_a, bits_b that such a caller makes once, outside its loop."""
    m = x.shape[0]
    for i in range(m):
        xi = min(max(x[i], -746.0), 710.0)
        kf = np.floor(xi * _LOG2E + 0.5)
        r = (xi - kf * _LN2_HI) - kf * _LN2_LO
        p = _EXP_C[0]
        p = p * r + _EXP_C[1]
        p = p * r + _EXP_C[2]
        p = p * r + _EXP_C[3]
        p = p * r + _EXP_C[4]
        p = p * r + _EXP_C[5]
        p = p * r + _EXP_C[6]
        p = p * r + _EXP_C[7]
        p = p * r + _EXP_C[8]
        p = p * r + _EXP_C[9]
        p = p * r + _EXP_C[10]
        p = p * r + _EXP_C[11]
        k = np.int64(kf)
        k1 = k >> 1
        bits_a[i] = (k1 + 1023) << 52
        bits_b[i] = (k - k1 + 1023) << 52
        x[i] = p


@njit(cache=True, fastmath=FASTMATH)
def log_inplace(x, bits):
    """x[i] <- ln x[i] for positive normal x; bits: int64 scratch of len(x) (viewed as float64).

    x = 2^e m with m in [sqrt(1/2), sqrt 2); ln m = 2 atanh(f), f = (m - 1) / (m + 1), |f| < 0.172,
    summed to f^21 (truncation error below 1e-16). Zero and subnormal inputs are not handled:
    callers pass values >= 1 or fall back to math.log.
    """
    m = x.shape[0]
    fb = bits.view(np.float64)
    xb = x.view(np.int64)
    for i in range(m):
        b = xb[i]
        e = (b >> 52) - 1023
        bits[i] = (b & _MANT_MASK) | _EXP_ONE
        mant = fb[i]
        big = mant > _SQRT2
        mant = mant * 0.5 if big else mant
        ef = np.float64(e + 1) if big else np.float64(e)
        f = (mant - 1.0) / (mant + 1.0)
        f2 = f * f
        s = 1.0 / 21.0
        s = s * f2 + 1.0 / 19.0
        s = s * f2 + 1.0 / 17.0
        s = s * f2 + 1.0 / 15.0
        s = s * f2 + 1.0 / 13.0
        s = s * f2 + 1.0 / 11.0
        s = s * f2 + 1.0 / 9.0
        s = s * f2 + 1.0 / 7.0
        s = s * f2 + 1.0 / 5.0
        s = s * f2 + 1.0 / 3.0
        s = s * f2 + 1.0
        x[i] = ef * _LN2_HI + (2.0 * f * s + ef * _LN2_LO)


@njit(cache=True, inline="always")
def logsumexp_row(x):
    """ln sum_i exp(x[i]) of a 1-D array, shifted by its maximum; -inf when every entry is -inf."""
    m = -np.inf
    for v in x:
        if v > m:
            m = v
    if m == -np.inf:
        return m
    acc = 0.0
    for v in x:
        acc += math.exp(v - m)
    return m + math.log(acc)


@njit(cache=True, inline="always")
def soft_value(next_state, reward, next_value, s):
    """logsumexp_a (reward[s, a] + next_value[next_state[s, a]]), with 0 in place of next_value after an
    end token (next_state = -1): one state of the soft backward recursion (theory section 2); -inf when no
    token has a finite term."""
    n = reward.shape[1]
    m = -np.inf
    for a in range(n):
        t = next_state[s, a]
        v = reward[s, a] + (next_value[t] if t >= 0 else 0.0)
        if v > m:
            m = v
    if m == -np.inf:
        return m
    acc = 0.0
    for a in range(n):
        t = next_state[s, a]
        acc += math.exp(reward[s, a] + (next_value[t] if t >= 0 else 0.0) - m)
    return m + math.log(acc)
