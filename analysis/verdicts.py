"""Verdicts from stated decision rules: every claim's verdict follows from an estimate and its interval
by a rule written down beside it, so no sentence can disagree with its data.

The vocabulary (``VERDICTS``): "reproduces", "reproduces under stated conditions" (a study that holds a
claim only where a condition it names holds), "does not reproduce", "inconclusive" (the interval
cannot decide; report the smallest effect the design could have seen, :func:`mde_80`), "mixed" (some
decidable units hold the claim and no stated property separates them beyond chance: :func:`draw_verdict`;
some units of :func:`count_verdict`), and QUICK (a --quick run checks the pipeline, not the claims).

    effect_verdict     a claimed effect of a sign, against the smallest effect that matters (a margin)
    bound_verdict      a claimed bound: a statistic at most (or at least) a tolerance
    decide_draws       per unit (task draw): can the design decide the claim there (the candidate targets
                       farther apart than MULTIPLE x the tolerance, the seed noise below it), and does it hold
    separating_condition, separation_p
                       a property's threshold that splits the holding units from the failing ones, and the
                       chance that some property splits a random relabelling as well (a permutation p-value)
    draw_verdict       the verdict over the decidable units only, with a separating condition as data
    draw_row           the verdicts.csv row of draw_verdict, with the tolerance sensitivity (half, twice)
    count_verdict      a claimed bound checked on each of several units: every unit, none or some
    mde_80, power      the smallest effect a two-sided test detects with 80% power; the power at an effect
    tost               two one-sided tests of equivalence within +-margin
    verdict_row        one row of a study's verdicts.csv
    t_power, t_mde_80  the power and the 80%-power effect of the two-sided t-test over clusters (noncentral t)
    fieller            Fieller's confidence set for a ratio of two noisy estimates; ratio_resolved says whether
                       it resolves a share (bounded, and not holding both 0 and 1)
    check_margin       an equivalence or non-superiority margin, refused unless below the effect under test
    clusters_for_power the clusters (tasks) a t-test needs for 80% power at an effect, from their spread
    tost_power, tost_se_for_power, tost_clusters_for_power
                       TOST's power to declare equivalence at a true effect of 0, the s.e. and the clusters
                       it needs for 80%
    median_lower_bound a distribution-free lower bound on a median (the sign test's order statistic), which
                       cannot fall when a value rises: conservative where values are censored from below
"""

import math

import numpy as np
import pandas as pd
from scipy import stats

VERDICTS = ("reproduces", "reproduces under stated conditions", "does not reproduce", "inconclusive", "mixed",
            "not decided (quick run)")
COLUMNS = ("claim", "condition", "statistic", "estimate", "lo", "hi", "rule", "verdict")
DRAW_COLUMNS = COLUMNS + ("n_draws", "n_decidable", "n_hold", "stated_condition", "condition_p",
                          "verdict_half_tolerance", "verdict_twice_tolerance")
MULTIPLE = 3.0          # a draw decides only where the candidate targets are farther apart than MULTIPLE x tolerance
MIN_DECIDABLE = 3       # fewer decidable draws than this: inconclusive
MIN_SIDE = 2            # a condition is stated only with at least this many decidable units on each side of it ...
CONDITION_ALPHA = 0.05  # ... and a permutation p-value (:func:`separation_p`) at most this
QUICK = "not decided (quick run)"


def _interval(lo, hi):
    lo, hi = float(lo), float(hi)
    if not lo <= hi:                                      # False when either is NaN
        raise ValueError(f"interval [{lo}, {hi}] must have lo <= hi, both numbers")
    return lo, hi


