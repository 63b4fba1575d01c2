"""Sequence-level pools over finite-state teachers (docs/theory.md section 2).

K teachers share one finite-state machine: ``next_state[s, a]`` is the state after token a in state
s (-1: the response ends), ``log_probs[k, s, a] = ln p_k(a | s)``. A response starts in ``start``
and emits at most ``horizon`` tokens. Sequence-level targets:

- mixture ``A_seq(y) = sum_k w_k p_k(y)``, token conditionals with posterior weights
  ``beta_k(u) ∝ w_k p_k(u)``;
- geometric ``G_seq(y) ∝ prod_k p_k(y)^{w_k}``, token conditionals
  ``g(a | u) = prod_k p_k(a | u)^{w_k} Z(ua) / Z(u)`` with the continuation partition Z;
- local geometric ``l(a | u) ∝ prod_k p_k(a | u)^{w_k}`` (the token-level pool at each state).
"""

import math
import warnings

import numpy as np
from scipy.special import logsumexp

from . import _kernels
from .validate import (as_array, check_horizon, check_int, check_log_probs, check_probs, check_token_ids, check_weights,
                       positive_teachers)
from .pools import _geometric, _threads_for, log_arithmetic_pool

# Below this many (state, token) pairs a step is one work item of the recursion: the whole recursion
# runs on one thread (a parallel region's start-up costs microseconds, far more when the other core is busy).
_PARALLEL_MIN_WORK = 1 << 14


class NumericalFallbackWarning(RuntimeWarning):
    """A fast path would have lost accuracy and a slower, exact one was used instead."""


class FiniteStateTeachers:
    """K teachers on one finite-state machine.

    Parameters
    ----------
    next_state : (S, n) int, entries in [-1, S); -1 means the token ends the response.
    log_probs : (K, S, n) log-probabilities; every row ``log_probs[k, s]`` a distribution
        (1e-6 relative), -inf allowed.
    start : the start state.
    """

    def __init__(self, next_state, log_probs, start=0):
        ns = np.asarray(next_state)
        if ns.dtype.kind not in "iu":
            raise ValueError(f"next_state must be an integer array, got dtype {ns.dtype}")
        if ns.ndim != 2 or ns.shape[0] == 0 or ns.shape[1] == 0:
            raise ValueError(f"next_state must have shape (S, n) with S, n >= 1, got {ns.shape}")
        lp = as_array(log_probs, "log_probs", min_ndim=3)
        if lp.ndim != 3:
            raise ValueError(f"log_probs must have shape (K, S, n), got {lp.shape}")
        for axis, what in ((1, "states"), (2, "vocabulary")):
            if lp.shape[axis] != ns.shape[axis - 1]:
                raise ValueError(f"log_probs axis {axis} ({what}) has {lp.shape[axis]} entries but "
                                 f"next_state axis {axis - 1} has {ns.shape[axis - 1]}")
        S = ns.shape[0]
        bad = (ns < -1) | (ns >= S)
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            raise ValueError(f"next_state[{i}] = {ns[i]} is out of range [-1, {S})")
        lp = check_log_probs(lp, "log_probs", normalised=True)
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start < S:
            raise ValueError(f"start = {start!r} must be a state index in [0, {S})")
        self.next_state = np.ascontiguousarray(ns, dtype=np.int64)
        self.log_probs = lp
        self.start = int(start)
        if S >= 2**31 - 1:
            raise ValueError(f"S = {S} states: at most 2^31 - 2 (transitions are stored as int32)")
        # int32 transitions with S for an end, made once: every step of the recursion reads them
        self._transitions = _kernels.end_transitions(self.next_state)
        self._ends = _kernels.every_token_ends(self.next_state)
        self._freeze()

    @classmethod
    def from_probs(cls, next_state, probs, start=0):
        """Build from probabilities ``probs: (K, S, n)`` instead of log-probabilities."""
        p = check_probs(probs, "probs", min_ndim=3)
        with np.errstate(divide="ignore"):
            return cls(next_state, np.log(p), start)

    K = property(lambda self: self.log_probs.shape[0], doc="number of teachers")
    S = property(lambda self: self.log_probs.shape[1], doc="number of states")
    n = property(lambda self: self.log_probs.shape[2], doc="vocabulary size")

    def __repr__(self):
        return f"FiniteStateTeachers(K={self.K}, S={self.S}, n={self.n}, start={self.start})"

    def __setstate__(self, state):
        """Unpickled (a process pool, dask) the tables are read-only again, as built: NumPy's pickles do not keep
        the flag, and a writeable table would also compile a second copy of each kernel that reads it."""
        self.__dict__.update(state)
        self._freeze()

    def _freeze(self):
        for table in (self.next_state, self.log_probs, self._transitions, self._ends):
            table.flags.writeable = False


