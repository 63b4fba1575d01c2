"""numba kernels of the regret sims (docs/theory.md section 3): plain arrays in, arrays out, log space.

One kernel per learner family, ``prange`` over independent seeds; each seed draws its own uniforms
from a splitmix64 stream started at an integer seed, so a seed's result does not depend on the
thread that ran it. No validation here: ``learners/online.py`` validates and prepares the tables.
Every kernel has a slow NumPy twin in ``_reference.py`` (same stream, same numbers).

Outputs are written at the rounds listed in ``grid`` (sorted, 1-based, last entry = n_rounds).
"""

import math

import numpy as np
from numba import njit, prange

from aggregation.jit import exp_parts, logsumexp_row, soft_value

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_TO_UNIT = 1.0 / 9007199254740992.0          # 2^-53


@njit(cache=True, inline="always")
def _draw(x):
    """One splitmix64 step: new state and a uniform in [0, 1) from its top 53 bits."""
    x = x + _GOLDEN
    z = x
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    return x, np.float64(z >> np.uint64(11)) * _TO_UNIT


@njit(cache=True, inline="always")
def _pick(cdf, u):
    """Smallest a with u < cdf[a] (the last index if rounding leaves u >= cdf[-1])."""
    n = cdf.shape[0]
    a = 0
    while a < n - 1 and u >= cdf[a]:
        a += 1
    return a


# ----------------------------------------------------------------------------------------------
# Off-policy: add-beta estimators per state (one context = one state, horizon 1)
# ----------------------------------------------------------------------------------------------
@njit(cache=True, parallel=True, error_model="numpy")
def add_beta_kernel(next_state, start, horizon, alias_prob, alias_index, teacher_cdf, joint, neg_entropy, log_num, log_den,
                    forced, seeds, grid, regret_out, pseudo_out, track, track_out):
    """Add-beta per state on teacher-sampled responses (log loss, FKL).

    q_t(a | s) = (N_t(s, a) + beta) / (N_t(s) + n beta); loss -ln q_t(y_t) = sum_h -ln q_t(y_h | s_h).
    regret_T = sum_t -ln q_t(y_t) + sum_{s,a} N(s,a) ln(N(s,a) / N(s))  (best per-state model);
    pseudo_T = sum_t [neg_entropy - sum_{s,a} joint[s,a] ln q_t(a|s)]  (= sum_t KL(A_seq || q_t) on a
    prefix tree, joint = the mixture's probability of emitting a in s).

    next_state (S, n); alias_prob, alias_index (K, S, n): Walker alias tables of the teachers' rows
    (one uniform per token: j = floor(n u), token j if frac(n u) < alias_prob else alias_index);
    teacher_cdf (K,);
    log_num[j] = ln(j + beta), log_den[j] = ln(j + n beta); forced (T,) tokens replacing the samples
    when non-empty (one state, horizon 1); seeds (R,) uint64; grid (G,); outputs (R, G).
    track (P,) tokens (P = 0: none): track_out[i, g, j] = q_t(track[j] | start) at t = grid[g], the prediction
    committed at that round (before its feedback); track_out (R, G, P).
    """
    S, n = next_state.shape
    n_rounds = grid[-1]
    use_forced = forced.shape[0] > 0
    mass = joint.sum(axis=1)
    for i in prange(seeds.shape[0]):
        x = seeds[i]
        counts = np.zeros((S, n), np.int64)
        totals = np.zeros(S, np.int64)
        expected = 0.0                                   # sum_{s,a} joint ln q_t(a|s)
        for s in range(S):
            expected += mass[s] * (log_num[0] - log_den[0])
        loss = 0.0
        pseudo = 0.0
        g = 0
        for t in range(1, n_rounds + 1):
            if t == grid[g]:
                for j in range(track.shape[0]):
                    track_out[i, g, j] = math.exp(log_num[counts[start, track[j]]] - log_den[totals[start]])
            pseudo += neg_entropy - expected
            k = 0
            if teacher_cdf.shape[0] > 1:
                x, u = _draw(x)
                k = _pick(teacher_cdf, u)
            s = start
            for h in range(horizon):
                if use_forced:
                    a = forced[t - 1]
                else:
                    x, u = _draw(x)
                    un = u * n
                    j = min(int(un), n - 1)
                    a = j if un - j < alias_prob[k, s, j] else alias_index[k, s, j]
                c = counts[s, a]
                m = totals[s]
                loss += log_den[m] - log_num[c]
                expected += joint[s, a] * (log_num[c + 1] - log_num[c]) - mass[s] * (log_den[m + 1] - log_den[m])
                counts[s, a] = c + 1
                totals[s] = m + 1
                s = next_state[s, a]
                if s < 0:
                    break
            if t == grid[g]:
                best = 0.0
                for s2 in range(S):
                    for a2 in range(n):
                        c2 = counts[s2, a2]
                        if c2 > 0:
                            best += c2 * math.log(c2 / totals[s2])
                regret_out[i, g] = loss + best
                pseudo_out[i, g] = pseudo
                g += 1


