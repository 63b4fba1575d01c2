"""Continual distillation with a shared-parameter student (SPEC 5; claim E3): the student knows task A,
then is distilled on task B; what it forgets of A, how well it learns B, and how sparse its update is,
across learning rates, schedules, the rollout mix, objectives, clipping and parameter storage.

Tasks: a ``tasks.Pair``, two prefix trees of the same shape (depth 3 over 3 tokens, 13 states) with
different teachers: A has one teacher (the skill the student has), B has K = 2. Students:

    log-linear   logits(task, s) = W phi(task, s), phi = [shared features of the tree position (d_shared,
                 the same for both tasks); a one-hot of (task, s)]: every run of a sweep in one tensor
                 W (R, n, d), trained by an elementwise Adam with a per-run learning rate
    neural       a tiny Qwen2 whose first input token names the task (n for A, n + 1 for B)

Both are trained by the spectrum's sampler and losses (``training``), and measured exactly:

    forgetting   KL_seq(P_A || q_A) after B minus before B: the increase of the student's loss on A's
                 own responses (P_A the teacher of A; ``evaluation.loss_on``)
    quality      KL_seq(q_B || the objective's target on B) per position, on the student's rollouts
    sparsity     the fraction of parameters with |theta_T - theta_0| > 1e-6 (1 + |theta_0|) (SPEC 5),
                 and the fraction whose bfloat16 value changed

Parameter storage 'bf16' keeps the parameters in bfloat16 (the update is computed in float32 and
rounded back, so updates below half an ulp vanish); 'float32' keeps them in float32.
"""

import copy
import math

import numpy as np
import pandas as pd
import torch

import aggregation as ag

from .evaluation import Evaluator, forgetting_reference, loss_on
from .configs import SCHEDULES, SpectrumConfig
from .fixed_points import TARGET_OF
from .students import BETAS, EPS, adam_step, clip_per_run, loglinear_tables, round_bf16, student_table
from .training import neural_step, partition_rows, per_run_losses, position_losses, rollouts






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


