"""The sequence-level geometric target on causal LMs: Monte-Carlo continuation partitions (theory section 2, 6).

For a context u (prompt + prefix) and a horizon H (tokens after u),

    Z_H(u) = sum_{c, |c| <= H} prod_k p_k(c | u)^{w_k} = E_{c ~ l(.|u)} [ prod_{h < |c|} z(u c_<h) ],

where ``l`` is the local geometric pool and ``z(v) = sum_a prod_k p_k(a | v)^{w_k}`` its normaliser;
a continuation stops at H tokens or after an end token (whose factors are then 1). The estimate is
``ln Z_hat = logmeanexp_i L_i`` with ``L_i = sum_h ln z(u c^i_<h)``, with a delta-method interval
``ln Z_hat ± 1.96 se``, ``se = sd(W) / (sqrt(N) mean(W))``, ``W_i = exp(L_i)``, and the effective
sample size ``(sum W)^2 / sum W^2``. One rollout to the largest horizon serves every smaller one
(prefix sums of the per-step ln z): l does not depend on the horizon.

An option o (a token string appended to u) then scores, under the sequence-level geometric pool of
responses "o followed by at most H tokens",

    ln g(o) = sum_j sum_k w_k ln p_k(o_j | u o_<j) + ln Z_H(u o) - logsumexp_{o'} ( same for o' ),

which for single-token options and the full vocabulary is the token conditional g(a | u) of theory section 2.
The pools themselves are aggregation's (float32 torch log-probs converted to float64 NumPy).
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy.special import logsumexp

import aggregation as ag
from aggregation.validate import check_horizon, check_horizons, check_int, positive_teachers

from .backend import expand_cache

Z_95 = 1.959963984540054    # two-sided 95% normal quantile: the intervals' stated coverage


@dataclass
class PartitionEstimate:
    """Monte-Carlo estimate of ln Z_H(u), one entry per horizon (scalars when one horizon was asked).

    ``log_weights`` (n_samples, n_horizons) are the per-sample ``L_i``; ``log_z_first`` = ln z(u),
    the deterministic first factor.
    """
    horizon: object
    log_partition: object
    ci_low: object
    ci_high: object
    std_error: object
    ess: object
    n_samples: int
    log_weights: np.ndarray
    log_z_first: float


def log_weights_at(increments, horizons):
    """L_i(H) = sum_{h < H} increments[i, h] at each of ``horizons`` (L(0) = 0): (N, n_h) from (N, H_max)
    per-step log-weight increments (ln z of the continuations, or their importance-weight increments)."""
    inc = np.asarray(increments, dtype=float)
    return np.concatenate([np.zeros((inc.shape[0], 1)), np.cumsum(inc, axis=1)], axis=1)[:, list(horizons)]


def log_mean_exp_stats(log_weights, z=Z_95):
    """(ln mean W, se of it by the delta method, ESS) of ``W = exp(log_weights)`` over axis 0."""
    L = np.asarray(log_weights, dtype=float)
    N = L.shape[0]
    top = L.max(axis=0)
    W = np.exp(L - top)
    mean = W.mean(axis=0)
    est = top + np.log(mean)
    if N > 1:
        se = W.std(axis=0, ddof=1) / (np.sqrt(N) * mean)
    else:
        se = np.full_like(est, np.inf)
    ess = W.sum(axis=0) ** 2 / (W ** 2).sum(axis=0)
    return est, se, ess


def _sample(log_l, rng):
    """One token per row of ``log_l: (B, n)`` by inverse CDF with uniforms in (0, 1]."""
    cdf = np.cumsum(np.exp(log_l), axis=1)
    u = (1.0 - rng.random(log_l.shape[0])) * cdf[:, -1]
    return np.minimum((cdf < u[:, None]).sum(axis=1), log_l.shape[1] - 1)


def _pool(weights, log_probs):
    """(ln l (B, n), ln z (B,)) of K' teachers' float32 log-probs ``[(B, n)]`` by aggregation (one pass)."""
    lp = np.stack([x.double().cpu().numpy() for x in log_probs])
    return ag.log_geometric_pool(lp, weights, return_log_partition=True)


@torch.no_grad()
def sample_log_factors(teachers, context_ids, horizon, n_samples, rng, batch_size=None, return_tokens=False):
    """Per-step ``ln z(u c_<h)`` of n_samples continuations sampled from l; (n_samples, horizon).

    Entries after an end token are 0. All positive-weight teachers run batched with their KV caches.
    With ``return_tokens``, also the sampled tokens ``(n_samples, horizon - 1)`` (the last factor
    needs no token; -1 where sampling stopped because every sequence of the batch had ended).
    """
    context_ids = teachers.check_ids(context_ids, "context", allow_empty=False, input_ids=True)
    horizon = check_horizon(horizon)
    n_samples = check_int(n_samples, "n_samples", 1)
    keep = positive_teachers(teachers.weights)
    w = teachers.weights[keep]
    batch_size = n_samples if batch_size is None else check_int(batch_size, "batch_size", 1)
    factors = np.zeros((n_samples, horizon))
    sampled = np.full((n_samples, max(horizon - 1, 0)), -1, dtype=np.int64)
    if horizon == 0:
        return (factors, sampled) if return_tokens else factors
    ends = torch.tensor(teachers.end_token_ids or [-1], device=teachers.device)
    first = [teachers.prefill(k, context_ids) for k in keep]
    for lo in range(0, n_samples, batch_size):
        B = min(batch_size, n_samples - lo)
        caches = [None] * len(keep)
        log_probs = [lp[None].expand(B, -1) for lp, _ in first]
        alive = np.ones(B, dtype=bool)
        for h in range(horizon):
            log_l, log_z = _pool(w, log_probs)
            factors[lo:lo + B, h] = np.where(alive, log_z, 0.0)
            if h == horizon - 1:
                break
            drawn = _sample(log_l, rng)
            sampled[lo:lo + B, h] = drawn
            tokens = torch.from_numpy(drawn).to(teachers.device)
            alive &= ~torch.isin(tokens, ends).cpu().numpy()
            if not alive.any():
                break
            for j, k in enumerate(keep):
                cache = caches[j]
                if cache is None:      # a fresh copy of the prompt's cache for this batch
                    _, cache = teachers.prefill(k, context_ids) if lo > 0 else first[j]
                    cache = expand_cache(cache, B)
                log_probs[j], caches[j] = teachers.step(k, tokens, cache)
    return (factors, sampled) if return_tokens else factors


def proposal_log_weights(backend, weights, contexts, horizon, n_samples, rngs, max_rows=512):
    """ln Z_H(v)'s importance weights from the teachers' own samples: the estimator a server can serve.

    Sampling from l needs every position's normaliser z, hence full distributions; this one needs only
    what a server gives exactly (samples, and scores of given ids). For every context v, ``n_samples``
    continuations of ``horizon`` tokens (fewer after an end token) are drawn, n_j of them from teacher j
    (the positive-weight teachers; ``n_samples`` split as evenly as possible, the first teachers take the
    remainder), and scored under each of them. With the mixture ``q = sum_j (n_j / N) p_j`` as the
    proposal (the balance heuristic, unbiased for a fixed split),

        L_i(H) = sum_k w_k ln p_k(c^i_<=H | v) - ln q(c^i_<=H | v),     Z_H(v) = E[exp L_i(H)],

    where ``c^i_<=H`` is the sample's first H tokens (all of it when it ended earlier), so one
    continuation serves every horizon. The support of the pool lies within every teacher's, so q covers it.
    A context that ends with an end token has nothing after it: L = 0 (Z = 1), with no request.

    Parameters
    ----------
    backend : an :mod:`llm_bridge.backend` backend (in process or served); teacher k is its model k.
    weights : (K,) the pool's weights over the backend's first K models.
    contexts : list of non-empty token-id lists (prompt + option); horizon : int >= 0.
    n_samples : continuations per context, at least one per positive-weight teacher.
    rngs : one numpy Generator per context (its rows draw their seeds / uniforms from it).
    max_rows : contexts x samples generated per backend call.

    Returns
    -------
    A list, per context, of (increments (N, horizon) with ``cumsum`` = L_i(1..horizon), as
    :func:`sample_log_factors` gives ln z factors; tokens (N, horizon - 1) int64, -1 after an end token).
    """
    from aggregation.validate import check_weights
    horizon = check_horizon(horizon)
    w = check_weights(weights, len(weights), name="weights")
    if len(w) > len(backend.models):
        raise ValueError(f"weights has {len(w)} entries for a backend of {len(backend.models)} models")
    keep = positive_teachers(w)
    n_samples = check_int(n_samples, "n_samples", len(keep))
    if len(rngs) != len(contexts):
        raise ValueError(f"rngs has {len(rngs)} generators for {len(contexts)} contexts")
    for i, c in enumerate(contexts):
        if len(c) == 0:
            raise ValueError(f"contexts[{i}] is empty")
    counts = np.full(len(keep), n_samples // len(keep))
    counts[:n_samples % len(keep)] += 1
    log_q = np.log(counts / n_samples)[:, None, None]
    source = np.repeat(keep, counts)                                    # the teacher of each sample
    ends = set(backend.end_token_ids)
    out = []
    per_call = max(1, check_int(max_rows, "max_rows", 1) // n_samples)
    for lo in range(0, len(contexts), per_call):
        chunk = [list(map(int, c)) for c in contexts[lo:lo + per_call]]
        # nothing follows a context that ends the response (Z = 1, L = 0): no request for it
        live = [a for a, c in enumerate(chunk) if horizon > 0 and c[-1] not in ends]
        done = {a: (np.zeros((n_samples, horizon)), np.full((n_samples, max(horizon - 1, 0)), -1, dtype=np.int64))
                for a in range(len(chunk)) if a not in live}
        rows = [(int(j), chunk[a]) for a in live for j in source]
        gens = [rngs[lo + a] for a in live for _ in source]
        drawn = [list(d[:horizon]) for d in backend.generate(rows, horizon, gens)] if rows else []
        scored = backend.score([(c, d) for (_, c), d in zip(rows, drawn)], models=list(keep)) if rows else []
        for a in range(len(chunk)):
            if a in done:
                out.append(done[a])
                continue
            b = live.index(a)
            S = np.zeros((len(keep), n_samples, horizon + 1))            # cumulative ln p_j(c_<=H | v)
            tokens = np.full((n_samples, max(horizon - 1, 0)), -1, dtype=np.int64)
            for s in range(n_samples):
                d, sc = drawn[b * n_samples + s], scored[b * n_samples + s]
                T = len(d)
                S[:, s, 1:T + 1] = np.cumsum(sc, axis=1)
                S[:, s, T + 1:] = S[:, s, T:T + 1]
                cut = next((t + 1 for t, x in enumerate(d) if x in ends), T)
                tokens[s, :min(cut, horizon - 1)] = d[:min(cut, horizon - 1)]
            L = np.tensordot(w[keep], S, axes=1) - logsumexp(log_q + S, axis=0)
            out.append((np.diff(L, axis=1), tokens))
    return out


def estimate_log_partition(teachers, prompt_ids, prefix_ids, horizon, n_samples, seed, batch_size=None):
    """Monte-Carlo ln Z_H(prompt + prefix) with a 95% interval and the effective sample size.

    Parameters
    ----------
    teachers : llm_bridge.Teachers.
    prompt_ids, prefix_ids : token ids; the context u is their concatenation (prompt non-empty).
    horizon : int or list of ints, tokens after the prefix (H = 0 gives Z = 1 exactly). One rollout
        to the largest horizon serves all.
    n_samples : continuations sampled from l (>= 1); seed : NumPy seed (same seed, same estimate).

    Returns
    -------
    :class:`PartitionEstimate`. A prefix ending in an end token has Z = 1 (nothing follows).
    """
    prompt_ids = teachers.check_ids(prompt_ids, "prompt", allow_empty=False, input_ids=True)
    prefix_ids = teachers.check_ids(prefix_ids, "prefix")
    horizons, scalar = check_horizons(horizon)
    n_samples = check_int(n_samples, "n_samples", 1)
    if batch_size is not None:
        check_int(batch_size, "batch_size", 1)
    for i, a in enumerate(prefix_ids[:-1]):
        if a in teachers.end_token_ids:
            raise ValueError(f"prefix[{i}] = {a} is an end token but the prefix goes on")
    rng = np.random.default_rng(seed)
    H = max(horizons)
    ended = bool(prefix_ids) and prefix_ids[-1] in teachers.end_token_ids
    if ended or H == 0:
        factors = np.zeros((n_samples, H))
    else:
        factors = sample_log_factors(teachers, prompt_ids + prefix_ids, H, n_samples, rng, batch_size)
    L = log_weights_at(factors, horizons)
    est, se, ess = log_mean_exp_stats(L)
    lo, hi = est - Z_95 * se, est + Z_95 * se
    pick = (lambda x: float(x[0])) if scalar else (lambda x: np.asarray(x))
    return PartitionEstimate(horizon=horizons[0] if scalar else horizons, log_partition=pick(est),
                             ci_low=pick(lo), ci_high=pick(hi), std_error=pick(se), ess=pick(ess),
                             n_samples=n_samples, log_weights=L,
                             log_z_first=float(factors[0, 0]) if H and not ended else 0.0)


def option_log_probs(teachers, prompt_ids, options):
    """Exact per-option quantities along each option's tokens (theory section 6, via aggregation's pools).

    Returns a dict: ``teacher`` (K, O) ln p_k(o | u); ``reward`` (O,) sum_j sum_k w_k ln p_k(o_j|..),
    the unnormalised sequence-level geometric log-weight at H = 0; ``local_geometric`` (O,)
    sum_j ln l(o_j | u o_<j); ``mixture`` (O,) ln sum_k w_k p_k(o | u).
    """
    K, O = teachers.K, len(options)
    out = {"teacher": np.empty((K, O)), "reward": np.empty(O), "local_geometric": np.empty(O),
           "mixture": np.empty(O)}
    keep = positive_teachers(teachers.weights)
    for i, o in enumerate(options):
        res = teachers.path_analysis(prompt_ids, o)
        full = res["teacher"]
        T = len(o)
        tok = full[:, np.arange(T), o]                                  # (K, T)
        out["teacher"][:, i] = tok.sum(axis=1)
        out["reward"][i] = (teachers.weights[keep, None] * tok[keep]).sum()
        out["local_geometric"][i] = res["local_geometric"][np.arange(T), o].sum()
        with np.errstate(divide="ignore"):
            out["mixture"][i] = logsumexp(np.log(teachers.weights) + out["teacher"][:, i])
    return out


def _normalise(x):
    return x - logsumexp(x)


def sequence_geometric_scores(teachers, prompt_ids, options, horizons, n_samples, seed, batch_size=None,
                              progress=False):
    """Scores of each option, relative to the others, under every teacher, l, the mixture and g.

    Parameters
    ----------
    options : list of token-id lists (answer strings, or single first tokens), each non-empty.
    horizons : list of ints >= 0, tokens after the option; the ln Z of each option is estimated
        once, to the largest horizon, with its own seed stream (``seed``, option index).
    progress : show a progress bar over the options' ln Z estimates (stderr).

    Returns
    -------
    pandas DataFrame, one row per (horizon, scorer, option): ``log_score`` (log-probability of the
    option among the options), ``ci_low``, ``ci_high`` (95%, for g only: the delta method through
    the estimated ln Z's; exact scorers have ci = log_score), and for g also ``log_weight``
    (unnormalised ``reward + ln Z``), ``log_partition``, its ``log_partition_se`` and ``ess``.
    Scorers: the teacher names, ``local_geometric``, ``mixture``, ``geometric``.
    """
    prompt_ids = teachers.check_ids(prompt_ids, "prompt", allow_empty=False, input_ids=True)
    if len(options) < 1:
        raise ValueError("options is empty")
    for i, o in enumerate(options):
        if len(o) == 0:
            raise ValueError(f"options[{i}] has no tokens")
    options = [teachers.check_ids(o, f"options[{i}]") for i, o in enumerate(options)]
    hs, _ = check_horizons(horizons)
    n_samples = check_int(n_samples, "n_samples", 1)
    exact = option_log_probs(teachers, prompt_ids, options)
    from tqdm import tqdm
    estimates = [estimate_log_partition(teachers, prompt_ids, o, hs, n_samples,
                                        np.random.SeedSequence([int(seed), i]), batch_size)
                 for i, o in enumerate(tqdm(options, desc=f"ln Z to H={max(hs)}, {n_samples} samples",
                                            unit="option", disable=not progress, leave=False))]
    log_z = np.stack([e.log_partition for e in estimates], axis=1)     # (n_h, O)
    se = np.stack([e.std_error for e in estimates], axis=1)
    ess = np.stack([e.ess for e in estimates], axis=1)
    exact_scores = {name: _normalise(exact["teacher"][k]) for k, name in enumerate(teachers.names)}
    exact_scores["local_geometric"] = _normalise(exact["local_geometric"])
    exact_scores["mixture"] = _normalise(exact["mixture"])
    return _score_table(hs, exact_scores, exact["reward"], log_z, se, ess)


def sequence_geometric_scores_backend(backend, weights, prompt_ids, options, horizons, n_samples, seed,
                                      names=None):
    """:func:`sequence_geometric_scores` through any backend (in process or served), from what a server gives
    exactly: the options scored under every teacher, each option's ln Z_H from the teachers' own samples
    (:func:`proposal_log_weights`). The same table without the ``local_geometric`` scorer (l's score needs
    each position's normaliser, hence full distributions). ``weights`` (K,): the pool's, over the backend's
    first K models; ``names``: the teachers' (default the backend's)."""
    from aggregation.validate import check_weights
    w = check_weights(weights, len(weights), name="weights")
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty")
    if len(options) < 1:
        raise ValueError("options is empty")
    for i, o in enumerate(options):
        if len(o) == 0:
            raise ValueError(f"options[{i}] has no tokens")
    hs, _ = check_horizons(horizons)
    n_samples = check_int(n_samples, "n_samples", 1)
    names = [m.name for m in backend.models[:len(w)]] if names is None else list(names)
    teacher = np.stack([sc.sum(axis=1) for sc in backend.score([(list(prompt_ids), list(o)) for o in options],
                                                                models=list(range(len(w))))], axis=1)   # (K, O)
    keep = positive_teachers(w)
    reward = w[keep] @ teacher[keep]
    with np.errstate(divide="ignore"):
        mixture = logsumexp(np.log(w)[:, None] + teacher, axis=0)
    rngs = [np.random.default_rng(np.random.SeedSequence([int(seed), i])) for i in range(len(options))]
    sampled = proposal_log_weights(backend, w, [list(prompt_ids) + list(o) for o in options], max(hs), n_samples,
                                   rngs)
    log_z, se, ess = np.zeros((len(hs), len(options))), np.zeros((len(hs), len(options))), np.zeros((len(hs), len(options)))
    for i, (inc, _) in enumerate(sampled):             # an option that ends the response: L = 0, Z = 1
        log_z[:, i], se[:, i], ess[:, i] = log_mean_exp_stats(log_weights_at(inc, hs))
    scores = {name: _normalise(teacher[k]) for k, name in enumerate(names)}
    scores["mixture"] = _normalise(mixture)
    return _score_table(hs, scores, reward, log_z, se, ess)


def _score_table(hs, exact_scores, reward, log_z, se, ess):
    """sequence_geometric_scores' table from the exact scorers' normalised scores, the unnormalised reward
    (O,) and each option's ln Z, its s.e. and ESS at every horizon (n_h, O)."""
    rows, O = [], len(reward)
    for j, h in enumerate(hs):
        for scorer, score in exact_scores.items():
            for i in range(O):
                rows.append(dict(horizon=h, scorer=scorer, option=i, log_score=score[i],
                                 ci_low=score[i], ci_high=score[i]))
        weight = reward + log_z[j]
        score = _normalise(weight)
        g = np.exp(score)
        for i in range(O):
            # d ln g_i / d ln Z_m = [i == m] - g_m, ln Z's independent
            grad = (np.arange(O) == i) - g
            finite = grad != 0
            half = Z_95 * np.sqrt(np.sum((grad[finite] * se[j][finite]) ** 2))
            rows.append(dict(horizon=h, scorer="geometric", option=i, log_score=score[i],
                             ci_low=score[i] - half, ci_high=min(score[i] + half, 0.0),
                             log_weight=weight[i], log_partition=log_z[j, i],
                             log_partition_se=se[j, i], ess=ess[j, i]))
    df = pd.DataFrame(rows)
    df.attrs["reward"] = np.asarray(reward)
    return df
