"""Validation (SPEC 7) and the chunked engine behind the token-level losses: a validated problem
(:class:`Problem`), then the loss per position with the student's gradient computed chunk by chunk
during the forward pass (:class:`ChunkedLoss`), then the reduction."""

import math
from dataclasses import dataclass

import numpy as np
import torch

TAILS = ("tail", "renormalize", "uniform", "truncate")
CHUNK_ELEMENTS = 1 << 23        # default chunk: about 8M logits (32 MB in float32) per (positions, V) buffer


@dataclass(frozen=True)
class TopK:
    """A teacher given by its top-k tokens: ``ids`` (B, T, k) long and ``log_probs`` (B, T, k), log-probs
    normalised over the full vocabulary (so the tail mass outside the top k is 1 - sum exp(log_probs))."""
    ids: torch.Tensor
    log_probs: torch.Tensor


# ------------------------------------------------------------------------------------------------
# validation (SPEC 7: ValueError before any work, naming the argument, the axis and the first position)
# ------------------------------------------------------------------------------------------------
def first_bad(bad):
    """The first True index of a boolean tensor, as a tuple."""
    return tuple(int(i) for i in torch.nonzero(bad)[0])


def _check_finite(x, name, chunk):
    """NaN / inf in a (..., V) tensor: ValueError naming the first position, scanned in chunks."""
    flat = x.reshape(-1, x.shape[-1])
    for lo in range(0, flat.shape[0], chunk):
        bad = ~torch.isfinite(flat[lo:lo + chunk])
        if bool(bad.any()):
            row, col = first_bad(bad)
            pos = np.unravel_index(lo + row, x.shape[:-1])
            raise ValueError(f"{name}{list(int(p) for p in pos)} has a non-finite logit "
                             f"({float(flat[lo + row, col])}) at vocabulary index {col}")


