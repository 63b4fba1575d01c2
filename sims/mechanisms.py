"""The three mechanisms of multi-teacher distillation, exact and learned (SPEC 1-3; claims T6-T8).

    python sims/mechanisms.py [confident-expert | low-prob | prefix-bias | all] [--quick] [--out DIR]

Writes ``OUT/<name>.csv`` (default OUT = results/mechanisms) and ``figures/mechanism_<name>.png``
(OUT/figures when --out is given). Every CSV is tidy, one row per observation, with the columns

    mechanism, part, learner, setting, x_name, x, seed, t, quantity, value

``part`` says what a row is: ``exact`` (a closed-form target swept over x), ``spec`` (the SPEC's
worked values), ``target`` (the exact value a learned curve should reach), ``learned`` (a learner's
q_t at round t, one row per seed and log-grid round), and per mechanism a few summaries
(``veto-rounds``, ``regret-constant``, ``random-family``). Empty cells mean "not applicable".

confident-expert (T6)  one expert (1-(n-1)d, d, ..., d) and K-1 uniform teachers: A and G top
    probability against d, K, the expert's weight and the vocabulary size n; learned top probability
    of KT on teacher samples (FKL -> A) and of FTL on RKL (-> G), both on sampled teachers.
low-prob (T7)          teachers (0.9, 0.1) x m and (e, 1-e): G(correct) against e (e* = 1/82),
    against m and the vetoing teacher's weight; the learners against the three teachers; rounds until
    the on-policy learner pushes the correct token below 1/2; FTL's regret constant against e.
prefix-bias (T8)       g(C) against H on the SPEC rows (H* marked), beside l and the mixture; the
    fraction of random finite-state instances whose g prefers the incorrect first token; the
    sequence-level RKL learner (-> g), the per-token one (-> l) and per-state KT (-> mixture).

Each mechanism is a list of cells (data below); a finished cell is saved atomically to OUT/cells/,
so an interrupted run resumes (--no-resume recomputes). Same seeds, same bytes.
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import aggregation as ag  # noqa: E402
from aggregation import examples  # noqa: E402
from sims import learners as L  # noqa: E402
from sims.storage import atomic_write, remove_stale_temps  # noqa: E402
from sims.cli import Parser, int_at_least  # noqa: E402
from sims.regret import load_cell, save_cell  # noqa: E402

MECHANISMS = ("confident-expert", "low-prob", "prefix-bias")
COLUMNS = ["mechanism", "part", "learner", "setting", "x_name", "x", "seed", "t", "quantity", "value"]
DEFAULT_OUT = os.path.join("results", "mechanisms")
FLOAT_FORMAT = "%.10g"
PROG = "mechanisms.py"

# ------------------------------------------------------------------------------------------------
# the settings (data, not code)
# ------------------------------------------------------------------------------------------------
SIZES = {   # full run / --quick
    "seeds": (10, 3),
    "rounds": (100_000, 2_000),               # learned curves
    "kt_vocab_rounds": (1_000_000, 20_000),   # KT needs t >> n/2 rounds to leave its uniform prior
    "ftl_vocab_rounds": (10_000, 500),        # FTL costs O(n) a round
    "veto_rounds": (100_000, 3_000),          # dense grid: every round
    "veto_seeds": (20, 4),
    "alternating_rounds": (1_000_000, 10_000),
    "iid_rounds": (100_000, 5_000),
    "instances": (400, 40),                   # random prefix-bias family, per disagreement level
}

CE_D = (0.05, 1e-2, 1e-4, 1e-8)               # SPEC 1 table (K = 2, w = 1/2)
CE_K = (2, 5, 10, 50)                         # SPEC 1, d = 1e-4, equal weights
CE_K_D = 1e-4
CE_VOCAB = (3, 100, 10_000)
CE_VOCAB_MASS = 1e-8                          # the expert's total mass off its top token, d = mass/(n-1)
LP_E_SPEC = (0.1, 0.02, 0.01, 1e-3, 1e-6, 0.0)
LP_E_LEARNED = (0.1, 0.02, 0.01, 1e-3, 1e-6)
LP_E_VETO = (1e-2, 5e-3, 2e-3, 1e-3, 1e-4, 1e-6, 1e-9, 1e-12)
LP_E_REGRET = (0.1, 1e-2, 1e-3, 1e-4, 1e-6)
LP_AGREE = (1, 2, 3, 5)
PB_ROWS = (   # SPEC 2 table: p_k(C), continuation A_k after C, weights
    ((0.9, 0.9), ((0.9, 0.1), (0.1, 0.9)), (0.5, 0.5)),
    ((0.9, 0.9), ((0.8, 0.2), (0.2, 0.8)), (0.5, 0.5)),
    ((0.99, 0.8), ((0.8, 0.2), (0.2, 0.8)), (0.5, 0.5)),
    ((0.9, 0.9), ((0.8, 0.2), (0.2, 0.8)), (0.8, 0.2)),
)
PB_H_MAX = 30
PB_LEARNED = ((0, 2), (0, 8), (2, 6), (2, 20))   # (SPEC row, H): one H below H*, one above
PB_SIGMAS = (0.25, 0.5, 1.0, 2.0, 4.0)
PB_H = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)

KT = "KT on teacher samples (FKL)"
FTL = "FTL, sampled teacher scores q (RKL)"
ROLLOUT = "FTL on own rollouts (RKL)"
SEQ_RKL = "sequence-level RKL, reward-to-go"
TOKEN_RKL = "per-token RKL, discount 0"
STATE_KT = "per-state KT on teacher samples (FKL)"


# ------------------------------------------------------------------------------------------------
# exact values (SPEC 1, 2)
# ------------------------------------------------------------------------------------------------
def confident_expert_pools(d, K=2, n=3, expert_weight=None):
    """Top probabilities (A(0), G(0)) of one expert and K - 1 uniform teachers (SPEC 1).

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


