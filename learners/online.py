"""Online learners for multi-teacher distillation and their regret (docs/theory.md section 3).

Each public function validates its arguments, prepares log-space tables and runs one numba kernel
from ``_kernels.py`` with ``prange`` over seeds. Results are arrays ``(R, G)``: one row per
seed, one column per round of ``grid`` (a log grid of rounds, 1-based, ending at ``n_rounds``).

Off-policy (FKL, log loss)       add_beta_tabular, add_beta_sequence
On-policy (RKL)                  rkl_tabular (FTL / exponentiated gradient), rkl_sequence (plug-in)
Function approximation           loglinear (OGD, online Newton step, on-policy OGD)
Learned curves                   learn_one_context, learn_prefix: q_t of the mechanism learners
The closed forms they are compared with are in ``learners.closed_forms``; grids and slopes in ``analysis``.
"""

import math

import numpy as np
from scipy import optimize
from scipy.special import logsumexp

import aggregation as ag
from aggregation.pools import log_softmax
from aggregation.validate import check_int, check_log_probs, check_probs, check_token_ids, check_weights, read_only

from . import _kernels
from analysis import log_grid
from .names import FTL, KT, ROLLOUT, SEQ_RKL, STATE_KT, TOKEN_RKL

__all__ = [
    "add_beta_tabular", "add_beta_sequence", "rkl_tabular", "rkl_sequence", "loglinear",
    "learn_one_context", "learn_prefix", "SCHEDULES", "FEEDBACK",
]

SCHEDULES = {"1/t": 0, "constant": 1, "1/sqrt(t)": 2, "1/(t+1)": 3}
FEEDBACK = {"alternating": 0, "sample": 1, "full": 2}


# ------------------------------------------------------------------------------------------------
# validation helpers
# ------------------------------------------------------------------------------------------------
def _seeds(seeds):
    """The runs' integer seeds: a 1-D array of seeds, or an int ``n`` meaning ``range(n)``."""
    if isinstance(seeds, (int, np.integer)) and not isinstance(seeds, bool):
        if seeds < 1:
            raise ValueError(f"seeds = {seeds!r} must be >= 1 (an int n means the seeds 0, ..., n-1)")
        seeds = np.arange(int(seeds))
    s = np.asarray(seeds)
    if s.ndim != 1 or s.size == 0 or s.dtype.kind not in "iu":
        raise ValueError(f"seeds must be an int n (the seeds 0, ..., n-1) or a non-empty 1-D integer array, "
                         f"got {seeds!r}")
    if s.dtype.kind == "i" and np.any(s < 0):
        i = int(np.flatnonzero(s < 0)[0])
        raise ValueError(f"seeds[{i}] = {s[i]} is negative")
    return np.ascontiguousarray(s.astype(np.uint64))


def _grid(grid, n_rounds):
    if grid is None:
        return log_grid(n_rounds)
    g = np.asarray(grid)
    if g.ndim != 1 or g.size == 0 or g.dtype.kind not in "iu":
        raise ValueError(f"grid must be a non-empty 1-D integer array, got {grid!r}")
    g = g.astype(np.int64)
    if g[0] < 1 or np.any(np.diff(g) <= 0):
        raise ValueError("grid must be strictly increasing rounds >= 1")
    if g[-1] != n_rounds:
        raise ValueError(f"grid must end at n_rounds = {n_rounds}, ends at {g[-1]}")
    return np.ascontiguousarray(g)


def _track(track, n):
    """Validated token ids to record, (P,) int64, or None."""
    if track is None:
        return None
    if np.ndim(track) != 1:
        raise ValueError(f"track must be a 1-D sequence of token ids, got {track!r}")
    return np.asarray(check_token_ids(track, "track", n, allow_empty=False), dtype=np.int64)


