"""Where each distillation objective drives a student that can represent every state: its target or its
derived fixed point, at every (step, state) of a finite-state task (theory section 2, 4, 5).

    fkl         forward KL with the teachers' full conditionals       target: A = sum_k w_k p_k (every state)
    sft         cross-entropy on a sampled teacher token              target: sft_fixed_point(alpha)
    rkl         reverse KL with the full conditionals                 target: l
    k1, k2, k3  the estimator on the pooled log-ratio, as a loss      k1: none (no drift); k2, k3: l
    k3-teacher  k3 on one sampled teacher's log-ratio (routed)        target: A
    pg0, pg1    on-policy RKL policy gradient, gamma = 0 / 1          l / g (the conditionals of G_seq)

on student samples; teacher samples shift some of these (the k-estimators without importance weights,
solved by ``estimator_fixed_point``) and make k1 diverge.
"""

import numpy as np

import aggregation as ag
from aggregation.pools import log_softmax

from .moments import estimator_derivatives


TARGET_OF = {"fkl": "arithmetic", "sft": "sft", "rkl": "local", "k1": None, "k2": "local", "k3": "local",
             "k3-teacher": "arithmetic", "pg0": "local", "pg1": "geometric"}


OBJECTIVES = tuple(TARGET_OF)


TARGETS = ("arithmetic", "local", "geometric", "mixture")


def target_table(task, name, alpha=None):
    """The target conditionals (H, S, n) (log-probs) that a loss reaches at every step and state:
    'arithmetic' sum_k w_k p_k, 'local' l, 'geometric' g, 'mixture' the sequence-level mixture's
    conditionals (posterior weights: what SFT on teacher rollouts reaches, alpha = 0), 'sft' the SFT fixed
    point at ``alpha``."""
    if name in TARGETS[:3]:
        return np.array(ag.target_log_probs(task.teachers, task.weights, task.horizon, name))
    if name == "mixture":
        return sft_fixed_point(task, 0.0)
    if name == "sft":
        return sft_fixed_point(task, alpha)
    raise ValueError(f"target = {name!r} must be one of {TARGETS + ('sft',)}")


def sft_fixed_point(task, alpha):
    """The fixed point of SFT (cross-entropy on a sampled teacher token) when a sequence comes from the
    student with probability alpha and from teacher k ~ w otherwise, every token of a teacher's sequence
    labelled by that teacher and every student token by a teacher k ~ w (theory section 2, 5).

    At step h and state s the labels are drawn from (1 - alpha) sum_k w_k d_k(h, s) p_k(.|s) + alpha
    d_q(h, s) A(.|s), d the occupancies: the teacher rollouts carry posterior weights (the sequence-level
    mixture's conditionals, the fixed point at alpha = 0) and the student's carry the prior weights
    (A, the fixed point at alpha = 1). q's own occupancy d_q depends on q at earlier steps only, so the
    fixed point is solved forward in h. Returns (H, S, n) log-probs; states no sequence reaches get A.
    """
    t, w, H = task.teachers, task.weights, task.horizon
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha = {alpha!r} must lie in [0, 1]")
    p = np.exp(t.log_probs)                                                   # (K, S, n)
    A = np.tensordot(w, p, axes=1)
    occ_k = np.stack([ag.state_occupancy(t, None, H, target=k) for k in range(t.K)])  # (K, H + 1, S)
    out = np.empty((H, t.S, t.n))
    d_q = np.zeros(t.S)
    d_q[t.start] = 1.0
    for h in range(H):
        mass = (1 - alpha) * np.einsum("k,ks,ksa->sa", w, occ_k[:, h], p) + alpha * d_q[:, None] * A
        total = mass.sum(axis=1, keepdims=True)
        q = np.where(total > 0, mass / np.where(total > 0, total, 1.0), A)
        out[h] = np.log(q)
        d_q = _step_occupancy(t, d_q, q)
    return out