def low_prob_teachers(e, n_agree=2):
    """``n_agree`` teachers (0.9, 0.1) and one (e, 1 - e); token 0 is correct (SPEC 1); (n_agree + 1, 2)."""
    return np.vstack([np.tile([0.9, 0.1], (n_agree, 1)), [[e, 1.0 - e]]])


def low_prob_weights(n_agree=2, veto_weight=None):
    """Equal weights, or ``veto_weight`` on the last teacher and (1 - veto_weight)/n_agree on the others."""
    if veto_weight is None:
        return np.full(n_agree + 1, 1.0 / (n_agree + 1))
    return np.append(np.full(n_agree, (1.0 - veto_weight) / n_agree), veto_weight)


def low_prob_pools(e, n_agree=2, veto_weight=None):
    """(A(0), G(0)) of the low-probability teachers (SPEC 1). With two agreeing teachers at w = 1/3,
    G(0) = 1 / (1 + (0.01 (1-e) / (0.81 e))^{1/3}), and G(0) = 0 at e = 0 (the veto)."""
    p = low_prob_teachers(e, n_agree)
    w = low_prob_weights(n_agree, veto_weight)
    return float(ag.arithmetic_pool(p, w)[0]), float(ag.geometric_pool(p, w)[0])


def veto_threshold(n_agree=2, veto_weight=None):
    """e* at which G(0) = 1/2: W_agree ln 9 = w_veto ln((1 - e)/e), so e* = 1 / (1 + 9^{W_agree / w_veto}).

    Equal weights: e* = 1 / (1 + 9^m) for m agreeing teachers (1/82 for m = 2, SPEC 1)."""
    w = low_prob_weights(n_agree, veto_weight)
    return 1.0 / (1.0 + 9.0 ** (w[:-1].sum() / w[-1]))


def first_token_g(teachers, weights, h_max, token=0):
    """g(token | start) when H = 0, 1, ..., h_max more tokens follow the first; (h_max + 1,).

    One backward recursion of horizon h_max + 1 (SPEC 2): on a time-homogeneous machine the row
    ln g[h, start] with h_max + 1 - h tokens left is the first-token conditional for H = h_max - h."""
    log_g = ag.sequence_geometric_conditionals(teachers, weights, h_max + 1)
    return np.exp(log_g[::-1, teachers.start, token])


