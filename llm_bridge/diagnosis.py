"""A diagnosis of K teachers before training (theory section 1, 2, 6; claims T6, T7, T8): along responses to a
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
  token C and its rival I: the other teachers' first choice, else l's runner-up), the pooled margin m, the
  drift of ``D(H) = ln Z_H(uI) - ln Z_H(uC)`` with its interval, and the powered flip bound of
  :mod:`llm_bridge.horizon`: the measured first significant flip (:func:`~llm_bridge.horizon.first_significant_flip`:
  the smallest H whose 95% upper bound of ``m - D(H)`` is below 0, every teacher preferring C), or else the
  smallest drift the design detects at 80% power (:func:`~llm_bridge.horizon.detectable_drift`:
  ``min_H (m + (z_95 + z_80) se_H) / H``): "no flip detectable below drift d". Nothing is extrapolated
  beyond the measured horizons (no H* = m / drift).

    traces = follow(teachers, prompt_ids, max_tokens, rng)        # teachers' responses, every teacher's
                                                                  # conditionals along each (one batch)
    tables = diagnose_path(lp, weights, tokens, end_ids, template_ids, Thresholds())   # tidy DataFrames
    flip = flip_risk(teachers, items, horizons, n_samples, seed)
    said = exposure(predict_target(run), run.samples, positions, vetoes, experts, flip)  # a run's exposure

A run's **exposure** (:func:`exposure`): the target it reaches (:func:`llm_bridge.runs.predict_target`) decides
which findings bind. A keeps every token some teacher gives mass (the vetoes do not bind) and dilutes a
confident expert; l drives a vetoed token to l's near-zero mass and follows the expert; g is l re-weighted
by continuation partitions (the vetoes bind) and is the only target with T8's prefix bias; J lies between
A and l.
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
from .runs import describe
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
        """The thresholds as {field name: value}."""
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
    table without its linear extrapolation H* (margins, drift with its interval, ``flip`` and
    ``first_flip``: the measured first significant flip, -1 when none; ``detectable_drift`` and
    ``detectable_horizon``: the smallest drift detected at 80% power and where), with ``flip_bound``, the
    verdict in words (:func:`flip_bound`), and the study's per-horizon table.
    """
    check_horizons(horizons)
    q, h = flip_horizon_study(teachers, items, horizons, n_samples, seed, max_rows=max_rows)
    q = q.drop(columns=["h_star", "h_star_lo", "h_star_hi"])
    q["flip_bound"] = [flip_bound(r) for r in q.itertuples(index=False)]
    return q, h


def flip_bound(row):
    """One prompt's flip verdict from its study row (``margin``, ``teachers_prefer_correct``, ``first_flip``,
    ``detectable_drift``, ``detectable_horizon``, ``drift``): the measured first flip, or the powered bound
    "no flip detectable below drift d", or why no flip is defined (not every teacher prefers C)."""
    if not row.teachers_prefer_correct:
        return ("the pool prefers I at H = 0" if row.margin <= 0 else "not every teacher prefers C") + \
            ": no flip to measure"
    if row.first_flip >= 0:
        return f"first significant flip at H = {int(row.first_flip)}"
    if not np.isfinite(row.detectable_drift):
        return "no flip detectable: no horizon has a finite standard error"
    return (f"no flip detectable below drift {row.detectable_drift:.3g} nats/token (80% power, by H = "
            f"{int(row.detectable_horizon)}); measured drift {row.drift:.3g}")


def summarise(positions, vetoes, experts, flips=None):
    """Counts over every prompt's tables (each with an ``id`` column): positions, where the targets would
    teach different tokens, the mean KL(A || l), vetoes by kind (distinct (prompt, token) pairs too),
    confident-expert positions and, given the flip table (:func:`flip_risk`'s), the flips measured (the
    earliest), the prompts where no flip is defined and, over the rest, the range of the drift below which
    no flip is detectable."""
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
        bounded = flips[flips.teachers_prefer_correct & ~flips.flip]
        out.update(flip_prompts=len(flips), flips_measured=int(flips.flip.sum()),
                   first_flip_min=int(flips.first_flip[flips.flip].min()) if flips.flip.any() else None,
                   flip_undefined=int((~flips.teachers_prefer_correct).sum()), no_flip_bounded=len(bounded),
                   detectable_drift_min=float(bounded.detectable_drift.min()) if len(bounded) else None,
                   detectable_drift_max=float(bounded.detectable_drift.max()) if len(bounded) else None)
    return out


# ------------------------------------------------------------------------------------------------
# what a training run is exposed to
# ------------------------------------------------------------------------------------------------
TARGET_WORDS = {"A": "the token-level mixture: forward KL, T1",
                "l": "the local geometric pool: per-token reverse KL, T2",
                "J": "the generalised-JSD barycentre, between A and l",
                "g": "the sequence-level geometric pool's conditionals: reverse KL over whole responses, T8",
                "select": "one teacher's own conditionals", "none": "no divergence's minimiser",
                "diverges": "away from the teachers"}
SAMPLE_WORDS = {"student": "the student's rollouts", "teacher": "the teachers' samples",
                "dataset": "a data set's responses",
                "mixed:teacher": "the student's rollouts mixed with the teachers' samples",
                "mixed:dataset": "the student's rollouts mixed with a data set's responses"}


def _vetoed(vetoes, kind):
    """Distinct vetoed occurrences (prompt, response, position, token) of one kind, and their tokens' texts."""
    v = vetoes[vetoes.kind == kind].drop_duplicates(["id", "response", "position", "token"])
    texts = sorted({str(t) if isinstance(t, str) and t else str(a) for a, t in zip(v.token, v.token_text)})
    return len(v), texts


