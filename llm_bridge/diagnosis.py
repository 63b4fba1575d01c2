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

from aggregation.validate import check_horizons, check_int, check_weights, positive_teachers

from .horizon import flip_horizon_study, flip_horizon_study_backend
from .runs import describe


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
# following responses: the statistics the findings need at each position, computed on the fly
# ------------------------------------------------------------------------------------------------
STAT_FIELDS = ("token_lp", "entropy", "top", "top_lp", "top_a", "top_l",            # (K,) per position
               "a_token", "l_token", "kl", "tv", "argmax_a", "argmax_a_prob", "argmax_l", "argmax_l_prob",
               "cand", "cand_lp", "cand_a", "cand_l", "cand_ref")                  # (k,) / (K, k) candidates


def veto_candidates(thresholds):
    """How many of the reference's most probable tokens can be vetoed: at most floor(1 / veto_floor) tokens
    have probability >= veto_floor (they sum to <= 1), one more for rounding."""
    return int(math.floor(1.0 / thresholds.veto_floor + 1e-9)) + 1


@torch.no_grad()
def position_stats(log_probs, weights, tokens, reference=None, k=21):
    """What the findings need at a block of positions, from every teacher's next-token log-probabilities.

    Parameters
    ----------
    log_probs : (K, b, n) tensor (float32 or float64): teacher k's ln p_k(. | context) at b positions.
    weights : (K,) on the simplex; tokens : (b,) the response's tokens there.
    reference : optional (b, n) log-probs of a student (the veto reference instead of A).
    k : how many of the reference's top tokens are kept as veto candidates (:func:`veto_candidates`).

    Returns
    -------
    dict of NumPy arrays with leading axis b (:data:`STAT_FIELDS`): per teacher the token's log-prob, the
    entropy, the top token, its log-prob, A's and l's probability of it; A's and l's probability of the
    token, KL(A || l), TV and both argmaxes with their probabilities (the pools in float64); the reference's
    top-k tokens ``cand`` with every teacher's log-prob of them (float32, as the models give them), A's,
    l's and the reference's probability. Memory O(b x n) while computing, O(b x (K + k)) kept.
    """
    lp = log_probs.double()
    K, b, n = lp.shape
    w = torch.as_tensor(np.asarray(weights, dtype=float), dtype=torch.float64, device=lp.device)
    keep = torch.as_tensor(positive_teachers(np.asarray(weights, dtype=float)), device=lp.device)
    wk, lk = w[keep], lp[keep]
    log_a = torch.logsumexp(torch.log(wk)[:, None, None] + lk, dim=0)                  # (b, n)
    r = (wk[:, None, None] * lk).sum(0)
    log_l = r - torch.logsumexp(r, dim=1, keepdim=True)
    A, Lp = log_a.exp(), log_l.exp()
    kl = torch.where(A > 0, A * (log_a - log_l), torch.zeros_like(A)).sum(1)
    tv = 0.5 * (A - Lp).abs().sum(1)
    P = lp.exp()
    entropy = -torch.where(P > 0, P * lp, torch.zeros_like(P)).sum(2)                  # (K, b)
    top_lp, top = lp.max(dim=2)
    idx = torch.arange(b, device=lp.device)
    tok = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=lp.device)
    ref = A if reference is None else reference.double().exp()
    cand_ref, cand = torch.topk(ref, min(k, n), dim=1)
    arg_a, arg_l = A.argmax(1), Lp.argmax(1)
    out = dict(token_lp=log_probs[:, idx, tok].T, entropy=entropy.T, top=top.T, top_lp=top_lp.T,
               top_a=A[idx[None], top].T, top_l=Lp[idx[None], top].T, a_token=A[idx, tok], l_token=Lp[idx, tok],
               kl=kl, tv=tv, argmax_a=arg_a, argmax_a_prob=A[idx, arg_a], argmax_l=arg_l, argmax_l_prob=Lp[idx, arg_l],
               cand=cand, cand_lp=log_probs.gather(2, cand[None].expand(K, -1, -1)).permute(1, 0, 2),
               cand_a=A.gather(1, cand), cand_l=Lp.gather(1, cand), cand_ref=cand_ref)
    return {key: v.cpu().numpy() for key, v in out.items()}