def prefix_bias_exact(p_correct, continuation, weights, h_max=PB_H_MAX):
    """The prefix-bias example of SPEC 2 on ``examples.prefix_bias_teachers``.

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


# ------------------------------------------------------------------------------------------------
# the random prefix-bias family
# ------------------------------------------------------------------------------------------------
def random_prefix_teachers(seed, sigma, n_teachers=3, n_states=4):
    """Random binary-token teachers where every teacher prefers the correct first token.

    State 0 is the start: token 0 = C enters a region of ``n_states`` states, token 1 = I another;
    each region's transitions are uniform within it (seeded) and never end. p_k(C | start) ~ U(0.55, 0.95).
    In a region state s teacher k's row is softmax(b_s + sigma eps_{k,s}), b, eps ~ N(0, 1): sigma
    is the teachers' disagreement (sigma = 0: identical teachers, Z = 1, no flip). The same seed gives
    the same b, eps at every sigma.
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
    return ag.FiniteStateTeachers(next_state, log_probs)


def growth_rate(teachers, weights, state):
    """lim_H Z(state, H)^{1/H}: the spectral radius of the pooled matrix M[s, s'] = sum_{a: next(s,a)=s'}
    prod_k p_k(a|s)^{w_k} restricted to the states reachable from ``state`` (SPEC 2)."""
    reward = np.asarray(weights, dtype=float) @ teachers.log_probs.reshape(teachers.K, -1)
    reward = reward.reshape(teachers.S, teachers.n)
    M = np.zeros((teachers.S, teachers.S))
    for s in range(teachers.S):
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
            t = random_prefix_teachers([seed, i], sigma, n_teachers, n_states)   # same instances at every sigma
            g = first_token_g(t, w, int(h_values.max()))
            flips += g[h_values] < 0.5
            below += growth_rate(t, w, 1) < growth_rate(t, w, 1 + n_states) * (1 - 1e-9)   # ulps: a tie
            gap += -np.mean(ag.log_partition(t.log_probs[:, 1:], w))
    return flips / n_instances, below / n_instances, gap / n_instances


# ------------------------------------------------------------------------------------------------
# learned curves: the existing learners, tracking q_t at log-grid rounds
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
        g = grid if grid is not None else L.log_grid(T)
        if name == KT:
            res = L.add_beta_tabular(p, weights, 0.5, T, seeds, grid=g, track=[token])
        elif name == FTL:
            res = L.rkl_tabular(np.log(p), weights, "sample", "1/t", T, seeds, grid=g, track=[token])
        elif name == ROLLOUT:
            res = L.rkl_sequence(one_context_machine(p), weights, 1, "sequence", T, seeds, grid=g, track=[token])
        else:
            raise ValueError(f"unknown learner {name!r}")
        out[name] = (res["grid"], res["track"][:, :, 0])
    return out


def learn_prefix(teachers, weights, horizon, n_rounds, seeds, token=0):
    """First-token probability q_t(C | start) of the three sequence learners (SPEC 2, "which target").

    SEQ_RKL: rkl_sequence 'sequence' (soft-optimal for the running-mean rewards, reward-to-go) -> g;
    TOKEN_RKL: rkl_sequence 'token' (discount 0) -> l; STATE_KT: add_beta_sequence (per-state KT on
    responses y ~ A_seq) -> the mixture's marginal sum_k w_k p_k(C). Returns dict learner -> (grid, (R, G)).
    """
    out = {}
    for name, mode in ((SEQ_RKL, "sequence"), (TOKEN_RKL, "token")):
        res = L.rkl_sequence(teachers, weights, horizon, mode, n_rounds, seeds, track=[token])
        out[name] = (res["grid"], res["track"][:, :, 0])
    res = L.add_beta_sequence(teachers, weights, horizon, 0.5, n_rounds, seeds, track=[token])
    out[STATE_KT] = (res["grid"], res["track"][:, :, 0])
    return out


