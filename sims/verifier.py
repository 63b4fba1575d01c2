"""Goal-reaching tasks with a checker: distillation from several teachers off- and on-policy, then RL from
the verifiable reward, with every generated and scored token counted (SPEC 5; claims E4, E6).

The task: states in levels 0..L (level 0 is the goal, absorbing), ``width`` states per level. At each
state one action (its 'progress' action) moves one level down; the others move to a random state on
the same level or one or two levels up (levels j, j + 1, j + 2): a mistake costs at least two steps. A
context is a start state c with the horizon level(c) + slack; a response is correct iff it reaches the
goal within the horizon (the checker). In-distribution (ID) contexts start at levels 1..4; the hard
out-of-distribution (OOD) ones at the top levels, which need longer horizons and which rollouts from ID
contexts rarely reach.

Teachers: K = 2, each an expert on alternate levels (a sharp preference for the progress action) and a
novice elsewhere (a weak one, plus noise). The students read the state's features phi(s) = [signal *
one-hot(progress action) + noise (the skill, shared across states); Gaussian features; one-hot(s)], so
what they learn at the states they train on transfers in part to the states they never visit: the
log-linear student logits(s) = W phi(s) (every run one slice of W (R, n, d), elementwise Adam) and a tiny
Qwen2 reading phi(s) through a linear input layer (runs stacked and evaluated by torch.func.vmap). Both
are stationary policies, so their outcomes are exact.

Everything is measured exactly: the probability that the student's stationary policy reaches the goal
within the horizon (a matrix power), averaged over the ID and the OOD contexts, and the per-position KL
from the student to the FKL and RKL targets (A and l, token-level: the teachers are state-wise) on the
student's own ID occupancy.

Costs, in tokens: ``teacher_tokens`` counts the teachers' forward tokens (K per position scored with the
full conditionals, for generating a trace or scoring a student's), ``student_tokens`` the tokens the
student generated. An offline method pays for its pool of teacher traces once, before training.
"""

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

import aggregation as ag
from llm_bridge.losses import forward_kl, reverse_kl
from sims.continual import adam_step, loglinear_tables
from sims.distill import clip_scale

ROLLOUTS = ("offline", "on-policy")
OBJECTIVES = ("fkl", "rkl")
GOAL = 0


@dataclass
class GoalTask:
    """The machine (next_state (S, n), level (S,), progress (S,)), the teachers (log-probs (K, S, n),
    weights (K,)), the student's features (S, d), the slack and the ID / OOD start states."""
    next_state: np.ndarray
    level: np.ndarray
    progress: np.ndarray
    teacher_logp: np.ndarray
    weights: np.ndarray
    features: np.ndarray
    slack: int
    id_starts: np.ndarray
    ood_starts: np.ndarray

    @property
    def S(self):
        return self.next_state.shape[0]

    @property
    def n(self):
        return self.next_state.shape[1]

    @property
    def K(self):
        return self.teacher_logp.shape[0]

    def horizons(self, starts):
        return self.level[starts] + self.slack

    def target(self, name):
        """The token-level target (S, n) log-probs: 'arithmetic' A (FKL) or 'local' l (RKL)."""
        pool = {"arithmetic": ag.log_arithmetic_pool, "local": ag.log_geometric_pool}[name]
        return np.asarray(pool(self.teacher_logp, self.weights))