def stack_stats(parts):
    """Concatenate :func:`position_stats` blocks along positions (an empty list: zero positions)."""
    return {key: np.concatenate([p[key] for p in parts]) for key in STAT_FIELDS} if parts else None


@dataclass
class Trace:
    """One response to a prompt: its ``source`` (a teacher's name, ``"student"`` or ``"given<i>"``), its
    ``tokens`` (T,), ``stats`` (:func:`position_stats` along it, leading axis T) and ``first`` (K, n):
    every teacher's float32 log-probabilities of the first token (the only full distributions kept)."""
    source: str
    tokens: list
    stats: dict
    first: np.ndarray


def follow(teachers, prompt_ids, max_tokens, rng, responses=None, student=None, thresholds=None):
    """The responses to one prompt and what the findings need along them (:func:`follow_many` of one)."""
    return follow_many(teachers, [prompt_ids], max_tokens, [rng], [responses], student, thresholds)[0]


def follow_many(teachers, prompts, max_tokens, rngs, responses=None, student=None, thresholds=None, block=32):
    """The responses to several prompts, and the statistics of every position along them.

    Parameters
    ----------
    teachers : llm_bridge.Teachers; prompts : list of non-empty token-id lists (the templates go before).
    max_tokens : int >= 1, the length of a sampled response (it stops after an end token).
    rngs : one numpy Generator per prompt (sampling by inverse CDF, :func:`llm_bridge.partition._sample`):
        a prompt's draws do not depend on the other prompts of the batch.
    responses : optional, per prompt None or a list of token-id lists: score these instead of sampling.
    student : optional :class:`llm_bridge.Teacher` (sharing the vocabulary): a prompt without responses
        follows one rollout of the student, and the student is the veto reference.
    thresholds : :class:`Thresholds` (its veto floor sets how many candidates are kept).
    block : positions whose full distributions are held at once (every teacher's, in float64 while pooled).

    Returns
    -------
    per prompt, a list of :class:`Trace`: the given responses, else the student's rollout, else one
    response sampled from each positive-weight teacher (at its temperature). The responses are generated in
    one batch (:meth:`llm_bridge.backend.InProcess.generate`), then scored by every teacher (and the
    student) in one parallel pass (:meth:`~llm_bridge.backend.InProcess.distributions`), a block of
    positions at a time: memory O(length x (K + k)), not O(length x vocabulary).
    """
    from .backend import InProcess
    th = Thresholds() if thresholds is None else thresholds
    prompts = [teachers.check_ids(p, f"prompts[{i}]", allow_empty=False, input_ids=True) for i, p in enumerate(prompts)]
    if not prompts:
        raise ValueError("prompts is empty")
    if len(rngs) != len(prompts):
        raise ValueError(f"rngs has {len(rngs)} entries for {len(prompts)} prompts")
    max_tokens = check_int(max_tokens, "max_tokens", 1)
    responses = [None] * len(prompts) if responses is None else list(responses)
    if len(responses) != len(prompts):
        raise ValueError(f"responses has {len(responses)} entries for {len(prompts)} prompts")
    backend = InProcess(teachers, [student] if student is not None else [])
    K = teachers.K
    samplers = [K] if student is not None else [int(k) for k in positive_teachers(teachers.weights)]
    rows = response_rows(backend, prompts, responses, samplers, list(teachers.names) + ["student"], max_tokens, rngs,
                         lambda r, what: teachers.check_ids(r, what, allow_empty=False))
    ref = K if student is not None else None
    parts = [[] for _ in rows]
    first = [None] * len(rows)
    for r, t, lp in backend.distributions([(prompts[p], tok) for p, _, tok in rows], block=block):
        tokens = [rows[i][2][s] for i, s in zip(r, t)]
        stats = position_stats(lp[:K], teachers.weights, tokens, None if ref is None else lp[ref],
                               veto_candidates(th))
        for i in np.unique(r):
            sel = r == i
            parts[i].append({key: v[sel] for key, v in stats.items()})
            if first[i] is None and t[sel][0] == 0:
                first[i] = lp[:K, np.flatnonzero(sel)[0]].cpu().numpy()
    out = [[] for _ in prompts]
    for i, (p, source, tokens) in enumerate(rows):
        out[p].append(Trace(source, list(tokens), stack_stats(parts[i]), first[i]))
    return out


