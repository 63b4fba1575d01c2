"""numba building blocks shared by the project's kernels (this package's and the sims').

Public so that kernels elsewhere (``learners/_kernels.py``) reuse them instead of copying them;
call them only from ``@njit`` code. No validation: plain contiguous arrays in, arrays out.

Vectorised exp and log
----------------------
numba's ``math.exp`` / ``math.log`` are scalar calls here (no SVML), and every pool is bound by them.
``exp_below`` (an argument <= 0) and ``ln`` are branch-free scalars that LLVM vectorises in the loop that
calls them, fused with that loop's other work: a range reduction plus a polynomial, with the power of two
assembled (exp) or taken apart (log) by a bit cast (``float_of_bits`` / ``bits_of_float``). ``exp_inplace``
(the whole range, subnormal results included) is a loop with the power of two in two int64 buffers.
They are compiled with ``error_model="numpy"``: numba's default ("python") wraps every float division
in a ZeroDivisionError branch, which keeps LLVM from vectorising the loop (a scalar log at ~5 ns a
value instead of ~1 ns). Kernels that call them should use ``error_model="numpy"`` too. Both work in
float64; the float32 pools widen each value in registers first (see ``_kernels.py`` for why).
They are plain ``@njit`` functions, not numba-inlined (``inline="always"``): LLVM inlines them into the
calling loop and vectorises it all the same (the pools run as fast, interleaved in one process), while
numba's own inlining re-typed their bodies at every call site and took half of each pool kernel's compile
time. Inlined by LLVM, each keeps its own fastmath flags (``ln``: contraction only) inside any caller.

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
import os

import llvmlite.ir as llvm_ir
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

# Reassociation lets LLVM vectorise the sums; no 'nnan' / 'ninf': -inf is a valid log-prob.
FASTMATH = {"reassoc", "contract"}

_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_SQRT2 = 1.4142135623730951
_MANT_MASK = (1 << 52) - 1
_EXP_ONE = 1023 << 52
_TINY = 2.2250738585072014e-308      # the smallest normal float64
_TWO54 = 18014398509481984.0          # 2^54
# 1/k!, k = 13 .. 0, for Horner on |r| <= ln2 / 2 (truncation error 2e-18 relative, below half an ulp).
EXP_C = (
    1.6059043836821613e-10, 2.08767569878681e-09, 2.505210838544172e-08, 2.755731922398589e-07,
    2.7557319223985893e-06, 2.48015873015873e-05, 0.0001984126984126984, 0.001388888888888889,
    0.008333333333333333, 0.041666666666666664, 0.16666666666666666, 0.5,
    1.0, 1.0,
)


def _bit_casts(np_int, np_float, nb_int, nb_float, llvm_int, llvm_float, names):
    """The two bit casts of one width, named ``names`` (float from bits, bits from float)."""
    def to_float(bits):
        return np_int(bits).view(np_float)

    def to_bits(x):
        return np_float(x).view(np_int)

    def cast(value, source, target, llvm_type):
        if value != source:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], llvm_type)
        return target(value), codegen

    @intrinsic
    def _to_float(typingctx, bits):
        return cast(bits, nb_int, nb_float, llvm_float)

    @intrinsic
    def _to_bits(typingctx, x):
        return cast(x, nb_float, nb_int, llvm_int)

    @overload(to_float)
    def _to_float_jit(bits):
        return lambda bits: _to_float(np_int(bits))

    @overload(to_bits)
    def _to_bits_jit(x):
        return lambda x: _to_bits(np_float(x))

    how = (": in compiled code a bit cast (a register move that LLVM vectorises with the loop around it, no buffer "
           "to view); NumPy under NUMBA_DISABLE_JIT=1.")
    to_float.__doc__ = f"The {np_float.__name__} whose bit pattern is the {np_int.__name__} ``bits``{how}"
    to_bits.__doc__ = f"The {np_int.__name__} bit pattern of the {np_float.__name__} ``x``{how}"
    to_float.__name__ = to_float.__qualname__ = names[0]
    to_bits.__name__ = to_bits.__qualname__ = names[1]
    return to_float, to_bits


float_of_bits, bits_of_float = _bit_casts(np.int64, np.float64, types.int64, types.float64, llvm_ir.IntType(64),
                                          llvm_ir.DoubleType(), ("float_of_bits", "bits_of_float"))
float32_of_bits, bits_of_float32 = _bit_casts(np.int32, np.float32, types.int32, types.float32, llvm_ir.IntType(32),
                                              llvm_ir.FloatType(), ("float32_of_bits", "bits_of_float32"))


@njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def horner(coefficients, r):
    """c[0] r^(m-1) + ... + c[m-1] for a tuple of m floats, highest power first (a fixed-length loop that
    LLVM unrolls, so the loops that call it stay vectorised)."""
    p = coefficients[0]
    for j in range(1, len(coefficients)):
        p = p * r + coefficients[j]
    return p


@njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def exp_inplace(x, bits_a, bits_b):
    """x[i] <- exp(x[i]) for a 1-D float64 buffer; bits_a, bits_b: int64 scratch of len(x).

    exp(x) = 2^k1 2^k2 P(r) with x = k ln2 + r, k = k1 + k2 split in two so that subnormal results
    come out right; x is clamped to [-746, 710], so -inf gives 0 and x > 709.78 gives inf; NaN stays NaN.
    Accuracy: within 1 ulp of NumPy's exp over the whole float64 range (tests/test_aggregation_dtypes.py).
    """
    exp_parts(x, bits_a, bits_b)
    fa = bits_a.view(np.float64)
    fb = bits_b.view(np.float64)
    for i in range(x.shape[0]):
        x[i] = x[i] * fa[i] * fb[i]


@njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def exp_parts(x, bits_a, bits_b):
    """The first pass of ``exp_inplace``, for callers in a hot loop: x[i] <- P(r_i), and the bits
    of 2^k1, 2^k2 into bits_a, bits_b; exp(x[i]) is then x[i] * fa[i] * fb[i], with fa, fb the
    float64 views of bits_a, bits_b that such a caller makes once, outside its loop."""
    m = x.shape[0]
    for i in range(m):
        xi = x[i]
        # a select, not min/max, so that NaN passes through to r (and k comes from 0, never from NaN)
        xi = -746.0 if xi < -746.0 else (710.0 if xi > 710.0 else xi)
        kf = np.floor((xi if xi == xi else 0.0) * _LOG2E + 0.5)
        r = (xi - kf * _LN2_HI) - kf * _LN2_LO
        p = horner(EXP_C, r)
        k = np.int64(np.int32(kf))                 # via int32 (|k| <= 1076): AVX2 converts to int32 only
        k1 = k >> 1
        bits_a[i] = (k1 + 1023) << 52
        bits_b[i] = (k - k1 + 1023) << 52
        x[i] = p


# 1/k!, k = 7 .. 0: exp to 7e-9 relative on |r| <= ln2 / 2 (truncation r^8 / 8! e^-r), for sums that a float32
# result reads (a float32 ulp is 6e-8 relative)
EXP7_C = (1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0)


@njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def exp_below(d, coefficients):
    """exp(d) for d <= 0, a scalar that LLVM vectorises in the loop that calls it: d = k ln2 + r, 2^k P(r),
    the power of two from its bits (``float_of_bits``: no int64 buffer, so the caller's loop stays one loop).
    One power of two: d below -700 (-inf and NaN too) is taken as -700, e^-700 = 1e-304 instead of a smaller
    term, which a sum of at least 1 (a max-shifted sum has a term 1) cannot tell apart; callers flag NaN
    themselves. ``exp_inplace`` is the whole-range exp.
    coefficients: ``EXP_C`` (the exact terms: within 1 ulp of NumPy's exp on [-700, 0]) or ``EXP7_C`` (a
    degree-7 polynomial, each term within 1e-8 of itself, about two thirds of the work).
    """
    d = d if d > -700.0 else -700.0
    kf = np.floor(d * _LOG2E + 0.5)
    r = (d - kf * _LN2_HI) - kf * _LN2_LO
    # via int32: AVX2 converts 4 lanes to int32, not to int64
    return horner(coefficients, r) * float_of_bits((np.int64(np.int32(kf)) + 1023) << 52)


# minimax coefficients of (ln((1 + r) / (1 - r)) - 2 r) / r^3 = 2/3 + 2/5 r^2 + ... in z = r^2, highest power first
# (|r| <= 0.1716; error below 2^-58)
_LOG_C = (1.479819860511658591e-01, 1.531383769920937332e-01, 1.818357216161805012e-01, 2.222219843214978396e-01,
          2.857142874366239149e-01, 3.999999999940941908e-01, 6.666666666666735130e-01)


@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def _ln_bits(b, bias):
    """ln of 2^((b >> 52) - bias) times the mantissa of the float64 bits b: the body of ``ln`` and ``ln_normal``."""
    e = (b >> 52) - bias
    mant = float_of_bits((b & _MANT_MASK) | _EXP_ONE)
    big = mant > _SQRT2
    mant = mant * 0.5 if big else mant
    ef = np.float64(e + 1) if big else np.float64(e)
    f = mant - 1.0                                   # exact (Sterbenz)
    r = f / (2.0 + f)
    z = r * r
    hfsq = 0.5 * f * f
    t = z * horner(_LOG_C, z)
    return ef * _LN2_HI - ((hfsq - (r * (hfsq + t) + ef * _LN2_LO)) - f)


@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def ln(xi):
    """ln xi of a float64, a scalar that LLVM vectorises in the loop that calls it.

    xi = 2^e m with m in [sqrt(1/2), sqrt 2); f = m - 1 is exact there, and ln m = f - (h - r (h + R)) with
    h = f^2 / 2, r = f / (2 + f), |r| < 0.172, and R a degree-7 minimax polynomial in r^2 (the compensated form
    keeps the leading f exact, so the result is accurate near 1 too). The whole range, branch-free: subnormals
    are scaled by 2^54 first, 0 gives -inf, +inf gives inf, a negative number or NaN gives NaN (as np.log).
    ``error_model="numpy"`` keeps numba's ZeroDivisionError branch out of the loop, so LLVM vectorises it.
    Inlined, it takes the flags of the kernel around it (``FASTMATH`` allows reassociation, which could undo
    the compensation): tests/test_aggregation_dtypes.py checks the bound inside such a kernel too.
    Accuracy: within 1 ulp of NumPy's log over the whole float64 range and of the exact value (against long
    double; tests/test_aggregation_dtypes.py).
    """
    sub = xi < _TINY
    v = _ln_bits(bits_of_float(xi * _TWO54 if sub else xi), 1023 + 54 if sub else 1023)
    v = -np.inf if xi == 0.0 else v
    v = np.inf if xi == np.inf else v
    return v if xi >= 0.0 else np.nan


@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def ln_normal(xi):
    """``ln`` without its special cases, for a positive, normal, finite xi (other inputs give meaningless
    values): the mixture's sums, which are at least 1e-280. Equal to ``ln`` there, with about a fifth less work."""
    return _ln_bits(bits_of_float(xi), 1023)