def make_goal_task(seed=0, levels=8, width=4, n=3, slack=2, id_levels=(1, 4), ood_levels=(6, 8), signal=1.0,
                   d_noise=5, expert=4.0, novice=0.5, noise=1.0):
    """A random goal task (module docstring). ``signal`` scales the skill feature (0: the student's
    features carry nothing about the progress action)."""
    for name, lo_hi in (("id_levels", id_levels), ("ood_levels", ood_levels)):
        if not 1 <= lo_hi[0] <= lo_hi[1] <= levels:
            raise ValueError(f"{name} = {lo_hi} must be a range inside 1..{levels}")
    rng = np.random.default_rng(8000 + seed)
    S = 1 + levels * width
    level = np.concatenate([[0], np.repeat(np.arange(1, levels + 1), width)])
    at = [np.nonzero(level == j)[0] for j in range(levels + 1)]
    next_state = np.full((S, n), GOAL)
    progress = np.zeros(S, dtype=int)
    for s in range(1, S):
        j = level[s]
        progress[s] = rng.integers(n)
        up = np.concatenate([at[i] for i in range(j, min(j + 2, levels) + 1)])
        next_state[s] = rng.choice(up, size=n)
        next_state[s, progress[s]] = rng.choice(at[j - 1])
    K = 2
    good = np.eye(n)[progress]                                                     # (S, n)
    logits = np.stack([np.where((level % K == k)[:, None], expert, novice) * good + noise * rng.normal(size=(S, n))
                       for k in range(K)])
    logits[:, GOAL] = 0.0
    teacher_logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    skill = signal * good + 0.5 * rng.normal(size=(S, n))
    features = np.concatenate([skill, rng.normal(size=(S, d_noise)) / math.sqrt(d_noise), np.eye(S)], axis=1)
    starts = lambda lo_hi: np.nonzero((level >= lo_hi[0]) & (level <= lo_hi[1]))[0]       # noqa: E731
    return GoalTask(next_state, level, progress, teacher_logp, np.full(K, 1.0 / K), features, slack,
                    starts(id_levels), starts(ood_levels))


# ------------------------------------------------------------------------------------------------
# exact outcomes
# ------------------------------------------------------------------------------------------------
def transitions(task, q):
    """The state-transition matrices (R, S, S) of stationary policies q (R, S, n) (probabilities)."""
    onehot = np.eye(task.S)[task.next_state]                                       # (S, n, S)
    return np.einsum("rsn,snt->rst", q, onehot)


def success(task, log_q, starts, P=None):
    """Probability (R, C) that each policy (R, S, n) log-probs reaches the goal from each start within
    its horizon (``P`` its :func:`transitions`, when already computed)."""
    P = transitions(task, np.exp(log_q)) if P is None else P
    H = task.horizons(starts)
    v = np.zeros(P.shape[:2])
    v[:, GOAL] = 1.0
    out = np.zeros((P.shape[0], len(starts)))
    for h in range(1, int(H.max()) + 1):
        v = np.einsum("rst,rt->rs", P, v)                       # v_h(s): the goal within h steps from s
        hit = H == h
        out[:, hit] = v[:, starts[hit]]
    return out


def evaluate(task, log_q):
    """Exact outcomes of policies (R, S, n): id_accuracy, ood_accuracy, and kl_arithmetic / kl_local, the
    per-position KL(q || target) on the student's own ID occupancy. Returns a dict of (R,) arrays."""
    q = np.exp(log_q)
    P = transitions(task, q)
    out = {"id_accuracy": success(task, log_q, task.id_starts, P).mean(1),
           "ood_accuracy": success(task, log_q, task.ood_starts, P).mean(1)}
    occ = _horizon_occupancy(task, P)
    for name in ("arithmetic", "local"):
        kl = np.sum(q * (log_q - task.target(name)), axis=-1)                        # (R, S)
        out[f"kl_{name}"] = (occ * kl).sum(1) / occ.sum(1)
    return out


def _horizon_occupancy(task, P):
    """Expected visits (R, S) to non-goal states at the steps before each ID response's horizon, for
    policies with transition matrices P (R, S, S)."""
    starts = task.id_starts
    H = task.horizons(starts)
    total = np.zeros((P.shape[0], task.S))
    for c, Hc in zip(starts, H):
        d = np.zeros_like(total)
        d[:, c] = 1.0
        for _ in range(int(Hc)):
            total += d / len(starts)
            d = np.einsum("rs,rst->rt", d, P)
            d[:, GOAL] = 0.0
    return total


# ------------------------------------------------------------------------------------------------
# rollouts, distillation and RL
# ------------------------------------------------------------------------------------------------
@dataclass
class Traces:
    """N responses: states, tokens, mask (N, H) (True at the positions before the goal and the
    horizon), whether each reached the goal (N,)."""
    states: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    correct: torch.Tensor

    def take(self, idx):
        return Traces(self.states[idx], self.tokens[idx], self.mask[idx], self.correct[idx])