def _convention(table, caller, expected):
    """ValueError naming the convention ``caller`` expects when ``table`` holds the other one: log-probabilities
    (every entry <= 0, exp of each row summing to 1) where probabilities are expected, or the reverse."""
    x = np.asarray(table, dtype=np.float64)
    if x.ndim < 1 or x.size == 0 or np.isnan(x).any():
        return
    with np.errstate(over="ignore", under="ignore"):
        rows_of_logs = np.all(x <= 0) and np.any(x < 0) and np.allclose(logsumexp(x, axis=-1), 0, atol=1e-6)
        rows_of_probs = np.all(x >= 0) and np.any(x > 0) and np.allclose(x.sum(axis=-1), 1, atol=1e-6)
        if expected == "probabilities" and rows_of_logs:
            raise ValueError(f"{caller} expects probabilities; got rows whose exp sums to 1 (log-probabilities? "
                             f"pass np.exp of them)")
        if expected == "log-probabilities" and rows_of_probs:
            raise ValueError(f"{caller} expects log-probabilities; got rows that sum to 1 (probabilities? "
                             f"pass np.log of them)")


def _probs(probs, name, caller):
    _convention(probs, caller, "probabilities")
    p = check_probs(probs, name)
    if p.ndim != 2:
        raise ValueError(f"{name} must have shape (K, n), got {p.shape}")
    return p


def _tracked_call(kernel, args, track, n_seeds, n_grid):
    """Run ``kernel(*args, track, track_out)``; returns track_out (R, G, P), or None without tracking (then
    with P = 0 tokens: one compiled kernel serves both, instead of a second specialisation to compile)."""
    tokens = np.zeros(0, np.int64) if track is None else track
    track_out = np.zeros((n_seeds, n_grid, tokens.size))
    kernel(*args, tokens, track_out)
    return None if track is None else track_out


def _teacher_cdf(weights):
    cdf = np.cumsum(weights)
    cdf[-1] = 1.0
    return np.ascontiguousarray(cdf)


# ------------------------------------------------------------------------------------------------
# off-policy: add-beta
# ------------------------------------------------------------------------------------------------
def alias_tables(probs):
    """Walker/Vose alias tables of the rows of ``probs`` (..., n): (prob, index), each (..., n).

    Token j is drawn with probability (prob[j] + sum_{i: index[i] = j, i != j} (1 - prob[i])) / n;
    one uniform u gives j = floor(n u), then j if frac(n u) < prob[j] else index[j]."""
    p = np.asarray(probs, dtype=float)
    n = p.shape[-1]
    flat = p.reshape(-1, n)
    prob = np.ones_like(flat)
    index = np.tile(np.arange(n, dtype=np.int64), (flat.shape[0], 1))
    for r, row in enumerate(flat):
        scaled = row * n / row.sum()
        small = [j for j in range(n) if scaled[j] < 1.0]
        large = [j for j in range(n) if scaled[j] >= 1.0]
        while small and large:
            lo, hi = small.pop(), large.pop()
            prob[r, lo] = scaled[lo]
            index[r, lo] = hi
            scaled[hi] -= 1.0 - scaled[lo]
            (small if scaled[hi] < 1.0 else large).append(hi)
        for j in small + large:                              # leftovers are 1 up to rounding
            prob[r, j] = 1.0
            index[r, j] = j
    return np.ascontiguousarray(prob.reshape(p.shape)), np.ascontiguousarray(index.reshape(p.shape))


def _log_tables(beta, n, size):
    j = np.arange(size + 1, dtype=float)
    return np.log(j + beta), np.log(j + n * beta)