# ----------------------------------------------------------------------------------------------
# On-policy, one context: follow-the-leader / exponentiated gradient on RKL
# ----------------------------------------------------------------------------------------------
@njit(cache=True, parallel=True, error_model="numpy", fastmath={"reassoc", "contract"})
def rkl_tabular_kernel(log_probs, teacher_cdf, pooled, log_target, feedback, schedule, eta0, seeds, grid,
                       regret_out, pseudo_out, track, track_out):
    """Exponentiated gradient on f_t(q) = KL(q || p_{k_t}) in logits, q_t = softmax(theta_t).

    theta_{t+1} = (1 - eta_t) theta_t + eta_t ln p_{k_t}, theta_1 = 0; schedule 0: eta_t = 1/t (this
    is follow-the-leader, theta_{t+1} = mean_{s<=t} ln p_{k_s}), 1: eta0, 2: eta0/sqrt(t), 3: 1/(t+1).
    feedback 0: k_t = (t-1) mod K (alternating), 1: k_t ~ w (teacher_cdf), 2: full, the loss
    sum_k w_k KL(q || p_k) whose target is ``pooled`` = sum_k w_k ln p_k.
    regret_T = sum_t f_t(q_t) + T logsumexp(mean_t ln p_{k_t})   (best fixed q in hindsight);
    pseudo_T = sum_t KL(q_t || G), G = exp(log_target) the w-geometric pool.

    log_probs (K, n); pooled (n,); log_target (n,); seeds (R,) uint64; outputs (R, G).
    track (P,) tokens (P = 0: none): track_out[i, g, j] = q_t(track[j]) at t = grid[g] (before the update);
    (R, G, P).
    """
    K, n = log_probs.shape
    n_rounds = grid[-1]
    rows = np.empty((K + 1, n))                          # the teachers, then the full-feedback target
    rows[:K] = log_probs
    rows[K] = pooled
    for i in prange(seeds.shape[0]):
        x = seeds[i]
        theta = np.zeros(n)
        q = np.empty(n)
        bits_a = np.empty(n, np.int64)
        bits_b = np.empty(n, np.int64)
        fa = bits_a.view(np.float64)
        fb = bits_b.view(np.float64)
        total = np.zeros(n)
        mean = np.empty(n)
        loss = 0.0
        comp = 0.0                                       # Kahan compensation of loss
        pseudo = 0.0
        g = 0
        for t in range(1, n_rounds + 1):
            # the revealed row of ``rows`` (indexed, not sliced: a slice per round costs a refcount)
            if feedback == 0:
                k = (t - 1) % K
            elif feedback == 1:
                x, u = _draw(x)
                k = _pick(teacher_cdf, u)
            else:
                k = K
            # one exp per token and one log per round: q = e / s, ln q = theta - m - ln s
            top = 0
            for a in range(1, n):
                if theta[a] > theta[top]:
                    top = a
            m = theta[top]
            s = 0.0
            if n < 4:                                    # scalar exp, skipping exp(0) at the top token
                for a in range(n):
                    q[a] = 1.0 if a == top else math.exp(theta[a] - m)
                    s += q[a]
            else:                                        # vectorised exp (math.exp is a scalar call)
                for a in range(n):
                    q[a] = theta[a] - m
                exp_parts(q, bits_a, bits_b)
                for a in range(n):
                    q[a] = q[a] * fa[a] * fb[a]
                    s += q[a]
            # f = KL(q || revealed) and kl = KL(q || G) share E_q[theta] - ln(sum exp theta)
            inv = 1.0 / s
            e_theta = 0.0
            e_rev = 0.0
            e_target = 0.0
            for a in range(n):                           # theta, rows finite: no 0 * inf here
                qa = q[a] * inv
                e_theta += qa * theta[a]
                e_rev += qa * rows[k, a]
                e_target += qa * log_target[a]
            neg_entropy = e_theta - m - math.log(s)
            f = neg_entropy - e_rev
            kl = neg_entropy - e_target
            y = f - comp
            s_ = loss + y
            comp = (s_ - loss) - y
            loss = s_
            pseudo += kl
            if schedule == 0:
                eta = 1.0 / t
            elif schedule == 1:
                eta = eta0
            elif schedule == 2:
                eta = eta0 / math.sqrt(t)
            else:
                eta = 1.0 / (t + 1.0)
            for a in range(n):
                total[a] += rows[k, a]
                theta[a] = (1.0 - eta) * theta[a] + eta * rows[k, a]
            if t == grid[g]:
                for a in range(n):
                    mean[a] = total[a] / t
                regret_out[i, g] = loss + t * logsumexp_row(mean)
                pseudo_out[i, g] = pseudo
                for j in range(track.shape[0]):          # q, inv still hold this round's q_t
                    track_out[i, g, j] = q[track[j]] * inv
                g += 1


