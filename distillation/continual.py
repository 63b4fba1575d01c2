"""Continual distillation with a shared-parameter student (theory section 5; claim E3): the student knows task A,
then is distilled on task B; what it forgets of A, how well it learns B, and how sparse its update is,
across learning rates, schedules, the rollout mix, objectives, clipping and parameter storage.

Tasks: a ``tasks.Pair``, two prefix trees of the same shape (depth 3 over 3 tokens, 13 states) with
different teachers: A has one teacher (the skill the student has), B has K = 2. Students:

    log-linear   logits(task, s) = W phi(task, s), phi = [shared features of the tree position (d_shared,
                 the same for both tasks); a one-hot of (task, s)]
    neural       a tiny Qwen2 whose first input token names the task (n for A, n + 1 for B)

Both are ``students`` classes (every run of a sweep at once, a learning rate per run); phase 2 uses the
spectrum's sampler and losses (``training``), and the outcomes are exact:

    forgetting   KL_seq(P_A || q_A) after B minus before B: the increase of the student's loss on A's
                 own responses (P_A the teacher of A; ``evaluation.loss_on``)
    quality      KL_seq(q_B || the objective's target on B) per position, on the student's rollouts
    sparsity     the fraction of parameters with |theta_T - theta_0| > 1e-6 (1 + |theta_0|) (theory section 5),
                 and the fraction whose bfloat16 value changed

Parameter storage 'bf16' keeps the parameters in bfloat16 (the update is computed in float32 and
rounded back, so updates below half an ulp vanish); 'float32' keeps them in float32; 'bf16-master' is
mixed precision as training frameworks do it: float32 master weights accumulate every update and the
forward pass (training and evaluation) reads their bfloat16 copy. For a run in mixed precision,
``sparsity`` is the master's and ``sparsity_bf16`` the served bfloat16 copy's.
"""

import math

import numpy as np
import pandas as pd
import torch

import aggregation as ag

from .evaluation import Evaluator, forgetting_reference, loss_on
from .configs import SCHEDULES
from .fixed_points import TARGET_OF
from .students import LogLinearStudents, TokenStudents, at_positions, at_step, round_bf16
from .training import partition_rows, per_run_losses, position_losses, rollouts

WARMUP = 0.1                    # the warm-up's share of the steps (a linear ramp from 0)


def learning_rates(lr, schedule, warmup, steps):
    """The learning rate at each of ``steps`` steps: a linear warm-up over the first 10% (``warmup``),
    then constant, linear decay to 0 or cosine decay to 0 over the rest. Returns (steps,)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule = {schedule!r} must be one of {SCHEDULES}")
    if not (lr >= 0 and math.isfinite(lr)):
        raise ValueError(f"lr = {lr!r} must be a finite number >= 0")
    w = int(round(WARMUP * steps)) if warmup else 0
    k = np.arange(steps, dtype=float)
    frac = np.clip((k - w) / max(steps - w, 1), 0.0, 1.0)
    decay = {"constant": np.ones(steps), "linear": 1.0 - frac, "cosine": 0.5 * (1.0 + np.cos(math.pi * frac))}
    ramp = np.where(k < w, (k + 1) / max(w, 1), 1.0)
    return lr * ramp * decay[schedule]


def update_sparsity(theta0, theta1):
    """(fraction of entries with |theta1 - theta0| > 1e-6 (1 + |theta0|), fraction whose bfloat16 value
    changed): over a 1-d parameter vector (floats), or per run over (R, ...) tensors ((R,) arrays)."""
    t0, t1 = torch.as_tensor(theta0, dtype=torch.float32), torch.as_tensor(theta1, dtype=torch.float32)
    if t0.shape != t1.shape:
        raise ValueError(f"theta0 and theta1 must have the same shape, got {tuple(t0.shape)} and {tuple(t1.shape)}")
    dims = tuple(range(1, t0.ndim)) if t0.ndim > 1 else (0,)
    changed = ((t1 - t0).abs() > 1e-6 * (1 + t0.abs())).double().mean(dims)
    changed_bf16 = (round_bf16(t1) != round_bf16(t0)).double().mean(dims)
    return changed.numpy(), changed_bf16.numpy()


def students_for(kind, pair, seeds):
    """Phase-1 students of a task pair, reading task A: 'loglinear' (:class:`LogLinearStudents` on A's
    features, lr 0.1, unclipped) or 'neural' (:class:`TokenStudents`, vocabulary n + 2, first token n
    for A and n + 1 for B, lr 3e-3)."""
    n = pair.A.teachers.n
    if kind == "loglinear":
        return LogLinearStudents(pair.features[0], n, seeds, lr=0.1, clip_norm=math.inf, init=5000)
    if kind == "neural":
        return TokenStudents(pair.A, seeds, vocab=n + 2, bos=n, lr=3e-3)
    raise ValueError(f"student = {kind!r} must be one of ('loglinear', 'neural')")


def read_task(students, pair, which):
    """Point the students at task A (``which`` 0) or B (1): the log-linear student's features, the neural
    student's tree and first token."""
    if isinstance(students, TokenStudents):
        students.task, students.bos = pair.tasks[which], pair.A.teachers.n + which
    else:
        students.features = torch.as_tensor(pair.features[which], dtype=torch.float32)


