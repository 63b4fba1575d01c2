"""Online learners for multi-teacher distillation and their regret (SPEC section 3).

Each public function validates its arguments, prepares log-space tables and runs one numba kernel
from ``_regret_kernels.py`` with ``prange`` over seeds. Results are arrays ``(R, G)``: one row per
seed, one column per round of ``grid`` (a log grid of rounds, 1-based, ending at ``n_rounds``).

Off-policy (FKL, log loss)       add_beta_tabular, add_beta_sequence
On-policy (RKL)                  rkl_tabular (FTL / exponentiated gradient), rkl_sequence (plug-in)
Function approximation           loglinear (OGD, online Newton step, on-policy OGD)
Theory                           kt_worst_case, laplace_worst_case, add_beta_constant_sequence,
                                 shtarkov_log_complexity, alternating_constant, ftl_constant, hak_bound
Analysis                         log_grid, fit_slope, cell_seeds
"""

import math
import zlib

import numpy as np
from scipy import optimize, stats
from scipy.special import gammaln, logsumexp

import aggregation as ag

from . import _regret_kernels as _k

__all__ = [
    "log_grid", "cell_seeds", "fit_slope",
    "add_beta_tabular", "add_beta_sequence", "rkl_tabular", "rkl_sequence", "loglinear",
    "kt_worst_case", "laplace_worst_case", "add_beta_constant_sequence", "add_beta_round_robin",
    "shtarkov_log_complexity", "alternating_constant", "ftl_constant", "hak_bound",
    "SCHEDULES", "FEEDBACK",
]

SCHEDULES = {"1/t": 0, "constant": 1, "1/sqrt(t)": 2, "1/(t+1)": 3}
FEEDBACK = {"alternating": 0, "sample": 1, "full": 2}


# ------------------------------------------------------------------------------------------------
# validation helpers
# ------------------------------------------------------------------------------------------------
def _positive_int(value, name, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} = {value!r} must be an integer >= {minimum}")
    return int(value)


def _seeds(seeds):
    s = np.asarray(seeds)
    if s.ndim != 1 or s.size == 0 or s.dtype.kind not in "iu":
        raise ValueError(f"seeds must be a non-empty 1-D integer array, got {seeds!r}")
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


def _probs(probs, name):
    p = np.ascontiguousarray(probs, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"{name} must have shape (K, n), got {p.shape}")
    ag.arithmetic_pool(p, np.full(p.shape[0], 1.0 / p.shape[0]))   # validates rows (SPEC 7)
    return p


def _weights(weights, K, name="weights"):
    w = np.ascontiguousarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.shape[0] != K:
        raise ValueError(f"{name} must have shape ({K},) (one weight per teacher), got {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        i = int(np.flatnonzero(~(np.isfinite(w) & (w >= 0)))[0])
        raise ValueError(f"{name}[{i}] = {w[i]} must be finite and >= 0")
    if abs(w.sum() - 1.0) > 1e-6:
        raise ValueError(f"{name} sum to {w.sum()!r}, not 1")
    return w


def _track(track, n):
    """Validated token ids to record, (P,) int64, or None."""
    if track is None:
        return None
    tr = np.asarray(track)
    if tr.ndim != 1 or tr.size == 0 or tr.dtype.kind not in "iu":
        raise ValueError(f"track must be a non-empty 1-D sequence of token ids, got {track!r}")
    bad = (tr < 0) | (tr >= n)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"track[{i}] = {tr[i]} is out of the vocabulary range [0, {n})")
    return np.ascontiguousarray(tr.astype(np.int64))


def _tracked_call(kernel, args, track, n_seeds, n_grid):
    """Run ``kernel(*args)``, adding the optional (track, track_out) pair only when tracking; returns
    track_out (R, G, P) or None. Without tracking the kernel is called exactly as before."""
    if track is None:
        kernel(*args)
        return None
    track_out = np.zeros((n_seeds, n_grid, track.size))
    kernel(*args, track, track_out)
    return track_out