def rollouts(task, tables, starts, gen, horizon=None):
    """Sample one response per row: tables (N, S, n) log-probs of the policy generating each row, starts
    (N,). Responses are padded to ``horizon`` (default the longest of the rows)."""
    next_state = torch.as_tensor(task.next_state)
    H = torch.as_tensor(task.horizons(starts.numpy()))
    steps = int(H.max()) if horizon is None else horizon
    N = starts.shape[0]
    s, rows = starts.clone(), torch.arange(N)
    rec = {"states": [], "tokens": [], "mask": []}
    for h in range(steps):
        alive = (s != GOAL) & (h < H)
        tok = torch.multinomial(tables[rows, s].exp(), 1, generator=gen)[:, 0]
        for key, value in (("states", s), ("tokens", tok), ("mask", alive)):
            rec[key].append(value)
        s = torch.where(alive, next_state[s, tok], s)
    return Traces(**{k: torch.stack(v, dim=1) for k, v in rec.items()}, correct=s == GOAL)


def _id_starts(task, size, gen):
    """``size`` ID start states drawn uniformly."""
    return torch.as_tensor(task.id_starts)[torch.randint(len(task.id_starts), (size,), generator=gen)]


def teacher_traces(task, size, gen):
    """A pool of ``size`` teacher responses on ID contexts (start uniform, teacher k ~ w), padded to the
    longest ID horizon."""
    starts = _id_starts(task, size, gen)
    k = torch.multinomial(torch.as_tensor(task.weights), size, replacement=True, generator=gen)
    tables = torch.as_tensor(task.teacher_logp, dtype=torch.float32)[k]
    return rollouts(task, tables, starts, gen, horizon=int(task.horizons(task.id_starts).max()))


# ------------------------------------------------------------------------------------------------
# the students: R runs behind one interface (tables with gradient, one optimiser step per run)
# ------------------------------------------------------------------------------------------------
class LogLinearStudents:
    """R log-linear students W (R, n, d) on the task's features, one small random W per seed, trained by
    an elementwise Adam (sims.continual.adam_step), the gradient norm clipped per run. ``lr`` may be
    changed between stages: :meth:`reset` (called by distil and reinforce) starts a fresh Adam."""

    def __init__(self, task, seeds, lr=0.03, clip_norm=1.0, scale=0.1):
        d = task.features.shape[1]
        self.features, self.lr, self.clip_norm = task.features, lr, clip_norm
        self.W = torch.stack([scale * torch.randn(task.n, d, generator=torch.Generator().manual_seed(9000 + s))
                              for s in seeds])
        self.reset()

    def reset(self):
        """A fresh optimiser state (each training stage starts its own Adam)."""
        self.m, self.v, self.t = torch.zeros_like(self.W), torch.zeros_like(self.W), 0

    def tables(self):
        """log-probs (R, S, n) with gradient."""
        self._W = self.W.clone().requires_grad_()
        return loglinear_tables(self._W, self.features)

    def step(self, loss):
        """One update from ``loss`` (the sum of the runs' losses, built from the last :meth:`tables`)."""
        (grad,) = torch.autograd.grad(loss, self._W)
        grad = grad * clip_scale(grad.flatten(1).norm(dim=1), self.clip_norm)[:, None, None]
        self.t += 1
        self.W = adam_step(self.W, grad, self.m, self.v, self.t, torch.full((self.W.shape[0],), self.lr))

    def log_probs(self):
        """log-probs (R, S, n) as float64 NumPy, for the exact outcomes."""
        with torch.no_grad():
            return loglinear_tables(self.W.double(), self.features).numpy()


class FeaturePolicy(torch.nn.Module):
    """A tiny Qwen2 (from a config) as a stationary policy: it reads a state's features through a linear
    input layer as a one-position sequence and returns log-probs over the n actions."""

    def __init__(self, task, seed, hidden=32):
        super().__init__()
        from llm_bridge.models import tiny_model
        torch.manual_seed(9000 + seed)
        self.embed = torch.nn.Linear(task.features.shape[1], hidden)
        self.lm = tiny_model("qwen2", vocab_size=task.n, hidden_size=hidden, seed=9000 + seed, attention="eager")

    def forward(self, features):
        logits = self.lm(inputs_embeds=self.embed(features)[:, None, :]).logits[:, 0, :]
        return torch.log_softmax(logits.float(), -1)


