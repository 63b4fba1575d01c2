"""How far teachers are from the prefix-bias flip: the drift of ln Z_H(uI) - ln Z_H(uC) and the
predicted flip horizon H* (theory section 2 "prefix bias", theory section 6; claim T8). Library of
``python sims/flip_horizon.py``.

For a prompt u with a correct option C and an incorrect one I (token strings), teachers p_k with
weights w, the sequence-level geometric pool over responses "option + at most H tokens" scores

    ln g_H(C) - ln g_H(I) = m - D(H),   m = sum_k w_k [ln p_k(C|u) - ln p_k(I|u)],
                                        D(H) = ln Z_H(uI) - ln Z_H(uC),

m the pooled margin (g's margin at H = 0) and D the continuation gap. ``ln Z_H`` accumulates the
teachers' per-token disagreement ``-ln z`` along continuations drawn from l (theory section 2:
``Z_H(v) = E_{c ~ l}[prod_h z(v c_<h)]``), so D grows about linearly, D(H) ~ drift * H, and g
prefers I once D(H) > m: the predicted flip horizon is ``H* = m / drift`` (infinite when
drift <= 0: the teachers disagree at least as much after I as after C, which favours C).
On theory section 2's machine D(H) = H (-ln rho) exactly and H* is the table's.

Estimation. For every context v = uC, uI, N continuations are sampled from l to the largest horizon
(many contexts at once, left-padded, in one KV-cached batch: :func:`sample_log_factors_many`);
``ln Z_hat_H = logmeanexp_i L_i(H)`` at every horizon from the same rollouts, with the delta-method
covariance across horizons ``Cov(ln Z_hat_H, ln Z_hat_H') = Cov(W_H, W_H') / (N mean W_H mean W_H')``
(:func:`log_partition_curve`). The drift is the least-squares slope of D through the origin over the
measured horizons (D(0) = 0 exactly), ``drift = sum_j H_j D_j / sum_j H_j^2``, its variance
``c' (Sigma_C + Sigma_I) c`` with ``c_j = H_j / sum H^2`` (C and I sampled independently); the H*
interval is ``[m / drift_hi, m / drift_lo]`` (Fieller's, exact for a known m), infinite above when
the drift's interval reaches 0. A *flip at H* is measured, not extrapolated: every teacher prefers C
(m_k > 0) and g's margin ``m - D(H)`` has its 95% upper bound below 0.

What the design can see (issue 30): :func:`first_significant_flip` is the measured first flip;
:func:`detectable_drift` the smallest drift that flips at 80% power given the measured s.e. of D(H);
:func:`running_share` and :func:`is_saturating` say where an end token makes D(H) plateau (no H* is
extrapolated there); :func:`sample_contexts` adds samples where the ESS is below a floor (heavy
tails) and continues the correct option's contexts with other teachers (``after_correct``: the
positive control, teachers changed only after C).
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy.special import logsumexp

import aggregation as ag
from aggregation.validate import check_horizons, check_int, positive_teachers

from .backend import Streams, expand_cache, prefill, step
from .partition import Z_95, _sample, log_mean_exp_stats, log_weights_at


# ------------------------------------------------------------------------------------------------
# sampling many contexts at once
# ------------------------------------------------------------------------------------------------
def torch_geometric_pool(log_probs, weights):
    """(ln l (B, n), ln z (B,)) float64 of teachers' log-probs ``[(B, n)]`` with weights (K',):
    ``ln l = sum_k w_k ln p_k - ln z``, ``ln z = logsumexp_a sum_k w_k ln p_k(a)`` (theory section 1), in torch
    (not aggregation's pool: it now reads float32 without a copy, but returns float32 for float32 input, and
    the callers here take float64 ln l and ln z; a float64 result from it needs the float64 (K', B, n) copy
    that made it too slow for 500 rows of 49k tokens, and stacking the K' rows is a copy of its own)."""
    r = sum(float(w) * lp.double() for w, lp in zip(weights, log_probs))
    log_z = torch.logsumexp(r, dim=-1)
    return r - log_z[:, None], log_z


def _runs(teachers):
    """Teachers that share a model and a template share one forward pass (a temperature pair):
    [[teacher indices], ...] in order of first appearance."""
    runs = {}
    for k, t in enumerate(teachers.teachers):
        runs.setdefault((id(t.model), tuple(t.template_ids)), []).append(k)
    return list(runs.values())


@torch.no_grad()
def sample_log_factors_many(teachers, contexts, horizon, n_samples, rng, max_rows=512, return_tokens=False,
                            score_last=None):
    """Per-step ``ln z(v c_<h)`` of ``n_samples`` continuations of every context v, sampled from l.

    The contexts are batched (left-padded, ``max_rows`` sequences per batch: contexts x samples);
    each teacher's template is run once per batch and each context once, its KV cache repeated over
    its samples; teachers sharing a model and a template (a temperature pair) share one forward pass.
    Entries after an end token are 0.

    Parameters
    ----------
    teachers : llm_bridge.Teachers; contexts : list of non-empty token-id lists (prompt + prefix).
    horizon : int >= 0, factors per continuation; n_samples : int >= 1; rng : numpy Generator, or one per
        context (contexts may share one: each step every context draws its samples' uniforms in context
        order, so a context's draws do not depend on which other contexts share its batch).
    score_last : optional list of ints, one per context: score its last ``score_last[i]`` tokens
        (an option) from the same forward pass.

    Returns
    -------
    factors : (len(contexts), n_samples, horizon) float64; with ``return_tokens`` also the sampled
    tokens (len(contexts), n_samples, horizon - 1) (-1 where sampling stopped: every row had ended);
    with ``score_last`` also a list of (teacher log-probs (K, T_i), local geometric log-probs (T_i,))
    of those tokens (float64; l pools the positive-weight teachers).
    """
    horizon = check_int(horizon, "horizon")
    n_samples = check_int(n_samples, "n_samples", 1)
    max_rows = check_int(max_rows, "max_rows", 1)
    contexts = [teachers.check_ids(c, f"contexts[{i}]", allow_empty=False, input_ids=True)
                for i, c in enumerate(contexts)]
    if not contexts:
        raise ValueError("contexts is empty")
    if score_last is not None:
        if len(score_last) != len(contexts):
            raise ValueError(f"score_last has {len(score_last)} entries for {len(contexts)} contexts")
        for i, (n, c) in enumerate(zip(score_last, contexts)):
            if not 1 <= check_int(n, f"score_last[{i}]", 1) < len(c):
                raise ValueError(f"score_last[{i}] = {n} must be below the context's length {len(c)}")
            teachers.check_ids(c[-n:], f"contexts[{i}] scored tokens")
    if isinstance(rng, (list, tuple)) and len(rng) != len(contexts):
        raise ValueError(f"rng has {len(rng)} generators for {len(contexts)} contexts")
    keep = positive_teachers(teachers.weights)
    w = teachers.weights[keep]
    runs = _runs(teachers)
    n_last = 1 + (max(score_last) if score_last is not None else 0)
    factors = np.zeros((len(contexts), n_samples, horizon))
    sampled = np.full((len(contexts), n_samples, max(horizon - 1, 0)), -1, dtype=np.int64)
    scores = []
    ends = torch.tensor(teachers.end_token_ids or [-1], device=teachers.device)
    per_batch = max(1, max_rows // n_samples)
    for lo in range(0, len(contexts) if horizon or score_last is not None else 0, per_batch):
        chunk = contexts[lo:lo + per_batch]
        B = len(chunk) * n_samples
        state = []                                      # per run: [cache, mask, next positions]
        log_probs, kept = {}, {}
        for run in runs:
            logits, cache, mask, pos = prefill(teachers.teachers[run[0]], chunk, n_last, teachers.device)
            state.append([expand_cache(cache, n_samples), mask.repeat_interleave(n_samples, 0),
                          pos.repeat_interleave(n_samples, 0)])
            for k in run:
                kept[k] = teachers.log_softmax(logits, teachers.teachers[k].temperature)     # (b, n_last, n)
                log_probs[k] = kept[k][:, -1].repeat_interleave(n_samples, 0)
        if score_last is not None:
            for j, c in enumerate(chunk):
                T = score_last[lo + j]
                target = torch.tensor(c[-T:], device=teachers.device)
                rows = [kept[k][j, -T - 1:-1] for k in range(teachers.K)]              # (T, n) each
                path = np.stack([r.gather(1, target[:, None])[:, 0].double().cpu().numpy() for r in rows])
                log_l, _ = torch_geometric_pool([rows[k] for k in keep], w)
                scores.append((path, log_l.gather(1, target[:, None])[:, 0].cpu().numpy()))
        alive = np.ones(B, dtype=bool)
        for h in range(horizon):
            log_l, log_z = torch_geometric_pool([log_probs[k] for k in keep], w)
            factors[lo:lo + len(chunk), :, h] = np.where(alive, log_z.cpu().numpy(), 0.0).reshape(len(chunk), -1)
            if h == horizon - 1:
                break
            streams = Streams([(g, n_samples) for g in rng[lo:lo + len(chunk)]]) \
                if isinstance(rng, (list, tuple)) else rng
            drawn = _sample(log_l.cpu().numpy(), streams)
            sampled[lo:lo + len(chunk), :, h] = drawn.reshape(len(chunk), -1)
            tokens = torch.from_numpy(drawn).to(teachers.device)
            alive &= ~torch.isin(tokens, ends).cpu().numpy()
            if not alive.any():
                break
            for run, st in zip(runs, state):
                if not any(k in keep for k in run):
                    continue
                cache, mask, pos = st
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                logits, cache = step(teachers.teachers[run[0]].model, tokens, cache, mask, pos)
                st[:] = [cache, mask, pos + 1]
                for k in run:
                    log_probs[k] = teachers.log_softmax(logits, teachers.teachers[k].temperature)
    out = (factors,) + ((sampled,) if return_tokens else ()) + ((scores,) if score_last is not None else ())
    return out if len(out) > 1 else factors


# ------------------------------------------------------------------------------------------------
# partitions, the gap and its drift
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PartitionCurve:
    """ln Z_hat at each horizon from one set of rollouts: ``log_partition`` (n_h,), its delta-method
    covariance across horizons ``cov`` (n_h, n_h) and the effective sample size ``ess`` (n_h,)."""
    horizons: tuple
    log_partition: np.ndarray
    cov: np.ndarray
    ess: np.ndarray


def log_partition_curve(factors, horizons):
    """ln Z_hat_H = logmeanexp_i sum_{h < H} factors[i, h] for every H, with the covariance across H.

    factors : (N, H_max) per-step ln z of N continuations (:func:`sample_log_factors_many`).
    ``Cov(ln Z_hat_H, ln Z_hat_H') = Cov(W_H, W_H') / (N mean W_H mean W_H')`` (delta method), W = exp L.
    """
    factors = np.asarray(factors, dtype=float)
    if factors.ndim != 2:
        raise ValueError(f"factors must be (n_samples, horizon), got shape {factors.shape}")
    hs, _ = check_horizons(horizons)
    N = factors.shape[0]
    for i, h in enumerate(hs):
        if h > factors.shape[1]:
            raise ValueError(f"horizons[{i}] = {h} exceeds the {factors.shape[1]} factors sampled")
    L = log_weights_at(factors, hs)
    est, _, ess = log_mean_exp_stats(L)
    W = np.exp(L - L.max(axis=0))
    R = W / W.mean(axis=0)                          # W_H / mean W_H: the delta method's linearisation
    cov = np.cov(R, rowvar=False, ddof=1).reshape(len(hs), len(hs)) / N if N > 1 \
        else np.full((len(hs), len(hs)), np.inf)
    return PartitionCurve(tuple(hs), est, cov, ess)


@dataclass(frozen=True)
class DriftFit:
    """The gap's drift per token and the predicted flip horizon, each with a 95% interval."""
    drift: float
    drift_se: float
    drift_lo: float
    drift_hi: float
    h_star: float
    h_star_lo: float
    h_star_hi: float


def fit_drift(horizons, gap, gap_cov, margin, z=Z_95):
    """Least-squares slope through the origin of the gap D(H) and H* = margin / drift.

    Parameters
    ----------
    horizons : (n_h,) ints >= 0, at least one > 0; gap : (n_h,) D(H_j); gap_cov : (n_h, n_h) its
        covariance (zeros for exact values); margin : the pooled margin m > 0 (exact).

    Returns
    -------
    :class:`DriftFit`. ``drift = sum H D / sum H^2``, ``se^2 = c' Sigma c``, ``c = H / sum H^2``;
    H* = m / drift (inf when drift <= 0); interval ``[m / drift_hi, m / drift_lo]`` with inf where the
    drift bound is <= 0. A margin <= 0 (the pool already prefers I at H = 0) gives H* = 0.
    """
    H = np.asarray(horizons, dtype=float)
    D = np.asarray(gap, dtype=float)
    S = np.asarray(gap_cov, dtype=float)
    if H.ndim != 1 or D.shape != H.shape or S.shape != (H.size, H.size):
        raise ValueError(f"horizons {H.shape}, gap {D.shape} and gap_cov {S.shape} do not match")
    if not np.all(H >= 0) or not np.any(H > 0):
        raise ValueError("horizons must be >= 0 with at least one > 0")
    if not np.all(np.isfinite(D)):
        raise ValueError(f"gap[{int(np.flatnonzero(~np.isfinite(D))[0])}] is not finite")
    if not np.isfinite(margin):
        raise ValueError(f"margin = {margin} is not finite")
    c = H / np.sum(H ** 2)
    drift = float(c @ D)
    se = float(np.sqrt(max(c @ S @ c, 0.0)))
    lo, hi = drift - z * se, drift + z * se

    def ratio(d):
        return margin / d if d > 0 else np.inf
    if margin <= 0:
        return DriftFit(drift, se, lo, hi, 0.0, 0.0, 0.0)
    return DriftFit(drift, se, lo, hi, ratio(drift), ratio(hi), ratio(lo))


# ------------------------------------------------------------------------------------------------
# power, measured flips, saturation
# ------------------------------------------------------------------------------------------------
Z_80 = 0.8416212335729143   # one-sided 80% normal quantile: the power the detectable drift is stated at
SATURATION = 0.5            # below this share of continuations still running, D(H) is saturating


def detectable_drift(margin, gap_se, horizons, z=Z_95, z_power=Z_80):
    """The smallest drift the design detects with 80% power, and the horizon where it does.

    A flip is found at H when the upper bound ``m - D(H) + z se_H`` of g's margin is < 0. If D(H) is
    normal around drift * H with the measured s.e. se_H, that happens with probability 1 - beta when
    ``drift >= (m + (z + z_beta) se_H) / H``; the design detects the smallest such drift over its
    horizons H > 0 (z_beta = 0.84 for 80% power; the s.e. is the one measured, not the one at the
    alternative). Returns (drift, H); (inf, -1) when no horizon > 0 has a finite s.e.

    Parameters
    ----------
    margin : the pooled margin m (finite); gap_se : (n_h,) s.e. of D(H) at each horizon;
    horizons : (n_h,) ints >= 0.
    """
    H = np.asarray(horizons, dtype=float)
    se = np.asarray(gap_se, dtype=float)
    if H.ndim != 1 or se.shape != H.shape:
        raise ValueError(f"horizons {H.shape} and gap_se {se.shape} do not match")
    if np.any(H < 0):
        raise ValueError("horizons must be >= 0")
    if np.any(se < 0):
        raise ValueError("gap_se must be >= 0")
    if not np.isfinite(margin):
        raise ValueError(f"margin = {margin} is not finite")
    ok = (H > 0) & np.isfinite(se)
    if not ok.any():
        return np.inf, -1
    need = (margin + (z + z_power) * se[ok]) / H[ok]
    j = int(np.argmin(need))
    return float(need[j]), int(H[ok][j])


def first_significant_flip(horizons, margin_g_hi, eligible):
    """The measured first flip: the smallest H whose upper 95% bound of g's margin is < 0, for an
    eligible question (every teacher prefers C); -1 when there is none up to the largest horizon."""
    hi = np.asarray(margin_g_hi, dtype=float)
    if hi.shape != (len(horizons),):
        raise ValueError(f"margin_g_hi {hi.shape} does not match {len(horizons)} horizons")
    if not eligible:
        return -1
    return next((int(h) for h, b in zip(horizons, hi) if b < 0), -1)


def running_share(tokens, end_token_ids, horizons):
    """Share of continuations still running at the H-th token (no end token among their first H - 1),
    per horizon: ``tokens`` (N, >= H_max - 1) as returned by :func:`sample_log_factors_many`. Below
    1/2 the continuation gap D(H) is saturating (most continuations have ended) and a line through it
    extrapolates nothing."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (n_samples, horizon - 1), got shape {tokens.shape}")
    if max(horizons) > tokens.shape[1] + 1:
        raise ValueError(f"horizon {max(horizons)} needs {max(horizons) - 1} tokens per continuation, "
                         f"got {tokens.shape[1]}")
    ended = np.isin(tokens, list(end_token_ids))
    before = np.concatenate([np.zeros((tokens.shape[0], 1), bool), np.cumsum(ended, axis=1) > 0], axis=1)
    return np.array([1.0 - before[:, max(h - 1, 0)].mean() for h in horizons])


def is_saturating(running_correct, running_incorrect, share=SATURATION):
    """Whether D(H) is saturating at a horizon: fewer than ``share`` of the continuations of C or of I
    still run there (:func:`running_share`); a linear extrapolation of D beyond it would be wrong."""
    return bool(min(running_correct, running_incorrect) < share)


def resampled_coverage(pool_correct, pool_incorrect, n_samples, replicates, rng, ess_share=0.75, max_factor=4,
                       z=Z_95, z_power=Z_80):
    """How the gap's interval behaves at a sample size, on a pool of real continuations (issue 44, items 10, 12).

    The pools ``(M, n_h)`` hold the log-weights L_i(H) of M continuations of uC and of uI; the pool's own
    ``D = logmeanexp L(uI) - logmeanexp L(uC)`` (per horizon) is the truth. Each replicate draws
    ``n_samples`` of each pool with replacement and, as the study does, doubles them while the ESS (at any
    horizon) is below ``ess_share`` of ``n_samples``, up to ``max_factor`` x ``n_samples``; then the study's
    delta-method interval ``D_hat +- z se`` at the largest horizon. Returns a dict: ``coverage`` (the share of
    intervals holding the truth), ``false_flip`` (the share whose lower end is above it: at a margin equal to
    the truth, no flip is true and the rule "m - D_hat + z se < 0" flags one), ``samples`` (mean per pool),
    ``truth``, ``replicates``, and the planted control arm: ``se_median`` (the s.e. the study states, median
    over replicates) and ``planted_flip``, the share of replicates the rule flags when the gap is planted at
    ``D = m + (z + z_power) se_median``, the gap the study says it detects with 80% power (adding a constant to
    uI's log-weights moves D_hat by exactly that constant and leaves se and the ESS alone, so the replicates
    are reused: flagged iff ``D_hat - D_pool > z se - (z + z_power) se_median``, whatever m).
    """
    pools = [np.asarray(p, dtype=float) for p in (pool_correct, pool_incorrect)]
    for name, p in zip(("pool_correct", "pool_incorrect"), pools):
        if p.ndim != 2 or p.shape[0] < 2:
            raise ValueError(f"{name} must be (M >= 2, n_horizons), got shape {p.shape}")
    if pools[0].shape[1] != pools[1].shape[1]:
        raise ValueError("the two pools need the same horizons")
    n_samples = check_int(n_samples, "n_samples", 2)
    replicates = check_int(replicates, "replicates", 1)
    truth = log_mean_exp_stats(pools[1])[0][-1] - log_mean_exp_stats(pools[0])[0][-1]
    err, ses, used = np.zeros(replicates), np.zeros(replicates), 0
    for r in range(replicates):
        est, var = 0.0, 0.0
        for sign, pool in ((-1.0, pools[0]), (1.0, pools[1])):
            idx = rng.integers(len(pool), size=n_samples)
            while log_mean_exp_stats(pool[idx])[2].min() < ess_share * n_samples and \
                    2 * len(idx) <= max_factor * n_samples:
                idx = np.concatenate([idx, rng.integers(len(pool), size=len(idx))])
            e, se, _ = log_mean_exp_stats(pool[idx][:, -1])
            est, var, used = est + sign * e, var + se ** 2, used + len(idx)
        err[r], ses[r] = est - truth, np.sqrt(var)
    se_median = float(np.median(ses))
    return dict(coverage=float(np.mean(np.abs(err) <= z * ses)), false_flip=float(np.mean(err > z * ses)),
                samples=used / (2 * replicates), truth=float(truth), replicates=replicates, se_median=se_median,
                planted_flip=float(np.mean(err > z * ses - (z + z_power) * se_median)))


def _check_twin(teachers, twin, name):
    if twin.K != teachers.K or not np.array_equal(twin.weights, teachers.weights) \
            or twin.vocab_size != teachers.vocab_size or twin.end_token_ids != teachers.end_token_ids:
        raise ValueError(f"{name} must have the teachers' K, weights, vocabulary and end tokens")


def sample_contexts(teachers, contexts, horizon, n_samples, rng, max_rows=512, ess_floor=None,
                    max_samples=None, after_correct=None):
    """Continuation factors and tokens of every context, with the heavy-tail correction.

    ``ess_floor``: a context whose ESS (at any horizon 1..``horizon``, over its own samples) is below
    the floor gets as many samples again, repeatedly, until it reaches the floor or ``max_samples``
    (default 8 n_samples). ``after_correct``: a second llm_bridge.Teachers (same K, weights) that
    continues the even contexts (uC of the study's interleaved uC, uI); the odd ones use ``teachers``.

    Returns a list of (factors (N_i, horizon), tokens (N_i, horizon - 1)) per context.
    """
    n_samples = check_int(n_samples, "n_samples", 1)
    if ess_floor is not None and not 0 < ess_floor:
        raise ValueError(f"ess_floor = {ess_floor} must be > 0")
    max_samples = 8 * n_samples if max_samples is None else check_int(max_samples, "max_samples", n_samples)
    if after_correct is not None:
        _check_twin(teachers, after_correct, "after_correct")
    # the contexts that want more are sampled in rounds of n = n_samples, n_samples, 2 n_samples, 4 n_samples,
    # ... (each round doubles every context still below the floor), the odd ones then the even ones
    sources = ((teachers, 1), (after_correct, 0)) if after_correct is not None else ((teachers, None),)
    out = [None] * len(contexts)
    want, n = list(range(len(contexts))), n_samples
    while want:
        for src, parity in sources:
            idx = [j for j in want if parity is None or j % 2 == parity]
            if not idx:
                continue
            f, t = sample_log_factors_many(src, [contexts[j] for j in idx], horizon, n, rng, max_rows,
                                           return_tokens=True)
            for a, j in enumerate(idx):
                out[j] = (f[a], t[a]) if out[j] is None else (np.concatenate([out[j][0], f[a]]),
                                                              np.concatenate([out[j][1], t[a]]))
        n = len(out[want[0]][0])
        want = [] if ess_floor is None or horizon == 0 or 2 * n > max_samples else \
            [j for j in want if log_mean_exp_stats(np.cumsum(out[j][0], axis=1))[2].min() < ess_floor]
    return out


# ------------------------------------------------------------------------------------------------
# the study on one teacher set
# ------------------------------------------------------------------------------------------------
def flip_horizon_study(teachers, questions, horizons, n_samples, seed, max_rows=512, z=Z_95, ess_floor=None,
                       max_samples=None, after_correct=None):
    """Margins, partitions, the gap's drift and H* for each question under one teacher set.

    Parameters
    ----------
    teachers : llm_bridge.Teachers.
    questions : list of dicts with ``id``, ``prompt_ids`` (non-empty), ``correct_ids`` and
        ``incorrect_ids`` (non-empty token-id lists: the two options).
    horizons : ints >= 0 (at least one > 0); n_samples : continuations per option; seed : NumPy seed, or
        one per question (each question's samples then depend on its seed alone; without ``ess_floor`` and
        ``after_correct``).
    ess_floor, max_samples : the heavy-tail correction of :func:`sample_contexts` (None: N fixed).
    after_correct : optional llm_bridge.Teachers (same K and weights) that continue after C only: the
        options are scored, and continued after I, by ``teachers`` (the positive control: a teacher
        changed only after the correct option, so that the teachers disagree more after C).

    Returns
    -------
    (per_question, per_horizon) DataFrames. per_question: ``id``, ``margin_<teacher>`` (ln p_k(C|u) -
    ln p_k(I|u)), ``margin_local`` (l's), ``margin_mixture``, ``margin`` (pooled, = g's at H = 0),
    ``teachers_prefer_correct``, ``drift``, ``drift_se``, ``drift_lo``, ``drift_hi``, ``h_star``,
    ``h_star_lo``, ``h_star_hi`` (the linear extrapolation; NaN where ``saturating``: fewer than half
    of the continuations of C or I still run at the largest H), ``flip`` (at some measured H,
    significant), ``first_flip`` (:func:`first_significant_flip`), ``detectable_drift`` and
    ``detectable_horizon`` (:func:`detectable_drift`), ``samples_correct`` / ``samples_incorrect``,
    ``ess_min`` (over both options and H), ``running_correct`` / ``running_incorrect`` (at the
    largest H), ``saturating``, ``tokens_correct``, ``tokens_incorrect``. per_horizon: ``id``,
    ``horizon``, ``log_z_correct`` / ``log_z_incorrect`` with ``_lo`` / ``_hi`` (95%), ``ess_*`` and
    ``running_*``, ``gap`` (D(H)) with ``gap_lo`` / ``gap_hi`` / ``gap_se``, ``margin_g`` (m - D) with
    ``margin_g_lo`` / ``_hi``, ``flip`` (teachers prefer C and margin_g_hi < 0), ``flip_point`` (margin_g < 0).
    """
    hs, _ = check_horizons(horizons)
    if max(hs) < 1:
        raise ValueError("horizons needs one horizon > 0 to fit a drift")
    n_samples = check_int(n_samples, "n_samples", 2)
    _check_questions(questions)
    contexts = [list(q["prompt_ids"]) + list(q[key]) for q in questions for key in ("correct_ids", "incorrect_ids")]
    score_last = [len(q[key]) for q in questions for key in ("correct_ids", "incorrect_ids")]
    if isinstance(seed, (list, tuple)):
        if len(seed) != len(questions) or ess_floor is not None or after_correct is not None:
            raise ValueError("one seed per question needs len(seed) == len(questions), no ess_floor and no "
                             "after_correct")
        rng = [g for s in seed for g in [np.random.default_rng(s)] * 2]        # C and I draw from one stream
    else:
        rng = np.random.default_rng(seed)
    if after_correct is None and ess_floor is None:
        factors, tokens, scores = sample_log_factors_many(teachers, contexts, max(hs), n_samples, rng, max_rows,
                                                          return_tokens=True, score_last=score_last)
        sampled = list(zip(factors, tokens))
    else:
        _, scores = sample_log_factors_many(teachers, contexts, 0, 1, rng, max_rows, score_last=score_last)
        sampled = sample_contexts(teachers, contexts, max(hs), n_samples, rng, max_rows, ess_floor, max_samples,
                                  after_correct)
    return _study_tables(questions, teachers.names, teachers.weights, teachers.end_token_ids, hs, z, scores, sampled)


def _check_questions(questions):
    if not questions:
        raise ValueError("questions is empty")
    for i, q in enumerate(questions):
        for key in ("id", "prompt_ids", "correct_ids", "incorrect_ids"):
            if key not in q:
                raise ValueError(f"questions[{i}] has no {key!r}")
        for key in ("correct_ids", "incorrect_ids"):
            if len(q[key]) == 0:
                raise ValueError(f"questions[{i}].{key} is empty")


def flip_horizon_study_backend(backend, weights, questions, horizons, n_samples, seed, max_rows=512, z=Z_95,
                               after_correct=None):
    """:func:`flip_horizon_study` through any backend (in process or served), from what a server gives exactly.

    The options are scored under every teacher (``backend.score``); ln Z_H of each context comes from the
    teachers' own samples with importance weights (:func:`llm_bridge.partition.proposal_log_weights`), not
    from sampling l, which needs each position's normaliser z and so the full distributions. The same
    tables, except ``margin_local`` (l's margin needs z: NaN here). Not here: the heavy-tail correction.

    Parameters
    ----------
    backend : teachers 0 .. K - 1 of an :mod:`llm_bridge.backend` backend; weights : (K,) on the simplex.
    questions, horizons : as :func:`flip_horizon_study`; n_samples : continuations per option (split over the
        positive-weight teachers); seed : int, or one per question (a question's samples depend on its
        seed alone: its two contexts draw from ``default_rng([seed, side])``).
    after_correct : optional backend (the same teachers, vocabulary and end tokens) that continues after C
        only, as in :func:`flip_horizon_study` (the options are scored under ``backend``).
    """
    from aggregation.validate import check_weights
    from .partition import proposal_log_weights
    hs, _ = check_horizons(horizons)
    if max(hs) < 1:
        raise ValueError("horizons needs one horizon > 0 to fit a drift")
    _check_questions(questions)
    w = check_weights(weights, len(weights), name="weights")
    n_samples = check_int(n_samples, "n_samples", max(2, len(positive_teachers(w))))
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [[int(seed), i] for i in range(len(questions))]
    if len(seeds) != len(questions):
        raise ValueError(f"seed has {len(seeds)} entries for {len(questions)} questions")
    contexts = [list(q["prompt_ids"]) + list(q[key]) for q in questions for key in ("correct_ids", "incorrect_ids")]
    rngs = [np.random.default_rng([int(x) for x in np.atleast_1d(s)] + [side]) for s in seeds for side in (0, 1)]
    options = backend.score([(list(q["prompt_ids"]), list(q[key])) for q in questions
                             for key in ("correct_ids", "incorrect_ids")], models=list(range(len(w))))
    sampled = [None] * len(contexts)
    if after_correct is not None and (len(after_correct.models) != len(backend.models) or after_correct.vocab_size
                                      != backend.vocab_size or after_correct.end_token_ids != backend.end_token_ids):
        raise ValueError("after_correct must have the backend's teachers, vocabulary and end tokens")
    for src, side in ((backend, 1), (after_correct, 0)) if after_correct is not None else ((backend, None),):
        idx = [j for j in range(len(contexts)) if side is None or j % 2 == side]
        got = proposal_log_weights(src, w, [contexts[j] for j in idx], max(hs), n_samples, [rngs[j] for j in idx],
                                   max_rows)
        for j, g in zip(idx, got):
            sampled[j] = g
    names = [getattr(backend.models[k], "name", "") or f"teacher{k}" for k in range(len(w))]
    return _study_tables(questions, names, w, backend.end_token_ids, hs, z, [(o, None) for o in options], sampled)


def _study_tables(questions, names, weights, end_token_ids, hs, z, scores, sampled):
    """flip_horizon_study's two tables from each context's option scores (teachers (K, T), l (T,) or None)
    and its continuations' (per-step log-weight increments (N, H), tokens (N, H - 1))."""
    pos = weights > 0
    log_w = np.log(weights[pos])
    q_rows, h_rows = [], []
    for i, q in enumerate(questions):
        (path_c, local_c), (path_i, local_i) = scores[2 * i], scores[2 * i + 1]
        seq = np.stack([path_c.sum(1), path_i.sum(1)], axis=1)                  # (K, 2): ln p_k(option | u)
        teacher_margins = seq[:, 0] - seq[:, 1]
        m = float(weights[pos] @ teacher_margins[pos])
        mixture = [logsumexp(log_w + seq[pos, j]) for j in range(2)]
        prefer = bool(np.all(teacher_margins > 0))
        (fc, tc), (fi, ti) = sampled[2 * i], sampled[2 * i + 1]
        cc, ci = log_partition_curve(fc, hs), log_partition_curve(fi, hs)
        rc, ri = running_share(tc, end_token_ids, hs), running_share(ti, end_token_ids, hs)
        gap = ci.log_partition - cc.log_partition
        cov = ci.cov + cc.cov
        se = np.sqrt(np.maximum(np.diag(cov), 0.0))
        half = z * se
        fit = fit_drift(hs, gap, cov, m, z)
        top = int(np.argmax(hs))
        saturating = is_saturating(rc[top], ri[top])
        h_star = (np.nan, np.nan, np.nan) if saturating else (fit.h_star, fit.h_star_lo, fit.h_star_hi)
        for j, h in enumerate(hs):
            half_c, half_i = (z * np.sqrt(max(c.cov[j, j], 0.0)) for c in (cc, ci))
            mg = m - gap[j]
            h_rows.append(dict(id=q["id"], horizon=h,
                               log_z_correct=cc.log_partition[j], log_z_correct_lo=cc.log_partition[j] - half_c,
                               log_z_correct_hi=cc.log_partition[j] + half_c, ess_correct=cc.ess[j],
                               running_correct=rc[j],
                               log_z_incorrect=ci.log_partition[j], log_z_incorrect_lo=ci.log_partition[j] - half_i,
                               log_z_incorrect_hi=ci.log_partition[j] + half_i, ess_incorrect=ci.ess[j],
                               running_incorrect=ri[j],
                               gap=gap[j], gap_lo=gap[j] - half[j], gap_hi=gap[j] + half[j], gap_se=se[j],
                               margin_g=mg, margin_g_lo=mg - half[j], margin_g_hi=mg + half[j],
                               flip=prefer and mg + half[j] < 0, flip_point=prefer and mg < 0))
        first = first_significant_flip(hs, m - gap + half, prefer)
        need, need_h = detectable_drift(m, se, hs, z)
        row = dict(id=q["id"])
        row.update({f"margin_{n}": float(v) for n, v in zip(names, teacher_margins)})
        row.update(margin_local=np.nan if local_c is None else float(local_c.sum() - local_i.sum()), margin_mixture=float(mixture[0] - mixture[1]),
                   margin=m,
                   teachers_prefer_correct=prefer, drift=fit.drift, drift_se=fit.drift_se, drift_lo=fit.drift_lo,
                   drift_hi=fit.drift_hi, h_star=h_star[0], h_star_lo=h_star[1],
                   h_star_hi=h_star[2], flip=first >= 0, first_flip=first,
                   detectable_drift=need, detectable_horizon=need_h, samples_correct=len(fc), samples_incorrect=len(fi),
                   ess_min=float(min(cc.ess.min(), ci.ess.min())), running_correct=rc[top], running_incorrect=ri[top],
                   saturating=saturating, tokens_correct=len(q["correct_ids"]), tokens_incorrect=len(q["incorrect_ids"]))
        q_rows.append(row)
    return pd.DataFrame(q_rows), pd.DataFrame(h_rows)


# ------------------------------------------------------------------------------------------------
# the exact reference on finite-state teachers
# ------------------------------------------------------------------------------------------------
def exact_flip_horizon(machine, weights, horizons, correct=0, incorrect=1, h_max=None):
    """What :func:`flip_horizon_study` estimates, exactly, on a FiniteStateTeachers machine whose
    first token (from the start state) is the option: C = token ``correct``, I = ``incorrect``.

    Returns a dict: ``margin`` (pooled), ``gap`` (n_h,) exact D(H) from aggregation's backward
    recursion, the through-origin ``drift`` and ``h_star`` = margin / drift (the fit's estimand), and
    ``first_flip``: the smallest H <= h_max (default 4 max(horizons)) with m - D(H) < 0, or -1.
    """
    w = np.asarray(weights, dtype=float)
    hs, _ = check_horizons(horizons)
    h_max = 4 * max(hs) if h_max is None else check_int(h_max, "h_max")
    s0 = machine.start
    sc, si = int(machine.next_state[s0, correct]), int(machine.next_state[s0, incorrect])
    if sc < 0 or si < 0:
        raise ValueError("the options must not end the response")
    top = max(h_max, max(hs))
    table = ag.sequence_log_partition(machine, w, top)           # table[h, s] = ln Z with top - h tokens left
    gap_all = table[top - np.arange(top + 1), si] - table[top - np.arange(top + 1), sc]     # D(0..top)
    m = float(w @ (machine.log_probs[:, s0, correct] - machine.log_probs[:, s0, incorrect]))
    gap = gap_all[hs]
    fit = fit_drift(hs, gap, np.zeros((len(hs), len(hs))), m)
    below = np.flatnonzero(m - gap_all[:h_max + 1] < 0)
    return dict(margin=m, gap=gap, drift=fit.drift, h_star=fit.h_star,
                first_flip=int(below[0]) if below.size else -1)