def _teacher_cdf(weights):
    cdf = np.cumsum(weights)
    cdf[-1] = 1.0
    return np.ascontiguousarray(cdf)


# ------------------------------------------------------------------------------------------------
# grids, seeds, slopes
# ------------------------------------------------------------------------------------------------
def log_grid(n_rounds, per_decade=10):
    """Rounds 1..n_rounds on a log grid: unique rounded 10^(j / per_decade), always ending at n_rounds."""
    n_rounds = _positive_int(n_rounds, "n_rounds")
    top = math.log10(n_rounds)
    pts = np.unique(np.round(10.0 ** np.arange(0.0, top + 1e-12, 1.0 / per_decade)).astype(np.int64))
    pts = pts[pts <= n_rounds]
    if pts[-1] != n_rounds:
        pts = np.append(pts, n_rounds)
    return pts


def cell_seeds(base_seed, key, n_seeds):
    """Per-seed uint64 stream seeds for one cell: SeedSequence([base_seed, crc32(key), i])."""
    crc = zlib.crc32(key.encode())
    return np.array([np.random.SeedSequence([int(base_seed), crc, i]).generate_state(1, np.uint64)[0]
                     for i in range(int(n_seeds))], dtype=np.uint64)


def fit_slope(t, regret, decades=2.0, level=0.95):
    """Least-squares slope of regret against ln t over t in [t_max / 10^decades, t_max], per seed.

    Returns (mean slope, lower, upper): a Student-t interval over seeds (lower = upper = the slope
    with one seed). regret: (R, G) or (G,).
    """
    t = np.asarray(t, dtype=float)
    r = np.atleast_2d(np.asarray(regret, dtype=float))
    keep = t >= t.max() / 10.0 ** decades - 1e-9
    if keep.sum() < 2:
        raise ValueError("fit_slope needs at least two grid points in the fitted range")
    x = np.log(t[keep])
    xc = x - x.mean()
    slopes = (r[:, keep] - r[:, keep].mean(axis=1, keepdims=True)) @ xc / (xc @ xc)
    mean = float(slopes.mean())
    if slopes.size < 2:
        return mean, mean, mean
    half = stats.t.ppf(0.5 + level / 2, slopes.size - 1) * slopes.std(ddof=1) / math.sqrt(slopes.size)
    return mean, mean - float(half), mean + float(half)


# ------------------------------------------------------------------------------------------------
# theory (SPEC 3)
# ------------------------------------------------------------------------------------------------
def add_beta_constant_sequence(T, n, beta):
    """Regret of add-beta on a constant sequence of length T over n symbols:
    ln Γ(T + n beta) - ln Γ(n beta) - ln Γ(T + beta) + ln Γ(beta)."""
    T = np.asarray(T, dtype=float)
    return gammaln(T + n * beta) - gammaln(n * beta) - gammaln(T + beta) + gammaln(beta)


def kt_worst_case(T, n):
    """R_KT(T) = ln Γ(1/2) + ln Γ(T + n/2) - ln Γ(n/2) - ln Γ(T + 1/2) ~ (n-1)/2 ln T (SPEC 3)."""
    return add_beta_constant_sequence(T, n, 0.5)


def laplace_worst_case(T, n):
    """Laplace's worst case ln binom(T + n - 1, n - 1) (SPEC 3)."""
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
    T = _positive_int(T, "T")
    n = _positive_int(n, "n")
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