# ------------------------------------------------------------------------------------ float32 lanes
#
# ``exp_below32`` and ``ln32_normal`` are ``exp_below`` and ``ln_normal`` in float32 arithmetic: twice the lanes
# of a float64 vector (8 on AVX2, 16 on AVX-512), for the float32 mixture's terms and logs where its error
# analysis allows them (``_kernels.py``). Both compile with contraction only (no reassociation, which could
# undo the split of ln 2 or the compensated log), and LLVM keeps those flags when it inlines them.
_F32 = np.float32
_ZERO32, _HALF32, _ONE32, _TWO32 = _F32(0.0), _F32(0.5), _F32(1.0), _F32(2.0)
EXP_FLOOR32 = _F32(-87.0)                         # e^-87 = 1.6e-38, above the least normal float32 (1.2e-38)
_LOG2E_32 = _F32(_LOG2E)
_LN2_HI_32 = _F32(round(math.log(2.0) * 2.0**16) / 2.0**16)   # 16 bits: k ln2_hi is exact for |k| <= 255
_LN2_LO_32 = _F32(math.log(2.0) - float(_LN2_HI_32))
_SQRT2_32 = _F32(_SQRT2)
EXP7_C32 = tuple(_F32(c) for c in EXP7_C)
# (ln((1 + r) / (1 - r)) - 2 r) / r^3 = 2/3 + 2/5 z + 2/7 z^2 + 2/9 z^3 + ..., z = r^2 <= 0.0295: the next term
# moves ln m by at most 2/11 |r|^11, 1e-9 of it
_LOG_C32 = (_F32(2.0 / 9.0), _F32(2.0 / 7.0), _F32(2.0 / 5.0), _F32(2.0 / 3.0))