def effect_verdict(lo, hi, sign=1, margin=0.0):
    """The verdict on a claimed effect of ``sign`` (+1: positive, -1: negative) from its interval
    [lo, hi], the smallest effect that matters being ``margin`` >= 0 (on the claimed side):

        does not reproduce   the interval excludes every effect of at least ``margin`` on the claimed side
                             (sign * effect < margin throughout: the effect is absent, opposite or negligible)
        reproduces           the interval lies on the claimed side of 0 (and does not end below the margin)
        inconclusive         otherwise: the interval holds 0 and effects of at least ``margin``
    """
    lo, hi = _interval(lo, hi)
    if sign not in (1, -1) or not margin >= 0:
        raise ValueError(f"sign = {sign!r} must be +1 or -1 and margin = {margin!r} >= 0")
    lo, hi = sorted((sign * lo, sign * hi))
    if hi < margin:
        return "does not reproduce"
    if lo > 0:
        return "reproduces"
    return "inconclusive"


def bound_verdict(lo, hi, tolerance, at_most=True):
    """The verdict on a claimed bound, statistic <= ``tolerance`` (``at_most``) or >= it: "reproduces"
    when the whole interval satisfies it, "does not reproduce" when none of it does, else "inconclusive"."""
    lo, hi = _interval(lo, hi)
    if not at_most:
        lo, hi, tolerance = -hi, -lo, -tolerance
    if hi <= tolerance:
        return "reproduces"
    if lo > tolerance:
        return "does not reproduce"
    return "inconclusive"


def count_verdict(values, tolerance, at_most=True):
    """The verdict on a claim checked on each of several independent units (task draws, random pairs):
    each unit's ``values`` must be <= ``tolerance`` (``at_most``) or > it. 'reproduces' when every unit
    meets it, 'does not reproduce' when none does, else 'mixed' (it holds on some units only, the row says
    how many, and no condition is stated: 'under stated conditions' needs one, :func:`draw_verdict`).
    Returns (verdict, met)."""
    values = np.asarray(values, dtype=float)
    met = int((values <= tolerance).sum() if at_most else (values > tolerance).sum())
    return ("reproduces" if met == len(values) else "does not reproduce" if met == 0 else "mixed"), met


def mde_80(se, level=0.95, power_target=0.8):
    """The smallest true effect that a two-sided z-test at ``level`` detects with probability
    ``power_target``: (z_{1 - (1 - level) / 2} + z_{power_target}) se (2.80 se at the defaults)."""
    if not se >= 0:
        raise ValueError(f"se = {se!r} must be >= 0")
    return (stats.norm.ppf(0.5 + level / 2) + stats.norm.ppf(power_target)) * se


def power(effect, se, level=0.95):
    """The probability that a two-sided z-test at ``level`` rejects 0 when the true effect is ``effect``
    and the estimate's standard error ``se``: Phi(|effect|/se - z) + Phi(-|effect|/se - z)."""
    if not se > 0:
        raise ValueError(f"se = {se!r} must be > 0")
    z = stats.norm.ppf(0.5 + level / 2)
    d = abs(effect) / se
    return float(stats.norm.cdf(d - z) + stats.norm.cdf(-d - z))


def tost(estimate, se, margin, df=None, alpha=0.05):
    """Two one-sided tests of equivalence: the effect lies within (-margin, margin) when both
    H0: effect <= -margin and H0: effect >= margin are rejected at ``alpha`` (t with ``df`` degrees of
    freedom, normal when None). Returns (p-value = the larger one-sided p, equivalent: bool)."""
    if not (se > 0 and margin > 0):
        raise ValueError(f"se = {se!r} and margin = {margin!r} must be > 0")
    dist = stats.norm if df is None else stats.t(df)
    p = max(dist.sf((estimate + margin) / se), dist.cdf((estimate - margin) / se))
    return float(p), bool(p < alpha)