# ------------------------------------------------------------------------------------------------
# rates: the asymptotic s.d. of the learned q_T (CLT + delta method), which sets the tests' tolerances
# ------------------------------------------------------------------------------------------------
def learner_sd(probs, weights, n_rounds, learner, token=0):
    """Asymptotic s.d. of q_T(token) of a one-context learner over seeds (SPEC 3: O(1/sqrt T) rates).

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
    """Asymptotic s.d. of q_T(C | start) of the sequence learners on the prefix-bias machine (SPEC 2, 3).

    SEQ_RKL: logit g(C) = rhat(0,C) - rhat(0,I) + ln Zhat(C), ln Zhat(C) = H ln sum_a exp rhat(1,a); the
    running means see N ≈ T g, T (1-g) and g H T l_c(a) teacher scores (k ~ w), so
    Var(logit) = [V(C)/g + V(I)/(1-g) + H sum_a l_c(a) V_c(a) / g] / T with V = Var_w(ln p_k) and l_c the
    continuation's local pool (the I branch is shared by all teachers: no noise). TOKEN_RKL: the same
    without the continuation term, with l in place of g. STATE_KT: sqrt(m (1 - m) / T), m = sum_k w_k p_k.
    """
    w = np.asarray(weights, dtype=float)
    p = np.asarray(p_correct, dtype=float)
    if learner == STATE_KT:
        m = float(w @ p)
        return math.sqrt(m * (1 - m) / n_rounds)
    var = lambda lp: float(w @ lp ** 2 - (w @ lp) ** 2)                  # noqa: E731
    lc = np.log(np.asarray(continuation, dtype=float))
    local_c = ag.geometric_pool(np.exp(lc), w)
    ex = prefix_bias_exact(p_correct, continuation, weights, h_max=horizon_after)
    if learner == SEQ_RKL:
        q = float(ex["g"][horizon_after])
        extra = horizon_after * sum(local_c[a] * var(lc[:, a]) for a in range(lc.shape[1])) / q
    elif learner == TOKEN_RKL:
        q, extra = ex["local"], 0.0
    else:
        raise ValueError(f"unknown learner {learner!r}")
    logit_var = (var(np.log(p)) / q + var(np.log1p(-p)) / (1 - q) + extra) / n_rounds
    return q * (1 - q) * math.sqrt(logit_var)


def rounds_to_veto(q, grid):
    """First round from which q_t(correct) < 1/2 at every later round of ``grid`` (a dense grid 1..T);
    NaN where q_T >= 1/2 (not vetoed by the end). q: (R, G); returns (R,)."""
    above = np.asarray(q) >= 0.5
    G = above.shape[1]
    last = np.where(above.any(axis=1), G - 1 - np.argmax(above[:, ::-1], axis=1), -1)
    rounds = np.asarray(grid)[np.minimum(last + 1, G - 1)].astype(float)
    rounds[above[:, -1]] = np.nan
    return rounds


# ------------------------------------------------------------------------------------------------
# cells
# ------------------------------------------------------------------------------------------------
@dataclass
class Config:
    """Sizes of a run; ``seeds=None`` takes the mode's default (full or --quick)."""
    quick: bool = False
    seeds: int | None = None
    base_seed: int = 0

    def size(self, name):
        full, quick = SIZES[name]
        if self.seeds is not None and name in ("seeds", "veto_seeds"):
            return self.seeds
        return quick if self.quick else full


@dataclass
class Cell:
    """One independent unit of work of one mechanism."""
    mechanism: str
    part: str
    label: str
    base_seed: int = 0
    params: dict = field(default_factory=dict)

    @property
    def key(self):
        blob = json.dumps(asdict(self), sort_keys=True, default=str)
        return f"{self.mechanism}__{hashlib.sha1(blob.encode()).hexdigest()[:16]}"

    @property
    def stream_key(self):
        """What the random streams depend on: the setting, not the sizes."""
        return json.dumps([self.mechanism, self.part, self.label])