def _check_teachers(teachers):
    if not isinstance(teachers, FiniteStateTeachers):
        raise ValueError(f"teachers must be a FiniteStateTeachers, got {type(teachers).__name__}")
    return teachers


def _reward(teachers, weights):
    """r[s, a] = sum_k w_k ln p_k(a | s) over the positive-weight teachers; (S, n)."""
    _check_teachers(teachers)
    w = check_weights(weights, teachers.K, other="teachers.log_probs")
    keep = positive_teachers(w)
    return _kernels.pooled_weights_kernel(np.ascontiguousarray(teachers.log_probs[keep]), w[keep])


def _log_partition(teachers, weights, horizon):
    """ln Z (H + 1, S): the fused pooled exp and the one-region linear recursion; the log-space kernel when
    the linear one would underflow."""
    _check_teachers(teachers)
    w = check_weights(weights, teachers.K, other="teachers.log_probs")
    keep = positive_teachers(w)
    S, n = teachers.S, teachers.n
    out = np.empty((horizon + 1, S))
    with _threads_for(S * n, _PARALLEL_MIN_WORK) as threads:
        weight = np.empty((S, n))
        tiny = np.empty(S, np.int64)
        _kernels.pooled_exp_kernel(teachers.log_probs, keep.astype(np.int64), w[keep], weight, tiny, threads)
        if not _kernels.linear_recursion_kernel(weight, teachers._transitions, teachers._ends, tiny, horizon, out,
                                                threads):
            warnings.warn("sequence_log_partition: the linear-space recursion would underflow (partitions "
                          "differing by more than ~1e280, or pooled probabilities below 1e-308 that carry a "
                          "state's partition); using the "
                          "log-space recursion", NumericalFallbackWarning, stacklevel=3)
            _kernels.sequence_log_partition_log_kernel(teachers.next_state, _reward(teachers, w), horizon, out)
    if out[0, teachers.start] == -np.inf:
        raise ValueError(f"empty support intersection at the sequence level: no response of at most "
                         f"{horizon} tokens from the start state {teachers.start} has positive probability "
                         f"under every positive-weight teacher (Z = 0)")
    return out


def sequence_log_partition(teachers, weights, horizon):
    """Continuation partitions ln Z by the backward recursion (theory section 2).

    ln Z[H, s] = 0,  ln Z[h, s] = logsumexp_a ( sum_k w_k ln p_k(a|s) + ln Z[h+1, next(s, a)] ),
    with ln Z = 0 after an end token. O(H S n) time after pooling the K teachers once.

    Returns
    -------
    (horizon + 1, S): row h is ln Z of each state with ``horizon - h`` tokens left; -inf where no
    completion has positive weight. Raises ValueError when that happens at the start state.
    """
    horizon = check_horizon(horizon)
    return _log_partition(teachers, weights, horizon)


def sequence_geometric_conditionals(teachers, weights, horizon):
    """Token conditionals of the sequence-level geometric pool G_seq (theory section 2).

    ln g[h, s, a] = sum_k w_k ln p_k(a|s) + ln Z[h+1, next(s, a)] - ln Z[h, s].

    Returns
    -------
    (horizon, S, n) log-probabilities; rows of states with Z = 0 (never reached under g) are -inf.
    """
    horizon = check_horizon(horizon)
    log_z = _log_partition(teachers, weights, horizon)
    reward = _reward(teachers, weights)
    out = np.empty((horizon, teachers.S, teachers.n))
    _kernels.geometric_conditionals_kernel(teachers.next_state, reward, log_z, out)
    return out


