"""Token-level losses from the student's logits and K teachers' full conditionals (or top-k): forward_kl,
reverse_kl, generalized_jsd, and fused_linear_loss from hidden states (SPEC 1, 2, 6)."""

import math

import torch

from ._engine import ChunkedLoss, prepare, reduce, rows

# The beta of a generalised JSD in other libraries, against ours (0 = forward KL, 1 = reverse KL), read
# from each release's source and, where stated, run against ours (tests/test_losses_oracle.py):
JSD_CONVENTIONS = {
    "this library": "beta = 0: sum_k w_k KL(p_k || q) (forward); beta = 1: reverse; "
                    "M = beta p + (1 - beta) q, JSD = beta KL(p || M) + (1 - beta) KL(q || M)",
    "TRL GKDTrainer.generalized_jsd_loss": "the same (ours = TRL's at the same beta)",
    "Liger LigerFusedLinearJSDLoss >= 0.5.6 (chunked)": "the same (ours = Liger's at the same beta; "
        "do not translate beta)",
    "Liger LigerFusedLinearJSDLoss 0.5.3-0.5.5 (chunked)": "beta never reaches the formula: always the "
        "symmetric JSD (ours at beta = 0.5), whatever beta is passed",
    "Liger LigerJSD (Triton, GPU)": "the same formula as ours in 0.8.5's source (P the target, Q the input)",
}


def _kl_rows(log_a, log_b):
    """KL(a || b) per row, 0 log 0 = 0 (a = exp(log_a))."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def _jsd_rows(log_p, log_q, beta):
    """beta KL(p || M) + (1 - beta) KL(q || M), M = beta p + (1 - beta) q; exact KLs at the endpoints."""
    if beta == 0.0:
        return _kl_rows(log_p, log_q)
    if beta == 1.0:
        return _kl_rows(log_q, log_p)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * _kl_rows(log_p, log_m) + (1 - beta) * _kl_rows(log_q, log_m)


def _log1mexp(x):
    """ln(1 - e^x) for x <= 0, accurate on both sides of ln 2."""
    x = x.clamp(max=0.0)
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _topk_rows(kind, s_logp, ids, lp, tail, V, beta):
    """One top-k teacher against the student's full log-probs ``s_logp`` (n, V), per row."""
    s_top = s_logp.gather(-1, ids)
    # the teacher's mass outside its top k; below 1e-12 it is the rounding of 1 - sum, and counts as 0
    log_tail = _log1mexp(torch.logsumexp(lp, dim=-1))
    log_tail = torch.where(log_tail < math.log(1e-12), torch.full_like(log_tail, -math.inf), log_tail)
    if tail == "truncate":                                      # the partial KL sum, clamped at 0
        terms = (lp.exp() * (lp - s_top)) if kind == "forward" else (s_top.exp() * (s_top - lp))
        return terms.sum(-1).clamp(min=0.0)
    if tail == "uniform":                                       # the tail mass spread over the other V - k
        full = torch.full_like(s_logp, 0.0) + (log_tail - math.log(max(V - ids.shape[-1], 1)))[:, None]
        full = full.scatter(-1, ids, lp)
        t_rows, s_rows = full, s_logp
    elif tail == "tail":                                        # k + 1 categories: the top k and the tail
        s_rest = torch.logsumexp(s_logp.scatter(-1, ids, -math.inf), dim=-1)     # exact, no 1 - sum
        t_rows = torch.cat([lp, log_tail[:, None]], dim=-1)
        s_rows = torch.cat([s_top, s_rest[:, None]], dim=-1)
    else:                                                       # renormalise the teacher on its top k
        t_rows = lp - torch.logsumexp(lp, dim=-1, keepdim=True)
        # forward KL keeps the student's full log-probs (its mass outside is pushed to 0); reverse KL and
        # the JSD need the student on the same support, so it is renormalised there too
        s_rows = s_top if kind == "forward" else s_top - torch.logsumexp(s_top, dim=-1, keepdim=True)
    if kind == "forward":
        p = t_rows.exp()
        return torch.where(p > 0, p * (t_rows - s_rows), torch.zeros_like(p)).sum(-1)
    if kind == "reverse":
        return _kl_rows(s_rows, t_rows)
    return _jsd_rows(t_rows, s_rows, beta)




