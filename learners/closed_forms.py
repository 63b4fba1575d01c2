"""Closed forms and asymptotic rates of the theory (theory section 1-3): what the sims and the tests compare with.

Regret (theory section 3)        add_beta_constant_sequence, kt_worst_case, laplace_worst_case,
                       add_beta_round_robin, shtarkov_log_complexity, alternating_constant,
                       ftl_constant, full_feedback_regret
Mechanisms (theory section 1-2)  confident_expert_pools, low_prob_weights, low_prob_pools, veto_threshold,
                       first_token_g, prefix_bias_exact, flip_fractions
Rates (theory section 3)         learner_sd, prefix_learner_sd: the asymptotic s.d. of a learned q_T over seeds
"""

import math
import warnings

import numpy as np
from scipy.special import gammaln, logsumexp

import aggregation as ag
from aggregation import examples
from aggregation.validate import check_int

from .names import FTL, KT, ROLLOUT, SEQ_RKL, STATE_KT, TOKEN_RKL


# ------------------------------------------------------------------------------------------------
# regret (theory section 3)
# ------------------------------------------------------------------------------------------------
def add_beta_constant_sequence(T, n, beta):
    """Regret of add-beta on a constant sequence of length T over n symbols:
    ln Γ(T + n beta) - ln Γ(n beta) - ln Γ(T + beta) + ln Γ(beta)."""
    T = np.asarray(T, dtype=float)
    return gammaln(T + n * beta) - gammaln(n * beta) - gammaln(T + beta) + gammaln(beta)


def kt_worst_case(T, n):
    """R_KT(T) = ln Γ(1/2) + ln Γ(T + n/2) - ln Γ(n/2) - ln Γ(T + 1/2) ~ (n-1)/2 ln T (theory section 3)."""
    return add_beta_constant_sequence(T, n, 0.5)


def laplace_worst_case(T, n):
    """Laplace's worst case ln binom(T + n - 1, n - 1) (theory section 3)."""
    T = np.asarray(T, dtype=float)
    return gammaln(T + n) - gammaln(n) - gammaln(T + 1)


def add_beta_round_robin(T, n, beta):
    """Regret of add-beta on the round-robin sequence 0, 1, ..., n-1, 0, ... (counts as equal as possible):
    ln Γ(T + n beta)/Γ(n beta) - sum_a ln Γ(N_a + beta)/Γ(beta) + sum_a N_a ln(N_a / T)."""
    T = np.atleast_1d(np.asarray(T, dtype=np.int64))
    out = gammaln(T + n * beta) - gammaln(n * beta)
    for a in range(n):
        N = (T - a + n - 1) // n
        out = out - (gammaln(N + beta) - gammaln(beta)) + np.where(N > 0, N * np.log(np.maximum(N, 1) / T), 0.0)
    return out