def response_rows(backend, prompts, responses, samplers, names, max_tokens, rngs, check=None):
    """The responses a diagnosis follows, as rows (prompt index, source, token ids): a prompt's given
    responses (``given<i>``, each checked by ``check(ids, what)`` when given; an empty list is an error), else
    one response sampled by ``backend.generate`` from each model j of ``samplers`` (source ``names[j]``), every
    prompt's in one call, each drawing from its prompt's generator."""
    rows, gen = [], []                      # gen: (row, model, prompt)
    for p, given in enumerate(responses):
        if given is not None:
            given = [check(r, f"responses[{i}]") if check else list(r) for i, r in enumerate(given)]
            if not given:
                raise ValueError("responses is empty")
            rows += [(p, f"given{i}", r) for i, r in enumerate(given)]
            continue
        for j in samplers:
            gen.append((len(rows), j, p))
            rows.append((p, names[j], None))
    if gen:
        drawn = backend.generate([(j, prompts[p]) for _, j, p in gen], max_tokens, [rngs[p] for _, _, p in gen])
        for (i, _, _), tokens in zip(gen, drawn):
            rows[i] = rows[i][:2] + (tokens,)
    return rows


# ------------------------------------------------------------------------------------------------
# the diagnosis along one response (pure: arrays in, tidy DataFrames out)
# ------------------------------------------------------------------------------------------------
def diagnose_path(log_probs, weights, tokens, end_token_ids=(), template_token_ids=(), thresholds=None,
                  reference=None, names=None, decode=None):
    """Disagreement, vetoes and confident experts along one response (see the module docstring), from
    every teacher's full conditionals: :func:`position_stats` then :func:`diagnose_stats`.

    Parameters
    ----------
    log_probs : (K, T, n) every teacher's conditionals along the response; weights : (K,) on the simplex.
    tokens : (T,) the response's token ids (the ``token`` columns).
    reference : optional (T, n) log-probs of a student: the veto reference instead of A.
    end_token_ids, template_token_ids, thresholds, names, decode : as :func:`diagnose_stats` takes them.

    Returns
    -------
    :func:`diagnose_stats`'s tables.
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
    if reference is not None:
        reference = np.asarray(reference, dtype=float)
        if reference.shape != (T, n):
            raise ValueError(f"reference must be (T, n) = {(T, n)}, got {reference.shape}")
        reference = torch.from_numpy(reference)
    stats = position_stats(torch.from_numpy(lp), w, tokens, reference, veto_candidates(th)) if T else None
    return diagnose_stats(stats, w, tokens, end_token_ids, template_token_ids, th, names, decode)


def diagnose_stats(stats, weights, tokens, end_token_ids=(), template_token_ids=(), thresholds=None, names=None,
                   decode=None):
    """The diagnosis's tables along one response from its :func:`position_stats` (None: no position).

    Parameters
    ----------
    stats : dict of arrays with leading axis T (:func:`position_stats`); weights : (K,) on the simplex.
    tokens : (T,) the response's token ids (the ``token`` columns).
    end_token_ids, template_token_ids : the ids reported as kind ``end`` and ``template`` (an id in both
        is ``end``).
    thresholds : :class:`Thresholds` (default the stated defaults).
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
    w = np.asarray(weights, dtype=float)
    K = len(w)
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    if stats is None:
        stats = {key: np.zeros((0,) + ((K,) if key in STAT_FIELDS[:6] else (K, 0) if key == "cand_lp" else
                                       (0,) if key.startswith("cand") else ())) for key in STAT_FIELDS}
    names = [f"teacher{k}" for k in range(K)] if names is None else list(names)
    if len(names) != K:
        raise ValueError(f"names has {len(names)} entries for {K} teachers")
    decode = decode or (lambda a: "")
    ends, template = set(int(e) for e in end_token_ids), set(int(e) for e in template_token_ids)

    def kind(a):
        return "end" if a in ends else "template" if a in template else "text"

    s = stats
    keep = positive_teachers(w)
    v_rows = []
    for k in keep:                         # rows ordered by teacher, position, token (as np.nonzero over (K', T, n))
        hit = (s["cand_lp"][:, k] < th.veto_log_prob) & (s["cand_ref"] >= th.veto_floor)    # (T, k)
        found = sorted((int(t), int(s["cand"][t, c]), c) for t, c in zip(*np.nonzero(hit)))
        for t, a, c in found:
            v_rows.append(dict(position=t, teacher=names[k], token=a, token_text=decode(a), kind=kind(a),
                               teacher_log_prob=float(s["cand_lp"][t, k, c]), a_prob=float(s["cand_a"][t, c]),
                               l_prob=float(s["cand_l"][t, c]), reference_prob=float(s["cand_ref"][t, c]),
                               is_response_token=bool(tokens[t] == a)))
    vetoes = pd.DataFrame(v_rows, columns=["position", "teacher", "token", "token_text", "kind", "teacher_log_prob",
                                           "a_prob", "l_prob", "reference_prob", "is_response_token"])
    e_rows, expert_at = [], [""] * T
    entropy = s["entropy"]
    entropy_hi = s.get("entropy_hi", entropy)      # served: decided on the bounds (the expert's upper, the others' lower)
    for t in range(T):
        for k in keep:
            others = [int(i) for i in keep if i != k]
            if not others or entropy_hi[t, k] > th.expert_entropy:
                continue
            low = min(entropy[t, i] for i in others)
            top = int(s["top"][t, k])
            if low >= th.uninformative_entropy and s["top_l"][t, k] - s["top_a"][t, k] >= th.expert_gap:
                expert_at[t] = names[k]
                e_rows.append(dict(position=t, expert=names[k], expert_entropy=float(entropy[t, k]),
                                   others_min_entropy=float(low), token=top, token_text=decode(top),
                                   expert_prob=float(np.exp(s["top_lp"][t, k])), a_prob=float(s["top_a"][t, k]),
                                   l_prob=float(s["top_l"][t, k])))
    experts = pd.DataFrame(e_rows, columns=["position", "expert", "expert_entropy", "others_min_entropy", "token",
                                            "token_text", "expert_prob", "a_prob", "l_prob"])
    arg_a, arg_l = s["argmax_a"].astype(np.int64), s["argmax_l"].astype(np.int64)
    idx = np.arange(T)
    count = (lambda what: np.bincount(vetoes.position[vetoes.kind == what], minlength=T) if len(vetoes)
             else np.zeros(T, int))
    positions = pd.DataFrame(dict(
        position=idx, token=tokens, token_text=[decode(int(a)) for a in tokens], token_kind=[kind(int(a)) for a in tokens],
        a_prob=s["a_token"], l_prob=s["l_token"], kl_a_l=s["kl"], tv=s["tv"], argmax_a=arg_a,
        argmax_a_text=[decode(int(a)) for a in arg_a], argmax_a_prob=s["argmax_a_prob"], argmax_l=arg_l,
        argmax_l_text=[decode(int(a)) for a in arg_l], argmax_l_prob=s["argmax_l_prob"], argmax_differs=arg_a != arg_l,
        vetoes=count("text") + count("end") + count("template"), end_vetoes=count("end"),
        template_vetoes=count("template"), expert=expert_at))
    if "kl_hi" in s:                                # bounds from the servers' top k (llm_bridge.topk_bounds)
        positions = positions.assign(kl_a_l_hi=s["kl_hi"], tv_hi=s["tv_hi"], l_factor=s["l_factor"],
                                     argmax_certain=s["argmax_certain"])
    teachers = pd.DataFrame(dict(
        position=np.tile(idx, K), teacher=np.repeat(names, T), weight=np.repeat(w, T), entropy=entropy.T.ravel(),
        token_log_prob=s["token_lp"].T.astype(float).ravel(), top_token=s["top"].T.astype(np.int64).ravel(),
        top_prob=np.exp(s["top_lp"].T.astype(float)).ravel()))
    if "entropy_hi" in s:
        teachers.insert(teachers.columns.get_loc("entropy") + 1, "entropy_hi", s["entropy_hi"].T.ravel())
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