def _terms(problem, kind, beta):
    """terms(idx, s_logp) -> (loss (n,), metrics {name: (n,) or (K, n)}) for the positions idx.

    Full teachers, one pass each (log-softmax in the compute dtype): A = sum_k w_k p_k, the pooled
    r = sum_k w_k ln p_k and sum_k w_k sum_a p_k ln p_k accumulate, so that
    forward = sum_k w_k sum p_k ln p_k - sum_a A ln q, reverse = sum_a q (ln q - r),
    disagreement = sum_k w_k sum p_k ln p_k - sum_a A ln A (= H(A) - sum_k w_k H(p_k)), ln z = lse(r).
    Where a teacher's weight is > 0 its logits are finite or -inf (checked; -inf only for forward KL and
    the JSD, with 0 log 0 = 0 taken explicitly for the teachers that have one); where its weight is 0
    non-finite logits are replaced by a finite row, so weight-0 teachers add exact zeros.
    """
    teachers, V, compute, tau_t = problem.teachers, problem.V, problem.compute, problem.tau_t
    w_pos = problem.weights.to(compute).to(problem.student.device)
    metrics = problem.metrics

    def weights_at(idx):
        b = (torch.arange(problem.B * problem.T, device=w_pos.device)[idx] if isinstance(idx, slice) else idx) // problem.T
        return w_pos[b]                                          # (n, K)

    def terms(idx, s_logp):
        w = weights_at(idx)
        if problem.topk:
            flat = [(rows(t.ids, idx), rows(t.log_probs, idx).to(compute)) for t in teachers]
            per = torch.stack([_topk_rows(kind, s_logp, ids, lp, problem.tail, V, beta) for ids, lp in flat], dim=1)
            tail = torch.stack([-torch.expm1(torch.logsumexp(lp, -1)) for _, lp in flat]).clamp(min=0.0)
            return (w * per).sum(-1), ({"tail_mass": tail} if metrics else {})
        A = pooled = None
        neg_entropy = 0.0
        jsd = 0.0
        for k in range(len(teachers)):
            logits = problem.teacher_rows[k](idx)[:, :V].to(compute)
            wk = w[:, k:k + 1]
            if problem.sanitize[k]:               # non-finite logits where the weight is 0: any finite row
                logits = torch.where(wk > 0, logits, torch.zeros_like(logits))
            lp = torch.log_softmax(logits if tau_t == 1.0 else logits / tau_t, -1)
            if kind == "reverse":
                pooled = wk * lp if pooled is None else pooled.add_(wk * lp)
                if not metrics:
                    continue
            p = lp.exp()
            p_lp = torch.where(p > 0, p * lp, torch.zeros_like(p)) if problem.neg_inf[k] else p * lp   # 0 log 0 = 0
            neg_entropy = neg_entropy + wk[:, 0] * p_lp.sum(-1)
            A = wk * p if A is None else A.add_(wk * p)
            if metrics and kind != "reverse":
                pooled = wk * lp if pooled is None else pooled.add_(wk * lp)
            if kind == "jsd":
                jsd = jsd + wk[:, 0] * _jsd_rows(lp, s_logp, beta)
        if kind == "forward":
            loss = neg_entropy - (A * s_logp).sum(-1)
        elif kind == "reverse":
            loss = (s_logp.exp() * (s_logp - pooled)).sum(-1)
        else:
            loss = jsd
        if not metrics:
            return loss, {}
        a_log_a = torch.where(A > 0, A * torch.log(A), torch.zeros_like(A)) if any(problem.neg_inf) else A * torch.log(A)
        return loss, {"teacher_disagreement": neg_entropy - a_log_a.sum(-1),
                      "neg_log_z": -torch.logsumexp(pooled, -1)}
    return terms