def verdict_row(claim, condition, statistic, estimate, lo, hi, rule, verdict):
    """One row of a verdicts.csv (``COLUMNS``); ValueError unless ``verdict`` is in ``VERDICTS``."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict = {verdict!r} must be one of {VERDICTS}")
    return dict(claim=claim, condition=condition, statistic=statistic, estimate=float(estimate), lo=float(lo),
                hi=float(hi), rule=rule, verdict=verdict)


def decide_draws(values, tolerance, at_most=True, separation=None, noise=None, multiple=MULTIPLE,
                 separation_tolerance=None):
    """Per unit (task draw), whether the design can decide a claimed bound there and whether it holds.

    A unit is *decidable* when the candidate targets the claim must tell apart are at least ``multiple``
    x ``separation_tolerance`` apart there (``separation``; the tolerance the targets are told apart at,
    ``tolerance`` itself unless the statistic is not a distance, e.g. a ratio or a step count; NaN or
    None: the claim names no candidates, e.g. an exact identity) and the statistic's seed-to-seed noise there (``noise``: the s.d.
    over seeds; NaN or None: not measured, e.g. an exact value) is below ``tolerance``. On a decidable unit
    the claim *holds* when the statistic is <= ``tolerance`` (``at_most``) or > it. Returns a DataFrame
    (value, separation, noise, decidable, held), held NaN where undecidable."""
    values = np.asarray(values, dtype=float)
    n = values.shape
    sep = np.full(n, np.nan) if separation is None else np.broadcast_to(np.asarray(separation, dtype=float), n)
    noi = np.full(n, np.nan) if noise is None else np.broadcast_to(np.asarray(noise, dtype=float), n)
    sep_tol = tolerance if separation_tolerance is None else separation_tolerance
    if not (sep_tol > 0 or np.all(np.isnan(sep))):
        raise ValueError(f"tolerance = {sep_tol!r} must be > 0 where a separation is given")
    sep_ok = np.isnan(sep) | (sep >= multiple * abs(sep_tol))
    noise_ok = np.isnan(noi) | (noi < abs(tolerance))
    decidable = sep_ok & noise_ok & ~np.isnan(values)
    held = np.where(values <= tolerance, 1.0, 0.0) if at_most else np.where(values > tolerance, 1.0, 0.0)
    return pd.DataFrame(dict(value=values, separation=sep, noise=noi, decidable=decidable,
                             held=np.where(decidable, held, np.nan)))


def _held(held):
    held = np.asarray(held)
    if held.dtype != bool:
        raise ValueError(f"held must be booleans (a mask over the units), got dtype {held.dtype}")
    return held


def _splits(vals, k):
    """The sets of ``k`` units (as frozensets of positions) that a threshold on ``vals`` puts on one side:
    the k largest (if the k-th largest exceeds the next) and the k smallest (likewise)."""
    order = np.argsort(vals, kind="stable")
    out = set()
    for side in (order[::-1], order):                 # the k largest, then the k smallest
        inside, outside = vals[side[:k]], vals[side[k:]]
        if inside.min() > outside.max() or inside.max() < outside.min():
            out.add(frozenset(side[:k].tolist()))
    return out


def separating_condition(held, properties):
    """A condition that separates the units where a claim holds (``held``, booleans) from those where it
    does not: the first of ``properties`` ({name: per-unit values}; one with a NaN is skipped) with a
    threshold that puts every holding unit on one side and every failing unit on the other. Returns
    'name > t' or 'name <= t' (t midway between the two groups), or None when no property separates them
    (or one group is empty). Whether the split is more than chance is :func:`separation_p`'s."""
    held = _held(held)
    if held.all() or not held.any():
        return None
    for name, vals in properties.items():
        vals = np.asarray(vals, dtype=float)
        yes, no = vals[held], vals[~held]
        if np.isnan(vals).any():
            continue
        if yes.min() > no.max():
            return f"{name} > {(yes.min() + no.max()) / 2:.3g}"
        if yes.max() < no.min():
            return f"{name} <= {(yes.max() + no.min()) / 2:.3g}"
    return None


def separation_p(held, properties):
    """The permutation p-value of a separating condition: the share of the C(n, k) ways to choose which k of
    the n units hold (k = those that do) that some property of ``properties`` (NaN-free) separates as
    :func:`separating_condition` would, exactly. A property with distinct values separates 2 of them (the
    k largest, the k smallest), so 1 holding unit of 3 is separated by chance with p = 2/3; 2 of 8 by one
    property with p = 2/28. NaN when one group is empty."""
    held = _held(held)
    n, k = held.size, int(held.sum())
    if k in (0, n):
        return math.nan
    hits = set()
    for vals in properties.values():
        vals = np.asarray(vals, dtype=float)
        if not np.isnan(vals).any():
            hits |= _splits(vals, k)
    return len(hits) / math.comb(n, k)


