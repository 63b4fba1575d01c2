"""Argument checks shared by every public function of the project (docs/theory.md section 7).

Each raises ValueError naming the argument and the first offending index, and returns a contiguous
float64 (or int64) array, or a plain Python value, ready for a kernel. ``sims`` and ``llm_bridge``
validate with these too, so that one bad input reads the same everywhere.
"""

import numpy as np
from scipy.special import logsumexp

ROW_TOL = 1e-6


def first_index(mask):
    """The first True index of a boolean array, as a tuple (or an int for 1-D)."""
    idx = tuple(int(i) for i in np.argwhere(mask)[0])
    return idx[0] if len(idx) == 1 else idx


def as_array(x, name, dtype=np.float64, min_ndim=1):
    """``x`` as a contiguous array of ``dtype`` with at least ``min_ndim`` axes."""
    try:
        arr = np.ascontiguousarray(x, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a numeric array: {exc}") from None
    if arr.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} axes (teacher first, vocabulary last), "
                         f"got shape {arr.shape}")
    return arr


def float_dtype(x):
    """The dtype a pool computes in for input ``x``: float32 stays float32 (the dtype of real logits), any
    other input (float64, integers, lists, float16) becomes float64."""
    return np.float32 if getattr(x, "dtype", None) == np.float32 else np.float64


def read_only(x):
    """``x`` as a read-only C-contiguous view (a copy only where ``x`` is not C-contiguous), for a kernel's input:
    numba compiles a kernel once per argument type, and a read-only array is another type than a writeable
    one. Handing every input read-only (the teachers' tables are) keeps it to one compile per dtype."""
    view = np.ascontiguousarray(x).view()
    view.flags.writeable = False
    return view


def check_out(out, shape, dtype, name="out"):
    """An ``out=`` array: a writeable C-contiguous ndarray of exactly ``shape`` and ``dtype``."""
    if not isinstance(out, np.ndarray):
        raise ValueError(f"{name} must be a NumPy array, got {type(out).__name__}")
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{name} has shape {out.shape} and dtype {out.dtype}; the result has shape "
                         f"{tuple(shape)} and dtype {np.dtype(dtype)}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name} must be C-contiguous and writeable")
    return out


def check_weights(weights, n_teachers, name="weights", other="log_probs"):
    """Weights on the simplex: 1-D, length K, finite, >= 0, summing to 1 (1e-6 relative)."""
    w = as_array(weights, name)
    if w.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {w.shape}")
    if w.shape[0] != n_teachers:
        raise ValueError(f"{name} has length {w.shape[0]} but the teacher axis (axis 0) of {other} "
                         f"has {n_teachers} entries")
    if not np.all(np.isfinite(w)):
        i = first_index(~np.isfinite(w))
        raise ValueError(f"{name}[{i}] = {w[i]} is not finite")
    if np.any(w < 0):
        i = first_index(w < 0)
        raise ValueError(f"{name}[{i}] = {w[i]} is negative")
    total = w.sum()
    if abs(total - 1.0) > ROW_TOL:
        raise ValueError(f"{name} sum to {float(total)!r}, not 1 (normalise them first)")
    return w


def check_probs(probs, name="probs", min_ndim=2):
    """Probabilities with the vocabulary last: finite, >= 0, each row summing to 1 (1e-6 relative)."""
    p = as_array(probs, name, min_ndim=min_ndim)
    if not np.all(np.isfinite(p)):
        i = first_index(~np.isfinite(p))
        raise ValueError(f"{name}[{i}] = {p[i]} is not finite")
    if np.any(p < 0):
        i = first_index(p < 0)
        raise ValueError(f"{name}[{i}] = {p[i]} is negative")
    sums = p.sum(axis=-1)
    bad = np.abs(sums - 1.0) > ROW_TOL
    if np.any(bad):
        i = first_index(bad)
        raise ValueError(f"{name}[{i}] sums to {float(sums[i])!r}, not 1 (each row over the last axis must be "
                         f"a distribution){transposed_hint(p, name)}")
    return p


def transposed_hint(probs, name):
    """A hint for a 2-D table whose rows fail to sum to 1 while its columns do: the (n, K) transpose of a
    (K, n) table. Empty otherwise."""
    if probs.ndim != 2 or probs.shape[0] == probs.shape[1]:
        return ""
    if not np.all(np.abs(probs.sum(axis=0) - 1.0) <= ROW_TOL):
        return ""
    return (f"; its columns sum to 1, so {name} looks transposed: shape {probs.shape} is read as "
            f"({probs.shape[0]} teachers, {probs.shape[1]} tokens), but the teacher axis is axis 0, "
            f"(K, n): pass {name}.T")


def check_log_probs(log_probs, name="log_probs", min_ndim=2, normalised=False):
    """Log-probabilities: no NaN, none above 0 (-inf allowed); optionally rows with logsumexp = 0."""
    lp = as_array(log_probs, name, min_ndim=min_ndim)
    if np.any(np.isnan(lp)):
        i = first_index(np.isnan(lp))
        raise ValueError(f"{name}[{i}] is NaN")
    if np.any(lp > 0):
        i = first_index(lp > 0)
        raise ValueError(f"{name}[{i}] = {lp[i]} > 0: pass log-probabilities (log_softmax), not logits")
    if normalised:
        with np.errstate(divide="ignore"):
            sums = np.exp(logsumexp(lp, axis=-1))
        bad = np.abs(sums - 1.0) > ROW_TOL
        if np.any(bad):
            i = first_index(bad)
            with np.errstate(under="ignore"):
                hint = transposed_hint(np.exp(lp), name) if lp.ndim == 2 else ""
            raise ValueError(f"{name}[{i}] sums to {float(sums[i])!r} in probability, not 1 (each row over "
                             f"the last axis must be a distribution){hint}")
    return lp


def check_int(value, name, minimum=0):
    """A Python or NumPy integer (not a bool) that is at least ``minimum``; returns an int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} = {value!r} must be an integer >= {minimum}")
    return int(value)


def check_horizon(horizon, name="horizon"):
    """A response length: an integer >= 0."""
    if isinstance(horizon, bool) or not isinstance(horizon, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {horizon!r}")
    if horizon < 0:
        raise ValueError(f"{name} = {horizon} is negative")
    return int(horizon)


def check_horizons(horizons, name="horizon"):
    """One horizon or a non-empty list of them; returns (list of ints, whether one scalar was given)."""
    scalar = np.ndim(horizons) == 0
    hs = [horizons] if scalar else list(horizons)
    if not hs:
        raise ValueError(f"{name}s is empty")
    return [check_horizon(h, f"{name}[{i}]") for i, h in enumerate(hs)], scalar


def check_token_ids(ids, name, vocab_size, allow_empty=True):
    """Token ids: integers in [0, vocab_size); returns a list of ints. ValueError names the first bad
    position (a negative id, an id past the vocabulary, or a value that is not an integer)."""
    ids = list(ids)
    if not ids and not allow_empty:
        raise ValueError(f"{name} is empty")
    for i, a in enumerate(ids):
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise ValueError(f"{name}[{i}] = {a!r} is not an integer token id")
        if not 0 <= a < vocab_size:
            raise ValueError(f"{name}[{i}] = {a} is outside the vocabulary [0, {vocab_size})")
    return [int(a) for a in ids]


def positive_teachers(weights):
    """Indices of the teachers with positive weight (weight-0 teachers are left out of every sum)."""
    return np.flatnonzero(weights > 0)