def local_geometric_conditionals(teachers, weights):
    """Local (per-token) geometric pool at every state, l(a|s) ∝ prod_k p_k(a|s)^{w_k} (theory section 2); (S, n).

    Raises ValueError naming the first state whose supports do not intersect.
    """
    _check_teachers(teachers)
    return _geometric(teachers.log_probs, weights, "teachers.log_probs")[0]


TARGETS = ("arithmetic", "local", "geometric")


def target_log_probs(teachers, weights, horizon, target):
    """The target conditionals a distillation loss names, at every position of a response, ``(horizon, S, n)``.

    ``"arithmetic"``: ln sum_k w_k p_k(a|s), the forward loss's (prior weights at every position);
    ``"local"``: ln l(a|s), the per-token geometric pool (per-token reverse KL); ``"geometric"``:
    ln g[h, s, a] of G_seq (sequence-level reverse KL: the gamma = 1 policy gradient), theory section 1-2. The first
    two do not depend on the position h and are broadcast over it (a read-only view).
    """
    _check_teachers(teachers)
    w = check_weights(weights, teachers.K, other="teachers.log_probs")
    horizon = check_int(horizon, "horizon", 1)
    if target == "arithmetic":
        table = log_arithmetic_pool(teachers.log_probs, w)
    elif target == "local":
        table = local_geometric_conditionals(teachers, w)
    elif target == "geometric":
        return sequence_geometric_conditionals(teachers, w, horizon)
    else:
        raise ValueError(f"target = {target!r} must be one of {TARGETS}")
    return np.broadcast_to(table, (horizon,) + table.shape)


def _walk(teachers, path):
    """Validate a token path from the start state; returns (tokens, states visited before each)."""
    _check_teachers(teachers)
    if np.ndim(path) != 1:
        raise ValueError(f"path must be a 1-D sequence of token ids, got {path!r}")
    tokens = np.asarray(check_token_ids(path, "path", teachers.n), dtype=np.int64)
    states = np.empty(tokens.size, np.int64)
    s = teachers.start
    for t, a in enumerate(tokens):
        if s < 0:
            raise ValueError(f"path[{t - 1}] = {tokens[t - 1]} ends the response but the path goes on")
        states[t] = s
        s = teachers.next_state[s, a]
    return tokens, states


def sequence_log_prob(teachers, path):
    """ln p_k(y) = sum_h ln p_k(y_h | y_<h) of a token path from the start state, per teacher; (K,)."""
    tokens, states = _walk(teachers, path)
    return teachers.log_probs[:, states, tokens].sum(axis=1)


def mixture_conditionals(teachers, weights, path):
    """Token conditionals of the sequence-level mixture A_seq along a path (theory section 2).

    ln A(a | u) = logsumexp_k ( ln beta_k(u) + ln p_k(a|u) ),  beta_k(u) ∝ w_k p_k(u),
    for every prefix u of the path (the empty prefix first).

    Returns
    -------
    (len(path) + 1, n) log-probabilities; the last row is -inf when the path ends the response.
    Raises ValueError when the path has probability 0 under every positive-weight teacher.
    """
    tokens, states = _walk(teachers, path)
    w = check_weights(weights, teachers.K, other="teachers.log_probs")
    keep = positive_teachers(w)
    lp = teachers.log_probs[keep]
    # log_beta[t] = ln w_k + ln p_k(y_<t), for t = 0 .. L
    steps = lp[:, states, tokens]                                 # (K', L)
    log_beta = np.log(w[keep])[:, None] + np.concatenate(
        [np.zeros((keep.size, 1)), np.cumsum(steps, axis=1)], axis=1)
    dead = np.isneginf(log_beta).all(axis=0)
    if dead.any():
        t = int(np.flatnonzero(dead)[0]) - 1
        raise ValueError(f"path[{t}] = {tokens[t]}: the prefix has probability 0 under every "
                         f"positive-weight teacher")
    log_beta -= logsumexp(log_beta, axis=0)
    last = teachers.start if tokens.size == 0 else teachers.next_state[states[-1], tokens[-1]]
    all_states = np.append(states, last)
    out = np.full((tokens.size + 1, teachers.n), -np.inf)
    live = all_states >= 0
    cond = lp[:, np.where(live, all_states, 0), :]               # (K', L + 1, n)
    out[live] = logsumexp(log_beta[:, :, None] + cond, axis=0)[live]
    return out


