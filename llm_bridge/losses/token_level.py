"""Token-level losses from the student's logits and K teachers' full conditionals (or top-k): forward_kl,
reverse_kl, generalized_jsd, and fused_linear_loss from hidden states (theory section 1, 2, 6)."""

import math

import torch

from ._engine import check_not_meta, compute, locate_bad_input, prepare, rows

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




def _dot(a, b):
    """Row-wise dot product of two (n, V) tensors. torch.linalg.vecdot, not a batched (1, V) x (V, 1) bmm: on the
    CPU the bmm took 15x longer at n = 65, V = 32000 (one thread; 42 ms against 2.7 ms), a third of the loss's time."""
    return torch.linalg.vecdot(a, b)


def _kernel(problem, kind, beta):
    """kernel(idx, z, factor, need_grad) -> (loss (n,), check (n,), metrics) for the engine (_engine.run):
    z holds the chunk's student log-probabilities ln q (log_softmax of the logits / temperature: a gradient
    with respect to them is one with respect to the logits / temperature) and is overwritten with factor x
    the gradient of the chunk's summed loss with respect to z, in closed form (q = softmax z, ln p_k,
    weights w_k):

        forward   sum_k w_k sum p_k ln p_k - sum A ln q        gradient (sum_k w_k) q - A, A = sum_k w_k p_k
        reverse   sum q (ln q - r), r = sum_k w_k ln p_k      gradient q (ln q - r - loss)
        jsd       sum_k w_k JSD_beta(p_k, q)                  gradient (1 - beta) q (D - sum q D),
                                                              D = sum_k w_k (ln q - ln M_k)

    Metrics from the same terms: ``teacher_disagreement`` = sum_k w_k sum p_k ln p_k - sum A ln A
    (= H(A) - sum_k w_k H(p_k)) and ``neg_log_z`` = -lse(r). Where a teacher's weight is > 0 its
    logits are finite or -inf (-inf only for forward KL and the JSD; 0 log 0 = 0, taken exactly when a
    row's p ln p is not finite); where its weight is 0 its logits are never read (a chunk without weight
    on it) or replaced by zeros, so weight-0 teachers add exact zeros. Top-k teachers: the loss by
    autograd on the chunk (k + 1 categories, small next to the logits).
    """
    teachers, V, c, tau_t, metrics = problem.teachers, problem.V, problem.compute, problem.tau_t, problem.metrics

    def teacher_log_probs(k, idx, wk):
        """ln p_k on the chunk (n, V), or None when teacher k has weight 0 on every row."""
        dead = wk[:, 0] == 0
        if bool(dead.all()):
            return None
        logits = problem.teacher_rows[k](idx)[:, :V]
        if bool(dead.any()):                 # weight 0 there: any finite row (its logits may be NaN / inf)
            logits = torch.where(dead[:, None], torch.zeros((), dtype=logits.dtype, device=logits.device), logits)
        if tau_t != 1.0:
            return torch.log_softmax(logits.to(c) / tau_t, -1)
        return torch.log_softmax(logits, -1, dtype=c)

    def p_log_p(k, idx, p, lp):
        """sum p ln p per row, 0 log 0 = 0; bad logits (NaN, +inf, all -inf where live) raise."""
        e = _dot(p, lp)
        if not bool(torch.isfinite(e).all()):
            e = torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1)      # -inf logits: p = 0 there
            if not bool(torch.isfinite(e).all()):
                locate_bad_input(problem, idx, kind)
        return e

    def pools(idx, w, need_a, need_r):
        """A = sum_k w_k p_k, sum_k w_k sum p_k ln p_k, r = sum_k w_k ln p_k (each only if needed)."""
        A = r = None
        neg_entropy = torch.zeros(w.shape[0], dtype=c, device=w.device)
        for k in range(len(teachers)):
            wk = w[:, k:k + 1]
            lp = teacher_log_probs(k, idx, wk)
            if lp is None:
                continue
            if need_a:
                p = lp.exp()
                neg_entropy += wk[:, 0] * p_log_p(k, idx, p, lp)
                A = p.mul_(wk) if A is None else A.addcmul_(p, wk)
            if need_r:
                r = lp.mul_(wk) if r is None else r.addcmul_(lp, wk)
        return A, neg_entropy, r

    def metrics_of(A, neg_entropy, r):
        """The metrics; A and r kept. sum A ln A as a dot product with ln A (torch's xlogy took about 3x the time
        of log and dot on a CPU chunk, benchmarks/bench_metric_terms.py); a row with a zero in A (every teacher's p = 0
        there: 0 x -inf = NaN) is summed again with xlogy (0 log 0 = 0). r <= 0 (a weighted sum of
        log-probabilities), so e^r <= 1 needs no max shift (two passes fewer); a row whose sum of e^r is below
        1e-30 (its largest term then near float32's subnormals, or every r = -inf) is summed again shifted."""
        buf = torch.log(A)
        a_log_a = _dot(A, buf)
        zero = ~torch.isfinite(a_log_a)
        if bool(zero.any()):
            a_log_a[zero] = torch.xlogy(A[zero], A[zero]).sum(-1)
        lse = torch.exp(r, out=buf).sum(-1)
        low = lse < 1e-30
        lse.log_()
        if bool(low.any()):
            lse[low] = torch.logsumexp(r[low], -1)
        return {"teacher_disagreement": neg_entropy - a_log_a, "neg_log_z": -lse}

    def full(idx, z, factor, need_grad):
        w = problem.weights_at(idx, z.device)
        w_sum = w.sum(-1, keepdim=True)                               # z = ln q (the engine's log_softmax)
        if kind == "forward":
            A, neg_entropy, r = pools(idx, w, True, metrics)
            loss = neg_entropy - _dot(A, z)
            if need_grad:
                z.exp_().mul_(w_sum * factor).sub_(A, alpha=factor)
            return loss, loss, metrics_of(A, neg_entropy, r) if metrics else {}
        if kind == "reverse":
            A, neg_entropy, r = pools(idx, w, metrics, True)
            met = metrics_of(A, neg_entropy, r) if metrics else {}
            q = torch.exp(z, out=A) if metrics else z.exp()          # A is free once the metrics have read it
            d = torch.sub(z, r, out=r)                                 # ln q - r
            loss = _dot(q, d)
            if need_grad:
                torch.mul(q, d.sub_(loss[:, None]), out=z).mul_(factor)
            return loss, loss, met
        loss = torch.zeros(w.shape[0], dtype=c, device=z.device)
        log_m_pool = None
        for k in range(len(teachers)):
            wk = w[:, k:k + 1]
            lp = teacher_log_probs(k, idx, wk)
            if lp is None:
                continue
            log_m = torch.logaddexp(lp + math.log(beta), z + math.log1p(-beta))
            loss += wk[:, 0] * (beta * _kl_rows(lp, log_m) + (1 - beta) * _kl_rows(z, log_m))
            log_m_pool = log_m.mul_(wk) if log_m_pool is None else log_m_pool.addcmul_(log_m, wk)
        met = {}
        if metrics:
            met = metrics_of(*pools(idx, w, True, True))
        d = torch.mul(z, w_sum).sub_(log_m_pool)                       # D = sum_k w_k (ln q - ln M_k)
        q = z.exp()
        qd = _dot(q, d)
        if need_grad:
            torch.mul(q, d.sub_(qd[:, None]), out=z).mul_((1 - beta) * factor)
        return loss, loss + qd, met

    def topk(idx, z, factor, need_grad):
        w = problem.weights_at(idx, z.device)
        with torch.enable_grad():
            x = z.detach().requires_grad_(need_grad)
            s_logp = torch.log_softmax(x, dim=-1)
            flat = [(rows(t.ids, idx), rows(t.log_probs, idx).to(c)) for t in teachers]
            per = torch.stack([_topk_rows(kind, s_logp, ids, lp, problem.tail, V, beta) for ids, lp in flat], dim=1)
            loss = (w * per).sum(-1)
            if need_grad:
                (g,) = torch.autograd.grad(loss.sum(), x)
                z.copy_(g).mul_(factor)
        loss = loss.detach()
        met = {}
        if metrics:
            met["tail_mass"] = torch.stack([-torch.expm1(torch.logsumexp(lp, -1)) for _, lp in flat]).clamp(min=0.0)
        return loss, loss, met

    kernel = topk if problem.topk else full
    kernel.kind = kind
    return kernel