def _token_loss(kind, student_logits, teacher_logits, weights, mask, student_temperature, teacher_temperature,
                chunk_size, reduction, vocab_size, tail, metrics, beta=None, num_items_in_batch=None,
                empty_mask="zero"):
    s = student_logits
    if not torch.is_tensor(s) or s.ndim != 3 or not s.is_floating_point():
        raise ValueError(f"student_logits must be a floating (B, T, V) tensor, got "
                         f"{tuple(s.shape) if torch.is_tensor(s) else type(s).__name__}")
    problem = prepare(s, s.shape[-1], teacher_logits, weights, mask, student_temperature, teacher_temperature,
                      chunk_size, reduction, vocab_size, tail, kind, metrics=metrics,
                      num_items_in_batch=num_items_in_batch, empty_mask=empty_mask)
    out = {}
    per_position = ChunkedLoss.apply(student_logits, None, problem, _terms(problem, kind, beta), out)
    return reduce(per_position, problem, out), out


def forward_kl(student_logits, teacher_logits, weights, mask=None, *, student_temperature=1.0,
               teacher_temperature=1.0, chunk_size=None, reduction="mean", vocab_size=None, tail="tail",
               metrics=True, num_items_in_batch=None, empty_mask="zero"):
    """sum_k w_k KL(p_k || q) per position (SPEC 1); its minimiser is the arithmetic pool A = sum_k w_k p_k,
    and sum_k w_k KL(p_k || q) = sum_k w_k KL(p_k || A) + KL(A || q) (metric ``teacher_disagreement`` is
    the first term: the loss's floor).

    q = softmax(student_logits / student_temperature), p_k = softmax(teacher_logits_k / teacher_temperature)
    over the first ``vocab_size`` columns (default: all; teachers must then have the student's width).
    ``tail`` is the treatment of top-k teachers outside their k tokens (see :data:`TAILS` and the README).
    ``chunk_size``: positions per chunk (default about 8M logits per buffer); ``metrics=False`` skips
    the per-position metrics (about a fifth of the time).

    ``mask`` (B, T): 0 / 1 only (bool, integer or float; anything else is a ValueError; from labels with
    -100 use :func:`mask_from_labels`). ``reduction``: ``"mean"`` over the kept positions (TRL's
    ``batchmean`` with labels), ``"sum"``, ``"batchmean"`` the sum divided by B (torch's KLDivLoss, and
    TRL's ``batchmean`` with ``labels=None``), ``"none"`` (B, T) with 0 where masked.
    ``num_items_in_batch``: the kept positions of the whole gradient-accumulation step (what
    transformers' Trainer passes to ``compute_loss``); the loss is then the sum over this micro-batch
    divided by it, so that accumulated micro-batches give the full batch's gradient (only with 'mean').
    A mask with no kept position gives a zero loss that still backpropagates (zero gradients); pass
    ``empty_mask="raise"`` to make it an error. Teachers and weights are constants: no gradient flows to
    them, even if they require one (detach them yourself to make that explicit). Returns (loss, metrics).
    """
    return _token_loss("forward", student_logits, teacher_logits, weights, mask, student_temperature,
                       teacher_temperature, chunk_size, reduction, vocab_size, tail, metrics,
                       num_items_in_batch=num_items_in_batch, empty_mask=empty_mask)


def reverse_kl(student_logits, teacher_logits, weights, mask=None, *, student_temperature=1.0,
               teacher_temperature=1.0, chunk_size=None, reduction="mean", vocab_size=None, tail="tail",
               metrics=True, num_items_in_batch=None, empty_mask="zero"):
    """sum_k w_k KL(q || p_k) = KL(q || l) - ln z per position (SPEC 1, 2): its minimiser is the local
    geometric pool l ∝ prod_k p_k^{w_k}, with minimum -ln z (metric ``neg_log_z``). Per position this is
    the per-token RKL; summed over a sequence it reaches l, not the sequence-level G_seq (for that, see
    :func:`rkl_policy_gradient` with gamma = 1). Same arguments and returns as :func:`forward_kl`."""
    return _token_loss("reverse", student_logits, teacher_logits, weights, mask, student_temperature,
                       teacher_temperature, chunk_size, reduction, vocab_size, tail, metrics,
                       num_items_in_batch=num_items_in_batch, empty_mask=empty_mask)


