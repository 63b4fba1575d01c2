"""Sampled-token losses (theory section 2, 4): the log-prob of sampled tokens, the on-policy reverse-KL policy
gradient by reward-to-go, and the k1 / k2 / k3 estimators as losses or rewards."""

import torch

from ._engine import check_items, check_mask, check_reduction, check_weights, first_bad, positive_number, reduce_total
from .token_level import reverse_kl

def token_log_probs(logits, tokens, temperature=1.0, vocab_size=None):
    """ln softmax(logits / temperature)[tokens] over the first ``vocab_size`` columns: logits (..., B, T, V),
    tokens (B, T) long; returns (..., B, T) in float32 (float64 for float64 logits), differentiable."""
    if not torch.is_tensor(tokens) or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError("tokens must be an integer (B, T) tensor")
    temperature = positive_number("temperature", temperature)
    V = logits.shape[-1] if vocab_size is None else vocab_size
    if tokens.shape != logits.shape[-3:-1]:
        raise ValueError(f"tokens must have shape (B, T) = {tuple(logits.shape[-3:-1])}, got {tuple(tokens.shape)}")
    bad = (tokens < 0) | (tokens >= V)
    if bool(bad.any()):
        i = first_bad(bad)
        raise ValueError(f"tokens{list(i)} = {int(tokens[i])} is outside the vocabulary [0, {V})")
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits[..., :V].to(compute) / temperature
    idx = tokens.expand(logits.shape[:-1]).unsqueeze(-1)
    return z.gather(-1, idx).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _sampled(student_logits, tokens, teacher_log_probs, weights, mask, importance_weights, student_temperature,
             vocab_size, empty_mask="zero", num_items_in_batch=None):
    """Validated (ln q(y) (B, T) with grad, ln p_k(y) (K, B, T), weights (B, K), mask, IS weights)."""
    if not torch.is_tensor(student_logits) or student_logits.ndim != 3:
        raise ValueError("student_logits must be a (B, T, V) tensor")
    B, T, _ = student_logits.shape
    lq = token_log_probs(student_logits, tokens, positive_number("student_temperature", student_temperature),
                         vocab_size)
    lp = torch.as_tensor(teacher_log_probs)
    if lp.ndim != 3 or lp.shape[1:] != (B, T):
        raise ValueError(f"teacher_log_probs must have shape (K, B, T) = (K, {B}, {T}): each teacher's "
                         f"log-prob of the sampled tokens (token_log_probs(teacher_logits, tokens)), got {tuple(lp.shape)}")
    w = check_weights(weights, lp.shape[0], B).to(lq.dtype).to(lq.device)
    m = check_mask(mask, B, T, lq.device, empty_mask)
    check_items(num_items_in_batch, m)
    lp = lp.detach()                                            # a constant: no gradient flows to the teachers
    live = (w.T[:, :, None] > 0).to(lp.device) & m[None].to(lp.device)   # (K, B, T): weight > 0, kept
    bad = (torch.isnan(lp) | (lp > 1e-6)) & live
    if bool(bad.any()):
        i = first_bad(bad)
        raise ValueError(f"teacher_log_probs{list(i)} = {float(lp[i])} is not a log-probability")
    minus_inf = torch.isneginf(lp)
    if bool((minus_inf & live).any()):
        i = first_bad(minus_inf & live)
        raise ValueError(f"teacher_log_probs{list(i)} = -inf with weight {float(w[i[1], i[0]])} > 0 at a kept "
                         f"position: the sampled token has probability 0 under teacher {i[0]}, so its log-ratio "
                         f"(the reward, k1/k2/k3) is infinite; mask the position or give the teacher weight 0 there")
    dead = ~torch.isfinite(lp) & ~live
    if bool(dead.any()):                       # weight 0 or masked: exact zeros, and no NaN in the backward
        lp = torch.where(dead, torch.zeros_like(lp), lp)
    if importance_weights is None:
        rho = torch.ones(B, T, dtype=lq.dtype, device=lq.device)
    else:
        rho = torch.as_tensor(importance_weights, dtype=lq.dtype, device=lq.device)
        if rho.shape != (B, T) or bool((~torch.isfinite(rho) | (rho < 0)).any()):
            raise ValueError(f"importance_weights must be finite, >= 0 and of shape (B, T) = ({B}, {T})")
    return lq, lp.to(lq.dtype).to(lq.device), w, m, rho.detach()


def _reduce_tokens(per_token, m, reduction, num_items_in_batch=None):
    per_token = torch.where(m, per_token, torch.zeros_like(per_token))
    if reduction == "none":
        return per_token
    return reduce_total(per_token.sum(), m.sum(), m.shape[0], reduction, num_items_in_batch)