def hak_bound(T, G, lam):
    """Hazan-Agarwal-Kale (2007): OGD with eta_t = 1/(lam t) on lam-strongly convex losses with
    gradients bounded by G has regret <= G^2 / (2 lam) (1 + ln T)."""
    return G ** 2 / (2 * lam) * (1 + np.log(np.asarray(T, dtype=float)))


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
    """Add-beta estimator q_t(a) = (N_t(a) + beta) / (t - 1 + n beta) on one context (SPEC 3).

    Feedback: ``sequence=None`` draws k_t ~ w and y_t ~ p_{k_t} (sample feedback); otherwise the
    tokens are fixed: ``"constant"`` (all 0, the worst case of beta >= 1/2), ``"round-robin"``
    (0, 1, ..., n-1, ...) or an explicit (n_rounds,) token array.

    Returns dict with ``regret`` (R, G) against the best fixed distribution in hindsight,
    ``pseudo`` (R, G) = sum_t KL(A || q_t) against the mixture A = sum_k w_k p_k, and ``grid``; with
    ``track`` (token ids, (P,)) also ``track`` (R, G, P) = q_t(track) at the grid rounds (the
    prediction committed at round t, before its feedback; it converges to A(track)).
    """
    p = _probs(probs, "probs")
    K, n = p.shape
    w = _weights(weights, K)
    track = _track(track, n)
    if not (np.isfinite(beta) and beta > 0):
        raise ValueError(f"beta = {beta!r} must be positive")
    n_rounds = _positive_int(n_rounds, "n_rounds")
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
    tracked = _tracked_call(_k.add_beta_kernel, (np.full((1, n), -1, np.int64), 0, 1, prob, index, np.ones(1), joint,
                                                 neg_entropy, log_num, log_den, forced, seeds, grid, regret, pseudo),
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
    """Per-state add-beta on responses y ~ A_seq (k_t ~ w, then y ~ p_{k_t}), loss -ln q_t(y) (SPEC 3).

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
    w = _weights(weights, teachers.K)
    track = _track(track, teachers.n)
    horizon = _positive_int(horizon, "horizon")
    if not (np.isfinite(beta) and beta > 0):
        raise ValueError(f"beta = {beta!r} must be positive")
    n_rounds = _positive_int(n_rounds, "n_rounds")
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
    tracked = _tracked_call(_k.add_beta_kernel, (teachers.next_state, teachers.start, horizon, prob, index,
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
    """Exponentiated gradient / follow-the-leader on the RKL loss, one context (SPEC 3).

    theta_{t+1} = (1 - eta_t) theta_t + eta_t ln p_{k_t} is exponentiated gradient on
    f_t(q) = KL(q || p_{k_t}) (gradient ln q - ln p_{k_t}); eta_t = 1/t is follow-the-leader,
    q_{t+1} ∝ exp(mean_{s<=t} ln p_{k_s}). schedule: '1/t', 'constant' (eta0), '1/sqrt(t)'
    (eta0 / sqrt t), '1/(t+1)'. feedback: 'alternating' (k_t cycles 0, 1, ..., K-1), 'sample'
    (k_t ~ w) or 'full' (f_t = sum_k w_k KL(q || p_k)).

    Returns dict ``regret`` (R, G) against the best fixed q in hindsight, ``pseudo`` (R, G) =
    sum_t KL(q_t || G) with G the w-geometric pool, and ``grid``; with ``track`` (token ids, (P,)) also
    ``track`` (R, G, P) = q_t(track) at the grid rounds (before that round's update).
    """
    lp = np.ascontiguousarray(log_probs, dtype=np.float64)
    if lp.ndim != 2:
        raise ValueError(f"log_probs must have shape (K, n), got {lp.shape}")
    if np.isnan(lp).any() or np.any(lp > 1e-12) or np.isneginf(lp).any():
        raise ValueError("log_probs must be finite and <= 0 (RKL is infinite when a teacher gives a token "
                         "probability 0)")
    if np.any(np.abs(logsumexp(lp, axis=1)) > 1e-6):
        i = int(np.flatnonzero(np.abs(logsumexp(lp, axis=1)) > 1e-6)[0])
        raise ValueError(f"log_probs[{i}] does not sum to 1")
    K, n = lp.shape
    w = _weights(weights, K)
    track = _track(track, n)
    if feedback not in FEEDBACK:
        raise ValueError(f"feedback = {feedback!r} must be one of {sorted(FEEDBACK)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule = {schedule!r} must be one of {sorted(SCHEDULES)}")
    if not (np.isfinite(eta0) and 0 < eta0 <= 1):
        raise ValueError(f"eta0 = {eta0!r} must be in (0, 1]")
    n_rounds = _positive_int(n_rounds, "n_rounds")
    seeds = _seeds(seeds)
    grid = _grid(grid, n_rounds)
    pooled = np.ascontiguousarray(w @ lp)
    log_target = np.ascontiguousarray(pooled - logsumexp(pooled))
    regret = np.zeros((seeds.size, grid.size))
    pseudo = np.zeros_like(regret)
    tracked = _tracked_call(_k.rkl_tabular_kernel, (lp, _teacher_cdf(w), pooled, log_target, FEEDBACK[feedback],
                                                    SCHEDULES[schedule], float(eta0), seeds, grid, regret, pseudo),
                            track, seeds.size, grid.size)
    out = {"regret": regret, "pseudo": pseudo, "grid": grid}
    if tracked is not None:
        out["track"] = tracked
    return out


def rkl_sequence(teachers, weights, horizon, mode, n_rounds, seeds, grid=None, track=None):
    """On-policy learner on finite-state teachers with sample feedback on its own rollouts (SPEC 2, 3).

    mode 'sequence': q_t is the soft-optimal policy of the running-mean rewards rhat (each token
    credited with the reward-to-go; converges to g, the conditionals of G_seq); mode 'token':
    q_t(a|s) ∝ exp rhat(s, a) (per-token RKL, discount 0; converges to the local geometric l).

    Returns dict ``regret`` (realised, against the best fixed policy in hindsight on the realised
    teacher draws), ``pseudo`` = sum_t KL_seq(q_t || G_seq), ``token`` = sum_t sum_{h,s} occ_{q_t}(h, s)
    KL(q_t(.|h, s) || l(.|s)) (the per-token regret), each (R, G), and ``grid``; with ``track`` (token
    ids, (P,)) also ``track`` (R, G, P) = q_t(track | h = 0, start) at the grid rounds, the first-token
    probability of the policy rolled out in that round (-> g(.|start) in mode 'sequence', l in 'token').
    """
    if not isinstance(teachers, ag.FiniteStateTeachers):
        raise ValueError(f"teachers must be a FiniteStateTeachers, got {type(teachers).__name__}")
    w = _weights(weights, teachers.K)
    track = _track(track, teachers.n)
    if mode not in ("sequence", "token"):
        raise ValueError(f"mode = {mode!r} must be 'sequence' or 'token'")
    horizon = _positive_int(horizon, "horizon")
    n_rounds = _positive_int(n_rounds, "n_rounds")
    seeds = _seeds(seeds)
    grid = _grid(grid, n_rounds)
    keep = np.flatnonzero(w > 0)
    lp = np.ascontiguousarray(teachers.log_probs[keep])
    if np.isneginf(lp).any():
        raise ValueError("teachers.log_probs must be finite for the on-policy learner (RKL against a "
                         "teacher that gives a token probability 0 is infinite)")
    log_g = np.ascontiguousarray(ag.sequence_geometric_conditionals(teachers, w, horizon))
    log_l = np.ascontiguousarray(ag.local_geometric_conditionals(teachers, w))
    out = np.zeros((3, seeds.size, grid.size))
    tracked = _tracked_call(_k.rkl_sequence_kernel, (teachers.next_state, teachers.start, horizon, lp,
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
METHODS = {"OGD": 0, "ONS": 1, "OGD-RKL": 2}


def _loglinear_objective(theta, features, stats_xy, lam, t, pooled, on_policy):
    logits = features @ theta                                   # (X, n)
    log_q = logits - logsumexp(logits, axis=1, keepdims=True)
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


def loglinear_comparator(features, counts, lam, t, pooled=None):
    """min_theta sum_t f_t(theta) from the counts of (x_t, y_t) (scipy L-BFGS from theta = 0)."""
    on_policy = pooled is not None
    res = optimize.minimize(_loglinear_objective, np.zeros(features.shape[2]), jac=True, method="L-BFGS-B",
                            args=(features, counts.astype(float), lam, t, pooled, on_policy),
                            options={"gtol": 1e-10, "ftol": 1e-15, "maxiter": 500})
    return float(res.fun)


def loglinear(features, probs, weights, method, lam, n_rounds, seeds, grid=None):
    """Log-linear student with d shared features, q(a|x) ∝ exp(theta . phi(x, a)), x ~ uniform (SPEC 3).

    method 'OGD' / 'ONS': off-policy log loss on y_t ~ p_{k_t}(.|x_t) plus lam/2 |theta|^2;
    'OGD-RKL': on-policy loss sum_k w_k KL(q(.|x_t) || p_k(.|x_t)) plus lam/2 |theta|^2.
    OGD uses eta_t = 1/(lam t); iterates stay in the ball |theta| <= D = 2 Phi / lam (Phi = max |phi|),
    which holds the regularised minimiser, so the gradients are bounded by G = 4 Phi and
    Hazan-Agarwal-Kale gives regret <= G^2/(2 lam)(1 + ln T) for OGD (the log loss is convex in theta).
    ONS: theta <- theta - A_t^{-1} g_t with A_t = lam I + sum_{s<=t} (g_s g_s^T + lam I), the running
    Gauss-Newton proxy of the Hessian of sum_s f_s (gamma = 1; O(d ln T) regret for exp-concave losses).
    Returns dict ``regret`` (R, G) against the best fixed theta in hindsight (scipy), ``grid``,
    ``G``, ``D``, ``bound_slope`` (G^2/(2 lam) for the off-policy methods, NaN on-policy, whose RKL
    loss is not convex in theta).
    """
    phi = np.ascontiguousarray(features, dtype=np.float64)
    if phi.ndim != 3:
        raise ValueError(f"features must have shape (X, n, d), got {phi.shape}")
    p = np.ascontiguousarray(probs, dtype=np.float64)
    if p.ndim != 3 or p.shape[1:] != phi.shape[:2]:
        raise ValueError(f"probs must have shape (K, X, n) = (K, {phi.shape[0]}, {phi.shape[1]}), got {p.shape}")
    if np.any(p <= 0) or np.any(np.abs(p.sum(axis=2) - 1) > 1e-6):
        raise ValueError("probs must be positive rows summing to 1")
    K = p.shape[0]
    w = _weights(weights, K)
    if method not in METHODS:
        raise ValueError(f"method = {method!r} must be one of {sorted(METHODS)}")
    if not (np.isfinite(lam) and lam > 0):
        raise ValueError(f"lam = {lam!r} must be positive")
    n_rounds = _positive_int(n_rounds, "n_rounds")
    seeds = _seeds(seeds)
    grid = _grid(grid, n_rounds)
    lp = np.ascontiguousarray(np.log(p))
    pooled = np.ascontiguousarray(np.tensordot(w, lp, axes=1))
    phi_max = float(np.sqrt((phi ** 2).sum(axis=2)).max())
    radius = 2 * phi_max / lam
    G = 4 * phi_max
    gamma, eps = 1.0, float(lam)
    loss = np.zeros((seeds.size, grid.size))
    counts = np.zeros((seeds.size, grid.size) + phi.shape[:2], np.int64)
    _k.loglinear_kernel(phi, lp, _teacher_cdf(w), pooled, METHODS[method], float(lam), radius, gamma, eps,
                        seeds, grid, loss, counts)
    on = method == "OGD-RKL"
    regret = np.empty_like(loss)
    for i in range(seeds.size):
        for g, t in enumerate(grid):
            regret[i, g] = loss[i, g] - loglinear_comparator(phi, counts[i, g], lam, int(t), pooled if on else None)
    return {"regret": regret, "grid": grid, "G": G, "D": radius,
            "bound_slope": float("nan") if on else G ** 2 / (2 * lam)}