def add_beta_tabular(probs, weights, beta, n_rounds, seeds, sequence=None, grid=None, track=None):
    """Add-beta estimator q_t(a) = (N_t(a) + beta) / (t - 1 + n beta) on one context (theory section 3).

    Feedback: ``sequence=None`` draws k_t ~ w and y_t ~ p_{k_t} (sample feedback); otherwise the
    tokens are fixed: ``"constant"`` (all 0, the worst case of beta >= 1/2), ``"round-robin"``
    (0, 1, ..., n-1, ...) or an explicit (n_rounds,) token array.

    Returns dict with ``regret`` (R, G) against the best fixed distribution in hindsight,
    ``pseudo`` (R, G) = sum_t KL(A || q_t) against the mixture A = sum_k w_k p_k, and ``grid``; with
    ``track`` (token ids, (P,)) also ``track`` (R, G, P) = q_t(track) at the grid rounds (the
    prediction committed at round t, before its feedback; it converges to A(track)).
    """
    p = _probs(probs, "probs", "add_beta_tabular")
    K, n = p.shape
    w = check_weights(weights, K, other="probs")
    track = _track(track, n)
    if not (np.isfinite(beta) and beta > 0):
        raise ValueError(f"beta = {beta!r} must be positive")
    n_rounds = check_int(n_rounds, "n_rounds", 1)
    seeds = _seeds(seeds)
    grid = _grid(grid, n_rounds)
    if sequence is None:
        forced = np.zeros(0, np.int64)
    elif isinstance(sequence, str):
        if sequence == "constant":
            forced = np.zeros(n_rounds, np.int64)
        elif sequence == "round-robin":
            forced = np.arange(n_rounds, dtype=np.int64) % n
        else:
            raise ValueError(f"sequence = {sequence!r} must be 'constant', 'round-robin', an array or None")
    else:
        forced = np.ascontiguousarray(sequence, dtype=np.int64)
        if forced.shape != (n_rounds,) or forced.min() < 0 or forced.max() >= n:
            raise ValueError(f"sequence must be (n_rounds,) = ({n_rounds},) tokens in [0, {n})")
    mix = ag.arithmetic_pool(p, w)
    joint = np.ascontiguousarray(mix[None, :])
    with np.errstate(divide="ignore", invalid="ignore"):
        neg_entropy = float(np.sum(np.where(mix > 0, mix * np.log(mix), 0.0)))
    log_num, log_den = _log_tables(beta, n, n_rounds)
    # one context: y_t ~ p_{k_t} with k_t ~ w is y_t ~ A, so the kernel samples A directly
    prob, index = alias_tables(mix[None, None, :])
    regret = np.zeros((seeds.size, grid.size))
    pseudo = np.zeros_like(regret)
    no_next = read_only(np.full((1, n), -1, np.int64))            # one context, every token ends
    tracked = _tracked_call(_kernels.add_beta_kernel, (no_next, 0, 1, prob, index, np.ones(1), joint, neg_entropy,
                                                 log_num, log_den, forced, seeds, grid, regret, pseudo),
                            track, seeds.size, grid.size)
    out = {"regret": regret, "pseudo": pseudo, "grid": grid}
    if tracked is not None:
        out["track"] = tracked
    return out


def mixture_joint(teachers, weights, horizon):
    """joint[s, a] = P_{A_seq}(the response visits s and emits a there), summed over steps; (S, n).

    joint = sum_k w_k sum_h occ_k[h, s] p_k(a | s), occ_k the forward occupancy under teacher k."""
    w = np.asarray(weights, dtype=float)
    joint = np.zeros((teachers.S, teachers.n))
    for k in np.flatnonzero(w > 0):
        occ = ag.state_occupancy(teachers, None, horizon, target=int(k))[:horizon].sum(axis=0)
        joint += w[k] * occ[:, None] * np.exp(teachers.log_probs[k])
    return joint


