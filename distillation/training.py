"""Students distilled from exact finite-state teachers across the rollout spectrum (theory section 4-5; E1, E2, E5).

Training sequences come from the student with probability alpha and from a teacher k ~ w with
1 - alpha (or, ``switch=True``, from a teacher up to a uniform position and from the student after).
Every objective of ``fixed_points.OBJECTIVES`` is computed by the loss code of ``llm_bridge.losses``,
for every student of ``students`` with per-step tables (a tabular softmax, one logit row per (step, state);
a shared-parameter tiny Qwen2 reading the token prefix), every run of a sweep trained at once. The outcomes are exact
(``evaluation.Evaluator``).
"""

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from llm_bridge.losses import forward_kl, kl_estimator_loss, reverse_kl, rkl_policy_gradient, token_log_probs

from .evaluation import DIVERGED_LOGIT, TARGETS, Evaluator, _outcome_row
from .students import at_positions, at_step


@dataclass
class Batch:
    """N sequences of H steps, as a sampler recorded them: states, tokens and mask (N, H) (True at the
    positions a sequence reaches); the spectrum's sampler adds whether the student generated each token,
    the generating policy's log-prob of it and the SFT label of each position (N, H), and the teacher
    that generated (or, for student sequences, scores) each sequence (N,); the goal tasks' sampler adds
    whether each sequence reached the goal (N,). Fields a sampler does not record are None."""
    states: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    by_student: torch.Tensor = None
    gen_logp: torch.Tensor = None
    labels: torch.Tensor = None
    teacher: torch.Tensor = None
    correct: torch.Tensor = None

    def take(self, rows):
        """The sequences ``rows`` (indices or a mask)."""
        return Batch(**{k: None if v is None else v[rows] for k, v in vars(self).items()})

    @staticmethod
    def cat(parts):
        """The sequences of several batches, in order."""
        return Batch(**{k: None if getattr(parts[0], k) is None else torch.cat([getattr(p, k) for p in parts])
                        for k in Batch.__dataclass_fields__})


def sample(next_state, states, steps, policy, gen, finished, record=None):
    """The one sampler of the finite-state tasks: N sequences from start ``states`` (N,) for ``steps``
    steps on the machine ``next_state`` (S, n) (a negative entry ends a sequence).

    At step h a sequence still running (not ``finished(h, states)``) draws its token from
    ``policy(h, states)`` ((N, n) log-probs) and moves on;
    a finished one keeps its state (its draws are masked out). ``record(h, states, tokens, rows)`` returns
    more per-step fields to keep (drawn after the token, in this order). Returns ({field: (N, steps)}
    with states, tokens, mask and the recorded ones, the final states (N,))."""
    rec = {"states": [], "tokens": [], "mask": []}
    s = states
    for h in range(steps):
        alive = ~finished(h, s)
        safe = s.clamp(min=0)
        rows = policy(h, safe)
        token = torch.multinomial(rows.exp(), 1, generator=gen)[:, 0]
        for key, value in (("states", safe), ("tokens", token), ("mask", alive)):
            rec[key].append(value)
        for key, value in (record(h, safe, token, rows) if record else {}).items():
            rec.setdefault(key, []).append(value)
        s = torch.where(alive, next_state[safe, token], s)
    return {k: torch.stack(v, dim=1) for k, v in rec.items()}, s


def rollouts(task, student_logp, alpha, switch, n_sequences, gen, labels=True):
    """A training batch over the rollout spectrum (:func:`sample`). student_logp(h, states (N,)) -> (N, n)
    log-probs of the student at step h. ``alpha`` (N,) or a float: the probability that a sequence is the student's;
    ``switch``: the teacher writes up to a uniform position m in {0..H}, the student after (alpha is then
    ignored); ``labels``: draw SFT's label for each student token from a teacher k ~ w (else the labels
    are the tokens)."""
    N, H = n_sequences, task.horizon
    next_state, teacher_logp, _ = task.tensors
    teacher = torch.multinomial(torch.as_tensor(task.weights, dtype=torch.float32), N, replacement=True, generator=gen)
    if switch:
        m = torch.randint(0, H + 1, (N,), generator=gen)
    else:
        student_seq = torch.rand(N, generator=gen) < torch.as_tensor(alpha, dtype=torch.float32).expand(N)

    def by_student(h):
        return (h >= m) if switch else student_seq

    def policy(h, states):
        return torch.where(by_student(h)[:, None], student_logp(h, states), teacher_logp[teacher, states])

    def record(h, states, token, rows):
        b = by_student(h)                                       # student tokens: a teacher labels the state
        label = torch.where(b, torch.multinomial(teacher_logp[teacher, states].exp(), 1, generator=gen)[:, 0],
                            token) if labels else token
        return {"by_student": b, "gen_logp": rows.gather(1, token[:, None])[:, 0], "labels": label}
    start = torch.full((N,), task.teachers.start, dtype=torch.long)
    fields, _ = sample(next_state, start, H, policy, gen, lambda h, s: s < 0, record)
    return Batch(teacher=teacher, **fields)