def flip_risk(teachers, items, horizons, n_samples, seed, max_rows=64, weights=None):
    """Prefix flip risk of each prompt from :func:`llm_bridge.horizon.flip_horizon_study` (``teachers``: an
    llm_bridge.Teachers) or, for a backend with its pool ``weights`` (teachers on a server),
    :func:`llm_bridge.horizon.flip_horizon_study_backend` (ln Z_H from the teachers' own samples).

    items : list of dicts with ``id``, ``prompt_ids`` and ``correct_ids`` / ``incorrect_ids`` (the options;
    for the teachers' first tokens, from :func:`first_token_options`). Returns the study's per-question
    table without its linear extrapolation H* (margins, drift with its interval, ``flip`` and
    ``first_flip``: the measured first significant flip, -1 when none; ``detectable_drift`` and
    ``detectable_horizon``: the smallest drift detected at 80% power and where), with ``flip_bound``, the
    verdict in words (:func:`flip_bound`), and the study's per-horizon table. ``seed``: one, or one per item
    (each item's draws then do not depend on the others); ``max_rows``: sequences sampled at once (each a
    KV cache of the prompt, the option and H tokens).
    """
    check_horizons(horizons)
    if weights is None:
        q, h = flip_horizon_study(teachers, items, horizons, n_samples, seed, max_rows=max_rows)
    else:
        q, h = flip_horizon_study_backend(teachers, weights, items, horizons, n_samples, seed, max_rows=max_rows)
    q = q.drop(columns=["h_star", "h_star_lo", "h_star_hi"])
    q["flip_bound"] = [flip_bound(r) for r in q.itertuples(index=False)]
    # numbers that do not apply are blank: no first flip where none was measured, no powered bound where a flip
    # was measured or none is defined (not every teacher prefers C)
    q["first_flip"] = q.first_flip.where(q.flip).astype(float)
    bounded = q.teachers_prefer_correct & ~q.flip
    q["detectable_drift"] = q.detectable_drift.where(bounded).astype(float)
    q["detectable_horizon"] = q.detectable_horizon.where(bounded).astype(float)
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
# advice: a verdict per finding, the rule that decides it, and what to do
# ------------------------------------------------------------------------------------------------
DISAGREEMENT_KL = 0.01
"""Mean KL(A || l) (nats per position) at or above which the FKL and RKL targets differ materially. It sits
between the two shipped examples (docs/diagnose.md): two concise personas (the control pair, well below it)
and a concise persona with a storyteller (the end-veto pair, above it)."""


