"""The worked examples of docs/theory.md sections 1-2, and random teachers for tests and sweeps."""

import numpy as np

from .sequence import FiniteStateTeachers


def confident_expert(d, n_uniform=1, n=3):
    """One expert (1 - (n-1) d, d, ..., d) and ``n_uniform`` uniform teachers; (1 + n_uniform, n)."""
    expert = np.full(n, d, dtype=float)
    expert[0] = 1.0 - (n - 1) * d
    return np.vstack([expert] + [np.full(n, 1.0 / n)] * n_uniform)


def low_probability_teachers(e, n_agree=2):
    """``n_agree`` teachers (0.9, 0.1) and one (e, 1 - e) last; token 0 is correct (theory section 1);
    (n_agree + 1, 2). The default is theory section 1's triple (0.9, 0.1), (0.9, 0.1), (e, 1 - e)."""
    return np.vstack([np.tile([0.9, 0.1], (n_agree, 1)), [[e, 1.0 - e]]])


def prefix_bias_teachers(p_correct, continuation_c, continuation_i=None):
    """The prefix-bias machine of theory section 2: first token C (0) or I (1), then i.i.d. tokens.

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


def random_prefix_teachers(seed, sigma, n_teachers=3, n_states=4):
    """Random binary-token teachers on which every teacher prefers the correct first token (theory section 2).

    State 0 is the start: token 0 = C enters a region of ``n_states`` states, token 1 = I another;
    each region's transitions are uniform within it (seeded) and never end. p_k(C | start) ~ U(0.55, 0.95).
    In a region state s teacher k's row is softmax(b_s + sigma eps_{k,s}), b, eps ~ N(0, 1): sigma
    is the teachers' disagreement (sigma = 0: identical teachers, Z = 1, no flip). The same seed gives
    the same b, eps at every sigma. The regions start at states 1 and 1 + n_states.
    """
    rng = np.random.default_rng(seed)
    m, K = n_states, n_teachers
    S = 1 + 2 * m
    next_state = np.zeros((S, 2), np.int64)
    next_state[0] = (1, 1 + m)
    for offset in (1, 1 + m):
        next_state[offset:offset + m] = offset + rng.integers(0, m, size=(m, 2))
    p_c = rng.uniform(0.55, 0.95, size=K)
    base = rng.normal(size=(S - 1, 2))
    noise = rng.normal(size=(K, S - 1, 2))
    logits = base[None] + sigma * noise
    log_probs = np.empty((K, S, 2))
    log_probs[:, 0, 0], log_probs[:, 0, 1] = np.log(p_c), np.log1p(-p_c)
    log_probs[:, 1:] = logits - np.logaddexp(logits[..., :1], logits[..., 1:])
    return FiniteStateTeachers(next_state, log_probs)


def llm_like_prefix_teachers(seed, sigma=0.5, n=24, n_states=8, n_teachers=2, end_logit=-3.0, df=2.0):
    """Random teachers in a language model's regime, on which every teacher prefers the correct first
    token (theory section 2, claim T8): ``n`` tokens, the last an end token, and heavy-tailed disagreement.

    State 0 is the start: token 0 = C enters a region of ``n_states`` states, token 1 = I another; the
    other start tokens end the response. p_k(C | start) ~ U(0.55, 0.95), p_k(I | start) = 0.9 (1 - p_k(C)).
    In a region, every token but the end token moves to a seeded state of the same region; the end
    token (id n - 1) ends the response. Teacher k's row in region state s is
    softmax(b_s + sigma t_{k,s}), b ~ N(0, 2^2) over the tokens with b_end = ``end_logit`` + the log
    of the row's mass (so the end token takes a fixed share of about e^end_logit / (1 + e^end_logit)),
    and t Student-t with ``df`` degrees of freedom: most tokens nearly agreed on, a few with large
    disagreement, so that the continuation weights prod z are heavy-tailed as on real models.
    """
    rng = np.random.default_rng(seed)
    if n < 4:
        raise ValueError(f"n = {n} must be >= 4 (C, I, another token and the end token)")
    m, K, end = n_states, n_teachers, n - 1
    S = 1 + 2 * m
    next_state = np.full((S, n), -1, dtype=np.int64)
    for offset in (1, 1 + m):
        next_state[offset:offset + m, :end] = offset + rng.integers(0, m, size=(m, end))
    next_state[0, 0], next_state[0, 1] = 1, 1 + m
    p_c = rng.uniform(0.55, 0.95, size=K)
    log_probs = np.empty((K, S, n))
    log_probs[:, 0, 0], log_probs[:, 0, 1] = np.log(p_c), np.log(0.9 * (1 - p_c))
    log_probs[:, 0, 2:] = np.log(0.1 * (1 - p_c))[:, None] - np.log(n - 2)
    base = 2.0 * rng.normal(size=(S - 1, n))
    noise = rng.standard_t(df, size=(K, S - 1, n))
    logits = base[None] + sigma * noise
    body = logits[..., :end] - np.logaddexp.reduce(logits[..., :end], axis=-1, keepdims=True)
    log_end = end_logit + sigma * noise[..., end]
    log_probs[:, 1:, :end] = body - np.logaddexp(0.0, log_end)[..., None]
    log_probs[:, 1:, end] = log_end - np.logaddexp(0.0, log_end)
    return FiniteStateTeachers(next_state, log_probs)