@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def exp_below32(d):
    """exp(d) of a float32 d <= 0 in float32 arithmetic, a scalar that LLVM vectorises in the loop that calls it:
    d = k ln2 + r (ln 2 in two parts, k ln2_hi exact), 2^k P7(r) (``EXP7_C32``: truncation 7e-9 relative), the
    power of two from its bits. d is clamped to [-87, 0]: -inf and NaN give e^-87 = 1.6e-38 (a caller flags NaN
    and takes sums that small elsewhere), d > 0 gives 1. Accuracy: within 1.5 float32 ulps of exp(d) on [-87, 0],
    with or without fused multiply-adds in the Horner steps (tests/test_aggregation_dtypes.py, also under
    NUMBA_DISABLE_JIT, where there are none)."""
    d = d if d > EXP_FLOOR32 else EXP_FLOOR32
    d = d if d < _ZERO32 else _ZERO32
    kf = np.floor(d * _LOG2E_32 + _HALF32)
    r = (d - kf * _LN2_HI_32) - kf * _LN2_LO_32
    return horner(EXP7_C32, r) * float32_of_bits(np.int32((np.int32(kf) + np.int32(127)) << np.int32(23)))


@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def ln32_normal(x):
    """ln x of a positive, normal, finite float32 in float32 arithmetic (other inputs give meaningless values):
    ``ln``'s compensated form, x = 2^e m, m in [sqrt(1/2), sqrt 2), f = m - 1 exact, r = f / (2 + f), with the
    series of ``_LOG_C32``. Accuracy: within 1 float32 ulp of the exact value (tests/test_aggregation_dtypes.py)."""
    b = bits_of_float32(x)
    e = np.int32(np.int32(b >> np.int32(23)) - np.int32(127))
    mant = float32_of_bits(np.int32((b & np.int32(0x7FFFFF)) | np.int32(0x3F800000)))
    big = mant > _SQRT2_32
    mant = mant * _HALF32 if big else mant
    ef = _F32(e + np.int32(1)) if big else _F32(e)
    f = mant - _ONE32                                # exact (Sterbenz)
    r = f / (_TWO32 + f)
    z = r * r
    hfsq = _HALF32 * f * f
    t = z * horner(_LOG_C32, z)
    return ef * _LN2_HI_32 - ((hfsq - (r * (hfsq + t) + ef * _LN2_LO_32)) - f)