def _show(token):
    """A token's text with its whitespace visible: a space as ␣, a newline as ⏎, a tab as ⇥."""
    return str(token).replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥") if token != "" else "(empty)"


def _where(rows, n=4):
    """'prompt sky position 5, prompt cow positions 3, 9' for the first ``n`` (id, position) pairs."""
    by = {}
    for pid, pos in rows:
        by.setdefault(str(pid), []).append(int(pos))
    parts = [f"prompt {pid} position{'s' * (len(p) > 1)} {', '.join(map(str, sorted(set(p))))}"
             for pid, p in list(by.items())[:n]]
    return "; ".join(parts) + ("; ..." if len(by) > n else "")


def advise(positions, vetoes, experts, flips=None, thresholds=None, prediction=None, samples=None, no_flip="--no-flip"):
    """Each finding's verdict in words, the rule that decides it (threshold and where it comes from) and an
    action; the first lines of every report. With bounded positions (``kl_a_l_hi``: teachers served,
    :mod:`llm_bridge.topk_bounds`) the disagreement is decided on the bounds of the mean KL, or said to be
    undecided.

    Parameters
    ----------
    positions, vetoes, experts : the diagnosis tables over every prompt (``id`` and ``response`` columns);
    flips : :func:`flip_risk`'s table or None (not estimated); thresholds : :class:`Thresholds`;
    prediction : optional :class:`llm_bridge.runs.Prediction` of the user's run (its ``target``, ``label``).
    no_flip : why the flip was not estimated, when ``flips`` is None.

    Returns
    -------
    dict: ``todo`` (the short list of what to do, most important first) and ``findings``: one dict per
    finding (``finding``, ``applies``, ``verdict``, ``rule``, ``action``); a finding that does not apply has
    a one-line verdict saying why and empty rule and action.
    """
    th = Thresholds() if thresholds is None else thresholds
    target = prediction.target if prediction is not None else None
    findings, todo = [], []
    n = len(positions)
    kl = float(positions.kl_a_l.mean()) if n else 0.0
    differ = int(positions.argmax_differs.sum()) if n else 0
    rule = (f"mean KL(A || l) >= {DISAGREEMENT_KL:g} nats per position: the FKL target A and the RKL target l "
            "differ materially (the threshold sits between the shipped control pair, two concise personas, and "
            "the shipped end-veto pair, concise vs storyteller)")
    bounded = bool(n) and "kl_a_l_hi" in positions
    kl_hi = float(positions.kl_a_l_hi.mean()) if bounded else kl
    said = f"mean KL(A || l) {'is at least' if bounded else '='} {kl:.3g} nats"
    if kl >= DISAGREEMENT_KL:
        verdict = (f"FKL and RKL teach different targets here: {said} >= {DISAGREEMENT_KL:g}; they would teach "
                   f"different tokens at {differ} of {n} positions")
        action = ("choose the loss deliberately: forward KL (A) keeps every teacher's tokens (mass-covering), "
                  "reverse KL (l) keeps only what all teachers allow (their consensus)")
        todo.append(f"Choose FKL or RKL deliberately: the targets differ (mean KL(A || l) {'at least ' * bounded}"
                    f"{kl:.3g} >= {DISAGREEMENT_KL:g} nats; different tokens at {differ} of {n} positions).")
    elif kl_hi < DISAGREEMENT_KL:
        verdict = (f"FKL and RKL teach nearly the same target: mean KL(A || l) = {kl:.3g} nats < {DISAGREEMENT_KL:g}; "
                   f"different tokens at {differ} of {n} positions")
        action = "either loss is fine here"
    else:
        verdict = (f"undecided from the servers' top k: mean KL(A || l) is at least {kl:.3g} nats, below "
                   f"{DISAGREEMENT_KL:g}, and the teachers' tails outside their top k leave no finite upper bound; "
                   f"different tokens at {differ} of {n} positions")
        action = "run the diagnosis in process on a sample of these prompts to decide, or raise --top-k"
    findings.append(dict(finding="disagreement of the targets", applies=True, verdict=verdict, rule=rule,
                         action=action))
    veto_rule = (f"a positive-weight teacher gives the token ln p < {th.veto_log_prob:.3g} (p < "
                 f"{math.exp(th.veto_log_prob):.2g}) where the reference gives it at least {th.veto_floor:g} "
                 "(--veto-log-prob, --veto-floor; defaults: a teacher allowing it at most once in 10,000 "
                 "against a reference giving it at least once in 20)")
    for kind, what in (("end", "end token"), ("template", "chat-template token"), ("text", "token")):
        v = vetoes[vetoes.kind == kind] if len(vetoes) else vetoes
        title = {"end": "end-token vetoes", "template": "template-token vetoes", "text": "other vetoes"}[kind]
        if v.empty:
            findings.append(dict(finding=title, applies=True, rule=veto_rule, action="nothing to do",
                                 verdict=f"no teacher vetoes {'an' if kind == 'end' else 'a'} {what} the reference "
                                         "gives mass"))
            continue
        parts = []
        for (teacher, token), g in v.groupby(["teacher", "token_text"], sort=False):
            occ = g.drop_duplicates(["id", "response", "position"])
            parts.append(f"{teacher} vetoes {_show(token)} at {len(occ)} position{'s' * (len(occ) != 1)} "
                         f"({_where(zip(occ['id'], occ.position))}; l gives it at most {occ.l_prob.max():.2g}, "
                         f"A at least {occ.a_prob.min():.2g})")
        teachers = sorted(set(v.teacher))
        tokens = ", ".join(sorted({_show(t) for t in v.token_text}))
        effect = {"end": "a reverse-KL student learns not to stop", "template": "a reverse-KL student learns to "
                  "avoid the chat template's token (a template mismatch between teachers)",
                  "text": "reverse KL suppresses it"}[kind]
        if target in ("A", "mix"):
            verdict = "; ".join(parts) + f": your run's target {prediction.label} keeps it, so this does not bind"
            action = "nothing to do for this run (it would bind under reverse KL)"
        else:
            verdict = "; ".join(parts) + f": {effect}"
            action = (f"mask {tokens} in the reverse-KL loss, or lower the weight of {', '.join(teachers)}, "
                      "or use forward KL (A keeps it)")
            todo.append(f"{'Mask' if kind != 'text' else 'Check'} {tokens} under reverse KL: "
                        f"{', '.join(teachers)} veto{'es' * (len(teachers) == 1)} it ({what}); or lower "
                        f"{'its' if len(teachers) == 1 else 'their'} weight, or use FKL.")
        findings.append(dict(finding=title, applies=True, verdict=verdict, rule=veto_rule, action=action))
    e_rule = (f"one teacher's entropy <= {th.expert_entropy:g} nats, every other's >= {th.uninformative_entropy:g}, "
              f"and l(a*) - A(a*) >= {th.expert_gap:g} for its top token a* (--expert-entropy, "
              "--uninformative-entropy, --expert-gap)")
    if experts.empty:
        findings.append(dict(finding="confident experts", applies=True, rule=e_rule, action="nothing to do",
                             verdict="no position where one teacher is sure and the others are not"))
    else:
        parts = [f"{name} at {len(g)} position{'s' * (len(g) != 1)} ({_where(zip(g['id'], g.position))})"
                 for name, g in experts.groupby("expert", sort=False)]
        findings.append(dict(finding="confident experts", applies=True, rule=e_rule,
                             verdict="a confident expert where the others are uninformative: " + "; ".join(parts)
                                     + ": reverse KL (l) follows the expert, forward KL (A) dilutes it",
                             action="reverse KL if you trust the expert there, forward KL to hedge"))
    flip_title = "prefix flip (sequence-level reverse KL)"
    if target is not None and target not in ("g", "computed"):
        findings.append(dict(finding=flip_title, applies=False, rule="", action="",
                             verdict=f"does not apply: your run reaches {prediction.label}, a token-level target "
                                     "(only the sequence-level geometric pool g has the prefix bias)"))
    elif flips is None or not len(flips):
        findings.append(dict(finding=flip_title, applies=False, rule="", action="",
                             verdict=f"not estimated ({no_flip})"))
    else:
        f_rule = ("a flip is measured at H when the 95% upper bound of g's margin m - D(H) is below 0 and every "
                  "teacher prefers C; otherwise the smallest drift of D(H) the design detects at 80% power bounds "
                  "what is not seen (llm_bridge.horizon)")
        measured = flips[flips.flip]
        undefined = flips[~flips.teachers_prefer_correct]
        bounded = flips[flips.teachers_prefer_correct & ~flips.flip]
        words = []
        if len(measured):
            words.append(f"g prefers the incorrect option after H = {int(measured.first_flip.min())} tokens on "
                         f"{len(measured)} of {len(flips)} prompts ({', '.join(map(str, measured['id']))})")
        if len(bounded):
            lo, hi = bounded.detectable_drift.min(), bounded.detectable_drift.max()
            words.append(f"{len(bounded)} prompt{'s' * (len(bounded) != 1)} show no flip detectable below a drift of "
                         + (f"{lo:.3g}" if lo == hi else f"{lo:.3g} to {hi:.3g}") + " nats/token")
        if len(undefined):
            words.append(f"{len(undefined)} without a flip to measure (not every teacher prefers C)")
        first = flips[flips.option_source == "first tokens"] if "option_source" in flips else flips.iloc[:0]
        if len(first):
            count = {}
            for c, i in zip(first.option_c, first.option_i):
                count[f"{_show(c)} vs {_show(i)}"] = count.get(f"{_show(c)} vs {_show(i)}", 0) + 1
            pairs = ", ".join(p + (f" on {n}" if n > 1 else "") for p, n in count.items())
            words.append(f"caution: {len(first)} prompt{'s' * (len(first) != 1)} without options compare the pool's "
                         f"two preferred first tokens ({pairs}), a matter of style, not of a correct answer")
        applies = "" if target == "g" else " (it matters only to sequence-level reverse KL, g)"
        action = ("avoid sequence-level reverse KL on these prompts, or use a token-level loss" if len(measured)
                  else "nothing to do" + applies)
        if len(first):
            action += "; give the prompts file options [C, I] to measure the flip between real answers"
        if len(measured) and target in (None, "g"):
            todo.append(f"Avoid sequence-level RKL on {', '.join(map(str, measured['id']))}: g flips to the "
                        f"incorrect option by H = {int(measured.first_flip.min())}.")
        findings.append(dict(finding=flip_title, applies=True, verdict="; ".join(words) + applies, rule=f_rule,
                             action=action))
    if not todo:
        todo.append("Either loss is fine for these teachers and prompts: the targets barely differ (mean KL(A || l) "
                    f"{kl:.3g} < {DISAGREEMENT_KL:g} nats), no teacher vetoes a token the reference wants, and no "
                    "confident expert dominates.")
    return dict(todo=todo, findings=findings)