def cells_for(mechanism, config):
    """Every cell of one mechanism, in the order of its CSV."""
    c, b = config, config.base_seed
    learned = {"n_rounds": c.size("rounds"), "n_seeds": c.size("seeds")}
    out = [Cell(mechanism, "exact", "closed forms", b)]
    if mechanism == "confident-expert":
        for K in CE_K:
            out.append(Cell(mechanism, "learned", f"K={K}", b, {"K": K, **learned}))
        for n in CE_VOCAB:
            out.append(Cell(mechanism, "learned-vocab", f"n={n}", b,
                            {"n": n, "kt_rounds": c.size("kt_vocab_rounds"),
                             "ftl_rounds": c.size("ftl_vocab_rounds"), "n_seeds": c.size("seeds")}))
    elif mechanism == "low-prob":
        for e in LP_E_LEARNED:
            out.append(Cell(mechanism, "learned", f"e={e:g}", b, {"e": e, **learned}))
        for e in LP_E_VETO:
            out.append(Cell(mechanism, "veto-rounds", f"e={e:g}, every round", b,
                            {"e": e, "n_rounds": c.size("veto_rounds"), "n_seeds": c.size("veto_seeds")}))
        out.append(Cell(mechanism, "regret-constant", "FTL", b,
                        {"alternating_rounds": c.size("alternating_rounds"), "iid_rounds": c.size("iid_rounds"),
                         "n_seeds": c.size("seeds")}))
    elif mechanism == "prefix-bias":
        for sigma in PB_SIGMAS:
            out.append(Cell(mechanism, "random-family", f"sigma={sigma:g}", b,
                            {"sigma": sigma, "n_instances": c.size("instances"), "H": PB_H}))
        for row, H in PB_LEARNED:
            out.append(Cell(mechanism, "learned", f"row {row + 1}, H={H}", b, {"row": row, "H": H, **learned}))
    else:
        raise ValueError(f"unknown mechanism {mechanism!r}")
    return out


def _frame(cell, part=None, **cols):
    """A tidy DataFrame of the cell; scalars broadcast, missing columns are empty (NaN)."""
    n = max((np.size(v) for v in cols.values() if not isinstance(v, str)), default=1)
    data = {"mechanism": cell.mechanism, "part": part or cell.part}
    for name in COLUMNS[2:]:
        v = cols.get(name, np.nan)
        data[name] = v if isinstance(v, str) or np.ndim(v) == 0 else np.asarray(v)
    return pd.DataFrame(data, index=range(n))[COLUMNS]


def _learned_rows(cell, curves, setting, x_name, x, quantity):
    frames = []
    for name, (grid, q) in curves.items():
        R, G = q.shape
        frames.append(_frame(cell, "learned", learner=name, setting=setting, x_name=x_name, x=x,
                             seed=np.repeat(np.arange(R), G), t=np.tile(grid, R), quantity=quantity, value=q.ravel()))
    return frames


def _targets(cell, targets, setting, x_name, x, quantity):
    return [_frame(cell, "target", learner=name, setting=setting, x_name=x_name, x=x, quantity=quantity, value=v)
            for name, v in targets.items()]


TOP = "top-token probability"
CORRECT = "probability of the correct token"
FIRST_C = "first-token probability of C"


def _pool_rows(cell, setting, x_name, xs, pools, quantity, part="exact"):
    """Rows of A and G, ``pools(x) -> (A, G)``, at every x of ``xs``."""
    values = np.array([pools(x) for x in xs])
    return [_frame(cell, part, learner=lab, setting=setting, x_name=x_name, x=np.asarray(xs), quantity=quantity,
                   value=values[:, j]) for j, lab in enumerate(("A", "G"))]


def _run_confident_expert(cell, seeds):
    """Exact A and G top probabilities against d, K, the expert's weight and n; or one learned setting."""
    p = cell.params
    if cell.part == "exact":
        d_grid = np.unique(np.concatenate([np.logspace(-12, math.log10(0.3), 61), CE_D]))
        frames = (_pool_rows(cell, "K=2, w=1/2", "d", d_grid, confident_expert_pools, TOP)
                  + _pool_rows(cell, "K=2, w=1/2", "d", CE_D, confident_expert_pools, TOP, part="spec"))
        by_k = lambda K: confident_expert_pools(CE_K_D, K=int(K))               # noqa: E731
        frames += (_pool_rows(cell, f"d={CE_K_D:g}, equal w", "K", np.arange(2, 51), by_k, TOP)
                   + _pool_rows(cell, f"d={CE_K_D:g}, equal w", "K", CE_K, by_k, TOP, part="spec"))
        for d in (1e-2, 1e-4, 1e-8):
            frames += _pool_rows(cell, f"K=2, d={d:g}", "expert weight", np.linspace(0.02, 0.98, 49),
                                 lambda we, d=d: confident_expert_pools(d, expert_weight=we), TOP)
        n_grid = np.unique(np.round(np.logspace(math.log10(3), 4, 25)).astype(int))
        frames += _pool_rows(cell, f"K=2, expert mass off top={CE_VOCAB_MASS:g}", "n", n_grid,
                             lambda n: confident_expert_pools(CE_VOCAB_MASS / (n - 1), n=int(n)), TOP)
        return frames
    if cell.part == "learned":
        K = p["K"]
        probs, w = examples.confident_expert(CE_K_D, n_uniform=K - 1), np.full(K, 1.0 / K)
        setting, x_name, x = f"K={K}, d={CE_K_D:g}", "K", K
        curves = learn_one_context(probs, w, p["n_rounds"], seeds)
    else:
        n = p["n"]
        probs, w = examples.confident_expert(CE_VOCAB_MASS / (n - 1), n=n), np.array([0.5, 0.5])
        setting, x_name, x = f"n={n}, expert mass off top={CE_VOCAB_MASS:g}", "n", n
        curves = learn_one_context(probs, w, {KT: p["kt_rounds"], FTL: p["ftl_rounds"]}, seeds,
                                   learners=(KT, FTL))
    targets = {"A": float(ag.arithmetic_pool(probs, w)[0]), "G": float(ag.geometric_pool(probs, w)[0])}
    return (_learned_rows(cell, curves, setting, x_name, x, TOP)
            + _targets(cell, targets, setting, x_name, x, TOP))


