"""Students distilled from exact finite-state teachers across the rollout spectrum (SPEC 4-5; E1, E2, E5).

Training sequences come from the student with probability alpha and from a teacher k ~ w with
1 - alpha (or, ``switch=True``, from a teacher up to a uniform position and from the student after).
Every objective is computed by the loss code of ``llm_bridge.losses``, for both students:

    fkl         forward KL with the teachers' full conditionals       target: A = sum_k w_k p_k (every state)
    sft         cross-entropy on a sampled teacher token              target: sft_fixed_point(alpha), below
    rkl         reverse KL with the full conditionals                 target: l
    k1, k2, k3  the estimator on the pooled log-ratio, as a loss      k1: none (no drift); k2, k3: l
    k3-teacher  k3 on one sampled teacher's log-ratio (routed)        target: A
    pg0, pg1    on-policy RKL policy gradient, gamma = 0 / 1          l / g (the conditionals of G_seq)

on student samples; teacher samples shift some of these (the k-estimators without importance weights)
and make k1 diverge. Students: a tabular softmax (one logit row per (step, state), vectorised over
every run of a sweep in one tensor) and a shared-parameter tiny Qwen2 reading the token prefix. The
outcomes are exact: the sequence-level KL_seq(q || P) on the student's own rollouts for each target
P (aggregation.sequence_kl), the probability of a correct response, divergence, and the steps until
the named target is within a tolerance.
"""

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd
import torch

from scipy.special import logsumexp

import aggregation as ag
from aggregation import examples
from llm_bridge.losses import forward_kl, kl_estimator_loss, reverse_kl, rkl_policy_gradient, token_log_probs
from llm_bridge.tabular import target_log_probs, tree_responses
from sims.estimation import estimator_derivatives

TARGET_OF = {"fkl": "arithmetic", "sft": "sft", "rkl": "local", "k1": None, "k2": "local", "k3": "local",
             "k3-teacher": "arithmetic", "pg0": "local", "pg1": "geometric"}
OBJECTIVES = tuple(TARGET_OF)
TARGETS = ("arithmetic", "local", "geometric", "mixture")
DIVERGED_LOGIT = 25.0          # a logit this far from its row's mean (q below e^-25): driven to a vertex


@dataclass
class Task:
    """K teachers on a finite-state machine, their weights and the response length; token 0 at the start
    is the correct first answer when ``correct_first`` (every teacher prefers it)."""
    teachers: ag.FiniteStateTeachers
    weights: np.ndarray
    horizon: int
    name: str = ""

    @property
    def K(self):
        return self.teachers.K

    @cached_property
    def tensors(self):
        """(next_state, log_probs float32, weights float64) as torch tensors, made once."""
        t = self.teachers
        return (torch.as_tensor(np.array(t.next_state)), torch.as_tensor(np.array(t.log_probs), dtype=torch.float32),
                torch.as_tensor(self.weights, dtype=torch.float64))


def make_task(kind="tree", K=2, seed=0, horizon=None):
    """'tree': a prefix tree of depth 3 over 3 tokens (13 states); 'loop': 6 looping states over 3 tokens
    for long horizons. The teachers are Dirichlet(0.5) rows, except at the start: every teacher gives
    token 0 (the correct first token) probability 0.55 and splits the rest differently. K = 1 gives a
    single teacher."""
    rng = np.random.default_rng(1000 + seed)
    if kind == "tree":
        H = horizon or 3
        base = examples.prefix_tree(K, H, 3, seed=seed, concentration=0.5)
        next_state, log_probs = base.next_state, np.array(base.log_probs)
    elif kind == "loop":
        H = horizon or 16
        S, n = 6, 3
        next_state = rng.integers(0, S, size=(S, n))
        log_probs = np.log(rng.dirichlet(np.full(n, 0.5), size=(K, S)))
    else:
        raise ValueError(f"kind = {kind!r} must be 'tree' or 'loop'")
    first = rng.dirichlet(np.ones(2), size=K) * 0.45
    log_probs[:, 0] = np.log(np.column_stack([1 - first.sum(1), first]))
    w = np.full(K, 1.0 / K) if K != 2 else np.array([0.6, 0.4])
    return Task(ag.FiniteStateTeachers(next_state, log_probs), w, H, f"{kind} K={K}")


