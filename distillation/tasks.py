"""The tasks the students are distilled on, all with exact finite-state teachers (theory section 2, 5).

    Task, make_task            K teachers on a finite-state machine ('tree': a prefix tree, 'loop': looping
                               states for long horizons), their weights and the response length
    Pair, make_pair            task A (one teacher) and task B (K teachers) on trees of the same shape, with
                               the log-linear student's features: the continual-distillation setting
    GoalTask, make_goal_task   goal-reaching tasks with a checker: states in levels 0..L (level 0 the goal),
                               one progress action per state, a mistake costs at least two steps; a context
                               is a start state with the horizon level + slack, and a response is correct iff
                               it reaches the goal within it (``success``, exact by matrix powers). Teachers:
                               K = 2, each an expert on alternate levels and a novice elsewhere. Features:
                               [signal * one-hot(progress) + noise (a skill shared across states);
                               Gaussian features; one-hot(s)]
"""

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

import aggregation as ag
from aggregation import examples


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


@dataclass
class Pair:
    """Task A (one teacher), task B (K teachers) on trees of the same shape, and the log-linear
    student's features (2, S, d): [shared features of the tree position; one-hot of (task, s)]."""
    A: Task
    B: Task
    features: np.ndarray

    @property
    def tasks(self):
        return (self.A, self.B)


def make_pair(seed=0, K=2, d_shared=8):
    """Task A (one teacher) and task B (``K`` teachers) on prefix trees of one shape (draw ``seed``), with the
    features (2, S, d_shared + 2 S) of each task's states: ``d_shared`` Gaussian features shared by both
    tasks, then a one-hot of (task, state)."""
    A = make_task("tree", K=1, seed=2000 + seed)
    B = make_task("tree", K=K, seed=3000 + seed)
    if not np.array_equal(A.teachers.next_state, B.teachers.next_state):
        raise ValueError("tasks A and B must share the tree's shape")
    S = A.teachers.S
    rng = np.random.default_rng(4000 + seed)
    shared = rng.normal(size=(S, d_shared)) / math.sqrt(d_shared)
    own = np.eye(2 * S).reshape(2, S, 2 * S)
    return Pair(A, B, np.concatenate([np.broadcast_to(shared, (2, S, d_shared)), own], axis=-1))


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
        """The horizon of each context that starts at ``starts``: its level plus the slack."""
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
