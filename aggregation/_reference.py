"""Slow, obviously-correct NumPy twins of the kernels in ``_kernels.py`` (tests compare the two).

Also the brute-force enumeration of every response of a finite-state machine, the independent
reference for the chain rules and the backward recursion.
"""

import numpy as np
from scipy.special import logsumexp


def log_geometric_pool(log_probs, weights):
    """s - logsumexp(s), s = sum_k w_k log_probs[k]; weights all positive."""
    s = np.tensordot(weights, log_probs, axes=1)
    return s - logsumexp(s, axis=-1, keepdims=True)


def log_arithmetic_pool(log_probs, weights):
    """logsumexp_k (ln w_k + log_probs[k]); weights all positive."""
    lw = np.log(weights).reshape((-1,) + (1,) * (log_probs.ndim - 1))
    return logsumexp(log_probs + lw, axis=0)


def pooled_weights(log_probs, weights):
    """r[s, a] = sum_k w_k log_probs[k, s, a]."""
    return np.tensordot(weights, log_probs, axes=1)


def sequence_log_partition(next_state, reward, horizon):
    """ln Z_h(s) = logsumexp_a (r[s, a] + ln Z_{h+1}(next[s, a])), ln Z = 0 after an end and at H."""
    S = next_state.shape[0]
    out = np.zeros((horizon + 1, S))
    ended = next_state < 0
    idx = np.where(ended, 0, next_state)
    for h in range(horizon - 1, -1, -1):
        future = np.where(ended, 0.0, out[h + 1][idx])
        with np.errstate(invalid="ignore"):
            out[h] = logsumexp(reward + future, axis=1)
    return out


def geometric_conditionals(next_state, reward, log_partition):
    """ln g[h, s, a] = r[s, a] + ln Z_{h+1}(next) - ln Z_h(s); rows with Z_h(s) = 0 are -inf."""
    H = log_partition.shape[0] - 1
    ended = next_state < 0
    idx = np.where(ended, 0, next_state)
    out = np.empty((H,) + next_state.shape)
    for h in range(H):
        future = np.where(ended, 0.0, log_partition[h + 1][idx])
        lz = log_partition[h][:, None]
        with np.errstate(invalid="ignore"):
            out[h] = np.where(np.isneginf(lz), -np.inf, reward + future - lz)
    return out


def sample_paths(next_state, cdf, table, step, start, uniforms):
    """Inverse-CDF sampling, one sample and step at a time."""
    N, H = uniforms.shape
    out = np.full((N, H), -1, dtype=np.int64)
    for i in range(N):
        s = start
        for h in range(H):
            if s < 0:
                break
            row = cdf[table[i] + step * h, s]
            a = int(np.searchsorted(row, uniforms[i, h] * row[-1], side="right"))
            a = min(a, row.shape[0] - 1)
            out[i, h] = a
            s = next_state[s, a]
    return out


def state_occupancy(next_state, probs, step, start, horizon):
    """out[h + 1, next(s, a)] += out[h, s] P_h(a | s), vectorised with np.add.at."""
    S, n = next_state.shape
    out = np.zeros((horizon + 1, S))
    out[0, start] = 1.0
    live = next_state >= 0
    for h in range(horizon):
        flow = out[h][:, None] * probs[step * h]
        np.add.at(out[h + 1], next_state[live], flow[live])
    return out


def enumerate_responses(teachers, horizon):
    """Every response of at most ``horizon`` tokens from the start state, by depth-first search.

    Returns a list of (tokens, log_probs (K,)) with log_probs[k] = ln p_k(y): a response ends at an
    end token (next_state = -1) or after ``horizon`` tokens. Exponential in the horizon: small trees.
    """
    out = []
    K = teachers.log_probs.shape[0]

    def walk(s, tokens, lp, depth):
        if depth == horizon:
            out.append((tuple(tokens), lp))
            return
        for a in range(teachers.n):
            step = teachers.log_probs[:, s, a]
            if np.all(np.isneginf(step)):
                continue
            t = teachers.next_state[s, a]
            if t < 0:
                out.append((tuple(tokens + [a]), lp + step))
            else:
                walk(t, tokens + [a], lp + step, depth + 1)

    walk(teachers.start, [], np.zeros(K), 0)
    return out