@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def log_inplace(x):
    """x[i] <- ln x[i] (``ln``) for a 1-D float64 buffer."""
    for i in range(x.shape[0]):
        x[i] = ln(x[i])


@njit(cache=True)
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


@njit(cache=True, inline="always")   # numba-inlined: 1.04x faster in the log-space recursion than LLVM-inlined
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


# ----------------------------------------------------------------------------- dynamic scheduling

def fetch_add_one(counter):
    """counter[0] += 1, returning the old value: the work queue of a parallel kernel.

    In compiled code an atomic read-modify-write (an LLVM ``atomicrmw add``), so that the workers of a
    ``prange`` take items one at a time from a shared int64 counter: a worker whose core is busy takes
    fewer items instead of stalling the region (numba's own schedule is a static split). This plain
    Python body runs under NUMBA_DISABLE_JIT=1.
    """
    old = counter[0]
    counter[0] = old + 1
    return old


@intrinsic
def _atomic_fetch_add_one(typingctx, counter):
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [context.get_constant(types.intp, 0)])
        return builder.atomic_rmw("add", ptr, context.get_constant(types.int64, 1), "seq_cst")

    return types.int64(counter), codegen


@overload(fetch_add_one)
def _fetch_add_one_jit(counter):
    return lambda counter: _atomic_fetch_add_one(counter)


def atomic_add(counter, i, value):
    """counter[i] += value, returning the old value (an atomic read-modify-write in compiled code; with
    value 0, an atomic load that a spin-wait may poll). Plain Python under NUMBA_DISABLE_JIT=1."""
    old = counter[i]
    counter[i] = old + value
    return old


@intrinsic
def _atomic_add(typingctx, counter, i, value):
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64 and isinstance(i, types.Integer)
            and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        aryty, ity, vty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = context.cast(builder, args[1], ity, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [idx])
        val = context.cast(builder, args[2], vty, types.int64)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return types.int64(counter, i, value), codegen


@overload(atomic_add)
def _atomic_add_jit(counter, i, value):
    return lambda counter, i, value: _atomic_add(counter, i, value)


def yield_cpu():
    """Give the core to another runnable thread (POSIX sched_yield): a spin-wait that has waited a while
    calls it, so that on a busy machine the thread it waits for gets the core sooner."""
    os.sched_yield()


@intrinsic
def _sched_yield(typingctx):
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, llvm_ir.FunctionType(llvm_ir.IntType(32), []),
                                            "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@overload(yield_cpu)
def _yield_cpu_jit():
    return lambda: _sched_yield()
