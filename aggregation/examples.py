"""The worked examples of SPEC sections 1-2, and random teachers for tests and sweeps."""

import numpy as np

from .sequence import FiniteStateTeachers


def confident_expert(d, n_uniform=1, n=3):
    """One expert (1 - (n-1) d, d, ..., d) and ``n_uniform`` uniform teachers; (1 + n_uniform, n)."""
    expert = np.full(n, d, dtype=float)
    expert[0] = 1.0 - (n - 1) * d
    return np.vstack([expert] + [np.full(n, 1.0 / n)] * n_uniform)


def low_probability_teachers(e):
    """Teachers (0.9, 0.1), (0.9, 0.1), (e, 1 - e); token 0 is correct (SPEC 1); (3, 2)."""
    return np.array([[0.9, 0.1], [0.9, 0.1], [e, 1.0 - e]])


def prefix_bias_teachers(p_correct, continuation_c, continuation_i=None):
    """The prefix-bias machine of SPEC 2: first token C (0) or I (1), then i.i.d. tokens.

    State 0 is the start: token 0 = C goes to state 1, token 1 = I to state 2. In state 1 teacher k
    draws from ``continuation_c[k]``, in state 2 every teacher from ``continuation_i`` (default
    uniform); both loop on themselves. With ``horizon = H + 1``, Z(C) = rho^H and Z(I) = 1.

    p_correct : (K,) probability each teacher gives C; continuation_c : (K, m) with m >= 2.
    """
    p = np.asarray(p_correct, dtype=float)
    cont = np.asarray(continuation_c, dtype=float)
    K, m = cont.shape
    if continuation_i is None:
        continuation_i = np.full(m, 1.0 / m)
    probs = np.zeros((K, 3, m))
    probs[:, 0, 0] = p
    probs[:, 0, 1] = 1.0 - p
    probs[:, 1] = cont
    probs[:, 2] = np.asarray(continuation_i, dtype=float)
    next_state = np.zeros((3, m), dtype=np.int64)
    next_state[0, 0], next_state[0, 1:] = 1, 2
    next_state[1], next_state[2] = 1, 2
    return FiniteStateTeachers.from_probs(next_state, probs)


def _random_log_probs(rng, K, S, n, concentration, zero_fraction, tiny):
    """Dirichlet rows; a fraction of entries set to 0 (token 0 kept positive for every teacher, so
    supports always intersect) and, optionally, one entry per row pushed down to ``tiny``."""
    probs = rng.dirichlet(np.full(n, concentration), size=(K, S))
    if zero_fraction > 0 and n > 1:
        zero = rng.random((K, S, n)) < zero_fraction
        zero[..., 0] = False
        probs = np.where(zero, 0.0, probs)
    if tiny is not None and n > 1:
        col = rng.integers(1, n, size=(K, S))
        np.put_along_axis(probs, col[..., None], tiny, axis=-1)
    probs /= probs.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return np.log(probs)


def random_teachers(K, S, n, seed, end_prob=0.1, concentration=1.0, zero_fraction=0.0, tiny=None):
    """Random K teachers on a random S-state machine over n tokens.

    Each transition ends the response with probability ``end_prob``, else goes to a uniform state.
    Rows are Dirichlet(concentration); ``zero_fraction`` of the entries are set to probability 0
    (never token 0) and ``tiny`` (e.g. 1e-300) puts one very small entry in every row.
    """
    rng = np.random.default_rng(seed)
    next_state = rng.integers(0, S, size=(S, n))
    next_state[rng.random((S, n)) < end_prob] = -1
    return FiniteStateTeachers(next_state, _random_log_probs(rng, K, S, n, concentration, zero_fraction, tiny))


def prefix_tree(K, depth, n, seed, concentration=1.0, zero_fraction=0.0, tiny=None, end_prob=0.0):
    """Random teachers on the full n-ary prefix tree of the given depth: every node is its own state.

    Nodes are numbered breadth first; the tokens of a node at depth ``depth - 1`` end the response,
    and so does any token with probability ``end_prob``. S = (n^depth - 1) / (n - 1).
    """
    rng = np.random.default_rng(seed)
    S = sum(n ** d for d in range(depth))
    next_state = np.full((S, n), -1, dtype=np.int64)
    interior = S - n ** (depth - 1)
    for s in range(interior):
        next_state[s] = s * n + 1 + np.arange(n)
    next_state[rng.random((S, n)) < end_prob] = -1
    return FiniteStateTeachers(next_state, _random_log_probs(rng, K, S, n, concentration, zero_fraction, tiny))
