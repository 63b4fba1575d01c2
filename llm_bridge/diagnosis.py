"""A diagnosis of K teachers before training (SPEC 1, 2, 6; claims T6, T7, T8): along responses to a
prompt, where the FKL and the RKL targets disagree, which tokens a teacher vetoes, where a confident
expert dominates, and how far the prompt is from a prefix flip. Library of ``python sims/diagnose.py``.

At each position t of a response c to a prompt u, with the teachers' conditionals p_k(. | u c_<t):

- **targets**: ``A = sum_k w_k p_k`` (the token-level mixture: what a forward-KL loss against the teachers'
  logits teaches) and ``l ∝ prod_k p_k^{w_k}`` (the local geometric pool: what per-token reverse KL
  teaches), both aggregation's pools; their **disagreement** ``KL(A || l)``, the total variation
  ``TV = 1/2 sum_a |A(a) - l(a)|`` and whether ``argmax A != argmax l`` (the two targets would teach
  different tokens there);
- **vetoes** (T7): tokens a with ``ln p_k(a) < veto_log_prob`` for a teacher with ``w_k > 0`` while the
  reference (A, or the student when one is given) gives ``a`` at least ``veto_floor``: reverse KL drives
  the student's mass on a towards l(a), which that teacher alone holds near zero. End tokens (the
  response's end: a student that never learns to stop) and chat-template tokens (a template mismatch)
  are reported as their own kinds;
- **confident experts** (T6): positions where one positive-weight teacher's entropy is at most
  ``expert_entropy`` nats, every other one's at least ``uninformative_entropy``, and l follows the expert
  where A does not: ``l(a*) - A(a*) >= expert_gap`` for the expert's top token a*;
- **prefix flip risk** (T8): for the prompt's two options (or, without options, the pool's preferred first
  token C and its rival I: the other teachers' first choice, else l's runner-up), the pooled margin, the
  drift of ``D(H) = ln Z_H(uI) - ln Z_H(uC)`` with its interval, H* = margin / drift and the first flip
  measured at the horizons asked, from :func:`llm_bridge.horizon.flip_horizon_study` (today's estimator:
  the flip is reported at the measured horizons only, with no power statement).

    traces = follow(teachers, prompt_ids, max_tokens, rng)        # teachers' responses, every teacher's
                                                                  # conditionals along each (one batch)
    tables = diagnose_path(lp, weights, tokens, end_ids, template_ids, Thresholds())   # tidy DataFrames
    flip = flip_risk(teachers, items, horizons, n_samples, seed)
"""

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

import aggregation as ag
from aggregation.validate import check_horizons, check_int, check_weights, positive_teachers

from .horizon import flip_horizon_study
from .partition import _sample
from .teachers import Teacher, _accepts, _cache_name, _cache_of


@dataclass(frozen=True)
class Thresholds:
    """What counts as a veto and as a confident expert (nats and probabilities, stated in every report).

    veto_log_prob : a teacher's ln p_k(a) below this is a veto (default ln 1e-4) ...
    veto_floor : ... where the reference (A or the student) gives a at least this (default 0.05);
    expert_entropy : the expert's entropy at most this (nats, default 0.5) ...
    uninformative_entropy : ... every other positive-weight teacher's at least this (nats, default 2.0) ...
    expert_gap : ... and l(a*) - A(a*) at least this (default 0.1) for the expert's top token a*.
    """
    veto_log_prob: float = math.log(1e-4)
    veto_floor: float = 0.05
    expert_entropy: float = 0.5
    uninformative_entropy: float = 2.0
    expert_gap: float = 0.1

    def __post_init__(self):
        for name in ("veto_log_prob", "veto_floor", "expert_entropy", "uninformative_entropy", "expert_gap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} = {value!r} must be a finite number")
        if not self.veto_log_prob < 0:
            raise ValueError(f"veto_log_prob = {self.veto_log_prob} must be < 0 (a log-probability)")
        if not 0 < self.veto_floor <= 1:
            raise ValueError(f"veto_floor = {self.veto_floor} must be in (0, 1]")
        if not 0 <= self.expert_entropy < self.uninformative_entropy:
            raise ValueError(f"expert_entropy = {self.expert_entropy} must be >= 0 and below "
                             f"uninformative_entropy = {self.uninformative_entropy}")
        if not 0 <= self.expert_gap <= 1:
            raise ValueError(f"expert_gap = {self.expert_gap} must be in [0, 1]")

    def as_dict(self):
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


