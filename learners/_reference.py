"""Slow, obviously-correct NumPy twins of the kernels in ``_kernels.py`` (tests compare them).

Same arguments, same splitmix64 stream (Python integers), the formulas written out directly: each
prediction q_t is recomputed from scratch every round instead of being updated incrementally.
"""

import math

import numpy as np
from scipy.special import logsumexp

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class Stream:
    """splitmix64: x <- x + golden; uniform = mix(x) >> 11 / 2^53."""

    def __init__(self, seed):
        self.x = int(seed) & _MASK

    def uniform(self):
        self.x = (self.x + _GOLDEN) & _MASK
        z = self.x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        z ^= z >> 31
        return (z >> 11) / 9007199254740992.0


def _pick(cdf, u):
    return min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)


def _alias_pick(prob, index, u):
    n = len(prob)
    j = min(int(u * n), n - 1)
    return j if u * n - j < prob[j] else index[j]


def add_beta(next_state, start, horizon, alias_prob, alias_index, teacher_cdf, joint, neg_entropy, beta, forced,
             seeds, grid, track=None):
    """Add-beta per state; returns (regret, pseudo) of shape (R, G), and (R, G, P) q_t(track | start)
    when ``track`` is given. See the kernel's docstring."""
    S, n = next_state.shape
    regret = np.zeros((len(seeds), len(grid)))
    pseudo = np.zeros_like(regret)
    tracked = np.zeros((len(seeds), len(grid), 0 if track is None else len(track)))
    for i, seed in enumerate(seeds):
        rng = Stream(seed)
        counts = np.zeros((S, n))
        loss = pseudo_sum = 0.0
        for t in range(1, grid[-1] + 1):
            log_q = np.log(counts + beta) - np.log(counts.sum(axis=1, keepdims=True) + n * beta)
            if track is not None and t in grid:
                tracked[i, list(grid).index(t)] = np.exp(log_q[start, track])
            pseudo_sum += neg_entropy - np.sum(joint * log_q)
            k = _pick(teacher_cdf, rng.uniform()) if len(teacher_cdf) > 1 else 0
            s = start
            for _ in range(horizon):
                a = forced[t - 1] if len(forced) else _alias_pick(alias_prob[k, s], alias_index[k, s], rng.uniform())
                loss -= log_q[s, a]
                counts[s, a] += 1
                s = next_state[s, a]
                if s < 0:
                    break
            if t in grid:
                g = list(grid).index(t)
                with np.errstate(divide="ignore", invalid="ignore"):
                    best = np.where(counts > 0, counts * np.log(counts / counts.sum(axis=1, keepdims=True)), 0.0)
                regret[i, g] = loss + best.sum()
                pseudo[i, g] = pseudo_sum
    return (regret, pseudo) if track is None else (regret, pseudo, tracked)


def rkl_tabular(log_probs, teacher_cdf, pooled, log_target, feedback, schedule, eta0, seeds, grid, track=None):
    """Exponentiated gradient / FTL on RKL, one context; returns (regret, pseudo), (R, G), and (R, G, P)
    q_t(track) when ``track`` is given."""
    K, n = log_probs.shape
    regret = np.zeros((len(seeds), len(grid)))
    pseudo = np.zeros_like(regret)
    tracked = np.zeros((len(seeds), len(grid), 0 if track is None else len(track)))
    for i, seed in enumerate(seeds):
        rng = Stream(seed)
        theta = np.zeros(n)
        seen = []
        loss = pseudo_sum = 0.0
        for t in range(1, grid[-1] + 1):
            log_q = theta - logsumexp(theta)
            q = np.exp(log_q)
            if track is not None and t in grid:
                tracked[i, list(grid).index(t)] = q[track]
            if feedback == 0:
                target = log_probs[(t - 1) % K]
            elif feedback == 1:
                target = log_probs[_pick(teacher_cdf, rng.uniform())]
            else:
                target = pooled
            loss += np.sum(q * (log_q - target))
            pseudo_sum += np.sum(q * (log_q - log_target))
            eta = [1.0 / t, eta0, eta0 / math.sqrt(t), 1.0 / (t + 1)][schedule]
            theta = (1 - eta) * theta + eta * target
            seen.append(target)
            if t in grid:
                g = list(grid).index(t)
                regret[i, g] = loss + t * logsumexp(np.mean(seen, axis=0))
                pseudo[i, g] = pseudo_sum
    return (regret, pseudo) if track is None else (regret, pseudo, tracked)


def soft_policy(next_state, reward, horizon):
    """ln q[h, s, a] = reward + V[h+1, next] - V[h, s], the soft-optimal policy; (H, S, n)."""
    S, n = next_state.shape
    value = np.zeros((horizon + 1, S))
    log_q = np.zeros((horizon, S, n))
    ended = next_state < 0
    for h in range(horizon - 1, -1, -1):
        row = reward + np.where(ended, 0.0, value[h + 1][np.where(ended, 0, next_state)])
        value[h] = logsumexp(row, axis=1)
        log_q[h] = row - value[h][:, None]
    return log_q, value


def occupancy(next_state, start, log_q):
    """occ[h, s] under the policy exp(log_q) (H, S, n); (H, S)."""
    horizon, S, n = log_q.shape
    occ = np.zeros((horizon, S))
    occ[0, start] = 1.0
    for h in range(horizon - 1):
        flow = occ[h][:, None] * np.exp(log_q[h])
        for s in range(S):
            for a in range(n):
                if next_state[s, a] >= 0:
                    occ[h + 1, next_state[s, a]] += flow[s, a]
    return occ