@torch.compiler.disable
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
    return compute(problem, _kernel(problem, kind, beta), student_logits)


def forward_kl(student_logits, teacher_logits, weights, mask=None, *, student_temperature=1.0,
               teacher_temperature=1.0, chunk_size=None, reduction="mean", vocab_size=None, tail="tail",
               metrics=True, num_items_in_batch=None, empty_mask="zero"):
    """sum_k w_k KL(p_k || q) per position (theory section 1); its minimiser is the arithmetic pool A = sum_k w_k p_k,
    and sum_k w_k KL(p_k || q) = sum_k w_k KL(p_k || A) + KL(A || q) (metric ``teacher_disagreement`` is
    the first term: the loss's floor).

    q = softmax(student_logits / student_temperature), p_k = softmax(teacher_logits_k / teacher_temperature)
    over the first ``vocab_size`` columns (default: all; teachers must then have the student's width).
    ``tail`` is the treatment of top-k teachers outside their k tokens (see :data:`TAILS` and docs/losses.md,
    "Top-k teachers").
    ``chunk_size``: positions per chunk (default about 512K logits per buffer on a CPU, 2M elsewhere); ``metrics=False`` skips
    the per-position metrics (a tenth to three tenths of the time: benchmarks/README.md).

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
    """sum_k w_k KL(q || p_k) = KL(q || l) - ln z per position (theory section 1, 2): its minimiser is the local
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
    so memory beyond the inputs and the weight's gradient does not grow with V (theory section 6 practice).

    kind: 'forward', 'reverse' or 'jsd' (with ``beta``). Gradients flow to ``hidden_states`` and to
    ``lm_head_weight`` (every reduction but 'none'). Returns (loss, metrics) as the other losses.
    """
    return _fused(hidden_states, lm_head_weight, teacher_logits, weights, mask, kind, beta, bias, student_temperature,
                  teacher_temperature, chunk_size, reduction, vocab_size, tail, metrics, num_items_in_batch, empty_mask)


@torch.compiler.disable
def _fused(hidden_states, lm_head_weight, teacher_logits, weights, mask, kind, beta, bias, student_temperature,
           teacher_temperature, chunk_size, reduction, vocab_size, tail, metrics, num_items_in_batch, empty_mask):
    if kind not in ("forward", "reverse", "jsd"):
        raise ValueError(f"kind = {kind!r} must be 'forward', 'reverse' or 'jsd'")
    check_not_meta(hidden_states=hidden_states, lm_head_weight=lm_head_weight)
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
    b = None if kind == "jsd" and beta in (0, 1) else beta
    k = "forward" if kind == "jsd" and beta == 0 else "reverse" if kind == "jsd" and beta == 1 else kind
    return compute(problem, _kernel(problem, k, b), hidden_states, lm_head_weight)


