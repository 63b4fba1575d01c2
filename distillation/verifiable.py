"""Distillation from several teachers off- and on-policy on goal tasks with a checker, then RL from the
verifiable reward, with every generated and scored token counted (SPEC 5; claims E4, E6).

Costs, in tokens: ``teacher_tokens`` counts the teachers' forward tokens (K per position scored with the
full conditionals, for generating a trace or scoring a student's), ``student_tokens`` the tokens the
student generated. An offline method pays for its pool of teacher traces once, before training.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from llm_bridge.losses import forward_kl, reverse_kl

from .evaluation import evaluate
from .tasks import GOAL


ROLLOUTS = ("offline", "on-policy")


OBJECTIVES = ("fkl", "rkl")


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