def draw_verdict(table, properties=None, min_decidable=MIN_DECIDABLE, min_side=MIN_SIDE, alpha=CONDITION_ALPHA):
    """The verdict over the decidable units of ``table`` (:func:`decide_draws`): fewer than
    ``min_decidable`` decidable units: 'inconclusive'; the claim holds on every decidable unit:
    'reproduces'; on none: 'does not reproduce'; on some: 'reproduces under stated conditions' when a
    property of ``properties`` ({name: per-unit values}, read on the decidable units) separates them
    (:func:`separating_condition`) with at least ``min_side`` decidable units on each side and a
    permutation p-value (:func:`separation_p`) at most ``alpha``, else 'mixed'. Returns (verdict,
    n_decidable, n_hold, the separating condition or '', its p-value or NaN); a condition that separates
    the units but fails the minimum or the p-value is returned with a 'mixed' verdict, to be reported."""
    decided = table[table.decidable]
    n, hold = len(decided), int(decided.held.sum())
    if n < min_decidable:
        return "inconclusive", n, hold, "", math.nan
    if hold == n:
        return "reproduces", n, hold, "", math.nan
    if hold == 0:
        return "does not reproduce", n, hold, "", math.nan
    idx = table.index[table.decidable]
    props = {k: np.asarray(v, dtype=float)[idx] for k, v in (properties or {}).items()}
    held = decided.held.to_numpy() > 0
    cond = separating_condition(held, props)
    if not cond:
        return "mixed", n, hold, "", math.nan
    p = separation_p(held, props)
    stated = min(hold, n - hold) >= min_side and p <= alpha
    return ("reproduces under stated conditions" if stated else "mixed"), n, hold, cond, p


def draw_row(claim, condition, statistic, values, tolerance, at_most=True, separation=None, noise=None,
             properties=None, unit="task draw", multiple=MULTIPLE, min_decidable=MIN_DECIDABLE, quick=False,
             separation_tolerance=None):
    """The verdicts.csv row (``DRAW_COLUMNS``) of a claimed bound checked per unit, counting only the
    decidable units (:func:`decide_draws`, :func:`draw_verdict`; ``separation_tolerance`` as there): the statistic's median [min, max] over
    the decidable units (over all units when none is), the counts, the rule with its tolerance and
    multiple, the separating condition, and the verdict recomputed at half and twice the tolerance (the
    decidability too). ``quick``: the verdict columns say QUICK (a quick run checks the pipeline, not
    the claims). Also returns the per-unit table (with the columns 'unit', 'tolerance')."""
    side = "<=" if at_most else ">"
    sep_tol = tolerance if separation_tolerance is None else separation_tolerance
    table = decide_draws(values, tolerance, at_most, separation, noise, multiple, sep_tol)
    verdict, n, hold, cond, p = draw_verdict(table, properties, min_decidable)
    shown = table.value[table.decidable] if n else table.value
    shown = shown[~np.isnan(shown)]
    est, lo, hi = shown.median(), shown.min(), shown.max()             # NaN when there is nothing to show
    sens = [draw_verdict(decide_draws(values, f * tolerance, at_most, separation, noise, multiple, f * sep_tol),
                         properties, min_decidable)[0] for f in (0.5, 2.0)]
    clauses = ([f"the candidate targets are >= {multiple:g} x {sep_tol:g} apart"] if table.separation.notna().any()
               else []) + ([f"the seed s.d. < {tolerance:g}"] if table.noise.notna().any() else [])
    decides = (f"a {unit} decides when {' and '.join(clauses)}; " if clauses else
               f"every {unit} with a value decides (no candidates or seed noise to tell apart); ")
    rule = (f"{decides}on the decidable {unit}s (>= {min_decidable}): every one {side} {tolerance:g}: reproduces; "
            f"none: does not; some: under stated conditions if a property separates them with >= {MIN_SIDE} "
            f"{unit}s on each side and permutation p <= {CONDITION_ALPHA:g}, else mixed; fewer: inconclusive")
    stated = verdict == "reproduces under stated conditions"
    note = ""
    if cond and not stated:
        why = (f"fewer than {MIN_SIDE} {unit}s on a side" if min(hold, n - hold) < MIN_SIDE else
               f"permutation p = {p:.2g} > {CONDITION_ALPHA:g}")
        note = f"; {cond} separates them, but {why}: no condition stated"
    row = dict(claim=claim, condition=condition,
               statistic=f"{statistic}; {hold} of {n} decidable {unit}s {side} {tolerance:g} ({len(table)} {unit}s); "
                         f"median [min, max] over the decidable {unit}s{note}",
               estimate=float(est), lo=float(lo), hi=float(hi), rule=rule, verdict=QUICK if quick else verdict,
               n_draws=len(table), n_decidable=n, n_hold=hold, stated_condition=cond if stated else "",
               condition_p=float(p), verdict_half_tolerance=QUICK if quick else sens[0],
               verdict_twice_tolerance=QUICK if quick else sens[1])
    return row, table.assign(tolerance=tolerance)