# ----------------------------------------------------------------------------------------------
# On-policy, finite-state teachers: the student sees teachers only on its own rollouts
# ----------------------------------------------------------------------------------------------
@njit(cache=True, parallel=True, error_model="numpy")
def rkl_sequence_kernel(next_state, start, horizon, log_probs, teacher_cdf, log_g, log_l, mode, seeds, grid,
                        regret_out, pseudo_out, token_out, track, track_out):
    """Plug-in on-policy learner with sample feedback on finite-state teachers (theory section 2, 3).

    Round t: k_t ~ w; the student rolls out y ~ q_t; teacher k_t reveals ln p_{k_t}(y_h | s_h) of the
    student's tokens only; rhat(s, a) is the running mean of what was revealed at (s, a) (0 before,
    i.e. optimistic). mode 0 (sequence-level RKL): q_t is soft-optimal for rhat,
    ln q(a|h,s) = rhat(s,a) + V[h+1, next] - V[h, s], V = soft values (reward-to-go); mode 1
    (per-token RKL, discount 0): q_t(a|s) ∝ exp rhat(s, a).
    regret_T = sum_t KL_seq(q_t || p_{k_t}) + T ln Z_emp (weights = empirical teacher frequencies);
    pseudo_T = sum_t KL_seq(q_t || G_seq) with log_g (H, S, n); token_T = sum_t sum_{h,s} occ_{q_t}(h, s)
    KL(q_t(.|h,s) || l(.|s)) with log_l (S, n). Outputs (R, G).
    track (P,) tokens (P = 0: none): track_out[i, g, j] = q_t(track[j] | h = 0, start) at t = grid[g], the
    first-token probability of the policy rolled out in that round; (R, G, P).
    """
    S, n = next_state.shape
    K = log_probs.shape[0]
    n_rounds = grid[-1]
    for i in prange(seeds.shape[0]):
        x = seeds[i]
        rhat = np.zeros((S, n))
        seen = np.zeros((S, n), np.int64)
        n_teacher = np.zeros(K, np.int64)
        value = np.zeros((horizon + 1, S))
        log_q = np.zeros((horizon, S, n))
        occ = np.zeros(S)
        nxt = np.zeros(S)
        reward = np.empty((S, n))
        log_z = np.zeros((horizon + 1, S))
        loss = 0.0
        pseudo = 0.0
        token = 0.0
        g = 0
        for t in range(1, n_rounds + 1):
            # the student's policy for this round
            if mode == 0:                                # soft-optimal for rhat (theory section 2)
                for h in range(horizon - 1, -1, -1):
                    for s in range(S):
                        v = soft_value(next_state, rhat, value[h + 1], s)
                        value[h, s] = v
                        for a in range(n):
                            s2 = next_state[s, a]
                            log_q[h, s, a] = rhat[s, a] + (value[h + 1, s2] if s2 >= 0 else 0.0) - v
            else:
                for s in range(S):
                    v = logsumexp_row(rhat[s])
                    for a in range(n):
                        log_q[0, s, a] = rhat[s, a] - v
                for h in range(1, horizon):
                    log_q[h] = log_q[0]
            if t == grid[g]:
                for j in range(track.shape[0]):
                    track_out[i, g, j] = math.exp(log_q[0, start, track[j]])
            x, u = _draw(x)
            k = _pick(teacher_cdf, u)
            n_teacher[k] += 1
            # exact losses of q_t by the forward recursion over its occupancy
            occ[:] = 0.0
            occ[start] = 1.0
            for h in range(horizon):
                nxt[:] = 0.0
                for s in range(S):
                    o = occ[s]
                    if o == 0.0:
                        continue
                    for a in range(n):
                        lq = log_q[h, s, a]
                        qa = math.exp(lq)
                        if qa == 0.0:
                            continue
                        w = o * qa
                        loss += w * (lq - log_probs[k, s, a])
                        pseudo += w * (lq - log_g[h, s, a])
                        token += w * (lq - log_l[s, a])
                        s2 = next_state[s, a]
                        if s2 >= 0:
                            nxt[s2] += w
                occ[:] = nxt
            # the rollout and its feedback
            s = start
            for h in range(horizon):
                x, u = _draw(x)
                acc = 0.0
                a = n - 1
                for b in range(n):
                    acc += math.exp(log_q[h, s, b])
                    if u < acc:
                        a = b
                        break
                c = seen[s, a] + 1
                seen[s, a] = c
                rhat[s, a] += (log_probs[k, s, a] - rhat[s, a]) / c
                s = next_state[s, a]
                if s < 0:
                    break
            if t == grid[g]:
                for s in range(S):
                    for a in range(n):
                        acc = 0.0
                        for kk in range(K):
                            if n_teacher[kk] > 0:
                                acc += n_teacher[kk] / t * log_probs[kk, s, a]
                        reward[s, a] = acc
                for h in range(horizon - 1, -1, -1):
                    for s in range(S):
                        log_z[h, s] = soft_value(next_state, reward, log_z[h + 1], s)
                regret_out[i, g] = loss + t * log_z[0, start]
                pseudo_out[i, g] = pseudo
                token_out[i, g] = token
                g += 1