def estimator_fixed_point(task, objective, alpha, importance=False, tol=1e-11):
    """Where the expected gradient of a sampled-token estimator loss (k2, k3 pooled, k3-teacher routed)
    vanishes at every (step, state), for sequences from the student with probability alpha and from a
    teacher k ~ w otherwise (token-level importance weights q / p_k on the teachers' tokens when
    ``importance``). Returns (H, S, n) log-probs.

    With r = ln P - ln q at the sampled token (P the pooled sum_k w_k ln p_k, or the routed teacher's
    ln p_k) the loss k(r) has logit gradient -k'(r) (e_x - q), so at a state the expected gradient is
    c - q sum(c) with c(x) = -sum_sources mass * sample_prob(x) * weight(x) * k'(r(x)): it vanishes where
    c = q sum(c). Teacher k's sequences reach (h, s) with mass (1 - alpha) w_k d_k(h, s) (its
    occupancy, which does not depend on q) and are routed to k itself; the student's reach it with
    alpha d_q(h, s) and are routed to k ~ w. So the student's own samples give l (k2, k3) or A
    (k3-teacher); importance weights turn a teacher's samples into the student's for pooled losses, but
    k3-teacher keeps the teacher-state correlation (posterior weights: the mixture's conditionals at
    alpha = 0); without weights the teachers' token distribution replaces q (a different point, no closed
    form, and more than one stable point can exist). d_q depends on q at earlier steps only: solved forward
    in h, each step by the gradient flow from uniform logits (where the students start), polished by
    Newton."""
    if objective not in ("k2", "k3", "k3-teacher"):
        raise ValueError(f"objective = {objective!r}: the estimator fixed point is for k2, k3 and k3-teacher")
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha = {alpha!r} must lie in [0, 1]")
    t, w, H = task.teachers, task.weights, task.horizon
    lp = np.asarray(t.log_probs)
    p = np.exp(lp)
    deriv = estimator_derivatives
    est, routed = ("k3", True) if objective == "k3-teacher" else (objective, False)
    pooled = np.tensordot(w, lp, axes=1)                                           # sum_k w_k ln p_k (S, n)
    occ_k = np.stack([ag.state_occupancy(t, None, H, target=k) for k in range(t.K)])  # (K, H + 1, S)
    out = np.empty((H, t.S, t.n))
    d_q = np.zeros(t.S)
    d_q[t.start] = 1.0
    for h in range(H):
        tm = (1 - alpha) * w[:, None] * occ_k[:, h]                                 # (K, S)
        sm = alpha * d_q
        total = tm.sum(0) + sm
        scale = np.where(total > 0, 1.0 / np.where(total > 0, total, 1.0), 0.0)[:, None]

        def expected_gradient(z):
            lq = log_softmax(z)
            q = np.exp(lq)
            r_t = lp - lq if routed else np.broadcast_to(pooled - lq, lp.shape)       # (K, S, n)
            c_t = np.exp(lq - lp) if importance else 1.0
            coef = -np.einsum("ks,ksn->sn", tm, p * c_t * deriv(r_t)[est])
            student = np.tensordot(w, deriv(lp - lq)[est], axes=1) if routed else deriv(pooled - lq)[est]
            coef -= sm[:, None] * q * student
            return (coef - q * coef.sum(1, keepdims=True)) * scale
        z = _stable_zero(expected_gradient, np.zeros((t.S, t.n)), tol,
                         f"estimator_fixed_point({objective}, alpha={alpha}), step {h}")
        lq = log_softmax(z)
        q = np.exp(lq)
        out[h] = lq
        d_q = _step_occupancy(t, d_q, q)
    return out