def _run_low_prob(cell, seeds):
    """Exact G(correct) against e, m and the weights; learned curves; rounds to the veto; regret constants."""
    p = cell.params
    frames = []
    if cell.part == "exact":
        e_grid = np.unique(np.concatenate([np.logspace(-12, math.log10(0.5), 89), LP_E_SPEC[:-1]]))
        for m in LP_AGREE:
            frames += _pool_rows(cell, f"{m} agreeing, equal w", "e", e_grid,
                                 lambda e, m=m: low_prob_pools(e, m), CORRECT)
            frames.append(_frame(cell, learner="e*", setting=f"{m} agreeing, equal w", x_name="e",
                                 quantity="veto threshold e*", value=veto_threshold(m)))
        frames += _pool_rows(cell, "2 agreeing, equal w", "e", LP_E_SPEC, low_prob_pools, CORRECT, part="spec")
        w_grid = np.linspace(0.02, 0.98, 49)
        for e in (1e-2, 1e-3, 1e-6):
            frames += _pool_rows(cell, f"2 agreeing, e={e:g}", "veto weight", w_grid,
                                 lambda wv, e=e: low_prob_pools(e, 2, wv), CORRECT)
        frames.append(_frame(cell, learner="e*", setting="2 agreeing", x_name="veto weight", x=w_grid,
                             quantity="veto threshold e*", value=[veto_threshold(2, wv) for wv in w_grid]))
        return frames
    if cell.part == "regret-constant":
        for e in LP_E_REGRET:
            res = L.rkl_tabular(np.log([[1 - e, e], [e, 1 - e]]), [0.5, 0.5], "alternating", "1/t",
                                p["alternating_rounds"], seeds[:1])
            slope = L.fit_slope(res["grid"], res["regret"])
            frames.append(_frame(cell, learner="FTL, alternating (1-e, e), (e, 1-e)", setting="alternating",
                                 x_name="e", x=e, quantity=["slope", "slope_lo", "slope_hi", "theory slope"],
                                 value=[*slope, L.alternating_constant(e)]))
            lp = np.log(low_prob_teachers(e))
            res = L.rkl_tabular(lp, np.full(3, 1 / 3), "sample", "1/t", p["iid_rounds"], seeds)
            slope = L.fit_slope(res["grid"], res["regret"])
            frames.append(_frame(cell, learner="FTL, low-prob teachers i.i.d. (sample feedback)", setting="i.i.d.",
                                 x_name="e", x=e, quantity=["slope", "slope_lo", "slope_hi", "theory slope"],
                                 value=[*slope, L.ftl_constant(lp, np.full(3, 1 / 3))]))
        return frames
    e = p["e"]
    probs, w = low_prob_teachers(e), np.full(3, 1 / 3)
    setting = cell.label
    if cell.part == "learned":
        curves = learn_one_context(probs, w, p["n_rounds"], seeds)
        a, g = low_prob_pools(e)
        return (_learned_rows(cell, curves, setting, "e", e, CORRECT)
                + _targets(cell, {"A": a, "G": g}, setting, "e", e, CORRECT))
    # veto-rounds: every round tracked, only the first round of the final veto is kept
    T, R = p["n_rounds"], p["n_seeds"]
    curves = learn_one_context(probs, w, T, seeds, learners=(FTL, ROLLOUT), grid=np.arange(1, T + 1))
    d = np.log(probs[:, 0]) - np.log(probs[:, 1])               # per-teacher log-odds of the correct token
    scale = float(np.var(d) / np.mean(d) ** 2)                  # drift-diffusion scale (sigma / mu)^2
    for name, (grid, q) in curves.items():
        frames.append(_frame(cell, learner=name, setting=setting, x_name="e", x=e, seed=np.arange(R), t=T,
                             quantity="rounds until q(correct) < 1/2 for good", value=rounds_to_veto(q, grid)))
    frames.append(_frame(cell, "target", learner="(sigma/mu)^2 of the log-odds", setting=setting, x_name="e", x=e,
                         quantity="rounds until q(correct) < 1/2 for good", value=scale))
    return frames