# ------------------------------------------------------------------------------------------------
# following responses: every teacher's conditionals along each, in one KV-cached batch
# ------------------------------------------------------------------------------------------------
@dataclass
class Trace:
    """One response to a prompt: its ``source`` (a teacher's name, ``"student"`` or ``"given<i>"``), its
    ``tokens`` (T,), every teacher's conditionals ``teacher`` (K, T, n) float64 along it and, when a student
    was given, the student's ``student`` (T, n)."""
    source: str
    tokens: list
    teacher: np.ndarray
    student: object = None


@torch.no_grad()
def follow(teachers, prompt_ids, max_tokens, rng, responses=None, student=None):
    """The responses to one prompt and every teacher's (and the student's) conditionals along them.

    Parameters
    ----------
    teachers : llm_bridge.Teachers; prompt_ids : non-empty token ids (the templates go before them).
    max_tokens : int >= 1, the length of a sampled response (it stops earlier at an end token).
    rng : numpy Generator (sampling by inverse CDF, :func:`llm_bridge.partition._sample`).
    responses : optional list of token-id lists: score these instead of sampling.
    student : optional :class:`llm_bridge.Teacher` (sharing the vocabulary): without ``responses`` one
        rollout of the student is followed; its conditionals are returned along every response.

    Returns
    -------
    list of :class:`Trace`: the given responses, else the student's rollout, else one response sampled
    from each positive-weight teacher (at its temperature). Every (response, scorer) pair is one row of
    a left-padded, KV-cached batch per model (scorers sharing a model share its forward passes).
    """
    prompt_ids = teachers.check_ids(prompt_ids, "prompt", allow_empty=False, input_ids=True)
    max_tokens = check_int(max_tokens, "max_tokens", 1)
    scorers = list(teachers.teachers) + ([student] if student is not None else [])
    if student is not None:
        if not isinstance(student, Teacher):
            raise ValueError(f"student must be an llm_bridge.Teacher, got {type(student).__name__}")
        student.model.to(teachers.device).eval()
    if responses is not None:
        responses = [teachers.check_ids(r, f"responses[{i}]", allow_empty=False) for i, r in enumerate(responses)]
        if not responses:
            raise ValueError("responses is empty")
        sources = [f"given{i}" for i in range(len(responses))]
        samplers = [None] * len(responses)
    elif student is not None:
        sources, samplers = ["student"], [len(scorers) - 1]
    else:
        samplers = [int(k) for k in positive_teachers(teachers.weights)]
        sources = [teachers.names[k] for k in samplers]
    R, S = len(sources), len(scorers)
    T = max(len(r) for r in responses) if responses is not None else max_tokens
    tokens = np.full((R, T), -1, dtype=np.int64)
    if responses is not None:
        for r, resp in enumerate(responses):
            tokens[r, :len(resp)] = resp
    out = np.zeros((R, S, T, teachers.vocab_size))
    ends = set(teachers.end_token_ids)
    groups = {}
    for s, sc in enumerate(scorers):
        groups.setdefault(id(sc.model), []).append(s)
    state = {}
    for g, members in groups.items():
        rows = [(r, s) for r in range(R) for s in members]
        state[g] = [rows] + list(_prefill(scorers, teachers.device, [(s, prompt_ids) for _, s in rows]))
    length = np.full(R, T if responses is None else 0)
    if responses is not None:
        length[:] = [len(r) for r in responses]
    for t in range(T):
        for g, st in state.items():
            rows, logits = st[0], st[1]
            for i, (r, s) in enumerate(rows):
                if t < length[r]:
                    out[r, s, t] = teachers.log_softmax(logits[i], scorers[s].temperature).double().cpu().numpy()
        if responses is None:
            for r in range(R):
                if t < length[r]:
                    tokens[r, t] = int(_sample(out[r, samplers[r], t][None], rng)[0])
                    if tokens[r, t] in ends:
                        length[r] = t + 1
        if t == T - 1 or not np.any(length > t + 1):
            break
        for g, st in state.items():
            rows, _, cache, mask, pos = st
            model = scorers[rows[0][1]].model
            feed = torch.tensor([max(int(tokens[r, t]), 0) for r, _ in rows], device=teachers.device)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            res = model(input_ids=feed[:, None], attention_mask=mask, position_ids=pos[:, None], use_cache=True,
                        **{_cache_name(model): cache})
            st[1:] = [res.logits[:, -1], _cache_of(res), mask, pos + 1]
    traces = []
    for r in range(R):
        n = int(length[r])
        traces.append(Trace(sources[r], tokens[r, :n].tolist(), out[r, :teachers.K, :n],
                            out[r, teachers.K, :n] if student is not None else None))
    return traces


