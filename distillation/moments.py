"""Exact moments of the sampled-token KL estimators of theory section 4 (the library behind sims/estimators.py).

For x ~ s, r = ln p(x) - ln q(x): k1 = -r, k2 = r^2 / 2, k3 = (e^r - 1) - r.

    value_moments          E and Var of k1, k2, k3 under x ~ q (bias against KL(q || p))
    gradient_moments       the expected gradient (w.r.t. the student's logits) of an estimator used as a
                           loss or a reward, on samples from the student or a teacher, with or without
                           importance weights, and the trace of its per-sample covariance
    samples_needed         how many samples bring the Monte-Carlo gradient within a relative error
    sequence_is_second_moment   E_p[w^2] for the sequence-level importance weight w = prod_h q / p
    topk_k3_bias           E_q[k3] when q samples only its top k: KL(q || p) - p(V \\ S)
"""

import numpy as np
from scipy.special import logsumexp

ESTIMATORS = ("k1", "k2", "k3")


def estimator_values(r):
    """k1, k2, k3 at log-ratios r = ln p(x) - ln q(x) (any shape)."""
    return {"k1": -r, "k2": 0.5 * r * r, "k3": np.expm1(r) - r}


def estimator_derivatives(r):
    """dk/dr of k1, k2, k3 at log-ratios r."""
    return {"k1": -np.ones_like(r), "k2": r, "k3": np.expm1(r)}


def value_moments(log_q, log_p):
    """{estimator: (mean, variance)} of k(r) under x ~ q, exactly (a sum over the vocabulary); the KL
    KL(q || p) is the mean of k1 and of k3 (theory section 4). log_q, log_p: (n,)."""
    q = np.exp(log_q)
    r = log_p - log_q
    out = {}
    for name, k in estimator_values(r).items():
        mean = float(q @ k)
        out[name] = (mean, float(q @ (k - mean) ** 2))
    return out


def gradient_moments(log_q, log_p, estimator, mode="loss", source="student", importance=False):
    """Expected gradient of one estimator configuration w.r.t. the student's logits, and the trace of
    the per-sample gradient's covariance, exactly.

    A sample x ~ s (s = q for 'student', p for 'teacher') with weight c = q(x) / s(x) (``importance``)
    or 1 has gradient c(x) phi(x) (e_x - q), phi = -k'(r) for a loss (differentiated through ln q) and
    phi = k(r) for a reward (the detached value times the score). Returns (mean (n,), trace of Cov)."""
    q, p = np.exp(log_q), np.exp(log_p)
    s, log_s = (q, log_q) if source == "student" else (p, log_p)
    r = log_p - log_q
    phi = -estimator_derivatives(r)[estimator] if mode == "loss" else estimator_values(r)[estimator]
    c = np.exp(log_q - log_s) if importance else np.ones_like(q)
    coef = s * c * phi                                         # E[g] = sum_x s c phi (e_x - q)
    mean = coef - q * coef.sum()
    sq_norm = 1.0 - 2.0 * q + q @ q                            # |e_x - q|^2
    second = float(np.sum(s * (c * phi) ** 2 * sq_norm))
    return mean, max(second - float(mean @ mean), 0.0)


def samples_needed(mean, trace, target, rel_error=0.1):
    """Samples for the Monte-Carlo mean gradient to be within ``rel_error`` of ``target`` in expectation
    (root mean square): (|mean - target|^2 + trace / N) <= rel_error^2 |target|^2; inf when the bias
    alone exceeds it."""
    bias2 = float(np.sum((mean - target) ** 2))
    budget = rel_error ** 2 * float(target @ target) - bias2
    return float("inf") if budget <= 0 else max(1.0, trace / budget)


def sequence_is_second_moment(next_state, start, horizon, log_q, log_p):
    """E_{y ~ p}[w(y)^2] for the sequence-level importance weight w = prod_h q(y_h|s_h) / p(y_h|s_h) of
    responses of ``horizon`` tokens on a machine (next_state (S, n), -1 ends), student q and teacher p
    given as state tables (S, n) log-probs: sum_y q(y)^2 / p(y), by a forward recursion with the
    unnormalised rows q^2 / p (so Var w = E w^2 - 1 grows like exp(H D_2(q || p)), D_2 the order-2 Renyi
    divergence per step). Returns (horizon + 1,) ln E[w^2] after each number of tokens."""
    rows = np.exp(2 * log_q - log_p)                           # (S, n)
    S, n = rows.shape
    mass = np.zeros(S)
    mass[start] = 1.0
    ended, log_scale = 0.0, 0.0                                # mass is kept scaled: true = mass e^log_scale
    out = [0.0]
    for _ in range(horizon):
        nxt = np.zeros(S)
        for s in range(S):
            for a in range(n):
                s2 = next_state[s, a]
                if s2 >= 0:
                    nxt[s2] += mass[s] * rows[s, a]
                else:
                    ended += mass[s] * rows[s, a]
        c = max(nxt.max(), ended, 1e-300)
        mass, ended, log_scale = nxt / c, ended / c, log_scale + np.log(c)
        out.append(float(np.log(mass.sum() + ended) + log_scale))
    return np.array(out)


def topk_k3_bias(log_q, log_p, k):
    """(E_q~[k3], KL(q~ || p), p(V \\ S)) for the student restricted to its top-k tokens S (q~ = q
    renormalised on S): theory section 4's E_q~[k3] = KL(q~ || p) - p(V \\ S), since sum_{x in S} p(x) != 1."""
    top = np.argsort(-log_q)[:k]
    lq = log_q[top] - logsumexp(log_q[top])
    r = log_p[top] - lq
    q = np.exp(lq)
    return float(q @ (np.expm1(r) - r)), float(q @ -r), float(1.0 - np.exp(logsumexp(log_p[top])))