def target_table(task, name, alpha=None):
    """The target conditionals (H, S, n) (log-probs) that a loss reaches at every step and state:
    'arithmetic' sum_k w_k p_k, 'local' l, 'geometric' g, 'mixture' the sequence-level mixture's
    conditionals (posterior weights: what SFT on teacher rollouts reaches, alpha = 0), 'sft' the SFT fixed
    point at ``alpha``."""
    if name in TARGETS[:3]:
        return np.array(target_log_probs(task.teachers, task.weights, task.horizon, name))
    if name == "mixture":
        return sft_fixed_point(task, 0.0)
    if name == "sft":
        return sft_fixed_point(task, alpha)
    raise ValueError(f"target = {name!r} must be one of {TARGETS + ('sft',)}")


def sft_fixed_point(task, alpha):
    """The fixed point of SFT (cross-entropy on a sampled teacher token) when a sequence comes from the
    student with probability alpha and from teacher k ~ w otherwise, every token of a teacher's sequence
    labelled by that teacher and every student token by a teacher k ~ w (SPEC 2, 5).

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
            lq = z - logsumexp(z, axis=1, keepdims=True)
            q = np.exp(lq)
            r_t = lp - lq if routed else np.broadcast_to(pooled - lq, lp.shape)       # (K, S, n)
            c_t = np.exp(lq - lp) if importance else 1.0
            coef = -np.einsum("ks,ksn->sn", tm, p * c_t * deriv(r_t)[est])
            student = np.tensordot(w, deriv(lp - lq)[est], axes=1) if routed else deriv(pooled - lq)[est]
            coef -= sm[:, None] * q * student
            return (coef - q * coef.sum(1, keepdims=True)) * scale
        z = _stable_zero(expected_gradient, np.zeros((t.S, t.n)), tol,
                         f"estimator_fixed_point({objective}, alpha={alpha}), step {h}")
        lq = z - logsumexp(z, axis=1, keepdims=True)
        q = np.exp(lq)
        out[h] = lq
        d_q = _step_occupancy(t, d_q, q)
    return out


def _stable_zero(F, z, tol, what, flow_tol=1e-3, max_flow=200_000, max_newton=50, eps=1e-7):
    """A zero of F (z (S, n) logits, F(z) the expected gradient: invariant to adding a constant to a row)
    that gradient descent reaches: the flow z <- z - F(z) until |F| < flow_tol (so a repelling or spurious
    zero is never picked), then Newton steps with a finite-difference Jacobian (the gauge direction pinned
    by adding 11^T / n) to |F| < tol."""
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
        z = z - np.linalg.solve(J, G[..., None])[..., 0]
        G = F(z)
    raise RuntimeError(f"{what}: Newton did not converge (largest expected gradient {np.abs(G).max():.2g})")


def _step_occupancy(t, d, q):
    """One step of the occupancy recursion: d'(s') = sum_{s, a -> s'} d(s) q(a | s)."""
    nxt = np.zeros(t.S)
    ok = t.next_state >= 0
    np.add.at(nxt, t.next_state[ok], (d[:, None] * q)[ok])
    return nxt


def fixed_point(task, config):
    """The derived fixed point (H, S, n) of a tabular student under one spectrum configuration, or None
    where none is derived: fkl -> A and rkl -> l (any sampling); sft -> :func:`sft_fixed_point`; k2, k3,
    k3-teacher -> :func:`estimator_fixed_point`; pg0 / pg1 on the student's samples (or with the
    sequence-level importance weights) -> l / g. None for k1 (no stable point: its expected gradient on
    the teachers' samples pushes q away from their token distribution), for the policy gradients on
    unweighted teacher samples (the leave-one-out baseline couples the states) and for the switch
    variant of the sampled-token objectives."""
    obj, alpha = config["objective"], float(config.get("alpha", 0.0))
    switch, importance = bool(config.get("switch")), bool(config.get("importance"))
    if obj in ("fkl", "rkl"):
        return target_table(task, TARGET_OF[obj])
    if switch or obj == "k1":
        return None
    if obj == "sft":
        return sft_fixed_point(task, alpha)
    if obj in ("k2", "k3", "k3-teacher"):
        return estimator_fixed_point(task, obj, alpha, importance)
    return target_table(task, TARGET_OF[obj]) if (importance or alpha == 1.0) else None


class Evaluator:
    """Exact outcomes of tabular policies on one task; the target tables (and, with ``fixed_points``,
    each configuration's derived fixed point) are computed once."""

    def __init__(self, task, fixed_points=True):
        self.task = task
        self.tables = {name: target_table(task, name) for name in TARGETS}
        self.fixed_points = fixed_points
        self._cache = {}

    def _table(self, kind, config):
        key = (kind, config["objective"], float(config.get("alpha", 0.0)), bool(config.get("switch")),
               bool(config.get("importance")))
        if key not in self._cache:
            self._cache[key] = (fixed_point(self.task, config) if kind == "fixed_point" else
                                None if key[3] else sft_fixed_point(self.task, key[2]))
        return self._cache[key]

    def __call__(self, log_q, config=None):
        """log_q (H, S, n): KL_seq(q || P) per response on q's own rollouts for every target P, and with a
        spectrum ``config``: kl_sft (SFT's fixed point at its alpha; NaN for the switch variant or another
        objective) and kl_fixed_point (the config's derived fixed point; NaN where none); ``accuracy``
        the probability of the correct first token."""
        t, H = self.task.teachers, self.task.horizon
        tables = dict(self.tables)
        if config is not None:
            tables["sft"] = self._table("sft", config) if config["objective"] == "sft" else None
            tables["fixed_point"] = self._table("fixed_point", config) if self.fixed_points else None
        occ = ag.policy_occupancy(t, H, log_q)[:H, :, None]                # q's occupancy, once for every target
        q = np.exp(log_q)
        out = {f"kl_{name}": math.nan if table is None else   # KL_seq = sum_h,s occ(h, s) KL(q(.|h, s) || P(.|h, s))
               float(np.sum(np.where(q > 0, occ * q * (log_q - table), 0.0))) for name, table in tables.items()}
        out["accuracy"] = float(np.exp(log_q[0, t.start, 0]))
        return out


def _outcome_row(config, seed, step, loss, evaluation, **extra):
    named = TARGET_OF[config["objective"]]
    return dict(config, seed=seed, step=step, loss=loss, kl_named=evaluation.get(f"kl_{named}", math.nan)
                if named else math.nan, **extra, **evaluation)


# ------------------------------------------------------------------------------------------------
# one training batch: rollouts over the spectrum, and the losses of llm_bridge.losses
# ------------------------------------------------------------------------------------------------
@dataclass
class Batch:
    """N sequences of H steps: states, tokens, whether the student generated each token, the generating
    policy's log-prob of it, the teacher that generated (or, for student sequences, scores) each sequence,
    and the SFT label of each position."""
    states: torch.Tensor
    tokens: torch.Tensor
    by_student: torch.Tensor
    gen_logp: torch.Tensor
    teacher: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor


def rollouts(task, student_logp, alpha, switch, n_sequences, gen, labels=True):
    """Sample the batch. student_logp(h, states (N,), tokens (N, h)) -> (N, n) log-probs of the student at
    step h (a tabular student reads the states, a neural one the tokens so far).
    ``alpha`` (N,) or a float: the probability that a sequence is the student's; ``switch``: the teacher
    writes up to a uniform position m in {0..H}, the student after (alpha is then ignored); ``labels``:
    draw SFT's label for each student token (else the labels are the tokens)."""
    t = task.teachers
    N, H = n_sequences, task.horizon
    next_state, teacher_logp, _ = task.tensors
    teacher = torch.multinomial(torch.as_tensor(task.weights, dtype=torch.float32), N, replacement=True, generator=gen)
    if switch:
        m = torch.randint(0, H + 1, (N,), generator=gen)
        student_seq = None
    else:
        a = torch.as_tensor(alpha, dtype=torch.float32).expand(N)
        student_seq = torch.rand(N, generator=gen) < a
    s = torch.full((N,), t.start, dtype=torch.long)
    alive = torch.ones(N, dtype=torch.bool)
    rec = {k: [] for k in ("states", "tokens", "by_student", "gen_logp", "labels", "mask")}
    for h in range(H):
        safe = s.clamp(min=0)
        by_student = (h >= m) if switch else student_seq
        prefix = torch.stack(rec["tokens"], dim=1) if h else torch.zeros(N, 0, dtype=torch.long)
        t_rows = teacher_logp[teacher, safe]                       # student tokens: a teacher labels the state
        rows = torch.where(by_student[:, None], student_logp(h, safe, prefix), t_rows)
        token = torch.multinomial(rows.exp(), 1, generator=gen)[:, 0]
        label = torch.where(by_student, torch.multinomial(t_rows.exp(), 1, generator=gen)[:, 0], token) if labels \
            else token
        for key, value in (("states", safe), ("tokens", token), ("by_student", by_student),
                           ("gen_logp", rows.gather(1, token[:, None])[:, 0]), ("labels", label), ("mask", alive)):
            rec[key].append(value)
        s = torch.where(alive, next_state[safe, token], s)
        alive = alive & (s >= 0)
    stack = {k: torch.stack(v, dim=1) for k, v in rec.items()}
    return Batch(teacher=teacher, **stack)


def position_losses(objective, logits, batch, task, importance=False, groups=None):
    """Per-position losses (N, H) of one objective on a batch, by the loss code of llm_bridge.losses.
    logits (N, H, n) are the student's at the batch's positions (with gradient). ``importance`` (a bool,
    or one per sequence): weight the tokens a teacher generated by q/mu (sequence-level prefix products
    for the policy gradients)."""
    t = task.teachers
    _, teacher_logp, w = task.tensors
    lp_rows = teacher_logp.to(logits.dtype)[:, batch.states]                                   # (K, N, H, n)
    m = batch.mask
    tok = batch.tokens
    if objective == "fkl":
        return forward_kl(logits, lp_rows, w, m, reduction="none", metrics=False)[0]
    if objective == "rkl":
        return reverse_kl(logits, lp_rows, w, m, reduction="none", metrics=False)[0]
    if objective == "sft":
        return torch.where(m, -token_log_probs(logits, batch.labels), torch.zeros_like(logits[..., 0]))
    t_tok = lp_rows.gather(-1, tok[None, ..., None].expand(t.K, -1, -1, 1))[..., 0]             # (K, N, H)
    lq = token_log_probs(logits, tok).detach()
    weighted = torch.as_tensor(importance, dtype=torch.bool)
    weighted = weighted[:, None] if weighted.ndim == 1 else weighted
    ratio = torch.where(batch.by_student | ~weighted, torch.ones_like(lq), (lq - batch.gen_logp).exp())
    if objective in ("pg0", "pg1"):
        rho = torch.cumprod(ratio, dim=1)                                                          # prefix products
        return rkl_policy_gradient(logits, tok, t_tok, w, m, gamma=0.0 if objective == "pg0" else 1.0,
                                   groups=groups, importance_weights=rho, reduction="none")[0]
    if objective == "k3-teacher":
        route = torch.nn.functional.one_hot(batch.teacher, t.K).double()
        return kl_estimator_loss(logits, tok, t_tok, route, m, estimator="k3", pool="after", importance_weights=ratio,
                                 reduction="none")[0]
    return kl_estimator_loss(logits, tok, t_tok, w, m, estimator=objective, pool="before", importance_weights=ratio,
                             reduction="none")[0]


def clip_scale(norms, clip_norm):
    """The factor min(1, clip_norm / |g|) that clips each run's gradient (norms (R,)) to ``clip_norm``."""
    return (clip_norm / norms.clamp(min=1e-12)).clamp(max=1.0)


# ------------------------------------------------------------------------------------------------
# the tabular student: every run of a sweep in one tensor
# ------------------------------------------------------------------------------------------------
def train_tabular(task, configs, seeds, steps=300, batch=32, lr=0.05, eval_every=50, clip_norm=1.0, seed=0,
                  fixed_points=True):
    """Train one tabular student per (config, seed), all at once: theta (R, H, S, n), Adam (elementwise,
    so the runs stay independent), gradient norm clipped per run when the config says ``clip``.

    configs: list of dicts with ``objective``, ``alpha``, ``switch``, ``importance``, ``clip``. Returns
    a tidy DataFrame: one row per run and evaluation step with the config, seed, step, loss and the
    exact outcomes of :class:`Evaluator` (KL to every target, ``kl_named`` to the objective's nominal
    target, ``kl_fixed_point`` to the configuration's derived fixed point unless ``fixed_points`` is
    False), ``diverged`` and ``max_logit``.
    """
    H, n, S = task.horizon, task.teachers.n, task.teachers.S
    runs = [(c, s) for c in configs for s in seeds]
    R = len(runs)
    gen = torch.Generator().manual_seed(seed)
    theta = torch.zeros(R, H, S, n, requires_grad=True)
    with torch.no_grad():
        theta.normal_(0.0, 0.1, generator=gen)
    opt = torch.optim.Adam([theta], lr=lr)
    clip = torch.tensor([bool(c.get("clip", False)) for c, _ in runs])
    # rows: ``batch`` sequences per run, the plain runs' first and the switch-point runs' after them
    switch = torch.tensor([bool(c.get("switch")) for c, _ in runs])
    row_run = torch.cat([torch.nonzero(~switch)[:, 0], torch.nonzero(switch)[:, 0]]).repeat_interleave(batch)
    n_plain = int((~switch).sum()) * batch
    alpha = torch.tensor([float(c.get("alpha", 0.0)) for c, _ in runs])[row_run[:n_plain]]
    weighted = torch.tensor([bool(c.get("importance")) for c, _ in runs])[row_run]
    objective_of = np.array([c["objective"] for c, _ in runs])[row_run.numpy()]
    rows_of = {obj: torch.as_tensor(np.nonzero(objective_of == obj)[0]) for obj in sorted(set(objective_of))}
    sft = "sft" in rows_of                                    # draw SFT's labels only when a run needs them
    rows = []

    evaluate = Evaluator(task, fixed_points)

    def record(step, losses):
        with torch.no_grad():
            log_q = torch.log_softmax(theta.double(), -1).numpy()
            centred = (theta - theta.mean(-1, keepdim=True)).abs().amax(dim=(1, 2, 3)).numpy()
        bad = ~np.isfinite(log_q).all(axis=(1, 2, 3))
        for r, (c, s) in enumerate(runs):
            out = ({f"kl_{k}": math.nan for k in TARGETS + ("sft", "fixed_point")} | {"accuracy": math.nan}) if bad[r] \
                else evaluate(log_q[r], c)
            rows.append(_outcome_row(c, s, step, float(losses[r]), out, max_logit=float(centred[r]),
                                     diverged=bool(bad[r] or centred[r] > DIVERGED_LOGIT
                                                   or not np.isfinite(losses[r]))))

    losses = np.zeros(R)
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            record(step, losses)
        if step == steps:
            break
        logp_all = torch.log_softmax(theta, -1)

        def student_logp(sel):
            return lambda h, states, _tokens: logp_all.detach()[row_run[sel], h, states]
        parts = [rollouts(task, student_logp(slice(0, n_plain)), alpha, False, n_plain, gen, sft)] if n_plain else []
        if n_plain < R * batch:
            parts.append(rollouts(task, student_logp(slice(n_plain, None)), 0.0, True, R * batch - n_plain, gen, sft))
        b = parts[0] if len(parts) == 1 else Batch(**{k: torch.cat([getattr(p, k) for p in parts])
                                                     for k in Batch.__dataclass_fields__})
        h_idx = torch.arange(H).expand(R * batch, H)
        logits = theta[row_run[:, None], h_idx, b.states]                              # (N, H, n)
        per_run = torch.zeros(R)
        for objective, idx in rows_of.items():
            sub = Batch(**{k: getattr(b, k)[idx] for k in Batch.__dataclass_fields__})
            pos = position_losses(objective, logits[idx], sub, task, weighted[idx], groups=row_run[idx])
            per_run = per_run.index_add(0, row_run[idx], pos.sum(1).float() / batch)
        opt.zero_grad()
        per_run.sum().backward()
        with torch.no_grad():
            g = theta.grad
            g.nan_to_num_(0.0, 0.0, 0.0)
            norms = g.flatten(1).norm(dim=1)
            scale = torch.where(clip, clip_scale(norms, clip_norm), torch.ones_like(norms))
            g.mul_(scale[:, None, None, None])
        opt.step()
        losses = per_run.detach().numpy()
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------
# the shared-parameter student: a tiny Qwen2 reading the token prefix
# ------------------------------------------------------------------------------------------------
def student_table(model, task, bos=None):
    """The neural student's conditionals at every state of a prefix-tree task, as a tabular policy
    (H, S, n) log-probs (each state is reached by one prefix); ``bos`` the first input token (default n,
    a token after the task's vocabulary)."""
    t, H = task.teachers, task.horizon
    inputs, tokens, states = tree_responses(t, H)
    if bos is not None:
        inputs[:, 0] = bos
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=inputs).logits[..., :t.n].double(), -1).numpy()
    table = np.full((H, t.S, t.n), -math.log(t.n))          # (step, state) pairs no prefix reaches: uniform
    for i in range(inputs.shape[0]):
        for h in range(H):
            table[h, states[i, h]] = logp[i, h]
    return table


