"""Exact outcomes of tabular policies (theory section 2, 5): every number a distance to a known target.

    Evaluator      the one evaluator, built for a task:
                   on a finite-state task (``tasks.Task``), one run's table (H, S, n): KL_seq(q || P) on q's
                   own rollouts for every target P, the configuration's derived fixed point, and the
                   probability of the correct first token;
                   on a goal task (``tasks.GoalTask``), every run's table (R, S, n): the probability of
                   reaching the goal within the horizon from the ID and OOD contexts, and the per-position
                   KL to A and l on the student's ID occupancy
    loss_on        KL_seq(P || q) of a student on a one-teacher task's own responses (forgetting)
    teacher_rows   the goal-task outcomes for each teacher of a goal task and for A and l
"""

import math
import warnings

import numpy as np
import pandas as pd

import aggregation as ag

from .fixed_points import TARGET_OF, TARGETS, fixed_point, sft_fixed_point, target_table
from .tasks import GOAL, GoalTask, success, transitions


DIVERGED_LOGIT = 25.0          # a logit this far from its row's mean (q below e^-25): driven to a vertex


class Evaluator:
    """Exact outcomes of tabular policies on one task; the target tables (and, with ``fixed_points``,
    each configuration's derived fixed point) are computed once."""

    def __init__(self, task, fixed_points=True):
        self.task = task
        self.goal = isinstance(task, GoalTask)
        self.tables = {} if self.goal else {name: target_table(task, name) for name in TARGETS}
        self.fixed_points = fixed_points
        self._cache = {}
        self._unsolved = set()

    def _table(self, kind, config):
        key = (kind, config.objective, float(config.alpha), config.switch, config.importance)
        if key not in self._cache:
            self._cache[key] = (fixed_point(self.task, config) if kind == "fixed_point" else
                                None if key[3] else sft_fixed_point(self.task, key[2]))
        return self._cache[key]

    def fixed_point(self, config):
        """The configuration's derived fixed point (H, S, n) log-probs (``fixed_points.fixed_point``), cached;
        None where none is derived."""
        return self._table("fixed_point", config)

    def _solved_fixed_point(self, config):
        """The derived fixed point for an evaluation; where the solver does not converge (e.g. a zero at
        the boundary of the simplex, approached but never reached) None, with a warning that names the
        configuration: kl_fixed_point is then NaN, never a value against an unconverged table."""
        key = (config.objective, float(config.alpha), config.switch, config.importance)
        if key in self._unsolved:
            return None
        try:
            return self._table("fixed_point", config)
        except RuntimeError as err:
            self._unsolved.add(key)
            warnings.warn(f"{err}; kl_fixed_point is NaN for this configuration", RuntimeWarning, stacklevel=3)
            return None

    def separation(self, table_a, table_b):
        """How far apart two candidate targets (H, S, n) log-probs are, in the evaluation's own units: the
        smaller of KL_seq(a || b) and KL_seq(b || a), per response (each on its own rollouts): the value
        kl_<b> would take for a student that had reached a, or the reverse."""
        return min(self._kl_seq(table_a, table_b), self._kl_seq(table_b, table_a))

    def _kl_seq(self, log_q, table, occ=None):
        """KL_seq(q || table) per response on q's own rollouts: sum_h,s occ(h, s) KL(q(.|h, s) || table(.|h, s)),
        over the tokens q gives mass (``occ``: q's occupancy, when already computed)."""
        t, H = self.task.teachers, self.task.horizon
        occ = ag.policy_occupancy(t, H, log_q)[:H, :, None] if occ is None else occ
        q = np.exp(log_q)
        return float(np.sum(np.where(q > 0, occ * q * (log_q - table), 0.0)))

    def __call__(self, log_q, config=None):
        """log_q (H, S, n): KL_seq(q || P) per response on q's own rollouts for every target P, and with a
        ``configs.SpectrumConfig``: kl_sft (SFT's fixed point at its alpha; NaN for the switch variant or another
        objective) and kl_fixed_point (the config's derived fixed point; NaN where none); ``accuracy``
        the probability of the correct first token. On a goal task: log_q (R, S, n), the outcomes of
        :func:`_goal_outcomes` ((R,) arrays; ``config`` unused)."""
        if self.goal:
            return _goal_outcomes(self.task, log_q)
        t, H = self.task.teachers, self.task.horizon
        tables = dict(self.tables)
        if config is not None:
            tables["sft"] = self._table("sft", config) if config.objective == "sft" else None
            derived = self.fixed_points and config.truncate == math.inf     # truncated weights: none derived
            tables["fixed_point"] = self._solved_fixed_point(config) if derived else None
        occ = ag.policy_occupancy(t, H, log_q)[:H, :, None]                # q's occupancy, once for every target
        out = {f"kl_{name}": math.nan if table is None else self._kl_seq(log_q, table, occ)
               for name, table in tables.items()}
        out["accuracy"] = float(np.exp(log_q[0, t.start, 0]))
        return out


def _outcome_row(config, seed, step, loss, evaluation, **extra):
    named = TARGET_OF[config.objective]
    return dict(config.as_dict(), seed=seed, step=step, loss=loss, kl_named=evaluation.get(f"kl_{named}", math.nan)
                if named else math.nan, **extra, **evaluation)


def forgetting_reference(task):
    """P_A, the task's one teacher, as a tabular policy (S, n) log-probs: the responses the student's
    forgetting is measured on are P_A's."""
    return np.asarray(task.teachers.log_probs[0])


def loss_on(task, log_q):
    """KL_seq(P || q) of a student table (S, n) or (H, S, n) on the task's one teacher P: the excess
    loss of the student on P's own responses."""
    t = task.teachers
    return ag.sequence_kl(t, None, task.horizon, forgetting_reference(task), target=log_q)


def _goal_outcomes(task, log_q):
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


def teacher_rows(task):
    """The exact outcomes of each teacher and of the two targets, for reference."""
    names = [f"teacher {k + 1}" for k in range(task.K)] + ["A (FKL target)", "l (RKL target)"]
    tables = np.concatenate([task.teacher_logp, np.stack([task.target("arithmetic"), task.target("local")])])
    out = Evaluator(task)(tables)
    return pd.DataFrame([dict(policy=name, **{k: float(v[i]) for k, v in out.items()}) for i, name in enumerate(names)])