# ------------------------------------------------------------------------------------------------
# the test a row uses: Student-t power over clusters, Fieller sets for ratios, margins below the effect
# ------------------------------------------------------------------------------------------------
def _df(df):
    if not (df > 0 and math.isfinite(df)):
        raise ValueError(f"df = {df!r} must be a finite number > 0")
    return float(df)


def t_power(effect, se, df, level=0.95):
    """The probability that the two-sided one-sample (or paired) t-test at ``level`` with ``df`` degrees
    of freedom (clusters - 1) rejects 0 when the true effect is ``effect`` and the estimate's standard
    error ``se``: P(|T| > t_crit) with T noncentral t(df, effect / se)."""
    if not se > 0:
        raise ValueError(f"se = {se!r} must be > 0")
    df = _df(df)
    crit = stats.t.ppf(0.5 + level / 2, df)
    nc = abs(effect) / se
    p = float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))
    if math.isfinite(p):
        return p
    # scipy's noncentral t can return NaN at few df and a large noncentrality, and at many df (388 and a
    # noncentrality of 39: its far tail is NaN): integrate over the chi-square instead, T = (Z + nc) / s with
    # s^2 ~ chi2(df) / df, so P(|T| > crit) = E[Phi(nc - crit s) + Phi(-nc - crit s)], in the chi-square's
    # quantiles u (v = chi2.ppf(u)): an integral over (0, 1) whose mass no df can move out of reach of the
    # quadrature (over v in (0, inf) it sits in a window of width ~sqrt(df) near df, which quad misses)
    from scipy.integrate import quad
    tail = lambda u: (stats.norm.cdf(nc - crit * math.sqrt(stats.chi2.ppf(u, df) / df))      # noqa: E731
                      + stats.norm.cdf(-nc - crit * math.sqrt(stats.chi2.ppf(u, df) / df)))
    return float(quad(tail, 0, 1)[0])        # at most 14 subintervals at df 1 to 1e5, noncentrality to 300


def t_mde_80(se, df, level=0.95, power_target=0.8):
    """The smallest true effect that the two-sided t-test of :func:`t_power` detects with probability
    ``power_target`` (the noncentral t, not the normal: with 7 df it is 1.17x the z-test's 2.80 se)."""
    if not se >= 0:
        raise ValueError(f"se = {se!r} must be >= 0")
    df = _df(df)
    if not 1 - level < power_target < 1:
        raise ValueError(f"power_target = {power_target!r} must lie in ({1 - level:g}, 1): above the test's size, "
                         f"its power at effect 0")
    return _unit_mde(df, level, power_target) * se


_UNIT_MDE = {}


def _unit_mde(df, level, power_target):
    """t_mde_80 at se = 1 (the MDE scales with se), solved once per test (a root of the noncentral t power)."""
    from scipy.optimize import brentq
    key = (df, level, power_target)
    if key not in _UNIT_MDE:
        short = lambda d: t_power(d, 1.0, df, level) - power_target                                # noqa: E731
        hi = 1.0
        while short(hi) < 0:                  # power increases with the effect: double until it brackets the root
            hi *= 2
        _UNIT_MDE[key] = float(brentq(short, 0.0, hi))
    return _UNIT_MDE[key]


