"""Token-level pools of K teachers over one vocabulary (docs/theory.md section 1).

Arrays put the teacher axis first and the vocabulary last, ``(K, ..., n)``, with any number of
middle axes; weights are ``(K,)`` on the simplex. Weight-0 teachers are left out of every sum, so a
teacher with weight 0 may put probability 0 anywhere.

dtypes: the log-space pools keep float32 (float32 in, float32 out, read and written as float32, with no
up-cast copy) and give float64 for every other input; the arithmetic in between is float64 (see
``_kernels.py`` for why and for the error bound). ``out=`` takes a preallocated result, so that repeated
calls do not page-fault a fresh array each time. The probability-space pools return float64.
"""

from contextlib import contextmanager

import numba
import numpy as np

from . import _kernels
from .validate import (as_array, check_log_probs, check_out, check_probs, check_weights, float_dtype, positive_teachers,
                       read_only)


# Below this many input entries a pool runs on one thread: a parallel region's start-up and join cost
# microseconds on an idle machine and a scheduler time slice (milliseconds) when the other core is busy.
_PARALLEL_MIN_ENTRIES = 1 << 16


@contextmanager
def _threads_for(work, minimum):
    """numba threads for a kernel of ``work`` units: 1 below ``minimum``, else the current count; yields it."""
    before = numba.get_num_threads()
    if work >= minimum or before == 1:
        yield before
        return
    numba.set_num_threads(1)
    try:
        yield 1
    finally:
        numba.set_num_threads(before)


def _active(log_probs, weights, name):
    """Validate the shapes and weights; drop weight-0 teachers (after checking their entries too)."""
    lp = as_array(log_probs, name, dtype=float_dtype(log_probs), min_ndim=2)
    w = check_weights(weights, lp.shape[0], other=name)
    if lp.shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary axis (axis -1)")
    keep = positive_teachers(w)
    if keep.size < w.size:
        check_log_probs(lp, name)
        lp, w = np.ascontiguousarray(lp[keep]), w[keep]
    return lp, w


def _flat(lp):
    """lp (K, ..., n) as a read-only (K, M, n) view (:func:`validate.read_only`)."""
    return read_only(lp.reshape(lp.shape[0], -1, lp.shape[-1]))


def _result(lp, out):
    """The (M, n) result array of a pool of lp (K, ..., n): ``out`` (checked) or a fresh one."""
    if out is None:
        return np.empty(lp.shape[1:], lp.dtype)
    return check_out(out, lp.shape[1:], lp.dtype)


def _geometric(log_probs, weights, name="log_probs", out=None):
    """Run the geometric kernel; returns (log G, ln Z) with the middle axes restored, both of the input's
    dtype (float32 stays float32)."""
    lp, w = _active(log_probs, weights, name)
    middle = lp.shape[1:-1]
    flat = _flat(lp)
    result = _result(lp, out)
    out = result.reshape(flat.shape[1:])
    log_z = np.empty(flat.shape[1])
    status = np.empty(flat.shape[1], np.int8)
    with _threads_for(flat.size, _PARALLEL_MIN_ENTRIES) as threads:
        _kernels.log_geometric_pool_kernel(flat, w, out, log_z, status, threads, 0)
    if status.any():
        row = int(np.flatnonzero(status)[0])
        if status[row] == 1:
            check_log_probs(log_probs, name)  # raises with the exact index
        idx = np.unravel_index(row, middle) if middle else ()
        raise ValueError(f"{name}: empty support intersection at middle index {tuple(int(i) for i in idx)}: "
                         f"every token has probability 0 under some positive-weight teacher (Z = 0)")
    return result, log_z.reshape(middle).astype(lp.dtype, copy=False)


