"""Multi-teacher distillation losses for torch training loops, each paired with the target it reaches
(SPEC 1, 2, 4, 6).

Token level, from the student's logits ``(B, T, V)`` and K teachers (full logits ``(K, B, T, V)`` or a
list of K ``(B, T, V)`` tensors, or a list of K :class:`TopK`), weights ``(K,)`` or per sample ``(B, K)``
(one-hot rows route each sample to one teacher: routing and pooling are one API):

    forward_kl       sum_k w_k KL(p_k || q)                     target: the arithmetic pool A = sum_k w_k p_k
    reverse_kl       sum_k w_k KL(q || p_k) = KL(q || l) - ln z target: the local geometric pool l
    generalized_jsd  sum_k w_k JSD_beta(p_k, q)                 beta = 0: forward_kl, beta = 1: reverse_kl

Sequence level, from sampled tokens (SPEC 2 "which target a learner reaches", SPEC 4):

    rkl_policy_gradient   on-policy RKL by reward-to-go; gamma = 1 reaches G_seq (conditionals g),
                          gamma = 0 reaches l
    kl_estimator_loss     k1 / k2 / k3 of SPEC 4 on the sampled token, as a loss or as a reward
    audit_estimators      exact expected gradient of every estimator configuration, and which
                          divergence's gradient it equals

Every token-level loss returns ``(loss, metrics)``: the loss reduced over the unmasked positions
(``reduction="mean"``: their mean; ``"sum"``; ``"none"``: ``(B, T)`` with 0 at masked positions), and
per-position metrics (``(B, T)``, NaN where masked): ``teacher_disagreement`` = sum_k w_k KL(p_k || A),
``neg_log_z`` = -ln z (both zero iff the teachers agree), ``tail_mass`` ``(K, B, T)`` for top-k teachers,
and the temperatures used. Memory: positions are processed in chunks of ``chunk_size``; the gradient
with respect to the student's logits is computed chunk by chunk during the forward pass (as Liger's
fused losses do), so no ``K x B x T x V`` float32 tensor, nor the student's full log-softmax, is ever
materialised; bf16 / fp16 logits are upcast to float32 per chunk (float64 inputs stay float64).
:func:`fused_linear_loss` goes further and never materialises the student's logits at all.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["TopK", "TAILS", "forward_kl", "reverse_kl", "generalized_jsd", "fused_linear_loss",
           "rkl_policy_gradient", "kl_estimator_loss", "token_log_probs", "audit_estimators", "JSD_CONVENTIONS"]

TAILS = ("tail", "renormalize", "uniform", "truncate")
CHUNK_ELEMENTS = 1 << 23        # default chunk: about 8M logits (32 MB in float32) per (positions, V) buffer
# The beta of a generalised JSD in other libraries, against ours (0 = forward KL, 1 = reverse KL):
JSD_CONVENTIONS = {
    "this library": "beta = 0: sum_k w_k KL(p_k || q) (forward); beta = 1: reverse; "
                    "M = beta p + (1 - beta) q, JSD = beta KL(p || M) + (1 - beta) KL(q || M)",
    "TRL GKDTrainer (generalized_jsd_loss)": "the same: beta = 0 forward, beta = 1 reverse (ours = theirs)",
    "Liger LigerFusedLinearJSDLoss (chunked, M = beta q + (1 - beta) p)": "mixture weights swapped: small "
        "beta approaches reverse KL and beta near 1 forward KL; pass beta_ours = 1 - beta_liger for the same "
        "mixture (the KL weights then differ; check the installed version's formula)",
}


@dataclass(frozen=True)
class TopK:
    """A teacher given by its top-k tokens: ``ids`` (B, T, k) long and ``log_probs`` (B, T, k), log-probs
    normalised over the full vocabulary (so the tail mass outside the top k is 1 - sum exp(log_probs))."""
    ids: torch.Tensor
    log_probs: torch.Tensor


# ------------------------------------------------------------------------------------------------
# validation (SPEC 7: ValueError before any work, naming the argument, the axis and the first position)
# ------------------------------------------------------------------------------------------------
def _first_bad(bad):
    """The first True index of a boolean tensor, as a tuple."""
    return tuple(int(i) for i in torch.nonzero(bad)[0])


def _check_finite(x, name, chunk):
    """NaN / inf in a (..., V) tensor: ValueError naming the first position, scanned in chunks."""
    flat = x.reshape(-1, x.shape[-1])
    for lo in range(0, flat.shape[0], chunk):
        bad = ~torch.isfinite(flat[lo:lo + chunk])
        if bool(bad.any()):
            row, col = _first_bad(bad)
            pos = np.unravel_index(lo + row, x.shape[:-1])
            raise ValueError(f"{name}{list(int(p) for p in pos)} has a non-finite logit "
                             f"({float(flat[lo + row, col])}) at vocabulary index {col}")


def _check_weights(weights, K, B):
    w = torch.as_tensor(weights, dtype=torch.float64)
    if w.ndim == 1:
        if w.shape[0] != K:
            raise ValueError(f"weights has {w.shape[0]} entries but there are K = {K} teachers")
        w = w.expand(B, K)
    elif w.ndim == 2:
        if w.shape != (B, K):
            raise ValueError(f"weights must have shape (K,) = ({K},) or (B, K) = ({B}, {K}), got {tuple(w.shape)}")
    else:
        raise ValueError(f"weights must have shape (K,) or (B, K), got {tuple(w.shape)}")
    bad = ~torch.isfinite(w) | (w < 0)
    if bool(bad.any()):
        i = _first_bad(bad)
        raise ValueError(f"weights{list(i)} = {float(w[i])} must be finite and >= 0")
    sums = w.sum(dim=1)
    off = (sums - 1).abs() > 1e-6
    if bool(off.any()):
        b = int(torch.nonzero(off)[0])
        raise ValueError(f"weights of sample {b} sum to {float(sums[b])!r}, not 1 (weights lie on the simplex)")
    return w


def _check_mask(mask, B, T, device):
    if mask is None:
        return torch.ones(B, T, dtype=torch.bool, device=device)
    m = torch.as_tensor(mask, device=device)
    if m.shape != (B, T):
        raise ValueError(f"mask must have shape (B, T) = ({B}, {T}), got {tuple(m.shape)}")
    m = m.bool()
    if not bool(m.any()):
        raise ValueError("mask is all zero: no position to compute a loss on")
    return m


def _vocab(student_V, teacher_Vs, vocab_size):
    """The number of vocabulary columns that count (padded logit rows past it are dropped)."""
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size = {vocab_size!r} must be a positive integer")
        short = [(f"teacher {k}", v) for k, v in enumerate(teacher_Vs) if v is not None and v < vocab_size]
        if student_V < vocab_size:
            short.insert(0, ("the student", student_V))
        if short:
            who, v = short[0]
            raise ValueError(f"{who} has {v} logit columns, fewer than vocab_size = {vocab_size}")
        return vocab_size
    for k, v in enumerate(teacher_Vs):
        if v is not None and v != student_V:
            raise ValueError(f"the student has {student_V} logit columns and teacher {k} has {v} "
                             f"({student_V - v:+d}): pass vocab_size = len(tokenizer) to drop the padded rows "
                             f"(Qwen pads past the tokenizer), or align the vocabularies")
    return student_V


def _prepare(student, student_V, teachers, weights, mask, student_temperature, teacher_temperature, chunk_size,
             reduction, vocab_size, tail, kind, hidden=False, metrics=True):
    """Validate everything before any work; returns a dict describing the problem. ``student`` is the
    student's (B, T, V) logits, or its (B, T, H) hidden states with ``student_V`` the lm_head's rows."""
    s = student
    B, T = s.shape[:2]
    V_s = student_V
    if torch.is_tensor(teachers):
        if teachers.ndim != 4:
            raise ValueError(f"teacher_logits must have shape (K, B, T, V), got {tuple(teachers.shape)}")
        teachers = list(teachers.unbind(0))
    teachers = list(teachers)
    if not teachers:
        raise ValueError("teacher_logits is empty: give at least one teacher")
    topk = [isinstance(t, TopK) for t in teachers]
    if any(topk) and not all(topk):
        raise ValueError("teachers must be all full logits or all TopK, not a mix")
    K = len(teachers)
    for name, tau in (("student_temperature", student_temperature), ("teacher_temperature", teacher_temperature)):
        if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
            raise ValueError(f"{name} = {tau!r} must be a positive number")
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // max(int(student_V), 1))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size = {chunk_size!r} must be a positive integer (positions per chunk)")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction = {reduction!r} must be 'mean', 'sum' or 'none'")
    if all(topk):
        if tail not in TAILS:
            raise ValueError(f"tail = {tail!r} must be one of {TAILS}")
        if tail == "truncate" and kind == "jsd":
            raise ValueError("tail = 'truncate' has no generalised-JSD form: use 'tail', 'renormalize' or 'uniform'")
        if teacher_temperature != 1.0:
            raise ValueError("top-k teachers arrive as log-probs: apply teacher_temperature when computing them "
                             "(teacher_temperature must be 1 here, not silently ignored)")
        for k, t in enumerate(teachers):
            if t.ids.shape != t.log_probs.shape or t.ids.shape[:2] != (B, T) or t.ids.ndim != 3:
                raise ValueError(f"teacher {k}: TopK ids and log_probs must both have shape (B, T, k) = "
                                 f"({B}, {T}, k), got {tuple(t.ids.shape)} and {tuple(t.log_probs.shape)}")
        V = _vocab(V_s, [None] * K, vocab_size)
        for k, t in enumerate(teachers):
            ids = t.ids
            bad = (ids < 0) | (ids >= V)
            if bool(bad.any()):
                i = _first_bad(bad)
                raise ValueError(f"teacher {k}: TopK ids{list(i)} = {int(ids[i])} is outside the vocabulary [0, {V})")
            srt = ids.sort(dim=-1).values
            dup = srt[..., 1:] == srt[..., :-1]
            if bool(dup.any()):
                i = _first_bad(dup)
                raise ValueError(f"teacher {k}: TopK ids at position {list(i[:2])} repeat token {int(srt[i])}")
            lp = t.log_probs
            bad = torch.isnan(lp) | (lp > 1e-6)
            if bool(bad.any()):
                i = _first_bad(bad)
                raise ValueError(f"teacher {k}: TopK log_probs{list(i)} = {float(lp[i])} is not a log-probability")
            over = torch.logsumexp(lp.double(), dim=-1) > 1e-6
            if bool(over.any()):
                i = _first_bad(over)
                raise ValueError(f"teacher {k}: TopK log_probs at position {list(i)} sum to more than 1")
    else:
        for k, t in enumerate(teachers):
            if not torch.is_tensor(t) or t.ndim != 3 or not t.is_floating_point():
                raise ValueError(f"teacher {k} must be a floating (B, T, V) tensor or a TopK")
            if t.shape[:2] != (B, T):
                axis = 0 if t.shape[0] != B else 1
                raise ValueError(f"teacher {k} has {t.shape[axis]} entries on axis {axis} "
                                 f"({'batch' if axis == 0 else 'positions'}), the student {(B, T)[axis]}")
        V = _vocab(V_s, [t.shape[-1] for t in teachers], vocab_size)
    w = _check_weights(weights, K, B)
    m = _check_mask(mask, B, T, s.device)
    if hidden:
        _check_finite(s, "hidden_states", chunk_size)
    else:
        _check_finite(s[..., :V], "student_logits", chunk_size)
    if not all(topk):
        for k, t in enumerate(teachers):
            _check_finite(t[..., :V], f"teacher {k} logits", chunk_size)
    compute = torch.float64 if s.dtype == torch.float64 else torch.float32
    return dict(student=s, teachers=teachers, topk=all(topk), K=K, B=B, T=T, V=V, weights=w, mask=m,
                tau_s=float(student_temperature), tau_t=float(teacher_temperature), chunk=chunk_size,
                reduction=reduction, tail=tail, compute=compute, metrics=bool(metrics))


# ------------------------------------------------------------------------------------------------
# per-position divergences (rows are positions; every input is a log-probability row)
# ------------------------------------------------------------------------------------------------
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


def _rows(x, idx):
    """Rows ``idx`` (a slice or an index tensor) of a (..., V) tensor flattened to (N, V)."""
    return x.reshape(-1, x.shape[-1])[idx]


def _terms(P, kind, beta):
    """terms(idx, s_logp) -> (loss (n,), metrics {name: (n,) or (K, n)}) for the positions idx.

    Full teachers, one pass each (log-softmax in the compute dtype): A = sum_k w_k p_k, the pooled
    r = sum_k w_k ln p_k and sum_k w_k sum_a p_k ln p_k accumulate, so that
    forward = sum_k w_k sum p_k ln p_k - sum_a A ln q, reverse = sum_a q (ln q - r),
    disagreement = sum_k w_k sum p_k ln p_k - sum_a A ln A (= H(A) - sum_k w_k H(p_k)), ln z = lse(r).
    Logits are finite (checked), so every ln p_k is finite and weight-0 teachers add exact zeros.
    """
    teachers, K, V, compute, tau_t = P["teachers"], P["K"], P["V"], P["compute"], P["tau_t"]
    w_pos = P["weights"].to(compute).to(P["student"].device)
    metrics = P["metrics"]

    def weights_at(idx):
        b = (torch.arange(P["B"] * P["T"], device=w_pos.device)[idx] if isinstance(idx, slice) else idx) // P["T"]
        return w_pos[b]                                          # (n, K)

    def terms(idx, s_logp):
        w = weights_at(idx)
        if P["topk"]:
            flat = [(_rows(t.ids, idx), _rows(t.log_probs, idx).to(compute)) for t in teachers]
            per = torch.stack([_topk_rows(kind, s_logp, ids, lp, P["tail"], V, beta) for ids, lp in flat], dim=1)
            tail = torch.stack([-torch.expm1(torch.logsumexp(lp, -1)) for _, lp in flat]).clamp(min=0.0)
            return (w * per).sum(-1), ({"tail_mass": tail} if metrics else {})
        A = pooled = None
        neg_entropy = 0.0
        jsd = 0.0
        for k, t in enumerate(teachers):
            logits = _rows(t, idx)[:, :V].to(compute)
            lp = torch.log_softmax(logits if tau_t == 1.0 else logits / tau_t, -1)
            wk = w[:, k:k + 1]
            if kind == "reverse":
                pooled = wk * lp if pooled is None else pooled.add_(wk * lp)
                if not metrics:
                    continue
            p = lp.exp()
            neg_entropy = neg_entropy + wk[:, 0] * (p * lp).sum(-1)
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
        return loss, {"teacher_disagreement": neg_entropy - (A * torch.log(A)).sum(-1),
                      "neg_log_z": -torch.logsumexp(pooled, -1)}
    return terms


# ------------------------------------------------------------------------------------------------
# the chunked engine: loss per position, gradient computed chunk by chunk during the forward pass
# ------------------------------------------------------------------------------------------------
class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, weight, P, terms, out_metrics):
        """student: (B, T, V_s) logits, or hidden states (B, T, H) when ``weight`` (V_s, H) is given."""
        N = P["B"] * P["T"]
        flat = student.reshape(N, student.shape[-1])
        dense = bool(P["mask"].all())                    # every position: contiguous slices, no gathers
        positions = torch.nonzero(P["mask"].reshape(-1)).squeeze(1)
        need = bool(ctx.needs_input_grad[0] or (weight is not None and ctx.needs_input_grad[1]))
        losses = torch.zeros(N, dtype=P["compute"], device=student.device)
        grad_in = torch.zeros_like(student).reshape(N, student.shape[-1]) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=P["compute"], device=weight.device) \
            if weight is not None and ctx.needs_input_grad[1] else None
        V = P["V"]
        for lo in range(0, positions.numel(), P["chunk"]):
            idx = slice(lo, lo + P["chunk"]) if dense else positions[lo:lo + P["chunk"]]
            with torch.enable_grad():
                x = flat[idx].detach().to(P["compute"]).requires_grad_(need)
                if weight is None:
                    z = x[:, :V]
                else:
                    w_c = weight.detach().to(P["compute"]).requires_grad_(grad_w is not None)
                    z = (x @ w_c.T)[:, :V]
                    if P.get("bias") is not None:
                        z = z + P["bias"][:V].to(P["compute"])
                s_logp = torch.log_softmax(z if P["tau_s"] == 1.0 else z / P["tau_s"], dim=-1)
                loss, met = terms(idx, s_logp)
                if need:
                    wrt = [x] + ([w_c] if grad_w is not None else [])
                    grads = torch.autograd.grad(loss.sum(), wrt)
                    if grad_in is not None:
                        grad_in[idx] = grads[0].to(grad_in.dtype)
                    if grad_w is not None:
                        grad_w += grads[1]
            losses[idx] = loss.detach()
            for name, value in met.items():
                if name not in out_metrics:
                    shape = (value.shape[0], N) if value.ndim == 2 else (N,)
                    out_metrics[name] = torch.full(shape, math.nan, dtype=P["compute"], device=student.device)
                out_metrics[name][..., idx] = value.detach()
        ctx.save_for_backward(grad_in if grad_in is not None else torch.empty(0),
                              grad_w if grad_w is not None else torch.empty(0))
        ctx.has = (grad_in is not None, grad_w is not None)
        ctx.in_shape = student.shape
        ctx.w_dtype = weight.dtype if weight is not None else None
        return losses.reshape(P["B"], P["T"])

    @staticmethod
    def backward(ctx, grad_out):
        grad_in, grad_w = ctx.saved_tensors
        g = grad_out.reshape(-1)
        out_in = out_w = None
        if ctx.has[0]:
            out_in = grad_in.mul_(g[:, None].to(grad_in.dtype)).reshape(ctx.in_shape)
        if ctx.has[1]:
            if not bool((g == g[0]).all()):
                raise RuntimeError("fused_linear_loss supports reduction 'mean' or 'sum' for the lm_head weight")
            out_w = (grad_w * g[0]).to(ctx.w_dtype)
        return out_in, out_w, None, None, None


def _reduce(per_position, P, metrics):
    mask = P["mask"]
    n = int(mask.sum())
    metrics.update(n_positions=n, student_temperature=P["tau_s"], teacher_temperature=P["tau_t"],
                   loss_per_position=torch.where(mask, per_position.detach(), torch.full_like(per_position, math.nan)))
    for name in list(metrics):
        v = metrics[name]
        if torch.is_tensor(v) and v.shape[-1] == P["B"] * P["T"]:
            metrics[name] = v.reshape(v.shape[:-1] + (P["B"], P["T"]))
    if P["reduction"] == "none":
        return per_position
    total = per_position.sum()
    return total / n if P["reduction"] == "mean" else total


def _token_loss(kind, student_logits, teacher_logits, weights, mask, student_temperature, teacher_temperature,
                chunk_size, reduction, vocab_size, tail, metrics, beta=None):
    s = student_logits
    if not torch.is_tensor(s) or s.ndim != 3 or not s.is_floating_point():
        raise ValueError(f"student_logits must be a floating (B, T, V) tensor, got "
                         f"{tuple(s.shape) if torch.is_tensor(s) else type(s).__name__}")
    P = _prepare(s, s.shape[-1], teacher_logits, weights, mask, student_temperature, teacher_temperature,
                 chunk_size, reduction, vocab_size, tail, kind, metrics=metrics)
    out = {}
    per_position = _ChunkedLoss.apply(student_logits, None, P, _terms(P, kind, beta), out)
    return _reduce(per_position, P, out), out


def forward_kl(student_logits, teacher_logits, weights, mask=None, *, student_temperature=1.0,
               teacher_temperature=1.0, chunk_size=None, reduction="mean", vocab_size=None, tail="tail",
               metrics=True):
    """sum_k w_k KL(p_k || q) per position (SPEC 1); its minimiser is the arithmetic pool A = sum_k w_k p_k,
    and sum_k w_k KL(p_k || q) = sum_k w_k KL(p_k || A) + KL(A || q) (metric ``teacher_disagreement`` is
    the first term: the loss's floor).

    q = softmax(student_logits / student_temperature), p_k = softmax(teacher_logits_k / teacher_temperature)
    over the first ``vocab_size`` columns (default: all; teachers must then have the student's width).
    ``tail`` is the treatment of top-k teachers outside their k tokens (see :data:`TAILS` and the README).
    ``chunk_size``: positions per chunk (default about 8M logits per buffer); ``metrics=False`` skips
    the per-position metrics (about a fifth of the time). Returns (loss, metrics); the loss is the mean
    over unmasked positions for ``reduction="mean"``.
    """
    return _token_loss("forward", student_logits, teacher_logits, weights, mask, student_temperature,
                       teacher_temperature, chunk_size, reduction, vocab_size, tail, metrics)


def reverse_kl(student_logits, teacher_logits, weights, mask=None, *, student_temperature=1.0,
               teacher_temperature=1.0, chunk_size=None, reduction="mean", vocab_size=None, tail="tail",
               metrics=True):
    """sum_k w_k KL(q || p_k) = KL(q || l) - ln z per position (SPEC 1, 2): its minimiser is the local
    geometric pool l ∝ prod_k p_k^{w_k}, with minimum -ln z (metric ``neg_log_z``). Per position this is
    the per-token RKL; summed over a sequence it reaches l, not the sequence-level G_seq (for that, see
    :func:`rkl_policy_gradient` with gamma = 1). Same arguments and returns as :func:`forward_kl`."""
    return _token_loss("reverse", student_logits, teacher_logits, weights, mask, student_temperature,
                       teacher_temperature, chunk_size, reduction, vocab_size, tail, metrics)


def generalized_jsd(student_logits, teacher_logits, weights, mask=None, *, beta=0.5, student_temperature=1.0,
                    teacher_temperature=1.0, chunk_size=None, reduction="mean", vocab_size=None,
                    tail="tail", metrics=True):
    """sum_k w_k JSD_beta(p_k, q), JSD_beta = beta KL(p || M) + (1 - beta) KL(q || M), M = beta p + (1 - beta) q.

    beta = 0 is exactly :func:`forward_kl` and beta = 1 exactly :func:`reverse_kl` (TRL's convention;
    :data:`JSD_CONVENTIONS` translates Liger's). Near the endpoints the scale shrinks: JSD_beta ≈ beta
    KL(p || q) as beta -> 0 and ≈ (1 - beta) KL(q || p) as beta -> 1, so the loss is continuous inside
    (0, 1) but jumps at the endpoints, where the plain KL is used; rescale the learning rate accordingly.
    """
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise ValueError(f"beta = {beta!r} must lie in [0, 1]")
    kind = "forward" if beta == 0 else "reverse" if beta == 1 else "jsd"
    return _token_loss(kind, student_logits, teacher_logits, weights, mask, student_temperature,
                       teacher_temperature, chunk_size, reduction, vocab_size, tail, metrics, beta=float(beta))


def fused_linear_loss(hidden_states, lm_head_weight, teacher_logits, weights, mask=None, *, kind="forward",
                      beta=0.5, bias=None, student_temperature=1.0, teacher_temperature=1.0,
                      chunk_size=None, reduction="mean", vocab_size=None, tail="tail", metrics=True):
    """The same losses from the student's final hidden states ``(B, T, H)`` and its ``lm_head`` weight
    ``(V, H)`` (and optional bias): the student's logits are formed chunk by chunk and never held whole,
    so memory beyond the inputs and the weight's gradient does not grow with V (SPEC 6 practice).

    kind: 'forward', 'reverse' or 'jsd' (with ``beta``). Gradients flow to ``hidden_states`` and to
    ``lm_head_weight`` (reductions 'mean' and 'sum'). Returns (loss, metrics) as the other losses.
    """
    if kind not in ("forward", "reverse", "jsd"):
        raise ValueError(f"kind = {kind!r} must be 'forward', 'reverse' or 'jsd'")
    if not torch.is_tensor(hidden_states) or hidden_states.ndim != 3:
        raise ValueError("hidden_states must be a (B, T, H) tensor")
    if not torch.is_tensor(lm_head_weight) or lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden_states.shape[2]:
        raise ValueError(f"lm_head_weight must have shape (V, H) with H = {hidden_states.shape[2]}, got "
                         f"{tuple(lm_head_weight.shape) if torch.is_tensor(lm_head_weight) else lm_head_weight}")
    if reduction == "none":
        raise ValueError("fused_linear_loss supports reduction 'mean' or 'sum'")
    P = _prepare(hidden_states, lm_head_weight.shape[0], teacher_logits, weights, mask, student_temperature,
                 teacher_temperature, chunk_size, reduction, vocab_size, tail, kind, hidden=True, metrics=metrics)
    P["bias"] = bias
    out = {}
    b = None if kind == "jsd" and beta in (0, 1) else beta
    k = "forward" if kind == "jsd" and beta == 0 else "reverse" if kind == "jsd" and beta == 1 else kind
    per_position = _ChunkedLoss.apply(hidden_states, lm_head_weight, P, _terms(P, k, b), out)
    return _reduce(per_position, P, out), out


# ------------------------------------------------------------------------------------------------
# sequence level: sampled tokens
# ------------------------------------------------------------------------------------------------
def token_log_probs(logits, tokens, temperature=1.0, vocab_size=None):
    """ln softmax(logits / temperature)[tokens] over the first ``vocab_size`` columns: logits (..., B, T, V),
    tokens (B, T) long; returns (..., B, T) in float32 (float64 for float64 logits), differentiable."""
    if not torch.is_tensor(tokens) or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError("tokens must be an integer (B, T) tensor")
    V = logits.shape[-1] if vocab_size is None else vocab_size
    if tokens.shape != logits.shape[-3:-1]:
        raise ValueError(f"tokens must have shape (B, T) = {tuple(logits.shape[-3:-1])}, got {tuple(tokens.shape)}")
    bad = (tokens < 0) | (tokens >= V)
    if bool(bad.any()):
        i = _first_bad(bad)
        raise ValueError(f"tokens{list(i)} = {int(tokens[i])} is outside the vocabulary [0, {V})")
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits[..., :V].to(compute) / temperature
    idx = tokens.expand(logits.shape[:-1]).unsqueeze(-1)
    return z.gather(-1, idx).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _sampled(student_logits, tokens, teacher_log_probs, weights, mask, importance_weights, student_temperature,
             vocab_size):
    """Validated (ln q(y) (B, T) with grad, ln p_k(y) (K, B, T), weights (B, K), mask, IS weights)."""
    if not torch.is_tensor(student_logits) or student_logits.ndim != 3:
        raise ValueError("student_logits must be a (B, T, V) tensor")
    B, T, _ = student_logits.shape
    lq = token_log_probs(student_logits, tokens, student_temperature, vocab_size)
    lp = torch.as_tensor(teacher_log_probs)
    if lp.ndim != 3 or lp.shape[1:] != (B, T):
        raise ValueError(f"teacher_log_probs must have shape (K, B, T) = (K, {B}, {T}): each teacher's "
                         f"log-prob of the sampled tokens (token_log_probs(teacher_logits, tokens)), got {tuple(lp.shape)}")
    bad = torch.isnan(lp) | (lp > 1e-6)
    if bool(bad.any()):
        i = _first_bad(bad)
        raise ValueError(f"teacher_log_probs{list(i)} = {float(lp[i])} is not a log-probability")
    w = _check_weights(weights, lp.shape[0], B).to(lq.dtype).to(lq.device)
    m = _check_mask(mask, B, T, lq.device)
    if importance_weights is None:
        rho = torch.ones(B, T, dtype=lq.dtype, device=lq.device)
    else:
        rho = torch.as_tensor(importance_weights, dtype=lq.dtype, device=lq.device)
        if rho.shape != (B, T) or bool((~torch.isfinite(rho) | (rho < 0)).any()):
            raise ValueError(f"importance_weights must be finite, >= 0 and of shape (B, T) = ({B}, {T})")
    return lq, lp.to(lq.dtype).to(lq.device), w, m, rho.detach()


def _reduce_tokens(per_token, m, reduction):
    per_token = torch.where(m, per_token, torch.zeros_like(per_token))
    if reduction == "none":
        return per_token
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction = {reduction!r} must be 'mean', 'sum' or 'none'")
    return per_token.sum() / (m.sum() if reduction == "mean" else 1)


def rkl_policy_gradient(student_logits, tokens, teacher_log_probs, weights, mask=None, *, gamma=1.0,
                        baseline="leave-one-out", groups=None, importance_weights=None, teacher_logits=None,
                        student_temperature=1.0, teacher_temperature=1.0, vocab_size=None, reduction="mean",
                        chunk_size=None):
    """On-policy reverse-KL policy gradient from sampled tokens (SPEC 2 "which target", SPEC 3).

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
    student samples).
    """
    if not (isinstance(gamma, (int, float)) and 0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma = {gamma!r} must lie in [0, 1]")
    if baseline not in ("leave-one-out", None):
        raise ValueError(f"baseline = {baseline!r} must be 'leave-one-out' or None")
    lq, lp, w, m, rho = _sampled(student_logits, tokens, teacher_log_probs, weights, mask, importance_weights,
                                 student_temperature, vocab_size)
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
    return _reduce_tokens(per_token, m, reduction), metrics


ESTIMATORS = {"k1": (lambda r: -r, lambda r: -torch.ones_like(r)),
              "k2": (lambda r: 0.5 * r * r, lambda r: r),
              "k3": (lambda r: torch.expm1(r) - r, lambda r: torch.expm1(r))}


def kl_estimator_loss(student_logits, tokens, teacher_log_probs, weights, mask=None, *, estimator="k3",
                      mode="loss", pool="before", importance_weights=None, student_temperature=1.0,
                      vocab_size=None, reduction="mean"):
    """A sampled-token KL estimator of SPEC 4, as practitioners use it (x = the sampled token):
    r = ln p(x) - ln q(x); k1 = -r, k2 = r^2 / 2, k3 = (e^r - 1) - r.

    mode 'loss': rho k(r) differentiated through ln q (x fixed): on student samples k1 has zero expected
    gradient, k2 gives the RKL gradient, k3 the FKL gradient (SPEC 4). mode 'reward': the detached value
    as a cost in a policy gradient, rho sg(k(r)) ln q(x): k1 then gives the RKL gradient.
    pool 'before': one estimator on the pooled log-ratio sum_k w_k ln p_k(x) - ln q(x) (k3 then reaches
    l); 'after': sum_k w_k k(r_k), one estimator per teacher (k3 then reaches the arithmetic pool A).
    One-hot rows of ``weights`` (B, K) route each sample to one teacher. ``audit_estimators`` gives the
    exact expected gradient of every configuration. Returns (loss, metrics).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator = {estimator!r} must be one of {sorted(ESTIMATORS)}")
    if mode not in ("loss", "reward"):
        raise ValueError(f"mode = {mode!r} must be 'loss' or 'reward'")
    if pool not in ("before", "after"):
        raise ValueError(f"pool = {pool!r} must be 'before' or 'after'")
    lq, lp, w, m, rho = _sampled(student_logits, tokens, teacher_log_probs, weights, mask, importance_weights,
                                 student_temperature, vocab_size)
    value_of = ESTIMATORS[estimator][0]
    if pool == "before":
        value = value_of((w.T[:, :, None] * lp).sum(0) - lq)
    else:
        value = (w.T[:, :, None] * value_of(lp - lq[None])).sum(0)
    per_token = rho * (value if mode == "loss" else value.detach() * lq)
    metrics = {"estimate": float((value.detach() * m).sum() / m.sum()), "estimator": estimator, "mode": mode,
               "pool": pool}
    return _reduce_tokens(per_token, m, reduction), metrics


# ------------------------------------------------------------------------------------------------
# the estimator audit: exact expected gradients, no sampling
# ------------------------------------------------------------------------------------------------
def audit_estimators(student_logits, teacher_logits, weights, *, student_temperature=1.0,
                     teacher_temperature=1.0, tolerance=1e-6):
    """Exact expected gradient, with respect to the student's logits, of every sampled-token estimator
    configuration, and which divergence's gradient it equals (SPEC 4).

    student_logits (..., V) and teacher_logits (K, ..., V) at some positions; weights (K,). For a
    sample x from s with weight c(x) and per-sample loss L(x), E_s[grad L] = sum_x s(x) phi(x) (e_x - q)
    / tau_s, with phi = -c k'(r) for an estimator used as a loss and phi = c k(r) as a reward. The
    configurations: estimator k1 / k2 / k3 x mode loss / reward x samples from the student, from the
    teachers, from the teachers with importance weights q / s x teachers: 'one' (teacher 0 alone),
    'pooled' (one estimator on sum_k w_k ln p_k - ln q; teacher samples from the mixture A), 'per-teacher'
    (sum_k w_k k(r_k); samples from A), 'routed' (k ~ w per sample, teacher k's estimator and samples).

    Returns a pandas DataFrame, one row per configuration: the relative error of the expected gradient
    against each reference gradient (FKL to A: q - A; RKL to l: grad sum_k w_k KL(q || p_k); FKL to l:
    q - l; minus FKL to A; zero: |g| / |q - A|) and ``equals``: the reference within ``tolerance`` (for
    'one', A = l = p_0), or the best direction with its scale ('FKL to l x 0.83'), or 'none'.
    """
    import pandas as pd
    s = torch.as_tensor(student_logits, dtype=torch.float64)
    t = torch.as_tensor(teacher_logits, dtype=torch.float64)
    if t.ndim != s.ndim + 1 or t.shape[1:] != s.shape:
        raise ValueError(f"teacher_logits must have shape (K,) + {tuple(s.shape)}, got {tuple(t.shape)}")
    K, V = t.shape[0], s.shape[-1]
    w = _check_weights(weights, K, 1)[0]
    lq = torch.log_softmax(s.reshape(-1, V) / student_temperature, -1)
    lp = torch.log_softmax(t.reshape(K, -1, V) / teacher_temperature, -1)
    q = lq.exp()
    tau = student_temperature

    def expected(sample_lp, phi):
        """E_{x ~ s}[phi(x) (e_x - q)] / tau, s = exp(sample_lp) (n, V), phi (n, V)."""
        sp = sample_lp.exp() * phi
        return (sp - q * sp.sum(-1, keepdim=True)) / tau

    def rkl_grad(r):
        d = lq - r
        return q * (d - (q * d).sum(-1, keepdim=True)) / tau

    rows = []
    for teachers in ("one", "pooled", "per-teacher", "routed"):
        if teachers == "one":
            wk, lp_k = torch.ones(1, dtype=torch.float64), lp[:1]
        else:
            wk, lp_k = w, lp
        keep = wk > 0
        r_pool = (wk[keep][:, None, None] * lp_k[keep]).sum(0)
        log_a = torch.logsumexp(torch.log(wk[keep])[:, None, None] + lp_k[keep], 0)
        log_l = r_pool - torch.logsumexp(r_pool, -1, keepdim=True)
        refs = {"FKL to A": (q - log_a.exp()) / tau, "RKL to l": rkl_grad(r_pool), "FKL to l": (q - log_l.exp()) / tau}
        refs["minus FKL to A"] = -refs["FKL to A"]
        for est, (k_val, k_der) in ESTIMATORS.items():
            for mode in ("loss", "reward"):
                for samples in ("student", "teacher", "teacher + IS"):
                    def phi_for(r, sample_lp):
                        c = torch.ones_like(r) if samples != "teacher + IS" else (lq - sample_lp).exp()
                        return -c * k_der(r) if mode == "loss" else c * k_val(r)
                    if teachers in ("one", "pooled"):
                        sample_lp = lq if samples == "student" else log_a
                        g = expected(sample_lp, phi_for(r_pool - lq, sample_lp))
                    elif teachers == "per-teacher":
                        sample_lp = lq if samples == "student" else log_a
                        if mode == "loss":
                            phi = sum(wk[k] * phi_for(lp_k[k] - lq, sample_lp) for k in range(len(wk)) if wk[k] > 0)
                        else:
                            c = torch.ones_like(lq) if samples != "teacher + IS" else (lq - sample_lp).exp()
                            phi = c * sum(wk[k] * k_val(lp_k[k] - lq) for k in range(len(wk)) if wk[k] > 0)
                        g = expected(sample_lp, phi)
                    else:                                             # routed: k ~ w, then teacher k alone
                        g = sum(wk[k] * expected(lq if samples == "student" else lp_k[k],
                                                 phi_for(lp_k[k] - lq, lq if samples == "student" else lp_k[k]))
                                for k in range(len(wk)) if wk[k] > 0)
                    scale = refs["FKL to A"].norm()
                    errs = {name: float((g - ref).norm() / ref.norm().clamp(min=1e-300)) for name, ref in refs.items()}
                    errs["zero"] = float(g.norm() / scale.clamp(min=1e-300))
                    equals = next((name for name, e in errs.items() if e < tolerance), None)
                    if equals is None:                  # the same direction, scaled per position?
                        for name, ref in refs.items():
                            c = (g * ref).sum(-1, keepdim=True) / (ref * ref).sum(-1, keepdim=True).clamp(min=1e-300)
                            if bool((c > 0).all()) and float((g - c * ref).norm() / g.norm().clamp(min=1e-300)) < tolerance:
                                equals = f"{name} x {float(c.min()):.2g}..{float(c.max()):.2g}"
                                break
                        equals = equals or "none"
                    rows.append(dict(estimator=est, mode=mode, samples=samples, teachers=teachers, equals=equals,
                                     **{f"err {name}": e for name, e in errs.items()}))
    return pd.DataFrame(rows)
