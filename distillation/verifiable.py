"""Distillation from several teachers off- and on-policy on goal tasks with a checker, then RL from the
verifiable reward, with every generated and scored token counted (theory section 5; claims E4, E6).

Costs, in tokens: ``teacher_tokens`` counts the teachers' forward tokens (K per position scored with the
full conditionals, for generating a trace or scoring a student's), ``student_tokens`` the tokens the
student generated. An offline method pays for its pool of teacher traces once, before training.
"""

import math

import numpy as np
import torch

from analysis import log_grid
from llm_bridge.losses import forward_kl, reverse_kl

from .evaluation import Evaluator
from .students import at_positions
from .tasks import GOAL
from .training import Batch, partition_rows, per_run_losses, sample

LOSSES = {"fkl": forward_kl, "rkl": reverse_kl}           # a goal-task method's objective -> its loss


def rollouts(task, tables, starts, gen, horizon=None):
    """One response per row (``training.sample``): tables (N, S, n) log-probs of the policy generating each
    row, starts (N,); a response ends at the goal or at its context's horizon, and is padded to
    ``horizon`` (default the longest of the rows). Returns a ``training.Batch`` with ``correct``."""
    H = torch.as_tensor(task.horizons(starts.numpy()))
    rows = torch.arange(starts.shape[0])
    fields, last = sample(torch.as_tensor(task.next_state), starts.clone(), int(H.max()) if horizon is None else horizon,
                          lambda h, s: tables[rows, s], gen, lambda h, s: (s == GOAL) | (h >= H))
    return Batch(**fields, correct=last == GOAL)


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


def _record(task, students, runs, stage, step, costs):
    out = Evaluator(task)(students.log_probs())
    return [dict(method.as_dict(), seed=s, stage=stage, step=step, teacher_tokens=int(costs[0][r]),
                 student_tokens=int(costs[1][r]), **{k: float(v[r]) for k, v in out.items()})
            for r, (method, s) in enumerate(runs)]


def checkpoints(steps):
    """The steps at which outcomes are recorded: 0 and ``analysis.log_grid(steps)`` (10 per decade, ending
    at ``steps``), so early costs are resolved as finely as late ones."""
    return {0} | ({int(v) for v in log_grid(steps)} if steps >= 1 else set())


def pool_generator(task_seed, seed):
    """The generator of the offline pool of student seed ``seed`` on the task of ``task_seed``: seeded by
    both, so that no two tasks share a pool's start states and teacher draws (the seeds of a task are
    clustered by task; a component shared across tasks would not be)."""
    state = np.random.SeedSequence([10_000, int(task_seed), int(seed)]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(state))


def distil(task, runs, students, steps=300, batch=32, seed=0, task_seed=0):
    """Distil every run at once (``students`` one per run, trained in place): runs is a list of (method,
    seed), method a ``configs.Method`` with ``objective`` (fkl, rkl, or '': no distillation), ``rollouts`` (offline:
    minibatches from a pool of ``pool`` teacher traces drawn once per (``task_seed``, seed)
    (:func:`pool_generator`) and shared by that seed's offline methods; on-policy: the student's own
    responses; fresh: ``batch`` new teacher traces per run every step, from their own generator so that
    adding them changes no other run) and ``pool``. Returns
    (rows of the exact outcomes at the :func:`checkpoints` with the cumulative costs, the final costs
    (teacher_tokens, student_tokens) (R,))."""
    R = len(runs)
    gen = torch.Generator().manual_seed(seed)
    fresh_gen = torch.Generator().manual_seed(20_000 + seed)
    offline = [r for r, (m, _) in enumerate(runs) if m.offline]
    online = [r for r, (m, _) in enumerate(runs) if m.on_policy]
    fresh = [r for r, (m, _) in enumerate(runs) if m.fresh]
    pools = {}
    teacher_tokens, student_tokens = np.zeros(R), np.zeros(R)
    for r in offline:
        method, s = runs[r]
        key = (s, method.pool)
        if key not in pools:
            pools[key] = teacher_traces(task, method.pool, pool_generator(task_seed, s))
        teacher_tokens[r] = task.K * float(pools[key].mask.sum())      # generated and scored once, up front
    lp = torch.as_tensor(task.teacher_logp, dtype=torch.float32)
    w = torch.as_tensor(task.weights)
    H = int(task.horizons(task.id_starts).max())
    record_at = checkpoints(steps)
    students.reset()
    rows = _record(task, students, runs, "distil", 0, (teacher_tokens, student_tokens))
    if not offline + online + fresh:
        return rows, (teacher_tokens, student_tokens)
    for step in range(1, steps + 1):
        table = students.tables()                                                         # (R, S, n)
        parts, owner = [], []
        for r in offline:
            method, s = runs[r]
            pool = pools[(s, method.pool)]
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
        if fresh:                                    # new teacher traces, generated and scored every step
            b = teacher_traces(task, len(fresh) * batch, fresh_gen)
            teacher_tokens[fresh] += task.K * b.mask.sum(1).float().view(len(fresh), batch).sum(1).numpy()
            parts.append(b)
            owner.extend(fresh)
        tr = Batch.cat(parts)
        row_run = torch.as_tensor(owner).repeat_interleave(batch)
        logits = at_positions(table, row_run, tr.states)                                  # (N, H, n)
        lp_rows = lp[:, tr.states]                                                        # (K, N, H, n)
        objective_of = np.array([runs[r][0].objective for r in owner]).repeat(batch)
        students.step(per_run_losses(R, row_run, partition_rows(objective_of), lambda objective, idx: LOSSES[objective](
            logits[idx], lp_rows[:, idx], w, tr.mask[idx], reduction="none", metrics=False)[0], batch).sum())
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
        logp = at_positions(table, row_run, tr.states).gather(-1, tr.tokens[..., None])[..., 0]
        score = (logp * tr.mask).sum(1)
        students.step((-(advantage * score) / per).sum())
        if step in record_at:
            rows += _record(task, students, runs, "rl", step, (teacher_tokens, student_tokens))
    return rows
