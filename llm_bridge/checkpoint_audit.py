"""Which target a trained student sits closest to: the checkpoint audit of a distillation run (theory section 1, 2, 6).

:func:`target_distances` measures, at every position of some responses, the KL from a causal-LM
student's conditional q to each token-level target the runs of :mod:`llm_bridge.runs` reach — the
arithmetic pool A, the local geometric pool l, the routed mixture's conditionals (A with posterior
weights), each teacher alone, and any exact table the caller holds — and names the closest, with
the margin to the runner-up and its t interval over prompts. :class:`TargetAuditCallback` logs the
same every N steps of a ``transformers.Trainer`` run, so a run's drift toward a target is visible.
"""

import math

import numpy as np
import pandas as pd
import torch
from scipy import stats
from transformers import TrainerCallback

import aggregation as ag
from aggregation.validate import check_int

Z_LEVEL = 0.95


def _kl_rows(log_a, log_b):
    """KL(a || b) per row, 0 log 0 = 0."""
    a = np.exp(log_a)
    with np.errstate(invalid="ignore"):
        return np.where(a > 0, a * (log_a - log_b), 0.0).sum(-1)


@torch.no_grad()
def _student_log_probs(student, ids, n, start):
    """float64 log-softmax over the first n logit rows at positions start-1 .. len(ids)-2 (predicting
    ids[start:])."""
    logits = student(input_ids=torch.tensor([ids], device=next(student.parameters()).device)).logits[0]
    return torch.log_softmax(logits[start - 1:len(ids) - 1, :n].double(), -1).cpu().numpy()


@torch.no_grad()
def _sample(student, prompt, horizon, n, generator):
    ids = list(prompt)
    for _ in range(horizon):
        lp = _student_log_probs(student, ids + [0], n, len(ids))[-1]
        ids.append(int(torch.multinomial(torch.from_numpy(np.exp(lp)), 1, generator=generator)))
    return ids[len(prompt):]


def target_distances(student, teachers, prompts, responses=None, *, horizon=16, seed=0, g_samples=0, targets=None):
    """Per-position KL(q || target) from the student's conditionals q to A, l, the routed mixture, each
    teacher and (with ``g_samples`` > 0) g, the conditionals of the sequence-level geometric pool over the
    rest of the response.

    student: a causal LM (``model(input_ids=...).logits``) over the teachers' vocabulary;
    teachers: :class:`llm_bridge.teachers.Teachers` (their weights w define A and l); prompts: lists of
    token ids; responses: one list of token ids per prompt, or None for the student's own rollouts
    (``horizon`` tokens sampled with ``seed``); targets: optional extra targets, ``{name: f}`` with
    ``f(prompt, response)`` -> (T, n) log-probs at the response's positions (exact tables a caller holds,
    e.g. g on a finite-state machine). Returns a dict: ``responses`` (those used),
    ``positions`` (a DataFrame, one row per
    position: prompt, t, and the KL to each target, nats), ``summary`` (the mean KL per target, its
    mean over prompts and a 95% t interval over prompts), ``closest``, ``runner_up``, ``margin`` (the
    runner-up's mean KL minus the closest's) with ``margin_interval`` (a paired t interval over
    prompts; NaN with one prompt), and ``verdict`` (one line).

    The routed mixture ("routed": each response drawn from one teacher k ~ w, a run trained on the routed
    teacher's own traces reaches it, theory section 2): routed(a | u_t) = sum_k c_k(t) p_k(a | u_t) with the
    posterior c_k(t) ∝ w_k p_k(response[:t] | prompt) — A at t = 0, then the teacher the prefix reveals.

    g (theory section 2) at position t of a response of length T: g(a | u) ∝ prod_k p_k(a|u)^{w_k} Z(ua), Z(ua)
    over the T - t - 1 tokens that follow, each estimated by :func:`llm_bridge.partition.
    estimate_log_partition` with ``g_samples`` continuations from l (via ``sequence_geometric_scores``,
    one estimate per vocabulary token: only for small vocabularies). KL(q || g) is then a plug-in
    Monte-Carlo estimate; the t interval over prompts covers its noise (independent seeds per prompt).
    """
    prompts = [teachers.check_ids(list(p), f"prompts[{i}]", allow_empty=False, input_ids=True)
               for i, p in enumerate(prompts)]
    if not prompts:
        raise ValueError("prompts is empty")
    if responses is not None and len(responses) != len(prompts):
        raise ValueError(f"responses has {len(responses)} entries for {len(prompts)} prompts")
    horizon = check_int(horizon, "horizon", 1)
    g_samples = check_int(g_samples, "g_samples", 0)
    n, w = teachers.vocab_size, np.asarray(teachers.weights, dtype=float)
    generator = torch.Generator().manual_seed(seed)
    was_training = student.training
    student.eval()
    rows, used = [], []
    try:
        for i, prompt in enumerate(prompts):
            response = _sample(student, prompt, horizon, n, generator) if responses is None else \
                teachers.check_ids(list(responses[i]), f"responses[{i}]", allow_empty=False)
            used.append(response)
            path, full = teachers.teacher_log_probs(prompt, response, full=True)    # (K, T), (K, T, n)
            log_q = _student_log_probs(student, prompt + response, n, len(prompt))  # (T, n)
            tables = {"A": ag.log_arithmetic_pool(full, w), "l": ag.log_geometric_pool(full, w),
                      "routed": _log_routed(path, full, w)}
            tables.update({name: full[k] for k, name in enumerate(teachers.names)})
            if g_samples:
                tables["g"] = _log_g(teachers, prompt, response, g_samples, seed + i)
            for name, table_of in (targets or {}).items():
                tables[name] = np.asarray(table_of(prompt, response), dtype=float)[:, :n]
            kl = {name: _kl_rows(log_q, lp) for name, lp in tables.items()}
            for t in range(len(response)):
                rows.append({"prompt": i, "t": t, **{name: float(v[t]) for name, v in kl.items()}})
    finally:
        student.train(was_training)
    positions = pd.DataFrame(rows)
    names = [c for c in positions.columns if c not in ("prompt", "t")]
    per_prompt = positions.groupby("prompt")[names].mean()
    summary = pd.DataFrame({"mean KL": positions[names].mean(), "mean over prompts": per_prompt.mean()})
    lo, hi = zip(*(_t_interval(per_prompt[c].to_numpy()) for c in names))
    summary["low"], summary["high"] = lo, hi
    order = per_prompt.mean().sort_values()
    closest, runner_up = order.index[0], order.index[1]
    diff = (per_prompt[runner_up] - per_prompt[closest]).to_numpy()
    margin, interval = float(diff.mean()), _t_interval(diff)
    verdict = (f"closest to {closest}, by margin {margin:.3g} nats/token over {runner_up} "
               f"({int(Z_LEVEL * 100)}% t interval over {len(prompts)} prompts: [{interval[0]:.3g}, {interval[1]:.3g}])")
    return {"positions": positions, "responses": used, "summary": summary, "closest": closest, "runner_up": runner_up,
            "margin": margin, "margin_interval": interval, "verdict": verdict}