@njit(cache=True, inline="always")
def _cholesky_solve(a, b, chol, out):
    """out = a^{-1} b for a symmetric positive definite (d, d) a; chol: (d, d) scratch."""
    d = a.shape[0]
    for j in range(d):
        acc = a[j, j]
        for l in range(j):
            acc -= chol[j, l] * chol[j, l]
        chol[j, j] = math.sqrt(acc)
        for i in range(j + 1, d):
            acc = a[i, j]
            for l in range(j):
                acc -= chol[i, l] * chol[j, l]
            chol[i, j] = acc / chol[j, j]
    for i in range(d):                                   # forward: L z = b
        acc = b[i]
        for l in range(i):
            acc -= chol[i, l] * out[l]
        out[i] = acc / chol[i, i]
    for i in range(d - 1, -1, -1):                       # backward: L^T out = z
        acc = out[i]
        for l in range(i + 1, d):
            acc -= chol[l, i] * out[l]
        out[i] = acc / chol[i, i]


# ----------------------------------------------------------------------------------------------
# Function approximation: log-linear student, off-policy log loss or on-policy RKL, five update rules
# ----------------------------------------------------------------------------------------------
@njit(cache=True)
def project_a_norm(a_mat, y, radius, out):
    """out = argmin_{|x| <= radius} (x - y)^T A (x - y), the generalised projection of online Newton
    step (Hazan, Agarwal and Kale 2007). Inside the ball x = y; outside, x = (A + mu I)^{-1} A y with
    the mu > 0 at which |x| = radius, found by bisection on ln mu in the eigenbasis of A."""
    d = y.shape[0]
    norm = 0.0
    for j in range(d):
        norm += y[j] * y[j]
    if norm <= radius * radius:
        out[:] = y
        return
    lam, vec = np.linalg.eigh(a_mat)
    z = vec.T @ y
    lo, hi = -60.0, 60.0                                 # ln mu: |x(mu)| falls from |y| to 0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        mu = math.exp(mid)
        acc = 0.0
        for j in range(d):
            c = lam[j] * z[j] / (lam[j] + mu)
            acc += c * c
        if acc > radius * radius:
            lo = mid
        else:
            hi = mid
    mu = math.exp(hi)
    for j in range(d):
        z[j] = lam[j] * z[j] / (lam[j] + mu)
    out[:] = vec @ z