def rkl_sequence(next_state, start, horizon, log_probs, teacher_cdf, log_g, log_l, mode, seeds, grid, track=None):
    """On-policy plug-in learner on finite-state teachers; returns (regret, pseudo, token), (R, G), and
    (R, G, P) q_t(track | h = 0, start) when ``track`` is given."""
    S, n = next_state.shape
    K = log_probs.shape[0]
    out = np.zeros((3, len(seeds), len(grid)))
    tracked = np.zeros((len(seeds), len(grid), 0 if track is None else len(track)))
    for i, seed in enumerate(seeds):
        rng = Stream(seed)
        revealed = [[[] for _ in range(n)] for _ in range(S)]
        n_teacher = np.zeros(K)
        sums = np.zeros(3)
        for t in range(1, grid[-1] + 1):
            rhat = np.array([[np.mean(revealed[s][a]) if revealed[s][a] else 0.0 for a in range(n)]
                             for s in range(S)])
            if mode == 0:
                log_q = soft_policy(next_state, rhat, horizon)[0]
            else:
                log_q = np.broadcast_to(rhat - logsumexp(rhat, axis=1, keepdims=True), (horizon, S, n))
            if track is not None and t in grid:
                tracked[i, list(grid).index(t)] = np.exp(log_q[0, start, track])
            k = _pick(teacher_cdf, rng.uniform())
            n_teacher[k] += 1
            flow = occupancy(next_state, start, log_q)[:, :, None] * np.exp(log_q)
            sums += [np.sum(flow * (log_q - log_probs[k])), np.sum(flow * (log_q - log_g)),
                     np.sum(flow * (log_q - log_l))]
            s = start
            for h in range(horizon):
                a = _pick(np.cumsum(np.exp(log_q[h, s])), rng.uniform())
                revealed[s][a].append(log_probs[k, s, a])
                s = next_state[s, a]
                if s < 0:
                    break
            if t in grid:
                g = list(grid).index(t)
                keep = n_teacher > 0
                reward = np.tensordot(n_teacher[keep] / t, log_probs[keep], axes=1)
                log_z0 = soft_policy(next_state, reward, horizon)[1][0, start]
                out[:, i, g] = sums + [t * log_z0, 0.0, 0.0]
    return (out[0], out[1], out[2]) if track is None else (out[0], out[1], out[2], tracked)


def project_a_norm(a_mat, y, radius):
    """argmin_{|x| <= radius} (x - y)^T A (x - y): inside the ball y; outside (A + mu I)^{-1} A y with
    |x| = radius, mu found by a root finder (brentq on ln mu)."""
    from scipy.optimize import brentq
    if np.linalg.norm(y) <= radius:
        return y.copy()
    def excess(log_mu):
        return np.linalg.norm(np.linalg.solve(a_mat + math.exp(log_mu) * np.eye(len(y)), a_mat @ y)) - radius
    log_mu = brentq(excess, -60.0, 60.0, xtol=1e-14, rtol=1e-15)
    return np.linalg.solve(a_mat + math.exp(log_mu) * np.eye(len(y)), a_mat @ y)


def loglinear(features, log_probs, teacher_cdf, pooled, on_policy, update, lam, eta0, radius, gamma, eps, seeds,
              grid):
    """Log-linear student, the five update rules; returns (loss (R, G), counts (R, G, X, n), theta (R, G, d))."""
    X, n, d = features.shape
    loss_out = np.zeros((len(seeds), len(grid)))
    counts_out = np.zeros((len(seeds), len(grid), X, n), np.int64)
    theta_out = np.zeros((len(seeds), len(grid), d))
    for i, seed in enumerate(seeds):
        rng = Stream(seed)
        theta = np.zeros(d)
        a_mat = (eps if update == 1 else lam) * np.eye(d)
        counts = np.zeros((X, n), np.int64)
        loss = 0.0
        for t in range(1, grid[-1] + 1):
            ctx = min(int(rng.uniform() * X), X - 1)
            logits = features[ctx] @ theta
            log_q = logits - logsumexp(logits)
            q = np.exp(log_q)
            phi_bar = q @ features[ctx]
            if on_policy:
                diff = log_q - pooled[ctx]
                f = q @ diff
                grad = (q * diff) @ (features[ctx] - phi_bar) + lam * theta
                y = 0
            else:
                k = _pick(teacher_cdf, rng.uniform())
                y = _pick(np.cumsum(np.exp(log_probs[k, ctx])), rng.uniform())
                f = -log_q[y]
                grad = phi_bar - features[ctx, y] + lam * theta
            loss += f + 0.5 * lam * theta @ theta
            counts[ctx, y] += 1
            if update in (1, 2):
                a_mat += np.outer(grad, grad) + (lam * np.eye(d) if update == 2 else 0.0)
                theta = theta - np.linalg.solve(a_mat, grad) / gamma
                if update == 1:
                    theta = project_a_norm(a_mat, theta, radius)
            elif update in (0, 4):
                theta = theta - grad * (1.0 / (lam * t) if update == 0 else eta0)
            if update != 1 and np.linalg.norm(theta) > radius:
                theta *= radius / np.linalg.norm(theta)
            if t in grid:
                g = list(grid).index(t)
                loss_out[i, g] = loss
                counts_out[i, g] = counts
                theta_out[i, g] = theta
    return loss_out, counts_out, theta_out