def _stable_zero(F, z, tol, what, flow_tol=1e-3, max_flow=200_000, max_newton=50, eps=1e-7):
    """A zero of F (z (S, n) logits, F(z) the expected gradient: invariant to adding a constant to a row)
    that gradient descent reaches: the flow z <- z - F(z) until |F| < flow_tol (so a repelling or spurious
    zero is never picked), then Newton steps with a finite-difference Jacobian (the gauge direction pinned
    by adding 11^T / n), each damped row by row (``_damped``), to |F| < tol; where Newton cannot lower a
    row the flow finishes the job. RuntimeError, never a silent value, when neither converges."""
    S, n = z.shape
    G = F(z)
    for _ in range(max_flow):
        if np.abs(G).max() < flow_tol:
            break
        z = z - G
        G = F(z)
    else:
        raise RuntimeError(f"{what}: the gradient flow did not settle (largest gradient {np.abs(G).max():.2g})")
    for _ in range(max_newton):
        if np.abs(G).max() < tol:
            return z
        J = np.stack([(F(z + eps * np.eye(n)[j]) - G) / eps for j in range(n)], axis=-1) + 1.0 / n
        flat = np.abs(J - 1.0 / n).max(axis=(1, 2)) == 0                      # rows no sequence reaches
        J[flat] = np.eye(n)
        step = np.linalg.solve(J, G[..., None])[..., 0]
        z, G, stuck = _damped(F, z, G, step, tol)
        if stuck:                                      # Newton cannot lower some row: finish by the flow
            for _ in range(max_flow):
                if np.abs(G).max() < tol:
                    return z
                z = z - G
                G = F(z)
            break
    raise RuntimeError(f"{what}: Newton did not converge (largest expected gradient {np.abs(G).max():.2g})")


def _damped(F, z, G, step, tol, halvings=30):
    """One damped Newton step, row by row (a row of F depends on its own row of z only): each row takes the
    longest of step, step / 2, ... that lowers its norm and stays finite (a full step can overshoot into
    an overflow of k3's exp). Returns (z, F(z), stuck: some row found no such step)."""
    done = np.abs(G).max(axis=1) < tol
    z_new, G_new = z.copy(), G.copy()
    for damping in 0.5 ** np.arange(halvings):
        with np.errstate(over="ignore", invalid="ignore"):
            trial_z = z - damping * step
            trial = F(trial_z)
        ok = ~done & np.isfinite(trial).all(axis=1) & (np.linalg.norm(trial, axis=1) < np.linalg.norm(G, axis=1))
        z_new[ok], G_new[ok] = trial_z[ok], trial[ok]
        done |= ok
        if done.all():
            break
    return z_new, G_new, not done.all()


def _step_occupancy(t, d, q):
    """One step of the occupancy recursion: d'(s') = sum_{s, a -> s'} d(s) q(a | s)."""
    nxt = np.zeros(t.S)
    ok = t.next_state >= 0
    np.add.at(nxt, t.next_state[ok], (d[:, None] * q)[ok])
    return nxt


def fixed_point(task, config):
    """The derived fixed point (H, S, n) of a tabular student under one ``configs.SpectrumConfig``, or None
    where none is derived: fkl -> A and rkl -> l (any sampling); sft -> :func:`sft_fixed_point`; k2, k3,
    k3-teacher -> :func:`estimator_fixed_point`; pg0 / pg1 on the student's samples (or with the
    sequence-level importance weights) -> l / g. None for k1 (no stable point: its expected gradient on
    the teachers' samples pushes q away from their token distribution), for the policy gradients on
    unweighted teacher samples (the leave-one-out baseline couples the states) and for the switch
    variant of the sampled-token objectives."""
    obj, alpha, switch, importance = config.objective, float(config.alpha), config.switch, config.importance
    if obj in ("fkl", "rkl"):
        return target_table(task, TARGET_OF[obj])
    if switch or obj == "k1":
        return None
    if obj == "sft":
        return sft_fixed_point(task, alpha)
    if obj in ("k2", "k3", "k3-teacher"):
        return estimator_fixed_point(task, obj, alpha, importance)
    return target_table(task, TARGET_OF[obj]) if (importance or alpha == 1.0) else None