def shtarkov_log_complexity(T, n):
    """ln C_T, Shtarkov's minimax regret for n symbols: C_T(2) = sum_j binom(T, j) (j/T)^j ((T-j)/T)^(T-j),
    then C_T(m) = C_T(m-1) + T/(m-2) C_T(m-2) (Kontkanen and Myllymäki 2007), in log space."""
    T = check_int(T, "T", 1)
    n = check_int(n, "n", 1)
    j = np.arange(T + 1, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = (gammaln(T + 1) - gammaln(j + 1) - gammaln(T - j + 1)
                 + np.where(j > 0, j * np.log(j / T), 0.0) + np.where(j < T, (T - j) * np.log((T - j) / T), 0.0))
    log_c = [0.0, float(logsumexp(terms))]                   # m = 1, 2
    for m in range(3, n + 1):
        log_c.append(float(np.logaddexp(log_c[-1], math.log(T / (m - 2)) + log_c[-2])))
    return log_c[n - 1]


def alternating_constant(e):
    """c = (1/8) ln^2((1 - e)/e): FTL's regret c ln T on alternating teachers (1-e, e), (e, 1-e)."""
    return 0.125 * math.log((1.0 - e) / e) ** 2


def ftl_constant(log_probs, weights):
    """Asymptotic slope of FTL's RKL regret when teachers arrive with frequencies w (i.i.d. or cyclic):
    c = 1/2 sum_k w_k Var_G(ln p_k - r), r = sum_j w_j ln p_j, G the w-geometric pool.

    From R_T = sum_t t KL(q_t || q_{t+1}) and a second-order expansion of the KL in the logits."""
    lp = np.asarray(log_probs, dtype=float)
    w = np.asarray(weights, dtype=float)
    r = w @ lp
    log_g = r - logsumexp(r)
    g = np.exp(log_g)
    dev = lp - r
    var = g @ (dev ** 2).T - (g @ dev.T) ** 2
    return 0.5 * float(w @ var)


def full_feedback_regret(log_probs, weights, schedule, n_rounds, eta0=1.0):
    """Exact regret of exponentiated gradient on RKL with full feedback, for t = 1..n_rounds (theory section 3).

    Every round reveals f(q) = sum_k w_k KL(q || p_k) = KL(q || G) - ln Z, so the best fixed q is G
    and R_T = sum_{t<=T} KL(q_t || G). theta_{t+1} = (1 - eta_t) theta_t + eta_t r with r = sum_k
    w_k ln p_k and theta_1 = 0 gives theta_t = a_t r, 1 - a_t = prod_{s<t} (1 - eta_s), and
    KL(q_t || G) = (a_t - 1) E_{q_t}[r] - lse(a_t r) + lse(r). FTL (eta_1 = 1) reaches G after one
    round: R_T = KL(uniform || G) for every T. Returns (n_rounds,).
    """
    r = np.asarray(weights, dtype=float) @ np.asarray(log_probs, dtype=float)
    t = np.arange(1, n_rounds + 1, dtype=float)
    eta = {"1/t": 1 / t, "1/(t+1)": 1 / (t + 1), "1/sqrt(t)": eta0 / np.sqrt(t),
           "constant": np.full(t.size, float(eta0))}[schedule]
    a = 1 - np.concatenate([[1.0], np.cumprod(1 - eta[:-1])])
    logits = a[:, None] * r[None]
    lse = logsumexp(logits, axis=1)
    q = np.exp(logits - lse[:, None])
    return np.cumsum((a - 1) * (q @ r) - lse + logsumexp(r))


# ------------------------------------------------------------------------------------------------
# mechanisms (theory section 1-2)
# ------------------------------------------------------------------------------------------------
def confident_expert_pools(d, K=2, n=3, expert_weight=None):
    """Top probabilities (A(0), G(0)) of one expert and K - 1 uniform teachers (theory section 1).

    Expert (1 - (n-1) d, d, ..., d), uniform teachers 1/n; weights equal, or ``expert_weight`` for the
    expert and the rest shared. A(0) = sum_k w_k p_k(0); G(0) = prod_k p_k(0)^{w_k} / Z, in which the
    uniform teachers cancel: G ∝ p_expert^{w_expert}.
    """
    p = examples.confident_expert(d, n_uniform=K - 1, n=n)
    if expert_weight is None:
        w = np.full(K, 1.0 / K)
    else:
        w = np.array([expert_weight] + [(1.0 - expert_weight) / (K - 1)] * (K - 1))
    return float(ag.arithmetic_pool(p, w)[0]), float(ag.geometric_pool(p, w)[0])


def low_prob_weights(n_agree=2, veto_weight=None):
    """Equal weights, or ``veto_weight`` on the last teacher and (1 - veto_weight)/n_agree on the others."""
    if veto_weight is None:
        return np.full(n_agree + 1, 1.0 / (n_agree + 1))
    return np.append(np.full(n_agree, (1.0 - veto_weight) / n_agree), veto_weight)


def low_prob_pools(e, n_agree=2, veto_weight=None):
    """(A(0), G(0)) of the low-probability teachers (theory section 1). With two agreeing teachers at w = 1/3,
    G(0) = 1 / (1 + (0.01 (1-e) / (0.81 e))^{1/3}), and G(0) = 0 at e = 0 (the veto)."""
    p = examples.low_probability_teachers(e, n_agree)
    w = low_prob_weights(n_agree, veto_weight)
    return float(ag.arithmetic_pool(p, w)[0]), float(ag.geometric_pool(p, w)[0])


def veto_threshold(n_agree=2, veto_weight=None):
    """e* at which G(0) = 1/2: W_agree ln 9 = w_veto ln((1 - e)/e), so e* = 1 / (1 + 9^{W_agree / w_veto}).

    Equal weights: e* = 1 / (1 + 9^m) for m agreeing teachers (1/82 for m = 2, theory section 1)."""
    w = low_prob_weights(n_agree, veto_weight)
    return 1.0 / (1.0 + 9.0 ** (w[:-1].sum() / w[-1]))


def first_token_g(teachers, weights, h_max, token=0):
    """g(token | start) when H = 0, 1, ..., h_max more tokens follow the first; (h_max + 1,).

    One backward recursion of horizon h_max + 1 (theory section 2): on a time-homogeneous machine the row
    ln g[h, start] with h_max + 1 - h tokens left is the first-token conditional for H = h_max - h."""
    log_g = ag.sequence_geometric_conditionals(teachers, weights, h_max + 1)
    return np.exp(log_g[::-1, teachers.start, token])


def prefix_bias_exact(p_correct, continuation, weights, h_max=30):
    """The prefix-bias example of theory section 2 on ``examples.prefix_bias_teachers``.

    rho = sum_a prod_k A_k(a)^{w_k} (so Z(C) = rho^H, Z(I) = 1), H* = sum_k w_k ln(p_k/(1-p_k)) / (-ln rho),
    g(C) against H = 0..h_max, the first H with g(C) < 1/2, and the flat references: the local
    geometric l(C) and the mixture's first-token marginal sum_k w_k p_k.
    """
    teachers = examples.prefix_bias_teachers(p_correct, continuation)
    w = np.asarray(weights, dtype=float)
    p = np.asarray(p_correct, dtype=float)
    rho = float(np.exp(ag.log_partition(np.log(np.asarray(continuation, dtype=float)), w)))
    h_star = float(np.sum(w * np.log(p / (1 - p))) / -math.log(rho))
    g = first_token_g(teachers, w, h_max)
    flipped = np.flatnonzero(g < 0.5)
    return {"teachers": teachers, "rho": rho, "h_star": h_star, "g": g,
            "first_flip": int(flipped[0]) if flipped.size else None,
            "local": float(np.exp(ag.local_geometric_conditionals(teachers, w)[teachers.start, 0])),
            "mixture": float(np.exp(ag.mixture_conditionals(teachers, w, [])[0, 0]))}


def flip_fractions(sigma, h_values, n_instances, seed, n_teachers=3, n_states=4):
    """Fraction of random instances with g(C | start) < 1/2 at each H, and the H -> infinity limit.

    Returns (fractions (len(h_values),), limit, mean per-token disagreement): the limit is the fraction
    with growth rate after C below that after I (Z(C)/Z(I) -> 0); the disagreement is the mean over
    region states of -ln z(s) = min_q sum_k w_k KL(q || p_k(.|s)) (nats).
    """
    h_values = np.asarray(h_values)
    w = np.full(n_teachers, 1.0 / n_teachers)
    flips = np.zeros(h_values.size)
    below, gap = 0, 0.0
    with warnings.catch_warnings():
        # at H ~ 1000 Z(C) and Z(I) differ by more than 1e280: the exact log-space recursion takes over
        warnings.simplefilter("ignore", ag.NumericalFallbackWarning)
        for i in range(n_instances):
            t = examples.random_prefix_teachers([seed, i], sigma, n_teachers, n_states)   # same instances at every sigma
            g = first_token_g(t, w, int(h_values.max()))
            flips += g[h_values] < 0.5
            below += ag.growth_rate(t, w, 1) < ag.growth_rate(t, w, 1 + n_states) * (1 - 1e-9)   # ulps: a tie
            gap += -np.mean(ag.log_partition(t.log_probs[:, 1:], w))
    return flips / n_instances, below / n_instances, gap / n_instances


# ------------------------------------------------------------------------------------------------
# rates: the asymptotic s.d. of the learned q_T (CLT + delta method), which sets the tests' tolerances
# ------------------------------------------------------------------------------------------------
def learner_sd(probs, weights, n_rounds, learner, token=0):
    """Asymptotic s.d. of q_T(token) of a one-context learner over seeds (theory section 3: O(1/sqrt T) rates).

    KT: q_T -> A(token) = mean of T draws from A: sd = sqrt(A (1 - A) / T) (its bias is at most n/(2T)).
    FTL: q_T = softmax(sum_k f_k ln p_k) with teacher frequencies f ~ multinomial(T, w)/T, so
    sd^2 = c^T (diag w - w w^T) c / T with c_k = q(token) (ln p_k(token) - sum_a q_a ln p_k(a)), q = G.
    ROLLOUT: rhat(a) averages N_a ≈ T G(a) revealed ln p_k(a), k ~ w: sd^2 = sum_a
    (q(token) (1[a = token] - q_a))^2 Var_w(ln p_k(a)) / (T q_a).
    """
    p = np.asarray(probs, dtype=float)
    w = np.asarray(weights, dtype=float)
    if learner == KT:
        a = float(ag.arithmetic_pool(p, w)[token])
        return math.sqrt(a * (1 - a) / n_rounds)
    q = ag.geometric_pool(p, w)
    lp = np.log(p)
    jac = q[token] * ((np.arange(q.size) == token) - q)            # d q(token) / d r(a)
    if learner == FTL:
        c = lp @ jac
        return math.sqrt(float(c @ (np.diag(w) - np.outer(w, w)) @ c) / n_rounds)
    if learner == ROLLOUT:
        var = w @ lp ** 2 - (w @ lp) ** 2
        return math.sqrt(float(np.sum(jac ** 2 * var / q)) / n_rounds)
    raise ValueError(f"unknown learner {learner!r}")


def prefix_learner_sd(p_correct, continuation, weights, horizon_after, n_rounds, learner):
    """Asymptotic s.d. of q_T(C | start) of the sequence learners on the prefix-bias machine (theory section 2, 3).

    SEQ_RKL: logit q(C) = rhat(0,C) - rhat(0,I) + H ln sum_a exp rhat(1,a) (the I branch is shared by all
    teachers: no noise). A round that starts with C reveals ln p_k(C) and then H continuation scores,
    all from the *same* sampled teacher k ~ w. With D_k(x) = ln p_k(x) - sum_j w_j ln p_j(x),
    m_k = sum_a l_c(a) D_k(a) (l_c the continuation's local pool) and n ~ Multinomial(H, l_c) the
    round's continuation tokens, the round's contribution X = D_k(C) + sum_a n_a D_k(a) has
    E X^2 = V(C) + H sum_a l_c(a) V_c(a) + (H^2 - H) E_w[m_k^2] + 2 H Cov_w(D_k(C), m_k),
    V = Var_w(ln p_k), and the delta method over N_C ≈ T g and N_I ≈ T (1 - g) rounds gives
    Var(logit) = [E X^2 / g + V(I) / (1 - g)] / T. The last two terms vanish when the teachers'
    continuations are symmetric under l_c (theory section 2 rows 1-3), not in general (row 4).
    TOKEN_RKL: Var(logit) = [V(C)/l + V(I)/(1 - l)] / T. STATE_KT: sqrt(m (1 - m) / T), m = sum_k w_k p_k.
    """
    w = np.asarray(weights, dtype=float)
    p = np.asarray(p_correct, dtype=float)
    if learner == STATE_KT:
        m = float(w @ p)
        return math.sqrt(m * (1 - m) / n_rounds)
    lc = np.log(np.asarray(continuation, dtype=float))               # (K, m)
    dev_c = np.log(p) - w @ np.log(p)                                 # D_k(C), (K,)
    dev_i = np.log1p(-p) - w @ np.log1p(-p)                           # D_k(I)
    dev = lc - w @ lc                                                 # D_k(a) after C, (K, m)
    local_c = ag.geometric_pool(np.exp(lc), w)
    ex = prefix_bias_exact(p_correct, continuation, weights, h_max=horizon_after)
    if learner == SEQ_RKL:
        q, H = float(ex["g"][horizon_after]), horizon_after
        m_k = dev @ local_c
        second = (w @ dev_c ** 2 + H * float(local_c @ (w @ dev ** 2)) + (H * H - H) * float(w @ m_k ** 2)
                  + 2 * H * float(w @ (dev_c * m_k)))
    elif learner == TOKEN_RKL:
        q, second = ex["local"], float(w @ dev_c ** 2)
    else:
        raise ValueError(f"unknown learner {learner!r}")
    logit_var = (second / q + float(w @ dev_i ** 2) / (1 - q)) / n_rounds
    return q * (1 - q) * math.sqrt(logit_var)