def _target_tables(teachers, weights, horizon, target):
    """Per-step probability tables (T, S, n) and step (1: table h at step h, 0: one table)."""
    if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
        if not 0 <= target < teachers.K:
            raise ValueError(f"target = {target} is not a teacher index in [0, {teachers.K})")
        return np.exp(teachers.log_probs[target])[None], 0
    if target == "geometric":
        return np.exp(sequence_geometric_conditionals(teachers, weights, horizon)), 1
    if target == "local":
        return np.exp(local_geometric_conditionals(teachers, weights))[None], 0
    if target == "mixture":
        return np.exp(teachers.log_probs), 0
    raise ValueError(f"target = {target!r} must be 'geometric', 'local', 'mixture' or a teacher index")


def sample_paths(teachers, weights, horizon, n_samples, seed, target="geometric"):
    """Sample responses of at most ``horizon`` tokens from the start state.

    target: ``"geometric"`` (g, i.e. G_seq), ``"local"`` (l at every step), ``"mixture"`` (A_seq:
    a teacher k ~ w per response, then p_k) or a teacher index. ``weights`` may be None for a
    teacher index.

    Returns
    -------
    (n_samples, horizon) int64 tokens, -1 after the response ends. Same seed, same paths.
    """
    _check_teachers(teachers)
    horizon = check_horizon(horizon)
    n_samples = check_int(n_samples, "n_samples")
    probs, step = _target_tables(teachers, weights, horizon, target)
    rng = np.random.default_rng(seed)
    table = np.zeros(n_samples, np.int64)
    if target == "mixture":
        w = check_weights(weights, teachers.K, other="teachers.log_probs")
        table = rng.choice(teachers.K, size=n_samples, p=w).astype(np.int64)
    cdf = np.ascontiguousarray(np.cumsum(probs, axis=-1))
    uniforms = rng.random((n_samples, horizon))
    out = np.empty((n_samples, horizon), np.int64)
    _kernels.sample_paths_kernel(teachers.next_state, cdf, table, step, teachers.start, uniforms, out)
    return out


def state_occupancy(teachers, weights, horizon, target="geometric"):
    """Probability of being in each state, not yet ended, before token h (forward recursion).

    occ[0] = one-hot(start),  occ[h+1, s'] = sum_{s, a: next(s, a) = s'} occ[h, s] P_h(a | s).
    target as in :func:`sample_paths`; the mixture's occupancy is sum_k w_k occ_k.

    Returns
    -------
    (horizon + 1, S).
    """
    _check_teachers(teachers)
    horizon = check_horizon(horizon)
    probs, step = _target_tables(teachers, weights, horizon, target)

    def run(table, step):
        out = np.zeros((horizon + 1, teachers.S))
        _kernels.state_occupancy_kernel(teachers.next_state, np.ascontiguousarray(table), step,
                                        teachers.start, horizon, out)
        return out

    if target == "mixture":
        w = check_weights(weights, teachers.K, other="teachers.log_probs")
        return sum(w[k] * run(probs[k:k + 1], 0) for k in positive_teachers(w))
    return run(probs, step)


def policy_occupancy(teachers, horizon, log_policy):
    """Forward occupancy of a state-conditional policy q on the machine: occ[h, s] = P_q(in s, not ended,
    before token h); occ[0] = one-hot(start). log_policy: (S, n) or (horizon, S, n). Returns (horizon + 1, S)."""
    _check_teachers(teachers)
    horizon = check_horizon(horizon)
    lq = _check_policy(teachers, horizon, log_policy)
    step = 1 if lq.ndim == 3 else 0
    q = np.exp(lq) if step else np.exp(lq)[None]
    occ = np.zeros((horizon + 1, teachers.S))
    _kernels.state_occupancy_kernel(teachers.next_state, np.ascontiguousarray(q), step, teachers.start, horizon, occ)
    return occ


