"""The diagnosis's statistics from each teacher's top-k, with bounds that hold (issue 43).

A server returns, at each position, every teacher's k most likely tokens with their log-probabilities and
the log-probability of the token the response holds, not the full distribution (all n of them come back
one request per position, ~40x slower than in process on a CPU server). What that leaves unknown is each
teacher's *tail*: the tokens outside its top k, whose total mass tau_k = 1 - (the known mass) is exact and
each of which has p_k(a) <= u_k = min(p_k(k-th), tau_k).

Let S be the tokens whose log-probability is known under every positive-weight teacher (listed by all, the
response's token, or scored exactly on request) and R the rest. On S, A(a) = sum_k w_k p_k(a) and
g(a) = prod_k p_k(a)^w_k are exact; A(R) = 1 - A(S) is exact; and l = g / Z with Z = Z_S + Z_R, where
0 <= Z_R <= H = prod_k (1 - P_k(S))^w_k by Hoelder's inequality (the weights sum to 1; each factor at least
|S| 2^-20, the float32 rounding of the known mass). So:

    l(a), a in S        in [g(a) / (Z_S + H), g(a) / Z_S]: the lower end is reported, ``l_factor`` =
                        (Z_S + H) / Z_S the upper end over it (one factor per position)
    KL(A || l)          >= the KL of the coarse partition S + {R}, minimised over Z_R in [0, H] (data
                        processing; the minimiser is Z_R = A(R) Z_S / (1 - A(R)), clipped): ``kl``; no
                        finite upper bound unless A(R) = 0 (a tail token of one teacher may be ~0 under
                        another), so ``kl_hi`` is inf then
    TV(A, l)            in [sum of each term's least value, sum of its largest + (A(R) + H / (Z_S + H)) / 2]
    entropy H(p_k)      in [known part + tau_k ln(1 / u_k), known part + tau_k ln((n - known) / tau_k)]
    argmax of A, of l   over S, certain when no token outside S can beat it (``argmax_certain``)

Vetoes are exact: a token outside every teacher's top k has A(a) <= 1 / k < veto floor when
k >= :func:`llm_bridge.diagnosis.veto_candidates`, so every candidate is listed by some teacher, and a
candidate whose A may reach the floor is scored exactly under the teachers that do not list it
(:func:`rescore_needs`). So is the expert finding's top token.
"""

import math

import numpy as np

from aggregation.validate import check_int, positive_teachers

from .diagnosis import STAT_FIELDS, Thresholds, Trace, response_rows, veto_candidates

BOUND_FIELDS = ("kl_hi", "tv_hi", "entropy_hi", "l_factor", "argmax_certain")
# a float32 log-probability moves its probability by at most ~2^-20 (|ln p| <= 16; below, p < 1e-7 itself), so
# a teacher whose known mass rounds to 1 may still hold up to |S| 2^-20 outside S: H's factor never goes below
# that (at 0, a tempered teacher's whole mass in its top k made l(R) = 0 and KL's lower bound infinite, although
# another teacher put mass there and the true KL is finite)
ROUNDING = 2.0 ** -20