def log_geometric_pool(log_probs, weights, return_log_partition=False, out=None):
    """Normalised weighted geometric pool in log space (the RKL minimiser, theory section 1).

    ln G(a) = sum_k w_k ln p_k(a) - ln Z,   ln Z = logsumexp_a sum_k w_k ln p_k(a).

    Parameters
    ----------
    log_probs : (K, ..., n) log-probabilities (-inf allowed; rows need not be normalised, G is
        invariant to rescaling a teacher).
    weights : (K,) on the simplex.
    return_log_partition : also return ln Z, shape (...), from the same pass (the bridge's sampler
        needs both at every step; :func:`log_partition` alone runs the same kernel).
    out : optional (..., n) array of the result's dtype to write ln G into (returned).

    Returns
    -------
    (..., n) log-probabilities, or (ln G, ln Z); float32 for float32 input, float64 otherwise.
    Raises ValueError for an empty support intersection. Accuracy: within 1 ulp of the result's dtype of
    the exact value plus (8 + n) 2^-53 (|s| + |ln Z| + 1) (float64 arithmetic inside, ``_kernels.py``), and for
    float32 results 1e-8 (ln Z - max s) more (cheaper exps in the max-shifted sum: a sixth of a float32 ulp
    of the most probable token's log-probability, less of the others').
    """
    log_g, log_z = _geometric(log_probs, weights, out=out)
    return (log_g, log_z) if return_log_partition else log_g


def log_partition(log_probs, weights):
    """ln Z = logsumexp_a sum_k w_k ln p_k(a) <= 0 for normalised teachers (theory section 1); shape (...).

    -ln Z is the minimum of sum_k w_k KL(q || p_k) over q.
    """
    return _geometric(log_probs, weights)[1]


def log_arithmetic_pool(log_probs, weights, out=None):
    """Weighted arithmetic mixture in log space (the FKL minimiser, theory section 1).

    ln A(a) = logsumexp_k (ln w_k + ln p_k(a)).

    Parameters
    ----------
    log_probs : (K, ..., n) log-probabilities (-inf allowed).
    weights : (K,) on the simplex.
    out : optional (..., n) array of the result's dtype to write into (returned).

    Returns
    -------
    (..., n) log-probabilities; float32 for float32 input, float64 otherwise. Accuracy: within 1 ulp of
    the result's dtype of the exact value plus (8 + K) 2^-53 (max_k |ln p_k(a)| + 1); for float32 results,
    1 ulp plus (K + 4) 2^-24 where the mixture's probability is at most 1/64 (float32 arithmetic there, twice
    as fast: at most 1 + (K + 4) / 8 ulps, as ln A <= -4.16), and as float64 results above it.
    """
    lp, w = _active(log_probs, weights, "log_probs")
    flat = _flat(lp)
    result = _result(lp, out)
    status = np.empty(flat.shape[1], np.int8)
    with _threads_for(flat.size, _PARALLEL_MIN_ENTRIES) as threads:
        _kernels.log_arithmetic_pool_kernel(flat, np.log(w), result.reshape(flat.shape[1:]), status, threads, 0)
    if status.any():
        check_log_probs(log_probs)
    return result


def log_softmax(logits, axis=-1):
    """Finite ``logits`` normalised along ``axis`` into log-probabilities, in NumPy, without checks: for the small
    tables that a solver normalises thousands of times (the fixed points of ``distillation``, the regret
    comparators of ``learners``), where scipy's ``logsumexp`` spends most of a call on its checks."""
    shifted = logits - np.max(logits, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def arithmetic_pool(probs, weights):
    """A(a) = sum_k w_k p_k(a) (theory section 1). probs: (K, ..., n) distributions; returns (..., n)."""
    p = check_probs(probs)
    w = check_weights(weights, p.shape[0], other="probs")
    return np.tensordot(w, p, axes=1)


def geometric_pool(probs, weights):
    """G(a) = prod_k p_k(a)^{w_k} / Z (theory section 1), computed in log space. probs: (K, ..., n)."""
    p = check_probs(probs)
    with np.errstate(divide="ignore"):
        log_p = np.log(p)
    return np.exp(_geometric(log_p, weights, "probs")[0])