def _run_prefix_bias(cell, seeds):
    """Exact g(C) against H on the SPEC rows; one random-family disagreement level; or one learned setting."""
    p = cell.params
    frames = []
    if cell.part == "exact":
        for i, (pc, cont, w) in enumerate(PB_ROWS):
            ex = prefix_bias_exact(pc, cont, w)
            setting = f"row {i + 1}: p={pc}, A={cont}, w={w}"
            H = np.arange(PB_H_MAX + 1)
            frames += [_frame(cell, learner="g (sequence-level geometric)", setting=setting, x_name="H", x=H,
                              quantity=FIRST_C, value=ex["g"]),
                       _frame(cell, learner="l (local geometric)", setting=setting, x_name="H", x=H,
                              quantity=FIRST_C, value=ex["local"]),
                       _frame(cell, learner="mixture marginal", setting=setting, x_name="H", x=H,
                              quantity=FIRST_C, value=ex["mixture"]),
                       _frame(cell, "spec", learner="g (sequence-level geometric)", setting=setting,
                              quantity=["rho", "H*", "first H with g(C) < 1/2"],
                              value=[ex["rho"], ex["h_star"], ex["first_flip"]])]
        return frames
    if cell.part == "random-family":
        frac, limit, gap = flip_fractions(p["sigma"], p["H"], p["n_instances"], seed=cell.base_seed)
        setting = f"sigma={p['sigma']:g}"
        return [_frame(cell, learner="g (sequence-level geometric)", setting=setting, x_name="H", x=np.array(p["H"]),
                       quantity="fraction with g(C) < 1/2", value=frac),
                _frame(cell, "target", learner="g (sequence-level geometric)", setting=setting, x_name="sigma",
                       x=p["sigma"], quantity=["limit fraction as H -> inf", "mean -ln z per token (nats)",
                                               "instances"], value=[limit, gap, p["n_instances"]])]
    pc, cont, w = PB_ROWS[p["row"]]
    ex = prefix_bias_exact(pc, cont, w, h_max=max(p["H"], PB_H_MAX))
    setting = f"row {p['row'] + 1}, H={p['H']} (H*={ex['h_star']:.2f})"
    curves = learn_prefix(ex["teachers"], np.array(w), p["H"] + 1, p["n_rounds"], seeds)
    targets = {"g (sequence-level geometric)": float(ex["g"][p["H"]]), "l (local geometric)": ex["local"],
               "mixture marginal": ex["mixture"]}
    return (_learned_rows(cell, curves, setting, "H", p["H"], FIRST_C)
            + _targets(cell, targets, setting, "H", p["H"], FIRST_C))


RUNNERS = {"confident-expert": _run_confident_expert, "low-prob": _run_low_prob, "prefix-bias": _run_prefix_bias}


def run_cell(cell):
    """Run one cell; returns its tidy DataFrame (COLUMNS)."""
    seeds = L.cell_seeds(cell.base_seed, cell.stream_key, cell.params.get("n_seeds", 1))
    frames = RUNNERS[cell.mechanism](cell, seeds)
    return pd.concat(frames, ignore_index=True)[COLUMNS]