def _log_routed(path, full, w):
    """(T, n) ln of the routed mixture's conditionals: A with the posterior weights ∝ w_k p_k(prefix)."""
    with np.errstate(divide="ignore"):
        log_post = np.log(w)[:, None] + np.concatenate([np.zeros((len(w), 1)), np.cumsum(path, 1)[:, :-1]], 1)
    log_post -= np.logaddexp.reduce(log_post, axis=0)                                    # (K, T)
    return np.logaddexp.reduce(log_post[:, :, None] + full, axis=0)


def _log_g(teachers, prompt, response, n_samples, seed):
    """(T, n) Monte-Carlo ln g at every position of the response (horizon: the rest of the response)."""
    from .partition import sequence_geometric_scores
    n, T = teachers.vocab_size, len(response)
    out = np.empty((T, n))
    for t in range(T):
        scores = sequence_geometric_scores(teachers, prompt + response[:t], [[a] for a in range(n)], [T - t - 1],
                                           n_samples, seed=seed * 1000 + t)
        g = scores[scores.scorer == "geometric"].sort_values("option")
        out[t] = g.log_score.to_numpy()
    return out


def _t_interval(x):
    """The 95% t interval of the mean of x (NaN for fewer than 2 values)."""
    if len(x) < 2:
        return (math.nan, math.nan)
    half = stats.t.ppf(0.5 + Z_LEVEL / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return (float(x.mean() - half), float(x.mean() + half))


class TargetAuditCallback(TrainerCallback):
    """Every ``every`` optimiser steps (and at step 0), :func:`target_distances` on held-out prompts;
    each audit is appended to ``self.history`` (step, mean KL per target, closest, margin) and to the
    trainer's ``state.log_history`` under ``audit/...`` keys."""

    def __init__(self, teachers, prompts, responses=None, every=50, horizon=16, seed=0, g_samples=0, targets=None):
        self.teachers, self.prompts, self.responses, self.targets = teachers, prompts, responses, targets
        self.every = check_int(every, "every", 1)
        self.horizon, self.seed, self.g_samples = horizon, seed, g_samples
        self.history = []

    def _audit(self, model, state):
        out = target_distances(model, self.teachers, self.prompts, self.responses, horizon=self.horizon,
                               seed=self.seed, g_samples=self.g_samples, targets=self.targets)
        record = {"step": state.global_step, **{f"audit/KL to {name}": float(v)
                                                 for name, v in out["summary"]["mean over prompts"].items()},
                  "audit/closest": out["closest"], "audit/margin": out["margin"]}
        self.history.append(record)
        state.log_history.append(record)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._audit(model, state)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            self._audit(model, state)