def add_beta_sequence(teachers, weights, horizon, beta, n_rounds, seeds, grid=None, track=None):
    """Per-state add-beta on responses y ~ A_seq (k_t ~ w, then y ~ p_{k_t}), loss -ln q_t(y) (theory section 3).

    The loss splits by the chain rule, -ln q(y) = sum_h -ln q(y_h | s_h), so each state runs its own
    add-beta estimator. ``regret`` is against the best per-state model in hindsight; ``pseudo`` =
    sum_t [sum_{s,a} joint ln A(a|s) - sum_{s,a} joint ln q_t(a|s)], which is sum_t KL(A_seq || q_t)
    when every state is reached by one prefix only (a prefix tree), and the KL to the best
    per-state model otherwise. Returns dict regret, pseudo (R, G), grid, and ``visited`` (the number
    of states the mixture reaches, whose (n-1)/2 sum is the theory slope); with ``track`` (token ids,
    (P,)) also ``track`` (R, G, P) = q_t(track | start) at the grid rounds, which converges to the
    mixture's first-token marginal sum_k w_k p_k(track | start).
    """
    if not isinstance(teachers, ag.FiniteStateTeachers):
        raise ValueError(f"teachers must be a FiniteStateTeachers, got {type(teachers).__name__}")
    w = check_weights(weights, teachers.K, other="teachers")
    track = _track(track, teachers.n)
    horizon = check_int(horizon, "horizon", 1)
    if not (np.isfinite(beta) and beta > 0):
        raise ValueError(f"beta = {beta!r} must be positive")
    n_rounds = check_int(n_rounds, "n_rounds", 1)
    seeds = _seeds(seeds)
    grid = _grid(grid, n_rounds)
    joint = np.ascontiguousarray(mixture_joint(teachers, w, horizon))
    mass = joint.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        neg_entropy = float(np.sum(np.where(joint > 0, joint * np.log(joint / mass), 0.0)))
    log_num, log_den = _log_tables(beta, teachers.n, n_rounds * horizon)
    prob, index = alias_tables(np.exp(teachers.log_probs))
    regret = np.zeros((seeds.size, grid.size))
    pseudo = np.zeros_like(regret)
    tracked = _tracked_call(_kernels.add_beta_kernel, (teachers.next_state, teachers.start, horizon, prob, index,
                                                 _teacher_cdf(w), joint, neg_entropy, log_num, log_den,
                                                 np.zeros(0, np.int64), seeds, grid, regret, pseudo),
                            track, seeds.size, grid.size)
    visited = int(np.sum(mass[:, 0] > 0))
    out = {"regret": regret, "pseudo": pseudo, "grid": grid, "visited": visited}
    if tracked is not None:
        out["track"] = tracked
    return out


# ------------------------------------------------------------------------------------------------
# on-policy: RKL
# ------------------------------------------------------------------------------------------------
def rkl_tabular(log_probs, weights, feedback, schedule, n_rounds, seeds, eta0=1.0, grid=None, track=None):
    """Exponentiated gradient / follow-the-leader on the RKL loss, one context (theory section 3).

    theta_{t+1} = (1 - eta_t) theta_t + eta_t ln p_{k_t} is exponentiated gradient on
    f_t(q) = KL(q || p_{k_t}) (gradient ln q - ln p_{k_t}); eta_t = 1/t is follow-the-leader,
    q_{t+1} ∝ exp(mean_{s<=t} ln p_{k_s}). schedule: '1/t', 'constant' (eta0), '1/sqrt(t)'
    (eta0 / sqrt t), '1/(t+1)'. feedback: 'alternating' (k_t cycles 0, 1, ..., K-1), 'sample'
    (k_t ~ w) or 'full' (f_t = sum_k w_k KL(q || p_k)).

    Returns dict ``regret`` (R, G) against the best fixed q in hindsight, ``pseudo`` (R, G) =
    sum_t KL(q_t || G) with G the w-geometric pool, and ``grid``; with ``track`` (token ids, (P,)) also
    ``track`` (R, G, P) = q_t(track) at the grid rounds (before that round's update).
    """
    _convention(log_probs, "rkl_tabular", "log-probabilities")
    lp = np.ascontiguousarray(log_probs, dtype=np.float64)
    if lp.ndim != 2:
        raise ValueError(f"log_probs must have shape (K, n), got {lp.shape}")
    if np.isnan(lp).any() or np.any(lp > 1e-12) or np.isneginf(lp).any():
        raise ValueError("log_probs must be finite and <= 0 (RKL is infinite when a teacher gives a token "
                         "probability 0)")
    lp = check_log_probs(np.minimum(lp, 0.0), "log_probs", normalised=True)
    K, n = lp.shape
    w = check_weights(weights, K)
    track = _track(track, n)
    if feedback not in FEEDBACK:
        raise ValueError(f"feedback = {feedback!r} must be one of {sorted(FEEDBACK)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule = {schedule!r} must be one of {sorted(SCHEDULES)}")
    if not (np.isfinite(eta0) and 0 < eta0 <= 1):
        raise ValueError(f"eta0 = {eta0!r} must be in (0, 1]")
    n_rounds = check_int(n_rounds, "n_rounds", 1)
    seeds = _seeds(seeds)
    grid = _grid(grid, n_rounds)
    pooled = np.ascontiguousarray(w @ lp)
    log_target = np.ascontiguousarray(pooled - logsumexp(pooled))
    regret = np.zeros((seeds.size, grid.size))
    pseudo = np.zeros_like(regret)
    tracked = _tracked_call(_kernels.rkl_tabular_kernel, (lp, _teacher_cdf(w), pooled, log_target, FEEDBACK[feedback],
                                                    SCHEDULES[schedule], float(eta0), seeds, grid, regret, pseudo),
                            track, seeds.size, grid.size)
    out = {"regret": regret, "pseudo": pseudo, "grid": grid}
    if tracked is not None:
        out["track"] = tracked
    return out


