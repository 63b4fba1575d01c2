"""Validation (theory section 7) and the chunked engine behind the token-level losses: a validated problem
(:class:`Problem`), then the loss per position with the student's gradient computed chunk by chunk
during the forward pass (:class:`ChunkedLoss`), then the reduction."""

import contextlib
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

TAILS = ("tail", "renormalize", "uniform", "truncate")
# default chunk, logits per (positions, V) buffer: on a CPU about 512K (2 MB in float32), so that a chunk's
# buffers stay in the caches the closed-form passes sweep (benchmarks/README.md, the losses' idle
# re-measurement); on an accelerator, or from hidden states, about 2M (8 MB): fewer launches, fewer reads
# of the lm_head
CHUNK_ELEMENTS = {"cpu": 1 << 19, "other": 1 << 21}


@dataclass(frozen=True)
class TopK:
    """A teacher given by its top-k tokens: ``ids`` (B, T, k) long and ``log_probs`` (B, T, k), log-probs
    normalised over the full vocabulary (so the tail mass outside the top k is 1 - sum exp(log_probs))."""
    ids: torch.Tensor
    log_probs: torch.Tensor


# ------------------------------------------------------------------------------------------------
# validation (theory section 7: ValueError before any work, naming the argument, the axis and the first position)
# ------------------------------------------------------------------------------------------------
def first_bad(bad):
    """The first True index of a boolean tensor, as a tuple."""
    return tuple(int(i) for i in torch.nonzero(bad)[0])


def _raise_at(name, x, bad, positions, T, message):
    """ValueError naming the first True entry of ``bad`` (rows of the chunk ``x`` at flat ``positions``)."""
    row, col = first_bad(bad)
    pos = int(positions[row])
    raise ValueError(f"{name}[{pos // T}, {pos % T}] " + message.format(value=float(x[row, col]), col=col))