def _veto_list(vetoes):
    """'the 12 vetoed end tokens (<|im_end|>), 2 vetoed template tokens (...) and 3 other vetoed tokens (...)'."""
    parts = []
    for kind, words in (("end", "vetoed end token"), ("template", "vetoed template token"),
                        ("text", "other vetoed token")):
        n, texts = _vetoed(vetoes, kind)
        if n:
            shown = ", ".join(texts[:5]) + (", ..." if len(texts) > 5 else "")
            parts.append(f"{n} {words}{'s' * (n != 1)} ({shown})")
    return "the " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])


def exposure(prediction, samples, positions, vetoes, experts, flips=None, run=None):
    """Which of the diagnosed findings a run reaching ``prediction`` is exposed to, in sentences.

    Parameters
    ----------
    prediction : :class:`llm_bridge.runs.Prediction` (:func:`llm_bridge.runs.predict_target`); samples : the
        run's ``samples`` ('student', 'teacher', 'dataset', 'mixed:...'); positions, vetoes, experts, flips :
        the diagnosis tables over every prompt (``id`` and ``response`` columns; flips from :func:`flip_risk`
        or None); run : the run description, for its words (:func:`llm_bridge.runs.describe`).

    Returns
    -------
    dict of sentences: ``target`` (what the run reaches, on which samples), ``vetoes``, ``disagreement``,
    ``experts``, ``flip`` and ``notes`` (where the diagnosis and the run differ: weights, temperature,
    samples); empty where a finding does not apply.
    """
    t = prediction.target
    name = describe(run) if run is not None else "the run"
    out = dict(target=f"{name} on {SAMPLE_WORDS.get(samples, samples)} reaches {prediction.label} "
                      f"({TARGET_WORDS[t]})", vetoes="", disagreement="", experts="", flip="", notes="")
    if t in ("none", "diverges"):
        out["vetoes"] = ("it reaches no pool of the teachers: none of the findings is a target it reaches"
                         if t == "none" else "it moves the student away from the teachers, vetoes or not")
        return out
    if vetoes.empty:
        out["vetoes"] = "no veto was found"
    elif t == "A":
        out["vetoes"] = f"the vetoes do not bind: A keeps the mass the other teachers give {_veto_list(vetoes)}"
    elif t in ("l", "g"):
        low = float(vetoes.l_prob.max())
        them = "it" if len(vetoes.drop_duplicates(["id", "response", "position", "token"])) == 1 else "them"
        out["vetoes"] = (f"{_veto_list(vetoes)} will be driven to zero (l gives {them} at most {low:.2g}"
                         + (", and g re-weights l by continuation partitions)" if t == "g" else ")"))
    elif t == "J":
        out["vetoes"] = (f"the vetoes bind partly: J lies between l (at most {float(vetoes.l_prob.max()):.2g}) and A "
                         f"(at least {float(vetoes.a_prob.min()):.2g}) on {_veto_list(vetoes)}")
    else:
        out["vetoes"] = (f"the vetoes bind if the selected teacher is one that vetoes "
                         f"({', '.join(sorted(set(vetoes.teacher)))}): {_veto_list(vetoes)}")
    n = int(positions.argmax_differs.sum())
    follows = {"A": "A's token", "l": "l's token", "g": "l's token re-weighted by continuation partitions",
               "J": "a distribution between them", "select": "the selected teacher's token"}[t]
    out["disagreement"] = f"at the {n} positions where argmax A ≠ argmax l it teaches {follows}"
    m = len(experts)
    if t in ("A", "l", "g", "J"):
        out["experts"] = (f"at the {m} confident-expert positions " +
                          {"A": "it dilutes the expert (l would follow it)", "l": "it follows the expert (T6)",
                           "g": "it follows the expert (T6)", "J": "it follows the expert partly"}[t]) if m \
            else "no confident expert was found"
    if t == "g":
        if flips is None or not len(flips):
            out["flip"] = "exposed to the prefix bias (T8), which was not estimated (--no-flip)"
        else:
            measured = flips[flips.flip]
            out["flip"] = (f"exposed to the prefix bias (T8): {len(measured)} of {len(flips)} prompts flip at a "
                           f"measured horizon" + (f" (first at H = {int(measured.first_flip.min())})" if len(measured) else ""))
            bounded = flips[flips.teachers_prefer_correct & ~flips.flip]
            if len(bounded):
                lo, hi = (f"{x:.3g}" for x in (bounded.detectable_drift.min(), bounded.detectable_drift.max()))
                out["flip"] += (f"; {len(bounded)} show{'s' * (len(bounded) == 1)} no flip detectable below drift "
                                f"{lo if lo == hi else lo + ' to ' + hi} nats/token")
    else:
        out["flip"] = "a token-level target: the prefix flip (g's, T8) does not apply"
    notes = []
    if prediction.weights != "prior":
        notes.append(f"the run weighs the teachers per prefix ({prediction.weights} weights); the diagnosis pools "
                     "with the teachers file's weights")
    if prediction.temperature != 1.0:
        notes.append(f"the run pools the temperature-{prediction.temperature:g} conditionals; the diagnosis is at "
                     "temperature 1")
    sources = set(positions.response) if len(positions) else set()
    if samples.startswith("mixed") or samples == "student":
        if sources != {"student"}:
            notes.append("the run trains on the student's rollouts; the diagnosis followed other responses "
                         "(--student follows the student's)")
    out["notes"] = "; ".join(notes)
    return out


def exposure_text(said):
    """The sentences of :func:`exposure` as one paragraph."""
    body = "; ".join(said[k] for k in ("vetoes", "disagreement", "experts", "flip") if said[k])
    return f"{said['target']}: {body}." + (f" Note: {said['notes']}." if said["notes"] else "")