def rkl_sequence(teachers, weights, horizon, mode, n_rounds, seeds, grid=None, track=None):
    """Plug-in on-policy learner on finite-state teachers, sample feedback on its own rollouts (theory section 2, 3).

    It keeps rhat(s, a), the running mean of the teacher scores ln p_k(a|s) revealed on its rollouts,
    and re-solves for its policy every round; it is not a policy-gradient learner. mode 'sequence':
    q_t is the soft-optimal (soft-Bellman) policy of rhat over the remaining horizon, the exact
    minimiser of sequence-level RKL to the estimated teachers; converges to g, the conditionals of
    G_seq. mode 'token': q_t(a|s) ∝ exp rhat(s, a) (per-token RKL, discount 0); converges to l.

    Returns dict ``regret`` (realised, against the best fixed policy in hindsight on the realised
    teacher draws), ``pseudo`` = sum_t KL_seq(q_t || G_seq), ``token`` = sum_t sum_{h,s} occ_{q_t}(h, s)
    KL(q_t(.|h, s) || l(.|s)) (the per-token regret), each (R, G), and ``grid``; with ``track`` (token
    ids, (P,)) also ``track`` (R, G, P) = q_t(track | h = 0, start) at the grid rounds, the first-token
    probability of the policy rolled out in that round (-> g(.|start) in mode 'sequence', l in 'token').
    """
    if not isinstance(teachers, ag.FiniteStateTeachers):
        raise ValueError(f"teachers must be a FiniteStateTeachers, got {type(teachers).__name__}")
    w = check_weights(weights, teachers.K, other="teachers")
    track = _track(track, teachers.n)
    if mode not in ("sequence", "token"):
        raise ValueError(f"mode = {mode!r} must be 'sequence' or 'token'")
    horizon = check_int(horizon, "horizon", 1)
    n_rounds = check_int(n_rounds, "n_rounds", 1)
    seeds = _seeds(seeds)
    grid = _grid(grid, n_rounds)
    keep = np.flatnonzero(w > 0)
    lp = read_only(teachers.log_probs[keep])
    if np.isneginf(lp).any():
        raise ValueError("teachers.log_probs must be finite for the on-policy learner (RKL against a "
                         "teacher that gives a token probability 0 is infinite)")
    log_g = np.ascontiguousarray(ag.sequence_geometric_conditionals(teachers, w, horizon))
    log_l = np.ascontiguousarray(ag.local_geometric_conditionals(teachers, w))
    out = np.zeros((3, seeds.size, grid.size))
    tracked = _tracked_call(_kernels.rkl_sequence_kernel, (teachers.next_state, teachers.start, horizon, lp,
                                                     _teacher_cdf(w[keep]), log_g, log_l, 0 if mode == "sequence" else 1,
                                                     seeds, grid, out[0], out[1], out[2]),
                            track, seeds.size, grid.size)
    res = {"regret": out[0], "pseudo": out[1], "token": out[2], "grid": grid}
    if tracked is not None:
        res["track"] = tracked
    return res