class NeuralStudents:
    """R :class:`FeaturePolicy` students, one per seed, evaluated together by ``torch.func.vmap`` over
    their stacked parameters; Adam (elementwise, so the runs stay independent) with each run's gradient
    clipped to global norm ``clip_norm``. The same interface as :class:`LogLinearStudents`."""

    def __init__(self, task, seeds, lr=3e-3, clip_norm=1.0):
        import copy
        from torch.func import stack_module_state
        self.features = torch.as_tensor(task.features, dtype=torch.float32)
        self.lr, self.clip_norm = lr, clip_norm
        models = [FeaturePolicy(task, s) for s in seeds]
        params, self.buffers = stack_module_state(models)
        # the token embeddings are never read (the inputs are embedded features): not trained
        self.params = {k: v.detach().requires_grad_(not k.startswith("lm.model.embed_tokens"))
                       for k, v in params.items()}
        self.base = copy.deepcopy(models[0]).to("meta")
        self.reset()

    def reset(self):
        self.opt = torch.optim.Adam([p for p in self.params.values() if p.requires_grad], lr=self.lr)

    def tables(self):
        from torch.func import functional_call, vmap

        def one(params, buffers):
            return functional_call(self.base, (params, buffers), (self.features,))
        return vmap(one)(self.params, self.buffers)

    def step(self, loss):
        trained = [p for p in self.params.values() if p.requires_grad]
        grads = torch.autograd.grad(loss, trained)
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads))
        scale = clip_scale(norms, self.clip_norm)
        for p, g in zip(trained, grads):
            p.grad = g * scale.view(-1, *[1] * (g.ndim - 1))
        self.opt.step()

    def log_probs(self):
        with torch.no_grad():
            return self.tables().double().numpy()


STUDENTS = {"loglinear": LogLinearStudents, "neural": NeuralStudents}


def _record(task, students, runs, stage, step, costs):
    out = evaluate(task, students.log_probs())
    return [dict(method, seed=s, stage=stage, step=step, teacher_tokens=int(costs[0][r]),
                 student_tokens=int(costs[1][r]), **{k: float(v[r]) for k, v in out.items()})
            for r, (method, s) in enumerate(runs)]


def checkpoints(steps, per_decade=10):
    """The steps at which outcomes are recorded: 0, a log-spaced grid from 1 and ``steps`` (so early costs are
    resolved as finely as late ones)."""
    if steps < 1:
        return {0}
    grid = np.geomspace(1, steps, max(int(per_decade * math.log10(steps)) + 1, 2))
    return {0, steps} | {int(v) for v in np.round(grid)}