def neural_step(model, opt, task, config, batch, gen, clip_norm=1.0, bos=None):
    """One update of a causal-LM student: rollouts over the spectrum (the student's tokens by its own
    forward passes, after the first input token ``bos``, default n), the objective's loss by
    llm_bridge.losses, optional global-norm clipping, the optimiser's step."""
    n = task.teachers.n
    bos = n if bos is None else bos

    def student_logp(h, _states, tokens):
        ids = torch.cat([torch.full((tokens.shape[0], 1), bos, dtype=torch.long), tokens], dim=1)
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=ids).logits[:, -1, :n].float(), -1)
    b = rollouts(task, student_logp, config.get("alpha", 0.0), bool(config.get("switch")), batch, gen,
                 labels=config["objective"] == "sft")
    inputs = torch.cat([torch.full((batch, 1), bos, dtype=torch.long), b.tokens[:, :-1]], dim=1)
    logits = model(input_ids=inputs).logits[..., :n]
    loss = position_losses(config["objective"], logits, b, task, bool(config.get("importance"))).sum(1).mean()
    opt.zero_grad()
    loss.backward()
    if config.get("clip"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    opt.step()
    return float(loss.detach())


def train_neural(task, config, seed, steps=200, batch=64, lr=3e-3, eval_every=50):
    """Train a tiny Qwen2 student (from a config, seeded) on one spectrum config; the same loss code and
    optimiser as the tabular student. Returns a DataFrame like :func:`train_tabular` (one run)."""
    from llm_bridge.models import tiny_model
    model = tiny_model("qwen2", vocab_size=task.teachers.n + 1, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    evaluate = Evaluator(task)
    rows, loss = [], 0.0
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            out = evaluate(student_table(model, task), config)
            rows.append(_outcome_row(config, seed, step, loss, out, diverged=not np.isfinite(loss)))
        if step < steps:
            loss = neural_step(model, opt, task, config, batch, gen)
    return pd.DataFrame(rows)