def partition_rows(keys):
    """{key: the rows (a LongTensor) whose key it is}, keys in sorted order: the sub-batches of a batch
    whose rows belong to runs with different objectives."""
    keys = np.asarray(keys)
    return {k: torch.as_tensor(np.nonzero(keys == k)[0]) for k in sorted(set(keys.tolist()))}


def per_run_losses(n_runs, row_run, parts, position_loss, batch):
    """(n_runs,) float32: each run's loss, the sum over its rows of ``position_loss(key, rows)`` ((len(rows),
    H) per-position losses of the sub-batch ``rows``) divided by ``batch``, for every ``key, rows`` of
    ``parts`` (:func:`partition_rows`); ``row_run`` (N,) the run of each row."""
    per_run = torch.zeros(n_runs)
    for key, rows in parts.items():
        per_run = per_run.index_add(0, row_run[rows], position_loss(key, rows).sum(1).float() / batch)
    return per_run


def importance_ratios(objective, log_q, batch, importance):
    """The importance weight at each position (N, H): 1 on the student's tokens and on rows not
    ``importance``-weighted (a bool, or one per sequence), else q / mu of the teacher's token (the
    k-estimators: a per-token weight) or its prefix product over the response (the policy gradients: a
    sequence weight). log_q (N, H): the student's log-prob of each token (no gradient)."""
    weighted = torch.as_tensor(importance, dtype=torch.bool)
    weighted = weighted[:, None] if weighted.ndim == 1 else weighted
    ratio = torch.where(batch.by_student | ~weighted, torch.ones_like(log_q), (log_q - batch.gen_logp).exp())
    return torch.cumprod(ratio, dim=1) if objective in ("pg0", "pg1") else ratio


def truncated(ratio, truncate):
    """(the weights truncated at ``truncate`` (N,) per row, where each weight was truncated (N, H) bool)."""
    over = ratio > truncate[:, None]
    return torch.where(over, truncate[:, None].to(ratio.dtype), ratio), over


def position_losses(objective, logits, batch, task, importance=False, groups=None, truncate=None):
    """Per-position losses (N, H) of one objective on a batch, by the loss code of llm_bridge.losses.
    logits (N, H, n) are the student's at the batch's positions (with gradient). ``importance`` (a bool,
    or one per sequence): weight the tokens a teacher generated by q/mu (sequence-level prefix products
    for the policy gradients, :func:`importance_ratios`), truncated at ``truncate`` ((N,) per row; None:
    never)."""
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
    ratio = importance_ratios(objective, token_log_probs(logits, tok).detach(), batch, importance)
    if truncate is not None:
        ratio = truncated(ratio, truncate)[0]
    if objective in ("pg0", "pg1"):
        return rkl_policy_gradient(logits, tok, t_tok, w, m, gamma=0.0 if objective == "pg0" else 1.0,
                                   groups=groups, importance_weights=ratio, reduction="none")[0]
    if objective == "k3-teacher":
        route = torch.nn.functional.one_hot(batch.teacher, t.K).double()
        return kl_estimator_loss(logits, tok, t_tok, route, m, estimator="k3", pool="after", importance_weights=ratio,
                                 reduction="none")[0]
    return kl_estimator_loss(logits, tok, t_tok, w, m, estimator=objective, pool="before", importance_weights=ratio,
                             reduction="none")[0]


def truncation_counts(n_runs, row_run, parts, logits, batch, importance, truncate):
    """Per run (n_runs,): how many of a batch's importance-weighted teacher tokens had their weight cut by
    ``truncate`` ((N,) per row), and how many such tokens there were (``parts`` as in :func:`per_run_losses`)."""
    over, count = torch.zeros(n_runs), torch.zeros(n_runs)
    for objective, rows in parts.items():
        b = batch.take(rows)
        weighted = b.mask & ~b.by_student & importance[rows][:, None]
        ratio = importance_ratios(objective, token_log_probs(logits[rows], b.tokens), b, importance[rows])
        over = over.index_add(0, row_run[rows], (truncated(ratio, truncate[rows])[1] & weighted).sum(1).float())
        count = count.index_add(0, row_run[rows], weighted.sum(1).float())
    return over, count