def rkl_policy_gradient(student_logits, tokens, teacher_log_probs, weights, mask=None, *, gamma=1.0,
                        baseline="leave-one-out", groups=None, importance_weights=None, teacher_logits=None,
                        student_temperature=1.0, teacher_temperature=1.0, vocab_size=None, reduction="mean",
                        chunk_size=None, num_items_in_batch=None, empty_mask="zero"):
    """On-policy reverse-KL policy gradient from sampled tokens (theory section 2 "which target", theory section 3).

    Per-token reward r_t = sum_k w_k ln p_k(y_t | u_t) - ln q(y_t | u_t) (detached), reward-to-go
    G_t = sum_{s >= t} gamma^{s-t} r_s along each sequence (masked positions end it), and the surrogate
    -sum_t rho_t (G_t - b_t) ln q(y_t | u_t), whose expected gradient on student samples is that of
    sum_k w_k KL(q || p_k) over whole responses for gamma = 1 (the target: G_seq, conditionals g) and
    of the per-token RKL for gamma = 0 (the target: the local geometric l).

    baseline: 'leave-one-out' (the mean G_t of the other sequences at the same position; unbiased) or
    None; ``groups`` (B,) integer ids restrict it to the sequences of the same group (several prompts,
    or independent runs, in one batch: the group-relative baseline). importance_weights rho (B, T):
    per-token weights for tokens drawn from another policy (q / mu; for the sequence-level estimate
    pass the product of the ratios up to t). teacher_logits
    (K, B, T, V), optional: the lower-variance single-step decomposition, exact per-token RKL
    (:func:`reverse_kl`, differentiated exactly) plus the score-function term of the discounted future
    reward gamma G_{t+1} only. Returns (loss, metrics); metrics['sequence_rkl'] is the Monte-Carlo
    estimate of sum_k w_k KL(q || p_k) per sequence (mean over sequences; exact in expectation on
    student samples). ``mask``, ``reduction``, ``num_items_in_batch`` and ``empty_mask`` as in
    :func:`~llm_bridge.losses.forward_kl`.
    """
    if not (isinstance(gamma, (int, float)) and 0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma = {gamma!r} must lie in [0, 1]")
    if baseline not in ("leave-one-out", None):
        raise ValueError(f"baseline = {baseline!r} must be 'leave-one-out' or None")
    check_reduction(reduction, num_items_in_batch, empty_mask)
    lq, lp, w, m, rho = _sampled(student_logits, tokens, teacher_log_probs, weights, mask, importance_weights,
                                 student_temperature, vocab_size, empty_mask, num_items_in_batch)
    B, T = lq.shape
    reward = torch.where(m, (w.T[:, :, None] * lp).sum(0) - lq.detach(), torch.zeros_like(lq))
    to_go = torch.zeros_like(reward)
    running = torch.zeros(B, dtype=reward.dtype, device=reward.device)
    for t in range(T - 1, -1, -1):
        running = torch.where(m[:, t], reward[:, t] + gamma * running, torch.zeros_like(running))
        to_go[:, t] = running
    future = torch.cat([to_go[:, 1:], torch.zeros_like(to_go[:, :1])], dim=1) * m

    if groups is None:
        group = torch.zeros(B, dtype=torch.long, device=lq.device)
    else:
        group = torch.as_tensor(groups, device=lq.device).long()
        if group.shape != (B,) or bool((group < 0).any()):
            raise ValueError(f"groups must be (B,) = ({B},) non-negative integer ids")

    def centred(g):
        if baseline is None or B < 2:
            return g
        G = int(group.max()) + 1
        n = torch.zeros(G, T, dtype=g.dtype, device=g.device).index_add_(0, group, m.to(g.dtype))[group]
        total = torch.zeros(G, T, dtype=g.dtype, device=g.device).index_add_(0, group, g * m)[group]
        return torch.where(n > 1, g - (total - g) / (n - 1).clamp(min=1), g)
    if teacher_logits is None:
        per_token = -rho * centred(to_go) * lq
        metrics = {}
    else:
        exact, metrics = reverse_kl(student_logits, teacher_logits, weights, m, student_temperature=student_temperature,
                                    teacher_temperature=teacher_temperature, chunk_size=chunk_size,
                                    reduction="none", vocab_size=vocab_size)
        per_token = exact - rho * gamma * centred(future) * lq
    metrics.update(sequence_rkl=float(-(reward * m).sum(1).mean()), gamma=gamma,
                   student_temperature=student_temperature)
    return _reduce_tokens(per_token, m, reduction, num_items_in_batch), metrics


ESTIMATORS = {"k1": (lambda r: -r, lambda r: -torch.ones_like(r)),
              "k2": (lambda r: 0.5 * r * r, lambda r: r),
              "k3": (lambda r: torch.expm1(r) - r, lambda r: torch.expm1(r)),
              # verl's straight-through "k3+": the value of k3, the gradient of k2
              "k3+": (lambda r: torch.expm1(r) - r, lambda r: r)}
DIRECTIONS = ("reverse", "forward")
VERL_LOG_RATIO_CLAMP = 20.0       # verl clamps the log-ratio to [-20, 20] before its k3 ("for numerical stability")


def _estimator_value(estimator, r, clamp):
    """k(r) as a differentiable tensor: k3+ is k3's value with k2's gradient; ``clamp`` as verl's
    low_var_kl: r clamped to [-20, 20], then the value to [-clamp, clamp] (zero gradient beyond)."""
    if clamp is not None:
        r = r.clamp(-VERL_LOG_RATIO_CLAMP, VERL_LOG_RATIO_CLAMP)
    value = ESTIMATORS[estimator][0](r)
    if clamp is not None:
        value = value.clamp(-clamp, clamp)
    if estimator == "k3+":
        k2 = 0.5 * r * r
        value = k2 - k2.detach() + value.detach()
    return value


def kl_estimator_loss(student_logits, tokens, teacher_log_probs, weights, mask=None, *, estimator="k3",
                      mode="loss", pool="before", direction="reverse", clamp=None, importance_weights=None,
                      student_temperature=1.0, vocab_size=None, reduction="mean", num_items_in_batch=None,
                      empty_mask="zero"):
    """A sampled-token KL estimator of theory section 4, as practitioners use it (x = the sampled token):
    r = ln p(x) - ln q(x); k1 = -r, k2 = r^2 / 2, k3 = (e^r - 1) - r; k3+ (verl's) k3's value with
    k2's gradient.

    mode 'loss': rho k(r) differentiated through ln q (x fixed): on student samples k1 has zero expected
    gradient, k2 gives the RKL gradient, k3 the FKL gradient (theory section 4), k3+ the RKL gradient. mode
    'reward': the detached value as a cost in a policy gradient, rho sg(k(r)) ln q(x): k1 then gives the
    RKL gradient.
    pool 'before': one estimator on the pooled log-ratio sum_k w_k ln p_k(x) - ln q(x) (k3 then reaches
    l); 'after': sum_k w_k k(r_k), one estimator per teacher (k3 then reaches the arithmetic pool A).
    direction 'reverse' (r = ln p - ln q, for tokens sampled from the student) or 'forward'
    (r = ln q - ln p, for tokens sampled from the teacher: torchrl's DistillationLoss
    kl_direction='forward'; k3 as a loss then gives the FKL gradient). clamp: None, or verl's
    low_var_kl / k3 clamp (clamp=10: r clamped to [-20, 20], the value to [-10, 10], zero gradient
    where it binds: for k3 from r = 2.53 up). One-hot rows of ``weights`` (B, K) route each sample to
    one teacher. ``audit_estimators`` gives the exact expected gradient of every configuration.
    ``mask``, ``reduction``, ``num_items_in_batch`` and ``empty_mask`` as in
    :func:`~llm_bridge.losses.forward_kl`. Returns (loss, metrics).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator = {estimator!r} must be one of {sorted(ESTIMATORS)}")
    if mode not in ("loss", "reward"):
        raise ValueError(f"mode = {mode!r} must be 'loss' or 'reward'")
    if pool not in ("before", "after"):
        raise ValueError(f"pool = {pool!r} must be 'before' or 'after'")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction = {direction!r} must be one of {DIRECTIONS}")
    if clamp is not None and not (isinstance(clamp, (int, float)) and not isinstance(clamp, bool) and clamp > 0):
        raise ValueError(f"clamp = {clamp!r} must be None or a positive number (verl's low_var_kl: 10)")
    check_reduction(reduction, num_items_in_batch, empty_mask)
    lq, lp, w, m, rho = _sampled(student_logits, tokens, teacher_log_probs, weights, mask, importance_weights,
                                 student_temperature, vocab_size, empty_mask, num_items_in_batch)
    if direction == "reverse" and clamp is None and estimator != "k3+":      # the original arithmetic, unchanged
        value_of = ESTIMATORS[estimator][0]
        if pool == "before":
            value = value_of((w.T[:, :, None] * lp).sum(0) - lq)
        else:
            value = (w.T[:, :, None] * value_of(lp - lq[None])).sum(0)
    else:
        sign = 1 if direction == "reverse" else -1
        if pool == "before":
            value = _estimator_value(estimator, sign * ((w.T[:, :, None] * lp).sum(0) - lq), clamp)
        else:
            value = (w.T[:, :, None] * _estimator_value(estimator, sign * (lp - lq[None]), clamp)).sum(0)
    per_token = rho * (value if mode == "loss" else value.detach() * lq)
    n = int(m.sum())                                      # no kept position: the estimate of nothing is 0
    metrics = {"estimate": float((value.detach() * m).sum() / n) if n else 0.0, "estimator": estimator, "mode": mode,
               "pool": pool, "direction": direction, "clamp": clamp}
    return _reduce_tokens(per_token, m, reduction, num_items_in_batch), metrics