def distil(task, runs, students, steps=300, batch=32, seed=0):
    """Distil every run at once (``students`` one per run, trained in place): runs is a list of (method,
    seed), method a dict with ``objective`` (fkl, rkl, or '': no distillation), ``rollouts`` (offline:
    minibatches from a pool of ``pool`` teacher traces drawn once per seed and shared by that seed's
    offline methods; on-policy: the student's own responses) and ``pool``. Returns (rows of the exact
    outcomes at the :func:`checkpoints` with the cumulative costs, the final costs (teacher_tokens,
    student_tokens) (R,))."""
    for method, _ in runs:
        if method["objective"] not in ("",) + OBJECTIVES or (method["objective"] and method["rollouts"] not in ROLLOUTS):
            raise ValueError(f"method {method}: objective must be one of {('',) + OBJECTIVES} and rollouts one of "
                             f"{ROLLOUTS}")
        if method["objective"] and method["rollouts"] == "offline" and not method["pool"] >= 1:
            raise ValueError(f"method {method}: an offline method needs a pool of at least 1 trace")
    R = len(runs)
    gen = torch.Generator().manual_seed(seed)
    offline = [r for r, (m, _) in enumerate(runs) if m["objective"] and m["rollouts"] == "offline"]
    online = [r for r, (m, _) in enumerate(runs) if m["objective"] and m["rollouts"] == "on-policy"]
    pools = {}
    teacher_tokens, student_tokens = np.zeros(R), np.zeros(R)
    for r in offline:
        method, s = runs[r]
        key = (s, method["pool"])
        if key not in pools:
            pools[key] = teacher_traces(task, method["pool"], torch.Generator().manual_seed(10_000 + s))
        teacher_tokens[r] = task.K * float(pools[key].mask.sum())      # generated and scored once, up front
    lp = torch.as_tensor(task.teacher_logp, dtype=torch.float32)
    w = torch.as_tensor(task.weights)
    H = int(task.horizons(task.id_starts).max())
    record_at = checkpoints(steps)
    students.reset()
    rows = _record(task, students, runs, "distil", 0, (teacher_tokens, student_tokens))
    if not offline + online:
        return rows, (teacher_tokens, student_tokens)
    for step in range(1, steps + 1):
        table = students.tables()                                                         # (R, S, n)
        parts, owner = [], []
        for r in offline:
            method, s = runs[r]
            pool = pools[(s, method["pool"])]
            parts.append(pool.take(torch.randint(pool.mask.shape[0], (batch,), generator=gen)))
            owner.append(r)
        if online:
            row_run = torch.as_tensor(online).repeat_interleave(batch)
            b = rollouts(task, table.detach()[row_run], _id_starts(task, len(row_run), gen), gen, horizon=H)
            lengths = b.mask.sum(1).float().view(len(online), batch).sum(1).numpy()
            student_tokens[online] += lengths
            teacher_tokens[online] += task.K * lengths
            parts.append(b)
            owner.extend(online)
        tr = Traces(*(torch.cat([getattr(p, f) for p in parts]) for f in ("states", "tokens", "mask", "correct")))
        row_run = torch.as_tensor(owner).repeat_interleave(batch)
        logits = table[row_run[:, None], tr.states]                                       # (N, H, n)
        lp_rows = lp[:, tr.states]                                                        # (K, N, H, n)
        fkl = np.array([runs[r][0]["objective"] == "fkl" for r in owner]).repeat(batch)
        per_run = torch.zeros(R)
        for use, loss in ((fkl, forward_kl), (~fkl, reverse_kl)):
            idx = torch.as_tensor(np.nonzero(use)[0])
            if len(idx):
                pos = loss(logits[idx], lp_rows[:, idx], w, tr.mask[idx], reduction="none", metrics=False)[0]
                per_run = per_run.index_add(0, row_run[idx], pos.sum(1).float() / batch)
        students.step(per_run.sum())
        if step in record_at:
            rows += _record(task, students, runs, "distil", step, (teacher_tokens, student_tokens))
    return rows, (teacher_tokens, student_tokens)


def reinforce(task, runs, students, costs, steps=300, contexts=8, group=8, seed=0):
    """RL from the verifiable reward for every run at once (``students`` trained in place, a fresh
    optimiser state): per step, ``contexts`` ID contexts per run, ``group`` responses each from the
    student, reward 1 iff correct, the group-relative advantage r - mean(group) (REINFORCE with the
    group's mean as baseline), the score-function loss. ``costs`` (teacher_tokens, student_tokens) (R,)
    carried on from distillation. Returns the rows."""
    R = len(runs)
    gen = torch.Generator().manual_seed(seed)
    teacher_tokens, student_tokens = (np.array(c, dtype=float) for c in costs)
    per = contexts * group
    row_run = torch.arange(R).repeat_interleave(per)
    record_at = checkpoints(steps)
    students.reset()
    rows = _record(task, students, runs, "rl", 0, (teacher_tokens, student_tokens))
    for step in range(1, steps + 1):
        table = students.tables()
        starts = _id_starts(task, R * contexts, gen).repeat_interleave(group)
        tr = rollouts(task, table.detach()[row_run], starts, gen)
        student_tokens += tr.mask.sum(1).float().view(R, per).sum(1).numpy()
        reward = tr.correct.float().view(R * contexts, group)
        advantage = (reward - reward.mean(1, keepdim=True)).flatten()
        logp = table[row_run[:, None], tr.states].gather(-1, tr.tokens[..., None])[..., 0]
        score = (logp * tr.mask).sum(1)
        students.step((-(advantage * score) / per).sum())
        if step in record_at:
            rows += _record(task, students, runs, "rl", step, (teacher_tokens, student_tokens))
    return rows


def teacher_rows(task):
    """The exact outcomes of each teacher and of the two targets, for reference."""
    names = [f"teacher {k + 1}" for k in range(task.K)] + ["A (FKL target)", "l (RKL target)"]
    tables = np.concatenate([task.teacher_logp, np.stack([task.target("arithmetic"), task.target("local")])])
    out = evaluate(task, tables)
    return pd.DataFrame([dict(policy=name, **{k: float(v[i]) for k, v in out.items()}) for i, name in enumerate(names)])