# ------------------------------------------------------------------------------------------------
# function approximation
# ------------------------------------------------------------------------------------------------
# name -> (on-policy loss, update rule of loglinear_kernel)
METHODS = {"OGD": (0, 0), "ONS": (0, 1), "Newton-style": (0, 2), "frozen": (0, 3), "constant step": (0, 4),
           "OGD-RKL": (1, 0), "frozen-RKL": (1, 3)}


def _loglinear_objective(theta, features, stats_xy, lam, t, pooled, on_policy):
    logits = features @ theta                                   # (X, n)
    log_q = log_softmax(logits)
    q = np.exp(log_q)
    phi_bar = np.einsum("xa,xad->xd", q, features)
    if on_policy:
        n_x = stats_xy.sum(axis=1)
        diff = log_q - pooled
        kl = np.sum(q * diff, axis=1)
        grad_x = np.einsum("xa,xad->xd", q * diff, features - phi_bar[:, None, :])
        value = n_x @ kl
        grad = n_x @ grad_x
    else:
        value = -np.sum(stats_xy * log_q)
        grad = np.einsum("xa,xad->d", stats_xy, phi_bar[:, None, :] - features)
    return value + 0.5 * lam * t * theta @ theta, grad + lam * t * theta


def loglinear_comparator(features, counts, lam, t, pooled=None, starts=()):
    """(min_theta sum_t f_t(theta), its argmin) from the counts of (x_t, y_t): scipy L-BFGS from
    theta = 0 and from each of ``starts``, keeping the best. The off-policy objective is strongly
    convex (one start suffices); the on-policy RKL objective is not convex in theta, so callers pass
    several starts."""
    on_policy = pooled is not None
    best = (math.inf, None)
    for x0 in [np.zeros(features.shape[2]), *starts]:
        res = optimize.minimize(_loglinear_objective, np.asarray(x0, dtype=float), jac=True, method="L-BFGS-B",
                                args=(features, counts.astype(float), lam, t, pooled, on_policy),
                                options={"gtol": 1e-10, "ftol": 1e-15, "maxiter": 1000})
        if res.fun < best[0]:
            best = (float(res.fun), res.x)
    return best


def hak_constants(phi_max, lam, d):
    """The constants of online Newton step (Hazan, Agarwal and Kale 2007) for this student.

    Iterates live in the ball |theta| <= R = 2 Phi / lam (it holds the regularised minimiser), so the
    gradients are bounded by G = 4 Phi; a lam-strongly convex loss with gradients bounded by G is
    alpha = lam / G^2 exp-concave; with the diameter D = 2R, gamma = min(1 / (4 G D), alpha) / 2 and
    eps = 1 / (gamma^2 D^2), and ONS has regret <= 5 (1/alpha + G D) d ln T. OGD with eta_t = 1/(lam t)
    has regret <= G^2 / (2 lam) (1 + ln T). Both bounds are far above what the learners reach here
    (they hold for every sequence), so they are reported, not drawn as a theory line.
    """
    R = 2 * phi_max / lam
    G = 4 * phi_max
    alpha = lam / G ** 2
    D = 2 * R
    gamma = 0.5 * min(1.0 / (4 * G * D), alpha)
    return {"R": R, "G": G, "alpha": alpha, "gamma": gamma, "eps": 1.0 / (gamma * D) ** 2,
            "ons_bound_slope": 5 * (1 / alpha + G * D) * d, "ogd_bound_slope": G ** 2 / (2 * lam)}