def learn_a(pair, students, steps=400):
    """Phase 1: the students (one per seed, :func:`students_for`) learn task A by exact FKL (the loss
    summed over A's states with their occupancy, no sampling), trained in place. Returns them."""
    A = pair.A
    occ = torch.as_tensor(ag.state_occupancy(A.teachers, None, A.horizon, target=0), dtype=torch.float32)
    p = torch.as_tensor(np.exp(forgetting_reference(A)), dtype=torch.float32)
    read_task(students, pair, 0)
    for _ in range(steps):
        lq = students.tables()                          # (R, S, n) stationary or (R, H, S, n) per step
        weight = occ.sum(0)[:, None] if lq.ndim == 3 else occ[:A.horizon, :, None]
        students.step((weight * p * (torch.log(p) - lq)).sum())
    return students


def distil(pair, runs, start, steps=150, batch=32, seed=0):
    """Phase 2 for every run at once: runs a list of (``configs.ContinualConfig``, seed), each starting
    from its seed's phase-1 student in ``start`` (:func:`learn_a`); the config's learning-rate schedule,
    objective, alpha, clipping and storage on task B. Returns one row per run (:func:`outcome_row`)."""
    B, R = pair.B, len(runs)
    configs = [c for c, _ in runs]
    students = start.take([start.seeds.index(s) for _, s in runs])
    students.clip = torch.tensor([c.clip for c in configs])
    students.store_bf16([c.storage == "bf16" for c in configs])
    students.cast_bf16([c.storage == "bf16-master" for c in configs])
    theta0 = students.flat().clone()
    read_task(students, pair, 0)
    q_a0 = students.log_probs()
    read_task(students, pair, 1)
    lrs = torch.as_tensor(np.stack([learning_rates(c.lr, c.schedule, c.warmup, steps) for c in configs]),
                          dtype=torch.float32)                                          # (R, steps)
    row_run = torch.arange(R).repeat_interleave(batch)
    alpha = torch.tensor([float(c.alpha) for c in configs])[row_run]
    objective_of = np.array([c.objective for c in configs])[row_run.numpy()]
    rows_of = partition_rows(objective_of)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        table = students.tables()
        b = rollouts(B, lambda h, s: at_step(table.detach(), h)[row_run, s], alpha, False, R * batch, gen,
                     labels="sft" in rows_of)
        logits = at_positions(table, row_run, b.states)                                 # (N, H, n) log-probs
        per_run = per_run_losses(R, row_run, rows_of, lambda objective, idx: position_losses(
            objective, logits[idx], b.take(idx), B, False, groups=row_run[idx]), batch)
        students.step(per_run.sum(), lr=lrs[:, step])
    sparsity, sparsity_bf16 = update_sparsity(theta0, students.flat())
    q_b = students.log_probs()
    read_task(students, pair, 0)
    q_a = students.log_probs()
    evaluate = Evaluator(B, fixed_points=False)
    per_step = (B.horizon,) + q_b.shape[-2:]
    return pd.DataFrame([outcome_row(pair, c, s, q_a0[r], q_a[r], np.broadcast_to(q_b[r], per_step),
                                     sparsity[r], sparsity_bf16[r], evaluate) for r, (c, s) in enumerate(runs)])


def outcome_row(pair, config, seed, q_a_before, q_a_after, q_b, sparsity, sparsity_bf16, evaluate=None):
    """One run's outcomes from its tables on A before and after phase 2 and on B ((H, S, n) log-probs):
    the config, seed, loss on A before and after, forgetting, quality (KL per position to the objective's
    target on B, on the student's rollouts), kl_arithmetic_b, accuracy_b and the two sparsities."""
    A, B = pair.A, pair.B
    out = (evaluate or Evaluator(B, fixed_points=False))(q_b, config.spectrum())
    before, after = loss_on(A, q_a_before), loss_on(A, q_a_after)
    return dict(config.as_dict(), seed=seed, loss_a_before=before, loss_a_after=after, forgetting=after - before,
                quality=out[f"kl_{TARGET_OF[config.objective]}"] / B.horizon,
                kl_arithmetic_b=out["kl_arithmetic"] / B.horizon, accuracy_b=out["accuracy"],
                sparsity=float(sparsity), sparsity_bf16=float(sparsity_bf16))