class TeacherRows:
    """Rows (positions) of a (B, T, V) teacher, read chunk by chunk without copying the teacher whole: a
    flat view when its layout allows one (contiguous, or a view of the teacher axis of a larger tensor),
    else the chunk's rows gathered by (sample, position) (a permuted view: only the chunk is copied)."""

    def __init__(self, teacher):
        teacher = teacher.detach()                   # a constant: no gradient flows to the teachers
        self.B, self.T = teacher.shape[:2]
        try:
            self.flat, self.tensor = teacher.view(-1, teacher.shape[-1]), None
        except RuntimeError:
            self.flat, self.tensor = None, teacher

    def __call__(self, idx):
        """Rows ``idx`` (a slice or an index tensor of flat positions b T + t) as an (n, V) tensor."""
        if self.flat is not None:
            return self.flat[idx]
        if isinstance(idx, slice):
            idx = torch.arange(self.B * self.T, device=self.tensor.device)[idx]
        return self.tensor[idx // self.T, idx % self.T]


def _check_teacher(rows, k, live_samples, V, kind, chunk):
    """A full teacher's logits, scanned in chunks. On samples where its weight is > 0: NaN / +inf, a row
    of -inf only, or (reverse KL) any -inf, is a ValueError naming the first position; -inf elsewhere
    is a valid log-prob (vocabulary masks, top-p filtering: p = 0, 0 log 0 = 0). On samples where its
    weight is 0 anything goes. Returns (neg_inf: -inf on a live sample, sanitize: non-finite on a dead
    one), so that the exact path is taken only for the teachers that need it."""
    neg_inf = sanitize = False
    N = rows.B * rows.T
    for lo in range(0, N, chunk):
        x = rows(slice(lo, lo + chunk))[:, :V]
        finite = torch.isfinite(x)
        if bool(finite.all()):
            continue
        live = live_samples[torch.arange(lo, lo + x.shape[0], device=live_samples.device) // rows.T][:, None]
        minus_inf = torch.isneginf(x)
        checks = ((~finite & ~minus_inf & live, "has a non-finite logit ({value}) at vocabulary index {col}"),
                  ((minus_inf.all(-1, keepdim=True) & live).expand_as(x), "is -inf at every vocabulary index"))
        if kind == "reverse":
            checks += ((minus_inf & live, "is -inf at vocabulary index {col} with weight > 0: the reverse KL is "
                                          "infinite there (the student gives every token mass); use forward_kl "
                                          "or generalized_jsd with 0 < beta < 1, or weight 0 on that sample"),)
        for bad, message in checks:
            if bool(bad.any()):
                row, col = first_bad(bad)
                pos = [(lo + row) // rows.T, (lo + row) % rows.T]
                raise ValueError(f"teacher {k} logits{pos} " + message.format(value=float(x[row, col]), col=col))
        neg_inf = neg_inf or bool((minus_inf & live).any())
        sanitize = sanitize or bool((~finite & ~live).any())
    return neg_inf, sanitize


def check_weights(weights, K, B):
    w = torch.as_tensor(weights, dtype=torch.float64).detach()      # a constant, as the teachers
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
        i = first_bad(bad)
        raise ValueError(f"weights{list(i)} = {float(w[i])} must be finite and >= 0")
    sums = w.sum(dim=1)
    off = (sums - 1).abs() > 1e-6
    if bool(off.any()):
        b = int(torch.nonzero(off)[0])
        raise ValueError(f"weights of sample {b} sum to {float(sums[b])!r}, not 1 (weights lie on the simplex)")
    return w


REDUCTIONS = ("mean", "sum", "batchmean", "none")
EMPTY_MASK = ("zero", "raise")


def check_mask(mask, B, T, device, empty_mask="zero"):
    """The (B, T) bool mask: ``mask`` must hold 0 / 1 only (bool, integer or float); an all-zero mask is
    a ValueError under ``empty_mask="raise"`` and otherwise gives a zero loss (see :func:`reduce_total`)."""
    if mask is None:
        return torch.ones(B, T, dtype=torch.bool, device=device)
    m = torch.as_tensor(mask, device=device)
    if m.shape != (B, T):
        raise ValueError(f"mask must have shape (B, T) = ({B}, {T}), got {tuple(m.shape)}")
    if m.dtype != torch.bool:
        bad = (m != 0) & (m != 1)
        if bool(bad.any()):
            i = first_bad(bad)
            raise ValueError(f"mask{list(i)} = {m[i].item()!r} is not 0 or 1: a mask keeps (1) or drops (0) a "
                             f"position (from labels with -100, pass mask_from_labels(labels))")
    m = m.bool()
    if empty_mask == "raise" and not bool(m.any()):
        raise ValueError("mask is all zero: no position to compute a loss on (empty_mask='raise')")
    return m


def check_reduction(reduction, num_items_in_batch, empty_mask):
    """reduction one of REDUCTIONS; num_items_in_batch (a positive count) only with reduction 'mean'."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction = {reduction!r} must be one of {REDUCTIONS}")
    if empty_mask not in EMPTY_MASK:
        raise ValueError(f"empty_mask = {empty_mask!r} must be one of {EMPTY_MASK}")
    if num_items_in_batch is None:
        return
    if reduction != "mean":
        raise ValueError(f"num_items_in_batch replaces the denominator of reduction = 'mean' (the kept positions "
                         f"of the whole accumulated batch); it cannot be combined with reduction = {reduction!r}")
    n = num_items_in_batch
    ok = (torch.is_tensor(n) and n.numel() == 1) or (isinstance(n, (int, float)) and not isinstance(n, bool))
    if not ok or not (math.isfinite(float(n)) and float(n) > 0):
        raise ValueError(f"num_items_in_batch = {n!r} must be a positive count (a number or a one-element tensor)")


def reduce_total(total, count, B, reduction, num_items_in_batch):
    """The reduced loss from ``total`` (the sum over kept positions) and ``count`` (their number):
    'mean' total / count (total / num_items_in_batch when given: the kept positions of every
    micro-batch of a gradient-accumulation step, as transformers' Trainer passes it), 'sum' total,
    'batchmean' total / B (torch's KLDivLoss and TRL's ``labels=None``). No kept position: a zero
    that keeps the graph (total is then an exact 0 with a grad_fn)."""
    if num_items_in_batch is not None:
        n = num_items_in_batch
        return total / (n.to(total.device) if torch.is_tensor(n) else n)
    if reduction == "sum":
        return total
    if reduction == "batchmean":
        return total / B
    return total / count if bool(count > 0) else total


def mask_from_labels(labels, ignore_index=-100):
    """The (B, T) bool mask of the positions whose label is not ``ignore_index`` (transformers' and TRL's
    convention). Passing ``labels`` itself as a mask is an error (its ids are not 0 / 1). The mask sits
    at the labels' positions: if the logits are shifted against the labels (``logits[:, :-1]`` predict
    ``labels[:, 1:]``), shift the mask the same way."""
    if not torch.is_tensor(labels) or labels.ndim != 2 or labels.is_floating_point():
        raise ValueError(f"labels must be an integer (B, T) tensor, got "
                         f"{tuple(labels.shape) if torch.is_tensor(labels) else type(labels).__name__}")
    return labels != ignore_index


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




@dataclass(frozen=True)
class Problem:
    """A validated token-level problem (built by :func:`prepare`; never by hand)."""
    student: torch.Tensor          # (B, T, V) logits, or (B, T, H) hidden states for the fused path
    teachers: list                 # K (B, T, V) logit tensors, or K TopK
    topk: bool                     # the teachers are TopK
    K: int
    B: int
    T: int
    V: int                         # vocabulary columns that count (padded columns past it are dropped)
    weights: torch.Tensor          # (B, K) float64, rows on the simplex
    mask: torch.Tensor             # (B, T) bool
    tau_s: float                   # student temperature
    tau_t: float                   # teacher temperature
    chunk: int                     # positions per chunk
    reduction: str
    tail: str                      # top-k tail treatment
    compute: torch.dtype           # float32, or float64 for float64 inputs
    metrics: bool                  # compute the per-position metrics
    bias: torch.Tensor = None      # the lm_head bias (V,) of the fused path
    num_items_in_batch: object = None   # the denominator of 'mean' under gradient accumulation
    teacher_rows: list = None      # K TeacherRows (full teachers): chunk rows without a whole copy
    neg_inf: list = None           # K bools: teacher k has -inf logits where its weight is > 0
    sanitize: list = None          # K bools: teacher k has non-finite logits where its weight is 0


def prepare(student, student_V, teachers, weights, mask, student_temperature, teacher_temperature, chunk_size,
             reduction, vocab_size, tail, kind, hidden=False, metrics=True, bias=None, num_items_in_batch=None,
            empty_mask="zero"):
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
    check_reduction(reduction, num_items_in_batch, empty_mask)
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
                i = first_bad(bad)
                raise ValueError(f"teacher {k}: TopK ids{list(i)} = {int(ids[i])} is outside the vocabulary [0, {V})")
            srt = ids.sort(dim=-1).values
            dup = srt[..., 1:] == srt[..., :-1]
            if bool(dup.any()):
                i = first_bad(dup)
                raise ValueError(f"teacher {k}: TopK ids at position {list(i[:2])} repeat token {int(srt[i])}")
            lp = t.log_probs
            bad = torch.isnan(lp) | (lp > 1e-6)
            if bool(bad.any()):
                i = first_bad(bad)
                raise ValueError(f"teacher {k}: TopK log_probs{list(i)} = {float(lp[i])} is not a log-probability")
            over = torch.logsumexp(lp.double(), dim=-1) > 1e-6
            if bool(over.any()):
                i = first_bad(over)
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
    w = check_weights(weights, K, B)
    m = check_mask(mask, B, T, s.device, empty_mask)
    if hidden:
        _check_finite(s, "hidden_states", chunk_size)
    else:
        _check_finite(s[..., :V], "student_logits", chunk_size)
    teacher_rows, neg_inf, sanitize = [], [], []
    if not all(topk):
        for k, t in enumerate(teachers):
            teacher_rows.append(TeacherRows(t))
            flags = _check_teacher(teacher_rows[-1], k, w[:, k].to(t.device) > 0, V, kind, chunk_size)
            neg_inf.append(flags[0])
            sanitize.append(flags[1])
    compute = torch.float64 if s.dtype == torch.float64 else torch.float32
    return Problem(student=s, teachers=teachers, topk=all(topk), K=K, B=B, T=T, V=V, weights=w, mask=m,
                   tau_s=float(student_temperature), tau_t=float(teacher_temperature), chunk=chunk_size,
                   reduction=reduction, tail=tail, compute=compute, metrics=bool(metrics), bias=bias,
                   num_items_in_batch=num_items_in_batch, teacher_rows=teacher_rows, neg_inf=neg_inf,
                   sanitize=sanitize)




def rows(x, idx):
    """Rows ``idx`` (a slice or an index tensor) of a (..., V) tensor flattened to (N, V)."""
    return x.reshape(-1, x.shape[-1])[idx]




# ------------------------------------------------------------------------------------------------
# the chunked engine: loss per position, gradient computed chunk by chunk during the forward pass
# ------------------------------------------------------------------------------------------------
class ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, weight, problem, terms, out_metrics):
        """student: (B, T, V_s) logits, or hidden states (B, T, H) when ``weight`` (V_s, H) is given."""
        N = problem.B * problem.T
        flat = student.reshape(N, student.shape[-1])
        dense = bool(problem.mask.all())                    # every position: contiguous slices, no gathers
        positions = torch.nonzero(problem.mask.reshape(-1)).squeeze(1)
        need = bool(ctx.needs_input_grad[0] or (weight is not None and ctx.needs_input_grad[1]))
        losses = torch.zeros(N, dtype=problem.compute, device=student.device)
        grad_in = torch.zeros_like(student).reshape(N, student.shape[-1]) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=problem.compute, device=weight.device) \
            if weight is not None and ctx.needs_input_grad[1] else None
        V = problem.V
        for lo in range(0, positions.numel(), problem.chunk):
            idx = slice(lo, lo + problem.chunk) if dense else positions[lo:lo + problem.chunk]
            with torch.enable_grad():
                x = flat[idx].detach().to(problem.compute).requires_grad_(need)
                if weight is None:
                    z = x[:, :V]
                else:
                    w_c = weight.detach().to(problem.compute).requires_grad_(grad_w is not None)
                    z = (x @ w_c.T)[:, :V]
                    if problem.bias is not None:
                        z = z + problem.bias[:V].to(problem.compute)
                s_logp = torch.log_softmax(z if problem.tau_s == 1.0 else z / problem.tau_s, dim=-1)
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
                    out_metrics[name] = torch.full(shape, math.nan, dtype=problem.compute, device=student.device)
                out_metrics[name][..., idx] = value.detach()
        ctx.save_for_backward(grad_in if grad_in is not None else torch.empty(0),
                              grad_w if grad_w is not None else torch.empty(0))
        ctx.has = (grad_in is not None, grad_w is not None)
        ctx.in_shape = student.shape
        ctx.w_dtype = weight.dtype if weight is not None else None
        return losses.reshape(problem.B, problem.T)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():                 # create_graph=True: the saved gradient is not a graph
            raise RuntimeError("the distillation losses compute the student's gradient during the forward pass, "
                               "so they cannot differentiate twice (create_graph=True, double backward); "
                               "write the objective out with torch ops where a second derivative is needed")
        grad_in, grad_w = ctx.saved_tensors
        g = grad_out.reshape(-1)
        out_in = out_w = None
        if ctx.has[0]:               # out of place: a second backward (retain_graph=True) finds grad_in intact
            out_in = (grad_in * g[:, None].to(grad_in.dtype)).reshape(ctx.in_shape)
        if ctx.has[1]:
            if not bool((g == g[0]).all()):
                raise RuntimeError("fused_linear_loss supports reduction 'mean' or 'sum' for the lm_head weight")
            out_w = (grad_w * g[0]).to(ctx.w_dtype)
        return out_in, out_w, None, None, None


def reduce(per_position, problem, metrics):
    mask = problem.mask
    n = int(mask.sum())
    metrics.update(n_positions=n, student_temperature=problem.tau_s, teacher_temperature=problem.tau_t,
                   loss_per_position=torch.where(mask, per_position.detach(), torch.full_like(per_position, math.nan)))
    for name in list(metrics):
        v = metrics[name]
        if torch.is_tensor(v) and v.shape[-1] == problem.B * problem.T:
            metrics[name] = v.reshape(v.shape[:-1] + (problem.B, problem.T))
    if problem.reduction == "none":
        return per_position
    return reduce_total(per_position.sum(), n, problem.B, problem.reduction, problem.num_items_in_batch)