def _prefill(scorers, device, rows):
    """Run ``template_s + prompt`` for every row (s, prompt) of one model, left-padded (the padding repeats
    the row's first token and is masked out; TabularLM's first token, BOS, resets it). Returns (last
    logits (B, V), cache, attention mask (B, L), next positions (B,))."""
    seqs = [list(scorers[s].template_ids) + list(p) for s, p in rows]
    L = max(len(x) for x in seqs)
    ids = torch.tensor([[x[0]] * (L - len(x)) + x for x in seqs], device=device)
    mask = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in seqs], device=device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    model = scorers[rows[0][0]].model
    extra = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    res = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
    return res.logits[:, -1], _cache_of(res), mask, positions[:, -1] + 1


# ------------------------------------------------------------------------------------------------
# the diagnosis along one response (pure: arrays in, tidy DataFrames out)
# ------------------------------------------------------------------------------------------------
def diagnose_path(log_probs, weights, tokens, end_token_ids=(), template_token_ids=(), thresholds=None,
                  reference=None, names=None, decode=None):
    """Disagreement, vetoes and confident experts along one response (see the module docstring).

    Parameters
    ----------
    log_probs : (K, T, n) every teacher's conditionals along the response; weights : (K,) on the simplex.
    tokens : (T,) the response's token ids (the ``token`` columns).
    end_token_ids, template_token_ids : the ids reported as kind ``end`` and ``template`` (an id in both
        is ``end``).
    thresholds : :class:`Thresholds` (default the stated defaults).
    reference : optional (T, n) log-probs of a student: the veto reference instead of A.
    names : teacher names (default ``teacher<k>``); decode : optional id -> text for ``token_text``.

    Returns
    -------
    dict of DataFrames: ``positions`` (one row per position: the token, its probability under A and l,
    ``kl_a_l``, ``tv``, ``argmax_a`` / ``argmax_l`` with their probabilities, ``argmax_differs``,
    ``vetoes``, ``end_vetoes``, ``template_vetoes``, ``expert``), ``teachers`` (one row per position x
    teacher: entropy, log-prob of the token, top token and its probability), ``vetoes`` (one row per
    position x teacher x vetoed token: the teacher's log-prob, A's, l's and the reference's probability,
    ``kind``), ``experts`` (one row per flagged position: the expert, its entropy, the others' smallest
    entropy, a*, the expert's, A's and l's probability of it).
    """
    th = Thresholds() if thresholds is None else thresholds
    lp = np.asarray(log_probs, dtype=float)
    if lp.ndim != 3:
        raise ValueError(f"log_probs must be (K, T, n), got shape {lp.shape}")
    K, T, n = lp.shape
    w = check_weights(weights, K, other="log_probs")
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.shape != (T,):
        raise ValueError(f"tokens has shape {tokens.shape}, log_probs has {T} positions")
    if T and (tokens.min() < 0 or tokens.max() >= n):
        raise ValueError(f"tokens[{int(np.flatnonzero((tokens < 0) | (tokens >= n))[0])}] is outside [0, {n})")
    names = [f"teacher{k}" for k in range(K)] if names is None else list(names)
    if len(names) != K:
        raise ValueError(f"names has {len(names)} entries for {K} teachers")
    if reference is not None:
        reference = np.asarray(reference, dtype=float)
        if reference.shape != (T, n):
            raise ValueError(f"reference must be (T, n) = {(T, n)}, got {reference.shape}")
    decode = decode or (lambda a: "")
    ends, template = set(int(e) for e in end_token_ids), set(int(e) for e in template_token_ids)

    def kind(a):
        return "end" if a in ends else "template" if a in template else "text"

    keep = positive_teachers(w)
    log_a = ag.log_arithmetic_pool(lp, w)                                  # (T, n)
    log_l = ag.log_geometric_pool(lp, w)
    A, Lp = np.exp(log_a), np.exp(log_l)
    with np.errstate(invalid="ignore", divide="ignore"):
        kl = np.where(A > 0, A * (log_a - log_l), 0.0).sum(axis=1)
        P = np.exp(lp)
        entropy = -np.where(P > 0, P * lp, 0.0).sum(axis=2)                # (K, T)
    tv = 0.5 * np.abs(A - Lp).sum(axis=1)
    ref = A if reference is None else np.exp(reference)
    veto = (lp[keep] < th.veto_log_prob) & (ref[None] >= th.veto_floor)     # (K', T, n)
    v_rows = []
    for j, t, a in zip(*np.nonzero(veto)):
        k = int(keep[j])
        v_rows.append(dict(position=int(t), teacher=names[k], token=int(a), token_text=decode(int(a)),
                           kind=kind(int(a)), teacher_log_prob=lp[k, t, a], a_prob=A[t, a], l_prob=Lp[t, a],
                           reference_prob=ref[t, a], is_response_token=bool(tokens[t] == a)))
    vetoes = pd.DataFrame(v_rows, columns=["position", "teacher", "token", "token_text", "kind", "teacher_log_prob",
                                           "a_prob", "l_prob", "reference_prob", "is_response_token"])
    e_rows, expert_at = [], [""] * T
    for t in range(T):
        for j, k in enumerate(keep):
            others = [int(i) for i in keep if i != k]
            if not others or entropy[k, t] > th.expert_entropy:
                continue
            low = min(entropy[i, t] for i in others)
            top = int(np.argmax(lp[k, t]))
            if low >= th.uninformative_entropy and Lp[t, top] - A[t, top] >= th.expert_gap:
                expert_at[t] = names[k]
                e_rows.append(dict(position=t, expert=names[k], expert_entropy=entropy[k, t], others_min_entropy=low,
                                   token=top, token_text=decode(top), expert_prob=P[k, t, top], a_prob=A[t, top],
                                   l_prob=Lp[t, top]))
    experts = pd.DataFrame(e_rows, columns=["position", "expert", "expert_entropy", "others_min_entropy", "token",
                                            "token_text", "expert_prob", "a_prob", "l_prob"])
    arg_a, arg_l = A.argmax(axis=1), Lp.argmax(axis=1)
    idx = np.arange(T)
    count = (lambda what: np.bincount(vetoes.position[vetoes.kind == what], minlength=T) if len(vetoes)
             else np.zeros(T, int))
    positions = pd.DataFrame(dict(
        position=idx, token=tokens, token_text=[decode(int(a)) for a in tokens], token_kind=[kind(int(a)) for a in tokens],
        a_prob=A[idx, tokens], l_prob=Lp[idx, tokens], kl_a_l=kl, tv=tv, argmax_a=arg_a,
        argmax_a_text=[decode(int(a)) for a in arg_a], argmax_a_prob=A[idx, arg_a], argmax_l=arg_l,
        argmax_l_text=[decode(int(a)) for a in arg_l], argmax_l_prob=Lp[idx, arg_l], argmax_differs=arg_a != arg_l,
        vetoes=count("text") + count("end") + count("template"), end_vetoes=count("end"),
        template_vetoes=count("template"), expert=expert_at))
    top = lp.argmax(axis=2)
    teachers = pd.DataFrame(dict(
        position=np.tile(idx, K), teacher=np.repeat(names, T), weight=np.repeat(w, T), entropy=entropy.ravel(),
        token_log_prob=lp[:, idx, tokens].ravel(), top_token=top.ravel(),
        top_prob=np.exp(np.take_along_axis(lp, top[..., None], axis=2)[..., 0]).ravel()))
    return dict(positions=positions, teachers=teachers, vetoes=vetoes, experts=experts)