def final_values(df):
    """Learned q_T at the last round, mean and s.d. over seeds, beside each target; one row per
    (setting, learner)."""
    learned = df[df.part == "learned"]
    last = learned[learned.t == learned.groupby(["setting", "learner"]).t.transform("max")]
    summary = last.groupby(["setting", "learner"], sort=False).agg(T=("t", "max"), mean=("value", "mean"),
                                                                   sd=("value", "std")).reset_index()
    summary["T"] = summary["T"].astype(int)
    targets = {}
    for row in df[df.part == "target"].itertuples():
        targets.setdefault(row.setting, []).append(f"{row.learner}={row.value:.4g}")
    summary["targets"] = summary.setting.map(lambda s: "; ".join(targets.get(s, [])))
    return summary


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
def parse_args(argv):
    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("mechanism", nargs="?", default="all", choices=MECHANISMS + ("all",),
                    help="which mechanism (default all)")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds); the tests use it")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default results/mechanisms)")
    ap.add_argument("--figures", default=None,
                    help="folder of the PNGs (default figures/, or OUT/figures when --out is given)")
    ap.add_argument("--no-figures", action="store_true", help="write the CSVs only")
    ap.add_argument("--seeds", type=int_at_least(1, "--seeds"), default=None, help="seeds per learned curve")
    ap.add_argument("--base-seed", type=int_at_least(0, "--base-seed"), default=0)
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse the finished cells in OUT/cells (default on)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    args = ap.parse_args(argv)
    for option, folder in (("--out", args.out), ("--figures", args.figures)):
        if folder is None:
            continue
        if not folder.strip():
            ap.error(f"{option} must not be empty")
        if os.path.exists(folder) and not os.path.isdir(folder):
            ap.error(f"{option} {folder!r} exists and is not a folder")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            ap.error(f"cannot create {option} folder {folder!r}: {exc.strerror}")
        if not os.access(folder, os.W_OK):
            ap.error(f"{option} folder {folder!r} is not writable")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from tqdm import tqdm
    config = Config(quick=args.quick, seeds=args.seeds, base_seed=args.base_seed)
    names = MECHANISMS if args.mechanism == "all" else (args.mechanism,)
    cells = {name: cells_for(name, config) for name in names}
    every = [c for name in names for c in cells[name]]
    remove_stale_temps(os.path.join(args.out, "cells"))         # left by a killed run
    done = {c.key for c in every if args.resume and load_cell(args.out, c) is not None}
    start = time.time()
    with tqdm(total=len(every), desc="mechanism cells", unit="cell", disable=args.quiet, file=sys.stderr) as bar:
        bar.update(len(done))
        for cell in every:
            if cell.key in done:
                continue
            bar.set_postfix_str(f"{cell.mechanism} {cell.part} {cell.label}")
            save_cell(args.out, cell, run_cell(cell))
            bar.update()
    frames = {}
    for name in names:
        df = pd.concat([load_cell(args.out, c) for c in cells[name]], ignore_index=True)
        path = os.path.join(args.out, f"{name}.csv")
        atomic_write(path, lambda tmp, df=df: df.to_csv(tmp, index=False, float_format=FLOAT_FORMAT))
        frames[name] = pd.read_csv(path)          # the figures are functions of the CSV, nothing else
    print(f"{PROG}: {len(every)} cells ({len(done)} resumed) in {time.time() - start:.1f} s -> {args.out}",
          file=sys.stderr)
    if not args.quiet:
        with pd.option_context("display.width", 200, "display.max_colwidth", 80, "display.max_rows", 100):
            for name, df in frames.items():
                print(f"\n{name}: learned q_T (mean, s.d. over seeds) and exact targets\n"
                      f"{final_values(df).to_string(index=False, float_format=lambda v: f'{v:.4f}')}",
                      file=sys.stderr)
    if not args.no_figures:
        default_out = os.path.normpath(args.out) == os.path.normpath(DEFAULT_OUT)
        fig_dir = args.figures or ("figures" if default_out else os.path.join(args.out, "figures"))
        from figures.mechanisms import save_figure
        for name, df in frames.items():
            path = save_figure(name, df, fig_dir)
            if not args.quiet:
                print(f"{PROG}: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