def loglinear(features, probs, weights, method, lam, n_rounds, seeds, grid=None, eta0=0.1, gamma=None,
              restarts=3):
    """Log-linear student with d shared features, q(a|x) ∝ exp(theta . phi(x, a)), x ~ uniform (theory section 3).

    Loss: off-policy log loss on y_t ~ p_{k_t}(.|x_t), or (methods ending in '-RKL') the on-policy
    loss sum_k w_k KL(q(.|x_t) || p_k(.|x_t)); both plus lam/2 |theta|^2. Methods:
      'OGD', 'OGD-RKL'  online gradient descent, eta_t = 1/(lam t), Euclidean projection on |theta| <= R;
      'ONS'             online Newton step as in Hazan-Agarwal-Kale (2007): A_t = eps I + sum g g^T,
                        theta <- Pi^{A_t}(theta - A_t^{-1} g_t / gamma), generalised projection; gamma
                        and eps from the exp-concavity and gradient bounds (:func:`hak_constants`)
                        unless ``gamma`` is given;
      'Newton-style'    A_t = lam I + sum (g g^T + lam I), theta <- theta - A_t^{-1} g_t / gamma with
                        gamma = 1 (or ``gamma``) and a Euclidean projection: fast here, but outside the
                        ONS analysis (no guarantee is claimed);
      'constant step'   OGD with the constant step ``eta0`` (badly tuned: linear regret);
      'frozen', 'frozen-RKL'  theta = 0 throughout (the reference every learner must beat).
    Regret is against the best fixed theta in hindsight (:func:`loglinear_comparator`, started from 0,
    from the learner's own theta at that round and, on-policy, from ``restarts`` random points).
    Returns dict ``regret`` (R, G), ``theta`` (R, G, d), ``grid`` and the constants of :func:`hak_constants`.
    """
    phi = np.ascontiguousarray(features, dtype=np.float64)
    if phi.ndim != 3:
        raise ValueError(f"features must have shape (X, n, d), got {phi.shape}")
    _convention(probs, "loglinear", "probabilities")
    p = np.ascontiguousarray(probs, dtype=np.float64)
    if p.ndim != 3 or p.shape[1:] != phi.shape[:2]:
        raise ValueError(f"probs must have shape (K, X, n) = (K, {phi.shape[0]}, {phi.shape[1]}), got {p.shape}")
    if np.any(p <= 0) or np.any(np.abs(p.sum(axis=2) - 1) > 1e-6):
        raise ValueError("probs must be positive rows summing to 1")
    K = p.shape[0]
    w = check_weights(weights, K, other="probs")
    if method not in METHODS:
        raise ValueError(f"method = {method!r} must be one of {sorted(METHODS)}")
    if not (np.isfinite(lam) and lam > 0):
        raise ValueError(f"lam = {lam!r} must be positive")
    if not (np.isfinite(eta0) and eta0 > 0):
        raise ValueError(f"eta0 = {eta0!r} must be positive")
    n_rounds = check_int(n_rounds, "n_rounds", 1)
    seeds = _seeds(seeds)
    grid = _grid(grid, n_rounds)
    lp = np.ascontiguousarray(np.log(p))
    pooled = np.ascontiguousarray(np.tensordot(w, lp, axes=1))
    const = hak_constants(float(np.sqrt((phi ** 2).sum(axis=2)).max()), float(lam), phi.shape[2])
    on_policy, update = METHODS[method]
    if gamma is None:
        gamma = const["gamma"] if update == 1 else 1.0
    eps = 1.0 / (gamma * 2 * const["R"]) ** 2
    loss = np.zeros((seeds.size, grid.size))
    counts = np.zeros((seeds.size, grid.size) + phi.shape[:2], np.int64)
    theta = np.zeros((seeds.size, grid.size, phi.shape[2]))
    _kernels.loglinear_kernel(phi, lp, _teacher_cdf(w), pooled, on_policy, update, float(lam), float(eta0), const["R"],
                        float(gamma), eps, seeds, grid, loss, counts, theta)
    rng = np.random.default_rng(12345)
    regret = np.empty_like(loss)
    for i in range(seeds.size):
        for g, t in enumerate(grid):
            starts = [theta[i, g]]
            if on_policy:
                starts += list(rng.normal(scale=const["R"] / 4, size=(restarts, phi.shape[2])))
            regret[i, g] = loss[i, g] - loglinear_comparator(phi, counts[i, g], lam, int(t),
                                                             pooled if on_policy else None, starts)[0]
    return {"regret": regret, "theta": theta, "grid": grid, **const, "gamma_used": float(gamma)}