def learn_a(pair, seeds, steps=400, lr=0.1):
    """Phase 1: each seed's student learns task A by exact FKL (the loss summed over A's states with
    their occupancy, no sampling), full-batch Adam from small random W. Returns {seed: W (n, d)}."""
    A = pair.A
    t = A.teachers
    occ = torch.as_tensor(ag.state_occupancy(t, None, A.horizon, target=0).sum(0), dtype=torch.float32)
    p = torch.as_tensor(np.exp(forgetting_reference(A)), dtype=torch.float32)
    out = {}
    for seed in seeds:
        g = torch.Generator().manual_seed(5000 + seed)
        W = (0.1 * torch.randn(t.n, pair.features.shape[-1], generator=g)).requires_grad_()
        opt = torch.optim.Adam([W], lr=lr)
        for _ in range(steps):
            lq = loglinear_tables(W[None], pair.features[0])[0]
            loss = (occ[:, None] * p * (torch.log(p) - lq)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        out[seed] = W.detach().clone()
    return out


def distil_loglinear(pair, runs, W_start, steps=150, batch=32, clip_norm=1.0, seed=0):
    """Phase 2 for every run at once: runs is a list of (``configs.ContinualConfig``, seed). W_start {seed: W (n, d)} from :func:`learn_a`. Returns one row per
    run: the config, seed, forgetting, quality (KL per position to the objective's target on B),
    kl_arithmetic_b, sparsity, sparsity_bf16, loss_a before and after."""
    B, R = pair.B, len(runs)
    configs = [c for c, _ in runs]
    bf16 = torch.tensor([c.storage == "bf16" for c in configs])
    W0 = torch.stack([W_start[s] for _, s in runs])
    W0 = torch.where(bf16[:, None, None], round_bf16(W0), W0)
    W = W0.clone()
    m, v = torch.zeros_like(W), torch.zeros_like(W)
    lrs = torch.as_tensor(np.stack([learning_rates(c.lr, c.schedule, c.warmup, steps) for c in configs]),
                          dtype=torch.float32)                                          # (R, steps)
    clip = torch.tensor([c.clip for c in configs])
    row_run = torch.arange(R).repeat_interleave(batch)
    alpha = torch.tensor([float(c.alpha) for c in configs])[row_run]
    objective_of = np.array([c.objective for c in configs])[row_run.numpy()]
    rows_of = partition_rows(objective_of)
    feats_b = pair.features[1]
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        Wg = W.clone().requires_grad_()
        table = loglinear_tables(Wg, feats_b)                                           # (R, S, n)
        b = rollouts(B, lambda h, s, _tok: table.detach()[row_run, s], alpha, False, R * batch, gen,
                       labels="sft" in rows_of)
        logits = table[row_run[:, None], b.states]                                      # (N, H, n) log-probs
        per_run = per_run_losses(R, row_run, rows_of, lambda objective, idx: position_losses(
            objective, logits[idx], b.take(idx), B, False, groups=row_run[idx]), batch)
        (grad,) = clip_per_run(torch.autograd.grad(per_run.sum(), Wg), clip_norm, active=clip)
        W = adam_step(W, grad, m, v, step + 1, lrs[:, step])
        W = torch.where(bf16[:, None, None], round_bf16(W), W)
    return _outcomes(pair, runs, W0, W)


def _outcomes(pair, runs, W0, W):
    B = pair.B
    with torch.no_grad():
        qa0, qa = (loglinear_tables(x.double(), pair.features[0]).numpy() for x in (W0, W))
        qb = loglinear_tables(W.double(), pair.features[1]).numpy()
    sparsity, sparsity_bf16 = update_sparsity(W0, W)
    evaluate = Evaluator(B, fixed_points=False)
    return pd.DataFrame([outcome_row(pair, c, s, qa0[r], qa[r], np.broadcast_to(qb[r], (B.horizon,) + qb[r].shape),
                                     sparsity[r], sparsity_bf16[r], evaluate)
                         for r, (c, s) in enumerate(runs)])


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


def neural_student(pair, seed, steps=300, batch=64, lr=3e-3):
    """Phase 1 for the tiny Qwen2: FKL with the full conditionals on A's teacher rollouts (first token
    n). Returns the trained model."""
    from llm_bridge.models import tiny_model
    n = pair.A.teachers.n
    model = tiny_model("qwen2", vocab_size=n + 2, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(6000 + seed)
    config = SpectrumConfig("fkl", clip=True)
    for _ in range(steps):
        neural_step(model, opt, pair.A, config, batch, gen, bos=n)
    return model


def distil_neural(pair, config, seed, start, steps=150, batch=32):
    """Phase 2 for one neural run from the phase-1 model ``start`` (copied): the config's learning-rate
    schedule, objective, alpha, clipping and storage on task B (first token n + 1). Returns the outcome
    row as :func:`distil_loglinear` does."""
    A, B = pair.A, pair.B
    n = A.teachers.n
    model = copy.deepcopy(start)
    bf16 = config.storage == "bf16"
    params = list(model.parameters())
    with torch.no_grad():
        if bf16:
            for p in params:
                p.copy_(round_bf16(p))
    theta0 = torch.cat([p.detach().flatten() for p in params]).clone()
    table_a0 = student_table(model, A, bos=n)
    opt = torch.optim.Adam(params, lr=config.lr, betas=BETAS, eps=EPS)
    gen = torch.Generator().manual_seed(7000 + seed)
    spectrum = config.spectrum()
    for step, lr in enumerate(learning_rates(config.lr, config.schedule, config.warmup, steps)):
        for group in opt.param_groups:
            group["lr"] = float(lr)
        neural_step(model, opt, B, spectrum, batch, gen, bos=n + 1)
        if bf16:
            with torch.no_grad():
                for p in params:
                    p.copy_(round_bf16(p))
    theta1 = torch.cat([p.detach().flatten() for p in params])
    sparsity, sparsity_bf16 = update_sparsity(theta0, theta1)
    return outcome_row(pair, config, seed, table_a0, student_table(model, A, bos=n),
                       student_table(model, B, bos=n + 1), sparsity, sparsity_bf16)