def _position(ids, lps, token, token_lp, extra, n):
    """Known log-probabilities at one position, ``known`` {token: (K,) array, nan where unknown} and ``table``
    (its rows stacked), and per teacher the tail mass tau, each unknown token's bound u and the entropy's
    bounds (the known part plus the tail's least and largest)."""
    K = len(ids)
    known = {}
    for k in range(K):
        for a, lp in zip(ids[k], lps[k]):
            known.setdefault(int(a), np.full(K, np.nan))[k] = lp
    row = known.setdefault(int(token), np.full(K, np.nan))
    row[:] = np.where(np.isnan(row), token_lp, row)
    for (k, a), lp in extra.items():
        known.setdefault(int(a), np.full(K, np.nan))[k] = lp
    table = np.array(list(known.values()))                                      # (m, K)
    p = np.exp(table)
    tau = np.maximum(1.0 - np.nansum(p, axis=0), 0.0)          # >= 0 where the listed sum rounds above 1
    u = np.minimum(np.exp(lps[:, -1]), tau)
    part = -np.nansum(np.where(p > 0, p * table, 0.0), axis=0)
    free = np.maximum(n - (~np.isnan(table)).sum(0), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent_lo = part + np.where(tau > 0, -tau * np.log(np.where(u > 0, u, 1.0)), 0.0)
        ent_hi = part + np.where(tau > 0, tau * np.log(free / np.where(tau > 0, tau, 1.0)), 0.0)
    return known, table, tau, u, ent_lo, ent_hi


def topk_stats(ids, lps, tokens, token_lps, weights, n, extra=None, k_cand=21, reference=None):
    """:func:`llm_bridge.diagnosis.position_stats`'s fields along one response, from each teacher's top k.

    Parameters
    ----------
    ids, lps : (K, T, k) each teacher's top-k token ids and log-probabilities at each position, most likely
        first; tokens : (T,) the response; token_lps : (K, T) each teacher's log-probability of it.
    weights : (K,) on the simplex; n : the vocabulary size.
    extra : optional {(t, k, a): ln p_k(a)} scored exactly (:func:`rescore_needs`).
    k_cand : veto candidates kept per position (A's most probable tokens of S).
    reference : optional, per position (tokens, log-probs) of a student's tokens that can be vetoed (its
        probability at least the veto floor; :func:`student_candidates`): the veto reference instead of A,
        each token scored exactly under every positive-weight teacher (``extra``: :func:`rescore_needs`).

    Returns
    -------
    dict of arrays with leading axis T: :data:`~llm_bridge.diagnosis.STAT_FIELDS` with the bounds' reading
    (``kl``, ``tv``, ``entropy``, l's probabilities: lower bounds, but ``cand_l``, the candidates' (vetoes'),
    an upper bound, so that "l gives it at most" holds; NaN where a value is not known) and
    :data:`BOUND_FIELDS`: ``kl_hi``, ``tv_hi``, ``entropy_hi`` (T, K), ``l_factor`` and ``argmax_certain``.
    """
    ids, lps = np.asarray(ids, dtype=np.int64), np.asarray(lps, dtype=float)
    token_lps = np.asarray(token_lps, dtype=float)
    K, T, _ = ids.shape
    w = np.asarray(weights, dtype=float)
    keep = positive_teachers(w)
    wk = w[keep]
    extra = extra or {}
    rows = []
    for t in range(T):
        here = {(k, a): v for (s, k, a), v in extra.items() if s == t}
        known, table, tau, u, ent_lo, ent_hi = _position(ids[:, t], lps[:, t], tokens[t], token_lps[:, t], here, n)
        toks = np.array(list(known), dtype=np.int64)
        in_s = ~np.isnan(table[:, keep]).any(1)
        s_tok, s_lp = toks[in_s], table[in_s]
        where = {int(a): i for i, a in enumerate(s_tok)}
        A = np.exp(s_lp[:, keep]) @ wk
        r = s_lp[:, keep] @ wk
        z_s = np.exp(r).sum()
        ps = np.exp(s_lp[:, keep]).sum(0)
        H = float(np.prod(np.maximum(1.0 - ps, len(s_tok) * ROUNDING) ** wk)) if len(s_tok) < n else 0.0
        a_r = max(0.0, 1.0 - A.sum()) if len(s_tok) < n else 0.0
        # z_s = 0: no known token has mass under every teacher (supports that do not meet there): l lives on
        # unlisted tokens or nowhere, so its statistics are unknown (NaN), as the full distributions give NaN
        # where the supports do not meet
        met = z_s > 0
        l_lo = np.exp(r) / (z_s + H) if met else np.full(len(r), np.nan)
        l_factor = (z_s + H) / z_s if met else math.nan
        base = float(np.sum(np.where(A > 0, A * (np.log(np.where(A > 0, A, 1.0)) - r), 0.0)))
        kl_lo = kl_hi = math.nan
        if met:
            zr = min(a_r * z_s / (1.0 - a_r), H) if a_r < 1 else H
            tail = a_r * math.log(a_r) - a_r * math.log(zr) if a_r > 0 else 0.0
            kl_lo = base + math.log(z_s + zr) + tail
            kl_hi = base + math.log(z_s + H) if a_r == 0 else math.inf
        l_hi = l_lo * l_factor
        gap_lo = np.where(A < l_lo, l_lo - A, np.where(A > l_hi, A - l_hi, 0.0))
        gap_hi = np.maximum(np.abs(A - l_lo), np.abs(A - l_hi))
        l_r_hi = H / (z_s + H)
        tv_lo = 0.5 * (gap_lo.sum() + max(0.0, a_r - l_r_hi)) if met else math.nan
        tv_hi = 0.5 * (gap_hi.sum() + a_r + l_r_hi) if met else math.nan
        # argmaxes over S, and whether a token outside S could beat them
        log_u = np.log(np.maximum(u[keep], 1e-300))
        bound = np.vstack([np.where(np.isnan(x), log_u, x) for x in table[~in_s][:, keep]] + [log_u])  # + unlisted
        ia, il = int(np.argmax(A)), int(np.argmax(r))
        certain = bool(A[ia] >= (np.exp(bound) @ wk).max() and r[il] >= (bound @ wk).max())
        # the response's token, every teacher's top token, the candidates
        tok = int(tokens[t])
        top = ids[:, t, 0]
        if reference is None:
            order = np.argsort(-A, kind="stable")[:k_cand]
            ref = A[order]
        else:
            r_tok, r_lp = reference[t]
            missing = [int(a) for a in r_tok if int(a) not in where]
            if missing:
                raise ValueError(f"the student's candidate {missing[0]} at position {t} is not scored under every "
                                 "teacher (rescore_needs names what to score)")
            order = np.array([where[int(a)] for a in r_tok[:k_cand]], dtype=np.int64)
            ref = np.exp(np.asarray(r_lp[:k_cand], dtype=float))
        cand = np.full(k_cand, -1, dtype=np.int64)
        cand[:len(order)] = s_tok[order]
        cand_lp = np.zeros((K, k_cand), dtype=np.float32)
        cand_lp[:, :len(order)] = s_lp[order].T
        pad = lambda x: np.concatenate([x[order], np.zeros(k_cand - len(order))])       # noqa: E731
        rows.append(dict(
            token_lp=token_lps[:, t].astype(np.float32), entropy=ent_lo, top=top, top_lp=lps[:, t, 0],
            top_a=np.array([A[where[int(a)]] if int(a) in where else np.nan for a in top]),
            top_l=np.array([l_lo[where[int(a)]] if int(a) in where else np.nan for a in top]),
            a_token=A[where[tok]], l_token=l_lo[where[tok]], kl=kl_lo, tv=tv_lo, argmax_a=s_tok[ia],
            argmax_a_prob=A[ia], argmax_l=s_tok[il], argmax_l_prob=l_lo[il], cand=cand, cand_lp=cand_lp,
            cand_a=pad(A), cand_l=pad(l_hi), cand_ref=np.concatenate([ref, np.zeros(k_cand - len(order))]),
            kl_hi=kl_hi, tv_hi=tv_hi, entropy_hi=ent_hi, l_factor=l_factor, argmax_certain=certain))
    return {key: np.array([row[key] for row in rows]) for key in STAT_FIELDS + BOUND_FIELDS}


def rescore_needs(ids, lps, tokens, token_lps, weights, n, thresholds=None, reference=None):
    """The (t, k, a) whose exact ln p_k(a) a finding needs and the top k does not give: a token whose A may
    reach the veto floor (its unknown teachers at their bound u_k; with a student ``reference``, as
    :func:`topk_stats` takes it, each of the student's candidates instead), and the top token of a teacher
    that may be a confident expert (its entropy's lower bound at most the expert threshold, every other
    positive-weight teacher's upper bound at least the uninformative one), under each positive-weight teacher
    not listing it."""
    ids, lps = np.asarray(ids, dtype=np.int64), np.asarray(lps, dtype=float)
    th = Thresholds() if thresholds is None else thresholds
    K, T, _ = ids.shape
    w = np.asarray(weights, dtype=float)
    keep = positive_teachers(w)
    need = set()
    for t in range(T):
        known, table, tau, u, ent_lo, ent_hi = _position(ids[:, t], lps[:, t], tokens[t], token_lps[:, t], {}, n)
        if reference is None:
            for a, row in known.items():
                missing = [int(k) for k in keep if np.isnan(row[k])]
                if missing and np.where(np.isnan(row), u, np.exp(row))[keep] @ w[keep] >= th.veto_floor:
                    need |= {(t, k, a) for k in missing}
        else:
            need |= {(t, int(k), int(a)) for a in reference[t][0] for k in keep
                     if int(a) not in known or np.isnan(known[int(a)][k])}
        for k in keep:
            others = [int(i) for i in keep if i != k]
            if others and ent_lo[k] <= th.expert_entropy and min(ent_hi[i] for i in others) >= th.uninformative_entropy:
                a = int(ids[k, t, 0])
                need |= {(t, int(i), a) for i in keep if np.isnan(known[a][i])}
    return sorted(need)


def student_candidates(log_probs, floor, k_cand):
    """A student's tokens that can be vetoed at one position: those whose probability is at least ``floor``,
    most probable first (at most ``k_cand``), and their log-probabilities, from its (n,) log-probabilities."""
    lp = np.asarray(log_probs, dtype=float)
    at = np.flatnonzero(lp >= math.log(floor))
    at = at[np.argsort(-lp[at], kind="stable")][:k_cand]
    return at.astype(np.int64), lp[at]


def follow_served(backend, weights, prompts, max_tokens, rngs, responses=None, thresholds=None, k=50,
                  student=None):
    """:func:`llm_bridge.diagnosis.follow_many` through a server: the responses to several prompts and the
    bounded statistics (:func:`topk_stats`) of every position along them.

    Parameters
    ----------
    backend : :class:`llm_bridge.served.Served` (its teachers in the order of ``weights``).
    prompts, max_tokens, rngs, responses, thresholds : as in follow_many (the responses are sampled by the
        server from each positive-weight teacher, with a seed drawn from the prompt's generator).
    k : top tokens asked per position and teacher, at least :func:`llm_bridge.diagnosis.veto_candidates`
        (so that every veto candidate is listed) and at most the server's ``--max-logprobs``.
    student : optional :class:`llm_bridge.Teacher` in this process (sharing the vocabulary): a prompt without
        responses follows one rollout of the student, and the student is the veto reference (its full
        distribution is here; each token it gives at least the veto floor is scored exactly under every teacher).

    Returns
    -------
    per prompt, a list of :class:`llm_bridge.diagnosis.Trace` (``first`` is None: no full distribution).
    Requests: one generation per response, one top-k scoring per response and teacher, and one exact score
    per (position, teacher, token) that :func:`rescore_needs` names (few: a candidate missing from a teacher's
    top k is rare, and a veto when it happens).
    """
    th = Thresholds() if thresholds is None else thresholds
    w = np.asarray(weights, dtype=float)
    if len(w) != len(backend.models):
        raise ValueError(f"weights has {len(w)} entries for {len(backend.models)} served teachers")
    k = check_int(k, "k", veto_candidates(th))
    max_tokens = check_int(max_tokens, "max_tokens", 1)
    if len(rngs) != len(prompts):
        raise ValueError(f"rngs has {len(rngs)} entries for {len(prompts)} prompts")
    responses = [None] * len(prompts) if responses is None else list(responses)
    if len(responses) != len(prompts):
        raise ValueError(f"responses has {len(responses)} entries for {len(prompts)} prompts")
    n = backend.vocab_size
    if student is None:
        rows = response_rows(backend, prompts, responses, [int(j) for j in positive_teachers(w)],
                             [t.name for t in backend.models], max_tokens, rngs)
        refs = [None] * len(rows)
    else:
        from .backend import InProcess
        from .teachers import Teachers
        local = InProcess(Teachers([student], [1.0], vocab_size=n, end_token_ids=backend.end_token_ids))
        rows = response_rows(local, prompts, responses, [0], ["student"], max_tokens, rngs)
        refs = [[None] * len(tok) for _, _, tok in rows]
        for r, t, lp in local.distributions([(prompts[p], tok) for p, _, tok in rows]):
            for b, (i, s) in enumerate(zip(r, t)):
                refs[i][s] = student_candidates(lp[0, b].double().numpy(), th.veto_floor, veto_candidates(th))
    top = backend.top_k([(prompts[p], tok) for p, _, tok in rows], k)
    extra = [{} for _ in rows]
    needs = [rescore_needs(ids, lps, tok, own, w, n, th, ref)
             for (_, _, tok), (ids, lps, own), ref in zip(rows, top, refs)]
    for j in range(len(w)):
        asked = [(i, t, a) for i, need in enumerate(needs) for t, jj, a in need if jj == j]
        if asked:
            got = backend.score([(prompts[rows[i][0]], rows[i][2][:t] + [a]) for i, t, a in asked], models=[j])
            for (i, t, a), lp in zip(asked, got):
                extra[i][(t, j, a)] = float(lp[0, -1])
    out = [[] for _ in prompts]
    for (p, source, tok), (ids, lps, own), ex, ref in zip(rows, top, extra, refs):
        stats = topk_stats(ids, lps, tok, own, w, n, ex, veto_candidates(th), ref)
        out[p].append(Trace(source, list(tok), stats, None))
    return out


def first_token_options_served(backend, weights, prompts, first_tokens, k=50):
    """:func:`llm_bridge.diagnosis.first_token_options` through a server: for each prompt, (C, I, certain).

    C is the pool's preferred first token ``argmax_a sum_k w_k ln p_k(a | u)`` over the union of the
    positive-weight teachers' top k (each union token scored exactly under every teacher: a token missing from
    a teacher's list is scored by one more request); ``certain`` when no token outside the union can beat it
    (its pooled score is at least ``sum_k w_k`` (k-th log-probability of teacher k), the most an unlisted token
    can have). I is the other teachers' top choice that the pool ranks highest, else the pool's runner-up in
    the union. ``first_tokens``: any token per prompt (the top k are those of the position before it).
    """
    w = np.asarray(weights, dtype=float)
    keep = [int(j) for j in positive_teachers(w)]
    top = backend.top_k([(p, [int(a)]) for p, a in zip(prompts, first_tokens)], k, models=keep)
    known = []                                            # per prompt: {token: {teacher: ln p}}
    for ids, lps, _ in top:
        table = {}
        for m, j in enumerate(keep):
            for a, lp in zip(ids[m, 0], lps[m, 0]):
                table.setdefault(int(a), {})[j] = float(lp)
        known.append(table)
    for j in keep:
        asked = [(i, a) for i, table in enumerate(known) for a, got in table.items() if j not in got]
        if asked:
            for (i, a), lp in zip(asked, backend.score([(prompts[i], [a]) for i, a in asked], models=[j])):
                known[i][a][j] = float(lp[0, 0])
    out = []
    for (ids, lps, _), table in zip(top, known):
        tokens = np.array(sorted(table))
        pooled = np.array([sum(w[j] * table[a][j] for j in keep) for a in tokens])
        order = np.argsort(-pooled, kind="stable")
        c = int(tokens[order[0]])
        outside = float(sum(w[j] * lps[m, 0, -1] for m, j in enumerate(keep)))
        rivals = sorted({int(ids[m, 0, 0]) for m in range(len(keep))} - {c}, key=lambda a: -pooled[tokens == a][0])
        i = rivals[0] if rivals else int(tokens[order[1]])
        out.append((c, i, bool(pooled[order[0]] >= outside)))
    return out