# ------------------------------------------------------------------------------------------------
# learned curves: the learners above, tracking q_t at log-grid rounds (the mechanism sims)
# ------------------------------------------------------------------------------------------------
def one_context_machine(probs):
    """A one-state, one-token machine whose teachers are the rows of ``probs`` (K, n): rkl_sequence on it
    is the on-policy learner that samples its own token and sees only the sampled teacher's ln p_k of it."""
    probs = np.asarray(probs, dtype=float)
    return ag.FiniteStateTeachers.from_probs(np.full((1, probs.shape[1]), -1), probs[:, None, :])


def learn_one_context(probs, weights, n_rounds, seeds, learners=(KT, FTL, ROLLOUT), grid=None, token=0):
    """q_t(token) of each learner at the rounds of ``grid`` (default the log grid of each learner's T).

    KT: add-beta (beta = 1/2) on y_t ~ p_{k_t}, k_t ~ w -> A. FTL: q_{t+1} ∝ exp(mean_{s<=t} ln p_{k_s})
    with teacher k_t revealing its row -> G. ROLLOUT: the student samples y ~ q_t, teacher k_t reveals
    ln p_{k_t}(y) only, q_t ∝ exp(running means) -> G. n_rounds: an int or a dict learner -> int.

    Returns dict learner -> (grid (G,), q (R, G)).
    """
    p = np.asarray(probs, dtype=float)
    out = {}
    for name in learners:
        T = n_rounds[name] if isinstance(n_rounds, dict) else n_rounds
        g = grid if grid is not None else log_grid(T)
        if name == KT:
            res = add_beta_tabular(p, weights, 0.5, T, seeds, grid=g, track=[token])
        elif name == FTL:
            res = rkl_tabular(np.log(p), weights, "sample", "1/t", T, seeds, grid=g, track=[token])
        elif name == ROLLOUT:
            res = rkl_sequence(one_context_machine(p), weights, 1, "sequence", T, seeds, grid=g, track=[token])
        else:
            raise ValueError(f"unknown learner {name!r}")
        out[name] = (res["grid"], res["track"][:, :, 0])
    return out


def learn_prefix(teachers, weights, horizon, n_rounds, seeds, token=0):
    """First-token probability q_t(C | start) of the three sequence learners (theory section 2, "which target").

    SEQ_RKL: rkl_sequence 'sequence' (soft-Bellman on the running-mean rewards) -> g;
    TOKEN_RKL: rkl_sequence 'token' (discount 0) -> l; STATE_KT: add_beta_sequence (per-state KT on
    responses y ~ A_seq) -> the mixture's marginal sum_k w_k p_k(C). Returns dict learner -> (grid, (R, G)).
    """
    out = {}
    for name, mode in ((SEQ_RKL, "sequence"), (TOKEN_RKL, "token")):
        res = rkl_sequence(teachers, weights, horizon, mode, n_rounds, seeds, track=[token])
        out[name] = (res["grid"], res["track"][:, :, 0])
    res = add_beta_sequence(teachers, weights, horizon, 0.5, n_rounds, seeds, track=[token])
    out[STATE_KT] = (res["grid"], res["track"][:, :, 0])
    return out