class Rows:
    """Rows (positions) of a (B, T, D) tensor, read chunk by chunk without copying it whole: a flat view
    when its layout allows one (contiguous, or a view of one slot of a larger tensor), else the chunk's
    rows gathered by (sample, position) (a shifted ``x[:, :-1]`` or permuted view: only the chunk is
    copied). The layout is read from the strides (no try / except: torch.compile traces it)."""

    def __init__(self, x):
        x = x.detach()                               # a constant here: gradients are computed in closed form
        self.B, self.T = x.shape[:2]
        flat = self.B == 1 or self.T == 1 or x.stride(0) == x.stride(1) * self.T
        self.flat, self.tensor = (x.reshape(-1, x.shape[-1]), None) if flat else (None, x)

    def __call__(self, idx):
        """Rows ``idx`` (a slice or an index tensor of flat positions b T + t) as an (n, D) tensor: a view
        when the layout is flat or the slice lies within one sample (a shifted view's rows there are one
        strided block), else the rows gathered."""
        if self.flat is not None:
            return self.flat[idx]
        if isinstance(idx, slice):
            b, t0 = divmod(idx.start, self.T)
            if t0 + idx.stop - idx.start <= self.T:
                return self.tensor[b, t0:t0 + idx.stop - idx.start]
            idx = torch.arange(self.B * self.T, device=self.tensor.device)[idx]
        return self.tensor[idx // self.T, idx % self.T]


def dense_chunks(count, chunk, T, split):
    """Slices of at most ``chunk`` consecutive flat positions; with ``split`` none crosses a sample's end, so
    that the rows of a view that is not flat (a shifted ``logits[:, :-1]``) are read as views, not gathered."""
    lo = 0
    while lo < count:
        hi = min(lo + chunk, count, (lo // T + 1) * T) if split else min(lo + chunk, count)
        yield slice(lo, hi)
        lo = hi


def locate_bad_input(problem, idx, kind):
    """The chunk ``idx`` gave a non-finite loss: the ValueError naming the first bad input there (theory section 7).
    The student (or hidden states): NaN / inf. A full teacher on samples where its weight is > 0: NaN /
    +inf, a row of -inf only, or (reverse KL) any -inf; -inf elsewhere is a valid log-prob (vocabulary
    masks, top-p filtering: p = 0, 0 log 0 = 0); on samples where its weight is 0 anything goes."""
    positions = problem.positions(idx)
    x = problem.student_rows(idx)
    name = "hidden_states" if problem.hidden else "student_logits"
    x = x if problem.hidden else x[:, :problem.V]
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        _raise_at(name, x, bad, positions, problem.T, "has a non-finite logit ({value}) at vocabulary index {col}"
                  if not problem.hidden else "has a non-finite value ({value}) at index {col}")
    for k, rows in enumerate(problem.teacher_rows):
        x = rows(idx)[:, :problem.V]
        live = (problem.weights[:, k].to(x.device) > 0)[positions // problem.T][:, None]
        minus_inf = torch.isneginf(x)
        checks = ((~torch.isfinite(x) & ~minus_inf & live, "has a non-finite logit ({value}) at vocabulary index {col}"),
                  ((minus_inf.all(-1, keepdim=True) & live).expand_as(x), "is -inf at every vocabulary index"))
        if kind == "reverse":
            checks += ((minus_inf & live, "is -inf at vocabulary index {col} with weight > 0: the reverse KL is "
                                          "infinite there (the student gives every token mass); use forward_kl "
                                          "or generalized_jsd with 0 < beta < 1, or weight 0 on that sample"),)
        for bad, message in checks:
            if bool(bad.any()):
                _raise_at(f"teacher {k} logits", x, bad, positions, problem.T, message)
    raise ValueError(f"the loss is not finite at position {[int(positions[0]) // problem.T, int(positions[0]) % problem.T]} "
                     f"or after it in that chunk, though every input there is finite")


def check_not_meta(**tensors):
    """A ValueError for a tensor on the meta device (shapes without values): the losses validate their inputs
    and compute the student's gradient during the forward pass, and both read values."""
    for name, x in tensors.items():
        xs = x if isinstance(x, (list, tuple)) else [x]
        for t in xs:
            for part in ((t.ids, t.log_probs) if isinstance(t, TopK) else (t,)):
                if torch.is_tensor(part) and part.device.type == "meta":
                    raise ValueError(f"{name} is on the meta device: the losses validate their inputs and compute "
                                     f"the student's gradient in the forward pass, which needs values; call them "
                                     f"on real tensors (cpu, cuda)")


LOW_PRECISION = (torch.bfloat16, torch.float16)


def positive_number(name, x):
    """A positive finite number (int, float, NumPy scalar or one-element tensor) as a float, else a
    ValueError naming ``name``."""
    if torch.is_tensor(x) and x.numel() == 1 and not x.dtype == torch.bool:
        x = x.item()
    if isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)) and math.isfinite(float(x)) and float(x) > 0:
        return float(x)
    raise ValueError(f"{name} = {x!r} must be a positive number")


def check_weights(weights, K, B):
    """(B, K) float64 weights on the simplex. Rows must sum to 1 within 1e-6, or, for bf16 / fp16 weights
    (a softmax in that dtype: row sums 1.002, 0.99995), within K x the dtype's epsilon; those rows are
    then renormalised."""
    dtype = weights.dtype if torch.is_tensor(weights) else None
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
    tol = max(1e-6, K * torch.finfo(dtype).eps) if dtype in LOW_PRECISION else 1e-6
    off = (sums - 1).abs() > tol
    if bool(off.any()):
        b = int(torch.nonzero(off)[0])
        raise ValueError(f"weights of sample {b} sum to {float(sums[b])!r}, not 1 within {tol:.3g} "
                         f"(weights lie on the simplex)")
    return w / sums[:, None] if dtype in LOW_PRECISION else w


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
    if not ok or not (math.isfinite(float(n)) and float(n) >= 0):
        raise ValueError(f"num_items_in_batch = {n!r} must be a count >= 0 (a number or a one-element tensor)")


def check_items(num_items_in_batch, mask):
    """num_items_in_batch = 0 (a whole accumulation step of ignored labels) goes with an empty mask only."""
    if num_items_in_batch is not None and float(num_items_in_batch) == 0 and bool(mask.any()):
        raise ValueError(f"num_items_in_batch = 0 but the mask keeps {int(mask.sum())} positions: it counts the "
                         f"kept positions of the whole accumulation step, this micro-batch's included")


def reduce_total(total, count, B, reduction, num_items_in_batch):
    """The reduced loss from ``total`` (the sum over kept positions) and ``count`` (their number):
    'mean' total / count (total / num_items_in_batch when given: the kept positions of every
    micro-batch of a gradient-accumulation step, as transformers' Trainer passes it), 'sum' total,
    'batchmean' total / B (torch's KLDivLoss and TRL's ``labels=None``). No kept position: a zero
    that keeps the graph (total is then an exact 0 with a grad_fn), also under num_items_in_batch = 0."""
    if num_items_in_batch is not None and float(num_items_in_batch) > 0:
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
    hidden: bool                   # the student is given by hidden states (fused path)
    student_rows: Rows             # the student's chunk rows without a whole copy
    teacher_rows: list             # K Rows (full teachers; empty for TopK)
    bias: torch.Tensor = None      # the lm_head bias (V,) of the fused path
    num_items_in_batch: object = None   # the denominator of 'mean' under gradient accumulation

    def positions(self, idx):
        """The flat positions b T + t of the rows ``idx`` (a slice or an index tensor)."""
        if isinstance(idx, slice):
            return torch.arange(self.B * self.T, device=self.mask.device)[idx]
        return idx

    def weights_at(self, idx, device):
        """(n, K) weights of the rows ``idx`` in the compute dtype."""
        return self.weights.to(device=device, dtype=self.compute)[self.positions(idx).to(device) // self.T]


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
    check_not_meta(**{("hidden_states" if hidden else "student_logits"): s, "teacher_logits": teachers,
                      "weights": weights, "mask": mask, "bias": bias})
    topk = [isinstance(t, TopK) for t in teachers]
    if any(topk) and not all(topk):
        raise ValueError("teachers must be all full logits or all TopK, not a mix")
    K = len(teachers)
    student_temperature = positive_number("student_temperature", student_temperature)
    teacher_temperature = positive_number("teacher_temperature", teacher_temperature)
    if chunk_size is None:
        # from hidden states each chunk re-reads the lm_head (V x H), so those keep the larger chunk
        elements = CHUNK_ELEMENTS["cpu" if student.device.type == "cpu" and not hidden else "other"]
        chunk_size = max(1, elements // max(int(student_V), 1))
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
    check_items(num_items_in_batch, m)
    # NaN / inf inputs are found inside the chunk loop, from the per-row results (locate_bad_input)
    compute = torch.float64 if s.dtype == torch.float64 else torch.float32
    return Problem(student=s, teachers=teachers, topk=all(topk), K=K, B=B, T=T, V=V, weights=w, mask=m,
                   tau_s=student_temperature, tau_t=teacher_temperature, chunk=chunk_size,
                   reduction=reduction, tail=tail, compute=compute, metrics=bool(metrics), hidden=hidden,
                   student_rows=Rows(s), teacher_rows=[] if all(topk) else [Rows(t) for t in teachers],
                   bias=bias, num_items_in_batch=num_items_in_batch)




def rows(x, idx):
    """Rows ``idx`` (a slice or an index tensor) of a (..., V) tensor flattened to (N, V)."""
    return x.reshape(-1, x.shape[-1])[idx]


# ------------------------------------------------------------------------------------------------
# the chunked engine: loss per position and, chunk by chunk in the forward pass, the student's gradient
# in closed form (a kernel per loss, token_level.py), the reduction's scale folded in
# ------------------------------------------------------------------------------------------------
def reduction_scale(problem):
    """d loss / d (sum of the per-position losses): 1 / count ('mean'), 1 / num_items_in_batch, 1 / B
    ('batchmean'), 1 ('sum'; 'none' multiplies by the upstream gradient in backward)."""
    n = problem.num_items_in_batch
    if n is not None and float(n) > 0:
        return 1.0 / float(n)
    if problem.reduction == "mean":
        return 1.0 / max(int(problem.mask.sum()), 1)
    return 1.0 / problem.B if problem.reduction == "batchmean" else 1.0


def run(problem, kernel, student, weight, out_metrics, grad_in=False, grad_w=False, base=None):
    """The loop over chunks of kept positions. ``kernel(idx, z, factor, need_grad)`` gets the chunk's
    student log-probabilities z = ln q (n, V) (log_softmax of the logits divided by the temperature, in the
    compute dtype, its own buffer) and
    returns (loss (n,), check (n,), metrics), with, when asked, factor x d loss.sum() / d z written over
    z. A non-finite ``check`` row is bad input (NaN / inf, or -inf where it is infinite): the chunk's
    inputs are then searched for the first bad entry (locate_bad_input). Returns (losses (N,),
    gradient with respect to the student (its shape and dtype) or None, and to the lm_head weight).
    ``base``: the contiguous tensor the student is a view of (a shifted ``logits[:, :-1]``): the gradient is
    then written into a zero buffer of the base's shape and returned as the base's gradient, so that the
    view's backward (a second full-size buffer) never runs (see :func:`view_base`)."""
    N, V, c = problem.B * problem.T, problem.V, problem.compute
    device = student.device
    dense = bool(problem.mask.all())                    # every position: contiguous slices, no gathers
    positions = None if dense else torch.nonzero(problem.mask.reshape(-1)).squeeze(1)
    count = N if dense else positions.numel()
    factor = reduction_scale(problem) / problem.tau_s
    losses = torch.zeros(N, dtype=c, device=device)
    need = grad_in or grad_w
    g_in = None
    g_base = None
    if grad_in and base is not None:
        g_base = torch.zeros(base.shape, dtype=base.dtype, device=device)
        g_in = g_base.as_strided(student.shape, student.stride(), student.storage_offset() - base.storage_offset())
    elif grad_in:
        width = student.shape[-1]
        fill = dense and (problem.hidden or V == width)
        g_in = (torch.empty if fill else torch.zeros)((N, width), dtype=student.dtype, device=device)
    g_w = torch.zeros(weight.shape, dtype=c, device=device) if grad_w else None
    w_c = weight.detach()[:V].to(c) if weight is not None else None
    bias = problem.bias.detach()[:V].to(c) if problem.bias is not None else None
    # a chunk within one sample where some input is a view that is not flat and a sample fills a chunk
    split = problem.T >= problem.chunk and any(r.flat is None for r in [problem.student_rows, *problem.teacher_rows])
    chunks = (dense_chunks(count, problem.chunk, problem.T, split) if dense else
              (positions[lo:lo + problem.chunk] for lo in range(0, count, problem.chunk)))
    fused = weight is None and problem.tau_s == 1.0      # ln q from one log_softmax of the student's rows
    for idx in chunks:
        x = problem.student_rows(idx)
        if weight is None:
            direct = g_in is not None and g_base is None and dense and g_in.dtype == c and V == x.shape[1]
            z = g_in[idx] if direct else torch.empty((x.shape[0], V), dtype=c, device=device)
            if fused:                                    # one pass, upcast in it
                torch.log_softmax(x[:, :V], -1, dtype=c, out=z)
            else:
                z.copy_(x[:, :V])
        else:
            direct = False
            x = x.to(c)
            z = x @ w_c.T
            if bias is not None:
                z.add_(bias)
        if not fused:
            if problem.tau_s != 1.0:
                z.div_(problem.tau_s)
            z.sub_(torch.logsumexp(z, -1, keepdim=True))
        loss, check, met = kernel(idx, z, factor, need)
        if not bool(torch.isfinite(check).all()):
            locate_bad_input(problem, idx, kernel.kind)
        losses[idx] = loss
        if need:
            if weight is not None:
                if g_w is not None:
                    g_w[:V].addmm_(z.T, x)
                if g_in is not None:
                    g_in[idx] = (z @ w_c).to(g_in.dtype)
            elif g_base is not None and dense:          # slices of the (B, T, V) view, one per sample
                for b, t0, t1, r0 in sample_runs(idx.start, idx.stop, problem.T):
                    g_in[b, t0:t1, :V] = z[r0:r0 + t1 - t0]
            elif g_base is not None:
                at = idx.to(device)
                g_in[at // problem.T, at % problem.T, :V] = z.to(g_in.dtype)
            elif not direct and g_in is not None:
                if dense:
                    g_in[idx, :V] = z
                else:
                    g_in[idx, :V] = z.to(g_in.dtype)
        for name, value in met.items():
            if name not in out_metrics:
                shape = (value.shape[0], N) if value.ndim == 2 else (N,)
                out_metrics[name] = torch.full(shape, math.nan, dtype=c, device=device)
            out_metrics[name][..., idx] = value
    if g_base is not None:
        g_in = g_base
    elif g_in is not None:
        g_in = g_in.reshape(student.shape)
    return losses, g_in, g_w


def sample_runs(lo, hi, T):
    """The flat positions [lo, hi) as runs within one sample: (b, t0, t1, first row of the run)."""
    pos = lo
    while pos < hi:
        b, t = divmod(pos, T)
        n = min(hi - pos, T - t)
        yield b, t, t + n, pos - lo
        pos += n


def view_base(problem, student):
    """The tensor to differentiate instead of ``student`` when it is a non-overlapping view (a slice such as
    the shifted ``logits[:, :-1]``) of a contiguous tensor that requires grad: that base, whose gradient
    is then built in one buffer; else None. Only for a scalar reduction of the logits path."""
    base = student._base
    if (problem.hidden or problem.reduction == "none" or base is None or student.grad_fn is None
            or not base.requires_grad
            or not base.is_contiguous() or base.dtype != student.dtype or base.device != student.device):
        return None
    span = 1                                  # non-overlapping: each stride at least the span of the smaller ones
    for stride, size in sorted((st, n) for st, n in zip(student.stride(), student.shape) if n > 1):
        if stride < span:
            return None
        span = stride * size
    return base


def _reduced(losses, problem):
    if problem.reduction == "none":
        return losses.reshape(problem.B, problem.T)
    return reduce_total(losses.sum(), int(problem.mask.sum()), problem.B, problem.reduction,
                        problem.num_items_in_batch)


UNSUPPORTED = ("the distillation losses compute the student's gradient in closed form during the forward pass: "
               "supported are loss.backward(), torch.autograd.grad and the reverse-mode transforms torch.func.grad, "
               "vjp and jacrev; not {what} (for per-position losses pass reduction='none')")


def float32_products(device):
    """Autocast off for the chunk loop: the products are computed in the compute dtype (float32, or float64)
    whatever ``torch.autocast`` asks (a bf16 bmm would round the loss and its gradient)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class Results:
    """What the forward pass hands to ``setup_context`` and to the caller: the metrics and the gradients. A
    plain object, not a dict: torch.func flattens dict arguments into copies, this passes through as it is."""

    def __init__(self):
        self.metrics, self.g_in, self.g_w = {}, None, None
        self.from_base = False          # the student passed is the base of the problem's student (view_base)


class ChunkedLoss(torch.autograd.Function):
    """The reduced loss (or the (B, T) losses for 'none'), its gradient computed in the forward pass.
    forward / setup_context kept apart, as torch.func asks: grad, vjp and jacrev work; vmap and forward mode
    (jvp) are a RuntimeError naming what works."""

    @staticmethod
    def forward(student, weight, problem, kernel, out, need_in, need_w):
        """``student``: the problem's student, or the base it is a view of (:func:`view_base`)."""
        base = student if out.from_base else None
        with float32_products(student.device):
            losses, out.g_in, out.g_w = run(problem, kernel, problem.student if base is not None else student,
                                            weight, out.metrics, grad_in=need_in, grad_w=need_w, base=base)
        out.metrics["loss_per_position"] = losses
        return _reduced(losses, problem)

    @staticmethod
    def setup_context(ctx, inputs, output):
        student, weight, problem, _, out, _, _ = inputs
        ctx.save_for_backward(out.g_in, out.g_w, student, weight)
        ctx.w_dtype = weight.dtype if weight is not None else None
        ctx.per_position = problem.reduction == "none"

    @staticmethod
    def backward(ctx, grad_out):
        g_in, g_w, student, weight = ctx.saved_tensors
        if ctx.per_position:
            g_in = g_in * grad_out[..., None].to(g_in.dtype) if g_in is not None else None
        else:
            # a scalar upstream gradient: 1 (loss.backward()) hands the saved buffer over as it is, with no
            # second full-size buffer (autograd copies it only if the graph is retained); else a scaled copy
            one = not torch.is_grad_enabled() and bool(grad_out == 1)
            if g_in is not None and not one:
                g_in = g_in * grad_out.to(g_in.dtype)
            if g_w is not None:
                g_w = (g_w if one else g_w * grad_out).to(ctx.w_dtype)
        if torch.is_grad_enabled():         # create_graph=True, torch.func: a second derivative must not be 0
            inputs = [x for x in (student, weight) if x is not None]
            g_in, g_w = (None if g is None else Once.apply(g, *inputs) for g in (g_in, g_w))
        return g_in, g_w, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, *args):
        raise RuntimeError(UNSUPPORTED.format(what="torch.func.vmap"))

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(UNSUPPORTED.format(what="forward-mode AD (torch.func.jvp, jacfwd, forward_ad)"))


class Once(torch.autograd.Function):
    """The saved gradient, tied to the inputs it depends on: differentiating it again raises (the closed form
    has no graph, so a second derivative through it would be a silent zero)."""

    generate_vmap_rule = True           # jacrev vmaps over the backward

    @staticmethod
    def forward(g, *inputs):
        return g.view_as(g)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("the distillation losses compute the student's gradient during the forward pass, so "
                           "they cannot differentiate twice (create_graph=True, double backward, nested "
                           "torch.func.grad); write the objective out with torch ops where a second derivative "
                           "is needed")


def compute(problem, kernel, student, weight=None):
    """(loss, metrics) through ChunkedLoss, which computes the gradient only when one is wanted (no_grad,
    inference_mode or nothing requiring grad: the same loop with no gradient work)."""
    out = Results()
    grad = torch.is_grad_enabled()
    need_w = grad and weight is not None and weight.requires_grad
    need_in = grad and student.requires_grad
    base = view_base(problem, student) if need_in else None
    out.from_base = base is not None
    loss = ChunkedLoss.apply(student if base is None else base, weight, problem, kernel, out, need_in, need_w)
    return loss, finish_metrics(problem, out.metrics)


def finish_metrics(problem, metrics):
    """(B, T) metrics (NaN where masked), the kept count and the temperatures."""
    mask = problem.mask
    per = metrics["loss_per_position"].reshape(problem.B, problem.T)
    metrics.update(n_positions=int(mask.sum()), student_temperature=problem.tau_s,
                   teacher_temperature=problem.tau_t,
                   loss_per_position=torch.where(mask, per, torch.full_like(per, math.nan)))
    for name in list(metrics):
        v = metrics[name]
        if torch.is_tensor(v) and v.shape[-1] == problem.B * problem.T:
            metrics[name] = v.reshape(v.shape[:-1] + (problem.B, problem.T))
    return metrics