def fieller(num, den, se_num, se_den, cov=0.0, df=None, level=0.95):
    """Fieller's ``level`` confidence set for the ratio num / den of two (jointly normal) estimates with
    standard errors ``se_num``, ``se_den`` and covariance ``cov`` (t with ``df`` degrees of freedom, normal
    when None): the ratios r with (num - r den)^2 <= q^2 Var(num - r den), the roots of
    a r^2 - 2 b r + c = 0 with a = den^2 - q^2 se_den^2, b = num den - q^2 cov, c = num^2 - q^2 se_num^2.
    Returns (estimate, lo, hi, kind): kind 'interval' ([lo, hi], when den is significantly nonzero),
    'two rays' ((-inf, lo] and [hi, inf)) or 'whole line' (lo = -inf, hi = inf)."""
    if not (se_num >= 0 and se_den >= 0):
        raise ValueError(f"se_num = {se_num!r} and se_den = {se_den!r} must be >= 0")
    q = stats.norm.ppf(0.5 + level / 2) if df is None else stats.t.ppf(0.5 + level / 2, _df(df))
    a = den ** 2 - q ** 2 * se_den ** 2
    b = num * den - q ** 2 * cov
    c = num ** 2 - q ** 2 * se_num ** 2
    disc = b * b - a * c
    estimate = num / den if den != 0 else math.copysign(math.inf, num) if num != 0 else math.nan
    if a > 0:                                   # disc >= 0 here (Cauchy-Schwarz); a bounded interval
        root = math.sqrt(max(disc, 0.0))
        return float(estimate), float((b - root) / a), float((b + root) / a), "interval"
    if a < 0 and disc > 0:
        root = math.sqrt(disc)
        r1, r2 = sorted(((b - root) / a, (b + root) / a))
        return float(estimate), float(r1), float(r2), "two rays"
    return float(estimate), -math.inf, math.inf, "whole line"


def ratio_resolved(lo, hi, kind):
    """Whether a Fieller set (:func:`fieller`) resolves a share: 'not resolved' when it is unbounded
    (two rays or the whole line) or holds both 0 and 1 (none of it and all of it are both consistent)."""
    return kind == "interval" and not (lo <= 0 and hi >= 1)


def check_margin(margin, effect, name="margin"):
    """``margin`` when 0 < margin < |effect| (an equivalence or non-superiority margin must be smaller than
    the effect it is meant to rule out: else an effect as large as the one measured, measured precisely,
    would pass as 'none'); ValueError naming ``name`` otherwise."""
    if not (0 < margin < abs(effect)):
        raise ValueError(f"{name} = {margin!r} must be > 0 and below the effect under test |{effect!r}|")
    return float(margin)