# ------------------------------------------------------------------------------------------------
# prefix flip risk
# ------------------------------------------------------------------------------------------------
def first_token_options(first_log_probs, weights):
    """(C, I) token ids from the teachers' first-position conditionals (K, n): C = l's top token (the
    pool's preferred first token), I = the other positive-weight teachers' top choice that l ranks
    highest, else l's runner-up."""
    lp = np.asarray(first_log_probs, dtype=float)
    w = check_weights(weights, lp.shape[0], other="first_log_probs")
    keep = positive_teachers(w)
    pooled = w[keep] @ lp[keep]
    c = int(np.argmax(pooled))
    rivals = sorted({int(np.argmax(lp[k])) for k in keep} - {c}, key=lambda a: -pooled[a])
    if rivals:
        return c, rivals[0]
    order = np.argsort(-pooled, kind="stable")
    return c, int(order[1])


def flip_risk(teachers, items, horizons, n_samples, seed, max_rows=512):
    """Prefix flip risk of each prompt from :func:`llm_bridge.horizon.flip_horizon_study`.

    items : list of dicts with ``id``, ``prompt_ids`` and ``correct_ids`` / ``incorrect_ids`` (the options;
    for the teachers' first tokens, from :func:`first_token_options`). Returns the study's per-question
    table (margins, drift with its interval, h_star with its interval, ``flip`` and ``first_flip`` at the
    measured horizons) and its per-horizon table.
    """
    check_horizons(horizons)
    return flip_horizon_study(teachers, items, horizons, n_samples, seed, max_rows=max_rows)