def generalized_jsd(student_logits, teacher_logits, weights, mask=None, *, beta=0.5, student_temperature=1.0,
                    teacher_temperature=1.0, chunk_size=None, reduction="mean", vocab_size=None,
                    tail="tail", metrics=True, num_items_in_batch=None, empty_mask="zero"):
    """sum_k w_k JSD_beta(p_k, q), JSD_beta = beta KL(p || M) + (1 - beta) KL(q || M), M = beta p + (1 - beta) q.

    beta = 0 is exactly :func:`forward_kl` and beta = 1 exactly :func:`reverse_kl`: TRL's convention, and
    Liger's chunked loss's from 0.5.6 on (see :data:`JSD_CONVENTIONS`; the same beta, no translation).
    Near the endpoints the scale shrinks: JSD_beta ≈ beta KL(p || q) as beta -> 0 and ≈ (1 - beta)
    KL(q || p) as beta -> 1, so the loss is continuous inside (0, 1) but jumps at the endpoints, where
    the plain KL is used; rescale the learning rate accordingly.
    """
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise ValueError(f"beta = {beta!r} must lie in [0, 1]")
    kind = "forward" if beta == 0 else "reverse" if beta == 1 else "jsd"
    return _token_loss(kind, student_logits, teacher_logits, weights, mask, student_temperature,
                       teacher_temperature, chunk_size, reduction, vocab_size, tail, metrics, beta=float(beta),
                       num_items_in_batch=num_items_in_batch, empty_mask=empty_mask)


def fused_linear_loss(hidden_states, lm_head_weight, teacher_logits, weights, mask=None, *, kind="forward",
                      beta=0.5, bias=None, student_temperature=1.0, teacher_temperature=1.0,
                      chunk_size=None, reduction="mean", vocab_size=None, tail="tail", metrics=True,
                      num_items_in_batch=None, empty_mask="zero"):
    """The same losses from the student's final hidden states ``(B, T, H)`` and its ``lm_head`` weight
    ``(V, H)`` (and optional bias): the student's logits are formed chunk by chunk and never held whole,
    so memory beyond the inputs and the weight's gradient does not grow with V (SPEC 6 practice).

    kind: 'forward', 'reverse' or 'jsd' (with ``beta``). Gradients flow to ``hidden_states`` and to
    ``lm_head_weight`` (every reduction but 'none'). Returns (loss, metrics) as the other losses.
    """
    if kind not in ("forward", "reverse", "jsd"):
        raise ValueError(f"kind = {kind!r} must be 'forward', 'reverse' or 'jsd'")
    if not torch.is_tensor(hidden_states) or hidden_states.ndim != 3:
        raise ValueError("hidden_states must be a (B, T, H) tensor")
    if not torch.is_tensor(lm_head_weight) or lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden_states.shape[2]:
        raise ValueError(f"lm_head_weight must have shape (V, H) with H = {hidden_states.shape[2]}, got "
                         f"{tuple(lm_head_weight.shape) if torch.is_tensor(lm_head_weight) else lm_head_weight}")
    if reduction == "none":
        raise ValueError("fused_linear_loss supports reduction 'mean', 'sum' or 'batchmean', not 'none'")
    problem = prepare(hidden_states, lm_head_weight.shape[0], teacher_logits, weights, mask, student_temperature,
                      teacher_temperature, chunk_size, reduction, vocab_size, tail, kind, hidden=True, metrics=metrics,
                      bias=bias, num_items_in_batch=num_items_in_batch, empty_mask=empty_mask)
    out = {}
    b = None if kind == "jsd" and beta in (0, 1) else beta
    k = "forward" if kind == "jsd" and beta == 0 else "reverse" if kind == "jsd" and beta == 1 else kind
    per_position = ChunkedLoss.apply(hidden_states, lm_head_weight, problem, _terms(problem, k, b), out)
    return reduce(per_position, problem, out), out