def train(task, configs, seeds, students, steps=300, batch=32, eval_every=50, gen=None, fixed_points=True):
    """Train one student per (config, seed), all at once: ``students`` (any of ``distillation.students``:
    per-step tables (R, H, S, n), or stationary ones (R, S, n), the same policy at every step) holds the
    R = len(configs) * len(seeds) runs in that order
    (configs outer); each run's gradient norm is clipped when its config says ``clip``; the rollouts draw
    from ``gen`` (a torch.Generator; default seeded 0).

    configs: a list of ``configs.SpectrumConfig``. Returns a tidy DataFrame: one row per run and
    evaluation step with the config, seed, step, loss and the exact outcomes of :class:`Evaluator` (KL to
    every target, ``kl_named`` to the objective's nominal target, ``kl_fixed_point`` to the
    configuration's derived fixed point unless ``fixed_points`` is False), ``diverged`` and ``max_logit``
    (the tabular student's largest centred logit; NaN for others). When a config truncates its importance
    weights, every row also has ``truncated_steps`` (the share of the steps so far in which the truncation
    cut at least one of the run's weights) and ``truncated_tokens`` (the share of its weighted teacher tokens
    so far whose weight it cut); NaN for the runs that do not truncate.
    """
    runs = [(c, s) for c in configs for s in seeds]
    R = len(runs)
    if students.runs != R:
        raise ValueError(f"students hold {students.runs} runs, but configs x seeds make {R}")
    gen = torch.Generator().manual_seed(0) if gen is None else gen
    students.clip = torch.tensor([c.clip for c, _ in runs])
    # rows: ``batch`` sequences per run, the plain runs' first and the switch-point runs' after them
    switch = torch.tensor([c.switch for c, _ in runs])
    row_run = torch.cat([torch.nonzero(~switch)[:, 0], torch.nonzero(switch)[:, 0]]).repeat_interleave(batch)
    n_plain = int((~switch).sum()) * batch
    alpha = torch.tensor([float(c.alpha) for c, _ in runs])[row_run[:n_plain]]
    weighted = torch.tensor([c.importance for c, _ in runs])[row_run]
    cut = torch.tensor([c.truncate for c, _ in runs])
    truncating = bool(torch.isfinite(cut).any())
    truncate = cut[row_run] if truncating else None
    cut_steps, cut_tokens, weighted_tokens = torch.zeros(R), torch.zeros(R), torch.zeros(R)
    objective_of = np.array([c.objective for c, _ in runs])[row_run.numpy()]
    rows_of = partition_rows(objective_of)
    sft = "sft" in rows_of                                    # draw SFT's labels only when a run needs them
    rows = []
    evaluate = Evaluator(task, fixed_points)

    def record(step, losses):
        log_q = students.log_probs()
        if log_q.ndim == 3:                                   # stationary: the same table at every step
            log_q = np.broadcast_to(log_q[:, None], (R, task.horizon) + log_q.shape[1:])
        big = students.max_logit() if hasattr(students, "max_logit") else np.full(R, math.nan)
        bad = ~np.isfinite(log_q).all(axis=(1, 2, 3))
        shares = {}
        if truncating:
            finite = torch.isfinite(cut)
            shares = {"truncated_steps": torch.where(finite, cut_steps / max(step, 1), math.nan).numpy(),
                      "truncated_tokens": torch.where(finite, cut_tokens / weighted_tokens.clamp(min=1), math.nan).numpy()}
        for r, (c, s) in enumerate(runs):
            out = ({f"kl_{k}": math.nan for k in TARGETS + ("sft", "fixed_point")} | {"accuracy": math.nan}) if bad[r] \
                else evaluate(log_q[r], c)
            rows.append(_outcome_row(c, s, step, float(losses[r]), out, max_logit=float(big[r]),
                                     diverged=bool(bad[r] or big[r] > DIVERGED_LOGIT or not np.isfinite(losses[r])),
                                     **{k: float(v[r]) for k, v in shares.items()}))

    losses = np.zeros(R)
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            record(step, losses)
        if step == steps:
            break
        table = students.tables()                                             # (R, H, S, n) or (R, S, n)

        def student_logp(sel):
            return lambda h, states: at_step(table.detach(), h)[row_run[sel], states]
        parts = [rollouts(task, student_logp(slice(0, n_plain)), alpha, False, n_plain, gen, sft)] if n_plain else []
        if n_plain < R * batch:
            parts.append(rollouts(task, student_logp(slice(n_plain, None)), 0.0, True, R * batch - n_plain, gen, sft))
        b = Batch.cat(parts)
        logits = at_positions(table, row_run, b.states)                                  # (N, H, n)
        per_run = per_run_losses(R, row_run, rows_of, lambda objective, idx: position_losses(
            objective, logits[idx], b.take(idx), task, weighted[idx], groups=row_run[idx],
            truncate=None if truncate is None else truncate[idx]), batch)
        if truncating:
            over, count = truncation_counts(R, row_run, rows_of, logits.detach(), b, weighted, truncate)
            cut_steps, cut_tokens, weighted_tokens = cut_steps + (over > 0), cut_tokens + over, weighted_tokens + count
        students.step(per_run.sum())
        losses = per_run.detach().numpy()
    return pd.DataFrame(rows)