def summarise(positions, vetoes, experts, flips=None):
    """Counts over every prompt's tables (each with an ``id`` column): positions, where the targets would
    teach different tokens, the mean KL(A || l), vetoes by kind (distinct (prompt, token) pairs too),
    confident-expert positions and, given the flip table, prompts at risk."""
    out = dict(prompts=int(positions["id"].nunique()), responses=int(positions.groupby(["id", "response"]).ngroups),
               positions=len(positions), argmax_differs=int(positions.argmax_differs.sum()),
               kl_a_l_mean=float(positions.kl_a_l.mean()) if len(positions) else None,
               kl_a_l_max=float(positions.kl_a_l.max()) if len(positions) else None,
               tv_mean=float(positions.tv.mean()) if len(positions) else None,
               confident_expert_positions=len(experts))
    for kind in ("text", "end", "template"):
        v = vetoes[vetoes.kind == kind]
        out[f"{kind}_vetoes"] = len(v)
        out[f"{kind}_vetoed_tokens"] = sorted({str(text) if text else str(a) for a, text in zip(v.token, v.token_text)})
        out[f"{kind}_vetoes_prompts"] = int(v["id"].nunique())
    if flips is not None and len(flips):
        out.update(flip_prompts=len(flips), flips_measured=int(flips.flip.sum()),
                   finite_h_star=int(np.isfinite(flips.h_star).sum()),
                   h_star_min=float(flips.h_star.min()))
    return out