# ------------------------------------------------------------------------------------------------
# what a training run is exposed to
# ------------------------------------------------------------------------------------------------
TARGET_WORDS = {"A": "the token-level mixture: forward KL, T1",
                "l": "the local geometric pool: per-token reverse KL, T2",
                "J": "the generalised-JSD barycentre, between A and l",
                "g": "the sequence-level geometric pool's conditionals: reverse KL over whole responses, T8",
                "select": "one teacher's own conditionals", "none": "no divergence's minimiser",
                "diverges": "away from the teachers",
                "mix": "a mixture of the data's conditionals and A: a data term beside forward KL",
                "data": "the data's own conditionals: the cross-entropy alone",
                "computed": "no closed form: where it goes is computed on the teachers' own tree below"}
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
    if t in ("none", "diverges", "data"):
        out["vetoes"] = {"none": "it reaches no pool of the teachers: none of the findings is a target it reaches",
                         "diverges": "it moves the student away from the teachers, vetoes or not",
                         "data": "it follows the data, not the teachers: none of the findings binds"}[t]
        return out
    if t == "computed":
        out["vetoes"] = ("no closed form says whether the vetoes bind: see where it goes on the teachers' own tree"
                         + (f" ({_veto_list(vetoes)} vetoed)" if not vetoes.empty else ""))
        out["flip"] = "whether the prefix flip (g's, T8) applies depends on how far it goes towards g (below)"
        return out
    if vetoes.empty:
        out["vetoes"] = "no veto was found"
    elif t in ("A", "mix"):
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
               "J": "a distribution between them", "select": "the selected teacher's token",
               "mix": "A's token mixed with the data's"}[t]
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