def _check_policy(teachers, horizon, log_policy, name="log_policy"):
    lq = check_log_probs(log_policy, name, normalised=True)
    if lq.shape[-2:] != (teachers.S, teachers.n) or lq.ndim not in (2, 3) or (lq.ndim == 3 and lq.shape[0] != horizon):
        raise ValueError(f"{name} must have shape (S, n) = ({teachers.S}, {teachers.n}) or "
                         f"(horizon, S, n) = ({horizon}, {teachers.S}, {teachers.n}), got {lq.shape}")
    return lq


def sequence_kl(teachers, weights, horizon, log_policy, target="geometric"):
    """KL_seq(q || P) over responses of at most ``horizon`` tokens, for a state-conditional policy q.

    KL_seq(q || P) = sum_h sum_s occ_q(h, s) KL(q(.|h, s) || P(.|h, s))   (theory section 2-3: the KL over
    responses splits by the chain rule into per-state KLs weighted by q's occupancy), where P is
    G_seq (``"geometric"``, conditionals g), the local pool l at every step (``"local"``), teacher
    k (an index), or any state-conditional policy given as log-probs (S, n) or (horizon, S, n).
    Tokens with q = 0 contribute 0.

    log_policy : (S, n) (the same policy at every step) or (horizon, S, n) log-probabilities.
    Returns a float (nats per response). Example: the per-round sequence-level regret of an on-policy
    learner that converged to l is ``sequence_kl(t, w, H, local_geometric_conditionals(t, w))``.
    """
    _check_teachers(teachers)
    horizon = check_horizon(horizon)
    lq = _check_policy(teachers, horizon, log_policy)
    if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
        if not 0 <= target < teachers.K:
            raise ValueError(f"target = {target} is not a teacher index in [0, {teachers.K})")
        log_t = teachers.log_probs[target][None]
    elif isinstance(target, str) and target == "geometric":
        log_t = sequence_geometric_conditionals(teachers, weights, horizon)
    elif isinstance(target, str) and target == "local":
        log_t = local_geometric_conditionals(teachers, weights)[None]
    elif not isinstance(target, str):
        log_t = _check_policy(teachers, horizon, target, "target")
        log_t = log_t if log_t.ndim == 3 else log_t[None]
    else:
        raise ValueError(f"target = {target!r} must be 'geometric', 'local', a teacher index or a policy array")
    step = 1 if lq.ndim == 3 else 0
    q = np.exp(lq) if step else np.exp(lq)[None]
    occ = np.zeros((horizon + 1, teachers.S))
    _kernels.state_occupancy_kernel(teachers.next_state, np.ascontiguousarray(q), step, teachers.start, horizon, occ)
    lq = lq if step else lq[None]
    with np.errstate(invalid="ignore"):
        kl = np.sum(np.where(q > 0, q * (lq - log_t), 0.0), axis=2)
    return float(np.sum(occ[:horizon] * kl))


def growth_rate(teachers, weights, state):
    """lim_H Z_H(state)^{1/H}: the spectral radius of the pooled matrix
    M[s, s'] = sum_{a: next(s, a) = s'} prod_k p_k(a|s)^{w_k} restricted to the states reachable from
    ``state`` (theory section 2). Z_H(C) / Z_H(I) -> 0 as H -> inf when the rate after C is below the rate after I."""
    reward = _reward(teachers, weights)
    S = teachers.S
    state = check_int(state, "state")
    if state >= S:
        raise ValueError(f"state = {state} is not a state index in [0, {S})")
    M = np.zeros((S, S))
    for s in range(S):
        for a in range(teachers.n):
            if teachers.next_state[s, a] >= 0:
                M[s, teachers.next_state[s, a]] += math.exp(reward[s, a])
    reach, frontier = {state}, [state]
    while frontier:
        s = frontier.pop()
        for s2 in np.flatnonzero(M[s] > 0):
            if int(s2) not in reach:
                reach.add(int(s2))
                frontier.append(int(s2))
    idx = sorted(reach)
    return float(np.max(np.abs(np.linalg.eigvals(M[np.ix_(idx, idx)]))))