def clusters_for_power(sd, effect, level=0.95, power_target=0.8, most=1_000_000):
    """The fewest clusters n (>= 2) at which the two-sided t-test over n cluster means of spread ``sd``
    (se = sd / sqrt(n), df = n - 1) detects ``effect`` with probability ``power_target``; None when even
    ``most`` clusters do not (or the effect is 0)."""
    if not (sd > 0 and math.isfinite(sd)):
        raise ValueError(f"sd = {sd!r} must be a finite number > 0")
    enough = lambda n: t_power(effect, sd / math.sqrt(n), n - 1, level) >= power_target   # noqa: E731
    if effect == 0 or not enough(most):
        return None
    lo, hi = 1, 2                               # not enough(lo) (one cluster: no test), enough(hi) after doubling
    while not enough(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


_NODES = 96


def tost_power(sd, margin, n, alpha=0.05):
    """TOST's power over ``n`` cluster means of spread ``sd`` to declare equivalence within +-``margin``
    when the true effect is 0, exactly: with d = margin sqrt(n) / sd, t = t_{1 - alpha}(n - 1) and V ~
    chi2(n - 1), both one-sided tests reject when |mean| < margin - t s.e., of probability
    E[max(0, 2 Phi(d - t sqrt(V / (n - 1))) - 1)], integrated over V's quantiles up to where the bracket
    reaches 0 (Gauss-Legendre in V's normal scores, 96 nodes: 1e-8 against adaptive quadrature)."""
    if not (sd > 0 and margin > 0 and n >= 2):
        raise ValueError(f"sd = {sd!r} and margin = {margin!r} must be > 0 and n = {n!r} >= 2")
    df, d = n - 1, margin * math.sqrt(n) / sd
    t = stats.t.ppf(1 - alpha, df)
    # V's quantile u = Phi(z) in normal scores z: from z = -9 (u = 1e-19) to where the 90% interval grows wider
    # than 2 margin (the bracket reaches 0), the integrand is smooth there: Gauss-Legendre
    top = min(float(stats.norm.ppf(stats.chi2.cdf(df * (d / t) ** 2, df))), 9.0)
    if top <= -9:
        return 0.0
    x, w = np.polynomial.legendre.leggauss(_NODES)
    z = -9 + (top + 9) * (x + 1) / 2
    inside = 2 * stats.norm.cdf(d - t * np.sqrt(stats.chi2.ppf(stats.norm.cdf(z), df) / df)) - 1
    return min(1.0, float((top + 9) / 2 * w @ (np.maximum(inside, 0.0) * stats.norm.pdf(z))))


def tost_se_for_power(margin, n, alpha=0.05, power_target=0.8):
    """The largest standard error of a mean over ``n`` clusters at which TOST within +-``margin`` has power
    ``power_target`` at a true effect of 0 (:func:`tost_power`; the power falls as the s.e. grows)."""
    from scipy.optimize import brentq
    if not (margin > 0 and n >= 2 and 0 < power_target < 1):
        raise ValueError(f"margin = {margin!r} must be > 0, n = {n!r} >= 2 and power_target in (0, 1)")
    short = lambda se: tost_power(se * math.sqrt(n), margin, n, alpha) - power_target    # noqa: E731
    return float(brentq(short, 1e-9 * margin, margin, xtol=1e-14 * margin))


def tost_clusters_for_power(sd, margin, alpha=0.05, power_target=0.8, most=10 ** 9):
    """The fewest clusters n (>= 2) at which TOST within +-``margin`` over n cluster means of spread ``sd``
    declares equivalence with probability ``power_target`` at a true effect of 0 (:func:`tost_power`);
    None when even ``most`` do not. The design's answer to 'can this test ever say no effect'."""
    if not (sd > 0 and math.isfinite(sd)):
        raise ValueError(f"sd = {sd!r} must be a finite number > 0")
    enough = lambda n: tost_power(sd, margin, n, alpha) >= power_target              # noqa: E731
    if not enough(most):
        return None
    lo, hi = 1, 2
    while not enough(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def median_lower_bound(values, level=0.95):
    """A distribution-free lower confidence bound on the median of the distribution ``values`` are drawn
    from: their k-th smallest, k the largest with P(Binomial(n, 1/2) <= k - 1) <= 1 - level (the sign
    test's order statistic; its confidence is 1 - P(Binomial(n, 1/2) <= k - 1) >= level). An order statistic
    does not fall when any value rises, so where some values are known only from below (censored at a
    budget) the bound from them is at most the bound from the true values: conservative. Returns (bound, k,
    confidence); (NaN, 0, NaN) when even the smallest value is not a bound at ``level`` (fewer than 5 values
    at 95%)."""
    x = np.sort(np.asarray(values, dtype=float))
    if x.ndim != 1 or np.isnan(x).any():
        raise ValueError("values must be a 1-d array of numbers without NaN")
    if not 0 < level < 1:
        raise ValueError(f"level = {level!r} must lie in (0, 1)")
    k = 0
    while k < x.size and stats.binom.cdf(k, x.size, 0.5) <= 1 - level:
        k += 1
    if k == 0:
        return math.nan, 0, math.nan
    return float(x[k - 1]), k, float(stats.binom.sf(k - 1, x.size, 0.5))