@njit(cache=True, parallel=True, error_model="numpy")
def loglinear_kernel(features, log_probs, teacher_cdf, pooled, on_policy, update, lam, eta0, radius, gamma, eps,
                     seeds, grid, loss_out, counts_out, theta_out):
    """Log-linear student q_theta(a|x) ∝ exp(theta . phi(x, a)), contexts x ~ uniform (theory section 3).

    Loss f_t (+ lam/2 |theta|^2 in both): on_policy 0, the log loss -ln q(y_t|x_t) on y_t ~ p_{k_t};
    1, sum_k w_k KL(q(.|x_t) || p_k(.|x_t)) with gradient E_q[(ln q - r)(phi - E_q phi)], r = pooled.
    update 0: OGD, eta_t = 1/(lam t); 1: online Newton step (HAK 2007), A_t = eps I + sum_{s<=t} g_s g_s^T,
    theta <- Pi^{A_t}(theta - A_t^{-1} g_t / gamma) with the generalised projection; 2: Newton-style
    variant, A_t = lam I + sum_{s<=t} (g_s g_s^T + lam I), theta <- theta - A_t^{-1} g_t / gamma, Euclidean
    projection; 3: frozen at theta = 0; 4: OGD with the constant step eta0. OGD iterates are projected
    on |theta| <= radius. features (X, n, d); log_probs (K, X, n); pooled (X, n).
    Outputs at the grid rounds: loss_out (R, G) cumulative loss; counts_out (R, G, X, n) counts of
    (x_t, y_t) (on-policy: y_t = 0) for the comparator; theta_out (R, G, d) the iterate after round t.
    """
    X, n, d = features.shape
    n_rounds = grid[-1]
    for i in prange(seeds.shape[0]):
        x = seeds[i]
        theta = np.zeros(d)
        grad = np.zeros(d)
        mean_phi = np.zeros(d)
        step = np.zeros(d)
        a_mat = np.zeros((d, d))
        chol = np.zeros((d, d))
        for j in range(d):
            a_mat[j, j] = eps if update == 1 else lam
        logits = np.empty(n)
        counts = np.zeros((X, n), np.int64)
        loss = 0.0
        g = 0
        for t in range(1, n_rounds + 1):
            x, u = _draw(x)
            ctx = min(int(u * X), X - 1)
            for a in range(n):
                acc = 0.0
                for j in range(d):
                    acc += theta[j] * features[ctx, a, j]
                logits[a] = acc
            z = logsumexp_row(logits)
            sq = 0.0
            for j in range(d):
                sq += theta[j] * theta[j]
                mean_phi[j] = 0.0
            for a in range(n):
                qa = math.exp(logits[a] - z)
                for j in range(d):
                    mean_phi[j] += qa * features[ctx, a, j]
            if on_policy:
                f = 0.0
                for j in range(d):
                    grad[j] = lam * theta[j]
                for a in range(n):
                    lq = logits[a] - z
                    qa = math.exp(lq)
                    diff = lq - pooled[ctx, a]
                    f += qa * diff
                    for j in range(d):
                        grad[j] += qa * diff * (features[ctx, a, j] - mean_phi[j])
                y = 0
            else:
                x, u = _draw(x)
                k = _pick(teacher_cdf, u)
                x, u = _draw(x)
                y = n - 1
                acc = 0.0
                for a in range(n):
                    acc += math.exp(log_probs[k, ctx, a])
                    if u < acc:
                        y = a
                        break
                f = z - logits[y]
                for j in range(d):
                    grad[j] = mean_phi[j] - features[ctx, y, j] + lam * theta[j]
            loss += f + 0.5 * lam * sq
            counts[ctx, y] += 1
            if update == 1 or update == 2:
                for j in range(d):
                    for l in range(d):
                        a_mat[j, l] += grad[j] * grad[l]
                    if update == 2:
                        a_mat[j, j] += lam
                _cholesky_solve(a_mat, grad, chol, step)
                for j in range(d):
                    step[j] = theta[j] - step[j] / gamma
                if update == 1:
                    project_a_norm(a_mat, step, radius, theta)
                else:
                    theta[:] = step
            elif update != 3:
                eta = 1.0 / (lam * t) if update == 0 else eta0
                for j in range(d):
                    theta[j] -= eta * grad[j]
            if update != 1:
                norm = 0.0
                for j in range(d):
                    norm += theta[j] * theta[j]
                norm = math.sqrt(norm)
                if norm > radius:
                    for j in range(d):
                        theta[j] *= radius / norm
            if t == grid[g]:
                loss_out[i, g] = loss
                counts_out[i, g] = counts
                theta_out[i, g] = theta
                g += 1
